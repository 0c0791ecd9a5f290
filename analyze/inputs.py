"""What the analyses read from a store: sites, layers, token masks, and the NaN/Inf check."""
from __future__ import annotations

import dask.array as da
import numpy as np
import xarray as xr

from orthosphere.store import open_store

from .errors import AnalysisError, NonFiniteError

D_MODEL_SITES = ("resid_pre", "resid_mid", "resid_post", "attn_in")
HEAD_SITES = {"q": "head", "k": "kv_head", "v": "kv_head"}
VECTOR_SITES = D_MODEL_SITES + tuple(HEAD_SITES)
SITES = VECTOR_SITES + ("pattern",)


def open_for_analysis(url, storage_options: dict | None = None) -> xr.Dataset:
    """The complete store at `url` as a lazy Dataset, with its URL in attrs["url"] for messages and provenance."""
    dataset = open_store(url, storage_options=storage_options)
    dataset.attrs["url"] = str(url)
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
    if layers is None:
        return stored
    layers = sorted({int(layer) for layer in layers})
    missing = [layer for layer in layers if layer not in stored]
    if missing or not layers:
        n_layers = dataset.attrs.get("model", {}).get("n_layers", "?")
        raise AnalysisError(
            f"layer(s) {missing or 'none'} not in store {store_url(dataset)}: it holds layers {stored} "
            f"of the model's {n_layers}; choose layers from those"
        )
    return layers


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


def nonfinite_samples(data: da.Array) -> da.Array:
    """Per sample, whether any value is NaN or Inf: a float64 sum is non-finite exactly then."""
    return ~da.isfinite(data.sum(axis=tuple(range(1, data.ndim)), dtype="float64"))


class FiniteCheck:
    """Lazy per-sample NaN/Inf flags of every (variable, layer) an analysis reads, checked after compute."""

    def __init__(self, dataset: xr.Dataset):
        self.dataset = dataset
        self.flags: dict[tuple[str, int], da.Array] = {}

    def watch(self, name: str, layer: int, data: da.Array) -> None:
        self.flags.setdefault((name, layer), nonfinite_samples(data))

    def raise_if_any(self, computed: dict) -> None:
        """Raise NonFiniteError naming each variable, its layers and samples, if any flag is set."""
        samples = np.asarray(self.dataset["sample"].values)
        found: dict[str, dict[int, np.ndarray]] = {}
        for (name, layer), flags in computed.items():
            bad = samples[np.asarray(flags)]
            if bad.size:
                found.setdefault(name, {})[layer] = bad
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
