"""Norm spread: how tightly the norms of a vector site are spread around their median.

For each site, layer and group (the layer; each head for q, k, v or when weighted by attention)
the distribution of |x| / median(|x|): quantiles, a histogram, and the half-width p of the band
[1 - p, 1 + p] that holds `mass` of it (the paper's "90 % within +-20 %"); that band also per layer
with its groups pooled and over every layer and group (each group's |x| over its own median,
weighted as below: the groups' summed histograms added, no second pass). Weighted by attention
(the paper's choice), a key token counts with the attention it receives from the analysed
queries of the head (head h reads kv_head h // (n_heads // n_kv_heads)); a query (site q) counts
once, as it hands out one unit of attention. One streaming pass: per block of samples, fine
log-spaced histograms (see histogram.py), summed. Each site's results say which of the model's
norms produced it (``normalised_by``, from the store's norm description): a narrow spread there is
imposed by the model, not learned.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import dask
import dask.array as da
import numpy as np
import xarray as xr

from orthosphere.params import parameter

from .attention import (
    SHARED_SITES,
    AttentionShare,
    ScoreTerms,
    attention_inputs,
    attention_source,
    token_norms,
)
from .blocks import from_tasks, sample_block_sums, single_block
from .description import normalised_by
from .device import resolve_device
from .errors import AnalysisError
from .histogram import N_SLOTS, log_histogram, pooled_ratio_cumulative, ratio_band, spread_variables
from .inputs import (
    HEAD_SITES,
    VECTOR_SITES,
    FiniteCheck,
    align,
    check_layers,
    layer_data,
    require_site,
    store_url,
    token_mask,
)
from .kernels import attention_block
from .options import DEVICE, FLAG, LAYERS, NAMES, POSITIVE, SHARE, SHARES, AnalysisConfig, integer
from .plan import Deferred, Plan
from .registry import Analysis, describe

QUANTILES = (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95)


@dataclass(frozen=True)
class NormsConfig(AnalysisConfig):
    """The options of ``norms``."""

    sites: tuple[str, ...] | None = parameter(None, NAMES, None, help="vector sites (default: every one stored)")
    layers: tuple[int, ...] | None = parameter(None, LAYERS, None, help="layers (default: every one stored)")
    weight_by_attention: bool = parameter(True, FLAG, help="each key weighted by the attention it receives")
    exclude_start: bool = parameter(True, FLAG, help="leave out each sequence's start token")
    mass: float = parameter(0.9, SHARE, help="the share of the mass the band holds")
    quantiles: tuple[float, ...] = parameter(QUANTILES, SHARES, help="quantiles of |x| / median")
    ratio_max: float = parameter(2.0, POSITIVE, help="the histogram of |x| / median spans [0, ratio_max]")
    ratio_bins: int = parameter(100, integer(1), help="the histogram's bins")
    device: str = parameter("cpu", DEVICE, help="where the attention recomputed from q and k runs (device.py)")


def received_attention(dataset: xr.Dataset, layer: int, mask: da.Array) -> da.Array:
    """Lazy (sample, head, kpos) attention each analysed key (`mask`, the analysed tokens) receives from
    the analysed queries, from the stored pattern."""
    pattern = dataset["pattern"].sel(layer=layer).data
    return da.blockwise(_received, "shk", align(mask, pattern), "sq", pattern, "shqk", concatenate=False,
                        dtype="float32", meta=np.empty((0, 0, 0), dtype="float32"))


def attention_tasks(dataset: xr.Dataset, layer: int, exclude_start: bool, device: str,
                    norm_sites: tuple[str, ...], share: AttentionShare | None) -> tuple[list, tuple[str, ...]]:
    """Per block of samples, the delayed ``kernels.attention_sums`` from which the norms read the
    attention recomputed from q and k (on `device`, resolved: see device.py), and the sites whose |x|
    it holds: the replay's tasks when the replay of the same call provides them through `share`
    (``attention.AttentionShare``), else tasks of the norms' own, which read q and k and keep no
    pattern."""
    provided = None if share is None else share.provider(layer, device)
    if provided is not None:
        return provided
    terms = ScoreTerms.of_layer(dataset.attrs["model"], layer)
    own = tuple(site for site in norm_sites if site in ("q", "k"))
    return [dask.delayed(attention_block, pure=True)(*inputs, terms, device, exclude_start, own)
            for inputs in attention_inputs(dataset, layer)], own


def _provided_received(sums: dict, exclude_start: bool) -> np.ndarray:
    return sums["received"][exclude_start]


def _provided_norms(sums: dict, site: str) -> np.ndarray:
    return sums["norms"][site]


def _received(mask, pattern):
    """(sample, head, kpos) attention each analysed key receives from the analysed queries (einsum
    reads a key-major pattern in place; a matrix product would copy it first)."""
    weights = single_block(mask).astype("float32")
    return np.einsum("shqk,sq->shk", single_block(pattern), weights) * weights[:, None, :]


def site_norms(data: da.Array) -> da.Array:
    """Lazy |x| (float32) of each token (and head) of one layer of a site (sample, pos, ...): a small
    array, so that each block of the site is let go as soon as it is read, however long its
    histograms wait for the attention."""
    data = align(data, data)
    return data.map_blocks(token_norms, drop_axis=data.ndim - 1, dtype="float32",
                           meta=np.empty((0,) * (data.ndim - 1), dtype="float32"))


def _site_histograms(norms, mask, *attention, site_kind, n_heads, n_groups):
    """One block's histograms (group, slot) of the norms, group = head when weighted, else layer or
    head, followed by the count of non-finite norms and attention weights."""
    nonfinite = np.count_nonzero(~np.isfinite(norms)) + sum(np.count_nonzero(~np.isfinite(a)) for a in attention)
    weights = mask.astype("float32")
    if site_kind == "d_model" and not attention:
        counts = log_histogram(norms, weights)
    elif site_kind == "d_model":
        values = np.broadcast_to(norms[:, None, :], attention[0].shape)
        counts = log_histogram(values, attention[0], _head_index(values.shape, 1), n_heads)
    else:
        values = np.moveaxis(norms, -1, 1)  # (sample, head or kv_head, pos)
        if site_kind == "q" or not attention:
            weights = np.broadcast_to(weights[:, None, :], values.shape)
            counts = log_histogram(values, weights, _head_index(values.shape, 1), n_groups)
        else:
            values = np.repeat(values, n_heads // values.shape[1], axis=1)
            counts = log_histogram(values, attention[0], _head_index(values.shape, 1), n_heads)
    return np.append(counts.ravel(), nonfinite)


def _head_index(shape, axis):
    index = np.arange(shape[axis]).reshape([-1 if a == axis else 1 for a in range(len(shape))])
    return np.broadcast_to(index, shape)


def _group_dim(site: str, weighted: bool) -> str | None:
    if weighted:
        return "head"
    return HEAD_SITES.get(site)


def _site_summary(dataset, site, layers, counts, group_dim, spread, by_attention: bool) -> xr.Dataset:
    stacked = np.stack([counts[layer] for layer in layers])  # (layer, group, slot)
    group_dims = ("layer",) + ((group_dim,) if group_dim else ())
    coords = {"layer": layers}
    if group_dim:
        coords[group_dim] = dataset[group_dim].values
    data = spread_variables(stacked if group_dim else stacked[:, 0], group_dims=group_dims, coords=coords,
                            median_name="median_norm", **spread)
    median = data["median_norm"][1].reshape(stacked.shape[:2])
    layer_of_group = np.broadcast_to(np.arange(len(layers))[:, None], stacked.shape[:2])
    cumulative, total = pooled_ratio_cumulative(stacked, median, layer_of_group, len(layers))
    by_layer, everywhere = _pooled_band_descriptions(group_dim, by_attention)
    data["band_layer"] = (("layer",), ratio_band(cumulative, total, spread["mass"]), {"description": by_layer})
    data["band_pooled"] = ((), ratio_band(cumulative.sum(axis=0, keepdims=True), total.sum(keepdims=True),
                                          spread["mass"])[0], {"description": everywhere})
    result = xr.Dataset(data, coords=coords,
                        attrs={"site": site, "group": group_dim or "layer", "ratio_bin_width": spread["ratio_max"] / spread["ratio_bins"]})
    return describe(result, _site_descriptions(group_dim, by_attention), keep=True)


DESCRIPTIONS = {
    "median_norm": "weighted median of the L2 norm |x| of the site's analysed tokens, {per}, in the site's units; "
                   "{weight}",
    "band": "half-width p such that |x| / median_norm within [1 - p, 1 + p] holds `mass` (attrs) of the weight, {per} "
            "(the paper's '90 % within +-20 %': p = 0.2); {weight}",
    "ratio_quantile": "quantiles (coordinate quantile) of |x| / median_norm, {per}; {weight}",
    "histogram": "share of the weight per bin of |x| / median_norm (coordinate ratio: bin centres, width attrs "
                 "ratio_bin_width, over [0, ratio_max]), {per}; {weight}",
    "beyond": "share of the weight whose |x| / median_norm lies past ratio_max (the histogram's last edge), {per}",
    "weight_total": "total weight of the analysed tokens, {per}: {total}",
    "quantile": "the quantile levels of ratio_quantile",
    "ratio": "bin centres of |x| / median_norm of the histogram",
}
"""The attrs description of each variable and coordinate of a site's group (``_site_descriptions`` fills in the
group and the weighting); band_layer and band_pooled: ``_pooled_band_descriptions``."""


def _site_descriptions(group_dim: str | None, by_attention: bool) -> dict[str, str]:
    """DESCRIPTIONS for a site grouped by `group_dim` (None: per layer), weighted by attention or not."""
    per = f"per layer and {group_dim}" if group_dim else "per layer"
    weight = ("each key token weighted by the attention it receives from the head's analysed queries"
              if by_attention else "each token counting once")
    total = "the attention the analysed tokens receive" if by_attention else "the number of analysed tokens"
    return {name: text.format(per=per, weight=weight, total=total) for name, text in DESCRIPTIONS.items()}


def _pooled_band_descriptions(group_dim: str | None, by_attention: bool) -> tuple[str, str]:
    """The attrs descriptions of band_layer and band_pooled."""
    weight = ("each key token weighted by the attention it receives from the head's analysed queries"
              if by_attention else "each token counting once")
    band = "half-width p such that |x| / median within [1 - p, 1 + p] holds `mass` of the weight"
    if group_dim is None:
        ratio = f"|x| divided by the layer's weighted median (median_norm), {weight}"
        return f"{band}, per layer: {ratio}", f"{band}, pooled over every layer: {ratio}"
    ratio = (f"every {group_dim}'s |x| divided by that {group_dim}'s own weighted median (median_norm), {weight}; "
             f"the {group_dim}s' histograms added with their weights, so that each {group_dim} counts with its "
             "weight_total")
    return (f"{band}, per layer, pooled over its {group_dim}s: {ratio}",
            f"{band}, pooled over every layer and {group_dim}: {ratio}")


def _sites(dataset: xr.Dataset, sites) -> list[str]:
    if sites is not None:
        for site in sites:
            require_site(dataset, site, "norm spread")
            if site not in VECTOR_SITES:
                raise AnalysisError(f"norm spread reads vector sites, one of {list(VECTOR_SITES)}; got {site!r}")
        return list(sites)
    sites = [site for site in VECTOR_SITES if site in dataset.data_vars]
    if not sites:
        raise AnalysisError(f"store {store_url(dataset)} holds no vector site ({list(VECTOR_SITES)}) for norm spread")
    return sites


def plan_norm_spread(dataset: xr.Dataset, config: NormsConfig, share: AttentionShare | None = None) -> Plan:
    """Norm spread of every chosen site (default: every vector site stored): one child group per site.

    weight_by_attention: per head, each key weighted by the attention it receives (else uniform,
    per layer, or per head for q, k, v); exclude_start: leave out each sequence's start token;
    mass: the share of the mass the band holds; quantiles of |x| / median; a histogram of
    |x| / median with ratio_bins bins on [0, ratio_max]; device: where the attention recomputed from
    q and k runs (see device.py). With `share`, the call's ``attention.AttentionShare``, the attention
    recomputed from q and k comes from the replay's tasks when the call runs the replay too.
    """
    spread = {name: getattr(config, name) for name in ("mass", "quantiles", "ratio_max", "ratio_bins")}
    device = resolve_device(config.device)
    sites, layers, exclude_start = config.sites, config.layers, config.exclude_start
    sites = _sites(dataset, sites)
    layers = check_layers(dataset, layers)
    weighted = config.weight_by_attention
    source = attention_source(dataset) if weighted and any(site != "q" for site in sites) else None
    mask = token_mask(dataset, exclude_start)
    n_heads = dataset.sizes["head"]
    finite = FiniteCheck(dataset)
    attention_reads = {"pattern": ("pattern",), "q,k": ("q", "k")}.get(source, ())
    shared_sites = tuple(site for site in SHARED_SITES if site in sites) if source == "q,k" else ()
    share = share if source == "q,k" else None
    for layer in layers if share is not None else ():
        share.wish(layer, device, exclude_start=exclude_start, norm_sites=shared_sites)

    def attention_and_norms(layer: int) -> tuple[tuple, dict]:
        """The attention each key receives (none without weighting), and the sites' norms that the
        attention's tasks compute (so that the blocks of q, k, v those tasks read have no other reader)."""
        if source == "pattern":
            return (received_attention(dataset, layer, mask),), {}
        if source is None:
            return (), {}
        tasks, provided = attention_tasks(dataset, layer, exclude_start, device, shared_sites, share)
        samples = dataset["q"].sel(layer=layer).data.chunks[0]
        attention = from_tasks(tasks, partial(_provided_received, exclude_start=exclude_start),
                               (dataset.sizes["head"], dataset.sizes["pos"]), samples)
        return (attention,), {site: from_tasks(tasks, partial(_provided_norms, site=site),
                                               layer_data(dataset[site], layer).shape[1:-1], samples)
                              for site in provided}

    def lazy():  # built when the pass computes: the replay of the call may provide the attention (AttentionShare)
        work = {}
        for layer in layers:
            attention, provided_norms = attention_and_norms(layer)
            for site in sites:
                kind = site if site in HEAD_SITES else "d_model"
                group_dim = _group_dim(site, weighted)
                n_groups = dataset.sizes[group_dim] if group_dim else 1
                kernel = partial(_site_histograms, site_kind=kind, n_heads=n_heads, n_groups=n_groups)
                uses_attention = weighted and site != "q"
                norms = provided_norms[site] if site in provided_norms else site_norms(layer_data(dataset[site], layer))
                inputs = (norms, mask) + (attention if uses_attention else ())
                work[site, layer] = sample_block_sums(kernel, n_groups * N_SLOTS + 1, *inputs)
                names = (site,) + (attention_reads if uses_attention else ())
                finite.reads((site, layer), *((name, layer) for name in names))
        return work

    def finish(sums):
        finite.check({key: vector[-1] for key, vector in sums.items()})
        children = {}
        for site in sites:
            group_dim = _group_dim(site, weighted)
            n_groups = dataset.sizes[group_dim] if group_dim else 1
            per_layer = {layer: sums[site, layer][:-1].reshape(n_groups, N_SLOTS) for layer in layers}
            summary = _site_summary(dataset, site, layers, per_layer, group_dim, spread, weighted and site != "q")
            summary.attrs.update({
                "weighting": "attention" if weighted else "uniform",
                "attention_source": {"pattern": "stored pattern", "q,k": "recomputed from q, k"}.get(source, "none")
                if weighted and site != "q" else "none",
                "mass": config.mass,
                "exclude_start": exclude_start,
                "normalised_by": normalised_by(dataset.attrs.get("model", {}), site),
            })
            children[site] = xr.DataTree(dataset=summary)
        return xr.DataTree(children=children)

    return Plan(Deferred(lazy), finish)


norm_spread = Analysis(
    "norms", NormsConfig, plan_norm_spread, summary="how tightly the norms of each vector site spread around their median",
    reads=(*VECTOR_SITES, "pattern", "valid"), shares_attention=True)
