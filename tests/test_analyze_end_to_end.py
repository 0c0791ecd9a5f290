"""End to end: a store extracted from a shipped checkpoint goes through every analysis; the
attention recomputed from the stored q, k equals the model's own, and the results agree with
direct numpy computations on the same tensors."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from scipy.linalg import subspace_angles
from sklearn.covariance import OAS

import orthosphere.workflows
from orthosphere.analyze import analyze, norm_spread, open_for_analysis, open_results, store_attention
from tests.reference import assert_attention_close
from tests.synthetic import weighted_band

MODEL = Path(orthosphere.workflows.__file__).parent / "models" / "pre"
FACTORS = ["digit_value[role=digit]", "operand[role=digit]", "pos"]


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    if not (MODEL / "model.safetensors").exists():
        pytest.skip("the shipped checkpoints (workflows/models/) are not there yet")
    from orthosphere.extract.job import ExtractJob, run_job

    url = str(tmp_path_factory.mktemp("e2e") / "store.zarr")
    run_job(ExtractJob(model=str(MODEL), task="arithmetic:split=test,seed=0", out=url, n_samples=96,
                       sites=("resid_pre", "resid_post", "attn_in", "q", "k", "v", "pattern"), device="cpu",
                       samples_per_chunk=32), progress=False)
    return url


@pytest.mark.slow
def test_every_analysis_runs_on_an_extracted_store(extracted, tmp_path):
    out = tmp_path / "results.zarr"
    analyze(extracted, out, analyses=["norms", "subspaces", "spheres", "neighbours"], factors=FACTORS)
    results = open_results(out)
    dataset = open_for_analysis(extracted)
    valid = dataset["valid"].values
    counted = valid & (np.cumsum(valid, axis=1) > 1)  # without each start token

    for site in ("resid_pre", "attn_in", "q", "k", "v"):
        band = results[f"norms/{site}"]["band"].values
        assert band.shape == (dataset.sizes["layer"], dataset.sizes["head"]) and np.all(band > 0)
    uniform = analyze(extracted, analyses=["norms"], sites=["resid_pre"], weight_by_attention=False)
    norms = np.linalg.norm(dataset["resid_pre"].values, axis=-1)  # (sample, layer, pos)
    for layer in range(dataset.sizes["layer"]):
        expected = weighted_band(norms[:, layer], counted)
        assert uniform["norms/resid_pre"]["band"].values[layer] == pytest.approx(expected, abs=0.005)

    subspaces = results["subspaces"]
    basis = subspaces["basis"].sel(factor="digit_value[role=digit]").values
    for layer in range(dataset.sizes["layer"]):
        rank = int(subspaces["subspace_rank"].sel(layer=layer, factor="digit_value[role=digit]"))
        assert 1 <= rank <= 9
        np.testing.assert_allclose(basis[layer, :, :rank].T @ basis[layer, :, :rank], np.eye(rank), atol=1e-8)
    for layer in range(dataset.sizes["layer"]):  # principal angles against scipy's, from the stored bases
        bases = [subspaces["basis"].sel(layer=layer, factor=f).values[:, :int(subspaces["subspace_rank"].sel(layer=layer, factor=f))]
                 for f in ("digit_value[role=digit]", "operand[role=digit]")]
        expected = np.sort(np.degrees(subspace_angles(*bases)))
        found = subspaces["angles"].sel(layer=layer, factor="digit_value[role=digit]", other="operand[role=digit]").values
        np.testing.assert_allclose(np.sort(found[np.isfinite(found)]), expected, atol=1e-6)
    assert subspaces["n_classes"].sel(factor="digit_value[role=digit]").item() == 10

    spheres = results["spheres"]
    layer = 1  # the joint fit by brute force: role intercepts and every factor's one-hot columns, least squares
    effects, counts, mean, residuals = _joint_effects(dataset, counted, layer, "digit_value", "digit")
    rank = int(subspaces["subspace_rank"].sel(layer=layer, factor=FACTORS[0]))
    weighted = np.sqrt(counts)[:, None] * effects
    whitening, tolerance = np.eye(weighted.shape[1]), 1e-3  # degrees
    if subspaces["whitened"].sel(layer=layer).item():  # the residuals' OAS covariance^(-1/2), from X'X summed in float32
        values, vectors = np.linalg.eigh(OAS(assume_centered=True).fit(residuals).covariance_)
        whitening, tolerance = (vectors / np.sqrt(values)) @ vectors.T, 1e-2
    right = np.linalg.svd(weighted @ whitening, full_matrices=False)[2][:rank].T
    expected_basis = np.linalg.solve(whitening, right)
    found_basis = subspaces["basis"].sel(layer=layer, factor=FACTORS[0]).values[:, :rank]
    assert np.degrees(subspace_angles(expected_basis, found_basis)).max() < tolerance
    radii = np.linalg.norm((mean + effects) @ found_basis, axis=1)
    found = spheres["class_radius"].sel(layer=layer, factor=FACTORS[0]).values[:10]
    np.testing.assert_allclose(found, radii, rtol=0.02)  # less each class effect's noise variance
    assert np.all(found <= radii + 1e-6 * radii.max())
    assert spheres["sphere"].values.size and set(spheres["sphere"].values.ravel()) <= {"on sphere", "off sphere", "undetermined", "no structure"}
    xr_min = spheres["min_angle"].values
    np.testing.assert_allclose(xr_min, subspaces["min_angle"].values, equal_nan=True)

    pre, post = dataset["resid_pre"].values, dataset["resid_post"].values
    cosine = np.einsum("slpd,slpd->slp", pre, post) / (np.linalg.norm(pre, axis=-1) * np.linalg.norm(post, axis=-1))
    step = np.degrees(np.arccos(np.clip(cosine, -1, 1)))
    expected_step = [step[:, layer][counted].mean() for layer in range(dataset.sizes["layer"])]
    np.testing.assert_allclose(results["neighbours"]["angular_step"].values, expected_step, rtol=1e-4)


def test_attention_recomputed_from_stored_q_k_is_the_models_own(extracted):
    dataset = open_for_analysis(extracted)
    recomputed = store_attention(dataset.drop_vars("pattern")).values
    model = dataset["pattern"].values
    valid = dataset["valid"].values
    valid_queries = valid[:, None, :, None]
    q, k = dataset["q"].values, dataset["k"].values
    scale, causal = dataset.attrs["model"]["attn_scale"], dataset.attrs["model"]["causal"]
    for layer in range(dataset.sizes["layer"]):  # both float32 patterns against the float64 one
        for pattern in (recomputed[:, layer], model[:, layer]):
            assert_attention_close(pattern, q[:, layer], k[:, layer], valid, attn_scale=scale, causal=causal,
                                   where=valid_queries)
    from_pattern = norm_spread(dataset, sites=["k"])["k"]
    from_q_k = norm_spread(dataset.drop_vars("pattern"), sites=["k"])["k"]
    assert from_pattern.attrs["attention_source"] == "stored pattern"
    assert from_q_k.attrs["attention_source"] == "recomputed from q, k"
    np.testing.assert_allclose(from_q_k["band"].values, from_pattern["band"].values, rtol=1e-4)


def _joint_effects(dataset, counted, layer: int, label: str, role: str):
    """Centred effects (class, d) of `label`[role=...] from one least-squares fit of every factor of FACTORS
    with one intercept per (pattern, role), its class counts, the mean of its tokens and every token's
    residual (token, d)."""
    x = dataset["resid_pre"].sel(layer=layer).values.astype("float64")[counted]
    roles = np.array(dataset["role"].values[counted].tolist())
    digit = roles == role
    columns = {"cell": np.where(digit, "digit", np.char.add("other:", roles))}
    for name in ("digit_value", "operand"):
        columns[name] = np.where(digit, np.array(dataset[name].values[counted].tolist()).astype(str), "")
    columns["pos"] = np.broadcast_to(dataset["pos"].values, counted.shape)[counted].astype(str)
    blocks = []
    for values in columns.values():
        classes = np.unique(values[values != ""])
        blocks.append((values[:, None] == classes[None]).astype(float))
    design = np.hstack(blocks)
    theta = np.linalg.pinv(design) @ x
    sizes = np.cumsum([0] + [block.shape[1] for block in blocks])
    factor = list(columns).index(label)
    raw = theta[sizes[factor]: sizes[factor + 1]]
    counts = blocks[factor].sum(axis=0)
    effects = raw - counts @ raw / counts.sum()
    return effects, counts, x[digit].mean(axis=0), x - design @ theta
