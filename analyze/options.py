"""The analyses' options: the shared vocabulary of their constraints, the base of their
configurations, and options given as text (KEY=VALUE) or with keys "analysis.option", read into
the nested form the analyses take ({"option": value, "analysis": {"option": value}}).

Each analysis declares its options once, as a configuration (a dataclass deriving from
``AnalysisConfig``, see ``orthosphere.params``) in its own module; ``results.ANALYSES`` lists them.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from orthosphere.errors import AnalysisError, AnalysisParameterError
from orthosphere.params import Config, Delegated, Flag, Interval, Items, OneOf, Rule, Text, checked
from orthosphere.store.schema import layer_indices

from .device import DEVICE_FORM


@dataclass(frozen=True)
class AnalysisConfig(Config):
    """The configuration of an analysis: its refusals are AnalysisErrors."""

    error = AnalysisParameterError


LAYERS = Delegated(lambda layers: tuple(layer_indices(layers, AnalysisError)), "layer indices of the store")
NAMES = Items(Text())
SITE = Text("a site name")
FLAG = Flag()
SHARE = Interval(float, 0, 1, closed="right")
PROBABILITY = Interval(float, 0, 1, closed="neither", hint="e.g. 0.05")
CONFIDENCE = Interval(float, 0, 1, closed="neither", hint="e.g. 0.9")
FLOOR = Interval(float, 0, 1, closed="left", noun="a share",
                 hint="(0 keeps every significant direction; 0.01 by default)")
SHARES = Items(Interval(float, 0, 1))
POSITIVE = Interval(float, 0, closed="neither")
TOLERANCE_DEG = Interval(float, 0, 90, closed="neither", noun="a tolerance in degrees",
                         hint="(a claim of orthogonality or dependence needs some room to be shown: 10 by default)")
DEVICE = Rule(lambda value: isinstance(value, str) and DEVICE_FORM.match(value) is not None,
              "auto, cpu (numpy), cpu-torch (the torch kernels on the CPU), cuda or cuda:N")


def integer(minimum: int, hint: str = "") -> Interval:
    """An integer >= minimum."""
    return Interval(int, minimum, hint=hint)


def choice(*values: str) -> OneOf:
    """One of these names."""
    return OneOf(tuple(values))


def as_attrs(values: dict) -> dict:
    """Option values as plain JSON values, for the attrs of a results group."""
    return json.loads(json.dumps(values, default=lambda value: value.tolist() if hasattr(value, "tolist") else str(value)))


def parse_assignment(text: str, analyses: Iterable) -> tuple[str, object]:
    """An option given as text, KEY=VALUE (VALUE read as JSON when it is JSON, else kept as text),
    checked against the constraints of every one of `analyses` (``registry.Analysis``) that declares
    it (KEY "analysis.option": that analysis only), so that a bad value is named as given."""
    key, separator, text_value = text.partition("=")
    key = key.strip()
    if not separator or not key:
        raise AnalysisError(f"option {text!r}: expected KEY=VALUE, e.g. confidence=0.95 or replay.levels=[0.01,0.1]")
    try:
        value = json.loads(text_value)
    except json.JSONDecodeError:
        value = text_value
    target, _, option = key.rpartition(".")
    for analysis in analyses:
        declared = analysis.config.parameters().get(option)
        if declared is not None and (not target or target == analysis.name):
            checked(option, value, declared.metadata["constraints"], AnalysisParameterError, label=f"option {key}")
    return key, value


def nested(options: Mapping, analyses: Iterable) -> dict:
    """Options whose keys may be "analysis.option" (options given as text, a TOML table's quoted keys)
    in the nested form the analyses take: {"option": value, "analysis": {"option": value}}. A key
    naming none of `analyses` is kept as given (and refused where the options are configured)."""
    names = {analysis.name for analysis in analyses}
    result: dict = {}
    for key, value in options.items():
        target, _, option = key.rpartition(".")
        if key in names and isinstance(value, Mapping):
            result[key] = {**result.get(key, {}), **value}
        elif target in names:
            result.setdefault(target, {})[option] = value
        else:
            result[key] = value
    return result


def parse_options(texts: Iterable[str], analyses: Iterable) -> dict:
    """Options given as text, KEY=VALUE each (``parse_assignment``), in the nested form (``nested``)."""
    analyses = list(analyses)
    return nested(dict(parse_assignment(text, analyses) for text in texts), analyses)
