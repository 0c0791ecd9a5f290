"""Norm-perturbation replay: circuit collapse of sparse heads, measured from the stored q, k, v.

The paper's stability study (Menary et al. 2024, section on stability) without the model:
each head's attention is recomputed from the stored queries and keys, the L2 norms of
queries, keys and messages are perturbed multiplicatively, and the change is counted.

Definitions (every count below is over these instances and draws):

- **Scores and attention.** w_ij = q_i . k_j for query position i and key position j of one
  head (head h reads kv_head h // (n_heads / n_kv_heads)); a_i = softmax_j of the layer's score
  of w_ij (``orthosphere.analyze.attention``: the stored scale, soft-cap and position-bias terms of the
  model description) over the *allowed* keys: valid (not padding), j <= i in a causal model, and
  within the layer's sliding window. The noise perturbs w_ij inside exactly that score.
- **Instance.** (sample, layer, head, query position) with a valid query and at least
  ``min_keys`` allowed keys (4 by default). A query with few keys is sparse with little effort
  (a causal model's first positions: one key gets attention 1, and of two or three keys a small
  score gap puts 0.95 on one), which says little about the model's circuits. Queries with 2 to
  ``min_keys - 1`` allowed keys are *trivial instances*: counted apart (``n_instances_trivial``,
  ``n_sparse_trivial``) so that what the minimum removes is seen, and left out of every other
  result. A single allowed key is attended fully and can never switch: such a query is never
  an instance, so ``min_keys=2`` (the smallest allowed) counts every query that can switch.
- **Sparse instance.** An instance whose clean max_j a_ij >= ``sparse_threshold`` (0.95 in
  the paper); t* is its arg-max.
- **Noise.** q_i -> (1 + kq_i) q_i, k_j -> (1 + kk_j) k_j, m_j -> (1 + km_j) m_j with
  messages m_j = W_O v_j per head. kq has one value per (sample, query position, head),
  kk and km one per (sample, key position, kv_head); every value is independent. Uniform
  noise of RMS s is U(-sqrt(3) s, sqrt(3) s) (the paper's choice); Gaussian is N(0, s^2).
  Draw d at level s is kappa = s * unit_noise(seed, target, layer, sample, draw, ...), a value
  per (position, head) that depends only on those indices: the same seed gives the same draws for any
  chunking and any number of workers, the online check injects exactly these values, and
  every level reuses the draw's direction (common random numbers), so an instance that
  collapses at one level collapses at every larger one (each pairwise score comparison is
  linear in s; soft-capping keeps the order of scores; a position bias (ALiBi, T5's relative
  bias), added to them, or a factor 1 + kq <= 0 can break this).
- **Collapse.** A sparse instance whose arg-max over allowed keys moves to another token
  under the noise. **Strict collapse**: the new arg-max also holds >= ``sparse_threshold``.
  Query noise multiplies a query's scores by one positive factor, so it never moves the
  arg-max; message noise leaves the scores alone. (Only a factor 1 + kappa <= 0, which uniform
  noise reaches above s = 1/sqrt(3) and Gaussian noise rarely, reverses a norm: then query
  noise turns the arg-max into an arg-min.)
- **Theorem 7 (first order).** Collapse onto t is predicted when
  w_t* / w_t < lambda_w = (1 + kq + kk_t) / (1 + kq + kk_t*), the inequality flipped when
  w_t (1 + kq + kk_t*) < 0; evaluated on each draw, in the equivalent form
  w_t* (1 + kq + kk_t*) < w_t (1 + kq + kk_t) for some allowed t != t* (which also covers
  w_t = 0). The attention scale multiplies both sides and never matters. Where the layer's
  score soft-caps or adds a position bias, the products w_t (1 + kq + kk_t) pass through the same score
  before they are compared (soft-capping keeps their order; the bias shifts them).
- **Exact condition.** The noisy score's factor is (1 + kq)(1 + kk_t), and 1 + kq > 0 multiplies
  every score of the query alike: query noise cancels, and the arg-max switches iff
  max over allowed t != t* of w_t (1 + kk_t) > w_t* (1 + kk_t*) (through the layer's score as
  above). It is the measured collapse, up to float rounding on near-ties, except where the
  cancellation breaks: a position bias, which the query's factor does not scale, and a factor
  1 + kq <= 0 (uniform noise above s = 1/sqrt(3), Gaussian noise rarely). Theorem 7 differs from
  it by the second-order cross term kq (w_t* kk_t* - w_t kk_t).
- **Recall and precision** of each condition (``theory``: Theorem 7's first order; ``exact``)
  against the measured collapse, over sparse instances and draws: recall is the share of the
  measured collapses the condition predicted, precision the share of its predicted collapses that
  happened; per (level, layer, head) and pooled over layers and heads (per level); NaN where
  nothing collapsed (recall) or nothing was predicted (precision). ``*_missed`` counts the
  measured collapses the condition did not predict, ``*_false_alarm`` its predictions that did not
  happen. (Agreement over every sparse instance would be dominated by the instances that neither
  collapse nor are predicted to.)
- **Critical levels.** With common random numbers, key t beats t* at level s iff a quadratic in s
  is positive (``orthosphere.analyze.critical``): the collapse, Theorem 7's condition and the exact
  condition of a (sparse instance, draw) are computed once, as the level beyond which they hold, not
  level by level; the counts at every swept level and on the collapse-rate curve follow from it
  (rows where a collapse does not persist, a reversed query or a bias, are evaluated at each level
  directly). The comparisons run in float64 from the float32 dot products, so they equal the float32
  softmax's arg-max except on near-ties within float32 rounding. Strict collapse evaluates the
  softmax of the collapsed (instance, draw, level) only. A score that soft-caps and adds a position
  bias is refused (no family does both).
- **Total variation** 1/2 sum_j |a'_ij - a_ij| per instance, averaged over instances and the first
  ``smooth_draws`` draws (2 by default, 2 at least; 0 leaves out both smooth summaries, and with them
  the perturbed softmax of every instance at every level, most of the replay's time on a language
  model's store), with its Monte Carlo standard error
  (``*_mc_error``: the error over noise draws only, of these samples; not a standard error over
  documents or samples): samples draw independent noise, so each sample's sum over its instances varies
  between draws independently of the others', and the error is sqrt(sum over samples of that
  variance / smooth_draws) over the number of instances (n_samples (smooth_draws - 1) degrees of
  freedom: two draws state it well on a store of many samples).
- **Output change** of head h at query i, o_i = sum_j a_ij m_j (b_O aside): the relative RMS
  change sqrt(sum |o'_i - o_i|^2 / sum |o_i|^2) over instances and draws (pooled, so that
  outputs of near-zero norm do not dominate), over the same draws as the total variation, with its
  Monte Carlo error (delta method). Computed in each head's d_head-dimensional frame
  (``message_frame``), never with the d_model-sized messages.
- **Collapse level.** The noise level at which ``collapse_target`` (1 %) of sparse instances
  collapse, without interpolation: for collapse, the first level of the collapse-rate curve
  (``curve_level``: the swept levels and 64 levels an octave from a quarter of the lowest to the
  highest, 1.1 % apart) where its rate reaches the target; for strict collapse, the first swept
  level. inf when the sweep never reaches it, NaN without sparse instances. The crossing lies between
  that level and the one before, so an interval's low end is the grid level below its low percentile
  (on the swept levels one level is no zero-width interval).
- **Intervals** of the collapse levels, the pooled collapse rates and each condition's pooled recall
  and precision: percentile intervals of one seeded cluster bootstrap over the resampling units
  (``orthosphere.analyze.units``: documents when the store has them, each window with the document
  holding most of its tokens; else samples; ``group_by``): each resample draws units with replacement
  and weighs every sample as often as its unit was drawn, so that the windows of one document move together. Every rate counts
  (query, head, draw) instances: "1 % of sparse heads" is 1 % of the sparse instances over the draws.
- **Entropy** -sum_j a_ij log a_ij (nats) and the histogram of max_j a_ij, per head, over
  all instances of the clean attention.

Every result but the trivial counts is over the instances with at least ``min_keys`` allowed
keys: the collapse rates and levels, the predictions, total variation, output change, entropy
and the max-attention histogram.

Results (``replay``; dims definition = collapse/strict, level, layer, head, instances =
sparse/all, max_attention_bin, bound = low/high):
  n_instances, n_sparse (layer, head)    instances and sparse instances
  n_instances_trivial, n_sparse_trivial (layer, head)   the same of the trivial instances
  sparse_fraction, entropy (layer, head); max_attention_hist (layer, head, max_attention_bin)
  collapses, collapse_rate (definition, level, layer, head)
  predicted_collapse_rate, theory_recall, theory_precision, theory_missed, theory_false_alarm
                                         (level, layer, head): Theorem 7's first-order condition
  exact_predicted_collapse_rate, exact_recall, exact_precision, exact_missed, exact_false_alarm
                                         (level, layer, head): the exact condition
  theory_recall_pooled, theory_precision_pooled, exact_recall_pooled, exact_precision_pooled
                                         (level): over layers and heads
  tv_distance, output_change and their *_mc_error (instances, level, layer, head); absent with smooth_draws=0
  collapse_rate_pooled (definition, level) over layers and heads
  collapse_rate_curve (layer, curve_level), collapse_rate_curve_pooled (curve_level): collapse only
  collapse_level (definition, layer), collapse_level_pooled (definition) with their *_ci (..., bound)
  collapse_rate_pooled_ci (definition, level, bound); theory_recall_pooled_ci, theory_precision_pooled_ci,
  exact_recall_pooled_ci, exact_precision_pooled_ci (level, bound): intervals from resampling units
  attrs: seed, n_draws, smooth_draws, distribution, targets, sparse_threshold, min_keys, collapse_target,
  n_bootstrap, confidence, group_by, n_units (the resampling units), resamples (n_bootstrap, or 0 where the
  store holds a single unit: then every interval is NaN and a warning says why), device (where the dense
  attention work ran: see ``orthosphere.analyze.device``), attn_scale, causal, n_samples

Work is split per (layer, sample chunk, range of draws) into Dask tasks that return small
partial sums (float64), reduced and computed once. This module never imports torch or the
extraction code.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import dask
import numpy as np
import xarray as xr

from orthosphere.errors import AnalysisError, ReplayError  # noqa: F401
from orthosphere.params import Interval, parameter

from .attention import AttentionShare, ScoreTerms, Wish, attention_inputs
from .inputs import FiniteCheck, check_layers, store_url
from .kernels import SHARED_SUMS, replay_block
from .multiplicity import state_multiplicity
from .options import CONFIDENCE, LAYERS, integer
from .plan import Plan
from .registry import Analysis, describe
from .replay_blocks import (
    DEFINITIONS,
    INSTANCE_SETS,
    PREDICTION_COUNTS,
    PREDICTIONS,
    ReplaySettings,
    in_sample_order,
    message_frame,
)
from .units import GROUP_BY, GROUP_BY_HELP, Units, resampled, resampling_units

DRAWS_PER_TASK = 32
"""Draws per Dask task: tasks are (layer, sample chunk, range of draws). The default number of draws,
so that each block's clean attention is computed once (8 a task computed it 4 times: 15 % of the
replay on a language model's store); a study of more draws still spreads over more tasks."""
PREDICTED_RATE = {"theory": "predicted_collapse_rate", "exact": "exact_predicted_collapse_rate"}
"""The result holding each condition's share of sparse instances and draws predicted to collapse."""
_LLH = ("level", "layer", "head")

_OVER_DRAWS = "over the sparse instances and the n_draws noise draws at each level"
_CONDITIONS = {"theory": "Theorem 7's first-order condition (Menary et al. 2024)", "exact": "the exact condition"}


def _interval(of: str) -> str:
    return f"confidence interval (dim bound) of {of}"


def _condition_descriptions(rule: str) -> dict[str, str]:
    """The descriptions of one condition's predictions (PREDICTIONS: theory, exact)."""
    condition = _CONDITIONS[rule]
    return {
        PREDICTED_RATE[rule]: f"share of the sparse instances and draws that {condition} predicts to collapse",
        f"{rule}_recall": f"share of the measured collapses (definition collapse) that {condition} predicted, "
                          f"{_OVER_DRAWS}; NaN where nothing collapsed",
        f"{rule}_precision": f"share of the collapses {condition} predicted that happened, {_OVER_DRAWS}; NaN where "
                             "none was predicted",
        f"{rule}_missed": f"measured collapses (definition collapse) that {condition} did not predict, {_OVER_DRAWS}",
        f"{rule}_false_alarm": f"collapses {condition} predicted that did not happen, {_OVER_DRAWS}",
        f"{rule}_recall_pooled": f"{rule}_recall pooled over every layer and head",
        f"{rule}_precision_pooled": f"{rule}_precision pooled over every layer and head",
        f"{rule}_recall_pooled_ci": _interval(f"{rule}_recall_pooled"),
        f"{rule}_precision_pooled_ci": _interval(f"{rule}_precision_pooled"),
    }


DESCRIPTIONS = {
    "n_instances": "instances of the head: (sample, query position) pairs with a valid query and at least min_keys "
                   "allowed keys",
    "n_sparse": "sparse instances: instances whose clean largest attention reaches sparse_threshold",
    "n_instances_trivial": "trivial instances: queries with 2 to min_keys - 1 allowed keys, counted apart and left out "
                           "of every other result",
    "n_sparse_trivial": "trivial instances whose clean largest attention reaches sparse_threshold",
    "sparse_fraction": "n_sparse / n_instances: the share of the head's instances that are sparse (NaN without instances)",
    "entropy": "mean over the head's instances of the clean attention's entropy -sum_j a_ij log a_ij, in nats",
    "max_attention_hist": "instances of the head per bin of their clean largest attention max_j a_ij (coordinate "
                          "max_attention_bin: bin centres over [0, 1])",
    "collapses": f"collapse counts {_OVER_DRAWS}: the arg-max over allowed keys moves to another key under the noise "
                 "(definition collapse), and the new arg-max also holds at least sparse_threshold (strict)",
    "collapse_rate": "collapses / (n_sparse n_draws): the share of the sparse instances and draws that collapse",
    **{name: text for rule in PREDICTIONS for name, text in _condition_descriptions(rule).items()},
    "tv_distance": "total variation distance 1/2 sum_j |a'_ij - a_ij| between the noisy and the clean attention of a "
                   "query, in [0, 1], averaged over the instances of the set (dim instances) and the first smooth_draws "
                   "draws",
    "tv_distance_mc_error": "Monte Carlo standard error of tv_distance",
    "output_change": "relative RMS change of the head's output o_i = sum_j a_ij m_j under the noise, sqrt(sum |o'_i - "
                     "o_i|^2 / sum |o_i|^2) pooled over the instances of the set (dim instances) and the first "
                     "smooth_draws draws",
    "output_change_mc_error": "Monte Carlo standard error of output_change (delta method)",
    "collapse_level": "the noise level at which collapse_target of the layer's sparse instances and draws collapse: the "
                      "first curve_level reaching it (definition collapse), the first swept level (strict); no "
                      "interpolation; inf when the sweep never reaches it, NaN without sparse instances",
    "collapse_level_pooled": "collapse_level over the sparse instances of every layer",
    "collapse_level_ci": _interval("collapse_level") + " holding the resamples' crossings: its low end is the grid level "
                         "below the low percentile (inf: the resamples' curves stay below collapse_target)",
    "collapse_level_pooled_ci": _interval("collapse_level_pooled"),
    "collapse_rate_pooled": "collapse_rate over the sparse instances and draws of every layer and head",
    "collapse_rate_pooled_ci": _interval("collapse_rate_pooled"),
    "collapse_rate_curve": "collapse rate (definition collapse) of the layer's sparse instances and draws, its heads "
                           "pooled, at each curve_level (from the critical levels: no level-by-level replay)",
    "collapse_rate_curve_pooled": "collapse_rate_curve over every layer",
    "definition": "what counts as a collapse: collapse (the arg-max moves to another key), strict (and the new arg-max "
                  "holds at least sparse_threshold)",
    "level": "the swept noise levels s: the RMS of the relative noise kappa on the norms of the targets (x -> "
             "(1 + kappa) x; 0.01: 1 % noise)",
    "instances": "the instances averaged over: sparse (the sparse instances), all (every instance)",
    "max_attention_bin": "bin centres of the clean largest attention max_j a_ij (attrs edges: the bin edges)",
    "curve_level": "the noise levels of the collapse-rate curve: the swept levels and 64 log-spaced levels an octave "
                   "(1.1 % apart) from a quarter of the lowest swept level to the highest",
}
"""The attrs description of each result variable and coordinate (definitions: the module docstring); the
multiplicity of the intervals is appended (``multiplicity.state_multiplicity``)."""


# ---------------------------------------------------------------------------------------------
# The study over a store: Dask tasks per (layer, sample chunk, range of draws), reduced, computed once.


@dataclass(frozen=True)
class ReplayConfig(ReplaySettings):
    """The options of ``replay``: what to perturb (ReplaySettings), the layers and the summaries."""

    collapse_target: float = parameter(0.01, Interval(float, 0, 1, closed="neither", hint="a rate, e.g. 0.01 for 1 %"),
                                       help="the collapse rate whose level collapse_level reports")
    n_bootstrap: int = parameter(1000, integer(0), help="bootstrap resamples of the resampling units (documents) for "
                                                        "the intervals of the collapse levels, rates, recall and precision")
    confidence: float = parameter(0.95, CONFIDENCE, help="the confidence of those intervals")
    group_by: str | None = parameter(None, GROUP_BY, None, help=GROUP_BY_HELP)
    layers: tuple[int, ...] | None = parameter(None, LAYERS, None, help="layers (default: every one stored)")
    n_bins: int = parameter(20, integer(1, "histogram bins"), help="bins of the histogram of the largest attention")


def plan_replay(ds: xr.Dataset, config: ReplayConfig, share: AttentionShare | None = None) -> Plan:
    """The norm-perturbation study of every stored layer (or ``layers``), one layer at a time.

    ``ds`` is a store opened with ``orthosphere.store.open_store`` (or any Dataset of the same
    schema). Returns small xarray results (see the module docstring for the definitions). With
    `share`, the call's ``attention.AttentionShare``, its tasks also hand the norms of the call what
    they wish for.
    """
    settings, layers, n_bins = config, config.layers, config.n_bins
    collapse_target, n_bootstrap, confidence = config.collapse_target, config.n_bootstrap, config.confidence
    model = store_model(ds)
    _check_score_terms(model, check_layers(ds, layers))
    with_messages = check_variables(ds, settings)
    layers = check_layers(ds, layers)
    units = resampling_units(ds, config.group_by)
    resamples = n_bootstrap if resampled(units, store_url(ds), "the replay's intervals are NaN") else 0
    finite = FiniteCheck(ds)
    for layer in layers:
        finite.reads(layer, *((name, layer) for name in (("q", "k", "v") if with_messages else ("q", "k"))))
    graphs = [_layer_graph(ds, layer, settings, model, with_messages, n_bins, share) for layer in layers]

    def finish(per_layer):
        finite.check({layer: sums.pop("nonfinite") for layer, sums in zip(layers, per_layer)})
        result = _assemble(per_layer, ds, layers, settings, n_bins)
        _add_collapse_levels(result, per_layer, settings, collapse_target, units, resamples, confidence)
        result.attrs.update({
            "seed": settings.seed, "n_draws": settings.n_draws, "distribution": settings.distribution,
            "targets": list(settings.targets), "sparse_threshold": settings.sparse_threshold,
            "min_keys": settings.min_keys, "smooth_draws": settings.smooth_draws, "collapse_target": collapse_target, "n_bootstrap": n_bootstrap,
            "confidence": confidence, "device": settings.device, "group_by": units.label, "n_units": units.n_sample_units,
            "resamples": resamples,
            "attn_scale": model["attn_scale"], "causal": int(model["causal"]),
            "n_samples": int(ds.sizes["sample"]),
        })
        return state_multiplicity(describe(result, DESCRIPTIONS), "replay")

    return Plan(graphs, finish)


replay = Analysis("replay", ReplayConfig, plan_replay, reads=("q", "k", "v", "w_o", "valid"),
                  summary="norm perturbations replayed against the stored q, k, v: sparse attention's collapse",
                  shares_attention=True)


def store_model(ds: xr.Dataset) -> dict:
    """The store's model description, checked for what the replay needs."""
    model = ds.attrs.get("model")
    if not isinstance(model, dict):
        raise ReplayError("the dataset has no 'model' attribute: open the store with orthosphere.store.open_store")
    missing = [key for key in ("attn_scale", "causal", "n_heads", "n_kv_heads") if key not in model]
    if missing:
        raise ReplayError(
            f"the store's model description lacks {missing}: the replay needs the attention scale and "
            "whether attention is causal; re-extract the store with a current orthosphere"
        )
    return model


def _check_score_terms(model: dict, layers) -> None:
    """The critical levels compare capped scores or biased ones, not both (no model family does both)."""
    for layer in layers:
        terms = ScoreTerms.of_layer(model, layer)
        if terms.softcap is not None and terms.has_bias:
            raise ReplayError(f"layer {layer} soft-caps its scores and adds a position bias: the replay supports "
                              "one or the other")


def check_variables(ds: xr.Dataset, settings: ReplaySettings) -> bool:
    """Raise if the store lacks what the targets need; True when messages can be replayed."""
    needed = ["q", "k", "valid"] + (["v", "w_o"] if "m" in settings.targets else [])
    missing = [name for name in needed if name not in ds.variables]
    if missing:
        raise ReplayError(
            f"the store lacks {missing}, needed to replay noise on {list(settings.targets)}: "
            "extract with the sites q, k and v and with weights (w_o), or drop the target 'm'"
        )
    return "v" in ds.variables and "w_o" in ds.variables


def _sample_blocks(data: xr.DataArray, chunks: tuple[int, ...]) -> list:
    """Delayed numpy blocks of a (sample, ...) array, split along sample as ``chunks``."""
    import dask.array as darray

    array = data.data if isinstance(data.data, darray.Array) else darray.from_array(data.values)
    array = array.rechunk({0: chunks, **{axis: -1 for axis in range(1, array.ndim)}})
    return list(array.to_delayed(optimize_graph=False).ravel())  # the store's read tasks, shared with other analyses


def _layer_graph(ds, layer, settings, model, with_messages, n_bins, share: AttentionShare | None):
    """A delayed dict of one layer's reduced partial sums. When the norms or norm_geometry of the call wish,
    in `share`, for what they read of the attention (``attention.Wish``), the tasks of the first range of
    draws compute that too and provide it (``attention.AttentionShare``)."""
    q = ds["q"].sel(layer=layer)
    chunks = q.chunks[0] if q.chunks else (ds.sizes["sample"],)
    values = _sample_blocks(ds["v"].sel(layer=layer), chunks) if with_messages else [None] * len(chunks)
    frame = dask.delayed(message_frame)(ds["w_o"].sel(layer=layer).values) if with_messages else None
    sample_ids = ds["sample"].values
    starts = np.concatenate([[0], np.cumsum(chunks)])
    draw_ranges = [range(first, min(first + DRAWS_PER_TASK, settings.n_draws))
                   for first in range(0, settings.n_draws, DRAWS_PER_TASK)]
    wish = Wish() if share is None else share.wished(layer, settings.device)
    norm_sites = tuple(site for site in wish.sites if site != "v" or with_messages)  # the sites its tasks read
    terms = ScoreTerms.of_layer(model, layer)
    partials = [
        [dask.delayed(replay_block, pure=True)(
            *inputs, values[i], frame, samples=sample_ids[starts[i]:starts[i + 1]], layer=layer, draws=draws,
            settings=settings, terms=terms, n_bins=n_bins, received_for=wish.received if draws.start == 0 else (),
            norms_for=norm_sites if draws.start == 0 else (), queries_for=wish.queries if draws.start == 0 else ())
         for draws in draw_ranges]
        for i, inputs in enumerate(attention_inputs(ds, layer))
    ]
    if wish:
        share.provide(layer, settings.device, [ranges[0] for ranges in partials], norm_sites)
    return dask.delayed(_combine)(partials, settings.smooth_draws)


def _combine(partials: list[list[dict]], smooth_draws: int) -> dict:
    """Partial sums per sample block and draw range -> one layer's."""
    return in_sample_order([_within_samples({name: np.sum([p[name] for p in ranges], axis=0) for name in ranges[0]
                                              if name not in SHARED_SUMS}, smooth_draws)
                             for ranges in partials])


def _within_samples(sums: dict, draws: int) -> dict:
    """A block's per-sample sums and sums of squares over the smooth draws (``sample_smooth_<name>``) ->
    their total (``<name>``) and the sum over samples of each sample's variance between draws
    (``<name>_within``), all (set, level, head): what the Monte Carlo error needs."""
    for name in [name for name in sums if name.startswith("sample_smooth_")]:
        total, squares = np.moveaxis(sums.pop(name), 1, 0)
        quantity = name.removeprefix("sample_smooth_")
        sums[quantity] = total.sum(axis=0)
        spread = np.maximum(squares - total**2 / draws, 0.0).sum(axis=0)
        sums[f"{quantity}_within"] = spread / (draws - 1) if draws > 1 else np.full(spread.shape, np.nan)
    return sums


def _names(names) -> np.ndarray:
    """A coordinate of names (object dtype: Zarr v3 stores it as variable-length strings)."""
    return np.array(names, dtype=object)


def _rate(count, total):
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, count / np.where(total > 0, total, 1), np.nan)


def _assemble(per_layer, ds, layers, settings, n_bins) -> xr.Dataset:
    """The head-level results: counts, rates, means over instances and draws."""
    def stack(name):
        return np.stack([part[name] for part in per_layer], axis=-2)  # (..., layer, head)

    draws = settings.n_draws
    n_sparse, n_instances = stack("n_sparse"), stack("n_instances")
    sparse_draws = n_sparse * draws
    totals = np.stack([n_sparse, n_instances])  # (set, layer, head)
    collapses = stack("collapses")
    lh = ("layer", "head")
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    variables = {
        **{name: (lh, stack(name).astype(np.int64))
           for name in ("n_instances", "n_sparse", "n_instances_trivial", "n_sparse_trivial")},
        "sparse_fraction": (lh, _rate(n_sparse, n_instances)),
        "collapses": (("definition",) + _LLH, collapses.astype(np.int64)),
        "collapse_rate": (("definition",) + _LLH, _rate(collapses, sparse_draws)),
        **_prediction_variables(stack, collapses[DEFINITIONS.index("collapse")], sparse_draws),
        "entropy": (lh, _rate(stack("entropy"), n_instances)),
        "max_attention_hist": (("layer", "head", "max_attention_bin"),
                               np.stack([part["max_attention_hist"] for part in per_layer]).astype(np.int64)),
    }
    if "tv" in per_layer[0]:  # the smooth summaries, unless smooth_draws is 0
        tv, tv_error = _smooth_mean(stack("tv"), stack("tv_within"), totals[:, None], draws=settings.smooth_draws)
        variables["tv_distance"] = (("instances",) + _LLH, tv)
        variables["tv_distance_mc_error"] = (("instances",) + _LLH, tv_error)
    if "output_change_sq" in per_layer[0]:
        square, square_error = _smooth_mean(stack("output_change_sq"), stack("output_change_sq_within"),
                                            stack("output_sq")[:, None], draws=settings.smooth_draws)
        change = np.sqrt(square)
        with np.errstate(invalid="ignore", divide="ignore"):
            variables["output_change"] = (("instances",) + _LLH, change)
            variables["output_change_mc_error"] = (("instances",) + _LLH, square_error / (2 * change))
    result = xr.Dataset(variables, coords={
        "definition": _names(DEFINITIONS), "level": list(settings.levels), "layer": layers,
        "head": np.arange(n_sparse.shape[-1]), "instances": _names(INSTANCE_SETS),
        "max_attention_bin": 0.5 * (edges[:-1] + edges[1:]), "curve_level": settings.curve_levels,
    })
    result["max_attention_bin"].attrs["edges"] = edges.tolist()
    return result


def _smooth_mean(summed: np.ndarray, within: np.ndarray, total: np.ndarray, *, draws: int) -> tuple[np.ndarray, np.ndarray]:
    """The mean summed / (draws total) over instances and draws, and its Monte Carlo standard error.

    Samples draw independent noise, and a sample's instances share its key noise: the sum over a
    sample's instances is one draw of an independent variable per sample, whose variance between
    draws (summed over samples in ``within``) gives the variance of the mean, sum_s var_s / draws /
    total^2, estimated with n_samples (draws - 1) degrees of freedom."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return _rate(summed, draws * total), np.where(total > 0, np.sqrt(within / draws) / np.where(total > 0, total, 1),
                                                       np.nan)


def _prediction_variables(stack, measured: np.ndarray, sparse_draws: np.ndarray) -> dict:
    """Each condition's predicted collapse rate, recall, precision, missed and false alarms per
    (level, layer, head), and its recall and precision pooled over layers and heads (per level),
    from the partial sums and the measured collapses (level, layer, head)."""
    variables = {}
    for rule in PREDICTIONS:
        predicted, missed, false_alarm = (stack(f"{rule}_{count}") for count in PREDICTION_COUNTS)
        hits = predicted - false_alarm
        variables |= {
            PREDICTED_RATE[rule]: (_LLH, _rate(predicted, sparse_draws)),
            f"{rule}_recall": (_LLH, _rate(hits, measured)),
            f"{rule}_precision": (_LLH, _rate(hits, predicted)),
            f"{rule}_missed": (_LLH, missed.astype(np.int64)),
            f"{rule}_false_alarm": (_LLH, false_alarm.astype(np.int64)),
            f"{rule}_recall_pooled": (("level",), _rate(hits.sum(axis=(1, 2)), measured.sum(axis=(1, 2)))),
            f"{rule}_precision_pooled": (("level",), _rate(hits.sum(axis=(1, 2)), predicted.sum(axis=(1, 2)))),
        }
    return variables


def level_at_rate(levels, rates: np.ndarray, target: float) -> np.ndarray:
    """The first of ``levels`` where the rate curve (last axis over ``levels``) reaches ``target``:
    no interpolation; inf when the curve stays below the target, NaN where the rates are NaN (no
    sparse instances)."""
    rates = np.asarray(rates, float)
    reached = rates >= target
    level = np.where(reached.any(axis=-1), np.asarray(levels, float)[np.argmax(reached, axis=-1)], np.inf)
    return np.where(np.isnan(rates).any(axis=-1), np.nan, level)


def _add_collapse_levels(result, per_layer, settings, target, units: Units, n_bootstrap, confidence) -> None:
    """Per layer and pooled over layers: the level of ``target`` collapse rate (collapse on the fine curve of
    its critical levels, strict collapse on the swept levels); the pooled collapse rates and the conditions'
    pooled recall and precision; each with its interval from one cluster bootstrap of the resampling units."""
    sparse = np.stack([part["sample_sparse"] for part in per_layer], axis=1) * settings.n_draws  # (sample, layer)
    curves = (np.stack([part["sample_curve"] for part in per_layer], axis=1),  # (sample, layer, curve level)
              np.stack([part["sample_collapses"][:, DEFINITIONS.index("strict")] for part in per_layer], axis=1))
    collapses = np.stack([part["sample_collapses"] for part in per_layer], axis=1).sum(axis=1)  # (sample, def, level)
    predictions = np.stack([part["sample_predictions"] for part in per_layer], axis=1).sum(axis=1)  # (sample, rule, count, level)
    grids = (settings.curve_levels, settings.levels)

    def statistics_for(weights):
        """For sample weights (replicate, sample): the levels (replicate, def, layer) and (replicate, def),
        the pooled collapse rates (replicate, def, level) and recall and precision (replicate, rule, level)."""
        den = weights @ sparse  # (replicate, layer)
        by_layer, pooled = [], []
        for grid, counts in zip(grids, curves):
            num = np.einsum("bs,slv->blv", weights, counts)
            by_layer.append(level_at_rate(grid, _rate(num, den[..., None]), target))
            pooled.append(level_at_rate(grid, _rate(num.sum(axis=1), den.sum(axis=1)[:, None]), target))
        measured = weights @ collapses[:, DEFINITIONS.index("collapse")]  # (replicate, level)
        predicted, _, false_alarm = np.moveaxis(np.einsum("bs,srcv->brcv", weights, predictions), 2, 0)
        hits = predicted - false_alarm
        return (np.stack(by_layer, axis=1), np.stack(pooled, axis=1),
                _rate(np.einsum("bs,sdv->bdv", weights, collapses), den.sum(axis=1)[:, None, None]),
                _rate(hits, measured[:, None]), _rate(hits, predicted))

    points = [statistic[0] for statistic in statistics_for(np.ones((1, sparse.shape[0])))]
    unit = np.unique(units.sample_key, return_inverse=True)[1].ravel()
    intervals = _bootstrap_intervals(statistics_for, unit, n_bootstrap, confidence, settings.seed, points)
    for which in (0, 1):  # the levels: (definition, [layer,] bound)
        intervals[which] = np.stack([_holding_the_crossing(grid, part) for grid, part in zip(grids, intervals[which])])
    by_layer, pooled = points[:2]
    result.coords["bound"] = _names(("low", "high"))
    result["collapse_level"] = (("definition", "layer"), by_layer)
    result["collapse_level_ci"] = (("definition", "layer", "bound"), intervals[0])
    result["collapse_level_pooled"] = (("definition",), pooled)
    result["collapse_level_pooled_ci"] = (("definition", "bound"), intervals[1])
    result["collapse_rate_pooled"] = (("definition", "level"), points[2])
    result["collapse_rate_pooled_ci"] = (("definition", "level", "bound"), intervals[2])
    for r, rule in enumerate(PREDICTIONS):
        for measure, interval in (("recall", intervals[3]), ("precision", intervals[4])):
            result[f"{rule}_{measure}_pooled_ci"] = (("level", "bound"), interval[r])
    result["collapse_rate_curve"] = (("layer", "curve_level"), _rate(curves[0].sum(axis=0), sparse.sum(axis=0)[:, None]))
    result["collapse_rate_curve_pooled"] = (("curve_level",), _rate(curves[0].sum(axis=(0, 1)), sparse.sum()))


def _holding_the_crossing(grid, interval: np.ndarray) -> np.ndarray:
    """An interval (..., bound) of levels read off `grid` (the first level where a rate reaches the target)
    with its low bound moved to the grid level below (0 below the first): each resample's crossing lies
    between its level and the one before, so the interval holds the crossings, and a coarse grid (the
    swept levels of strict collapse) no longer gives one level as a zero-width interval."""
    grid = np.asarray(grid, float)
    low = interval[..., 0]
    on_grid = np.isfinite(low)
    index = np.searchsorted(grid, np.where(on_grid, low, grid[0]))
    below = np.where(index > 0, grid[np.maximum(index - 1, 0)], 0.0)
    widened = interval.copy()
    widened[..., 0] = np.where(on_grid, below, low)
    return widened


def _bootstrap_intervals(statistics_for, unit: np.ndarray, n_bootstrap, confidence, seed, points) -> list[np.ndarray]:
    """(..., bound) percentile intervals of each output of statistics_for(weights) over one set of
    resamples of the units (a cluster bootstrap: `unit` (sample,) numbers each sample's unit, and a
    sample weighs as often as its unit was drawn; NaN without resamples); inf bounds of a level mean
    the resamples' curves stay below the target."""
    if n_bootstrap == 0:
        return [np.full(point.shape + (2,), np.nan) for point in points]
    rng = np.random.default_rng(seed)
    n_units = int(unit.max()) + 1
    batches = [min(100, n_bootstrap - start) for start in range(0, n_bootstrap, 100)]
    outputs = [statistics_for(rng.multinomial(n_units, np.full(n_units, 1.0 / n_units), size=size)[:, unit].astype(float))
               for size in batches]
    tails = [(1 - confidence) / 2, (1 + confidence) / 2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN where a layer has no sparse instance
        return [np.moveaxis(np.nanquantile(np.concatenate([out[which] for out in outputs]), tails, axis=0,
                                           method="inverted_cdf"), 0, -1)
                for which in range(len(points))]
