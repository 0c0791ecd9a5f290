"""What an extraction runs over: the arithmetic task or a text file, as fixed-width batches.

Task specs (``orthosphere extract --task SPEC``)::

    arithmetic:split=test,seed=0                   # any split, any seed (these are the defaults)
    arithmetic:split=extrapolation,seed=3,digit_lengths=1/2,train_counts=2/3/5,interpolation_counts=4,extrapolation_counts=6/7
    text:path=corpus.txt,max_length=128            # one sequence per line

Arithmetic options besides split and seed are the task's TaskSpec fields, lists written
with ``/``. A text file gives one sample per non-blank line, tokenised with the model's
tokenizer (with the special tokens it adds), truncated to ``max_length`` tokens and padded
to the longest sample; ``valid`` marks the real tokens. A causal model's target is the next
token (scored where both are real); a bidirectional model's target is the token itself.

A data set hands out any sample range: ``dataset.batch(start, stop)`` gives numpy arrays
(sample, pos): tokens, valid, target, scored and the labels (arithmetic: token_str, role,
operand, digit_place, digit_value, carry; text: token_str, position).
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, fields

import numpy as np

from . import tasks
from .model import ConfigError

TEXT_MAX_LENGTH = 128
SPEC_FORMS = (
    "arithmetic:split=NAME,seed=N[,train_counts=2/3/5,...] or text:path=FILE[,max_length=N]"
)
ARITHMETIC_LABELS = {
    "token_str": "str", "role": "str", "operand": "int16",
    "digit_place": "int16", "digit_value": "int16", "carry": "int16",
}
TEXT_LABELS = {"token_str": "str", "position": "int32"}


@dataclass(frozen=True)
class ArithmeticData:
    split: str = "test"
    seed: int = 0
    spec: tasks.TaskSpec = tasks.DEFAULT_SPEC


@dataclass(frozen=True)
class TextData:
    path: str
    max_length: int = TEXT_MAX_LENGTH


def parse_task(spec: str) -> ArithmeticData | TextData:
    """Parse a task spec; anything that does not parse is a ConfigError naming the forms."""
    name, _, rest = spec.partition(":")
    options = _options(spec, rest)
    try:
        if name == "arithmetic":
            return _arithmetic(options)
        if name == "text":
            return _text(spec, options)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"task spec {spec!r} does not parse ({error}): expected {SPEC_FORMS}") from None
    raise ConfigError(f"task spec {spec!r} does not parse: unknown task {name!r}; expected {SPEC_FORMS}")


def _options(spec: str, text: str) -> dict[str, str]:
    options = {}
    for item in filter(None, text.split(",")):
        key, equals, value = item.partition("=")
        key = key.strip()
        if not equals or not key or key in options:
            raise ConfigError(
                f"task spec {spec!r} does not parse at {item!r}: expected key=value pairs, each key once; "
                f"expected {SPEC_FORMS}"
            )
        options[key] = value.strip()
    return options


def _integer(key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{key}={value!r} is not an integer") from None


def _arithmetic(options: dict) -> ArithmeticData:
    split = tasks.parse_split(options.pop("split", "test"))
    seed = _integer("seed", options.pop("seed", "0"))
    known = {field.name for field in fields(tasks.TaskSpec)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown arithmetic option(s) {unknown}; expected split, seed or {sorted(known)}")
    spec_values = {key: [_integer(key, part) for part in value.split("/")] for key, value in options.items()}
    return ArithmeticData(split, seed, tasks.TaskSpec.from_dict(spec_values) if spec_values else tasks.DEFAULT_SPEC)


def _text(spec: str, options: dict) -> TextData:
    unknown = sorted(set(options) - {"path", "max_length"})
    if unknown:
        raise ValueError(f"unknown text option(s) {unknown}; expected path and max_length")
    if not options.get("path"):
        raise ValueError("text needs path=FILE")
    max_length = _integer("max_length", options.get("max_length", str(TEXT_MAX_LENGTH)))
    if max_length < 1:
        raise ValueError(f"max_length={max_length} must be positive")
    return TextData(options["path"], max_length)


def open_dataset(data, *, n_samples: int | None, tokenizer=None, causal: bool = True, n_pos: int | None = None):
    """The data set of a parsed spec; text needs the model's tokenizer and whether it is causal."""
    if isinstance(data, ArithmeticData):
        if n_samples is None:
            raise ConfigError("the arithmetic task needs a sample count: pass --samples N")
        return ArithmeticDataset(data, n_samples)
    return TextDataset(data, n_samples=n_samples, tokenizer=tokenizer, causal=causal, n_pos=n_pos)


def _check_samples(n_samples) -> None:
    if not isinstance(n_samples, (int, np.integer)) or isinstance(n_samples, bool) or n_samples < 1:
        raise ConfigError(f"--samples {n_samples!r}: expected a positive number of samples")


class ArithmeticDataset:
    """Examples 0 .. n_samples - 1 of one split and seed of the arithmetic task."""

    labels = ARITHMETIC_LABELS

    def __init__(self, data: ArithmeticData, n_samples: int):
        _check_samples(n_samples)
        self.data, self.n_samples = data, int(n_samples)
        self.n_pos = data.spec.max_length(data.split)

    def describe(self) -> dict:
        return self.data.spec.describe(self.data.split, self.data.seed)

    def batch(self, start: int, stop: int) -> dict[str, np.ndarray]:
        generated = tasks.generate(self.data.split, stop - start, self.data.seed, self.data.spec, start=start)
        arrays = {
            "tokens": generated.tokens.astype(np.int32, copy=False),
            "valid": generated.valid,
            "target": generated.target.astype(np.int32, copy=False),
            "scored": generated.scored,
        }
        arrays.update({name: generated.labels[name] for name in self.labels})
        return arrays


class TextDataset:
    """The non-blank lines of a text file, tokenised, truncated and padded."""

    labels = TEXT_LABELS

    def __init__(self, data: TextData, *, n_samples, tokenizer, causal: bool, n_pos: int | None = None):
        if tokenizer is None:
            raise ConfigError(
                "text data needs the model's tokenizer, and this model has none: add its tokenizer files "
                "(tokenizer.json ...) to the model directory, or use the arithmetic task"
            )
        self.data, self.tokenizer, self.causal = data, tokenizer, causal
        self.lines = _read_lines(data.path)
        if n_samples is None:
            n_samples = len(self.lines)
        _check_samples(n_samples)
        if n_samples > len(self.lines):
            raise ConfigError(
                f"text file {data.path} has {len(self.lines)} non-blank lines, fewer than --samples {n_samples}: "
                "ask for fewer samples or give a longer file"
            )
        self.n_samples = int(n_samples)
        self.n_pos = n_pos if n_pos is not None else max(len(self._encode(line)) for line in self.lines[: self.n_samples])

    def describe(self) -> dict:
        return {
            "name": "text",
            "path": os.path.abspath(self.data.path),
            "sha256": _file_sha256(self.data.path),
            "n_lines": len(self.lines),
            "max_length": self.data.max_length,
            "tokenizer": self.tokenizer.name,
            "target": "next token" if self.causal else "same token",
        }

    def _encode(self, line: str) -> list[int]:
        return self.tokenizer.encode(line)[: self.data.max_length]

    def batch(self, start: int, stop: int) -> dict[str, np.ndarray]:
        n = stop - start
        tokens = np.full((n, self.n_pos), self.tokenizer.pad_id, dtype=np.int32)
        valid = np.zeros((n, self.n_pos), dtype=bool)
        token_str = np.full((n, self.n_pos), "", dtype=object)
        for row, line in enumerate(self.lines[start:stop]):
            ids = self._encode(line)[: self.n_pos]
            tokens[row, : len(ids)] = ids
            valid[row, : len(ids)] = True
            token_str[row, : len(ids)] = self.tokenizer.token_strings(ids)
        position = np.where(valid, np.arange(self.n_pos, dtype=np.int32), -1).astype(np.int32)
        if self.causal:
            target = np.full_like(tokens, self.tokenizer.pad_id)
            target[:, :-1] = tokens[:, 1:]
            scored = np.zeros_like(valid)
            scored[:, :-1] = valid[:, :-1] & valid[:, 1:]
        else:
            target, scored = tokens.copy(), valid.copy()
        return {
            "tokens": tokens, "valid": valid, "target": target, "scored": scored,
            "token_str": token_str.astype(str), "position": position,
        }


def _read_lines(path: str) -> list[str]:
    if not os.path.isfile(path):
        raise ConfigError(f"text file {path} not found: expected a file with one sequence per line")
    try:
        with open(path, encoding="utf-8") as handle:
            lines = [line.rstrip("\n") for line in handle if line.strip()]
    except UnicodeDecodeError:
        raise ConfigError(_not_utf8(path)) from None
    if not lines:
        raise ConfigError(f"text file {path} is empty (no non-blank lines): expected one sequence per line")
    return lines


def _not_utf8(path: str) -> str:
    """The message for a file that is not UTF-8 text, naming its first line that does not decode."""
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as error:
                return (f"text file {path} is not UTF-8 text: line {number} holds bytes that do not decode "
                        f"({error.reason} at byte {error.start} of the line); convert it to UTF-8, or give a text file")
    return f"text file {path} is not UTF-8 text; convert it to UTF-8, or give a text file"


def _file_sha256(path: str) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()
