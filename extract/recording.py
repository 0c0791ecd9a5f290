"""The buffer of one capture: activations copied by hooks into CPU tensors shaped as in the store."""
from __future__ import annotations

import math

import torch

from orthosphere.store.stream import DIRECT_ALIGNMENT


class Recording:
    """Activations of the forward passes of one capture, gathered into (batch, layer, ...) CPU tensors.

    From a CUDA device, each value is copied into pinned memory on a stream of this recording's own,
    after the work that produced it, so the copies overlap the next layers' compute; ``take`` waits
    for that stream only (another thread's captures on the device are not waited for).

    ``allocate(shape, dtype, pin_memory)`` gives each forward pass's buffers (default: new ones);
    ``take`` hands them over to the caller, so a pool that takes them back once they are written
    spares a fresh allocation per batch.
    """

    def __init__(self, sites, layers, dtype: torch.dtype, pin_memory: bool, allocate=None):
        self.allocate = allocate or new_buffer
        self.sites = tuple(sites)
        self.layers = tuple(layers)
        self.slot = {layer: index for index, layer in enumerate(self.layers)}
        self.dtype = dtype
        self.pin_memory = pin_memory
        self._buffers: dict[str, torch.Tensor] = {}
        self._filled: set[tuple[str, int]] = set()
        self._copies = None

    def wants(self, site: str, layer: int) -> bool:
        return site in self.sites and layer in self.slot

    def record(self, site: str, layer: int, value: torch.Tensor) -> None:
        """Copy one layer's value (batch, ...) into the site's (batch, layer, ...) buffer."""
        if not self.wants(site, layer):
            return
        buffer = self._buffers.get(site)
        if buffer is None:
            shape = (value.shape[0], len(self.layers), *value.shape[1:])
            buffer = self.allocate(shape, self.dtype, self.pin_memory)
            self._buffers[site] = buffer
        value = value.detach()
        if self.pin_memory and value.is_cuda:
            if self._copies is None:
                self._copies = torch.cuda.Stream(device=value.device)
            self._copies.wait_stream(torch.cuda.current_stream(value.device))
            with torch.cuda.stream(self._copies):
                buffer[:, self.slot[layer]].copy_(value, non_blocking=True)
            value.record_stream(self._copies)  # its memory is not reused before the copy is done
        else:
            buffer[:, self.slot[layer]].copy_(value)
        self._filled.add((site, layer))

    def take(self) -> dict[str, torch.Tensor]:
        """The recorded activations of the last forward pass; the recording starts afresh."""
        missing = [(site, layer) for site in self.sites for layer in self.layers if (site, layer) not in self._filled]
        if missing:
            raise RuntimeError(
                f"the forward pass did not reach sites {missing[:5]}: run adapter.forward inside "
                "the capture block before take()"
            )
        if self._copies is not None:
            self._copies.synchronize()
        buffers, self._buffers, self._filled = self._buffers, {}, set()
        return buffers


def new_buffer(shape, dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
    """A (batch, layer, ...) buffer laid out layer-major in memory, so that one layer of the batch
    is one contiguous block: the bytes of its piece of a chunk file (see store.stream). It starts
    at a multiple of ``DIRECT_ALIGNMENT``, so that such a piece can be written to disk directly."""
    if len(shape) < 2:
        return torch.empty(shape, dtype=dtype, pin_memory=pin_memory)
    layer_major = (shape[1], shape[0], *shape[2:])
    size = math.prod(layer_major) * dtype.itemsize
    raw = torch.empty(size + DIRECT_ALIGNMENT, dtype=torch.uint8, pin_memory=pin_memory)
    start = -raw.data_ptr() % DIRECT_ALIGNMENT
    return raw[start: start + size].view(dtype).view(layer_major).transpose(0, 1)
