"""The test of record for the arithmetic family and GGUF files, and captures that run concurrently.

A tiny model runs through `extract` into a float32 store; then, from the store alone,
softmax(q . k * attn_scale + mask) must equal the model's attention weights (transformers' eager
attention with output_attentions, or the arithmetic model's own softmax) to 1e-5, resid_post of
layer l must equal resid_pre of layer l + 1, and the stored maps must rebuild q, k, v from attn_in
and the attention output from the pattern and v. (Every transformers family: test_extract_families.py.)
"""
from __future__ import annotations

import contextlib
import gc
import threading
import weakref

import numpy as np
import pytest
import torch

from orthosphere.extract.adapters import adapter_for
from orthosphere.extract.job import ExtractJob, run_job
from orthosphere.extract.model import ConfigError, load_model
from orthosphere.store import open_store
from tests.test_extract_models import (
    gguf_model,
    hf_model,
    write_arithmetic_model,
    write_gguf,
    write_hf_model,
    write_text,
)

ALL_SITES = ("resid_pre", "resid_mid", "resid_post", "attn_in", "q", "k", "v", "pattern")
TOLERANCE = 1e-5


def run(tmp_path, model, task, **options):
    """Extract into a fresh float32 store with every site; return it loaded in memory."""
    options = {"n_samples": None, "sites": ALL_SITES, "dtype": "float32", "batch_size": 3, **options}
    out = tmp_path / f"store-{len(list(tmp_path.glob('store-*')))}.zarr"
    run_job(ExtractJob(model=str(model), task=task, out=str(out), device="cpu", **options), progress=False)
    return open_store(str(out)).load()


def recomputed_pattern(store) -> np.ndarray:
    """softmax(q . k * scale + mask) from the stored q, k and valid alone (sample, layer, head, q, k)."""
    model = store.attrs["model"]
    group = model["n_heads"] // model["n_kv_heads"]
    q = store["q"].values.astype(np.float64)
    k = np.repeat(store["k"].values.astype(np.float64), group, axis=3)
    scores = np.einsum("slqhd,slkhd->slhqk", q, k) * model["attn_scale"]
    valid = store["valid"].values
    n_pos = valid.shape[1]
    allowed = np.broadcast_to(valid[:, None, None, None, :], scores.shape).copy()
    if model["causal"]:
        allowed &= np.tril(np.ones((n_pos, n_pos), dtype=bool))
    scores = np.where(allowed, scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    return weights / weights.sum(axis=-1, keepdims=True)


def on_valid_queries(store, values: np.ndarray) -> np.ndarray:
    """Zero the rows of padding queries (sample, layer, head, qpos, kpos)."""
    return values * store["valid"].values[:, None, None, :, None]


def check_store_against(store, reference_pattern: np.ndarray, reference_logits: np.ndarray):
    """The test of record, and the consistency of every stored site with the stored maps."""
    recomputed = recomputed_pattern(store)
    assert np.abs(on_valid_queries(store, recomputed - reference_pattern)).max() < TOLERANCE
    assert np.abs(on_valid_queries(store, store["pattern"].values - reference_pattern)).max() < TOLERANCE
    resid_pre, resid_post = store["resid_pre"].values, store["resid_post"].values
    np.testing.assert_array_equal(resid_post[:, :-1], resid_pre[:, 1:])
    valid = store["valid"].values
    np.testing.assert_array_equal(store["pred"].values[valid], reference_logits.argmax(-1)[valid])

    model = store.attrs["model"]
    attn_in = store["attn_in"].values
    group = model["n_heads"] // model["n_kv_heads"]
    if model.get("norm_placement") != "qkv":
        v = np.einsum("slpm,lhmd->slphd", attn_in, store["w_v"].values) + store["b_v"].values[None, :, None]
        np.testing.assert_allclose(v, store["v"].values, atol=1e-5)
        if model.get("positions") != "rotary":
            q = np.einsum("slpm,lhmd->slphd", attn_in, store["w_q"].values) + store["b_q"].values[None, :, None]
            np.testing.assert_allclose(q, store["q"].values, atol=1e-5)
    if model["norm_placement"] != "post":  # Pre-Norm: resid_mid = resid_pre + sum_h (pattern v) W_O + b_O
        v_per_head = np.repeat(store["v"].values, group, axis=3)
        z = np.einsum("slhqk,slkhd->slqhd", store["pattern"].values, v_per_head)
        attention_out = np.einsum("slqhd,lhdm->slqm", z, store["w_o"].values) + store["b_o"].values[None, :, None]
        np.testing.assert_allclose(store["resid_mid"].values - resid_pre, attention_out, atol=1e-5)


def eager_reference(model, store):
    """transformers' eager attention weights (sample, layer, head, q, k) and logits on the stored tokens."""
    model.set_attn_implementation("eager")
    tokens = torch.from_numpy(store["tokens"].values).long()
    valid = torch.from_numpy(store["valid"].values).long()
    with torch.no_grad():
        output = model(input_ids=tokens, attention_mask=valid, output_attentions=True)
    return torch.stack(output.attentions, dim=1).numpy(), output.logits.numpy()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.slow
def test_gguf_attention_is_reproduced_from_the_store(tmp_path, family):
    reference = gguf_model(family, seed=3)
    path = write_gguf(tmp_path / "tiny.gguf", reference)
    text = write_text(tmp_path / "text.txt", [" the cat", " a the cat sat", " cat"])
    store = run(tmp_path, path, f"text:path={text}")
    assert store.attrs["model"]["format"] == "gguf"
    pattern, logits = eager_reference(reference, store)
    check_store_against(store, pattern, logits)


def arithmetic_reference(model_dir, store):
    """The arithmetic model's own softmax (read at its pattern hook) and logits."""
    model = load_model(model_dir)
    patterns = []
    handles = [block.attn.hook_pattern.register_forward_hook(lambda m, a, out: patterns.append(out)) for block in model.blocks]
    with torch.no_grad():
        logits = model(torch.from_numpy(store["tokens"].values).long())
    for handle in handles:
        handle.remove()
    return torch.stack(patterns, dim=1).numpy(), logits.numpy()


@pytest.mark.parametrize("placement,norm_type", [("none", "layer"), ("pre", "layer"), ("post", "layer"), ("qkv", "rms")])
@pytest.mark.slow
def test_arithmetic_attention_is_reproduced_from_the_store(tmp_path, placement, norm_type):
    model_dir = write_arithmetic_model(tmp_path / "model", placement=placement, norm_type=norm_type)
    store = run(tmp_path, model_dir, "arithmetic:split=test,seed=4", n_samples=7)
    assert store.attrs["task"]["split"] == "test" and set(np.unique(store["role"].values)) >= {"digit", "answer"}
    pattern, logits = arithmetic_reference(model_dir, store)
    check_store_against(store, pattern, logits)


@pytest.mark.slow
def test_float16_store_holds_the_float32_values_rounded(tmp_path):
    model_dir = write_hf_model(tmp_path / "llama", "llama")
    text = write_text(tmp_path / "text.txt")
    exact = run(tmp_path, model_dir, f"text:path={text}")
    half = run(tmp_path, model_dir, f"text:path={text}", dtype="float16")
    for site in ALL_SITES:
        assert half[site].dtype == np.float16
        np.testing.assert_array_equal(half[site].values, exact[site].values.astype(np.float16))


@pytest.mark.slow
def test_layer_subset_and_site_subset(tmp_path):
    model_dir = write_arithmetic_model(tmp_path / "model", n_layers=3)
    full = run(tmp_path, model_dir, "arithmetic", n_samples=4)
    part = run(tmp_path, model_dir, "arithmetic", n_samples=4, sites=("k", "resid_post"), layers=(0, 2))
    assert list(part["layer"].values) == [0, 2] and "q" not in part and "pattern" not in part
    np.testing.assert_array_equal(part["k"].values, full["k"].values[:, [0, 2]])
    np.testing.assert_array_equal(part["resid_post"].values, full["resid_post"].values[:, [0, 2]])
    np.testing.assert_array_equal(part["w_q"].values, full["w_q"].values[[0, 2]])


# --- the adapter's edit of q, k, v ----------------------------------------------------------------


def adapters(tmp_path):
    """The transformers families' edits are tested with every family in test_extract_families.py."""
    yield adapter_for(hf_model("llama"))
    yield adapter_for(load_model(write_arithmetic_model(tmp_path / "pre", "pre")))
    yield adapter_for(load_model(write_arithmetic_model(tmp_path / "qkv", "qkv")))


def test_edit_qkv_changes_the_attention_as_it_enters_the_score(tmp_path):
    tokens = torch.tensor([[1, 5, 7, 2, 9, 3, 4, 6], [2, 2, 8, 6, 5, 3, 1, 1]])
    valid = torch.ones_like(tokens, dtype=torch.bool)
    for adapter in adapters(tmp_path):
        with torch.no_grad(), adapter.capture(["q", "k", "v", "pattern", "resid_pre", "resid_mid"]) as recording:
            adapter.forward(tokens, valid)
            plain = recording.take()
            edit = lambda layer, q, k, v: (q * 3.0, k, v * 2.0) if layer == 1 else (q, k, v)  # noqa: E731
            with adapter.edit_qkv(edit):
                adapter.forward(tokens, valid)
                edited = recording.take()
            adapter.forward(tokens, valid)
            after = recording.take()
        family = adapter.family
        torch.testing.assert_close(edited["q"][:, 1], 3.0 * plain["q"][:, 1], msg=family)
        torch.testing.assert_close(edited["v"][:, 1], 2.0 * plain["v"][:, 1], msg=family)
        torch.testing.assert_close(edited["q"][:, 0], plain["q"][:, 0], msg=family)
        torch.testing.assert_close(after["q"], plain["q"], msg=family)  # the edit ends with its block
        description = adapter.describe()
        group = description["n_heads"] // description["n_kv_heads"]
        k = plain["k"][:, 1].repeat_interleave(group, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", 3.0 * plain["q"][:, 1], k) * description["attn_scale"]
        if description["causal"]:
            scores = scores.masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), float("-inf"))
        torch.testing.assert_close(edited["pattern"][:, 1], scores.softmax(-1), atol=1e-5, rtol=0, msg=family)
        if description["norm_placement"] != "post":  # the message W_O v doubles with v
            weights = adapter.head_weights(1)
            def message(r, b_o=weights["b_o"]):
                return r["resid_mid"][:, 1] - r["resid_pre"][:, 1] - b_o
            z = torch.einsum("bhqk,bkhd->bqhd", edited["pattern"][:, 1], plain["v"][:, 1].repeat_interleave(group, dim=2))
            expected = 2.0 * torch.einsum("bqhd,hdm->bqm", z, weights["w_o"])
            torch.testing.assert_close(message(edited), expected, atol=1e-5, rtol=1e-4, msg=family)


def test_capture_refuses_sites_and_layers_the_model_lacks(tmp_path):
    adapter = adapter_for(load_model(write_arithmetic_model(tmp_path / "model")))
    with pytest.raises(ConfigError, match=r"site\(s\) \['mlp_hidden'\] cannot be provided.*expected one or more of"):
        with adapter.capture(["q", "mlp_hidden"]):
            pass
    with pytest.raises(ConfigError, match=r"layer\(s\) \[2\] out of range: the model has 2 layers"):
        with adapter.capture(["q"], layers=[0, 2]):
            pass


# --- captures in concurrent threads ----------------------------------------------------------------


def concurrent_models(tmp_path):
    from tests.tiny_families import tiny_model

    yield adapter_for(load_model(write_arithmetic_model(tmp_path / "qkv", "qkv")))
    yield adapter_for(tiny_model("qwen3"))
    yield adapter_for(tiny_model("bloom"))


@pytest.mark.slow
def test_concurrent_captures_on_one_model_stay_apart(tmp_path):
    """Two threads capture on one model at once (as two shards on one multi-threaded Dask worker),
    one of them editing q: each gets exactly what it gets alone."""
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(1, 16, (3, 9), generator=generator) for _ in range(2)]
    edits = [None, lambda layer, q, k, v: (q * 1.5, k, v)]

    def run(adapter, thread, barrier=None):
        with torch.no_grad(), adapter.capture(["resid_pre", "q", "k", "v", "pattern"]) as recording:
            with adapter.edit_qkv(edits[thread]) if edits[thread] else contextlib.nullcontext():
                if barrier is not None:
                    barrier.wait()
                adapter.forward(batches[thread], torch.ones_like(batches[thread], dtype=torch.bool))
            return recording.take()

    for adapter in concurrent_models(tmp_path):
        alone = [run(adapter, thread) for thread in range(2)]
        barrier, found, failures = threading.Barrier(2), {0: [], 1: []}, []

        def worker(thread, adapter=adapter, barrier=barrier, found=found, failures=failures):
            try:
                for _ in range(6):
                    found[thread].append(run(adapter, thread, barrier))
            except BaseException as error:  # handed to the main thread
                failures.append(error)
                barrier.abort()

        threads = [threading.Thread(target=worker, args=(thread,)) for thread in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not failures, failures
        for thread in range(2):
            for result in found[thread]:
                for site, values in alone[thread].items():
                    torch.testing.assert_close(result[site], values, rtol=1e-6, atol=1e-6, msg=f"{adapter.family} {site}")
        assert not torch.allclose(alone[1]["q"], alone[0]["q"])  # the threads' results do differ


@pytest.mark.slow
def test_one_adapter_per_model_and_a_forward_outside_a_capture_records_nothing(tmp_path):
    model = load_model(write_arithmetic_model(tmp_path / "pre", "pre"))
    adapter = adapter_for(model)
    assert adapter_for(model) is adapter  # its hooks are installed once
    tokens = torch.randint(1, 16, (2, 7))
    with adapter.capture(["q"]) as recording:
        pass
    with torch.no_grad():
        adapter.forward(tokens)
    with pytest.raises(RuntimeError, match="did not reach sites"):
        recording.take()
    gone = weakref.ref(model)
    del model, adapter
    gc.collect()
    assert gone() is None  # the adapter does not keep its model alive


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_capture_buffers_are_layer_major_and_start_aligned_for_direct_writes(dtype):
    from orthosphere.extract.recording import new_buffer
    from orthosphere.store.stream import DIRECT_ALIGNMENT

    for _ in range(3):
        buffer = new_buffer((5, 3, 7, 2), dtype, pin_memory=False)
        assert buffer.shape == (5, 3, 7, 2) and buffer.dtype == dtype
        assert buffer.data_ptr() % DIRECT_ALIGNMENT == 0
        assert buffer.stride() == (7 * 2, 5 * 7 * 2, 2, 1)  # one layer of the batch is contiguous
        buffer.copy_(torch.arange(5 * 3 * 7 * 2, dtype=torch.float32).reshape(5, 3, 7, 2))
        assert buffer[4, 2, 6, 1].item() == 5 * 3 * 7 * 2 - 1
