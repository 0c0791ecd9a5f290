"""The extraction job: run a model over a data set and stream its activations into a store.

``run_job(ExtractJob(...), client=None)`` is what ``orthosphere extract`` runs:

1. parse the task spec, refuse what the job's ``mode`` may not touch at its URL (an existing store
   unless ``mode="resume"`` or ``mode="overwrite"``; what is not a store, always);
2. load the model, check sites and layers, open the data set;
3. open the store: the store's lifecycle (``orthosphere.store.lifecycle.open_for_job``) creates it
   (chunk-aligned shards), or, when resuming, checks that the store was made by the same job
   (model, task, sites, layers, dtype, sample count) and picks up its unfinished shards; a
   complete store is left alone;
4. write the attention maps, run every unfinished shard, then finish the store.

The model's predictions (``pred``) need its logits, so the forward pass runs through every layer;
a job that keeps none (``pred=False``; or a model without a language-model head) stops each pass after the last of its layers.

A corpus is tokenised once, by this process (packing.py), which writes every pending shard's
token arrays and labels into the store before the shards run; each shard then reads its tokens
back from the store, so no worker needs the corpus or a tokenizer.

The shards run in ``shards.py``: each runs its samples in batches starting at its first sample,
so a shard's values never depend on which process runs it or when: a resumed job is bitwise identical to
an uninterrupted one. Writes happen behind compute: the forward pass hands each batch to a
bounded queue that one writer thread drains (``store.stream.ChunkStream``: each batch's layers
go straight into the chunk files of a local uncompressed store, from the capture's layer-major
buffers, without copies), and the thread marks a shard complete only after its last chunk is
written. Memory is bounded by the queue depth, whatever the number of samples: the capture's
batch buffers come from a pool that takes them back once written, so no batch pays for fresh
memory. A float16 store refuses values beyond float16's range (they would be stored as inf).

Without a Dask client the shards run one after another in this process, on the job's device;
with one, each shard is a Dask task that loads the model on the job's device (once per worker),
writes its own chunks and records itself complete, while this coordinating process reads the
model's description and weights on the CPU: it never needs the workers' device.

Whatever a kill leaves, ``mode="resume"`` continues: a store whose creation or replacement was
interrupted is created afresh (nothing in it can be resumed), a created one continues with its
unfinished shards (a corpus's token arrays of those shards are written again), and chunks of
complete shards found missing or truncated are rewritten; ``mode="overwrite"`` replaces any of them.
For the crash tests, ``ORTHOSPHERE_CRASH_AT=POINT[:N]`` kills the process at a named point (see
``orthosphere.store.faults``; ``samples-written`` follows each block of a corpus's token arrays).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

from tqdm import tqdm

from orthosphere.errors import ConfigError
from orthosphere.params import (
    POSITIVE_INTEGER,
    REQUIRED,
    Config,
    Delegated,
    Flag,
    Items,
    Normalised,
    OneOf,
    Rule,
    Text,
    parameter,
)
from orthosphere.store.faults import crash_point
from orthosphere.store.lifecycle import MODES, Opened, check_location, chunk_samples, open_for_job
from orthosphere.store.location import as_location
from orthosphere.store.schema import ACTIVATION_DTYPES, check_dtype, holds_pred, layer_indices
from orthosphere.store.writer import new_store

from .data import ArithmeticData, CorpusData, open_dataset, task_data
from .defaults import DEFAULT_BATCH_SIZE
from .shards import Meter, ShardPlan, run_in_process, run_on_dask
from .sources import MODEL_DTYPES, CharacterTokenizer, LoadedModel, check_device, from_model, load_source

log = logging.getLogger("orthosphere.extract")

LAYERS = Delegated(lambda layers: tuple(layer_indices(layers, ConfigError)), "layer indices of the model")


def _is_mapping(value) -> bool:
    return isinstance(value, Mapping)


def _store_url(value) -> str:
    url = os.fspath(value)
    if not isinstance(url, str) or not url:
        raise ValueError(value)
    return url


@dataclass(frozen=True)
class ExtractJob(Config):
    """Everything `orthosphere extract` is asked to do: one typed configuration, built alike by the
    CLI, a pipeline's [extract] table and ``orthosphere.extract(...)``."""

    model: str | os.PathLike | object = parameter(
        REQUIRED, help="a path (model directory, .gguf file), or a model loaded in this process (sources.from_model)")
    task: str | ArithmeticData | CorpusData = parameter(
        REQUIRED, help="a task spec (arithmetic:..., text:..., jsonl:..., parquet:..., hf:...) or the data object it "
                       "parses to (data.corpus, data.arithmetic)")
    out: str = parameter(REQUIRED, Normalised(_store_url, "a store path or fsspec URL"), help="the store to write")
    n_samples: int | None = parameter(None, POSITIVE_INTEGER, None, help="samples (None: the whole task or corpus)")
    sites: tuple[str, ...] | None = parameter(None, Items(Text("a site name"), single=True), None,
                                              help="sites to store (None: DEFAULT_SITES, all but pattern and the block outputs)")
    layers: tuple[int, ...] | None = parameter(None, LAYERS, None, help="layers to store (None: all)")
    dtype: str = parameter("float32", Normalised(check_dtype, f"one of {list(ACTIVATION_DTYPES)}", ACTIVATION_DTYPES),
                           help="the stored activations' dtype")
    batch_size: int = parameter(DEFAULT_BATCH_SIZE, POSITIVE_INTEGER, help="samples per forward pass")
    n_shards: int = parameter(1, POSITIVE_INTEGER, help="chunk-aligned shards: the unit of Dask tasks and of resuming")
    samples_per_chunk: int | None = parameter(None, POSITIVE_INTEGER, None, help="samples per chunk (None: about 4 MB)")
    pred: bool = parameter(True, Flag(), help="store the model's predictions, which needs the whole forward pass "
                           "(False: the pass stops after the last stored layer)")
    mode: str = parameter("new", OneOf(MODES), help="new: create the store (refuse an existing one); resume: continue "
                          "an interrupted job (a complete store is left alone); overwrite: replace an existing store")
    break_lock: bool = parameter(False, Flag(), help="break the store's lock even if its holder looks alive")
    device: str = parameter("auto", Normalised(check_device, "auto, cpu, cuda or cuda:N"), help="where the model runs")
    model_dtype: str | None = parameter(None, OneOf(MODEL_DTYPES), None, help="the dtype a model path is loaded in")
    storage_options: dict | None = parameter(None, Rule(_is_mapping, "a mapping of fsspec storage options"), None,
                                             help="fsspec options of an object-storage store")
    command: str | None = parameter(None, Text("the command line"), None, help="recorded in the store")
    tokenizer: object | None = parameter(
        None, help="with a loaded transformers model: its tokenizer (None: the model reads token-id corpora only)")

    def check(self) -> None:
        if self.in_memory and self.model_dtype is not None:
            raise ConfigError(f"model_dtype={self.model_dtype!r} with a model object: it runs in the dtype it has; "
                              "convert it (model.to(dtype)) or leave model_dtype out")
        if not self.in_memory and self.tokenizer is not None:
            raise ConfigError("tokenizer= goes with a model object; a model path brings its own tokenizer files")

    @property
    def in_memory(self) -> bool:
        return not isinstance(self.model, (str, os.PathLike))


@dataclass(frozen=True)
class ExtractResult:
    url: str
    n_samples: int
    shards_run: int
    shards_total: int
    tokens: int
    seconds: float
    cpu_seconds: float = 0.0
    already_complete: bool = False

    def summary(self) -> str:
        if self.already_complete:
            return f"store {self.url} is already complete ({self.n_samples} samples): nothing to do"
        rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
        return (
            f"store {self.url} complete: {self.n_samples} samples; ran {self.shards_run} of {self.shards_total} "
            f"shards, {self.tokens} tokens in {self.seconds:.1f} s ({rate:,.0f} tokens/s)"
        )


def run_job(job: ExtractJob, client=None, progress: bool = True) -> ExtractResult:
    """Run (or resume) an extraction job; `client` is a distributed.Client or None (in-process)."""
    data = task_data(job.task)
    _check_client(job, client)
    check_location(as_location(job.out, job.storage_options), job.mode)
    if job.in_memory:
        loaded = from_model(job.model, job.tokenizer, job.device)
    else:
        loaded = load_source(job.model, job.device if client is None else "cpu", job.model_dtype)
    sites, layers = loaded.adapter.check_sites(job.sites), loaded.adapter.check_layers(job.layers)
    description = loaded.describe()
    dataset = _open_data(data, job, loaded, description)
    try:
        return _extract(job, data, loaded, dataset, description, sites, layers, client, progress)
    finally:
        if isinstance(data, CorpusData):
            dataset.close()


def _extract(job, data, loaded, dataset, description, sites, layers, client, progress) -> ExtractResult:
    identity = {
        "model": description, "task": dataset.describe(), "sites": list(sites), "layers": list(layers),
        "dtype": job.dtype, "labels": dict(dataset.labels), "n_samples": dataset.n_samples, "n_pos": dataset.n_pos,
        "pred": holds_pred({"pred": job.pred, "model": description}),
    }
    opened = _open_store(job, identity)
    log.info("%s", opened.news)
    writer = opened.writer
    if writer is None:
        return ExtractResult(job.out, dataset.n_samples, 0, opened.n_shards, 0, 0.0, already_complete=True)
    crash_point("store-created")
    plan = ShardPlan(
        "" if job.in_memory else os.path.abspath(job.model), job.device, job.model_dtype, _absolute(data), dataset.n_samples, sites, layers,
        job.dtype, job.batch_size, _absolute_url(writer.url), job.storage_options, identity["pred"],
    )
    with writer:
        if not writer.weights_written():
            writer.write_weights(loaded.adapter.all_head_weights(layers))
        if isinstance(data, CorpusData):
            write_samples(writer, dataset)
        result = _run_pending(job, loaded, plan, writer, client, progress)
        crash_point("before-finish")
        writer.finish()
    log.info("store complete at %s", writer.url)
    return result


def _open_data(data, job: ExtractJob, loaded: LoadedModel, description: dict):
    """The job's data set (a corpus is tokenised here), checked against the model's positions:
    packed windows before the corpus is tokenised, padded documents once their longest is known."""
    limit = max_positions(loaded.adapter.model)
    if not isinstance(data, CorpusData):
        if not isinstance(loaded.tokenizer, CharacterTokenizer):
            raise ConfigError(
                f"the arithmetic task with a {description.get('family', 'non-arithmetic')} model: the task's tokens are the "
                "arithmetic transformers' character ids, which mean nothing to this model's embeddings; give it a text corpus "
                "(e.g. text:path=FILE,context=256), or extract the arithmetic task with an orthosphere arithmetic model"
            )
        dataset = open_dataset(data, n_samples=job.n_samples)
        _check_positions(dataset.n_pos, limit, "max_length", loaded.adapter.model)
        return dataset
    if data.layout == "packed":
        _check_positions(data.length, limit, "context", loaded.adapter.model)
    dataset = open_dataset(
        data, n_samples=job.n_samples, tokenizer=loaded.corpus_tokenizer(data.tokenized), causal=description["causal"],
        vocab_size=description.get("vocab_size"), scratch=_scratch_folder(job),
    )
    if data.layout == "padded":
        try:
            _check_positions(dataset.n_pos, limit, "max_length", loaded.adapter.model)
            _check_rope_switch(dataset, loaded.adapter.model)
        except ConfigError:
            dataset.close()
            raise
    return dataset


def _check_positions(n_pos: int, limit: int | None, option: str, model) -> None:
    if limit is not None and n_pos > limit:
        dynamic = any(parameters.get("rope_type") == "dynamic" for parameters in _rope_sets(_text_config(model)))
        why = (" (its dynamic rope rescales its frequencies beyond them by each batch's length, which a store's terms "
               "cannot describe)") if dynamic else ""
        raise ConfigError(
            f"samples of {n_pos} positions are longer than the model's {limit} positions{why}: "
            f"use {option}={limit} or less in the task spec"
        )


def _check_rope_switch(dataset, model) -> None:
    """Refuse padded documents that straddle a longrope model's switch: its rotary frequencies change to
    their long-context set when a batch's largest position passes original_max_position_embeddings, and
    padding every document to the longest would give the short ones the set they do not get alone."""
    switch = rope_length_switch(model)
    if switch is None or dataset.n_pos <= switch:
        return
    lengths = dataset.document_lengths
    short = int((lengths <= switch).sum())
    if short:
        raise ConfigError(
            f"padded documents of {int(lengths.min())}-{dataset.n_pos} tokens with a longrope model: it switches its rotary "
            f"frequencies to their long-context set when a batch reaches original_max_position_embeddings={switch} "
            f"positions, so the {short} documents of {switch} tokens or fewer, padded to {dataset.n_pos}, would be stored with "
            f"frequencies they do not get alone; use max_length={switch} or less, or packed windows (context=N)"
        )


def rope_length_switch(model) -> int | None:
    """The length above which a longrope model's rotary frequencies switch set (transformers picks the set
    from the batch's largest position, ``modeling_rope_utils.dynamic_rope_update``); None for other models."""
    text = _text_config(model)
    switches = [parameters.get("original_max_position_embeddings") or getattr(text, "original_max_position_embeddings", None)
                or text.max_position_embeddings for parameters in _rope_sets(text) if parameters.get("rope_type") == "longrope"]
    return min(int(value) for value in switches) if switches else None


def _rope_sets(text) -> list[dict]:
    """A text config's rope parameters: one set, or one a layer type."""
    rope = getattr(text, "rope_parameters", None)
    if not isinstance(rope, dict):
        return []
    return [rope] if "rope_type" in rope else [value for value in rope.values() if isinstance(value, dict)]


def _text_config(model):
    """A Hugging Face model's (text) config; a multimodal model's language model's."""
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _scratch_folder(job: ExtractJob) -> str | None:
    """Where a corpus's temporary token files go: the folder of a local output store (where the
    store's space is), else None (the system's temporary folder)."""
    location = as_location(job.out, job.storage_options)
    if not location.is_local:
        return None
    folder = os.path.dirname(location.local_path)
    return folder if os.path.isdir(folder) else None


def max_positions(model) -> int | None:
    """The longest sequence the model takes: max_position_embeddings (or n_positions) of a Hugging
    Face (text) config, less the rows of a position table numbered after the pad id; max_len of an
    arithmetic model with learned positions; None where unbounded."""
    config, text = getattr(model, "config", None), _text_config(model)
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(text, name, None)
        if isinstance(value, int):
            return value - _positions_before_the_first(model)
    return config.max_len if getattr(config, "positions", None) == "learned" else None


def _positions_before_the_first(model) -> int:
    """Rows of the model's learned position table that no token's position reaches: RoBERTa and the
    families that copy its embeddings (XLM-R, CamemBERT, MPNet, ESM ...) number positions from their
    pad id + 1, the table's padding row marking it; 0 for every other model."""
    from torch import nn

    for name, module in model.named_modules():
        if name.endswith("position_embeddings") and isinstance(module, nn.Embedding) and module.padding_idx is not None:
            return module.padding_idx + 1
    return 0


def write_samples(writer, dataset, block_bytes: int = 64 * 2**20) -> None:
    """Write a corpus's token arrays and labels (tokens, valid, target, scored, token_str, document,
    offset) of every pending shard, in blocks of whole chunks."""
    chunk = writer.attrs["samples_per_chunk"]
    block = chunk * max(1, block_bytes // (32 * dataset.n_pos * chunk))
    for index in writer.pending_shards():
        start, stop = writer.shards[index]
        for first in range(start, stop, block):
            writer.write(first, dataset.batch(first, min(first + block, stop)))
            crash_point("samples-written")


def _open_store(job: ExtractJob, identity: dict) -> Opened:
    """The job's store, opened by the store's lifecycle in the job's mode: the store it creates has
    the job's identity and chunks sized for its batches and shards."""
    chunk = job.samples_per_chunk or chunk_samples(
        identity["model"], identity["n_samples"], identity["n_pos"], identity["sites"], len(identity["layers"]),
        job.dtype, job.batch_size, job.n_shards,
    )
    new = new_store(
        model=identity["model"], task=identity["task"], n_samples=identity["n_samples"], n_pos=identity["n_pos"],
        sites=identity["sites"], layers=identity["layers"], dtype=job.dtype, labels=identity["labels"],
        n_shards=job.n_shards, samples_per_chunk=chunk, pred=identity["pred"],
    )
    return open_for_job(as_location(job.out, job.storage_options), job.mode, identity, new,
                        break_lock=job.break_lock, command=job.command)


def _run_pending(job, loaded, plan: ShardPlan, writer, client, progress: bool) -> ExtractResult:
    """Run the store's unfinished shards, in this process or as Dask tasks, with a progress bar."""
    pending = writer.pending_shards()
    n_pending = sum(writer.shards[i][1] - writer.shards[i][0] for i in pending)
    log.info(
        "extracting %d samples (%d of %d shards) of %s with %s: sites %s, layers %s, %s",
        n_pending, len(pending), len(writer.shards), job.task, loaded.describe()["source"], ",".join(plan.sites),
        _layer_text(plan.layers), plan.dtype,
    )
    started, cpu_started = time.perf_counter(), time.process_time()
    with tqdm(total=n_pending, unit="sample", desc="extract", disable=not progress, dynamic_ncols=True) as bar:
        meter = Meter(bar)
        if client is None:
            run_in_process(loaded, plan, writer, pending, meter)
        else:
            run_on_dask(client, plan, pending, meter)
    return ExtractResult(
        writer.url, plan.n_samples, len(pending), len(writer.shards), meter.tokens,
        time.perf_counter() - started, time.process_time() - cpu_started,
    )


def _check_client(job: ExtractJob, client) -> None:
    if job.in_memory and client is not None:
        raise ConfigError("a model object runs in this process: Dask workers load the model themselves, so give "
                          "its path (a model directory or .gguf file) to run on a Dask client")


def _absolute(data):
    """The data with a corpus's path made absolute, for the store's record of the job."""
    return replace(data, path=os.path.abspath(data.path)) if isinstance(data, CorpusData) else data


def _absolute_url(url: str) -> str:
    location = as_location(url)
    return location.local_path if location.is_local else url


def _layer_text(layers) -> str:
    layers = list(layers)
    if layers == list(range(layers[0], layers[-1] + 1)) and len(layers) > 2:
        return f"{layers[0]}-{layers[-1]}"
    return ",".join(map(str, layers))
