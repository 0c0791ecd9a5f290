"""Attention patterns from a store: the stored `pattern`, or recomputed from the stored q and k.

`attention_from_qk` is the model's own attention for stored q, k (they are stored as they enter
the score): softmax(q . k * attn_scale) over the keys a query may see (earlier or equal
positions when the model is causal, and only valid tokens). `store_attention` gives it lazily for
a whole store, one block of samples at a time, never the whole pattern in memory.
"""
from __future__ import annotations

import dask.array as da
import numpy as np
import xarray as xr

from .blocks import single_block
from .errors import AnalysisError
from .inputs import align, check_layers, require_site, store_url


def attention_from_qk(q: np.ndarray, k: np.ndarray, valid: np.ndarray, *, attn_scale: float, causal: bool) -> np.ndarray:
    """Pattern (..., head, qpos, kpos), float32 as in the model, from q (..., pos, head, d_head),
    k (..., pos, kv_head, d_head) and valid (..., pos); head h reads kv_head h // (n_heads // n_kv_heads).
    A query that may see no key (none valid) gets an all-zero row."""
    group = q.shape[-2] // k.shape[-2]
    queries = np.swapaxes(np.asarray(q, dtype="float32"), -2, -3)
    keys = np.repeat(np.swapaxes(np.asarray(k, dtype="float32"), -2, -3), group, axis=-3)
    scores = queries @ np.swapaxes(keys, -1, -2)
    scores *= np.float32(attn_scale)
    allowed = np.asarray(valid, dtype=bool)[..., None, None, :]
    if causal:
        n_pos = scores.shape[-1]
        allowed = allowed & np.tril(np.ones((n_pos, n_pos), dtype=bool))
    np.copyto(scores, -np.inf, where=~allowed)
    peak = scores.max(axis=-1, keepdims=True)
    scores -= np.where(np.isneginf(peak), 0, peak)
    np.exp(scores, out=scores)
    total = scores.sum(axis=-1, keepdims=True)
    return np.divide(scores, total, out=scores, where=total > 0)


def attention_parameters(dataset: xr.Dataset) -> dict:
    """attn_scale and causal from the store's model description (needed to recompute attention)."""
    model = dataset.attrs.get("model", {})
    missing = [key for key in ("attn_scale", "causal") if key not in model]
    if missing:
        raise AnalysisError(
            f"store {store_url(dataset)} has no stored pattern and its model description lacks "
            f"{missing}, which recomputing attention from q and k needs: extract with the pattern "
            "site, or with a model description that gives attn_scale and causal"
        )
    return {"attn_scale": float(model["attn_scale"]), "causal": bool(model["causal"])}


def attention_source(dataset: xr.Dataset) -> str:
    """"pattern" when the store holds it, else "q,k" (recomputed); an error when it holds neither."""
    if "pattern" in dataset.data_vars:
        return "pattern"
    if "q" in dataset.data_vars and "k" in dataset.data_vars:
        attention_parameters(dataset)
        return "q,k"
    raise AnalysisError(
        f"store {store_url(dataset)} holds neither the attention pattern nor both q and k, so "
        "attention cannot be known: extract with sites pattern or q,k, or analyse without "
        "attention weighting"
    )


def layer_attention(dataset: xr.Dataset, layer: int) -> da.Array:
    """Lazy pattern (sample, head, qpos, kpos) of one layer: stored, or recomputed per block of samples."""
    if attention_source(dataset) == "pattern":
        return dataset["pattern"].sel(layer=layer).data
    parameters = attention_parameters(dataset)
    q = dataset["q"].sel(layer=layer).data
    k = align(dataset["k"].sel(layer=layer).data, q)
    valid = align(dataset["valid"].data, q)

    def block(q_block, k_block, valid_block):
        return attention_from_qk(single_block(q_block), single_block(k_block), valid_block, **parameters)

    return da.blockwise(
        block, "shqk", q, "sqhd", k, "skgd", valid, "sk", concatenate=False, dtype="float32",
        meta=np.empty((0, 0, 0, 0), dtype="float32"),
    )


def store_attention(dataset: xr.Dataset, layers=None) -> xr.DataArray:
    """Lazy attention (sample, layer, head, qpos, kpos) of the chosen layers, stored or recomputed."""
    layers = check_layers(dataset, layers)
    source = attention_source(dataset)
    if source == "pattern":
        return require_site(dataset, "pattern", "attention").sel(layer=layers)
    pattern = da.stack([layer_attention(dataset, layer) for layer in layers], axis=1)
    return xr.DataArray(
        pattern,
        dims=("sample", "layer", "head", "qpos", "kpos"),
        coords={"sample": dataset["sample"], "layer": layers, "head": dataset["head"]},
        attrs={"source": "recomputed from q, k"},
    )
