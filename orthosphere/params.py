"""Typed configurations: each parameter declared once, with its default, its constraints and a line
of help (as scikit-learn's ``_parameter_constraints``), checked when the configuration is built.

A configuration is a frozen dataclass deriving from ``Config`` whose fields are made with
``parameter(default, *constraints, help=...)``. A value passes when any one of its constraints
accepts it (``None`` among them: None is allowed); otherwise a ``ParameterError`` names the
parameter, the value and what was expected. The entry points give the parameter the caller's own
name for it (``ParameterError.named``): the CLI its flag or ``--option KEY=VALUE``, a TOML pipeline
its file, table and key, Python the keyword.

    @dataclass(frozen=True)
    class NormsConfig(Config):
        mass: float = parameter(0.9, Interval(float, 0, 1, closed="right"), help="share the band holds")
"""
from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from .errors import ConfigError, ParameterError


class Constraint:
    """One kind of value a parameter accepts: ``accepts(value)``, ``expected`` (words for the message)
    and ``convert(value)`` (the value kept: lists become tuples)."""

    expected = "a valid value"

    def accepts(self, value) -> bool:
        raise NotImplementedError

    def convert(self, value):
        return value


def with_hint(words: str, hint: str) -> str:
    """What is expected, followed by its hint (after a comma, or a space before a parenthesis)."""
    if not hint:
        return words
    return f"{words} {hint}" if hint.startswith("(") else f"{words}, {hint}"


def _is_number(value, kind: type) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, numbers.Integral if kind is int else numbers.Real)


@dataclass(frozen=True)
class Interval(Constraint):
    """A number (kind int or float) between low and high (None: unbounded); closed says which ends
    belong ("both", "left", "right", "neither"); noun names the value ("a number", "an integer" by
    default); hint follows the expected range in the message."""

    kind: type
    low: float | None = None
    high: float | None = None
    closed: str = "both"
    hint: str = ""
    noun: str = ""

    def accepts(self, value) -> bool:
        if not _is_number(value, self.kind):
            return False
        low_ok = self.low is None or (value >= self.low if self.closed in ("both", "left") else value > self.low)
        high_ok = self.high is None or (value <= self.high if self.closed in ("both", "right") else value < self.high)
        return low_ok and high_ok

    def convert(self, value):
        return int(value) if self.kind is int else float(value)

    @property
    def expected(self) -> str:
        noun = self.noun or ("an integer" if self.kind is int else "a number")
        low_closed, high_closed = self.closed in ("both", "left"), self.closed in ("both", "right")
        if self.low is None and self.high is None:
            words = noun
        elif self.high is None:
            if self.low == 0 and not low_closed and not self.noun:
                words = "a positive number" if self.kind is float else "a positive integer"
            else:
                words = f"{noun} {'>=' if low_closed else '>'} {self.low}"
        elif self.low is None:
            words = f"{noun} {'<=' if high_closed else '<'} {self.high}"
        elif not low_closed and not high_closed:
            words = f"{noun} strictly between {self.low} and {self.high}"
        elif self.kind is int and low_closed and high_closed:
            words = f"an integer from {self.low} to {self.high}"
        else:
            words = f"{noun} in {'[' if low_closed else '('}{self.low}, {self.high}{']' if high_closed else ')'}"
        return with_hint(words, self.hint)


@dataclass(frozen=True)
class OneOf(Constraint):
    """One of the given values."""

    values: tuple

    def accepts(self, value) -> bool:
        return isinstance(value, str) and value in self.values if all(isinstance(v, str) for v in self.values) \
            else value in self.values

    @property
    def expected(self) -> str:
        return f"one of {list(self.values)}"


@dataclass(frozen=True)
class Flag(Constraint):
    """True or False."""

    expected = "true or false"

    def accepts(self, value) -> bool:
        return isinstance(value, bool)


@dataclass(frozen=True)
class Text(Constraint):
    """A non-empty string (what it names: `expected`)."""

    expected: str = "a name"

    def accepts(self, value) -> bool:
        return isinstance(value, str) and bool(value)


@dataclass(frozen=True)
class Items(Constraint):
    """A list (kept as a tuple) whose every item one constraint accepts: non-empty unless
    `empty`, strictly increasing when `increasing`; `single` also accepts a lone item."""

    item: Constraint
    empty: bool = False
    increasing: bool = False
    single: bool = False
    hint: str = ""

    def accepts(self, value) -> bool:
        if self.single and self.item.accepts(value):
            return True
        if isinstance(value, np.ndarray) and value.ndim == 1:
            value = value.tolist()
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (list, tuple)):
            return False
        items = list(value)
        return (self.empty or bool(items)) and all(self.item.accepts(item) for item in items) and (
            not self.increasing or all(b > a for a, b in zip(items, items[1:])))

    def convert(self, value):
        if self.single and self.item.accepts(value):
            value = [value]
        if isinstance(value, np.ndarray):
            value = value.tolist()
        return tuple(self.item.convert(item) for item in value)

    @property
    def expected(self) -> str:
        order = "strictly increasing " if self.increasing else ""
        words = f"a {'' if self.empty else 'non-empty '}list of {order}items, each {self.item.expected}"
        if self.single:
            words = f"{self.item.expected}, or {words}"
        return with_hint(words, self.hint)


@dataclass(frozen=True)
class Rule(Constraint):
    """A check of its own: `test(value)` is true for an accepted value, described by `expected`."""

    test: Callable[[Any], bool]
    expected: str = "a valid value"

    def accepts(self, value) -> bool:
        try:
            return bool(self.test(value))
        except (TypeError, ValueError):
            return False


@dataclass(frozen=True)
class Normalised(Constraint):
    """A value `normalise(value)` accepts (it raises ValueError or TypeError otherwise): the value kept
    is what it returns (a dtype object becomes its name); `choices`, where it accepts a few names, are
    those names (a command line's choices)."""

    normalise: Callable[[Any], Any]
    expected: str = "a valid value"
    choices: tuple = ()

    def accepts(self, value) -> bool:
        try:
            self.normalise(value)
        except (TypeError, ValueError):
            return False
        return True

    def convert(self, value):
        return self.normalise(value)


@dataclass(frozen=True)
class Delegated(Constraint):
    """A check shared with code outside the configurations (layers: extraction, the store and the
    analyses alike): `check(value)` returns the value kept or raises its own error, whose message
    names the parameter."""

    check: Callable[[Any], Any]
    expected: str = "a valid value"

    def accepts(self, value) -> bool:
        return True

    def convert(self, value):
        return self.check(value)


POSITIVE_INTEGER = Interval(int, 0, closed="neither")
NON_NEGATIVE_INTEGER = Interval(int, 0)
POSITIVE_NUMBER = Interval(float, 0, closed="neither")
UNIT_INTERVAL = Interval(float, 0, 1)

REQUIRED = dataclasses.MISSING
"""The default of a parameter without one (the caller must give it)."""


def parameter(default, *constraints: Constraint | None, help: str = "") -> Any:
    """A configuration field: its default (REQUIRED: none), the constraints any one of which a value
    must meet (None among them: None is allowed; none at all: any value, checked where it is used),
    and a line of help."""
    return field(default=default, metadata={"constraints": constraints, "help": help})


def checked(name: str, value, constraints, error: type[ParameterError] = ParameterError, label: str | None = None):
    """The value kept for parameter `name` (converted by the constraint that accepts it), or the error
    (the parameter named `label` there: default "option NAME")."""
    if not constraints or (value is None and None in constraints):
        return value
    given = [constraint for constraint in constraints if constraint is not None]
    for constraint in given:
        if constraint.accepts(value):
            return constraint.convert(value)
    if any(isinstance(c, Items) and not c.single for c in given) and isinstance(value, str):
        expected = "a list, not a single string"
    else:
        expected = " or ".join(constraint.expected for constraint in given) + (", or none" if None in constraints else "")
    raise error(name, value, expected, label=label)


@dataclass(frozen=True)
class Config:
    """A typed configuration: every field checked against its declared constraints when built, then
    ``check()`` for what concerns several fields. ``error`` is the class of its ParameterErrors."""

    error: ClassVar[type[ParameterError]] = ParameterError

    def __post_init__(self):
        for item in dataclasses.fields(self):
            value = checked(item.name, getattr(self, item.name), item.metadata.get("constraints", ()), self.error)
            object.__setattr__(self, item.name, value)
        self.check()

    def check(self) -> None:
        """Constraints between fields (none by default): raise ``self.error``."""

    @classmethod
    def parameters(cls) -> dict[str, dataclasses.Field]:
        """The parameters, name -> field (default, metadata "constraints" and "help")."""
        return {item.name: item for item in dataclasses.fields(cls)}

    @classmethod
    def defaults(cls) -> dict:
        """Each parameter's default."""
        return {name: item.default for name, item in cls.parameters().items()}

    @classmethod
    def of(cls, options: Mapping | None = None, *, owner: str = ""):
        """The configuration of these options; an unknown one is an error naming the known ones."""
        options = dict(options or {})
        cls._refuse_unknown(options, owner)
        return cls(**options)

    @classmethod
    def from_table(cls, values: Mapping, table: str):
        """The configuration of a config file's table ``[table]``: unknown keys, missing ones and bad
        values are ConfigErrors naming the table (a bad value: ``[table] key = value: expected ...``)."""
        known = sorted(cls.parameters())
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"unknown {table} keys {unknown}; expected some of {known}")
        missing = [name for name, default in cls.defaults().items() if default is REQUIRED and name not in values]
        if missing:
            raise ConfigError(f"{table} config is incomplete: missing {missing}")
        try:
            return cls(**values)
        except ParameterError as error:
            raise error.in_table(f"[{table}]", error.parameter) from None

    @classmethod
    def _refuse_unknown(cls, options: Mapping, owner: str = "") -> None:
        unknown = sorted(set(options) - set(cls.parameters()))
        if unknown:
            raise cls.error(unknown[0], options[unknown[0]],
                            f"a parameter of {owner or cls.__name__}, one of {sorted(cls.parameters())}",
                            unknown=True)

    @classmethod
    def check_some(cls, options: Mapping) -> dict:
        """Some parameters' values checked (and converted) on their own, without the rest of a
        configuration (a TOML table that holds only some of them); an unknown one is an error."""
        cls._refuse_unknown(options)
        known = cls.parameters()
        return {name: checked(name, value, known[name].metadata.get("constraints", ()), cls.error)
                for name, value in options.items()}

    @classmethod
    def described(cls, leave: tuple[str, ...] = ()) -> str:
        """The parameters as a docstring's list, one line each: name (default), help."""
        lines = []
        for name, item in cls.parameters().items():
            if name not in leave:
                default = "required" if item.default is REQUIRED else f"default {item.default!r}"
                lines.append(f"- {name} ({default}): {item.metadata.get('help', '')}")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        """Every parameter's value."""
        return {name: getattr(self, name) for name in self.parameters()}

    def changed(self) -> dict:
        """The parameters whose value differs from the default."""
        defaults = self.defaults()
        return {name: value for name, value in self.as_dict().items() if defaults[name] is REQUIRED or (
            value != defaults[name] and not (isinstance(value, tuple) and list(value) == defaults[name]))}

    @classmethod
    def optional(cls, name: str, doc: str):
        """A configuration of the same parameters, each None by default (None: as decided elsewhere)."""
        fields = [(item.name, item.type, parameter(None, *item.metadata.get("constraints", ()), None,
                                                   help=item.metadata.get("help", "")))
                  for item in dataclasses.fields(cls)]
        made = dataclasses.make_dataclass(name, fields, bases=(Config,), frozen=True, namespace={"__doc__": doc})
        made.error = cls.error
        made.__module__ = cls.__module__
        return made
