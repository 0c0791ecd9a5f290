"""orthosphere.analyze: the paper's geometric questions answered from a store, without the model.

Every analysis takes a store opened lazily (``open_for_analysis(url)``, or ``orthosphere.store.open_store``)
and streams over it with Dask: per block of samples it reduces the activations to small float64
partial sums, summed as a tree (a ``distributed.Client`` made the default runs them on its cluster).
Nothing ever holds a whole variable in memory. ``analyze`` (``run_analyses`` on an opened store) plans the
chosen analyses together: one Dask computation per pass runs all of them, so each chunk of the store is read
once per pass (pass 1: accuracy aside, norms, subspaces, neighbours, norm_geometry, replay; the spheres then read
the fit of the subspaces, without a pass of their own). Each pass logs its progress (share
of tasks done, time, an estimate of the time left) on the ``orthosphere.analyze`` logger. NaN or Inf
in any activation an analysis reads stops it with ``NonFiniteError`` naming the variable, layers and
samples.

    import orthosphere
    tree = orthosphere.analyze("runs/store.zarr", "runs/results.zarr", analyses=["norms", "subspaces"],
                               layers=[0, 1], subspaces={"factors": ["digit_value[role=digit]", "pos"]})
    tree = orthosphere.analyze.open_results("runs/results.zarr")   # xr.open_datatree(url, engine="zarr")

``orthosphere.analyze(store, out=None, *, analyses=None, overwrite=False, storage_options=None,
out_storage_options=None, command=None, **options)`` (``orthosphere.analyze.analyze``, the same function:
``api.py``) takes the analyses by name (a list, or one string "norms,replay") and their options as
keywords: a keyword goes to every chosen analysis that takes it (``layers``, ``exclude_start``,
``seed``, ...), and a keyword named after an analysis, with a dict, to that analysis only (its value
wins over a shared one). ``results.configure`` turns them into one configuration per analysis (name
-> Config), which ``run_analyses(dataset, configs)`` runs on an opened store; options given as text
(KEY=VALUE, KEY "analysis.option" for one analysis) are read into this nested form once
(``options.parse_options``).

The analyses
(``ANALYSES``, run in this order: name -> ``registry.Analysis``, an object that declares its
configuration, what it reads and needs, the earlier results it takes and how it starts its work) and
their options, each declared once in its configuration class (a typed dataclass whose parameters
carry their default, constraints and help: see ``orthosphere.params``; ``NormsConfig.parameters()``
lists them). Calling an analysis runs it alone, ``norm_spread(dataset, mass=0.5)``; a refused value is
an ``AnalysisParameterError`` naming the option as the caller gave it:

- ``norms`` (``NormsConfig``): ``norm_spread(dataset, *, sites, layers, weight_by_attention, exclude_start, mass,
  quantiles, ratio_max, ratio_bins, device)``
- ``subspaces`` (``SubspacesConfig``): ``factor_subspaces(dataset, *, site, factors, layers, exclude_start, estimator,
  intercepts, rank, rank_significance, relevance_floor, max_classes, n_bootstrap, bootstrap_groups, group_by, confidence, n_null,
  significance, seed, independence_deg, orthogonality_deg, radius_cv_tolerance)``, the parameters of
  the estimator ``FactorSubspaces`` (``FactorSubspaces(...).fit(dataset)``; see ``subspaces.py``,
  ``design.py`` for the fit and ``inference.py`` for the statistics)
- ``spheres`` (``SpheresConfig``: those of SubspacesConfig, None by default): ``sphere_structure(dataset, *,
  subspaces, <the parameters of FactorSubspaces>)``:
  with ``subspaces`` (a fitted FactorSubspaces; a run passes that of its subspaces analysis) its fit
  (fit options given besides must agree); else fitted here
- ``neighbours`` (``NeighboursConfig``): ``neighbours(dataset, *, site, step_site, layers, exclude_start)``
- ``norm_geometry`` (``NormGeometryConfig``): ``norm_geometry(dataset, *, site, layers, n_top, sink_threshold,
  sparse_threshold, min_keys, interval_groups, interval_draws, confidence, seed, device)`` (massive
  activations, attention sinks, residual norm growth, norm_scale spread, sparse attention; see its module)
- ``replay`` (``ReplayConfig``): ``orthosphere.analyze.replay.replay(dataset, *, levels, n_draws, seed, distribution, targets,
  sparse_threshold, min_keys, smooth_draws, collapse_target, n_bootstrap, confidence, group_by, layers, n_bins,
  device)``
  (norm-perturbation replay; see its module)

Views for notebooks: importing this package registers the xarray accessor ``ds.ortho`` (``views.py``):
``ds.ortho.attn_scores(layer, head)``, ``ds.ortho.pattern(layer, head)`` and ``ds.ortho.z(layer, head)``,
lazy and exact, named as TransformerLens's ``hook_attn_scores``, ``hook_pattern`` and ``hook_z``.

``device`` (norms, replay): where the dense attention work runs, numpy on the CPU by default or torch
on a GPU (``orthosphere.analyze.device``).

Conventions: the analysed tokens are the valid ones, without each sequence's start token (its first
valid position) unless ``exclude_start=False``. A factor is ``LABEL`` or ``LABEL[KEY=V1|V2,...]``
over the store's label coordinates or ``pos`` (see ``factors.py``). Default factors: the task's own
(arithmetic: ``digit_value[role=digit]``, ``operand[role=digit]``, ``pos``); for text (a store
labelled ``token_str``) ``token_str`` and ``pos``; else every label and ``pos``. A factor keeps at
most ``max_classes`` classes (64): its ``max_classes - 1`` most frequent, the rest pooled into one
class "<N other classes>" (ties: the smaller value kept); ``max_classes=None`` keeps all. The
default ``estimator="joint"`` fits all factors together (tokens where a factor does not apply get
their own intercept per pattern of applying factors), ``"marginal"`` takes each factor's class
means alone. Angles are in degrees.

Results format (version 1): an ``xarray.DataTree`` in a Zarr v3 group at a local path or fsspec URL
(``memory://``, ``s3://``), one sub-group per analysis, written node by node with
``Dataset.to_zarr``; readers see the groups listed in the root's consolidated metadata. Writing to
existing results of the same store replaces only the groups of the analyses just run: a group being
replaced is first dropped from that list, new groups are written beside the listed ones and then
listed in one write of the root, so a crash loses at most the analyses being written.

``/`` attrs: ``orthosphere_results`` (1), ``store`` (URL), ``model``, ``task`` (the store's
descriptions), ``store_provenance``, ``provenance`` (package version, git commit, command, created),
``analyses`` (groups present). Every analysis group's attrs add ``analysis``, ``options`` (every
option's value, defaults included), ``store`` and ``provenance`` of the run that wrote it.

``/norms/<site>``, one group per site; dims ``layer``, ``G``, ``quantile``, ``ratio``, where ``G``
is ``head`` when weighted by attention, else none for residual sites (per layer), ``head`` for q
and ``kv_head`` for k, v:
  median_norm (layer, G)                 weighted median of |x|
  band (layer, G)                        half-width p: |x| / median within [1 - p, 1 + p] holds `mass`
  band_layer (layer)                     the same p for the ratios of the layer's groups G pooled: each
                                         group's |x| over its own median_norm, every token with its weight
                                         (attention received, or 1), i.e. the groups' histograms added,
                                         each group counting with its weight_total; without G the layer's band
  band_pooled ()                         the same pooled over every layer and group (the report's headline)
  ratio_quantile (layer, G, quantile)    quantiles of |x| / median
  histogram (layer, G, ratio)            share of the weight per bin of |x| / median (bin centres)
  beyond (layer, G)                      share of the weight past ratio_max
  weight_total (layer, G)                total weight (tokens, or attention received)
  attrs: site, group, weighting ("attention" | "uniform"), attention_source ("stored pattern" |
  "recomputed from q, k" | "none"), mass, exclude_start, ratio_bin_width, normalised_by (the
  model's norm whose output the site is, e.g. "rms norm per head" for q of a QK-Norm model; ""
  when none: see ``orthosphere.analyze.description``)

``/subspaces``; dims ``layer``, ``factor``, ``other`` (the factors again), ``component``,
``basis_vector``, ``d_model``, ``angle`` (principal angle index, ascending), ``bound`` ("low", "high"),
``claim`` ("orthogonal", "dependent", "independent"), ``head``, ``kv_head``; NaN pads ranks and angles
that do not exist (and the diagonal factor == other). Noise draws: ``n_bootstrap`` sign flips of the
corrected influences of ``bootstrap_groups`` groups of resampling units (``inference.py``; ``units.py``: documents,
across the packed windows they span, when the store has ``document``; else samples, or the values of ``group_by``).
Every p-value and interval's description says the correction it enters or that it is uncorrected
(``multiplicity.py``):
  n_classes, n_tokens (factor)           classes (the pooled one included) and tokens each factor is read on
  pooled_classes, pooled_tokens (factor) classes pooled into one beyond max_classes or held by one group
  label_nmi (factor, other)              normalised mutual information of the two labels on the tokens
                                         both read (0 unrelated, 1 each determines the other)
  shared_tokens (factor, other)          tokens both factors read
  variance_inflation (factor)            noise of the joint fit's centred effects over that of a fit of the
                                         factor alone (1: balanced crossed design; NaN: marginal estimator)
  condition_number ()                    of the unit-diagonal Z'Z beyond its trivial null directions (joint
                                         fit; above 100 a warning is logged)
  subspace_rank (layer, factor)          the rank that decides basis, angles, claims and spheres (attrs
                                         rank_rule): the fixed rank, or the significant directions that carry
                                         at least relevance_floor of the factor's between-class variance; 0
                                         when the structure test is not shown (then its angles are NaN)
  outlier_tokens (layer)                 analysed tokens of norm above 10 times their block's median (sinks):
                                         counted, not left out
  rounding_bias (layer)                  the store dtype's rounding of a class mean over the mean's noise
                                         (above 1: the rounding, not the noise, sets the class means' error)
  rounding_inflation (layer)             by how much the draws' variance grows, on average, to carry that
                                         rounding (1: it averages away)
  unit_shared_noise (layer)              the share of a token's noise that its resampling unit's tokens share
                                         (a random effect per document), estimated from the groups' residual
                                         sums (whitened where the tests are); the influences' correction
                                         assumes it (joint estimator)
  effective_groups (layer)               Kish's effective number of bootstrap groups at that share; where the
                                         share is above 0 and this below 10 the layer's relations and sphere
                                         verdicts are withheld (undetermined) and logged
  significance_rank (layer, factor)      directions standing above noise (deflated parallel analysis of the
                                         effects, whitened where the noise is anisotropic; each step at
                                         rank_significance), before the floor
  variance_share, site_variance_share (layer, factor, component)   each direction's noise-corrected
                                         variance over that of the significant directions, and over the
                                         site's total variance on the factor's tokens
  singular_value (layer, factor, component)   of the sqrt(n_c)-weighted centred effects (joint or marginal)
  whitened_singular_value (layer, factor, component)   the same in coordinates whitened by the noise
                                         covariance where it is anisotropic (the analysed tokens' covariance
                                         around the joint fit, OAS-shrunk)
  whitened (layer)                       whether the layer's noise is anisotropic: structure tests and ranks
                                         judged, and bases estimated, whitened and mapped back, the noise
                                         draws' too (inference.ANISOTROPY)
  whitening_understatement (layer)       the factor raising the structure test's null and the rank's noise
                                         there: whitened by their own covariance, the residuals' influences
                                         understate the effects' noise by m / (m - d_eff - 1); 1 unwhitened
  noise_singular_value (layer, factor, component)   what each step of the rank's test compared the
                                         whitened singular value with
  explained (layer, factor, component)   cumulative share of their variance
  between_fraction (layer, factor)       their variance / total variance of the factor's tokens
  structure_p, structure_q (layer, factor)   p-value of "the labels carry no information" (add-one over
                                         n_null sign-flip draws) and adjusted over every layer and factor
                                         (Benjamini-Hochberg); NaN without a null
  basis (layer, factor, d_model, basis_vector)   orthonormal basis of the subspace
  angles, angles_estimate (layer, factor, other, angle)   principal angles, and corrected for the noise's
                                         bias (median-unbiased; the extremes kept inside their intervals)
  min_angle, min_angle_estimate, min_angle_ci (layer, factor, other[, bound])   the smallest angle, its
                                         estimate and its `confidence` interval (inverted from draws)
  max_angle, max_angle_estimate, max_angle_ci   the same for the largest angle
  overlap (layer, factor, other)         mean squared cosine of the angles (0 orthogonal, 1 nested)
  null_angles, null_angles_ci (layer, factor, other, angle[, bound])   median and central 1 - significance
                                         interval of the angles between factor's noise-only subspace (same
                                         rank) and other's fitted one: what chance gives
  null_min_angle, null_min_angle_ci (layer, factor, other[, bound])   the same for the smallest angle
  claim_p, claim_q (layer, factor, other, claim)   p-value of each claim at its null's boundary, and
                                         adjusted over every claim of the run (Benjamini-Hochberg)
  relation (layer, factor, other)        "no structure" | "below relevance floor" | "orthogonal" |
                                         "dependent" | "independent" | "undetermined" | "" without draws
                                         (attrs relation_rule)
  q_angles, q_min_angle, q_overlap (layer, factor, head, ...)
  k_angles, ... (layer, factor, kv_head, ...)   the same with each head's read subspace, the column
                                         space of w_q[h] (w_k[g]) in the space of attn_in; present
                                         only when the store holds weights (point estimates)
  attrs: site, factors, estimator, intercepts, classes ({factor: [values]}), fit (the fit's options),
  head_angles, relation_rule, rank_rule, n_bootstrap, bootstrap_groups, confidence, n_null, significance, seed,
  independence_deg, orthogonality_deg; group_by (the label tying tokens into resampling units, "sample" for
  one sample a unit), n_units, occupied_groups (groups holding a unit: fewer than bootstrap_groups when the
  units are few, which is also logged); each variable's ``description``

``/spheres``; dims ``layer``, ``factor``, ``other``, ``bound``, ``sphere_claim`` ("on", "off"),
``class_index`` (a factor's classes, in the order of attrs classes):
  subspace_rank (layer, factor)
  radius_mean, radius_cv (layer, factor) token-weighted mean and coefficient of variation of the norms
                                         of the factor's class points U'(mean + E[c]) (class means on its
                                         subspace, each class effect's noise taken from its radius squared)
  radius_cv_estimate, radius_cv_ci (layer, factor[, bound])   corrected for the noise's bias, interval
  sphere_null_p (layer, factor)          p-value of "exactly on a sphere"
  sphere_claim_p, sphere_claim_q (layer, factor, sphere_claim)   the claims radius_cv below / above
                                         radius_cv_tolerance; q: the claim on the side of the measurement
                                         adjusted over layers and factors (Benjamini-Hochberg), NaN for the other
  sphere (layer, factor)                 "on sphere" | "off sphere" | "undetermined" | "no structure" |
                                         "below relevance floor" | ""
  sphere_classes (factor)                classes in the radius statistics: all but a pooled one; 0 when
                                         the factor's classes are ranges of positions or fewer than three
                                         (attrs sphere_refused)
  class_radius (layer, factor, class_index)
  cross_term, cross_term_ci, cross_term_null_ci, cross_term_p (layer, factor, other[, bound])   RMS cosine
                                         of the two components' class points over their shared tokens, each
                                         token weighted by |x_a|^2 |x_b|^2: sqrt(mean (x_a . x_b)^2 / mean
                                         |x_a|^2 |x_b|^2), in [0, 1], 0 for orthogonal subspaces; its
                                         interval, its null (orthogonal subspaces) and p-value (uncorrected)
  min_angle, min_angle_estimate, min_angle_ci, relation   the departure from orthogonality, as in /subspaces
  attrs: site, factors, estimator, intercepts, classes, sphere_rule, sphere_refused ({factor: reason}), fit,
  subspaces ("from the subspaces results" | "fitted here"), radius_cv_tolerance, confidence, significance, n_bootstrap

``/neighbours``; dim ``layer``: rank_collapse, rank_collapse_std (over sequences), angular_step,
angular_step_std (degrees, over tokens), log_norm_ratio, log_norm_ratio_std (log |post| / |pre|),
n_sequences, n_tokens; attrs: site, step_site, angle_unit, exclude_start.

``/norm_geometry``; dims ``layer``, ``d_model``, ``pos``, ``head``, ``top``, ``bound``; each variable's
``description`` gives its definition and source (``norm_geometry.py``); intervals (``*_ci``) are percentile
bootstraps over ``interval_groups`` groups of consecutive samples:
  massive_max, massive_median, massive_ratio (layer)   largest |x_i| of `site` over valid tokens and
                                         dimensions, the median |x_i|, their ratio (Sun et al. 2024)
  dimension_max (layer, d_model), position_max (layer, pos)   largest |x_i| per dimension, per position
  top_dimension, top_dimension_value (layer, top)   the n_top dimensions with the largest |x_i|
  max_position (layer)                   the position holding massive_max
  start_norm_ratio[_ci] (layer)          mean |x| of start tokens over that of the others
  median_norm, norm_growth (layer)       median |x| (no start token) and its growth from the previous layer
  growth_per_layer[_ci] ()               exp of the change of mean log |x| per layer, first to last layer
  norm_scale_cv[_ci] (layer), norm_scale_cv_pooled[_ci] ()   CV of norm_scale within sequences (when stored)
  sink_attention (layer, head)           mean attention of the analysed queries on the start token
  sink_share[_ci] (layer), sink_share_pooled[_ci] ()   share of heads with sink_attention > sink_threshold
  sparse_share[_ci] (layer), sparse_share_pooled[_ci] ()   share of (query, head) pairs, queries with at
                                         least min_keys keys, whose largest attention >= sparse_threshold
  attrs: site, attention_source, norm_scale, interval_groups, interval_draws, confidence, sink_threshold, sparse_threshold,
  min_keys (sink and sparse variables are absent without attention, norm_scale ones without norm_scale)

``/replay``: see ``orthosphere.analyze.replay``.
"""
import sys
import types

from .api import analyze
from .attention import ScoreTerms, attention_from_qk, store_attention
from .errors import AnalysisError, NonFiniteError
from .factors import Factor
from .inputs import open_for_analysis
from .neighbours import neighbours
from .norms import norm_spread
from .results import ANALYSES, configure, open_results, run_analyses, write_results
from .spheres import sphere_structure
from .subspaces import FactorSubspaces, factor_subspaces
from .views import OrthoAccessor

__all__ = [
    "ANALYSES",
    "AnalysisError",
    "Factor",
    "FactorSubspaces",
    "NonFiniteError",
    "OrthoAccessor",
    "ScoreTerms",
    "analyze",
    "attention_from_qk",
    "configure",
    "factor_subspaces",
    "neighbours",
    "norm_spread",
    "open_for_analysis",
    "open_results",
    "run_analyses",
    "sphere_structure",
    "store_attention",
    "write_results",
]


class _AnalyzePackage(types.ModuleType):
    """This package, callable as its function ``analyze``."""

    def __call__(self, *args, **kwargs):
        return analyze(*args, **kwargs)


sys.modules[__name__].__class__ = _AnalyzePackage
