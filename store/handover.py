"""Batches from DataLoader workers to the main process through shared memory set up once.

A DataLoader hands over each tensor a worker yields in a new shared-memory segment: the worker
copies the batch into it and both processes take the kernel's first touch of each of its pages,
for every batch: on the benchmark's machine 8.2 ms for a batch of 8 MB whose gather takes 2.4 ms
(benchmarks/RESULTS.md). A ``BatchRing`` holds, for each worker, a few batch-sized slots of shared
memory allocated before the workers start: a worker gathers a batch into its next free slot and
yields a small ``RingBatch`` naming it; the main process lends the slot itself to its caller as
the batch's tensor (the slot is freed when that tensor and every view of it are gone), or, when
`LENT_SLOTS` of the worker's slots are lent already or the batch must be pinned, copies it and
frees the slot at once.

Lent slots come back in any order, so each slot's state (free or in use) lies in shared memory
beside a counting semaphore of a worker's free slots: a worker waits on the semaphore, then takes
a free slot; the main process marks a slot free, then releases the semaphore (neither takes a lock,
so a slot can be given back from a finalizer at any moment). The main process takes each worker's
batches in the order they were made: when it waits for a worker's next batch it has taken all that
worker's earlier ones, so at most `LENT_SLOTS` of its slots are held and the worker can go on; no
wait ever closes a cycle.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from .bfloat16 import is_bfloat16

LENT_SLOTS = 2
"""Slots of a worker lent to the caller at once (a training loop holds one or two batches)."""


def ring_slots(prefetch_factor: int) -> int:
    """Slots per worker: the batches a DataLoader asks ahead, one being taken, one spare, and the lent ones."""
    return prefetch_factor + 2 + LENT_SLOTS


@dataclass
class RingBatch:
    """A batch a worker left in a slot of the ring, with its labels (numpy arrays)."""

    worker: int
    slot: int
    size: int
    labels: dict = field(default_factory=dict)


class BatchRing:
    """`slots` batches of `shape` and `dtype` (torch's) in shared memory for each of `workers`."""

    def __init__(self, workers: int, slots: int, shape: tuple[int, ...], dtype: torch.dtype, context):
        nbytes = workers * slots * math.prod(shape) * dtype.itemsize
        storage = torch.UntypedStorage._new_shared(nbytes)  # as torch's own collate makes its shared batches: no copy
        self.memory = torch.empty(0, dtype=dtype).set_(storage, 0, (workers, slots, *shape))
        self.in_use = torch.zeros((workers, slots), dtype=torch.uint8).share_memory_()
        self.free = [context.Semaphore(slots) for _ in range(workers)]
        self.lent = [0] * workers

    def put(self, worker: int, size: int, fill, labels: dict) -> RingBatch:
        """In worker `worker`: wait for a free slot, `fill` its first `size` rows (a numpy view), name it."""
        self.free[worker].acquire()
        in_use = self.in_use[worker].numpy()
        slot = int(np.flatnonzero(in_use == 0)[0])
        in_use[slot] = 1
        fill(numpy_view(self.memory[worker, slot, :size]))
        return RingBatch(worker, slot, size, labels)

    def receive(self, batch: RingBatch, pin: bool) -> torch.Tensor:
        """In the main process: the batch's tensor, the slot itself (lent) or a copy (pinned with `pin`)."""
        rows = self.memory[batch.worker, batch.slot, :batch.size]
        if pin or self.lent[batch.worker] >= LENT_SLOTS:
            tensor, out = new_batch(tuple(rows.shape), rows.dtype, pin)
            out[...] = numpy_view(rows)
            self._free(batch.worker, batch.slot)
            return tensor
        self.lent[batch.worker] += 1
        array = np.asarray(_Lease(numpy_view(rows), functools.partial(self._give_back, batch.worker, batch.slot)))
        tensor = torch.from_numpy(array)
        return tensor.view(torch.bfloat16) if rows.dtype == torch.bfloat16 else tensor

    def _give_back(self, worker: int, slot: int) -> None:
        self.lent[worker] -= 1
        self._free(worker, slot)

    def _free(self, worker: int, slot: int) -> None:
        self.in_use[worker, slot] = 0
        self.free[worker].release()


class _Lease:
    """A lent slot as numpy sees it (``__array_interface__``): an array made from it keeps it as its
    base, so the slot is given back when the last array, and tensor, over it is gone."""

    def __init__(self, rows: np.ndarray, give_back):
        self.__array_interface__ = rows.__array_interface__
        self._rows, self._give_back = rows, give_back

    def __del__(self):
        self._give_back()


def torch_dtype(dtype) -> torch.dtype:
    """torch's dtype of a numpy dtype (or torch's own)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    return torch.bfloat16 if is_bfloat16(dtype) else torch.from_numpy(np.empty(0, dtype)).dtype


def numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's memory as a numpy array (bfloat16 as int16: numpy has no bfloat16 of torch's)."""
    return tensor.view(torch.int16).numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()


def new_batch(shape: tuple[int, ...], dtype, pin: bool = False) -> tuple[torch.Tensor, np.ndarray]:
    """A new tensor of a numpy or torch dtype and a numpy view of its memory (bfloat16 as int16).
    Unpinned memory comes from numpy's allocator, which reuses the pages of freed batches (a
    torch.empty of this size took the kernel's first touch of every page again, three times the
    cost of filling it)."""
    dtype = torch_dtype(dtype)
    if pin:
        tensor = torch.empty(shape, dtype=dtype, pin_memory=True)
        return tensor, numpy_view(tensor)
    array = np.empty(shape, np.int16 if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype)
    tensor = torch.from_numpy(array)
    return (tensor.view(torch.bfloat16) if dtype == torch.bfloat16 else tensor), array
