"""The block's outputs of the arithmetic transformers, and captures that stop the forward pass early.

For every norm placement, one capture of every site the model provides, checked against the model's
own definitions in float64: attn_out and mlp_out are what the block adds to the residual stream
(Pre-Norm, QKV-Norm, no norm: the residual differences; Post-Norm: the norms' inputs less the
stream), z is pattern . v and, through w_o and b_o, attn_out; mlp_in and mlp_norm_scale are the
feed-forward norm's output and factor. The transformers families are checked through stores in
test_extract_families.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from orthosphere.data import TokenLoader
from orthosphere.errors import JobMismatchError
from orthosphere.extract.adapters import adapter_for
from orthosphere.extract.job import ExtractJob, run_job
from orthosphere.extract.model import ConfigError, load_model
from orthosphere.store import format_info, info, open_store, validate
from tests.test_extract_models import write_arithmetic_model

BLOCK_SITES = ("z", "attn_out", "mlp_in", "mlp_norm_scale", "mlp_out")


def captured(model, sites, layers=None, stop_early=False):
    """(logits, site -> float64 array (batch, layer, ...)) of one pass over fixed tokens."""
    adapter = adapter_for(model)
    tokens = torch.randint(0, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), adapter.capture(sites, layers, stop_early=stop_early) as recording:
        logits = adapter.forward(tokens)
        values = recording.take()
    return logits, {site: value.double().numpy() for site, value in values.items()}


def close(found, expected, scale_of):
    """float32 model values against a float64 reconstruction, to 1e-5 of their magnitude."""
    scale = max(1.0, float(np.abs(scale_of).max()))
    np.testing.assert_allclose(found, expected, rtol=0, atol=1e-5 * scale)


def apply(module, x):
    with torch.no_grad():
        return module.double()(torch.from_numpy(x)).numpy()


def factor(x, kind, eps):
    if kind == "layer":
        x = x - x.mean(axis=-1, keepdims=True)
    return 1 / np.sqrt((x**2).mean(axis=-1) + eps)


@pytest.mark.parametrize("placement", ["pre", "post", "qkv", "none"])
def test_block_outputs_of_every_placement_are_exact(tmp_path, placement):
    model = load_model(write_arithmetic_model(tmp_path / "model", placement=placement))
    adapter = adapter_for(model)
    assert set(BLOCK_SITES) - set(adapter.sites) == ({"mlp_in"} if placement == "post" else set())
    _, values = captured(model, ["resid_pre", "resid_mid", "resid_post", "v", "pattern",
                                 *(site for site in BLOCK_SITES if site in adapter.sites)])
    reference = load_model(tmp_path / "model")
    for layer, block in enumerate(reference.blocks):
        pre, mid, post, attn_out, mlp_out = (values[site][:, layer] for site in
                                             ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"))
        if placement == "post":
            close(mid, apply(block.norm_attn, pre + attn_out), mid)
            close(post, apply(block.norm_ff, mid + mlp_out), post)
            read = pre + attn_out
        else:
            close(attn_out, mid - pre, pre)
            close(mlp_out, post - mid, mid)
            close(values["mlp_in"][:, layer], apply(block.norm_ff, mid), mid)
            read = mid
        np.testing.assert_allclose(values["mlp_norm_scale"][:, layer], factor(read, model.config.norm_type,
                                                                              model.config.norm_eps), rtol=1e-5)
        z = np.einsum("bhqk,bkhd->bqhd", values["pattern"][:, layer], values["v"][:, layer])
        close(values["z"][:, layer], z, z)
        weights = adapter.head_weights(layer)
        projected = np.einsum("bqhd,hdm->bqm", values["z"][:, layer], weights["w_o"].double().numpy())
        close(attn_out, projected + weights["b_o"].double().numpy(), attn_out)


def test_a_post_norm_model_refuses_mlp_in_saying_it_is_resid_mid(tmp_path):
    adapter = adapter_for(load_model(write_arithmetic_model(tmp_path / "model", placement="post")))
    with pytest.raises(ConfigError, match=r"\['mlp_in'\] cannot be provided by this arithmetic model.*"
                                          r"mlp_in equals resid_mid: in this Post-Norm model"):
        adapter.check_sites(["mlp_in"])


def test_a_capture_that_stops_early_records_the_same_values_and_runs_no_later_block(tmp_path):
    model = load_model(write_arithmetic_model(tmp_path / "model", n_layers=4))
    ran = []
    for index, block in enumerate(model.blocks):
        block.register_forward_hook(lambda module, args, output, index=index: ran.append(index))
    sites = ["resid_pre", "q", "attn_out", "mlp_out", "resid_post"]
    full_logits, full = captured(model, sites, layers=[0, 1])
    assert full_logits is not None and ran == [0, 1, 2, 3]
    ran.clear()
    logits, early = captured(model, sites, layers=[0, 1], stop_early=True)
    assert logits is None and ran == [0, 1]
    for site in sites:
        np.testing.assert_array_equal(early[site], full[site])
    ran.clear()
    logits, _ = captured(model, sites, layers=[1, 3], stop_early=True)
    assert logits is not None and ran == [0, 1, 2, 3]  # the last layer is asked for: the whole pass runs


def test_a_job_without_predictions_stops_early_and_stores_the_same_activations(tmp_path):
    """pred=False: the store holds no pred (and says why), its activations are bitwise those of a job
    that ran the whole model, and resuming it with predictions is another job."""
    model_dir = write_arithmetic_model(tmp_path / "model", n_layers=3)
    stores = {}
    for pred in (True, False):
        out = str(tmp_path / f"pred-{pred}.zarr")
        run_job(ExtractJob(model=str(model_dir), task="arithmetic:split=test,seed=2", out=out, n_samples=6, layers=[0, 1],
                           sites=["resid_post", "q", "mlp_out"], pred=pred, batch_size=4, device="cpu"), progress=False)
        stores[pred] = open_store(out)
    assert "pred" in stores[True] and "pred" not in stores[False]
    assert validate(str(tmp_path / "pred-False.zarr")) == []
    for site in ("resid_post", "q", "mlp_out"):
        np.testing.assert_array_equal(stores[False][site].values, stores[True][site].values)
    assert "the job left the predictions out" in format_info(info(str(tmp_path / "pred-False.zarr")))
    with pytest.raises(JobMismatchError, match="its pred is False, this job.s is True"):
        run_job(ExtractJob(model=str(model_dir), task="arithmetic:split=test,seed=2", out=str(tmp_path / "pred-False.zarr"),
                           n_samples=6, layers=[0, 1], sites=["resid_post", "q", "mlp_out"], mode="resume", device="cpu"),
                progress=False)


def test_the_token_loader_reads_the_block_outputs(tmp_path):
    """attn_out and mlp_out of one layer side by side, as an SAE trainer reads them: every analysed
    token's stored rows, once an epoch."""
    model_dir = write_arithmetic_model(tmp_path / "model")
    out = str(tmp_path / "store.zarr")
    run_job(ExtractJob(model=str(model_dir), task="arithmetic:split=test,seed=5", out=out, n_samples=6,
                       sites=["attn_out", "mlp_out", "z"], batch_size=4, device="cpu"), progress=False)
    store = open_store(out)
    loader = TokenLoader(out, [("attn_out", 1), ("mlp_out", 1)], batch_size=8, buffer_tokens=1024, seed=0)
    delivered = torch.cat(list(loader)).numpy()
    valid = store["valid"].values & (np.cumsum(store["valid"].values, axis=1) != 1)  # no start tokens
    stored = np.stack([store[site].sel(layer=1).values[valid] for site in ("attn_out", "mlp_out")], axis=1)
    assert delivered.shape == stored.shape
    np.testing.assert_array_equal(np.sort(delivered[:, 0, 0]), np.sort(stored[:, 0, 0]))
    np.testing.assert_array_equal(np.sort(delivered[:, 1, 0]), np.sort(stored[:, 1, 0]))
    assert TokenLoader(out, [("z", 0)], batch_size=8, buffer_tokens=1024, seed=0).width == 32  # 4 heads of 8
