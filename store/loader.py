"""TokenLoader: a store's token vectors in shuffled, resumable, label-filtered batches for PyTorch.

The shuffle reads whole chunks: each epoch permutes the store's chunks (along sample), groups them
in that order into windows of at most `buffer_tokens` selected tokens, and permutes the tokens of
each window. The epoch's stream is the windows' permuted tokens one after another; batch b is
tokens [b * batch_size, (b + 1) * batch_size) of it (the last may be short). Ranks take contiguous
ranges of batches, DataLoader workers contiguous parts of their rank's range, so every selected
token comes once per epoch in all, and each worker reads only the windows of its part.
Memory: one window (`buffer_bytes`) and one chunk being read, per process.
"""
from __future__ import annotations

import functools
import hashlib
import json

import numpy as np
import psutil
import torch
import xarray as xr

from .integrity import guarded_group
from .label_filter import LabelExpression
from .location import as_location
from .reader import _promises, open_group_checked, open_store
from .schema import is_bfloat16

VECTOR_SITES = ("resid_pre", "resid_mid", "resid_post", "attn_in", "q", "k", "v")
OUTPUT_DTYPES = ("float32", "stored")


def _url_of(store):
    """A store given as a path, URL, Location or a Dataset that ``open_store`` opened (its attrs' url)."""
    if isinstance(store, xr.Dataset):
        if "url" not in store.attrs:
            raise ValueError("store: this Dataset was not opened by orthosphere.store.open_store (it has no url "
                             "attribute): pass the store's path or URL")
        return store.attrs["url"]
    return store


class TokenLoader(torch.utils.data.IterableDataset):
    """Token vectors of `sites` ([(site, layer), ...]) of a store (a path, URL, or the Dataset of
    ``open_store``, whose own storage options must be given again for object storage) in shuffled batches, each a tensor
    (batch, len(sites), width) (q, k, v flattened over heads), or with `with_labels` a dict of it
    (`activations`) and each token's `sample`, `pos`, `token` and labels.

    Filters: valid tokens only; the first valid token of each sample unless `exclude_start=False`;
    `where`, a label expression (``role == "answer" and 2 <= pos < 8``); `max_norm_ratio` k drops
    tokens whose norm at any site exceeds k x that site's median. `scale_norms` multiplies each
    site by the constant making its mean squared norm its width (SAE trainers' scaling);
    both are computed once from the store (`summary`). `dtype`: float32, or `stored` (bfloat16 stays
    bfloat16, bit for bit). Iterate directly or through `dataloader(num_workers=...)`, which keeps
    `state_dict()` exact."""

    def __init__(self, store, sites, *, batch_size: int, buffer_tokens: int, seed: int, where: str | None = None,
                 max_norm_ratio: float | None = None, exclude_start: bool = True, rank: int | None = None,
                 world_size: int | None = None, with_labels: bool = False, scale_norms: bool = False,
                 dtype: str = "float32", storage_options: dict | None = None):
        super().__init__()
        location = as_location(_url_of(store), storage_options)
        open_store(location)  # refuses an incomplete or damaged store as every reader does
        self.location = location
        self.attrs = dict(open_group_checked(location).attrs)
        self.sites = [(str(site), int(layer)) for site, layer in sites]
        self.width = self._check_sites()
        self.batch_size, self.buffer_tokens, self.seed = _positive(batch_size, "batch_size"), _positive(
            buffer_tokens, "buffer_tokens"), int(seed)
        if dtype not in OUTPUT_DTYPES:
            raise ValueError(f"dtype={dtype!r}: expected one of {', '.join(OUTPUT_DTYPES)}")
        if scale_norms and dtype == "stored":
            raise ValueError("scale_norms needs dtype='float32': a scaled vector is no longer the stored one")
        self.dtype, self.with_labels, self.exclude_start = dtype, with_labels, exclude_start
        self.max_norm_ratio, self.scale_norms = max_norm_ratio, scale_norms
        labels = {"sample", "pos", "token", *self.attrs["labels"]}
        self.where = LabelExpression(where, labels) if where else None
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        self.samples_per_chunk = int(self.attrs["samples_per_chunk"])
        self.n_samples, self.n_pos = int(self.attrs["n_samples"]), int(self.attrs["n_pos"])
        self.n_chunks = -(-self.n_samples // self.samples_per_chunk)
        self._group, self._arrays, self._window_buffer = None, {}, None
        self._check_memory()
        self.medians, self.scales, self.summary = self._measure()
        self._epoch, self._pending, self._delivered, self._parts = 0, None, 0, 1

    # --- what the store holds -------------------------------------------------------------
    def _check_sites(self) -> int:
        model, widths = self.attrs["model"], set()
        if not self.sites:
            raise ValueError("sites is empty: give (site, layer) pairs such as [('resid_pre', 1)]")
        for site, layer in self.sites:
            if site not in self.attrs["sites"] or site not in VECTOR_SITES:
                stored = [s for s in self.attrs["sites"] if s in VECTOR_SITES]
                raise ValueError(f"site {site!r} is not a token-vector site of this store; it holds {', '.join(stored)}")
            if layer not in self.attrs["layers"]:
                raise ValueError(f"layer {layer} of site {site!r} is not stored; the store holds layers {self.attrs['layers']}")
            heads = {"q": model["n_heads"], "k": model["n_kv_heads"], "v": model["n_kv_heads"]}.get(site)
            widths.add(model["d_model"] if heads is None else heads * model["d_head"])
        if len(widths) > 1:
            raise ValueError(f"sites {self.sites} have different widths {sorted(widths)}: choose sites of one width")
        return widths.pop()

    @property
    def row_bytes(self) -> int:
        return len(self.sites) * self.width * (2 if self.dtype == "stored" and is_bfloat16(self.attrs["dtype"]) else 4)

    @property
    def buffer_bytes(self) -> int:
        """The shuffle buffer's memory per process (one window of selected tokens)."""
        return self.buffer_tokens * self.row_bytes

    def _check_memory(self, processes: int = 1) -> None:
        """Refuse a buffer the `processes` (this one, or the DataLoader's workers) cannot hold together."""
        chunk_bytes = self.samples_per_chunk * self.n_pos * self.row_bytes
        if self.buffer_tokens < self.samples_per_chunk * self.n_pos:
            raise ValueError(f"buffer_tokens={self.buffer_tokens} holds less than one chunk "
                             f"({self.samples_per_chunk * self.n_pos} positions): give at least that")
        available = psutil.virtual_memory().available
        needed = processes * (self.buffer_bytes + chunk_bytes)
        if needed > available:
            each = f" ({processes} workers, each its own buffer)" if processes > 1 else ""
            raise MemoryError(f"buffer_tokens={self.buffer_tokens} needs {needed / 2**30:.2f} GiB{each}, more than "
                              f"the {available / 2**30:.2f} GiB of memory available: give a smaller buffer"
                              + (" or fewer workers" if processes > 1 else ""))

    @property
    def group(self):
        if self._group is None:
            self._group = guarded_group(self.location, _promises(open_group_checked(self.location)))
        return self._group

    @functools.cached_property
    def _output_dtype(self) -> np.dtype:
        """float32, or with dtype="stored" the dtype the sites' vectors are read as (read once)."""
        if self.dtype == "float32":
            return np.dtype(np.float32)
        return np.asarray(self._array(self.sites[0][0])[:0]).dtype

    def _array(self, name: str):
        """One of the store's arrays, opened once per process (each opening reads its metadata)."""
        if name not in self._arrays:
            self._arrays[name] = self.group[name]
        return self._arrays[name]

    def __getstate__(self):
        return {**self.__dict__, "_group": None, "_arrays": {}, "_window_buffer": None}

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
        start, stop = self._chunk_bounds(chunk)
        layers = list(self.attrs["layers"])
        return [np.asarray(self._array(site)[start:stop, layers.index(layer)]).reshape(-1, self.width)
                for site, layer in self.sites]

    def _selected(self, chunk: int) -> np.ndarray | None:
        """The chunk's selection (positions,) as measured once (``_measure``); None: every position."""
        packed = self._selection[chunk]
        if packed is None:
            return None
        start, stop = self._chunk_bounds(chunk)
        return np.unpackbits(packed, count=(stop - start) * self.n_pos).view(bool)

    def _read_chunk(self, chunk: int, rows: np.ndarray):
        """The chunk's selected tokens: their vectors written into `rows` (tokens, sites, width: the
        chunk's slice of its window, in the output dtype) and, with `with_labels`, their labels returned."""
        mask = self._selected(chunk)
        for index, vector in enumerate(self._chunk_vectors(chunk)):  # one copy per selected token and site
            if mask is None:
                rows[:, index] = vector
            elif vector.dtype == rows.dtype:
                np.compress(mask, vector, axis=0, out=rows[:, index])
            else:  # cast on the way (float16 to float32)
                rows[:, index] = vector[mask]
        if self.dtype == "float32" and self.scale_norms:
            rows *= np.asarray(self.scales, np.float32)[None, :, None]
        if not self.with_labels:
            return {}
        labels = self._chunk_labels(chunk)
        return labels if mask is None else {name: value[mask] for name, value in labels.items()}

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

    def _windows(self, epoch: int):
        """The epoch's windows: (chunks in order, first token in the stream), and the stream's token offsets."""
        order = np.random.default_rng([self.seed, epoch]).permutation(self.n_chunks)
        windows, current, filled = [], [], 0
        for chunk in order:
            size = int(self.chunk_tokens[chunk])
            if current and filled + size > self.buffer_tokens:
                windows.append(current)
                current, filled = [], 0
            current.append(int(chunk))
            filled += size
        if current:
            windows.append(current)
        starts = np.concatenate([[0], np.cumsum([self.chunk_tokens[w].sum() for w in windows])]).astype(np.int64)
        return windows, starts

    def _window(self, epoch: int, index: int, chunks: list[int]):
        sizes = self.chunk_tokens[chunks]
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        rows = self._window_rows(int(offsets[-1]))
        parts = [self._read_chunk(chunk, rows[offsets[i]:offsets[i + 1]]) for i, chunk in enumerate(chunks)]
        labels = {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
        order = np.random.default_rng([self.seed, epoch, index]).permutation(len(rows))
        return rows, labels, order

    def _window_rows(self, n_tokens: int) -> np.ndarray:
        """The window's (tokens, sites, width) rows, in one buffer kept for every window of this process
        (a fresh one each time would pay the kernel's first touch of every page again); batches are
        copies out of it."""
        buffer = self._window_buffer
        if buffer is None or len(buffer) < n_tokens:
            buffer = self._window_buffer = np.empty((n_tokens, len(self.sites), self.width), self._output_dtype)
        return buffer[:n_tokens]

    def _batches(self, epoch: int, ranges):
        """Batches of the epoch's stream for the given ranges of batch indices."""
        windows, starts = self._windows(epoch)
        loaded = (None, None)
        for first, stop in ranges:
            for batch in range(first, stop):
                begin, end = batch * self.batch_size, min((batch + 1) * self.batch_size, self.n_tokens)
                pieces = []
                while begin < end:
                    index = int(np.searchsorted(starts, begin, side="right") - 1)
                    if loaded[0] != index:
                        loaded = (index, self._window(epoch, index, windows[index]))
                    rows, labels, order = loaded[1]
                    upto = min(end, int(starts[index + 1]))
                    take = order[begin - starts[index]:upto - starts[index]]
                    # gathered now: the next window reuses the rows' buffer
                    pieces.append((rows[take], {name: values[take] for name, values in labels.items()}))
                    begin = upto
                yield self._as_batch(pieces)

    def _as_batch(self, pieces):
        rows = pieces[0][0] if len(pieces) == 1 else np.concatenate([rows for rows, _ in pieces])
        activations = _tensor(rows)
        if not self.with_labels:
            return activations
        batch = {"activations": activations}
        for name in pieces[0][1]:
            values = np.concatenate([labels[name] for _, labels in pieces])
            batch[name] = values if values.dtype.kind in "OUT" else torch.from_numpy(values.astype(np.int64))
        return batch

    # --- iteration and resumption -----------------------------------------------------------------
    def _begin(self, parts: int) -> None:
        """Start an iteration over `parts` consumers (1, or the DataLoader's workers)."""
        if self._pending is None:
            self._pending = [self._rank_range()]
        if self._delivered:
            self._pending, self._delivered = self._remaining(), 0
        self._parts = parts

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        if info is None:
            self._begin(1)
            for batch in self._batches(self._epoch, self._pending):
                self._delivered += 1
                yield batch
            self._end_epoch()
            return
        yield from self._batches(self._epoch, split_ranges(self._pending, info.num_workers)[info.id])

    def _end_epoch(self) -> None:
        self._epoch, self._pending, self._delivered = self._epoch + 1, None, 0

    def _remaining(self) -> list[tuple[int, int]]:
        """The ranges not delivered yet, in the order the consumers deliver them next."""
        parts = split_ranges(self._pending, self._parts)
        taken, following = interleaved_counts([sum(b - a for a, b in part) for part in parts], self._delivered)
        remaining = [drop_first(part, count) for part, count in zip(parts, taken)]
        if self._parts == 1:
            return remaining[0]
        return [_joined(part) for part in remaining[following:] + remaining[:following]]

    def dataloader(self, num_workers: int = 0, **options) -> torch.utils.data.DataLoader:
        """A DataLoader over this loader (batches as they are: batch_size=None) that keeps state_dict exact."""
        if options.get("persistent_workers"):
            raise ValueError("persistent_workers=True would keep each worker's position apart from state_dict: leave it off")
        self._check_memory(max(1, num_workers))
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
        """Where this rank stands: the epoch and the batches it has not delivered yet."""
        if self._pending is None:
            pending = [self._rank_range()]
        else:
            pending = self._remaining() if self._delivered else self._pending
        if not any(b > a for a, b in pending) and self._pending is not None:
            return {**self.identity(), "epoch": self._epoch + 1, "pending": [list(self._rank_range())]}
        return {**self.identity(), "epoch": self._epoch, "pending": [list(r) for r in pending]}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a state dict of this store and these choices, on the batches it had not delivered."""
        for key, value in self.identity().items():
            if state.get(key) != value:
                what = "another store" if key == "store" else f"{key}={state.get(key)!r}, not {value!r}"
                raise ValueError(f"the state dict is of {what}: resume with the loader it was saved from")
        self._epoch, self._pending, self._delivered = int(state["epoch"]), [tuple(r) for r in state["pending"]], 0


class _CountingDataLoader(torch.utils.data.DataLoader):
    """A DataLoader that tells its TokenLoader how many batches it delivered."""

    def __iter__(self):
        loader = self.dataset
        if self.num_workers == 0:  # the loader counts its own batches in this process
            yield from loader
            return
        loader._begin(max(1, self.num_workers))
        for batch in super().__iter__():
            loader._delivered += 1
            yield batch
        loader._end_epoch()


def split_ranges(ranges, parts: int) -> list[list[tuple[int, int]]]:
    """Ranges of batches split among `parts` consumers: one each when there are as many, else contiguous even shares."""
    ranges = [tuple(r) for r in ranges]
    if len(ranges) == parts:
        return [[r] for r in ranges]
    total = sum(b - a for a, b in ranges)
    shares = [total // parts + (i < total % parts) for i in range(parts)]
    result, queue = [], list(ranges)
    for share in shares:
        part = []
        while share:
            a, b = queue.pop(0)
            take = min(share, b - a)
            part.append((a, a + take))
            if a + take < b:
                queue.insert(0, (a + take, b))
            share -= take
        result.append(part)
    return result


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
    result = []
    for a, b in ranges:
        skip = min(count, b - a)
        count -= skip
        result.append((a + skip, b))
    return result


def _joined(ranges) -> tuple[int, int]:
    kept = [r for r in ranges if r[1] > r[0]]
    return kept[0] if kept else (0, 0)


def _norms(vectors: np.ndarray) -> np.ndarray:
    return np.sqrt(np.square(vectors.astype(np.float32), dtype=np.float64).sum(axis=-1))


def _tensor(rows: np.ndarray) -> torch.Tensor:
    if is_bfloat16(rows.dtype):
        return torch.from_numpy(np.ascontiguousarray(rows).view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(rows))


def _positive(value, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}: expected a positive integer")
    return value


def _rank_and_world(rank, world_size) -> tuple[int, int]:
    if rank is None and world_size is None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    rank, world_size = rank or 0, world_size or 1
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} with world_size={world_size}: expected 0 <= rank < world_size")
    return rank, world_size
