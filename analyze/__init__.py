"""orthosphere.analyze: the paper's geometric questions answered from a store, without the model.

Every analysis takes a store opened lazily (``open_for_analysis(url)``, or ``orthosphere.store.open_store``)
and streams over it with Dask: per block of samples it reduces the activations to small float64
partial sums, summed as a tree and computed once (``dask.compute``; a ``distributed.Client`` made the
default runs them on its cluster). Nothing ever holds a whole variable in memory. NaN or Inf in any
activation an analysis reads stops it with ``NonFiniteError`` naming the variable, layers and samples.

    from orthosphere.analyze import analyze, open_results
    tree = analyze("runs/store.zarr", "runs/results.zarr", only=["norms", "subspaces"],
                   options={"layers": [0, 1], "factors": ["digit_value[role=digit]", "pos"]})
    tree = open_results("runs/results.zarr")          # xr.open_datatree(url, engine="zarr")

``options`` is one dict: a key goes to every chosen analysis that takes that keyword (``layers``,
``exclude_start``, ``seed``, ...), a key ``"analysis.option"`` only to that analysis. The analyses
(``ANALYSES``, run in this order) and their options, the keyword parameters of their functions:

- ``norms``: ``norm_spread(dataset, *, sites, layers, weight_by_attention, exclude_start, mass,
  quantiles, ratio_max, ratio_bins)``
- ``subspaces``: ``factor_subspaces(dataset, *, site, factors, layers, exclude_start, rank_threshold,
  rank, n_bootstrap, bootstrap_groups, confidence, seed, independence_deg, orthogonality_deg)``
- ``spheres``: ``sphere_structure(dataset, *, site, factors, layers, exclude_start, rank_threshold,
  rank, mass, quantiles, ratio_max, ratio_bins)`` (bases from ``subspaces`` of the same run when
  fitted the same way)
- ``neighbours``: ``neighbours(dataset, *, site, step_site, layers, exclude_start)``
- ``replay``: ``orthosphere.analyze.replay.replay`` (norm-perturbation replay; see its module)

Conventions: the analysed tokens are the valid ones, without each sequence's start token (its first
valid position) unless ``exclude_start=False``. A factor is ``LABEL`` or ``LABEL[KEY=V1|V2,...]``
over the store's label coordinates or ``pos`` (see ``factors.py``). Angles are in degrees.

Results format (version 1): an ``xarray.DataTree`` written with ``DataTree.to_zarr`` to a local
path or fsspec URL (``memory://``, ``s3://``); writing to existing results of the same store replaces
only the groups of the analyses just run.

``/`` attrs: ``orthosphere_results`` (1), ``store`` (URL), ``model``, ``task`` (the store's
descriptions), ``store_provenance``, ``provenance`` (package version, git commit, command, created),
``analyses`` (groups present). Every analysis group's attrs add ``analysis``, ``options`` (every
option's value, defaults included), ``store`` and ``provenance`` of the run that wrote it.

``/norms/<site>``, one group per site; dims ``layer``, ``G``, ``quantile``, ``ratio``, where ``G``
is ``head`` when weighted by attention, else none for residual sites (per layer), ``head`` for q
and ``kv_head`` for k, v:
  median_norm (layer, G)                 weighted median of |x|
  band (layer, G)                        half-width p: |x| / median within [1 - p, 1 + p] holds `mass`
  ratio_quantile (layer, G, quantile)    quantiles of |x| / median
  histogram (layer, G, ratio)            share of the weight per bin of |x| / median (bin centres)
  beyond (layer, G)                      share of the weight past ratio_max
  weight_total (layer, G)                total weight (tokens, or attention received)
  attrs: site, group, weighting ("attention" | "uniform"), attention_source ("stored pattern" |
  "recomputed from q, k" | "none"), mass, exclude_start, ratio_bin_width

``/subspaces``; dims ``layer``, ``factor``, ``other`` (the factors again), ``component``,
``basis_vector``, ``d_model``, ``angle`` (principal angle index, ascending), ``bound`` ("low", "high"),
``head``, ``kv_head``; NaN pads ranks and angles that do not exist (and the diagonal factor == other):
  n_classes (factor), n_tokens (factor)  classes and tokens each factor is read on
  subspace_rank (layer, factor)          chosen rank
  singular_value (layer, factor, component)   of the sqrt(n_c)-weighted centred class means
  explained (layer, factor, component)   cumulative share of the between-class variance
  between_fraction (layer, factor)       between-class variance / total variance of its tokens
  basis (layer, factor, d_model, basis_vector)   orthonormal basis of the subspace
  angles, angles_ci (layer, factor, other, angle[, bound])   principal angles, bootstrap interval
  min_angle, min_angle_ci (layer, factor, other[, bound])    the smallest angle (independence)
  overlap (layer, factor, other)         mean squared cosine of the angles (0 orthogonal, 1 nested)
  relation (layer, factor, other)        "dependent" | "independent" | "orthogonal" (from min_angle)
  q_angles, q_angles_ci, q_min_angle, q_min_angle_ci, q_overlap (layer, factor, head, ...)
  k_angles, ... (layer, factor, kv_head, ...)   the same with each head's read subspace, the column
                                         space of w_q[h] (w_k[g]) in the space of attn_in; present
                                         only when the store holds weights
  attrs: site, factors, classes ({factor: [values]}), fit (what fixes the bases), head_angles,
  n_bootstrap, bootstrap_groups, seed, confidence, independence_deg, orthogonality_deg

``/spheres``; dims ``layer``, ``factor``, ``other``, ``part`` (the factors and "rest"),
``quantile``, ``ratio``, ``d_model``:
  n_tokens ()                            tokens read by every factor
  subspace_rank (layer, factor)
  radius_mean, radius_cv (layer, factor) mean and coefficient of variation of |x_a|
  radius_median, band, ratio_quantile, histogram, beyond, weight_total   spread of |x_a| around its
                                         median, as in /norms
  sphere_radius, sphere_centre (.., d_model), centre_offset (|centre| / radius), fit_residual
                                         algebraic sphere fit of the points x_a
  cross_term_mean, cross_term_rms (layer, factor, other)   x_a . x_b
  part_norm_sq_mean, part_norm_sq_variance (layer, part)   of |x_part|^2
  cross_term_second_moment (layer)       E[c^2], c = 2 sum_{a<b} x_a . x_b
  norm_sq_mean, norm_sq_variance (layer) of |x|^2
  deviation (layer)                      sqrt(sum_parts Var |x_part|^2 + E[c^2]) / E|x|^2: 0 for
                                         perfect orthogonal spheres
  radius_share (layer, part), cross_term_share (layer)   split of the deviation's square
  attrs: site, factors, bases ("from the subspaces results" | "fitted here"), mass, exclude_start

``/neighbours``; dim ``layer``: rank_collapse, rank_collapse_std (over sequences), angular_step,
angular_step_std (degrees, over tokens), log_norm_ratio, log_norm_ratio_std (log |post| / |pre|),
n_sequences, n_tokens; attrs: site, step_site, angle_unit, exclude_start.

``/replay``: see ``orthosphere.analyze.replay``.
"""
from .attention import attention_from_qk, store_attention
from .errors import AnalysisError, NonFiniteError
from .factors import Factor
from .inputs import open_for_analysis
from .neighbours import neighbours
from .norms import norm_spread
from .results import ANALYSES, analyze, open_results, run_analyses, write_results
from .spheres import sphere_structure
from .subspaces import FactorSubspaces, factor_subspaces

__all__ = [
    "ANALYSES",
    "AnalysisError",
    "Factor",
    "FactorSubspaces",
    "NonFiniteError",
    "analyze",
    "attention_from_qk",
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
