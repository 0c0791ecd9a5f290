"""Lazy views of a store's attention for notebooks, named as TransformerLens names them.

``import orthosphere.analyze`` registers the xarray accessor ``ortho`` on every Dataset::

    ds = open_store("runs/store.zarr")
    ds.ortho.attn_scores(layer=3, head=5)   # blocks.3.attn.hook_attn_scores: (sample, head, qpos, kpos)
    ds.ortho.pattern(layer=3)               # blocks.3.attn.hook_pattern: (sample, head, qpos, kpos)
    ds.ortho.z(layer=3, head=[0, 5])        # blocks.3.attn.hook_z: (sample, pos, head, d_head)

Each is a Dask-backed DataArray computed one block of samples at a time (q's chunks along
``sample``), never a whole layer's patterns at once. The scores and the pattern come from the
stored q and k with the store's score terms, through the one implementation of the model's
attention (``attention.BlockAttention``); a stored ``pattern`` is returned as it is. ``z`` is the
stored site where the store holds it, else the pattern times v. ``head`` is one head, a list of
heads, or None (every head). A score is -inf where the query may not see the key, as in
TransformerLens (a query that may see no key is scored unmasked, and its pattern row is zero).
Learned sink logits (GPT-OSS's ``score.sink_logits``) are a column of the softmax, not of the
scores: the pattern's rows then sum to less than one.
"""
from __future__ import annotations

from dataclasses import replace

import dask.array as da
import numpy as np
import xarray as xr

from .attention import BlockAttention, ScoreTerms, attention_from_qk
from .blocks import single_block
from .errors import AnalysisError
from .inputs import align, as_float32, check_layers, store_url

ATTENTION_DIMS = ("sample", "head", "qpos", "kpos")


@xr.register_dataset_accessor("ortho")
class OrthoAccessor:
    """``ds.ortho``: lazy views of a store's attention (see the module docstring)."""

    def __init__(self, dataset: xr.Dataset):
        self._given = dataset

    @property
    def _dataset(self) -> xr.Dataset:
        """The dataset, checked to hold what the views index by (read at each call: ``ds.load()`` changes it in place)."""
        return _viewable(self._given)

    def attn_scores(self, layer: int, head=None) -> xr.DataArray:
        """The score before the softmax, (sample, head, qpos, kpos) float32, -inf for refused keys."""
        inputs = _LayerInputs(self._dataset, layer, head, "attn_scores")

        def block(q, k, valid):
            attention = BlockAttention.of(_float32(q), _float32(k), single_block(valid), inputs.terms)
            return np.ascontiguousarray(attention.scores().transpose(1, 2, 3, 0))

        return inputs.view(inputs.attention_blocks(block), "hook_attn_scores", "the score before the softmax")

    def pattern(self, layer: int, head=None) -> xr.DataArray:
        """The attention pattern (sample, head, qpos, kpos): the stored one, else recomputed from q and k."""
        dataset = self._dataset
        if "pattern" in dataset.data_vars:
            heads = _heads(dataset, head)
            return dataset["pattern"].sel(layer=_layer(dataset, layer), head=heads)
        inputs = _LayerInputs(dataset, layer, head, "pattern")
        return inputs.view(inputs.attention_blocks(_pattern_block(inputs.terms)), "hook_pattern",
                           "the attention pattern, recomputed from q and k")

    def z(self, layer: int, head=None) -> xr.DataArray:
        """Each head's attention output before W_O, (sample, pos, head, d_head): the stored site, else the
        pattern (recomputed from q and k) times v."""
        dataset = self._dataset
        if "z" in dataset.data_vars:
            return dataset["z"].sel(layer=_layer(dataset, layer), head=_heads(dataset, head))
        inputs = _LayerInputs(dataset, layer, head, "z")
        if "v" not in dataset.data_vars:
            raise AnalysisError(f"store {store_url(dataset)} holds neither z nor v, so the view z cannot be computed: "
                                "extract with site z, or with q, k and v")
        v = align(inputs.kv_heads(dataset["v"]), inputs.q)
        pattern_of = _pattern_block(inputs.terms)

        def block(q, k, v, valid):
            return np.einsum("shqk,skhd->sqhd", pattern_of(q, k, single_block(valid)), _float32(v))

        data = da.blockwise(block, "sphd", inputs.q, "sphd", inputs.k, "skhd", v, "skhd", inputs.valid, "sk",
                            concatenate=False, dtype="float32", meta=np.empty((0, 0, 0, 0), np.float32))
        return xr.DataArray(data, dims=("sample", "pos", "head", "d_head"),
                            coords={"sample": dataset["sample"], "pos": dataset["pos"], "head": inputs.heads},
                            attrs=inputs.attrs("hook_z", "each head's attention output before W_O: pattern times v"))


class _LayerInputs:
    """One layer's q, k (the chosen heads and the key/value heads they read), valid and score terms."""

    def __init__(self, dataset: xr.Dataset, layer: int, head, view: str):
        if "q" not in dataset.data_vars or "k" not in dataset.data_vars:
            raise AnalysisError(
                f"store {store_url(dataset)} holds no {' and '.join(s for s in ('q', 'k') if s not in dataset.data_vars)}"
                f", which the view {view} recomputes the attention from: extract the store with sites q and k "
                f"(or {'pattern' if view != 'attn_scores' else 'q, k'})")
        self._dataset = dataset
        self.layer, self.heads = _layer(dataset, layer), _heads(dataset, head)
        self.terms = _terms_of_heads(ScoreTerms.of_layer(dataset.attrs.get("model", {}), self.layer), self.heads)
        self.q = dataset["q"].sel(layer=self.layer, head=self.heads).data
        self.k = align(self.kv_heads(dataset["k"]), self.q)
        self.valid = align(dataset["valid"].data, self.q)

    def kv_heads(self, site: xr.DataArray) -> da.Array:
        """k or v of this layer as (sample, pos, head, d_head): the key/value head each chosen head reads."""
        group = self._dataset.sizes["head"] // self._dataset.sizes["kv_head"]
        return site.sel(layer=self.layer).isel(kv_head=[head // group for head in self.heads]).data

    def attention_blocks(self, block) -> da.Array:
        return da.blockwise(lambda q, k, valid: block(q, k, single_block(valid)), "shqk", self.q, "sqhd", self.k, "skhd",
                            self.valid, "sk", concatenate=False, dtype="float32", meta=np.empty((0, 0, 0, 0), np.float32))

    def view(self, data: da.Array, hook: str, description: str) -> xr.DataArray:
        return xr.DataArray(data, dims=ATTENTION_DIMS, coords={"sample": self._dataset["sample"], "head": self.heads},
                            attrs=self.attrs(hook, description))

    def attrs(self, hook: str, description: str) -> dict:
        return {"transformer_lens": f"blocks.{self.layer}.attn.{hook}", "layer": self.layer, "description": description}


def _pattern_block(terms: ScoreTerms):
    def block(q, k, valid):
        return np.ascontiguousarray(attention_from_qk(_float32(q), _float32(k), single_block(valid), terms))

    return block


def _float32(block) -> np.ndarray:
    return as_float32(np.asarray(single_block(block)))


VIEW_DIMS = ("sample", "layer", "pos", "head")


def _viewable(dataset: xr.Dataset) -> xr.Dataset:
    """The dataset the views read: every head and kv_head of the store (the views choose heads by head=),
    the dims they index by, and Dask-backed (a loaded dataset is chunked as the store is)."""
    dropped = [dim for dim in VIEW_DIMS if dim not in dataset.dims]
    if dropped:
        raise AnalysisError(f"the views need the dims {list(VIEW_DIMS)} of a store, and this dataset lacks {dropped} (a "
                            "scalar selection drops a dim): select with a list to keep it, e.g. ds.isel(sample=[0]), and "
                            "choose the layer and heads with the view's layer= and head=")
    for dim in ("head", "kv_head"):
        if dim in dataset.dims and not np.array_equal(dataset[dim].values, np.arange(dataset.sizes[dim])):
            raise AnalysisError(f"the views read every {dim} of the store (a query head reads the key/value head of its "
                                f"group), and this dataset holds {dim}s {dataset[dim].values.tolist()}: choose heads with the "
                                "view's head= instead of a selection")
    if any(not isinstance(array.data, da.Array) for array in dataset.data_vars.values()):
        dataset = dataset.chunk({"sample": dataset.attrs.get("samples_per_chunk") or 16})
    return dataset


def _layer(dataset: xr.Dataset, layer) -> int:
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise AnalysisError(f"layer={layer!r}: expected one layer index of the store")
    return check_layers(dataset, [layer])[0]


def _heads(dataset: xr.Dataset, head) -> list[int]:
    """The chosen query heads as a list (None: every head); one the store lacks is an error."""
    n_heads = dataset.sizes["head"]
    heads = list(range(n_heads)) if head is None else [head] if isinstance(head, (int, np.integer)) else list(head)
    bad = [h for h in heads if isinstance(h, bool) or not isinstance(h, (int, np.integer)) or not 0 <= h < n_heads]
    if bad or not heads:
        raise AnalysisError(f"head={head!r}: expected a head index or a list of them, each in 0..{n_heads - 1}")
    return [int(h) for h in heads]


def _terms_of_heads(terms: ScoreTerms, heads: list[int]) -> ScoreTerms:
    """The score terms of the chosen heads (the per-head ALiBi slopes, relative bias rows and sink logits)."""
    def chosen(values):
        return None if values is None else tuple(values[h] for h in heads)

    return replace(terms, alibi_slopes=chosen(terms.alibi_slopes), relative_bias=chosen(terms.relative_bias),
                   sink_logits=chosen(terms.sink_logits))
