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

import numpy as np

from .corpus import parquet_rows
from .model import ConfigError
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
CORPUS_OPTIONS = {
    "text": {"document"},
    "jsonl": {"field", "tokenized"},
    "parquet": {"column", "tokenized"},
    "hf": {"column", "split", "tokenized"},
}
LAYOUT_OPTIONS = {"path", "context", "max_length", "bos", "separator"}
SPECIAL_TOKENS = {"bos": "a BOS token", "separator": "an end-of-sequence token to separate documents"}
"""What each special-token option of packed windows asks for."""


@dataclass(frozen=True)
class ArithmeticData:
    split: str = "test"
    seed: int = 0
    spec: TaskSpec = DEFAULT_SPEC


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


def parse_task(spec: str) -> ArithmeticData | CorpusData:
    """Parse a task spec; anything that does not parse is a ConfigError naming the forms."""
    name, _, rest = spec.partition(":")
    options = _options(spec, rest)
    try:
        if name == "arithmetic":
            return _arithmetic(options)
        if name in CORPUS_OPTIONS:
            return _corpus(name, options)
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
    """A corpus as a data object, from the keywords of its task spec: ``corpus("jsonl", "c.jsonl",
    field="text", context=128)`` is ``jsonl:path=c.jsonl,field=text,context=128``, checked alike."""
    if source not in CORPUS_OPTIONS:
        raise ConfigError(f"corpus source {source!r}: expected one of {list(CORPUS_OPTIONS)}")
    values = {"path": os.fspath(path), **_spec_values(options)}
    return _built(f"{source} corpus {values['path']}", lambda: _corpus(source, values))


def arithmetic(split: str = "test", seed: int = 0, **counts) -> ArithmeticData:
    """The arithmetic task as a data object: a split, a seed and TaskSpec fields as lists
    (``arithmetic("extrapolation", 3, train_counts=[2, 3, 5])``), checked as the spec is."""
    values = _spec_values({"split": split, "seed": seed, **counts})
    return _built("arithmetic task", lambda: _arithmetic(values))


def _built(what: str, build):
    try:
        return build()
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{what}: {error}") from None


def _spec_values(options: dict) -> dict[str, str]:
    """Keyword values as the task spec writes them: True/False as true/false (bos: true/none,
    separator: eos/none), lists joined with /; None leaves the option out."""
    def text(key, value) -> str:
        if isinstance(value, bool):
            return {"bos": ("none", "true"), "separator": ("none", "eos")}.get(key, ("false", "true"))[value]
        if isinstance(value, (list, tuple)):
            return "/".join(text(key, item) for item in value)
        return str(value)

    return {key: text(key, value) for key, value in options.items() if value is not None}


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
    split = parse_split(options.pop("split", "test"))
    seed = _integer("seed", options.pop("seed", "0"))
    known = set(TaskSpec.parameters())
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown arithmetic option(s) {unknown}; expected split, seed or {sorted(known)}")
    spec_values = {key: [_integer(key, part) for part in value.split("/")] for key, value in options.items()}
    return ArithmeticData(split, seed, TaskSpec(**spec_values) if spec_values else DEFAULT_SPEC)


def _flag(key: str, value: str, true: str = "true", false: str = "false") -> bool:
    if value not in (true, false):
        raise ValueError(f"{key}={value!r}: expected {true} or {false}")
    return value == true


def _special_option(key: str, value: str, default: str, nones: tuple[str, ...]) -> tuple[bool, int | None]:
    """(whether the token is wanted, its id if given) of bos= or separator=: `default` (the tokenizer's),
    one of `nones` (none) or a token id."""
    if value == default:
        return True, None
    if value in nones:
        return False, None
    if value.isascii() and value.isdigit():  # not "²", which isdigit() takes and int() refuses
        return True, int(value)
    raise ValueError(f"{key}={value!r}: expected {default} or {nones[0]}, or a token id")


def _corpus(source: str, options: dict) -> CorpusData:
    allowed = CORPUS_OPTIONS[source] | LAYOUT_OPTIONS
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"unknown {source} option(s) {unknown}; expected {sorted(allowed)}")
    if not options.get("path"):
        raise ValueError(f"{source} needs path=...")
    if "context" in options and "max_length" in options:
        raise ValueError("context=N (packed windows) and max_length=N (padded documents) exclude each other: give one")
    packed = "context" in options
    length = _integer("context" if packed else "max_length", options.get("context", options.get("max_length", str(DEFAULT_MAX_LENGTH))))
    bos, bos_id = _special_option("bos", options.get("bos", "true"), "true", ("none", "false"))
    separator, separator_id = _special_option("separator", options.get("separator", "eos"), "eos", ("none",))
    if not packed and ({"bos", "separator"} & set(options)):
        raise ValueError("bos= and separator= shape packed windows: give context=N with them")
    if length < 1 + (packed and bos):
        raise ValueError(f"{'context' if packed else 'max_length'}={length} is too short: expected at least {1 + (packed and bos)}")
    document = options.get("document", "line")
    if document not in ("line", "file"):
        raise ValueError(f"document={document!r}: expected line (one document a line) or file (the whole file)")
    return CorpusData(
        source=source, path=options["path"], column=options.get("field", options.get("column", "text")),
        document=document, split=options.get("split"), tokenized=_flag("tokenized", options.get("tokenized", "false")),
        layout="packed" if packed else "padded", length=length, bos=bos, bos_id=bos_id,
        separator=separator, separator_id=separator_id,
    )


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
            "(tokenizer.json ...) to the model directory, give the corpus as token ids (tokenized=true), "
            "or use the arithmetic task"
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
