"""The command line's options, generated from the configurations' declared parameters
(``orthosphere.params``): each option's help, default and choices come from its field, so that a
new option is one field.

Where the command line spells a parameter otherwise than ``--name`` (underscores as dashes), a
``Spelling`` says so: another flag, flags that each set the parameter to one value (an inverted
flag, one mode among several), a repeated flag, an argument. The CLI declares them in one table
(``cli.SPELLINGS``); the same spellings turn the Python names in its error messages back into flags
(``Spelled``), so that a library message names a parameter as Python does and the CLI prints it as
the command line does.

A command's generated options are made when it first parses or shows its help
(``ConfigCommand``), so that listing the verbs imports no configuration (the extraction's needs
PyTorch, which the base installation lacks).
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import click

from orthosphere.errors import ParameterError
from orthosphere.params import REQUIRED, Config, Flag, Interval, Items, Normalised, OneOf


class _Own:
    """The marker of a value not given (None is a value)."""

    def __repr__(self) -> str:
        return "OWN"


OWN = _Own()
"""A Spelling's default when the option's default is its field's (none where several
configurations share the option); a ParameterOption's value when its flag sets none."""


@dataclass(frozen=True)
class Spelling:
    """How the command line spells one parameter: `flag` (default ``--name``); `values`, flags that
    each set the parameter to one value ({False: "--no-pred"}; several are exclusive); `multiple`: the
    flag repeats, an item each; `argument`: a positional argument named by `metavar`; `parse`: a
    click callback reading the text; `type`: a click type; `default`: the command line's own; `help`:
    where the flag's sense differs from the parameter's (with `values`: a mapping, value -> its flag's help)."""

    flag: str = ""
    values: Mapping = field(default_factory=dict)
    multiple: bool = False
    argument: bool = False
    metavar: str | None = None
    parse: Callable | None = None
    type: Any = None
    default: Any = OWN
    help: str | Mapping = ""


class CommaList(click.ParamType):
    """Comma-separated items, each read as `item` reads it (empty items dropped)."""

    name = "list"

    def __init__(self, item: click.ParamType):
        self.item = item

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        return tuple(self.item.convert(part.strip(), param, ctx) for part in str(value).split(",") if part.strip())


class ParameterOption(click.Option):
    """An option that sets a configuration's parameter (`value`: the one its flag sets, if any);
    `spelled`: its flag names the parameter in error messages."""

    def __init__(self, *args, parameter: str, value=OWN, spelled: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.parameter, self.value, self.spelled = parameter, value, spelled


class ParameterArgument(click.Argument):
    """An argument that sets a configuration's parameter."""

    def __init__(self, *args, parameter: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.parameter = parameter


def _click_type(constraints) -> tuple[Any, bool]:
    """The click type of a value these constraints accept, and whether it is a flag (None: no
    command-line form)."""
    given = [constraint for constraint in constraints if constraint is not None]
    if not given:
        return None, False
    first = given[0]
    if isinstance(first, Flag):
        return click.BOOL, True
    if isinstance(first, OneOf) and all(isinstance(value, str) for value in first.values):
        return click.Choice(first.values), False
    if isinstance(first, Normalised) and first.choices:
        return click.Choice(first.choices), False
    if isinstance(first, Interval):
        return (click.INT if first.kind is int else click.FLOAT), False
    if isinstance(first, Items):
        item, _ = _click_type([first.item])
        return CommaList(item or click.STRING), False
    return click.STRING, False


def sentence(text: str) -> str:
    """A parameter's help as the command line shows it: a sentence, Python's None as the default."""
    text = text.replace("(None: ", "(default: ")
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


class ConfigOptions:
    """The command-line options of configurations' parameters: of one configuration (each option's
    default its field's), or of several (``{owner: config}``: one option for a parameter several
    take, given to each that takes it; none by default, so that each keeps its own). Parameters in
    `hidden` get none."""

    def __init__(self, configs: type[Config] | Mapping[str, type[Config]], spellings: Mapping[str, Spelling],
                 hidden: Mapping[str, str], verb: str):
        self.shared = isinstance(configs, Mapping)
        self.configs = dict(configs) if self.shared else {verb: configs}
        self.spellings, self.verb = spellings, verb
        self.fields: dict[str, dict[str, dataclasses.Field]] = {}
        for owner, config in self.configs.items():
            for name, item in config.parameters().items():
                if name not in hidden:
                    self.fields.setdefault(name, {})[owner] = item

    def spelling(self, name: str) -> Spelling:
        """The parameter's spelling on this verb ("verb.name" in the table, else "name")."""
        return self.spellings.get(f"{self.verb}.{name}") or self.spellings.get(name) or Spelling()

    def params(self) -> list[click.Parameter]:
        """The click parameters, in the order of the fields."""
        return [param for name in self.fields for param in self._params(name)]

    def _params(self, name: str) -> Iterator[click.Parameter]:
        owners = self.fields[name]
        first = next(iter(owners.values()))
        spelling = self.spelling(name)
        kind, is_flag = _click_type(first.metadata.get("constraints", ()))
        if kind is None and spelling == Spelling():
            raise TypeError(f"parameter {name} of {self.verb} has no command-line form: give it a spelling in the "
                            "CLI's SPELLINGS or list it among the parameters it does not expose")
        default = self._default(name, spelling)
        if spelling.argument:
            yield ParameterArgument([name], parameter=name, metavar=spelling.metavar, type=spelling.type or kind,
                                    required=default is REQUIRED)
            return
        if spelling.values:
            for index, (value, flag) in enumerate(spelling.values.items()):
                help_text = spelling.help.get(value, "") if isinstance(spelling.help, Mapping) else spelling.help
                yield ParameterOption([flag, _value_dest(name, index)], parameter=name, value=value, is_flag=True,
                                      spelled=not self.shared, help=help_text or self._help(name))
            return
        help_text = spelling.help or self._help(name)
        flag = spelling.flag or "--" + name.replace("_", "-")
        if is_flag:
            flags = f"{flag}/--no-{flag[2:]}" if default is True else flag
            yield ParameterOption([flags, name], parameter=name, is_flag=True, default=default, spelled=not self.shared,
                                  help=help_text)
            return
        if spelling.parse is not None:
            kind = click.STRING
        elif spelling.multiple and isinstance(kind, CommaList):
            kind = kind.item
        yield ParameterOption(
            [flag, name], parameter=name, type=spelling.type or kind, multiple=spelling.multiple,
            default=None if default is REQUIRED or spelling.multiple else default, required=default is REQUIRED,
            show_default=default not in (None, REQUIRED), callback=spelling.parse, spelled=not self.shared,
            metavar=spelling.metavar or ("LIST" if isinstance(kind, CommaList) else None), help=help_text)

    def _default(self, name: str, spelling: Spelling):
        if spelling.default is not OWN:
            return spelling.default
        return None if self.shared else next(iter(self.fields[name].values())).default

    def _help(self, name: str) -> str:
        """The field's help; shared by several configurations, each's with its default, by owner."""
        owners = self.fields[name]
        if not self.shared:
            return sentence(next(iter(owners.values())).metadata.get("help", ""))
        texts: dict[str, tuple[list[str], list[str]]] = {}
        for owner, item in owners.items():
            names, defaults = texts.setdefault(item.metadata.get("help", ""), ([], []))
            names.append(owner)
            if item.default not in (None, REQUIRED) and _shown(item.default) not in defaults:
                defaults.append(_shown(item.default))
        described = {text + (f" (default {', '.join(defaults)})" if defaults else ""): names
                     for text, (names, defaults) in texts.items()}
        if len(described) == 1 and len(owners) == len(self.configs):
            return sentence(next(iter(described)))
        return "; ".join(f"{', '.join(names)}: {text}" for text, names in described.items()) + "."

    def values(self, given: dict) -> dict:
        """The parameters the command line gave, taken out of click's `given` values (of several
        configurations: only those given)."""
        values = {}
        for name in self.fields:
            spelling = self.spelling(name)
            if spelling.values:
                chosen = [value for index, value in enumerate(spelling.values) if given.pop(_value_dest(name, index))]
                if len(chosen) > 1:
                    flags = " and ".join(spelling.values[value] for value in chosen)
                    raise click.UsageError(f"{flags} contradict each other: give one")
                value = chosen[0] if chosen else self._default(name, spelling)
            else:
                value = given.pop(name)
            if spelling.multiple:
                value = tuple(value) or None
            if not self.shared or value is not None:
                values[name] = value
        return values


def _value_dest(name: str, index: int) -> str:
    """The name click gives the index-th of the flags that set parameter `name` to a value."""
    return f"{name}_value_{index}"


def _shown(value) -> str:
    return ",".join(str(item) for item in value) if isinstance(value, tuple) else str(value)


class ConfigCommand(click.Command):
    """A command whose parameters are its own, then those `options()` generates (made the first time
    the command parses or shows its help: `options` may import what only this verb needs)."""

    def __init__(self, *args, options: Callable[[], ConfigOptions], **kwargs):
        super().__init__(*args, **kwargs)
        self.make_options, self.options = options, None

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        if self.options is None:
            self.options = self.make_options()
            self.params = [*self.params, *self.options.params()]
        return super().get_params(ctx)


ELSEWHERE = (
    (r'(?<![\w.-])mode="(resume|overwrite)"', r"`orthosphere extract ... --\1`"),
    (r"read what is there with open_store", "read what is there from Python with open_store"),
)
"""How a command spells the library's advice that another command carries out (a store's job is
`extract`'s; reading an incomplete store is the Python API's); a command's own flags come first."""


class Spelled:
    """The flags of a command's parameters, as its error messages should name them: a library message
    names a parameter as Python does (``n_samples=``, ``break_lock=True``, ``mode="resume"``)."""

    def __init__(self, command: click.Command | None):
        self.labels: dict[str, str] = {}
        self.rules: list[tuple[re.Pattern, str]] = []
        for param in command.params if command is not None else ():
            self._add(param)
        self.rules += [(re.compile(pattern), text) for pattern, text in ELSEWHERE]

    def _add(self, param: click.Parameter) -> None:
        if isinstance(param, ParameterArgument):
            self.labels.setdefault(param.parameter, param.human_readable_name)
            return
        if not isinstance(param, click.Option) or not getattr(param, "spelled", True):
            return
        flag = max(param.opts, key=len)
        name = getattr(param, "parameter", param.name)
        self.labels.setdefault(name, flag)
        value = getattr(param, "value", OWN)
        if value is OWN and param.is_flag and not param.secondary_opts:
            value = True if param.is_bool_flag else param.flag_value
        if value is not OWN:
            said = "|".join(re.escape(text) for text in ([repr(value), f'"{value}"'] if isinstance(value, str) else [repr(value)]))
            self.rules.append((re.compile(rf"(?<![\w.-]){name}=(?:{said})"), flag))
        elif not param.is_flag:
            self.rules.append((re.compile(rf"(?<![\w.-]){name}=(\S+?)(?=[\s:;,)]|$)"), flag + r"=\1"))
            self.rules.append((re.compile(rf"(?<![\w.-]){name}=(?=[\s:;,)]|$)"), flag))

    def error(self, error: Exception) -> Exception:
        """A ParameterError named by its flag (other errors as they are)."""
        if isinstance(error, ParameterError) and error.parameter in self.labels:
            return error.named(self.labels[error.parameter])
        return error

    def __call__(self, text: str) -> str:
        """The message with each parameter's Python spelling replaced by its flag."""
        for pattern, flag in self.rules:
            text = pattern.sub(flag, text)
        return text
