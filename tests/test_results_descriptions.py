"""Every data variable an analysis writes says what it is: a non-empty ``description`` attribute, so that
results opened with plain xarray explain themselves."""
from __future__ import annotations

import numpy as np

from orthosphere.analyze import ANALYSES, open_for_analysis
from orthosphere.analyze.multiplicity import STATEMENTS
from orthosphere.analyze.results import configure, run_analyses
from orthosphere.store import create_store
from tests.synthetic import WEIGHT_SHAPES

N_SAMPLES, N_LAYERS, N_POS, D_MODEL, N_HEADS, D_HEAD = 32, 2, 6, 8, 2, 4
DESCRIBED_COORDS = {"replay": ("definition", "level", "instances", "max_attention_bin", "curve_level", "bound"),
                    "subspaces": ("other", "bound", "claim"), "spheres": ("other", "bound", "sphere_claim"),
                    "norms": ("quantile", "ratio")}
"""Coordinates whose meaning is not evident from their name and values."""


def full_store(url: str) -> str:
    """A small store holding what every analysis reads: predictions, the residual sites and their norm
    scale, q, k, v, two planted factors and the weights (the heads' read subspaces, the messages)."""
    rng = np.random.default_rng(0)
    labels = {"alpha": rng.integers(0, 3, (N_SAMPLES, N_POS)), "beta": rng.integers(0, 3, (N_SAMPLES, N_POS))}
    effects = rng.normal(size=(2, 3, D_MODEL)) * 2
    resid = effects[0][labels["alpha"]] + effects[1][labels["beta"]] + rng.normal(size=(N_SAMPLES, N_POS, D_MODEL))
    resid = np.stack([resid, 1.5 * resid], axis=1)
    heads = (N_SAMPLES, N_LAYERS, N_POS, N_HEADS, D_HEAD)
    sites = {"resid_pre": resid, "resid_post": resid[:, ::-1] + 0.1, "norm_scale": rng.uniform(0.5, 2, resid.shape[:3]),
             "q": rng.normal(size=heads) * 3, "k": rng.normal(size=heads) * 3, "v": rng.normal(size=heads)}
    model = {"family": "synthetic", "n_layers": N_LAYERS, "d_model": D_MODEL, "n_heads": N_HEADS,
             "n_kv_heads": N_HEADS, "d_head": D_HEAD, "attn_scale": 1 / np.sqrt(D_HEAD), "causal": True,
             "norm_placement": "none", "norm_type": "layer"}
    writer = create_store(url, model=model, task={"name": "planted"}, n_samples=N_SAMPLES, n_pos=N_POS,
                          sites=tuple(sites), labels={name: "int16" for name in labels}, samples_per_chunk=16)
    valid = np.ones((N_SAMPLES, N_POS), bool)
    scored = np.zeros((N_SAMPLES, N_POS), bool)
    scored[:, -2:] = True
    target = rng.integers(0, 5, (N_SAMPLES, N_POS)).astype("int32")
    pred = np.where(rng.random((N_SAMPLES, N_POS)) < 0.7, target, 0).astype("int32")
    writer.write(0, {"valid": valid, "scored": scored, "pred": pred, "target": target,
                     **{name: np.asarray(value, "float32") for name, value in sites.items()}, **labels})
    dims = {"layer": N_LAYERS, "head": N_HEADS, "kv_head": N_HEADS, "d_model": D_MODEL, "d_head": D_HEAD}
    writer.write_weights({name: rng.normal(size=tuple(dims[d] for d in shape)).astype("float32")
                          for name, shape in WEIGHT_SHAPES.items()})
    writer.mark_shard_complete(0)
    writer.finish()
    return url


def test_every_result_variable_has_a_description(tmp_path):
    dataset = open_for_analysis(full_store(str(tmp_path / "store.zarr")))
    options = {"factors": ["alpha", "beta"], "replay": {"n_draws": 2, "n_bootstrap": 20, "levels": [0.05, 0.3]},
               "norm_geometry": {"interval_draws": 20}}
    results = run_analyses(dataset, configure(ANALYSES.values(), options))
    assert set(results) == set(ANALYSES)
    missing, unstated, counted = [], [], 0
    for name, tree in results.items():
        for node in tree.subtree:
            group = node.to_dataset(inherit=False)
            where = f"/{name}{node.path.rstrip('/')}"
            for variable_name, variable in group.data_vars.items():
                counted += 1
                description = str(variable.attrs.get("description", "")).strip()
                if not description:
                    missing.append(f"{where} {variable_name}")
                elif variable_name in STATEMENTS.get(name, {}) and "; multiplicity: " not in description:
                    unstated.append(f"{where} {variable_name}")  # the multiplicity statement alone: no definition
            missing += [f"{where} coordinate {coord}" for coord in DESCRIBED_COORDS.get(name, ())
                        if coord in group.coords and not group[coord].attrs.get("description")]
    assert counted > 100
    assert not missing, f"{len(missing)} without a description ({counted} data variables checked): {missing}"
    assert not unstated, f"descriptions holding only their multiplicity statement, no definition: {unstated}"
