"""Running an extraction's shards: each sample batch through the model's capture, handed to one
writer thread behind compute (``WriteBehind``), in this process or as Dask tasks (``run_shard``).

A shard runs its samples in batches from its first sample, so its values never depend on which
process runs it or when. The capture's batch buffers come from a pool (``BufferPool``) that takes
them back once written, and at most ``QUEUE_DEPTH`` batches wait for the writer: memory is bounded
whatever the number of samples.
"""
from __future__ import annotations

import functools
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from orthosphere.errors import ClusterError, Float16OverflowError
from orthosphere.store import open_writer
from orthosphere.store.bfloat16 import bfloat16_dtype
from orthosphere.store.faults import crash_point
from orthosphere.store.stream import ChunkStream

from .data import ArithmeticData, CorpusData, StoredTokens, open_dataset
from .recording import new_buffer
from .sources import LoadedModel, load_source

QUEUE_DEPTH = 2
"""Batches waiting for the writer thread; the forward pass blocks only when this many wait."""


@dataclass(frozen=True)
class ShardPlan:
    """What a worker needs to run any shard of a job (small and picklable; local paths absolute)."""

    model: str
    device: str
    model_dtype: str | None
    data: ArithmeticData | CorpusData
    n_samples: int
    sites: tuple[str, ...]
    layers: tuple[int, ...]
    dtype: str
    batch_size: int
    url: str
    storage_options: dict | None
    pred: bool = True
    """Whether the store holds the predictions; without them the forward pass stops after the last layer."""


# --- computing batches ------------------------------------------------------------------


class Meter:
    """Progress: samples on the bar, tokens per second beside it."""

    def __init__(self, bar: tqdm):
        self.bar, self.tokens, self.started = bar, 0, time.perf_counter()

    def update(self, n_samples: int, n_tokens: int) -> None:
        self.tokens += n_tokens
        rate = self.tokens / max(time.perf_counter() - self.started, 1e-9)
        self.bar.set_postfix_str(f"{rate:,.0f} tok/s", refresh=False)
        self.bar.update(n_samples)


def compute_range(adapter, dataset, plan: ShardPlan, start: int, stop: int, sink, meter: Meter | None = None) -> int:
    """Run samples [start, stop) in batches from `start`, each handed to sink.put(first, arrays,
    release) with its buffers' release; returns the number of real tokens."""
    dtype = getattr(torch, plan.dtype)
    device = adapter.device
    pool = BufferPool(plan.batch_size)
    tokens_seen = 0
    capture = adapter.capture(plan.sites, plan.layers, dtype, allocate=pool.take, stop_early=not plan.pred)
    with torch.inference_mode(), capture as recording:
        for first in range(start, stop, plan.batch_size):
            inputs = dataset.batch(first, min(first + plan.batch_size, stop))
            tokens = torch.from_numpy(inputs["tokens"]).to(device=device, dtype=torch.long)
            valid = torch.from_numpy(inputs["valid"]).to(device)
            logits = adapter.forward(tokens, valid)
            arrays = {name: values for name, values in inputs.items() if name not in dataset.prewritten}
            if plan.pred:  # argmax, twice as fast
                arrays["pred"] = logits.max(dim=-1).indices.to(torch.int32).cpu().numpy()
            buffers = recording.take()
            if dtype == torch.float16:
                check_float16_range(buffers, plan.layers, first)
            arrays.update({site: as_numpy(values) for site, values in buffers.items()})
            sink.put(first, arrays, functools.partial(pool.give, list(buffers.values())))
            n_tokens = int(inputs["valid"].sum())
            tokens_seen += n_tokens
            if meter is not None:
                meter.update(len(inputs["valid"]), n_tokens)
    return tokens_seen


def check_float16_range(buffers: dict, layers, first: int) -> None:
    """Refuse float16 activations that overflowed (|x| > 65504 became inf), naming where."""
    for site, values in buffers.items():
        low, high = torch.aminmax(_in_memory_order(values))
        if torch.isinf(low) or torch.isinf(high):
            infinite = torch.isinf(values).flatten(2).any(dim=2)  # (batch, layer)
            samples, slots = (index.tolist() for index in torch.nonzero(infinite, as_tuple=True))
            raise Float16OverflowError(
                f"site {site} of layer {layers[slots[0]]} (sample {first + samples[0]}) holds values beyond float16's "
                'range (|x| > 65504), which float16 would store as inf: extract with dtype="bfloat16" (same range as '
                'float32, 16 bits) or dtype="float32"'
            )


def _in_memory_order(values: torch.Tensor) -> torch.Tensor:
    """The same elements as a view whose dimensions follow the memory layout (a layer-major
    buffer's reductions then read memory in order: 2-3x faster)."""
    return values.permute(*sorted(range(values.dim()), key=lambda d: -values.stride(d)))


def as_numpy(values: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a numpy array sharing its memory (bfloat16 as ml_dtypes.bfloat16)."""
    if values.dtype == torch.bfloat16:
        return values.view(torch.int16).numpy().view(bfloat16_dtype())
    return values.numpy()


class BufferPool:
    """Batch buffers handed back after they are written, so that the next batch reuses memory that is
    already mapped (fresh memory costs a page fault per 4 kB, more than the copy into it). Only
    buffers of a whole batch are kept; a shard's shorter last batch gets new ones."""

    def __init__(self, batch_size: int):
        self.batch_size = batch_size
        self.free: dict[tuple, list[torch.Tensor]] = {}
        self.lock = threading.Lock()

    def take(self, shape, dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
        with self.lock:
            held = self.free.get((tuple(shape), dtype, pin_memory))
            if held:
                return held.pop()
        return new_buffer(shape, dtype, pin_memory)

    def give(self, buffers) -> None:
        with self.lock:
            for buffer in buffers:
                if buffer.shape[0] == self.batch_size:
                    self.free.setdefault((tuple(buffer.shape), buffer.dtype, buffer.is_pinned()), []).append(buffer)


def run_in_process(loaded: LoadedModel, plan: ShardPlan, writer, pending, meter: Meter) -> None:
    """Every pending shard in this process, behind one writer thread."""
    dataset = _shard_dataset(plan, writer)
    sink = WriteBehind(writer, prewritten=dataset.prewritten)
    try:
        for index in pending:
            start, stop = writer.shards[index]
            compute_range(loaded.adapter, dataset, plan, start, stop, sink, meter)
            sink.end_shard(index)
    except BaseException:
        sink.abort()
        raise
    sink.close()


def _shard_dataset(plan: ShardPlan, writer):
    """What a shard reads its samples from: the arithmetic task, or the tokens written into the store."""
    if isinstance(plan.data, ArithmeticData):
        return open_dataset(plan.data, n_samples=plan.n_samples)
    return StoredTokens(writer.group)


@dataclass(frozen=True)
class ShardReport:
    index: int
    n_samples: int
    tokens: int


_WORKER_MODEL_LOCK = threading.Lock()


def _worker_model(path: str, device: str, model_dtype: str | None) -> LoadedModel:
    """A Dask worker loads the job's model once and keeps it for the job's other shards, which may
    run concurrently in the worker's threads (captures are per forward pass, so they share it)."""
    with _WORKER_MODEL_LOCK:
        return _load_once(path, device, model_dtype)


@functools.lru_cache(maxsize=1)
def _load_once(path: str, device: str, model_dtype: str | None) -> LoadedModel:
    return load_source(path, device, model_dtype)


def run_shard(plan: ShardPlan, index: int) -> ShardReport:
    """A Dask task: run one shard, write its chunks (without the store's lock, which the
    coordinating process holds) and record it complete."""
    loaded = _worker_model(plan.model, plan.device, plan.model_dtype)
    writer = open_writer(plan.url, lock=False, storage_options=plan.storage_options)
    dataset = _shard_dataset(plan, writer)
    start, stop = writer.shards[index]
    sink = WriteBehind(writer, prewritten=dataset.prewritten)
    try:
        tokens = compute_range(loaded.adapter, dataset, plan, start, stop, sink)
        sink.end_shard(index)
    except BaseException:
        sink.abort()
        raise
    sink.close()
    return ShardReport(index, stop - start, tokens)


NO_WORKERS_SECONDS = 120.0
"""How long a job waits on a cluster that has no worker before it stops, saying so (workers that die as they
start, or a cluster never given any, would leave it waiting forever)."""
POLL_SECONDS = 0.5


def run_on_dask(client, plan: ShardPlan, pending, meter: Meter) -> None:
    """Run the shards as Dask tasks; a cluster left without workers for NO_WORKERS_SECONDS, or a shard
    that kills the workers running it, stops the job with a ClusterError (its complete shards are kept)."""
    from distributed import as_completed

    futures = {client.submit(run_shard, plan, index, pure=False): index for index in pending}
    waiting = as_completed(list(futures))
    since = time.monotonic()
    try:
        while not waiting.is_empty():
            done = waiting.next_batch(block=False)
            for future in done:
                meter.update(*_shard_result(future, futures[future]))
            since = time.monotonic() if done or _has_workers(client) else since
            if time.monotonic() - since > NO_WORKERS_SECONDS:
                raise ClusterError(f"the Dask cluster at {client.scheduler.address} has had no worker for "
                                   f"{NO_WORKERS_SECONDS:g} s while {waiting.count()} shard(s) wait: start workers (or find why "
                                   'they die as they start), then resume the job (mode="resume"); its complete shards are kept')
            if not done:
                time.sleep(POLL_SECONDS)
    except BaseException:
        client.cancel(list(futures))
        raise


def _has_workers(client) -> bool:
    return bool(client.scheduler_info().get("workers"))


def _shard_result(future, index: int) -> tuple[int, int]:
    """The shard's samples and tokens; a worker killed while running it, as often as the cluster allows, is
    named as such (a worker out of memory, or a crash in the model), not as an unexpected KilledWorker."""
    from distributed import KilledWorker

    try:
        report = future.result()
    except KilledWorker as error:
        raise ClusterError(
            f"shard {index}'s task killed the Dask workers that ran it, as often as the cluster allows "
            f"(distributed.scheduler.allowed-failures): {error}; a worker out of memory is the usual cause: give "
            'workers more memory, fewer threads or a smaller batch, then resume the job (mode="resume")') from error
    return report.n_samples, report.tokens


# --- writing behind compute ---------------------------------------------------------------


class WriteBehind:
    """A bounded queue of batches, drained into the store by one writer thread (ChunkStream)."""

    def __init__(self, writer, depth: int = QUEUE_DEPTH, prewritten=()):
        """prewritten: the per-sample arrays written before the shards ran (see StoredTokens)."""
        self.writer, self.prewritten = writer, tuple(prewritten)
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._drain, name="orthosphere-store-writer", daemon=True)
        self.thread.start()

    def put(self, first: int, arrays: dict, release=None) -> None:
        """Queue a batch of samples starting at `first`; blocks only while the queue is full. The
        writer thread calls release() once the batch's arrays are written."""
        self._send(("block", first, arrays, release))

    def end_shard(self, index: int) -> None:
        """Write what the shard still holds, then mark it complete."""
        self._send(("end", index))

    def close(self) -> None:
        """Wait until everything is written; raise the writer thread's error, if any."""
        self._send(None)
        self.thread.join()
        if self.error is not None:
            raise self.error

    def abort(self) -> None:
        """Stop after a failure of the producer; shards it did not end stay incomplete."""
        self.queue.put(None)
        self.thread.join()

    def _send(self, item) -> None:
        while True:
            if self.error is not None:
                raise self.error
            try:
                self.queue.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def _drain(self) -> None:
        stream = None
        while (item := self.queue.get()) is not None:
            if self.error is not None:
                continue
            try:
                if stream is None:  # here, so that a failure to set it up reaches the producer
                    stream = ChunkStream(self.writer)
                if item[0] == "block":
                    stream.add(*item[1:])
                else:
                    stream.flush()
                    self.writer.mark_shard_complete(item[1], written_elsewhere=self.prewritten)
                    crash_point("shard-complete")
                for release in stream.pop_released():
                    release()
            except BaseException as error:  # handed to the producer by _send / close
                self.error = error
