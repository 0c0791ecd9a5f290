"""What every p-value and interval of the results is corrected for, said where users read it.

Each entry of ``STATEMENTS`` is appended to its variable's description (``state_multiplicity``):
either the correction it enters (Benjamini-Hochberg over the tests of one run: nothing is corrected
across runs) or that it is uncorrected, pointwise per layer, factor and pair. Monte Carlo p-values
cannot be below 1 / (draws + 1); where fewer than ``inference.TAIL_DRAWS`` draws are as extreme as
the measurement, ``inference.tail_p`` extrapolates a normal tail fitted to the draws instead.
"""
from __future__ import annotations

import xarray as xr

from .inference import TAIL_DRAWS

ADD_ONE = "a Monte Carlo p-value, (1 + draws at least as extreme) / (1 + {draws}): never below 1 / ({draws} + 1)"
TAIL = (f"a Monte Carlo p-value over {{draws}}: the add-one share of draws at least as extreme when {TAIL_DRAWS} or "
        f"more are, else a normal tail fitted to the draws' mean and spread (an extrapolation beyond what the draws "
        f"resolve), capped at {TAIL_DRAWS} / ({{draws}} + 1)")
POINTWISE = "pointwise: uncorrected for the many layers, factors and pairs (not a simultaneous band)"
BH_RUN = "Benjamini-Hochberg over {over} of this run (nothing is corrected across runs)"
HEAD_ANGLES = "a point estimate: no null, interval or test, so nothing to correct; not evidence of (in)dependence"
RANK_STEPS = ("each step of the rank's test at rank_significance, uncorrected over steps, layers and factors "
              "(a rank reads one step high at about that rate per factor and layer)")
CLUSTER_CI = ("percentile interval of a cluster bootstrap (n_bootstrap resamples of the resampling units: attrs "
              "group_by, n_units), " + POINTWISE)
MC_ERROR = ("Monte Carlo error over the noise draws only (what more draws would remove, for these samples): not a "
            "standard error over documents or samples, which the collapse intervals give")

STATEMENTS = {
    "subspaces": {
        "structure_p": "uncorrected (structure_q corrects it); " + ADD_ONE.format(draws="n_null"),
        "structure_q": BH_RUN.format(over="every layer and factor"),
        "claim_p": "uncorrected (claim_q corrects it); " + TAIL.format(draws="n_bootstrap"),
        "claim_q": BH_RUN.format(over="every claim of every layer and pair"),
        "relation": "decided on claim_q and structure_q: " + BH_RUN.format(over="each family of tests"),
        "subspace_rank": RANK_STEPS,
        "noise_singular_value": RANK_STEPS,
        **{name: POINTWISE for name in ("min_angle_ci", "max_angle_ci", "null_angles", "null_angles_ci",
                                        "null_min_angle", "null_min_angle_ci")},
        **{f"{kind}_{name}": HEAD_ANGLES for kind in "qk" for name in ("angles", "min_angle", "overlap")},
    },
    "spheres": {
        "sphere_null_p": "uncorrected; " + TAIL.format(draws="n_bootstrap"),
        "sphere_claim_p": "uncorrected (sphere_claim_q corrects the claim on the side of the measurement); "
                          + TAIL.format(draws="n_bootstrap"),
        "sphere_claim_q": BH_RUN.format(over="every layer and factor"),
        "sphere": "decided on sphere_claim_q: " + BH_RUN.format(over="every layer and factor"),
        "cross_term_p": "uncorrected; " + ADD_ONE.format(draws="n_bootstrap"),
        **{name: POINTWISE for name in ("radius_cv_ci", "cross_term_ci", "cross_term_null_ci")},
    },
    "replay": {
        **{name: CLUSTER_CI for name in ("collapse_level_ci", "collapse_level_pooled_ci", "collapse_rate_pooled_ci",
                                          "theory_recall_pooled_ci", "theory_precision_pooled_ci",
                                          "exact_recall_pooled_ci", "exact_precision_pooled_ci")},
        "tv_distance_mc_error": MC_ERROR,
        "output_change_mc_error": MC_ERROR,
    },
}
"""Per analysis, per variable: the correction it enters, or that it is uncorrected."""


def state_multiplicity(result: xr.Dataset, analysis: str) -> xr.Dataset:
    """Append each variable's ``STATEMENTS`` entry to its description (in place; returns `result`)."""
    for name, statement in STATEMENTS[analysis].items():
        if name in result:
            before = result[name].attrs.get("description")
            result[name].attrs["description"] = f"{before}; multiplicity: {statement}" if before else statement
    return result
