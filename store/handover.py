"""Batches from DataLoader workers to the main process through shared memory set up once.

A DataLoader hands over each tensor a worker yields in a new shared-memory segment: the worker
copies the batch into it and both processes take the kernel's first touch of each of its pages,
for every batch, which on the benchmark's machine cost ten times the batch's gather itself
(benchmarks/RESULTS.md). A ``BatchRing`` holds, for each worker, a few batch-sized slots of shared
memory allocated before the workers start: a worker gathers a batch into its next free slot and
yields a small ``RingBatch`` naming it; the main process copies the slot into a tensor of its own
(numpy's memory, which reuses the pages of freed batches) and frees the slot.

A worker uses its slots in turn and the main process takes each worker's batches in the order
they were made, so a counting semaphore per worker (its free slots) is all the bookkeeping.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .bfloat16 import is_bfloat16


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
        self.memory = torch.empty((workers, slots, *shape), dtype=dtype).share_memory_()
        self.free = [context.Semaphore(slots) for _ in range(workers)]
        self.next_slot = [0] * workers

    def put(self, worker: int, size: int, fill, labels: dict) -> RingBatch:
        """In worker `worker`: wait for its next slot, `fill` the slot's first `size` rows (a numpy view), name it."""
        self.free[worker].acquire()
        slot = self.next_slot[worker]
        self.next_slot[worker] = (slot + 1) % len(self.memory[worker])
        fill(numpy_view(self.memory[worker, slot, :size]))
        return RingBatch(worker, slot, size, labels)

    def take(self, batch: RingBatch, out: np.ndarray) -> None:
        """In the main process: the batch's rows copied into `out`, and its slot freed."""
        out[...] = numpy_view(self.memory[batch.worker, batch.slot, :batch.size])
        self.free[batch.worker].release()


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.bfloat16 if is_bfloat16(dtype) else torch.from_numpy(np.empty(0, dtype)).dtype


def numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's memory as a numpy array (bfloat16 as int16: numpy has no bfloat16 of torch's)."""
    return tensor.view(torch.int16).numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()


def new_batch(shape: tuple[int, ...], dtype: np.dtype, pin: bool = False) -> tuple[torch.Tensor, np.ndarray]:
    """A new tensor (bfloat16 as torch's) and a numpy view of its memory. Unpinned memory comes from
    numpy's allocator, which reuses the pages of freed batches (a torch.empty of this size took the
    kernel's first touch of every page again, three times the cost of filling it)."""
    if pin:
        tensor = torch.empty(shape, dtype=torch_dtype(dtype), pin_memory=True)
        return tensor, numpy_view(tensor)
    array = np.empty(shape, np.int16 if is_bfloat16(dtype) else dtype)
    tensor = torch.from_numpy(array)
    return (tensor.view(torch.bfloat16) if is_bfloat16(dtype) else tensor), array
