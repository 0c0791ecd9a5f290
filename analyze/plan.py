"""Planned analyses: each analysis builds its lazy work as a Plan, and one Dask computation per pass
runs the plans of every chosen analysis together, so that work reading the same chunks shares the
reads (Dask merges tasks with the same keys: one read of a chunk feeds every kernel that needs it).
Work that reads what a plan built after it provides is ``Deferred``: built when the pass computes
(the norms and norm_geometry read what they need of the attention from the replay's tasks,
``attention.AttentionShare``, handed to the three plans by ``run_analyses``).

An analysis that needs a second pass (the spheres, when they fit their own subspaces, finish that
fit into their results) finishes its first Plan into another Plan (or its result). Every pass logs its progress (share of tasks
done, elapsed time, an estimate of the time left) through the ``orthosphere.analyze`` logger, with
Dask's threads in this process or on a ``distributed`` cluster alike.
"""
from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import dask
from dask.base import unpack_collections
from dask.callbacks import Callback
from dask.utils import key_split
from threadpoolctl import threadpool_limits

log = logging.getLogger("orthosphere.analyze")

LOG_EVERY_SECONDS = 10.0
"""A pass logs its progress at most this often (and when it starts and ends)."""
THREADS = os.cpu_count() or 1
"""Threads of Dask's local scheduler (its default pool), for the estimate of the time left."""


@dataclass
class Plan:
    """Lazy work and what to make of it: `lazy` is anything ``dask.compute`` takes (collections,
    delayed objects, or dicts and lists of them); `finish` turns its computed value into the
    analysis's result, or into the Plan of its next pass."""

    lazy: Any
    finish: Callable[[Any], Any]

    def work(self) -> Any:
        """What ``dask.compute`` takes: `lazy`, or what it builds when it is ``Deferred``."""
        return self.lazy.build() if isinstance(self.lazy, Deferred) else self.lazy


@dataclass(frozen=True)
class Deferred:
    """Lazy work built by `build()` when its pass computes, once every plan of the pass is built."""

    build: Callable[[], Any]


def run_plans(plans: dict[str, Plan], ready: Callable[[dict], dict[str, Plan]] = lambda results: {}) -> dict[str, Any]:
    """Run plans to their results: one computation per pass, shared by every plan in that pass.
    After each pass, ``ready(results so far)`` may add the plans of analyses that can start now."""
    results, pending, number = {}, dict(plans), 0
    # one BLAS thread: the analyses' parallelism is Dask's threads, and BLAS's own threads on top of them
    # oversubscribe the cores, making the many small decompositions of the fits 10-30x slower
    # (distributed's workers start with one BLAS thread already)
    with threadpool_limits(limits=1, user_api="blas"):
        pending.update(ready(results))
        while pending:
            number += 1
            computed = compute({name: plan.work() for name, plan in pending.items()}, f"pass {number} ({', '.join(pending)})")
            finished = {name: plan.finish(computed[name]) for name, plan in pending.items()}
            pending = {name: value for name, value in finished.items() if isinstance(value, Plan)}
            results.update({name: value for name, value in finished.items() if not isinstance(value, Plan)})
            pending.update(ready(results))
    return results


def compute(lazy, label: str):
    """``dask.compute(lazy)`` with progress in the log: on the default ``distributed`` client when
    one is set, else on Dask's local scheduler."""
    collections, repack = unpack_collections(lazy)
    if not collections:
        return repack([])[0]
    client = _default_client()
    started = time.perf_counter()
    log.info("analyze %s: started", label)
    # unoptimised: Dask optimises each kind of collection apart, and would fuse a chunk's read into the
    # kernel of one analysis and read the chunk again for another's; unfused, they share one read task
    if client is None:
        with LogProgress(label):
            values = dask.compute(*collections, optimize_graph=False)
    else:
        futures = client.compute(list(collections), optimize_graph=False)
        _watch_futures(futures, label)
        values = client.gather(futures)
    log.info("analyze %s: done in %.1f s", label, time.perf_counter() - started)
    return repack(list(values))[0]


class ProgressLog:
    """Logs "label: 40 % of 1,200 tasks after 12 s, about 18 s left" at most every LOG_EVERY_SECONDS;
    the time left is the given estimate, else extrapolated from the share of tasks done."""

    def __init__(self, label: str):
        self.label = label
        self.started = time.perf_counter()
        self.last = self.started

    def update(self, done: int, total: int, left: float | None = None) -> None:
        now = time.perf_counter()
        if now - self.last < LOG_EVERY_SECONDS or not total or done >= total:
            return
        self.last = now
        elapsed = now - self.started
        share = done / total
        if left is None and share > 0:
            left = elapsed / share * (1 - share)
        estimate = f", about {left:.0f} s left" if left is not None else ""
        log.info("analyze %s: %d %% of %d tasks after %.0f s%s", self.label, 100 * share, total, elapsed, estimate)


class LogProgress(Callback):
    """Progress of a computation on Dask's local scheduler. The time left sums, over the kinds of
    task (reads, each analysis's kernels, fits, ...), the tasks left times their kind's mean duration
    so far, over the threads: tasks of very different costs are not counted alike."""

    def __init__(self, label: str):
        super().__init__()
        self.progress = ProgressLog(label)
        self.total = 0
        self.left: Counter = Counter()
        self.seconds: Counter = Counter()
        self.done: Counter = Counter()
        self.began: dict = {}

    def _start_state(self, dsk, state):
        keys = [key for kind in ("ready", "waiting", "running") for key in state[kind]]
        self.total = len(keys) + len(state["finished"])
        self.left = Counter(key_split(key) for key in keys)

    def _pretask(self, key, dsk, state):
        self.began[key] = time.perf_counter()

    def _posttask(self, key, result, dsk, state, worker_id):
        kind = key_split(key)
        self.left[kind] -= 1
        self.done[kind] += 1
        self.seconds[kind] += time.perf_counter() - self.began.pop(key, time.perf_counter())
        overall = sum(self.seconds.values()) / max(sum(self.done.values()), 1)
        work = sum(count * (self.seconds[kind] / self.done[kind] if self.done[kind] else overall)
                   for kind, count in self.left.items() if count > 0)
        self.progress.update(len(state["finished"]), self.total, work / THREADS)


def _default_client():
    try:
        from distributed import default_client
    except ImportError:
        return None
    try:
        return default_client()
    except ValueError:
        return None


def _watch_futures(futures, label: str) -> None:
    """Block until the futures finish, logging the progress of every task they depend on."""
    from distributed.diagnostics.progressbar import TextProgressBar

    class LoggedBar(TextProgressBar):
        def _draw_bar(self, remaining, all, **kwargs):
            progress.update(all - remaining, all)

        def _draw_stop(self, **kwargs):
            pass

    progress = ProgressLog(label)
    LoggedBar(futures, complete=True)
