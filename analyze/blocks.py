"""Streaming reductions over sample chunks: one small float64 vector per chunk, summed as a tree."""
from __future__ import annotations

import functools
import operator

import dask
import dask.array as da
import numpy as np

from .inputs import align, as_float32


def sample_block_sums(kernel, size: int, *inputs: da.Array) -> da.Array:
    """Lazy (size,) float64 sum over sample chunks of kernel(*blocks) (see ``sample_block_vectors``)."""
    return sample_block_vectors(kernel, size, *inputs).sum(axis=0, split_every=8)


def sample_block_vectors(kernel, size: int, *inputs: da.Array) -> da.Array:
    """Lazy (blocks, size) float64: kernel(*blocks) of each block of samples, for reductions other
    than a sum (a maximum).

    Every input has the sample axis first; they are aligned to the first input's sample chunks
    and taken whole along every other axis, so the kernel sees matching blocks of samples
    (float16 ones as float32).
    """
    first = inputs[0]
    pattern = []
    for number, array in enumerate(inputs):
        array = align(array, first)
        pattern += [array, ("sample",) + tuple(f"{number}.{axis}" for axis in range(1, array.ndim))]

    def block_vector(*blocks):
        blocks = [as_float32(single_block(block)) for block in blocks]
        return np.asarray(kernel(*blocks), dtype="float64").reshape(1, size)

    return da.blockwise(
        block_vector,
        ("sample", "value"),
        *pattern,
        new_axes={"value": size},
        adjust_chunks={"sample": 1},
        concatenate=False,
        dtype="float64",
        meta=np.empty((0, 0), dtype="float64"),
    )


def from_tasks(tasks: list, pick, shape: tuple[int, ...], samples: tuple[int, ...], dtype: str = "float32") -> da.Array:
    """Lazy (sample, *shape) array of what `pick` takes from each block's task (`samples`: the blocks' sizes)."""
    return da.concatenate([da.from_delayed(dask.delayed(pick, pure=True)(task), (n, *shape), dtype=dtype,
                                           meta=np.empty((0,) * (1 + len(shape)), dtype))
                           for task, n in zip(tasks, samples)])


def single_block(block):
    """The one block that blockwise hands over, nested in lists, for an axis taken whole (no copy,
    unlike concatenate=True)."""
    while isinstance(block, list):
        (block,) = block
    return block


class Packer:
    """Names and shapes of the arrays a kernel packs into one flat vector, and their unpacking."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        self.shapes = dict(shapes)
        self.offsets = {}
        offset = 0
        for name, shape in self.shapes.items():
            self.offsets[name] = offset
            offset += int(np.prod(shape, dtype=int))
        self.size = offset

    def pack(self, arrays: dict[str, np.ndarray]) -> np.ndarray:
        return np.concatenate([np.asarray(arrays[name], dtype="float64").ravel() for name in self.shapes])

    def unpack(self, vector: np.ndarray) -> dict[str, np.ndarray]:
        return {
            name: vector[self.offsets[name] : self.offsets[name] + int(np.prod(shape, dtype=int))].reshape(shape)
            for name, shape in self.shapes.items()
        }


def tree_sum(parts: list, split_every: int = 8):
    """A delayed sum of delayed parts (arrays or sparse matrices), added as a tree."""
    parts = list(parts)
    while len(parts) > 1:
        parts = [dask.delayed(_add_all)(parts[start: start + split_every]) for start in range(0, len(parts), split_every)]
    return parts[0]


def _add_all(items):
    return functools.reduce(operator.add, items)
