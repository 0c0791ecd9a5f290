"""Sphere structure: how far the representation is from the paper's orthogonal spheres (Theorem 2).

Pre-Norm keeps factor subspaces independent only if every component has a constant norm (each
factor's representations lie on a sphere) and the components are mutually orthogonal. With a
fitted ``FactorSubspaces`` (by default the joint fit, so that correlated labels do not tilt the
bases), three separate quantities measure this, each with a noise null and an interval from the
fit's noise draws (``inference``):

- **radius spread** of each factor: its class points, the orthogonal projections U'(mean + E[c])
  of its class means (within-class noise averaged out, what remains of it taken from the radii
  squared) onto its fitted subspace, and the coefficient of variation of their norms over classes
  (token-weighted): 0 on a sphere. ``sphere``: "on sphere" when the spread is shown below
  ``radius_cv_tolerance``, "off sphere" when above: the claim on the side of the measurement is
  tested, after Benjamini-Hochberg's correction over every layer and factor (``directional_q``;
  "undetermined" otherwise, "no structure" without a subspace, "below relevance floor" when its structure
  is shown but no significant direction reaches ``relevance_floor``);
- **departure from orthogonality** of each pair: the smallest principal angle of the two fitted
  subspaces, with its noise-corrected estimate and interval (as in ``/subspaces``);
- **cross term** of each pair: the RMS cosine between the class points of the two components over
  the tokens both factors read, each token weighted by |x_a|^2 |x_b|^2, i.e.
  sqrt(mean (x_a . x_b)^2 / mean |x_a|^2 |x_b|^2): within [0, 1] whatever the norms do (a ratio of
  the two means' roots would exceed 1 where the norms correlate), 0 for orthogonal subspaces, with an
  interval and its null (draws around orthogonal subspaces).

The spheres need no pass over the store of their own: they read the fit of the subspaces (given,
as ``run_analyses`` passes that of the same run, or fitted here).
"""
from __future__ import annotations

import numpy as np
import xarray as xr

from .errors import AnalysisError
from .inference import SPHERE_CLAIMS, benjamini_hochberg
from .multiplicity import state_multiplicity
from .options import as_attrs
from .plan import Plan
from .registry import Analysis, describe
from .subspaces import BELOW_FLOOR, BOUNDS, FactorSubspaces, SubspacesConfig, below_floor, factor_subspaces

SPHERE_RULE = ("no structure: the factor has rank 0 (subspaces' subspace_rank) and no direction above noise, or its "
               "structure is not shown; below relevance floor: rank 0 because its significant directions each carry less "
               "than relevance_floor of its between-class variance; on sphere / off sphere: the claim that radius_cv is below / above "
               "radius_cv_tolerance, the one on the side of the measurement (the smaller p-value), shown at "
               "significance after Benjamini-Hochberg's correction over every layer and factor, over the classes of "
               "sphere_classes (a pooled class never enters the radius statistics); undetermined: neither, or the "
               "factor's classes cannot show a sphere (attrs sphere_refused gives the reason: binned positions, fewer than "
               "three classes); "
               "empty without noise draws")


SpheresConfig = SubspacesConfig.optional("SpheresConfig", """The options of ``spheres``: the parameters of the fit
they read (SubspacesConfig), each None by default: as the subspaces of the same run were fitted (or,
fitting their own, SubspacesConfig's default).""")


def plan_sphere_structure(dataset: xr.Dataset, config: SpheresConfig, *, subspaces: FactorSubspaces | None = None) -> Plan:
    """Radius spread, departure from orthogonality and cross terms of the factors' components, per layer.

    subspaces: a fitted FactorSubspaces whose fit the spheres read; the options given (not None)
    must agree with it. Without it, the subspaces are fitted here with those options.
    """
    given = {name: value for name, value in config.as_dict().items() if value is not None}
    if subspaces is not None:
        return Plan({}, lambda computed: sphere_dataset(_fitted_subspaces(subspaces, given), "from the subspaces results"))
    first = FactorSubspaces(**given).plan(dataset)
    return Plan(first.lazy, lambda computed: sphere_dataset(first.finish(computed), "fitted here"))


def _fitted_subspaces(subspaces, given: dict) -> FactorSubspaces:
    """The given fitted subspaces, checked against the fit options the spheres were given."""
    if not isinstance(subspaces, FactorSubspaces) or not hasattr(subspaces, "fits_"):
        raise AnalysisError(
            f"spheres take fitted subspaces (FactorSubspaces(...).fit(dataset)), got {type(subspaces).__name__}: "
            "fit them first, or pass none and let the spheres fit their own"
        )
    fitted = subspaces.fit_options
    different = {name: (value, fitted[name]) for name, value in as_attrs(given).items() if fitted.get(name) != value}
    if different:
        raise AnalysisError(
            "the spheres were given subspaces fitted otherwise than they were asked for ("
            + "; ".join(f"{name}: asked {asked!r}, fitted {found!r}" for name, (asked, found) in different.items())
            + "): give those options to both analyses (a plain option, not spheres.OPTION), or pass no subspaces"
        )
    return subspaces


sphere_structure = Analysis("spheres", SpheresConfig, plan_sphere_structure, takes=("subspaces",),
                            reads=factor_subspaces.reads, summary="how far the factors' components are from orthogonal spheres")


def sphere_dataset(fitted: FactorSubspaces, source: str) -> xr.Dataset:
    """The results group /spheres of a fitted FactorSubspaces (`source`: where the fit came from)."""
    layers, names = fitted.layers_, fitted.factors_
    fits = [fitted.fits_[layer] for layer in layers]
    n_layers, n_factors = len(layers), len(names)
    sizes = [fitted.classes_[name].size for name in names]
    per_factor = {name: np.full((n_layers, n_factors), np.nan) for name in
                  ("radius_mean", "radius_cv", "radius_cv_estimate", "sphere_null_p")}
    radius_cv_ci = np.full((n_layers, n_factors, 2), np.nan)
    claim_p = np.full((n_layers, n_factors, len(SPHERE_CLAIMS)), np.nan)
    class_radius = np.full((n_layers, n_factors, max(sizes)), np.nan)
    for i, fit in enumerate(fits):
        for a, factor in enumerate(fit.factors):
            if factor.radii is None:
                continue
            classes = fitted.classes_[names[a]]
            kept = np.where(classes.sphere_classes, classes.counts, 0)
            weights = kept / kept.sum() if kept.sum() else kept
            class_radius[i, a, : len(factor.radii)] = factor.radii
            per_factor["radius_mean"][i, a] = factor.radii @ weights if kept.sum() else np.nan
            for name in ("radius_cv", "radius_cv_estimate", "sphere_null_p"):
                per_factor[name][i, a] = getattr(factor, name)
            radius_cv_ci[i, a] = factor.radius_cv_ci
            claim_p[i, a] = factor.sphere_p
    claim_q = directional_q(claim_p)
    subspaces = fitted.to_dataset()
    rank = subspaces["subspace_rank"].values
    pairs = {name: np.full((n_layers, n_factors, n_factors) + shape, np.nan)
             for name, shape in (("cross_term", ()), ("cross_term_ci", (2,)), ("cross_term_null_ci", (2,)),
                                 ("cross_term_p", ()))}
    for i, fit in enumerate(fits):
        for (a, b), pair in fit.pairs.items():
            for name in pairs:
                pairs[name][i, a, b] = pairs[name][i, b, a] = getattr(pair, name)
    lf, lfo = ("layer", "factor"), ("layer", "factor", "other")
    data = {
        "subspace_rank": (lf, rank),
        "sphere_classes": (("factor",), [int(fitted.classes_[name].sphere_classes.sum()) for name in names]),
        **{name: (lf, values) for name, values in per_factor.items()},
        "radius_cv_ci": (lf + ("bound",), radius_cv_ci),
        "sphere_claim_p": (lf + ("sphere_claim",), claim_p),
        "sphere_claim_q": (lf + ("sphere_claim",), claim_q),
        "sphere": (lf, _verdicts(rank, claim_q, fitted.significance, bool(fitted.n_bootstrap),
                                 below_floor(rank, subspaces["significance_rank"].values, subspaces["structure_q"].values,
                                             fitted.significance))),
        "class_radius": (lf + ("class_index",), class_radius),
        "cross_term": (lfo, pairs["cross_term"]),
        "cross_term_ci": (lfo + ("bound",), pairs["cross_term_ci"]),
        "cross_term_null_ci": (lfo + ("bound",), pairs["cross_term_null_ci"]),
        "cross_term_p": (lfo, pairs["cross_term_p"]),
        **{name: subspaces[name].variable for name in ("min_angle", "min_angle_estimate", "min_angle_ci", "relation")},
    }
    coords = {"layer": layers, "factor": np.array(names, dtype=object), "other": np.array(names, dtype=object),
              "bound": np.array(BOUNDS, dtype=object), "sphere_claim": np.array(SPHERE_CLAIMS, dtype=object)}
    attrs = {"site": fitted.site_, "factors": names, "estimator": fitted.estimator,
             "intercepts": fitted.intercepts_ or "none", "classes": {name: fitted.classes_[name].names for name in names},
             "sphere_rule": SPHERE_RULE, "fit": fitted.fit_options, "subspaces": source,
             "sphere_refused": {name: fitted.classes_[name].sphere_refusal for name in names
                                if fitted.classes_[name].sphere_refusal},
             **{name: getattr(fitted, name) for name in ("radius_cv_tolerance", "confidence", "significance", "n_bootstrap")}}
    result = xr.Dataset(data, coords=coords, attrs=as_attrs(attrs))
    return state_multiplicity(describe(result, DESCRIPTIONS), "spheres")  # min_angle ... relation: described in /subspaces


def directional_q(claim_p: np.ndarray) -> np.ndarray:
    """(..., claim) q-values of the claim on the side of each measurement (the smaller p-value of "on" and
    "off"; the other is NaN: not tested), adjusted by Benjamini-Hochberg over one claim per layer and
    factor. Each claim's own error rate stays at its level (a claim on the wrong side of the tolerance is
    chosen only when its p-value is the smaller), so the two claims of a factor count as one test, as a
    directional decision does; only a radius spread exactly at the tolerance, where both claims are
    false, could be claimed at up to twice the rate."""
    tested = np.isfinite(claim_p).all(axis=-1, keepdims=True)
    chosen = np.arange(claim_p.shape[-1]) == np.argmin(np.where(tested, claim_p, 0.0), axis=-1)[..., None]
    return benjamini_hochberg(np.where(tested & chosen, claim_p, np.nan))


def _verdicts(rank: np.ndarray, claim_q: np.ndarray, significance: float, drawn: bool, floored: np.ndarray) -> np.ndarray:
    """(layer, factor) sphere verdicts (see SPHERE_RULE); floored: the factors below the relevance floor."""
    shown = claim_q <= significance
    verdict = np.select([shown[..., 0], shown[..., 1]], ["on sphere", "off sphere"], "undetermined")
    verdict = np.where(rank > 0, verdict, np.where(floored, BELOW_FLOOR, "no structure"))
    return np.where(drawn, verdict, "").astype(object)


DESCRIPTIONS = {
    "subspace_rank": "the rank of the factor's fitted subspace, as in /subspaces (0: no structure, no sphere statistics)",
    "sphere": "the verdict on the factor's radius spread (the paper's Theorem 2: Pre-Norm keeps factor subspaces "
              "independent only on orthogonal spheres): 'on sphere', 'off sphere', 'undetermined', 'no structure', "
              "'below relevance floor', or "
              "'' without noise draws (attrs sphere_rule)",
    "radius_mean": "token-weighted mean norm of the factor's class points (projections of its class means onto its "
                   "subspace), each class effect's noise taken from its radius squared",
    "radius_cv": "coefficient of variation of those norms over classes (token-weighted): 0 on a sphere",
    "radius_cv_estimate": "radius_cv less the median bias of the draws around the fit (at least 0)",
    "radius_cv_ci": "confidence interval of the radius spread, inverted from draws around truths of scaled spread",
    "sphere_null_p": "p-value of 'exactly on a sphere' (draws around the class points moved onto a sphere)",
    "sphere_claim_p": "p-values of the claims 'on sphere' (radius spread below radius_cv_tolerance) and 'off sphere'",
    "sphere_claim_q": "the p-value of the claim on the side of the measurement (the smaller) adjusted for the "
                      "false-discovery rate over every layer and factor (Benjamini-Hochberg); NaN for the other claim",
    "class_radius": "norm of each class point (classes in the order of attrs classes)",
    "sphere_classes": "classes in the radius statistics: every class but a pooled one; 0 when the factor's classes "
                      "cannot show a sphere (attrs sphere_refused)",
    "cross_term": "RMS cosine between the class points of two components over the tokens both read, each token "
                  "weighted by |x_a|^2 |x_b|^2: sqrt(mean (x_a . x_b)^2 / mean |x_a|^2 |x_b|^2), within [0, 1], 0 for "
                  "orthogonal subspaces",
    "cross_term_ci": "basic bootstrap interval of the cross term (draws around the fit)",
    "cross_term_null_ci": "central 1 - significance range of the cross term when the subspaces are orthogonal",
    "cross_term_p": "p-value of 'the subspaces are orthogonal' from the cross term (draws around orthogonal subspaces)",
    "sphere_claim": "the claims on a factor's radius spread: on (radius_cv below radius_cv_tolerance), off (above it)",
}
