"""TokenLoader: a store's token vectors in shuffled, resumable, label-filtered batches for PyTorch.

The epoch's order: the store's chunks (along sample) are permuted (seeded by seed and epoch); their
selected tokens, chunk after chunk in that order and in store order within a chunk, are cut into
windows of `window_tokens` (`buffer_tokens` rounded down to a multiple of `batch_size`; the last
window holds the rest), and each window's tokens are permuted (seeded by seed, epoch and window).
The epoch's stream is the windows' permuted tokens one after another; batch b is tokens
[b * batch_size, (b + 1) * batch_size) of it, so a batch never spans two windows and only the
stream's last batch may be short. Ranks take contiguous ranges of batches whose lengths
(``len(loader)``) differ by one at most: a distributed loop that needs every rank to take the same
number of steps skips the batches beyond the smallest (with ``continue``, not ``break``, so that the
epoch ends). A rank's DataLoader workers take contiguous shares of whole windows (cut inside a
window only when the range holds fewer windows than workers), so every selected token comes once per
epoch in all and each window is read by one worker. The DataLoader takes the workers' batches in
turn, so the short batch (the last of the last worker's share) comes last only when that share is
at least as long as each other one, and otherwise before the other workers' last batches.

An iteration left early (``break``) leaves the epoch unfinished: the next iteration continues it with
the batches not delivered yet (as ``state_dict()`` does), and only an iteration that ends starts the
next epoch.

Reading: a chunk file of a local, uncompressed store goes straight into the window (``chunk_read``),
and the kernel is asked to read the next window's files ahead while batches are gathered. Memory
per process: one window (`buffer_bytes`) and one chunk being read; a DataLoader's worker also holds
`ring_slots(prefetch_factor)` batches of shared memory through which its batches reach the main
process without a copy (``handover``).

The loader's parameters are declared in ``LoaderConfig`` (``orthosphere.params``' constraints): a bad value
is a ParameterError naming it; the sites are then checked against the store.
"""
from __future__ import annotations

import collections
import functools
import hashlib
import json
import multiprocessing as mp
import sys
from dataclasses import dataclass

import numpy as np
import psutil
import torch
import xarray as xr

from orthosphere.errors import ConfigError
from orthosphere.params import (
    NON_NEGATIVE_INTEGER,
    POSITIVE_INTEGER,
    POSITIVE_NUMBER,
    REQUIRED,
    Config,
    Flag,
    Interval,
    Items,
    Normalised,
    OneOf,
    Rule,
    parameter,
)

from .chunk_read import ChunkReader
from .handover import BatchRing, RingBatch, new_batch, ring_slots, torch_dtype
from .integrity import guarded_group
from .label_filter import LabelExpression
from .location import as_location
from .reader import _promises, open_group_checked, open_store
from .schema import is_bfloat16

VECTOR_SITES = ("resid_pre", "resid_mid", "resid_post", "attn_in", "q", "k", "v", "z", "attn_out", "mlp_in", "mlp_out")
OUTPUT_DTYPES = ("float32", "stored")


def _site_pair(value) -> tuple[str, int]:
    """A (site, layer) pair as the loader keeps it."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError("not a (site, layer) pair")
    site, layer = value
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise TypeError("its layer is not an integer")
    return str(site), int(layer)


@dataclass(frozen=True)
class LoaderConfig(Config):
    """The choices of a TokenLoader (besides its store): each checked when the loader is made, a bad value a
    ParameterError naming it; the sites are then checked against the store."""

    sites: tuple = parameter(REQUIRED, Items(Normalised(_site_pair, "a (site, layer) pair"),
                                             hint="such as [('resid_pre', 1)]"),
                             help="the (site, layer) pairs whose token vectors a batch holds")
    batch_size: int = parameter(REQUIRED, POSITIVE_INTEGER, help="tokens a batch")
    buffer_tokens: int = parameter(REQUIRED, POSITIVE_INTEGER, help="tokens the shuffle buffer holds: at least a batch and a chunk")
    seed: int = parameter(REQUIRED, Interval(int), help="seed of the epochs' order")
    where: str | None = parameter(None, Rule(lambda value: isinstance(value, str), "a label expression"), None,
                                  help='a label expression the tokens meet (role == "answer" and 2 <= pos < 8)')
    max_norm_ratio: float | None = parameter(None, POSITIVE_NUMBER, None,
                                             help="drop tokens whose norm at any site exceeds this times that site's median")
    exclude_start: bool = parameter(True, Flag(), help="leave out the first valid token of each sample")
    rank: int | None = parameter(None, NON_NEGATIVE_INTEGER, None, help="this process's rank (None: torch.distributed's, or 0)")
    world_size: int | None = parameter(None, POSITIVE_INTEGER, None, help="the number of ranks (None: torch.distributed's, or 1)")
    with_labels: bool = parameter(False, Flag(), help="batches as dicts of the activations and each token's labels")
    scale_norms: bool = parameter(False, Flag(), help="scale each site to a mean squared norm of its width")
    dtype: str = parameter("float32", OneOf(OUTPUT_DTYPES), help="float32, or stored: the store's dtype, bit for bit")

    def check(self) -> None:
        if self.buffer_tokens < self.batch_size:
            raise self.error("buffer_tokens", self.buffer_tokens, f"buffer_tokens >= batch_size ({self.batch_size}): a batch "
                             "is drawn from one window of the buffer")
        if self.scale_norms and self.dtype == "stored":
            raise self.error("scale_norms", self.scale_norms, "False with dtype='stored': a scaled vector is no longer "
                             "the stored one")
        if self.rank is not None and self.rank >= (self.world_size or 1):
            raise self.error("rank", self.rank, f"0 <= rank < world_size ({self.world_size or 1})")


def _url_of(store):
    """A store given as a path, URL, Location or a Dataset that ``open_store`` opened (its attrs' url)."""
    if isinstance(store, xr.Dataset):
        if "url" not in store.attrs:
            raise ConfigError("store: this Dataset was not opened by orthosphere.store.open_store (it has no url "
                             "attribute): pass the store's path or URL")
        narrowed = {dim: size for dim, size in store.sizes.items() if dim in ("sample", "pos", "layer")
                     and size != _stored_size(store.attrs, dim)}
        if narrowed:
            raise ConfigError(f"store: this Dataset is a selection ({narrowed}) of the store at {store.attrs['url']}, and the "
                              "loader reads the store itself: pass the whole store, and choose tokens with where= and "
                              "layers with sites=")
        return store.attrs["url"]
    return store


def _stored_size(attrs: dict, dim: str) -> int | None:
    """The size of dim sample, pos or layer in the store that `attrs` describe."""
    return {"sample": attrs.get("n_samples"), "pos": attrs.get("n_pos"), "layer": len(attrs.get("layers", ()))}[dim]


class TokenLoader(torch.utils.data.IterableDataset):
    """Token vectors of `sites` ([(site, layer), ...]) of a store (a path, URL, or the Dataset of
    ``open_store``, whose own storage options must be given again for object storage) in shuffled batches, each a tensor
    (batch, len(sites), width) (q, k, v, z flattened over heads), or with `with_labels` a dict of it
    (`activations`) and each token's `sample`, `pos`, `token` and labels.

    Filters: valid tokens only; the first valid token of each sample unless `exclude_start=False`;
    `where`, a label expression (``role == "answer" and 2 <= pos < 8``); `max_norm_ratio` k drops
    tokens whose norm at any site exceeds k x that site's median. `scale_norms` multiplies each
    site by the constant making its mean squared norm its width (SAE trainers' scaling);
    both are computed once from the store (`summary`). `dtype`: float32, or `stored` (bfloat16 stays
    bfloat16, bit for bit). Iterate directly or through `dataloader(num_workers=...)`, which keeps
    `state_dict()` exact (a DataLoader with workers made otherwise is refused: its epochs would repeat)."""

    def __init__(self, store, sites, *, batch_size: int, buffer_tokens: int, seed: int, where: str | None = None,
                 max_norm_ratio: float | None = None, exclude_start: bool = True, rank: int | None = None,
                 world_size: int | None = None, with_labels: bool = False, scale_norms: bool = False,
                 dtype: str = "float32", storage_options: dict | None = None):
        super().__init__()
        config = LoaderConfig(sites, batch_size, buffer_tokens, seed, where, max_norm_ratio, exclude_start, rank,
                              world_size, with_labels, scale_norms, dtype)
        location = as_location(_url_of(store), storage_options)
        open_store(location)  # refuses an incomplete or damaged store as every reader does
        self.location = location
        self.attrs = dict(open_group_checked(location).attrs)
        self.sites = list(config.sites)
        self.width = self._check_sites()
        self._layer_indices = [list(self.attrs["layers"]).index(layer) for _, layer in self.sites]
        self.batch_size, self.buffer_tokens, self.seed = config.batch_size, config.buffer_tokens, config.seed
        self.window_tokens = self.buffer_tokens // self.batch_size * self.batch_size
        self.dtype, self.with_labels, self.exclude_start = config.dtype, config.with_labels, config.exclude_start
        self.max_norm_ratio, self.scale_norms = config.max_norm_ratio, config.scale_norms
        labels = {"sample", "pos", "token", *self.attrs["labels"]}
        self.where = LabelExpression(config.where, labels) if config.where else None
        self.rank, self.world_size = _rank_and_world(config.rank, config.world_size)
        self.samples_per_chunk = int(self.attrs["samples_per_chunk"])
        self.n_samples, self.n_pos = int(self.attrs["n_samples"]), int(self.attrs["n_pos"])
        self.n_chunks = -(-self.n_samples // self.samples_per_chunk)
        self._group, self._arrays, self._readers, self._buffers = None, {}, {}, {}
        self._check_memory()
        self.medians, self.scales, self.summary = self._measure()
        self._epoch, self._pending, self._delivered, self._given, self._ring = 0, None, 0, None, None

    # --- what the store holds -------------------------------------------------------------
    def _check_sites(self) -> int:
        model, widths = self.attrs["model"], set()
        for site, layer in self.sites:
            if site not in self.attrs["sites"] or site not in VECTOR_SITES:
                stored = [s for s in self.attrs["sites"] if s in VECTOR_SITES]
                raise ConfigError(f"site {site!r} is not a token-vector site of this store; it holds {', '.join(stored)}")
            if layer not in self.attrs["layers"]:
                raise ConfigError(f"layer {layer} of site {site!r} is not stored; the store holds layers {self.attrs['layers']}")
            heads = {"q": model["n_heads"], "z": model["n_heads"], "k": model["n_kv_heads"], "v": model["n_kv_heads"]}.get(site)
            widths.add(model["d_model"] if heads is None else heads * model["d_head"])
        if len(widths) > 1:
            raise ConfigError(f"sites {self.sites} have different widths {sorted(widths)}: choose sites of one width")
        return widths.pop()

    @property
    def row_bytes(self) -> int:
        two_bytes = self.dtype == "stored" and (is_bfloat16(self.attrs["dtype"]) or self.attrs["dtype"] == "float16")
        return len(self.sites) * self.width * (2 if two_bytes else 4)

    @property
    def batch_shape(self) -> tuple[int, int, int]:
        return self.batch_size, len(self.sites), self.width

    @property
    def buffer_bytes(self) -> int:
        """The shuffle buffer's memory per process (one window of `window_tokens` selected tokens)."""
        return self.window_tokens * self.row_bytes

    @property
    def window_batches(self) -> int:
        return self.window_tokens // self.batch_size

    def _check_memory(self, workers: int = 0, prefetch_factor: int = 2) -> None:
        """Refuse a buffer that this process, or the DataLoader's workers (each with its hand-over
        slots), cannot hold together."""
        chunk_bytes = self.samples_per_chunk * self.n_pos * self.row_bytes
        if self.buffer_tokens < self.samples_per_chunk * self.n_pos:
            raise ConfigError(f"buffer_tokens={self.buffer_tokens} holds less than one chunk "
                             f"({self.samples_per_chunk * self.n_pos} positions): give at least that")
        available, processes = psutil.virtual_memory().available, max(1, workers)
        slots = ring_slots(prefetch_factor) * self.batch_size * self.row_bytes if workers else 0
        needed = processes * (self.buffer_bytes + chunk_bytes + slots)
        if needed > available:
            each = f" ({processes} workers, each its own buffer)" if processes > 1 else ""
            raise MemoryError(f"buffer_tokens={self.buffer_tokens} needs {needed / 2**30:.2f} GiB{each}, more than "
                              f"the {available / 2**30:.2f} GiB of memory available: give a smaller buffer"
                              + (" or fewer workers" if processes > 1 else ""))

    def _open(self) -> None:
        """The store's group, read through the guard, and what its chunks promise: once per process."""
        promised = _promises(open_group_checked(self.location))
        self._group = guarded_group(self.location, promised)
        self._readers = {site: ChunkReader(self.location, self._group, site, promised[site]) for site, _ in self.sites}

    def _array(self, name: str):
        """One of the store's arrays, opened once per process (each opening reads its metadata)."""
        if self._group is None:
            self._open()
        if name not in self._arrays:
            self._arrays[name] = self._group[name]
        return self._arrays[name]

    def _reader(self, site: str) -> ChunkReader:
        if self._group is None:
            self._open()
        return self._readers[site]

    @property
    def _output_dtype(self) -> np.dtype:
        """float32, or with dtype="stored" the dtype the sites' vectors are stored in."""
        return np.dtype(np.float32) if self.dtype == "float32" else self._reader(self.sites[0][0]).dtype

    def _buffer(self, name: str, shape: tuple, dtype) -> np.ndarray:
        """A buffer kept for every window (or chunk) of this process: a fresh one each time would pay
        the kernel's first touch of every page again."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape != shape or buffer.dtype != dtype:
            buffer = self._buffers[name] = np.empty(shape, dtype)
        return buffer

    def __getstate__(self):
        return {**self.__dict__, "_group": None, "_arrays": {}, "_readers": {}, "_buffers": {}}

    # --- reading chunks ---------------------------------------------------------------------
    def _chunk_labels(self, chunk: int) -> dict[str, np.ndarray]:
        start, stop = self._chunk_bounds(chunk)
        names = set(self.where.names if self.where else ()) | ({"token", *self.attrs["labels"]} if self.with_labels else set())
        sample, pos = np.meshgrid(np.arange(start, stop), np.arange(self.n_pos), indexing="ij")
        labels = {"sample": sample.ravel(), "pos": pos.ravel()}
        for name in names - {"sample", "pos"}:
            labels[name] = np.asarray(self._array("tokens" if name == "token" else name)[start:stop]).ravel()
        return labels

    def _chunk_bounds(self, chunk: int) -> tuple[int, int]:
        start = chunk * self.samples_per_chunk
        return start, min(start + self.samples_per_chunk, self.n_samples)

    def _label_mask(self, chunk: int, labels: dict) -> np.ndarray:
        start, stop = self._chunk_bounds(chunk)
        valid = np.asarray(self._array("valid")[start:stop])
        mask = valid.copy()
        if self.exclude_start:
            first = np.argmax(valid, axis=1)
            mask[np.arange(stop - start), first] = False
        mask = mask.ravel()
        if self.where is not None:
            mask &= self.where.mask(labels)
        return mask

    def _chunk_vectors(self, chunk: int):
        """Each site's vectors of every position of the chunk, (positions, width), as stored."""
        return [self._read_site(chunk, index) for index in range(len(self.sites))]

    def _read_site(self, chunk: int, index: int, out: np.ndarray | None = None) -> np.ndarray:
        """Site `index`'s vectors of every position of the chunk, read into `out` (or a new array)."""
        reader = self._reader(self.sites[index][0])
        if out is None:
            out = np.empty((self._positions(chunk), self.width), reader.dtype)
        reader.read(chunk, self._layer_indices[index], out)
        return out

    def _positions(self, chunk: int) -> int:
        start, stop = self._chunk_bounds(chunk)
        return (stop - start) * self.n_pos

    def _selected(self, chunk: int) -> np.ndarray | None:
        """The chunk's selection (positions,) as measured once (``_measure``); None: every position."""
        packed = self._selection[chunk]
        if packed is None:
            return None
        start, stop = self._chunk_bounds(chunk)
        return np.unpackbits(packed, count=(stop - start) * self.n_pos).view(bool)

    def _read_piece(self, chunk: int, begin: int, end: int, rows: np.ndarray) -> dict:
        """The chunk's selected tokens [begin, end) written into `rows` (sites, tokens, width: their
        place in the window, in the output dtype) and, with `with_labels`, their labels returned.
        A whole chunk of every position, as stored, goes from its file straight into the window."""
        mask = self._selected(chunk)
        positions = self._positions(chunk)
        chosen = slice(begin, end) if mask is None else np.flatnonzero(mask)[begin:end]
        for index, target in enumerate(rows):
            reader = self._reader(self.sites[index][0])
            if mask is None and (begin, end) == (0, positions) and reader.dtype == target.dtype:
                self._read_site(chunk, index, target)
                continue
            scratch = self._buffer("chunk", (self.samples_per_chunk * self.n_pos, self.width), reader.dtype)
            vectors = self._read_site(chunk, index, scratch[:positions])
            if isinstance(chosen, slice) or vectors.dtype != target.dtype:
                target[...] = vectors[chosen]  # one copy (and a cast: float16 or bfloat16 to float32)
            else:
                np.take(vectors, chosen, axis=0, out=target, mode="clip")
        if self.dtype == "float32" and self.scale_norms:
            rows *= np.asarray(self.scales, np.float32)[:, None, None]
        if not self.with_labels:
            return {}
        return {name: value[chosen] for name, value in self._chunk_labels(chunk).items()}

    def _measure(self):
        """Tokens selected per chunk, the sites' median norms and scales, and a summary."""
        counts, norms, label_masks = [], [[] for _ in self.sites], []
        needs_norms = self.max_norm_ratio is not None or self.scale_norms
        for chunk in range(self.n_chunks):
            mask = self._label_mask(chunk, self._chunk_labels(chunk))
            label_masks.append(mask)
            counts.append(int(mask.sum()))
            if needs_norms:
                for kept, vector in zip(norms, self._chunk_vectors(chunk)):
                    kept.append(_norms(vector)[mask])
        summary = {"positions": self.n_samples * self.n_pos, "selected_by_labels": int(sum(counts))}
        medians, scales = [None] * len(self.sites), [1.0] * len(self.sites)
        keep_chunks = [np.ones(count, bool) for count in counts]
        if needs_norms:
            joined = [np.concatenate(site_norms) if site_norms else np.zeros(0) for site_norms in norms]
            medians = [float(np.median(values)) if values.size else 0.0 for values in joined]
            keep = np.ones(summary["selected_by_labels"], bool)
            if self.max_norm_ratio is not None:
                dropped = {}
                for (site, layer), values, median in zip(self.sites, joined, medians):
                    over = values > self.max_norm_ratio * median
                    dropped[f"{site}/{layer}"] = int(over.sum())
                    keep &= ~over
                summary["dropped_by_norm"] = dropped
                keep_chunks = np.split(keep, np.cumsum(counts)[:-1])
            if self.scale_norms:
                scales = [float(np.sqrt(self.width / np.mean(values[keep].astype(np.float64) ** 2))) for values in joined]
        masks = [label_mask.copy() for label_mask in label_masks]
        for mask, keep in zip(masks, keep_chunks):
            mask[mask] = keep
        self.chunk_tokens = np.array([int(mask.sum()) for mask in masks], dtype=np.int64)
        self._selection = [None if mask.all() else np.packbits(mask) for mask in masks]
        summary.update(tokens=int(self.chunk_tokens.sum()), medians=medians, scales=scales, buffer_bytes=self.buffer_bytes)
        return medians, scales, summary

    # --- the epoch's plan ---------------------------------------------------------------------
    @property
    def n_tokens(self) -> int:
        return int(self.chunk_tokens.sum())

    def _global_batches(self) -> int:
        return -(-self.n_tokens // self.batch_size)

    def _rank_range(self) -> tuple[int, int]:
        total = self._global_batches()
        return total * self.rank // self.world_size, total * (self.rank + 1) // self.world_size

    def __len__(self) -> int:
        start, stop = self._rank_range()
        return stop - start

    def _chunk_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's chunks in order, and where each one's selected tokens begin in the epoch's sequence."""
        order = np.random.default_rng([self.seed, epoch]).permutation(self.n_chunks)
        return order, np.concatenate([[0], np.cumsum(self.chunk_tokens[order])])

    def _pieces(self, index: int, chunk_order):
        """What window `index` holds: (chunk, its selected tokens [begin, end), their place in the window)."""
        order, starts = chunk_order
        first = index * self.window_tokens
        last = min(first + self.window_tokens, self.n_tokens)
        for position in range(int(np.searchsorted(starts, first, side="right")) - 1, len(order)):
            begin, end = max(first, starts[position]), min(last, starts[position + 1])
            if begin >= last:
                return
            if end > begin:
                yield int(order[position]), int(begin - starts[position]), int(end - starts[position]), int(begin - first)

    def _window(self, epoch: int, index: int, chunk_order) -> tuple[np.ndarray, dict, np.ndarray]:
        """Window `index` of the epoch: its rows (sites, tokens, width; this process's buffer), the
        tokens' labels (with `with_labels`) and the window's permutation."""
        size = min(self.window_tokens, self.n_tokens - index * self.window_tokens)
        rows = self._buffer("window", (len(self.sites), self.window_tokens, self.width), self._output_dtype)[:, :size]
        parts = [self._read_piece(chunk, begin, end, rows[:, at:at + end - begin])
                 for chunk, begin, end, at in self._pieces(index, chunk_order)]
        labels = {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
        permutation = np.random.default_rng([self.seed, epoch, index]).permutation(size)
        return rows, labels, permutation

    def _read_ahead(self, index: int, chunk_order) -> None:
        """Ask the kernel to read window `index`'s chunk files in the background (``ChunkReader.advise``),
        so that the disk works while this process gathers batches."""
        for chunk, *_ in self._pieces(index, chunk_order):
            for site_index, (site, _) in enumerate(self.sites):
                self._reader(site).advise(chunk, self._layer_indices[site_index])

    def _batches(self, epoch: int, ranges, worker: int | None = None):
        """Batches of the epoch's stream for the given ranges of batch indices (in a DataLoader's
        worker with a ring: RingBatch names of them)."""
        chunk_order, loaded = self._chunk_order(epoch), (None, None)
        upcoming = window_sequence(ranges, self.window_batches)
        for first, stop in ranges:
            for batch in range(first, stop):
                index = batch // self.window_batches
                if loaded[0] != index:
                    upcoming.popleft()
                    for ahead in [index, *list(upcoming)[:1]]:  # this window's files, then the next one's
                        self._read_ahead(ahead, chunk_order)
                    loaded = (index, self._window(epoch, index, chunk_order))
                rows, labels, permutation = loaded[1]
                begin = (batch - index * self.window_batches) * self.batch_size
                take = permutation[begin:begin + self.batch_size]
                picked = {name: values[take] for name, values in labels.items()}
                if worker is not None and self._ring is not None:
                    yield self._ring.put(worker, len(take), functools.partial(_gather, rows, take), picked)
                    continue
                activations, out = new_batch((len(take), len(self.sites), self.width), rows.dtype)
                _gather(rows, take, out)
                yield self._as_batch(activations, picked)

    def _as_batch(self, activations: torch.Tensor, labels: dict):
        """The batch as it is yielded: the tensor, or with `with_labels` a dict of it and the labels."""
        if not self.with_labels:
            return activations
        batch = {"activations": activations}
        for name, values in labels.items():
            batch[name] = values if values.dtype.kind in "OUT" else torch.from_numpy(values.astype(np.int64))
        return batch

    def _from_ring(self, batch: RingBatch, pin: bool):
        """In the main process: a batch a worker left in the ring, as it is yielded."""
        return self._as_batch(self._ring.receive(batch, pin), batch.labels)

    # --- iteration and resumption -----------------------------------------------------------------
    def _begin(self, parts: int, ring: BatchRing | None = None) -> None:
        """Start an iteration over `parts` consumers (1, or the DataLoader's workers, which hand their
        batches over through `ring`): each consumer's ranges of batches."""
        if self._pending is None:
            self._pending = [[self._rank_range()]]
        if self._delivered:
            self._pending, self._delivered = self._remaining(), 0
        if len(self._pending) == parts:
            self._given = self._pending
        else:
            self._given = split_ranges([r for part in self._pending for r in part], parts, self.window_batches)
        self._ring = ring

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        if info is None:
            self._begin(1)
            for batch in self._batches(self._epoch, self._given[0]):
                self._delivered += 1
                yield batch
            self._end_epoch()
            return
        if self._ring is None:  # its workers' copies cannot tell this loader that an epoch ended
            raise ConfigError(f"a TokenLoader in a DataLoader with {info.num_workers} workers that it did not make: every epoch "
                              "would repeat the first one's order and state_dict() would not follow the batches; iterate "
                              f"loader.dataloader(num_workers={info.num_workers}, ...) instead")
        yield from self._batches(self._epoch, self._given[info.id], info.id)

    def _end_epoch(self) -> None:
        self._epoch, self._pending, self._delivered, self._given, self._ring = self._epoch + 1, None, 0, None, None

    def _remaining(self) -> list[list[tuple[int, int]]]:
        """Each consumer's ranges not delivered yet, the consumer whose turn comes next first."""
        taken, following = interleaved_counts([_count(part) for part in self._given], self._delivered)
        remaining = [drop_first(part, count) for part, count in zip(self._given, taken)]
        return remaining[following:] + remaining[:following]

    def dataloader(self, num_workers: int = 0, **options) -> torch.utils.data.DataLoader:
        """A DataLoader over this loader (batches as they are: batch_size=None) that keeps state_dict
        exact. Its workers are forked where the platform allows it safely (Linux: a worker starts in
        milliseconds, where a spawned one imports torch and zarr again, every epoch) unless
        `multiprocessing_context` says otherwise, and hand their batches over through a few slots of
        shared memory each (``handover``)."""
        if options.get("persistent_workers"):
            raise ConfigError("persistent_workers=True would keep each worker's position apart from state_dict: leave it off")
        if num_workers and sys.platform == "linux":
            options.setdefault("multiprocessing_context", "fork")
        self._check_memory(num_workers, options.get("prefetch_factor") or 2)
        return _CountingDataLoader(self, batch_size=None, num_workers=num_workers, **options)

    def identity(self) -> dict:
        """What a state dict must match: the store and every choice that shapes the stream."""
        provenance = self.attrs.get("provenance", {})
        store = {key: self.attrs.get(key) for key in ("n_samples", "n_pos", "layers", "sites", "dtype", "shards")}
        store["created"], store["command"] = provenance.get("created"), provenance.get("command")
        digest = hashlib.sha256(json.dumps(store, sort_keys=True, default=str).encode()).hexdigest()
        return {"store": digest, "sites": [list(site) for site in self.sites], "where": self.where.text if self.where else None,
                "exclude_start": self.exclude_start, "max_norm_ratio": self.max_norm_ratio, "scale_norms": self.scale_norms,
                "batch_size": self.batch_size, "buffer_tokens": self.buffer_tokens, "seed": self.seed,
                "rank": self.rank, "world_size": self.world_size, "dtype": self.dtype}

    def state_dict(self) -> dict:
        """Where this rank stands: the epoch and, per consumer, the batches it has not delivered yet."""
        if self._pending is None:
            pending = [[self._rank_range()]]
        else:
            pending = self._remaining() if self._delivered else self._pending
        if self._pending is not None and not any(_count(part) for part in pending):
            return {**self.identity(), "epoch": self._epoch + 1, "pending": [[list(self._rank_range())]]}
        return {**self.identity(), "epoch": self._epoch, "pending": [[list(r) for r in part] for part in pending]}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a state dict of this store and these choices, on the batches it had not delivered."""
        for key, value in self.identity().items():
            if state.get(key) != value:
                what = "another store" if key == "store" else f"{key}={state.get(key)!r}, not {value!r}"
                raise ConfigError(f"the state dict is of {what}: resume with the loader it was saved from")
        pending = state.get("pending")
        if not isinstance(pending, list) or not all(
                isinstance(part, list) and all(isinstance(r, list) and len(r) == 2 for r in part) for part in pending):
            raise ConfigError(f"the state dict's pending={pending!r} is not a list of each consumer's [start, stop] "
                             "ranges (a state dict of an earlier TokenLoader, whose epochs were ordered otherwise?): "
                             "resume with the loader it was saved from")
        self._epoch, self._delivered = int(state["epoch"]), 0
        self._pending = [[(int(a), int(b)) for a, b in part] for part in pending]


class _CountingDataLoader(torch.utils.data.DataLoader):
    """A DataLoader that tells its TokenLoader how many batches it delivered."""

    def __iter__(self):
        loader = self.dataset
        if self.num_workers == 0:  # the loader counts its own batches in this process
            yield from loader
            return
        ring = BatchRing(self.num_workers, ring_slots(self.prefetch_factor or 2), loader.batch_shape,
                         torch_dtype(loader._output_dtype), self.multiprocessing_context or mp)
        loader._begin(self.num_workers, ring)
        for batch in super().__iter__():
            loader._delivered += 1
            yield loader._from_ring(batch, self.pin_memory)
        loader._end_epoch()


def split_ranges(ranges, parts: int, window_batches: int) -> list[list[tuple[int, int]]]:
    """Ranges of batches split among `parts` consumers in contiguous shares of about equal size: of
    whole windows (`window_batches` batches each) where the ranges span at least `parts` windows,
    else of batches (consumers then share a window)."""
    pieces = [(max(a, edge), min(b, edge + window_batches)) for a, b in ranges
              for edge in range(a // window_batches * window_batches, b, window_batches)]
    if len(pieces) < parts:
        pieces = [(batch, batch + 1) for a, b in ranges for batch in range(a, b)]
    ends = np.cumsum([b - a for a, b in pieces])
    edges = [0]
    for part in range(1, parts):  # each share ends at the piece's end nearest its even share
        nearest = int(np.argmin(np.abs(ends - ends[-1] * part / parts))) + 1 if len(ends) else 0
        edges.append(max(nearest, edges[-1]))
    edges.append(len(pieces))
    return [_merged(pieces[begin:end]) for begin, end in zip(edges, edges[1:])]


def interleaved_counts(sizes: list[int], delivered: int) -> tuple[list[int], int]:
    """How many batches each consumer delivered of the first `delivered` when consumers deliver in
    turn (as a DataLoader takes its workers' batches, skipping those done), and whose turn is next."""
    taken, left, turn = [0] * len(sizes), delivered, 0
    while left:
        for worker, size in enumerate(sizes):
            if left and taken[worker] < size:
                taken[worker] += 1
                left -= 1
                turn = (worker + 1) % len(sizes)
    return taken, turn


def drop_first(ranges, count: int) -> list[tuple[int, int]]:
    """The ranges without their first `count` batches (empty ranges left out)."""
    result = []
    for a, b in ranges:
        skip = min(count, b - a)
        count -= skip
        if a + skip < b:
            result.append((a + skip, b))
    return result


def _merged(ranges) -> list[tuple[int, int]]:
    """Consecutive ranges joined: (0, 4), (4, 8) -> (0, 8)."""
    result = []
    for a, b in ranges:
        if result and result[-1][1] == a:
            result[-1] = (result[-1][0], b)
        else:
            result.append((a, b))
    return result


def window_sequence(ranges, window_batches: int) -> collections.deque:
    """The windows the ranges of batches read, in order."""
    windows = collections.deque()
    for a, b in ranges:
        for window in range(a // window_batches, (b - 1) // window_batches + 1) if b > a else ():
            if not windows or windows[-1] != window:
                windows.append(window)
    return windows


def _count(ranges) -> int:
    return sum(b - a for a, b in ranges)


def _gather(rows: np.ndarray, take: np.ndarray, out: np.ndarray) -> None:
    """Rows `take` of each site's window rows (sites, tokens, width) into `out` (batch, sites, width)."""
    for index, site_rows in enumerate(rows):
        np.take(site_rows.view(out.dtype), take, axis=0, out=out[:, index], mode="clip")


def _norms(vectors: np.ndarray) -> np.ndarray:
    return np.sqrt(np.square(vectors.astype(np.float32), dtype=np.float64).sum(axis=-1))


def _rank_and_world(rank, world_size) -> tuple[int, int]:
    if rank is None and world_size is None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return rank or 0, world_size or 1
