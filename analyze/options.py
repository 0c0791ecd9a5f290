"""Options of the analyses (keyword arguments), checked by name: one rule per option name."""
from __future__ import annotations

import json

from orthosphere.store.schema import layer_indices

from .design import ESTIMATORS
from .device import check_device
from .errors import AnalysisError


def _layers(name, value):
    layer_indices(value, AnalysisError)


def _strings(name, value):
    if not all(isinstance(v, str) and v for v in value):
        raise AnalysisError(f"option {name}={list(value)!r}: expected a list of names")


def _flag(name, value):
    if not isinstance(value, bool):
        raise AnalysisError(f"option {name}={value!r}: expected true or false")


def _fraction(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise AnalysisError(f"option {name}={value!r}: expected a number in (0, 1]")


def _fractions(name, value):
    if not value or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1 for v in value):
        raise AnalysisError(f"option {name}={list(value)!r}: expected a list of numbers in [0, 1]")


def _noise_levels(name, value):
    levels = value if isinstance(value, (list, tuple)) else [value]
    if not levels or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1 for v in levels):
        raise AnalysisError(f"option {name}={value!r}: expected a number or a list of numbers strictly between "
                            "0 and 1 (0.01 is 1 % noise), e.g. replay.levels=[0.01,0.1]")
    if any(later <= earlier for earlier, later in zip(levels, levels[1:])):
        raise AnalysisError(f"option {name}={value!r}: expected strictly increasing levels, e.g. replay.levels=[0.01,0.1]")


def _count(minimum):
    def check(name, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise AnalysisError(f"option {name}={value!r}: expected an integer >= {minimum}")

    return check


def _positive(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise AnalysisError(f"option {name}={value!r}: expected a positive number")


def _probability(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise AnalysisError(f"option {name}={value!r}: expected a number strictly between 0 and 1, e.g. 0.05")


def _tolerance_deg(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 90:
        raise AnalysisError(
            f"option {name}={value!r}: expected a tolerance in degrees strictly between 0 and 90 (a claim of "
            "orthogonality or dependence needs some room to be shown: 10 by default)"
        )


def _intercepts(name, value):
    if not isinstance(value, str) or not value:
        raise AnalysisError(f"option {name}={value!r}: expected a label name, or 'none' for one intercept per pattern")


def _estimator(name, value):
    if value not in ESTIMATORS:
        raise AnalysisError(f"option {name}={value!r}: expected one of {list(ESTIMATORS)}")


def _max_classes(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise AnalysisError(
            f"option {name}={value!r}: expected an integer >= 2, the most classes a factor keeps (its rarest "
            "classes beyond that are pooled into one), or none to keep every class"
        )


def _name(name, value):
    if not isinstance(value, str) or not value:
        raise AnalysisError(f"option {name}={value!r}: expected a name")


RULES = {
    "layers": _layers,
    "sites": _strings,
    "factors": _strings,
    "site": _name,
    "step_site": _name,
    "exclude_start": _flag,
    "weight_by_attention": _flag,
    "mass": _fraction,
    "confidence": _probability,
    "quantiles": _fractions,
    "levels": _noise_levels,
    "ratio_max": _positive,
    "ratio_bins": _count(1),
    "rank": _count(1),
    "n_bootstrap": _count(0),
    "n_null": _count(0),
    "significance": _probability,
    "rank_significance": _probability,
    "intercepts": _intercepts,
    "radius_cv_tolerance": _positive,
    "estimator": _estimator,
    "max_classes": _max_classes,
    "bootstrap_groups": _count(2),
    "seed": _count(0),
    "smooth_draws": _count(2),
    "independence_deg": _tolerance_deg,
    "orthogonality_deg": _tolerance_deg,
    "device": check_device,
}


def check_options(**values) -> dict:
    """Check each option by the rule of its name (None means the default); lists become tuples."""
    return {name: check_option(name, value) for name, value in values.items()}


def check_option(name: str, value, rule_name: str | None = None):
    """The option's value, checked by the rule of `rule_name` (default: its name); a list becomes a tuple."""
    if isinstance(value, list):
        value = tuple(value)
    rule = RULES.get(rule_name or name)
    if isinstance(value, str) and rule in (_strings, _fractions):
        raise AnalysisError(f"option {name}={value!r}: expected a list, not a single string")
    if rule is not None and value is not None:
        rule(name, value)
    return value


def as_attrs(values: dict) -> dict:
    """Option values as plain JSON values, for the attrs of a results group."""
    return json.loads(json.dumps(values, default=lambda value: value.tolist() if hasattr(value, "tolist") else str(value)))


def parse_assignment(text: str) -> tuple[str, object]:
    """An option given as text, KEY=VALUE (VALUE read as JSON when it is JSON, else kept as text),
    checked by the rule of its name (the part after the last dot), so that a bad value is named as given."""
    key, separator, text_value = text.partition("=")
    key = key.strip()
    if not separator or not key:
        raise AnalysisError(f"option {text!r}: expected KEY=VALUE, e.g. confidence=0.95 or replay.levels=[0.01,0.1]")
    try:
        value = json.loads(text_value)
    except json.JSONDecodeError:
        value = text_value
    check_option(key, value, key.rpartition(".")[2])
    return key, value
