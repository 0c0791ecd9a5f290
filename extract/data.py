"""What an extraction runs over: the arithmetic task or a text corpus, as fixed-width samples.

Task specs (``orthosphere extract --task SPEC``)::

    arithmetic:split=test,seed=0                   # any split, any seed (these are the defaults)
    arithmetic:split=extrapolation,seed=3,digit_lengths=1/2,train_counts=2/3/5,interpolation_counts=4,extrapolation_counts=6/7
    text:path=corpus.txt,context=128               # one document a line, packed into windows of 128 tokens
    text:path=book.txt,document=file,context=512   # the whole file as one document
    jsonl:path=corpus.jsonl,field=text,context=128
    parquet:path=corpus.parquet,column=text,context=128          # a file, or a folder of *.parquet files
    hf:path=saved-dataset,split=train,column=text,context=128    # saved with datasets' save_to_disk
    parquet:path=ids.parquet,column=input_ids,tokenized=true,context=128   # token ids, already tokenised
    text:path=corpus.txt,max_length=128            # one padded sample a document, cut to 128 tokens

Arithmetic options besides split and seed are the task's TaskSpec fields, lists written
with ``/``.

A spec's options are the parameters of a configuration, declared once (``orthosphere.params``): the
arithmetic task's ``ArithmeticData`` (with ``TaskSpec``), a corpus's ``TextCorpus``, ``JsonlCorpus``,
``ParquetCorpus`` or ``SavedDatasetCorpus`` (``CORPUS_SOURCES``). Python builds the configuration from
keywords (``orthosphere.corpus.jsonl(path, context=128)``, ``orthosphere.tasks.arithmetic(...)``); a
spec's text is parsed into the same parameters once (``SPEC_VALUES``: how it writes those that are not
text), so a bad value gets the same message from both, naming the keyword. A corpus's configuration
is then laid out as ``CorpusData`` (``data()``).

A corpus (``text``, ``jsonl``, ``parquet``, ``hf``; read by corpus.py, streamed) is tokenised once
by the model's tokenizer and laid out (packing.py) either as **packed windows** (``context=N``:
documents concatenated with the tokenizer's end-of-sequence token between them, cut into windows
of N tokens that each start with BOS; no padding) or as **one padded sample per document**
(``max_length=N``, the default with N = 128: the document with its tokenizer's special tokens,
cut to N tokens, padded to the longest; ``valid`` marks the real tokens). Packing is the better
choice for real corpora: it stores no padding and sees every token; padding keeps documents
apart and aligned at position 0. ``field=`` (JSONL) and ``column=`` (Parquet, saved datasets)
name the documents' text, ``text`` by default; with ``tokenized=true`` it holds lists of token
ids instead, used as given (a model without tokenizer files reads these, its config.json naming
BOS and EOS). A causal model's target is the next token; a bidirectional model's target is the
token itself.

BOS and separator are special tokens of the tokenizer: ``bos=`` is ``true`` (the tokenizer's BOS,
else its [CLS], else the model config's ``bos_token_id``), ``none`` (or ``false``: windows start
with the corpus's tokens) or a token id; ``separator=`` is ``eos`` (the tokenizer's end-of-sequence
token, else its [SEP], else the config's ``eos_token_id``), ``none`` (documents follow each other
directly) or a token id. An id is taken from the tokenizer or the config only if the tokenizer
holds it as a special token (never its unknown token, nor an ordinary token a config's default
names); without one, packing is an error naming these options.

A data set hands out any sample range: ``dataset.batch(start, stop)`` gives numpy arrays
(sample, pos): tokens, valid, target, scored and the labels (arithmetic: token_str, role,
operand, digit_place, digit_value, carry; corpora: token_str, document, offset).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from orthosphere.errors import ConfigError
from orthosphere.params import REQUIRED, Config, Delegated, Flag, Interval, Normalised, Rule, Text, parameter

from .corpus import parquet_rows
from .packing import PackedWindows, PaddedDocuments, TokenizedCorpus
from .tasks import DEFAULT_SPEC, TaskSpec, generate, parse_split

DEFAULT_MAX_LENGTH = 128
SPEC_FORMS = (
    "arithmetic:split=NAME,seed=N[,train_counts=2/3/5,...]; text:path=FILE[,document=line|file]; "
    "jsonl:path=FILE[,field=text]; parquet:path=FILE_OR_FOLDER[,column=text]; hf:path=FOLDER[,split=NAME][,column=text]; "
    "a corpus takes context=N[,bos=true|none|ID][,separator=eos|none|ID] (packed windows) or max_length=N "
    "(one padded sample a document), and tokenized=true for a column of token ids"
)
ARITHMETIC_LABELS = {
    "token_str": "str", "role": "str", "operand": "int16",
    "digit_place": "int16", "digit_value": "int16", "carry": "int16",
}
SPECIAL_TOKENS = {"bos": "a BOS token", "separator": "an end-of-sequence token to separate documents"}
"""What each special-token option of packed windows asks for."""


@dataclass(frozen=True)
class ArithmeticData(Config):
    """The arithmetic task's samples: one split drawn with a seed, with the task's counts and digit lengths."""

    split: str = parameter("test", Delegated(parse_split), help="train, test, interpolation or extrapolation")
    seed: int = parameter(0, Interval(int), help="the seed the samples are drawn with")
    spec: TaskSpec = parameter(DEFAULT_SPEC, Rule(lambda value: isinstance(value, TaskSpec), "a TaskSpec"),
                               help="the number counts and digit lengths of each split")


@dataclass(frozen=True)
class CorpusData:
    """A corpus and how to lay it out (see the module docstring)."""

    source: str
    path: str
    column: str = "text"
    document: str = "line"
    split: str | None = None
    tokenized: bool = False
    layout: str = "padded"
    length: int = DEFAULT_MAX_LENGTH
    bos: bool = True
    bos_id: int | None = None
    """The BOS given as a token id (None: the tokenizer's); only with bos (ignored without)."""
    separator: bool = True
    separator_id: int | None = None
    """The separator given as a token id (None: the tokenizer's end-of-sequence token); only with
    separator (ignored without)."""


def _path(value) -> str:
    path = os.fspath(value)
    if not isinstance(path, str) or not path:
        raise ValueError("not a path")
    return path


SPECIAL_TOKEN = Rule(lambda value: isinstance(value, bool) or (isinstance(value, int) and value >= 0),
                     "True (the tokenizer's), False (none) or a token id")


@dataclass(frozen=True)
class CorpusSource(Config):
    """What every corpus takes: where it is, and how its documents become samples: packed windows of
    ``context`` tokens, or one padded sample a document of at most ``max_length`` tokens (the default,
    with max_length=128). Each source adds its own parameters; ``data()`` is the corpus as extraction
    reads it."""

    source: ClassVar[str] = ""

    path: str = parameter(REQUIRED, Normalised(_path, "a path"), help="the corpus: a file (a folder of Parquet files, "
                                                                     "a saved dataset)")
    context: int | None = parameter(None, Interval(int), None, help="pack the documents into windows of this many tokens")
    max_length: int | None = parameter(None, Interval(int), None,
                                       help=f"one padded sample a document, cut to this many tokens ({DEFAULT_MAX_LENGTH} "
                                            "without context)")
    bos: bool | int | None = parameter(None, SPECIAL_TOKEN, None, help="the first token of each packed window: the "
                                                                      "tokenizer's BOS (True, the default), none or a token id")
    separator: bool | int | None = parameter(None, SPECIAL_TOKEN, None,
                                             help="between packed documents: the tokenizer's end-of-sequence token (True, "
                                                  "the default), none or a token id")

    def check(self) -> None:
        if self.context is not None and self.max_length is not None:
            raise ConfigError("context=N (packed windows) and max_length=N (padded documents) exclude each other: give one")
        packed = self.context is not None
        if not packed and (self.bos is not None or self.separator is not None):
            raise ConfigError("bos= and separator= shape packed windows: give context=N with them")
        shortest = 1 + (packed and self.bos is not False)
        if self._length() < shortest:
            raise ConfigError(f"{'context' if packed else 'max_length'}={self._length()} is too short: expected at least {shortest}")

    def _length(self) -> int:
        if self.context is not None:
            return self.context
        return DEFAULT_MAX_LENGTH if self.max_length is None else self.max_length

    def _documents(self) -> dict:
        """Where in the source the documents are (CorpusData's column, document, split and tokenized)."""
        return {}

    def data(self) -> CorpusData:
        bos, separator = _special_token(self.bos), _special_token(self.separator)
        return CorpusData(source=self.source, path=self.path, layout="padded" if self.context is None else "packed",
                          length=self._length(), bos=bos[0], bos_id=bos[1], separator=separator[0],
                          separator_id=separator[1], **self._documents())


def _special_token(value: bool | int | None) -> tuple[bool, int | None]:
    """(whether the token is wanted, its id if given) of bos= or separator= (None: the tokenizer's)."""
    if value is None or isinstance(value, bool):
        return value is not False, None
    return True, value


@dataclass(frozen=True)
class TextCorpus(CorpusSource):
    """A text file: one document a line, or the whole file."""

    source: ClassVar[str] = "text"

    document: str = parameter("line", Rule(lambda value: value in ("line", "file"),
                                           "line (one document a line) or file (the whole file)"),
                              help="line: one document a line; file: the whole file")

    def _documents(self) -> dict:
        return {"document": self.document}


@dataclass(frozen=True)
class _TokenizableCorpus(CorpusSource):
    """A source whose documents may be lists of token ids."""

    tokenized: bool = parameter(False, Flag(), help="the documents are lists of token ids, used as given")


@dataclass(frozen=True)
class JsonlCorpus(_TokenizableCorpus):
    """A JSON-lines file whose records hold each document in ``field``."""

    source: ClassVar[str] = "jsonl"

    field: str = parameter("text", Text("a field name"), help="the records' field holding the document")

    def _documents(self) -> dict:
        return {"column": self.field, "tokenized": self.tokenized}


@dataclass(frozen=True)
class ParquetCorpus(_TokenizableCorpus):
    """A Parquet file, or a folder of them, with each document in ``column``."""

    source: ClassVar[str] = "parquet"

    column: str = parameter("text", Text("a column name"), help="the column holding the documents")

    def _documents(self) -> dict:
        return {"column": self.column, "tokenized": self.tokenized}


@dataclass(frozen=True)
class SavedDatasetCorpus(_TokenizableCorpus):
    """A dataset saved with the datasets library's ``save_to_disk`` (one ``split`` of a DatasetDict)."""

    source: ClassVar[str] = "hf"

    split: str | None = parameter(None, Text("a split name"), None, help="the split of a saved DatasetDict")
    column: str = parameter("text", Text("a column name"), help="the column holding the documents")

    def _documents(self) -> dict:
        return {"column": self.column, "split": self.split, "tokenized": self.tokenized}


CORPUS_SOURCES = {source.source: source for source in (TextCorpus, JsonlCorpus, ParquetCorpus, SavedDatasetCorpus)}
"""Each corpus source's configuration, by the name its task spec starts with."""


def parse_task(spec: str) -> ArithmeticData | CorpusData:
    """Parse a task spec; anything that does not parse is a ConfigError naming the forms."""
    name, _, rest = spec.partition(":")
    options = _options(spec, rest)
    try:
        if name == "arithmetic":
            return _arithmetic_of_spec(options)
        if name in CORPUS_SOURCES:
            return _corpus_of_spec(CORPUS_SOURCES[name], options)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"task spec {spec!r} does not parse ({error}): expected {SPEC_FORMS}") from None
    raise ConfigError(f"task spec {spec!r} does not parse: unknown task {name!r}; expected {SPEC_FORMS}")


def task_data(task) -> ArithmeticData | CorpusData:
    """The data of a job's `task`: a spec string parsed, or the data object as given."""
    if isinstance(task, (ArithmeticData, CorpusData)):
        return task
    if isinstance(task, str):
        return parse_task(task)
    raise ConfigError(f"data {task!r} ({type(task).__name__}): expected a task spec ({SPEC_FORMS}) or the object of "
                      "orthosphere.corpus.text/jsonl/parquet/hf(...) or orthosphere.tasks.arithmetic(...)")


def corpus(source: str, path, **options) -> CorpusData:
    """A corpus as a data object, from the parameters of its source's configuration (``CORPUS_SOURCES``):
    ``corpus("jsonl", "c.jsonl", field="text", context=128)`` is ``jsonl:path=c.jsonl,field=text,context=128``."""
    if source not in CORPUS_SOURCES:
        raise ConfigError(f"corpus source {source!r}: expected one of {list(CORPUS_SOURCES)}")
    return _built(f"{source} corpus {path}", lambda: _corpus(CORPUS_SOURCES[source], {"path": path, **options}))


def arithmetic(split: str = "test", seed: int = 0, **counts) -> ArithmeticData:
    """The arithmetic task as a data object: a split, a seed and TaskSpec fields as lists
    (``arithmetic("extrapolation", 3, train_counts=[2, 3, 5])``), checked as the spec is."""
    return _built("arithmetic task", lambda: _arithmetic(split, seed, counts))


def _built(what: str, build):
    try:
        return build()
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{what}: {error}") from None


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


def _arithmetic(split, seed, counts: dict) -> ArithmeticData:
    """The arithmetic task of these values (Python's or a spec's, parsed)."""
    known = set(TaskSpec.parameters())
    unknown = sorted(set(counts) - known)
    if unknown:
        raise ValueError(f"unknown arithmetic option(s) {unknown}; expected split, seed or {sorted(known)}")
    return ArithmeticData(split, seed, TaskSpec(**counts) if counts else DEFAULT_SPEC)


def _arithmetic_of_spec(options: dict[str, str]) -> ArithmeticData:
    split, seed = options.pop("split", "test"), _integer("seed", options.pop("seed", "0"))
    counts = {key: [_integer(key, part) for part in value.split("/")] if key in TaskSpec.parameters() else value
              for key, value in options.items()}
    return _arithmetic(split, seed, counts)


def _flag(key: str, value: str, true: str = "true", false: str = "false") -> bool:
    if value not in (true, false):
        raise ValueError(f"{key}={value!r}: expected {true} or {false}")
    return value == true


def _special_option(key: str, value: str, default: str, nones: tuple[str, ...]) -> bool | int:
    """bos= or separator= of a spec: `default` (the tokenizer's: True), one of `nones` (False) or a token id."""
    if value == default:
        return True
    if value in nones:
        return False
    if value.isascii() and value.isdigit():  # not "²", which isdigit() takes and int() refuses
        return int(value)
    raise ValueError(f"{key}={value!r}: expected {default} or {nones[0]}, or a token id")


SPEC_VALUES = {
    "context": _integer,
    "max_length": _integer,
    "tokenized": _flag,
    "bos": lambda key, value: _special_option(key, value, "true", ("none", "false")),
    "separator": lambda key, value: _special_option(key, value, "eos", ("none",)),
}
"""How a task spec writes the corpus parameters that are not text: key -> parse(key, text)."""


def _corpus_of_spec(source: type[CorpusSource], options: dict[str, str]) -> CorpusData:
    if not options.get("path"):
        raise ValueError(f"{source.source} needs path=...")
    return _corpus(source, {key: SPEC_VALUES[key](key, value) if key in SPEC_VALUES else value
                            for key, value in options.items()})


def _corpus(source: type[CorpusSource], options: dict) -> CorpusData:
    """The corpus of these parameters (Python's, or a spec's parsed); an unknown one is an error naming the known."""
    allowed = sorted(source.parameters())
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"unknown {source.source} option(s) {unknown}; expected {allowed}")
    return source(**options).data()


def open_dataset(data, *, n_samples: int | None, tokenizer=None, causal: bool = True, vocab_size: int | None = None,
                 scratch: str | None = None):
    """The data set of a parsed spec. A corpus is tokenised here, once, with the model's tokenizer
    (its token files in a new folder in `scratch`, None: the system's temporary folder)."""
    if n_samples is not None:
        _check_samples(n_samples)
    if isinstance(data, ArithmeticData):
        if n_samples is None:
            raise ConfigError("the arithmetic task needs a sample count: pass n_samples=N")
        return ArithmeticDataset(data, n_samples)
    if tokenizer is None:
        raise ConfigError(
            "a text corpus needs the model's tokenizer, and this model has none: add its tokenizer files "
            "(tokenizer.json ...) to the model directory (a model loaded in this session: pass tokenizer=), or give the "
            "corpus as token ids (tokenized=true)"
        )
    if data.layout == "padded":
        _check_rows(data, n_samples)
        corpus = TokenizedCorpus(data, tokenizer, special_tokens=True, separator=None, vocab_size=vocab_size,
                                 max_document_tokens=data.length, stop_documents=n_samples, scratch=scratch)
        layout = functools.partial(PaddedDocuments, max_length=data.length)
    else:
        bos = _special("bos", data.bos, data.bos_id, tokenizer.bos_id, tokenizer, vocab_size)
        separator = _special("separator", data.separator, data.separator_id, tokenizer.eos_id, tokenizer, vocab_size)
        body = data.length - (bos is not None)
        corpus = TokenizedCorpus(data, tokenizer, special_tokens=False, separator=separator, vocab_size=vocab_size,
                                 stop_tokens=None if n_samples is None else n_samples * body + 1, scratch=scratch)
        layout = functools.partial(PackedWindows, context=data.length, bos=bos)
    try:
        return layout(corpus, n_samples=n_samples, causal=causal, pad_id=tokenizer.pad_id)
    except BaseException:
        corpus.close()
        raise


def _special(key: str, wanted: bool, given: int | None, own: int | None, tokenizer,
             vocab_size: int | None) -> int | None:
    """The token id that bos= or separator= (`key`) asks for: none (not `wanted`), the id `given`,
    or `own`, the tokenizer's."""
    if not wanted:
        return None
    if given is not None:
        if vocab_size is not None and given >= vocab_size:
            raise ConfigError(f"{key}={given} is outside the model's vocabulary 0..{vocab_size - 1}: give a token id "
                              f"of the model, or {key}=none")
        return given
    if own is None:
        raise ConfigError(f"packing needs {SPECIAL_TOKENS[key]}, and none is known: {tokenizer.lacks_special}; pass "
                          f"{key}=ID (a token id of the model) or {key}=none in the task spec")
    return int(own)


def _check_rows(data: CorpusData, n_samples: int | None) -> None:
    """Refuse, before tokenising, more padded samples than a Parquet corpus has rows (its metadata says)."""
    rows = parquet_rows(data)
    if n_samples is not None and rows is not None and n_samples > rows:
        raise ConfigError(f"corpus {data.path} has {rows} rows, fewer than n_samples={n_samples} (one padded sample a "
                          "document): ask for fewer samples or give a longer corpus")


def _check_samples(n_samples) -> None:
    if not isinstance(n_samples, (int, np.integer)) or isinstance(n_samples, bool) or n_samples < 1:
        raise ConfigError(f"n_samples={n_samples!r}: expected a positive number of samples")


class ArithmeticDataset:
    """Examples 0 .. n_samples - 1 of one split and seed of the arithmetic task."""

    labels = ARITHMETIC_LABELS
    prewritten = ()

    def __init__(self, data: ArithmeticData, n_samples: int):
        _check_samples(n_samples)
        self.data, self.n_samples = data, int(n_samples)
        self.n_pos = data.spec.max_length(data.split)

    def describe(self) -> dict:
        return self.data.spec.describe(self.data.split, self.data.seed)

    def batch(self, start: int, stop: int) -> dict[str, np.ndarray]:
        generated = generate(self.data.split, stop - start, self.data.seed, self.data.spec, start=start)
        arrays = {
            "tokens": generated.tokens.astype(np.int32, copy=False),
            "valid": generated.valid,
            "target": generated.target.astype(np.int32, copy=False),
            "scored": generated.scored,
        }
        arrays.update({name: generated.labels[name] for name in self.labels})
        return arrays


class StoredTokens:
    """A corpus's samples as the coordinating process wrote them into the store: each shard reads
    its tokens and mask back, so that neither the corpus nor a tokenizer is needed where it runs.
    ``prewritten`` names every array that process wrote (tokens, valid, target, scored and the
    labels): a shard neither writes them nor fills them."""

    def __init__(self, group):
        self.tokens, self.valid = group["tokens"], group["valid"]
        self.prewritten = ("tokens", "valid", "target", "scored", *group.attrs["labels"])

    def batch(self, start: int, stop: int) -> dict[str, np.ndarray]:
        return {"tokens": self.tokens[start:stop], "valid": self.valid[start:stop]}
