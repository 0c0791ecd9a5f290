"""What the analyses read from a store: sites, layers, token masks, and the NaN/Inf check."""
from __future__ import annotations

import dask
import dask.array as da
import numpy as np
import xarray as xr

from orthosphere.store import open_store
from orthosphere.store.schema import chosen_layers

from .errors import AnalysisError, NonFiniteError

D_MODEL_SITES = ("resid_pre", "resid_mid", "resid_post", "attn_in")
HEAD_SITES = {"q": "head", "k": "kv_head", "v": "kv_head"}
VECTOR_SITES = D_MODEL_SITES + tuple(HEAD_SITES)
SITES = VECTOR_SITES + ("pattern",)

BLOCK_BYTES = 16 * 2**20
"""Dask blocks hold about this much of the largest activation (a whole number of the store's chunks):
fewer, larger tasks stream faster than one task per 4 MB chunk."""


def open_for_analysis(url, storage_options: dict | None = None, block_bytes: int = BLOCK_BYTES) -> xr.Dataset:
    """The complete store at `url` as a lazy Dataset in blocks of about block_bytes along sample
    (its URL in attrs["url"], as every opened store)."""
    dataset = open_store(url, storage_options=storage_options)
    chunk_samples = int(dataset.attrs["samples_per_chunk"])
    sample_bytes = max((dataset[site].nbytes // (dataset.sizes["sample"] * dataset.sizes["layer"])
                        for site in stored_sites(dataset)), default=1)
    samples = chunk_samples * max(1, block_bytes // (sample_bytes * chunk_samples))
    if samples > chunk_samples:
        # reopened rather than rechunked: each task then reads its chunks from zarr, with no concatenation
        dataset = open_store(url, storage_options=storage_options, samples_per_block=samples)
    return dataset


def store_url(dataset: xr.Dataset) -> str:
    return dataset.attrs.get("url", "the store")


def stored_sites(dataset: xr.Dataset) -> list[str]:
    return [name for name in SITES if name in dataset.data_vars]


def require_site(dataset: xr.Dataset, site: str, purpose: str) -> xr.DataArray:
    """The site's array; a site that is unknown or not stored is an error naming the stored ones."""
    if site not in SITES:
        raise AnalysisError(f"unknown site {site!r} for {purpose}: expected one of {list(SITES)}")
    if site not in dataset.data_vars:
        raise AnalysisError(
            f"store {store_url(dataset)} has no site {site!r}, which {purpose} needs; it holds "
            f"{stored_sites(dataset)}: choose one of those, or extract a store with site {site!r}"
        )
    return dataset[site]


def check_layers(dataset: xr.Dataset, layers) -> list[int]:
    """The layer indices to analyse (all stored ones when None); each must be stored."""
    stored = [int(layer) for layer in dataset["layer"].values]
    n_layers = dataset.attrs.get("model", {}).get("n_layers", "?")
    return chosen_layers(layers, stored, lambda missing: (
        f"layer(s) {missing} not in store {store_url(dataset)}: it holds layers {stored} of the model's {n_layers}; "
        "choose layers from those"), AnalysisError)


def layer_data(array: xr.DataArray, layer: int) -> da.Array:
    """One layer of a (sample, layer, ...) site as a Dask array (sample, ...), chunked along sample only."""
    return array.sel(layer=layer).data


def align(data: da.Array, like: da.Array) -> da.Array:
    """`data` chunked like `like` along the leading sample axis, whole along every other axis."""
    return data.rechunk((like.chunks[0],) + tuple(-1 for _ in range(1, data.ndim)))


def start_tokens(valid: da.Array) -> da.Array:
    """The first valid position of each sequence (the start token), as a (sample, pos) mask."""
    return valid & (da.cumsum(valid.astype("int32"), axis=1) == 1)


def token_mask(dataset: xr.Dataset, exclude_start: bool) -> da.Array:
    """Tokens the analyses count: valid ones, without each sequence's start token if asked."""
    valid = dataset["valid"].data
    return valid & ~start_tokens(valid) if exclude_start else valid


def sample_values(dataset: xr.Dataset, like: da.Array) -> da.Array:
    """The sample coordinate as a Dask array chunked like `like`."""
    return da.from_array(np.asarray(dataset["sample"].values), chunks=(like.chunks[0],))


FLOAT16_AS_FLOAT32 = np.arange(2**16, dtype=np.uint16).view(np.float16).astype(np.float32)
"""numpy's float32 of every float16 bit pattern: looking a block up in it gives the cast's values
4x faster than the cast (8.5 ns a value, not vectorised, in numpy 2.4 on x86_64)."""


def as_float32(block: np.ndarray) -> np.ndarray:
    """float16 activations as float32 (their squares overflow float16 at |x| > 256), by look-up in
    ``FLOAT16_AS_FLOAT32``; others unchanged."""
    return FLOAT16_AS_FLOAT32[block.view(np.uint16)] if block.dtype == np.float16 else block


def square_norms(x: np.ndarray) -> np.ndarray:
    """Per-token |x|^2 (float32) over the last axis: non-finite exactly where a token holds NaN or Inf
    (or values whose squares overflow float32). Kernels count these; see FiniteCheck."""
    return np.einsum("...d,...d->...", x, x)


def nonfinite_samples(data: da.Array) -> da.Array:
    """Per sample, whether any of its tokens has a non-finite square norm."""

    def block(values):
        return ~np.isfinite(square_norms(as_float32(values))).reshape(len(values), -1).all(axis=1)

    return data.map_blocks(block, drop_axis=list(range(1, data.ndim)), dtype=bool, meta=np.empty((0,), dtype=bool))


class FiniteCheck:
    """NaN/Inf detection for the arrays an analysis reads, in one of two ways:

    - kernels that derive per-token values count the non-finite ones (`reads`, then `check` with
      the counts): no extra pass; only when a count is not zero does a second pass over those
      inputs find the layers and samples to report;
    - otherwise `watch` an array: its per-sample flags (`flags`) are computed in the same graph as
      the analysis, and `raise_if_any` checks them.
    """

    def __init__(self, dataset: xr.Dataset):
        self.dataset = dataset
        self.inputs: dict = {}
        self.flags: dict[tuple[str, int], da.Array] = {}

    def reads(self, key, *inputs: tuple[str, int]) -> None:
        """Record the (variable, layer) pairs that the kernel `key` reads."""
        self.inputs[key] = inputs

    def check(self, counts: dict) -> None:
        """Raise NonFiniteError if any kernel counted non-finite values, naming variables, layers, samples."""
        suspects = sorted({pair for key, count in counts.items() if count for pair in self.inputs[key]})
        if not suspects:
            return
        (flags,) = dask.compute({pair: nonfinite_samples(layer_data(self.dataset[pair[0]], pair[1])) for pair in suspects})
        self.raise_if_any(flags)
        raise NonFiniteError(
            f"the analysis of store {store_url(self.dataset)} derived NaN or Inf from finite activations "
            f"{suspects} (values beyond float32's range, e.g. attention scores): check the model's scale"
        )

    def watch(self, name: str, layer: int, data: da.Array) -> None:
        """Add the lazy per-sample flags of one layer of a variable to `flags`."""
        self.flags.setdefault((name, layer), nonfinite_samples(data))

    def raise_if_any(self, computed: dict) -> None:
        """Raise NonFiniteError naming each variable, its layers and samples, if any computed flag is set."""
        samples = np.asarray(self.dataset["sample"].values)
        found: dict[str, dict[int, np.ndarray]] = {}
        for (name, layer), flagged in computed.items():
            if np.any(flagged):
                found.setdefault(name, {})[layer] = samples[np.asarray(flagged)]
        if not found:
            return
        parts = []
        for name, by_layer in found.items():
            bad = np.unique(np.concatenate(list(by_layer.values())))
            shown = ", ".join(str(s) for s in bad[:10]) + (", ..." if bad.size > 10 else "")
            parts.append(f"{name!r} at layer(s) {sorted(by_layer)} in {bad.size} sample(s) [{shown}]")
        raise NonFiniteError(
            f"store {store_url(self.dataset)} holds NaN or Inf activations: " + "; ".join(parts)
            + ". The analysis stopped rather than let them propagate: re-extract those samples "
            "(or the model overflowed there: extract in float32), or analyse other layers"
        )
