"""Normalisation geometry: the field's standard measures of how a model's residual stream and
attention are shaped around its norms, per layer, in one streaming pass.

- Massive activations (Sun et al. 2024, arXiv:2402.17762): the largest |x_i| over the valid tokens
  and dimensions of `site` (start tokens included: they often carry them), its ratio to the median
  |x_i|, the largest |x_i| of each dimension and of each position, and the `n_top` dimensions that
  carry the largest ones.
- Attention sinks (Xiao et al. 2023, "StreamingLLM"; Gu et al. 2025, "When attention sink
  emerges"): per head, the mean attention that the analysed queries (every valid token but each
  sequence's start) put on the sequence's start token; a head is a sink when that mean exceeds
  `sink_threshold` (0.3, Gu et al.'s), and ``sink_share`` is the share of such heads. Beside it the
  start token's mean |x| at `site` over that of the other tokens.
- Residual norm growth (Heimersheim & Turner 2023): the median |x| at `site` per layer (start tokens
  left out), its growth from one stored layer to the next, and the growth per layer over every stored
  layer as exp of the change of mean log |x| per layer.
- The normalisation factor itself: the coefficient of variation (std / mean) of the stored
  ``norm_scale`` across the analysed tokens of each sequence, averaged over sequences (the paper's
  band is its attention-weighted version at the attention input, in ``/norms``).
- Sparse attention: the share of analysed queries that may see at least `min_keys` keys and whose
  largest attention is at least `sparse_threshold` (0.95, the replay's).

Intervals (`confidence`, 0.9): the samples are cut into `interval_groups` groups of consecutive samples (so
that the windows of one document mostly stay together; the resampling by documents of
``inference.py`` is not used here), and the groups are drawn with replacement `interval_draws` times
(a percentile bootstrap of the ratio estimates). The maxima and medians have no interval.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import partial

import numpy as np
import xarray as xr

from orthosphere.params import parameter

from .attention import AttentionShare, ScoreTerms, attention_source, query_sums, sparse_candidates
from .blocks import Packer, from_tasks, sample_block_vectors, single_block
from .device import resolve_device
from .errors import AnalysisError
from .histogram import N_SLOTS, log_histogram, summarise
from .inputs import D_MODEL_SITES, FiniteCheck, check_layers, layer_data, sample_values, square_norms
from .kernels import CleanAttention
from .options import CONFIDENCE, DEVICE, LAYERS, SHARE, SITE, AnalysisConfig, integer
from .plan import Deferred, Plan
from .registry import Analysis
from .replay_blocks import DEFAULT_MIN_KEYS, MIN_KEYS, SPARSE_THRESHOLD


@dataclass(frozen=True)
class NormGeometryConfig(AnalysisConfig):
    """The options of ``norm_geometry``."""

    site: str = parameter("resid_pre", SITE, help="the residual site (massive activations, norm growth, start-token norm)")
    layers: tuple[int, ...] | None = parameter(None, LAYERS, None, help="layers (default: every one stored)")
    n_top: int = parameter(3, integer(1), help="the dimensions with the largest |x_i| named per layer")
    sink_threshold: float = parameter(0.3, SHARE, help="a head is a sink when its mean attention on the start token exceeds this")
    sparse_threshold: float = parameter(0.95, SPARSE_THRESHOLD, help="a query is sparse when its largest attention reaches this")
    min_keys: int = parameter(DEFAULT_MIN_KEYS, MIN_KEYS, help="sparse attention counts queries that may see at least this many keys")
    interval_groups: int = parameter(32, integer(2), help="groups of consecutive samples resampled for the intervals")
    interval_draws: int = parameter(200, integer(10), help="bootstrap draws of the groups")
    confidence: float = parameter(0.9, CONFIDENCE, help="the intervals' coverage")
    seed: int = parameter(0, integer(0), help="seed of the bootstrap draws")
    device: str = parameter("cpu", DEVICE, help="where the attention recomputed from q and k runs (device.py)")


ATTENTION_READS = {"pattern": ("pattern",), "q,k": ("q", "k"), "none": ()}
"""What each source of the attention reads, per layer."""


def _packers(n_groups: int, n_heads: int, d_model: int, n_pos: int) -> tuple[Packer, Packer]:
    """What one block sums (per group of samples, and the histograms), and what it maximises."""
    summed = Packer({
        "nonfinite": (),
        "start_norm": (n_groups,), "start_count": (n_groups,),
        "other_norm": (n_groups,), "other_log_norm": (n_groups,), "other_count": (n_groups,),
        "scale_cv": (n_groups,), "scale_sequences": (n_groups,),
        "sink_attention": (n_groups, n_heads), "sparse": (n_groups, n_heads), "sparse_queries": (n_groups,),
        "queries": (n_groups,),
        "value_histogram": (N_SLOTS,), "norm_histogram": (N_SLOTS,),
    })
    maximised = Packer({"dimension_max": (d_model,), "position_max": (n_pos,)})
    return summed, maximised


def _block_sums(x, valid, samples, *rest, summed: Packer, maximised: Packer, group_of, n_heads: int,
                terms: ScoreTerms | None, source: str, has_scale: bool, thresholds: tuple[float, int], device: str):
    """One block's packed sums, then its packed maxima (see ``_packers``)."""
    rest = list(rest)
    scale = rest.pop(0) if has_scale else None
    valid = np.asarray(valid, bool)
    groups = group_of(np.asarray(samples))
    n_groups = summed.shapes["start_count"][0]
    start = valid & (np.cumsum(valid, axis=1) == 1)
    other = valid & ~start
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        norms = np.sqrt(square_norms(x))
        magnitudes = np.abs(x[valid])

        def per_group(values):
            return np.bincount(groups, weights=np.asarray(values, "float64"), minlength=n_groups)

        sums = {
            "nonfinite": np.count_nonzero(~np.isfinite(norms[valid])),
            "start_norm": per_group((norms * start).sum(axis=1)), "start_count": per_group(start.sum(axis=1)),
            "other_norm": per_group(np.where(other, norms, 0).sum(axis=1)),
            "other_log_norm": per_group(np.where(other & (norms > 0), np.log(np.where(norms > 0, norms, 1)), 0).sum(axis=1)),
            "other_count": per_group(other.sum(axis=1)),
            "value_histogram": log_histogram(magnitudes)[0],
            "norm_histogram": log_histogram(norms[other])[0],
        }
        sums.update(_scale_sums(scale, other, per_group, n_groups))
        sums.update(_attention_sums(rest, valid, other, groups, n_groups, n_heads, terms, source, thresholds, device))
        masked = np.where(valid[..., None], np.abs(x), 0)
        maxima = {"dimension_max": masked.max(axis=(0, 1)), "position_max": masked.max(axis=(0, 2))}
    return np.concatenate([summed.pack(sums), maximised.pack(maxima)])


def _scale_sums(scale, other, per_group, n_groups: int) -> dict:
    """Per group, the sum of the sequences' coefficients of variation of norm_scale, and their number
    (sequences whose factor is NaN, where the model has no norm, are left out)."""
    if scale is None:
        return {"scale_cv": np.zeros(n_groups), "scale_sequences": np.zeros(n_groups)}
    count = other.sum(axis=1)
    values = np.where(other, scale, 0).astype("float64")
    mean = values.sum(axis=1) / np.maximum(count, 1)
    spread = np.sqrt(np.maximum((np.where(other, values - mean[:, None], 0) ** 2).sum(axis=1) / np.maximum(count, 1), 0))
    counted = (count > 1) & np.isfinite(mean) & (mean > 0)
    return {"scale_cv": per_group(np.where(counted, spread / np.where(counted, mean, 1), 0)),
            "scale_sequences": per_group(counted)}


def _attention_sums(inputs, valid, other, groups, n_groups, n_heads, terms, source, thresholds, device) -> dict:
    """Per group and head, the attention the analysed queries put on the start token and the sparse
    queries among those that may see at least min_keys keys (``attention.query_sums``: from the stored
    pattern, the attention recomputed from q and k, or the replay's tasks of the call, "provided"); per
    group, the numbers of queries."""
    zeros = {"sink_attention": np.zeros((n_groups, n_heads)), "sparse": np.zeros((n_groups, n_heads)),
             "sparse_queries": np.zeros(n_groups), "queries": np.zeros(n_groups)}
    if source == "none":
        return zeros
    if source == "provided":
        on_start, sparse = (np.asarray(single_block(block)) for block in inputs)
    elif source == "pattern":  # (sample, head, qpos, kpos) read key-major
        on_start, sparse = query_sums(np.moveaxis(np.asarray(inputs[0]), 3, 0), valid, terms, *thresholds)
    else:
        on_start, sparse = CleanAttention(inputs[0], inputs[1], valid, terms, device).query_sums(*thresholds)
    np.add.at(zeros["sink_attention"], groups, on_start)
    np.add.at(zeros["sparse"], groups, sparse)
    enough = sparse_candidates(valid, terms, thresholds[1])
    zeros["queries"] = np.bincount(groups, weights=other.sum(axis=1).astype("float64"), minlength=n_groups)
    zeros["sparse_queries"] = np.bincount(groups, weights=enough.sum(axis=1).astype("float64"), minlength=n_groups)
    return zeros


def _group_of(n_samples: int, n_groups: int, sample_ids: np.ndarray):
    """sample id -> group: consecutive samples (in the store's order) in n_groups groups of nearly equal size."""
    order = {int(sample): index for index, sample in enumerate(sample_ids)}
    lookup = np.vectorize(lambda sample: order[int(sample)] * n_groups // n_samples, otypes=[np.int64])
    return lambda samples: lookup(samples) if len(samples) else np.zeros(0, np.int64)


class Bootstrap:
    """Percentile intervals of ratio estimates from per-group sums, the groups drawn with replacement."""

    def __init__(self, n_groups: int, n_draws: int, confidence: float, seed: int):
        rng = np.random.default_rng(seed)
        self.weights = rng.multinomial(n_groups, np.full(n_groups, 1 / n_groups), size=n_draws).astype("float64")
        self.quantiles = ((1 - confidence) / 2, (1 + confidence) / 2)

    def interval(self, statistic, *group_sums: np.ndarray) -> np.ndarray:
        """(..., 2) interval of statistic(*totals), each total of group_sums (groups first) drawn."""
        with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN where a quantity is undefined (no sink, no norm factor)
            draws = statistic(*(np.tensordot(self.weights, sums, axes=(1, 0)) for sums in group_sums))
            low, high = np.nanquantile(draws, self.quantiles, axis=0) if np.isfinite(draws).any() else (draws[0] * np.nan,) * 2
        return np.stack([low, high], axis=-1)


def _ratio(numerator, denominator):
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denominator > 0, numerator / np.where(denominator > 0, denominator, 1), np.nan)


def _sink_share(threshold: float):
    def share(attention, queries):  # attention (..., head), queries (...)
        return (_ratio(attention, queries[..., None]) > threshold).mean(axis=-1)
    return share


def _sparse_share(sparse, queries):
    return _ratio(sparse.sum(axis=-1), queries * sparse.shape[-1])


def _growth(log_norms, counts, steps: float):
    """exp of the change of mean log |x| per layer, from the first stored layer to the last (layer last)."""
    means = _ratio(log_norms, counts)
    return np.exp((means[..., -1] - means[..., 0]) / steps)


DESCRIPTIONS = {
    "massive_max": "largest |x_i| over the valid tokens (start tokens included) and dimensions of the site (Sun et al. 2024)",
    "massive_median": "median |x_i| over the same tokens and dimensions",
    "massive_ratio": "massive_max / massive_median: above about 100 a layer carries massive activations (Sun et al. 2024)",
    "dimension_max": "largest |x_i| of each dimension over the valid tokens",
    "position_max": "largest |x_i| of each position over samples and dimensions (valid tokens)",
    "top_dimension": "the n_top dimensions with the largest dimension_max, largest first",
    "top_dimension_value": "their dimension_max",
    "max_position": "the position whose token holds massive_max",
    "start_norm_ratio": "mean |x| of the start tokens over mean |x| of the other valid tokens (Gu et al. 2025)",
    "median_norm": "median |x| of the analysed tokens (no start token) per layer (Heimersheim & Turner 2023)",
    "norm_growth": "median_norm over that of the previous stored layer, per layer between them (NaN at the first)",
    "growth_per_layer": "exp of the change of mean log |x| per layer from the first stored layer to the last",
    "norm_scale_cv": "coefficient of variation (std / mean) of norm_scale across the analysed tokens of a sequence, "
                     "averaged over sequences: how much the normalisation factor varies within a sequence",
    "norm_scale_cv_pooled": "norm_scale_cv over every layer's sequences",
    "sink_attention": "mean attention of the analysed queries on their sequence's start token, per head",
    "sink_share": "share of heads whose sink_attention exceeds sink_threshold (Gu et al. 2025's metric)",
    "sink_share_pooled": "the same over every layer and head",
    "sparse_share": "share of (query, head) pairs, over queries that may see at least min_keys keys, whose largest "
                    "attention reaches sparse_threshold",
    "sparse_share_pooled": "the same over every layer",
}


def plan_norm_geometry(dataset: xr.Dataset, config: NormGeometryConfig, share: AttentionShare | None = None) -> Plan:
    """The measures of the module docstring at `site`, per layer: one pass over the site, norm_scale
    (when stored) and the attention (stored, or recomputed from q and k). With `share`, the call's
    ``attention.AttentionShare``, the attention recomputed from q and k comes from the replay's tasks
    when the call runs the replay too (each block's attention is then computed once)."""
    if config.site not in D_MODEL_SITES:
        raise AnalysisError(f"norm_geometry site={config.site!r}: expected a residual site, one of {list(D_MODEL_SITES)}")
    if config.site not in dataset.data_vars:
        raise AnalysisError(f"store {dataset.attrs.get('url', 'the store')} has no site {config.site!r}, which "
                            "norm_geometry reads: extract it, or choose a stored residual site (option site)")
    layers = check_layers(dataset, config.layers)
    device = resolve_device(config.device)
    source = _source(dataset)
    has_scale = "norm_scale" in dataset.data_vars
    n_samples, n_heads = dataset.sizes["sample"], dataset.sizes.get("head", 1)
    n_groups = min(config.interval_groups, n_samples)
    summed, maximised = _packers(n_groups, n_heads, dataset.sizes["d_model"], dataset.sizes["pos"])
    group_of = _group_of(n_samples, n_groups, np.asarray(dataset["sample"].values))
    thresholds = (config.sparse_threshold, config.min_keys)
    share = share if source == "q,k" else None
    for layer in layers if share is not None else ():
        share.wish(layer, device, queries=thresholds)
    finite = FiniteCheck(dataset)
    for layer in layers:
        finite.reads(layer, (config.site, layer))

    def attention_inputs_of(layer: int) -> tuple[str, list]:
        """Where the layer's attention sums come from, and the inputs the block kernel reads for them."""
        provided = None if share is None else share.provider(layer, device)
        if provided is None:
            return source, [layer_data(dataset[name], layer) for name in ATTENTION_READS[source]]
        samples = dataset["q"].sel(layer=layer).data.chunks[0]
        return "provided", [from_tasks(provided[0], partial(_provided_queries, thresholds=thresholds, which=which),
                                       (n_heads,), samples, dtype="float64") for which in (0, 1)]

    def lazy():  # built when the pass computes: the replay of the call may provide the attention (AttentionShare)
        work = {}
        for layer in layers:
            x = layer_data(dataset[config.site], layer)
            inputs = [x, dataset["valid"].data, sample_values(dataset, x)]
            inputs += [layer_data(dataset["norm_scale"], layer)] if has_scale else []
            layer_source, attention = attention_inputs_of(layer)
            terms = ScoreTerms.of_layer(dataset.attrs["model"], layer) if source != "none" else None
            kernel = partial(_block_sums, summed=summed, maximised=maximised, group_of=group_of, n_heads=n_heads,
                             terms=terms, source=layer_source, has_scale=has_scale, thresholds=thresholds, device=device)
            vectors = sample_block_vectors(kernel, summed.size + maximised.size, *inputs, *attention)
            work[layer] = [vectors[:, :summed.size].sum(axis=0, split_every=8), vectors[:, summed.size:].max(axis=0)]
        return work

    def finish(computed):
        finite.check({layer: summed.unpack(sums)["nonfinite"] for layer, (sums, _) in computed.items()})
        per_layer = [(summed.unpack(computed[layer][0]), maximised.unpack(computed[layer][1])) for layer in layers]
        return _result(dataset, config, layers, per_layer, source, has_scale, n_groups)

    return Plan(Deferred(lazy), finish)


def _provided_queries(sums: dict, thresholds: tuple[float, int], which: int) -> np.ndarray:
    """The start token's attention (`which` 0) or the sparse queries (1) per (sample, head) from a replay task."""
    return sums["queries"][thresholds][which]


def _source(dataset: xr.Dataset) -> str:
    """Where the attention comes from: "pattern", "q,k" or "none" (the store holds neither)."""
    try:
        return attention_source(dataset)
    except AnalysisError:
        return "none"


def _result(dataset, config, layers, per_layer, source, has_scale, n_groups) -> xr.Dataset:
    sums = {name: np.stack([s[name] for s, _ in per_layer]) for name in per_layer[0][0]}
    maxima = {name: np.stack([m[name] for _, m in per_layer]) for name in per_layer[0][1]}
    bootstrap = Bootstrap(n_groups, config.interval_draws, config.confidence, config.seed)

    def groups_first(name):  # (layer, group, ...) -> (group, layer, ...)
        return np.moveaxis(sums[name], 1, 0)

    edges = np.array([0.0, 1.0])
    value_median = summarise(sums["value_histogram"], mass=0.5, quantiles=(0.5,), ratio_edges=edges)["median"]
    norm_median = summarise(sums["norm_histogram"], mass=0.5, quantiles=(0.5,), ratio_edges=edges)["median"]
    massive_max = maxima["dimension_max"].max(axis=1)
    top = np.argsort(-maxima["dimension_max"], axis=1, kind="stable")[:, :config.n_top]
    steps = float(layers[-1] - layers[0]) if len(layers) > 1 else np.nan
    with np.errstate(invalid="ignore", divide="ignore"):
        norm_growth = np.concatenate([[np.nan], (norm_median[1:] / norm_median[:-1]) ** (1 / np.diff(layers))])
    sink_share = _sink_share(config.sink_threshold)
    n_heads = sums["sink_attention"].shape[-1]

    def pooled_sinks(attention, queries):  # over layers and heads
        return sink_share(attention, queries).mean(axis=-1)

    def pooled_sparse(sparse, queries):
        return _ratio(sparse.sum(axis=(-1, -2)), queries.sum(axis=-1) * n_heads)

    def pooled_cv(cv, sequences):
        return _ratio(cv.sum(axis=-1), sequences.sum(axis=-1))

    attention = ("sink_attention", "queries")
    variables = {
        "massive_max": (("layer",), massive_max),
        "massive_median": (("layer",), value_median),
        "massive_ratio": (("layer",), _ratio(massive_max, value_median)),
        "dimension_max": (("layer", "d_model"), maxima["dimension_max"]),
        "position_max": (("layer", "pos"), maxima["position_max"]),
        "top_dimension": (("layer", "top"), top),
        "top_dimension_value": (("layer", "top"), np.take_along_axis(maxima["dimension_max"], top, axis=1)),
        "max_position": (("layer",), np.argmax(maxima["position_max"], axis=1)),
        "start_norm_ratio": (("layer",), _ratio(_ratio(sums["start_norm"].sum(1), sums["start_count"].sum(1)),
                                                _ratio(sums["other_norm"].sum(1), sums["other_count"].sum(1)))),
        "start_norm_ratio_ci": (("layer", "bound"), bootstrap.interval(
            lambda a, b, c, d: _ratio(_ratio(a, b), _ratio(c, d)),
            *(groups_first(name) for name in ("start_norm", "start_count", "other_norm", "other_count")))),
        "median_norm": (("layer",), norm_median),
        "norm_growth": (("layer",), norm_growth),
        "growth_per_layer": ((), _growth(sums["other_log_norm"].sum(1), sums["other_count"].sum(1), steps)),
        "growth_per_layer_ci": (("bound",), bootstrap.interval(
            partial(_growth, steps=steps), groups_first("other_log_norm"), groups_first("other_count"))),
        "norm_scale_cv": (("layer",), _ratio(sums["scale_cv"].sum(1), sums["scale_sequences"].sum(1))),
        "norm_scale_cv_ci": (("layer", "bound"), bootstrap.interval(_ratio, groups_first("scale_cv"),
                                                                     groups_first("scale_sequences"))),
        "norm_scale_cv_pooled": ((), pooled_cv(sums["scale_cv"].sum(1), sums["scale_sequences"].sum(1))),
        "norm_scale_cv_pooled_ci": (("bound",), bootstrap.interval(pooled_cv, groups_first("scale_cv"),
                                                                    groups_first("scale_sequences"))),
        "sink_attention": (("layer", "head"), _ratio(sums["sink_attention"].sum(1), sums["queries"].sum(1)[:, None])),
        "sink_share": (("layer",), sink_share(sums["sink_attention"].sum(1), sums["queries"].sum(1))),
        "sink_share_ci": (("layer", "bound"), bootstrap.interval(sink_share, *map(groups_first, attention))),
        "sink_share_pooled": ((), pooled_sinks(sums["sink_attention"].sum(1), sums["queries"].sum(1))),
        "sink_share_pooled_ci": (("bound",), bootstrap.interval(pooled_sinks, *map(groups_first, attention))),
        "sparse_share": (("layer",), _sparse_share(sums["sparse"].sum(1), sums["sparse_queries"].sum(1))),
        "sparse_share_ci": (("layer", "bound"), bootstrap.interval(
            _sparse_share, groups_first("sparse"), groups_first("sparse_queries"))),
        "sparse_share_pooled": ((), pooled_sparse(sums["sparse"].sum(1), sums["sparse_queries"].sum(1))),
        "sparse_share_pooled_ci": (("bound",), bootstrap.interval(
            pooled_sparse, groups_first("sparse"), groups_first("sparse_queries"))),
    }
    if source == "none":
        variables = {name: value for name, value in variables.items() if not name.startswith(("sink", "sparse"))}
    if not has_scale:
        variables = {name: value for name, value in variables.items() if not name.startswith("norm_scale")}
    result = xr.Dataset(
        {name: (dims, np.asarray(values), {"description": DESCRIPTIONS.get(name.removesuffix("_ci"), "")
                                            + (f" ({config.confidence:.0%} interval: bootstrap over {n_groups} "
                                               "groups of consecutive samples)" if name.endswith("_ci") else "")})
         for name, (dims, values) in variables.items()},
        coords={"layer": layers, "bound": ["low", "high"], "head": dataset["head"].values if "head" in dataset.coords
                else np.arange(n_heads)},
        attrs={"site": config.site, "attention_source": {"pattern": "stored pattern", "q,k": "recomputed from q, k"}.get(
            source, "none"), "norm_scale": "stored" if has_scale else "not stored", "interval_groups": n_groups,
            "interval_draws": config.interval_draws, "confidence": config.confidence, "sink_threshold": config.sink_threshold,
            "sparse_threshold": config.sparse_threshold, "min_keys": config.min_keys},
    )
    return result


norm_geometry = Analysis(
    "norm_geometry", NormGeometryConfig, plan_norm_geometry,
    reads=(*D_MODEL_SITES, "norm_scale", "q", "k", "pattern", "valid"), needs=("resid_pre",),
    summary="massive activations, attention sinks, residual norm growth, norm_scale spread, sparse attention",
    shares_attention=True)
