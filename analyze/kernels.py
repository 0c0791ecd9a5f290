"""The attention work of one block of samples on its device: the numpy kernels
(``attention.BlockAttention``, ``replay_blocks.HeadBlock``) or the torch ones (``torch_kernels``,
imported only for a device other than "cpu"), chosen here, above both; and the Dask tasks that run
them for the norms (``attention_block``) and the replay (``replay_block``)."""
from __future__ import annotations

import numpy as np

from .attention import BlockAttention, ScoreTerms, analysed_tokens, query_sums, token_norms
from .blocks import single_block
from .inputs import as_float32
from .replay_blocks import HeadBlock, ReplaySettings, in_sample_order, replay_sub_block

KERNEL_BYTES = 2**22
"""The most bytes of one float32 (kpos, sample, head, qpos) array of a sub-block of samples
(``CleanAttention``): the attention kernels' passes over such arrays run from cache, not memory.
Measured with two Dask threads at 128 positions and 9 heads, before the replay's windows: 1 MiB
sub-blocks spent more on Python's per-operation costs than cache saved, 4 MiB was fastest, 16 MiB
fell out of cache; with the windows (a quarter to all of a sub-block each) the replay's cost per
sample is flat from 2 to 10 samples a sub-block (1 to 6 MiB)."""


DEVICE_KERNEL_BYTES = 2**28
"""The same on a GPU (``device``), where one sub-block per task keeps its many cores busy."""


class CleanAttention:
    """The clean attention of one Dask block of samples: ``parts``, a list of (first sample,
    ``BlockAttention``) over sub-blocks of samples whose arrays fit in cache (``KERNEL_BYTES``; on a
    CUDA device one part, and a ``torch_kernels.TorchAttention``). Built inside the task that reads it,
    never a task's output: held between two tasks, every block's attention would stay in memory
    (``AttentionShare`` hands it on in one task instead)."""

    def __init__(self, q, k, valid, terms: ScoreTerms, device: str = "cpu"):
        q, k, valid = as_float32(single_block(q)), as_float32(single_block(k)), np.asarray(single_block(valid), bool)
        per_sample = np.dtype(np.float32).itemsize * q.shape[1] * k.shape[1] * q.shape[2]  # (kpos, head, qpos)
        step = max(1, (DEVICE_KERNEL_BYTES if device.startswith("cuda") else KERNEL_BYTES) // per_sample)
        if device == "cpu":
            attention_of = BlockAttention.of
        else:
            from .torch_kernels import TorchAttention

            def attention_of(*arrays):
                return TorchAttention(*arrays, device)
        self.device, self.valid, self.terms = device, valid, terms
        self.parts = [(start, attention_of(q[start:start + step], k[start:start + step], valid[start:start + step], terms))
                      for start in range(0, len(q), step)]

    def received(self, exclude_start: bool) -> np.ndarray:
        """(sample, head, kpos) attention each analysed key receives from the analysed queries
        (``analysed_tokens``), float32: what the norms weigh a key by."""
        mask = analysed_tokens(self.valid, exclude_start)
        return np.concatenate([part.received(mask[start:start + len(part.valid)]) for start, part in self.parts])

    def query_sums(self, sparse_threshold: float, min_keys: int) -> tuple[np.ndarray, np.ndarray]:
        """``attention.query_sums`` of the block, (sample, head) each."""
        sums = [query_sums(_host(part.attention), part.valid, self.terms, sparse_threshold, min_keys) for _, part in self.parts]
        return tuple(np.concatenate(parts) for parts in zip(*sums))


def _host(attention) -> np.ndarray:
    """A part's key-major attention as numpy (a torch kernel's comes back from its device)."""
    return attention if isinstance(attention, np.ndarray) else attention.cpu().numpy()


SHARED_SUMS = ("received", "norms", "queries")
"""What ``attention_sums`` hands on (the replay's own sums leave them out)."""


def attention_sums(clean: CleanAttention, received_for: tuple[bool, ...], read: dict,
                   queries_for: tuple[tuple[float, int], ...] = ()) -> dict:
    """What a block's attention task hands to the norms and norm_geometry of its call: "received", the
    attention each analysed key receives for each value of ``exclude_start`` in `received_for`; "norms", |x|
    of each site block in `read` (``token_norms``); "queries", the start token's attention and the sparse
    queries per (sample, head) for each (sparse_threshold, min_keys) in `queries_for` (``query_sums``)."""
    return {"received": {exclude_start: clean.received(exclude_start) for exclude_start in received_for},
            "norms": {site: token_norms(block) for site, block in read.items()},
            "queries": {thresholds: clean.query_sums(*thresholds) for thresholds in queries_for}}


def attention_block(q, k, valid, terms: ScoreTerms, device: str, exclude_start: bool, norm_sites: tuple[str, ...]) -> dict:
    """The norms' own task for a block when no replay of the call provides it: ``attention_sums`` of
    its attention, and |x| of q and k for the `norm_sites` among them."""
    blocks = {"q": q, "k": k}
    return attention_sums(CleanAttention(q, k, valid, terms, device), (exclude_start,),
                          {site: blocks[site] for site in norm_sites})


def head_block(attention, sparse_threshold: float, v=None, frame=None, *, min_keys: int):
    """The replay's block of a part of a ``CleanAttention``: a ``HeadBlock`` of a ``BlockAttention``
    (numpy), else a ``TorchHeadBlock`` of a ``TorchAttention``."""
    if isinstance(attention, BlockAttention):
        return HeadBlock.of_attention(attention, sparse_threshold, v, frame, min_keys=min_keys)
    from .torch_kernels import TorchHeadBlock

    return TorchHeadBlock(attention, sparse_threshold, v, frame, min_keys=min_keys)


def replay_block(q, k, valid, v, frame, *, samples, layer: int, draws: range, settings: ReplaySettings,
                 terms: ScoreTerms, n_bins: int, received_for: tuple[bool, ...] = (),
                 norms_for: tuple[str, ...] = (), queries_for: tuple[tuple[float, int], ...] = ()) -> dict[str, np.ndarray]:
    """Partial sums of the study for one layer, one block of samples and a range of draws.

    Head-level sums (float64) and per-sample counts for the bootstrap; the clean attention's
    counts (instances, sparse instances, entropy, histogram) come with the range of draw 0 only,
    so that the partial sums of every range add up. The block's clean attention (``CleanAttention``)
    comes in sub-blocks of samples whose arrays stay in cache: the kernel's passes over them then run
    from cache, not memory; every instance's result is the same either way. With `received_for`
    (values of ``exclude_start``) and `norms_for` (of q, k, v), what the norms of the same call read
    from this task (``attention_sums``, ``attention.AttentionShare``); with `queries_for`, what norm_geometry
    reads.
    """
    clean = CleanAttention(q, k, valid, terms, settings.device)
    v = None if v is None else np.asarray(single_block(v))
    parts = []
    for start, attention in clean.parts:
        stop = start + len(attention.valid)
        with np.errstate(invalid="ignore", over="ignore"):  # NaN or Inf: counted (``nonfinite``), then reported
            block = head_block(attention, settings.sparse_threshold, None if v is None else v[start:stop], frame,
                               min_keys=settings.min_keys)
            parts.append(replay_sub_block(block, samples=samples[start:stop], layer=layer, draws=draws,
                                           settings=settings, n_bins=n_bins))
    sums = in_sample_order(parts)
    if received_for or norms_for or queries_for:
        blocks = {"q": q, "k": k, "v": v}
        sums.update(attention_sums(clean, received_for, {site: blocks[site] for site in norms_for}, queries_for))
    return sums
