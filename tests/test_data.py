"""TokenLoader: every selected token once per epoch, resume, seeds, filters, bfloat16, bad input."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from orthosphere.data import TokenLoader  # noqa: E402
from orthosphere.errors import ParameterError  # noqa: E402
from orthosphere.store import IncompleteStoreError  # noqa: E402
from tests.synthetic import write_store  # noqa: E402

N_SAMPLES, N_LAYERS, N_POS, D_MODEL = 24, 2, 6, 8


def token_store(path, dtype="float32"):
    """Each vector's first entry is its token's id (sample * N_POS + pos), so batches name their tokens."""
    x = np.random.default_rng(0).normal(size=(N_SAMPLES, N_LAYERS, N_POS, D_MODEL))
    x[..., 0] = (np.arange(N_SAMPLES)[:, None] * N_POS + np.arange(N_POS))[:, None, :] / 8
    role = np.where(np.arange(N_POS) % 2, "answer", "digit")[None].repeat(N_SAMPLES, 0)
    valid = np.ones((N_SAMPLES, N_POS), bool)
    valid[::3, -1] = False
    return write_store(path, {"resid_pre": x}, labels={"role": role}, valid=valid, samples_per_chunk=4, dtype=dtype)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return token_store(tmp_path_factory.mktemp("data") / "store.zarr")


def ids(batches):
    return [int(round(v * 8)) for batch in batches for v in batch[:, 0, 0].tolist()]


def loader(store, **options):
    return TokenLoader(store, [("resid_pre", 1)], **{"batch_size": 5, "buffer_tokens": 48, "seed": 1, **options})


def expected(where=lambda sample, pos: True):
    valid = np.ones((N_SAMPLES, N_POS), bool)
    valid[::3, -1] = False
    return sorted(s * N_POS + p for s in range(N_SAMPLES) for p in range(1, N_POS) if valid[s, p] and where(s, p))


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_every_token_once_per_epoch(store, workers):
    tokens = loader(store)
    batches = list(tokens.dataloader(num_workers=workers))
    assert len(batches) == len(tokens) and sorted(ids(batches)) == expected()


def documented_batches(tokens, epoch=0) -> list[list[int]]:
    """The epoch's batches (token ids) as orthosphere.store.loader's docstring defines the epoch."""
    per_chunk = {}
    for token in expected():
        per_chunk.setdefault(token // (tokens.samples_per_chunk * N_POS), []).append(token)
    order = np.random.default_rng([tokens.seed, epoch]).permutation(tokens.n_chunks)
    sequence = np.array([token for chunk in order for token in per_chunk.get(chunk, [])])
    windows = [sequence[first:first + tokens.window_tokens] for first in range(0, len(sequence), tokens.window_tokens)]
    stream = np.concatenate([window[np.random.default_rng([tokens.seed, epoch, index]).permutation(len(window))]
                             for index, window in enumerate(windows)])
    return [stream[first:first + tokens.batch_size].tolist() for first in range(0, len(stream), tokens.batch_size)]


def test_the_epoch_is_the_documented_shuffle(store):
    tokens = loader(store)
    assert tokens.window_tokens == 45  # buffer_tokens 48 rounded down to batches of 5: no batch spans two windows
    for epoch in range(2):
        assert [ids([batch]) for batch in tokens] == documented_batches(tokens, epoch)


def test_workers_read_whole_windows_of_the_documented_batches(store, tmp_path, monkeypatch):
    """With 2 workers, every documented batch comes once and each window is read by one worker."""
    import os

    from orthosphere.store.loader import TokenLoader as Loader

    window = Loader._window

    def noted(self, epoch, index, chunk_order):
        with open(tmp_path / "windows.txt", "a") as record:
            record.write(f"{os.getpid()} {index}\n")
        return window(self, epoch, index, chunk_order)

    monkeypatch.setattr(Loader, "_window", noted)
    tokens = loader(store)
    delivered = [ids([batch]) for batch in tokens.dataloader(num_workers=2)]
    assert sorted(delivered) == sorted(documented_batches(tokens))
    readers = [line.split() for line in (tmp_path / "windows.txt").read_text().splitlines()]
    assert sorted(index for _, index in readers) == ["0", "1", "2"] and len({pid for pid, _ in readers}) == 2


def test_shares_of_workers_are_whole_windows_unless_too_few():
    from orthosphere.store.loader import split_ranges

    assert split_ranges([(0, 23)], 2, 9) == [[(0, 9)], [(9, 23)]]
    assert split_ranges([(4, 30)], 3, 8) == [[(4, 16)], [(16, 24)], [(24, 30)]]
    assert split_ranges([(0, 3)], 2, 9) == [[(0, 1)], [(1, 3)]]  # one window: the workers share it
    assert split_ranges([(0, 2), (5, 7)], 2, 4) == [[(0, 2)], [(5, 7)]]


def test_two_ranks_share_the_tokens_once(store):
    seen = [ids(loader(store, rank=r, world_size=2)) for r in range(2)]
    assert sorted(seen[0] + seen[1]) == expected() and abs(len(seen[0]) - len(seen[1])) <= 5


def test_an_opened_store_is_read_as_its_path_is(store):
    from orthosphere.store import open_store

    opened = open_store(str(store))
    assert ids(loader(opened)) == ids(loader(str(store)))
    with pytest.raises(ValueError, match="not opened by orthosphere.store.open_store"):
        loader(opened.drop_attrs())
    with pytest.raises(ValueError, match=r"this Dataset is a selection \(\{'sample': 3\}\) of the store at .*pass the whole store"):
        loader(opened.isel(sample=slice(0, 3)))


def test_seeds_and_epochs_give_different_orders(store):
    first = loader(store)
    assert ids(first) != ids(first) and ids(loader(store)) != ids(loader(store, seed=2))


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_gives_the_remaining_batches_bitwise(store, workers):
    whole = [b.clone() for b in loader(store).dataloader(num_workers=workers)]
    interrupted = loader(store)
    for count, _ in enumerate(interrupted.dataloader(num_workers=workers), 1):
        if count == 4:
            break
    state = interrupted.state_dict()
    resumed = loader(store)
    resumed.load_state_dict(state)
    rest = list(resumed.dataloader(num_workers=workers))
    assert len(rest) == len(whole) - 4
    assert all(torch.equal(a, b) for a, b in zip(rest, whole[4:]))


@pytest.mark.parametrize("first, then", [(2, 0), (0, 2)])
def test_resume_with_another_number_of_workers_gives_each_token_once(store, first, then):
    interrupted, seen = loader(store), []
    for count, batch in enumerate(interrupted.dataloader(num_workers=first), 1):
        seen += ids([batch])
        if count == 4:
            break
    resumed = loader(store)
    resumed.load_state_dict(interrupted.state_dict())
    rest = ids(resumed.dataloader(num_workers=then))
    assert sorted(seen + rest) == expected()


def test_a_dataloader_with_workers_that_the_loader_did_not_make_is_refused(store):
    """Its workers would read every epoch in the first epoch's order, and state_dict would not follow them."""
    tokens = loader(store)
    with pytest.raises(ValueError, match=r"with 2 workers .* iterate loader.dataloader\(num_workers=2, ...\) instead"):
        list(torch.utils.data.DataLoader(tokens, batch_size=None, num_workers=2))
    assert sorted(ids(torch.utils.data.DataLoader(tokens, batch_size=None))) == expected()  # no workers: the loader itself


@pytest.mark.parametrize("workers", [0, 2])
def test_filters_select_what_they_name(store, workers):
    answers = loader(store, where='role == "answer" and 2 <= pos < 5', with_labels=True)
    batches = list(answers.dataloader(num_workers=workers))
    assert sorted(ids(b["activations"] for b in batches)) == expected(lambda s, p: p % 2 == 1 and 2 <= p < 5)
    assert all(set(b["role"]) == {"answer"} for b in batches)
    with_start = loader(store, exclude_start=False)
    assert len(ids(with_start)) == len(expected()) + N_SAMPLES


def test_norm_filter_and_scaling_are_counted(store):
    tokens = loader(store, max_norm_ratio=1.5, scale_norms=True)
    dropped = tokens.summary["dropped_by_norm"]["resid_pre/1"]
    assert dropped > 0 and tokens.summary["tokens"] == len(expected()) - dropped
    vectors = torch.cat(list(tokens))[:, 0]
    assert float((vectors.double() ** 2).sum(1).mean()) == pytest.approx(D_MODEL, rel=1e-5)


@pytest.mark.parametrize("dtype, workers", [("bfloat16", 0), ("bfloat16", 2), ("float16", 0)])
def test_half_precision_round_trips_bit_exactly(tmp_path, dtype, workers):
    """dtype="stored" yields the stored bits; float32 their exact conversion (through the DataLoader's
    shared-memory hand-over too)."""
    import zarr

    url = token_store(tmp_path / f"{dtype}.zarr", dtype=dtype)
    stored = np.asarray(zarr.open_group(url, mode="r")["resid_pre"][:, 1]).reshape(-1, D_MODEL)
    valid = np.ones((N_SAMPLES, N_POS), bool)
    valid[::3, -1] = False
    for output, expected_rows in (("stored", stored[valid.ravel()]), ("float32", stored[valid.ravel()].astype(np.float32))):
        tokens = loader(url, dtype=output, exclude_start=False, buffer_tokens=48, batch_size=16)
        batches = list(tokens.dataloader(num_workers=workers))
        assert {batch.dtype for batch in batches} == {getattr(torch, dtype) if output == "stored" else torch.float32}
        got = torch.cat(batches)[:, 0]
        got = got.view(torch.int16) if got.dtype == torch.bfloat16 else got
        assert sorted(row.tobytes() for row in got.numpy()) == sorted(row.tobytes() for row in expected_rows)


def test_workers_that_cannot_hold_a_buffer_each_are_refused(store, monkeypatch):
    from orthosphere.store import loader as loader_module

    loader = TokenLoader(store, [("resid_pre", 1)], batch_size=8, buffer_tokens=2**12, seed=0)
    hand_over = 6 * loader.batch_size * loader.row_bytes  # each worker's slots of shared memory (ring_slots(2))
    one = loader.buffer_bytes + loader.samples_per_chunk * loader.n_pos * loader.row_bytes + hand_over
    monkeypatch.setattr(loader_module.psutil, "virtual_memory", lambda: type("Memory", (), {"available": 2 * one})())
    loader.dataloader(num_workers=2)
    with pytest.raises(MemoryError, match="3 workers, each its own buffer.* or fewer workers"):
        loader.dataloader(num_workers=3)


@pytest.mark.parametrize("options, error, message", [
    ({"sites": [("q", 0)]}, ValueError, "site 'q' is not a token-vector site of this store"),
    ({"sites": [("resid_pre", 7)]}, ValueError, "layer 7 of site 'resid_pre' is not stored"),
    ({"where": 'colour == "red"'}, ValueError, "names 'colour', which the store does not hold"),
    ({"where": "__import__('os')"}, ValueError, "is not allowed"),
    ({"where": "role == 3"}, ValueError, r"where='role == 3': compares text with a number, which selects no token"),
    ({"buffer_tokens": 2**50}, MemoryError, "more than the .* GiB of memory available"),
    ({"batch_size": 64}, ParameterError, r"buffer_tokens=48: expected buffer_tokens >= batch_size \(64\): a batch is drawn "),
    ({"batch_size": 0}, ParameterError, "batch_size=0: expected a positive integer"),
    ({"sites": []}, ParameterError, r"sites=\[\]: expected a non-empty list of items, each a \(site, layer\) pair"),
    ({"sites": [("resid_pre", 1.7)]}, ParameterError, r"sites=\[\('resid_pre', 1.7\)\]: expected a non-empty list of items"),
    ({"dtype": "float16"}, ParameterError, r"dtype='float16': expected one of \['float32', 'stored'\]"),
    ({"scale_norms": True, "dtype": "stored"}, ParameterError, "scale_norms=True: expected False with dtype='stored'"),
    ({"rank": 2, "world_size": 2}, ParameterError, r"rank=2: expected 0 <= rank < world_size \(2\)"),
])
def test_bad_input_is_refused(store, options, error, message):
    sites = options.pop("sites", [("resid_pre", 1)])
    with pytest.raises(error, match=message):
        TokenLoader(store, sites, **{"batch_size": 5, "buffer_tokens": 48, "seed": 1, **options})


def test_incomplete_store_is_refused(tmp_path):
    from orthosphere.store import create_store

    url = str(tmp_path / "part.zarr")
    create_store(url, model={"family": "synthetic", "source": "planted", "norm_placement": "none", "norm_type": "layer",
                             "attn_scale": 0.5, "causal": True, "n_layers": 1, "n_heads": 2, "n_kv_heads": 2,
                             "d_head": 4, "d_model": 8},
                 task={"name": "planted"}, n_samples=4, n_pos=3, sites=("resid_pre",), labels={}, with_weights=False).close()
    with pytest.raises(IncompleteStoreError, match="is incomplete"):
        loader(url)


@pytest.mark.parametrize("damage, message", [
    ("overwrite", r"array 'resid_pre' chunk \(1, 1, 0, 0\) \(samples 4-7, layer 1\): fails its CRC-32C checksum"),
    ("remove", r"array 'resid_pre' chunk \(1, 1, 0, 0\) \(samples 4-7, layer 1\): missing"),
])
def test_a_chunk_damaged_after_opening_is_named(tmp_path, damage, message):
    from orthosphere.store import DamagedStoreError

    url = token_store(tmp_path / "store.zarr")
    tokens = loader(url)
    path = tmp_path / "store.zarr" / "resid_pre" / "c" / "1" / "1" / "0" / "0"
    if damage == "remove":
        path.unlink()
    else:
        data = bytearray(path.read_bytes())
        data[10] ^= 0xFF
        path.write_bytes(bytes(data))
    with pytest.raises(DamagedStoreError, match=message):
        list(tokens)


@pytest.mark.parametrize("through_zarr", [False, True])
def test_chunks_read_into_given_memory_equal_zarrs(tmp_path, through_zarr):
    """ChunkReader reads each chunk (a short last one too) as zarr does, from its file or through zarr."""
    import zarr

    from orthosphere.store.chunk_read import ChunkReader
    from orthosphere.store.location import as_location
    from orthosphere.store.reader import _promises, open_group_checked

    x = np.random.default_rng(1).normal(size=(10, N_LAYERS, N_POS, D_MODEL)).astype(np.float32)
    url = write_store(tmp_path / "short.zarr", {"resid_pre": x}, samples_per_chunk=4)
    location = as_location(url)
    reader = ChunkReader(location, zarr.open_group(url, mode="r"), "resid_pre", _promises(open_group_checked(location))["resid_pre"])
    assert reader.folder is not None  # a local, uncompressed store: its chunk files are read directly
    if through_zarr:
        reader.folder = None
    for chunk, samples in enumerate([slice(0, 4), slice(4, 8), slice(8, 10)]):
        for layer in range(N_LAYERS):
            out = np.empty((samples.stop - samples.start, N_POS, D_MODEL), np.float32)
            reader.read(chunk, layer, out)
            assert np.array_equal(out, x[samples, layer])
    with pytest.raises(ValueError, match="needs a contiguous float32 buffer of 384 bytes, got float32 of 768"):
        reader.read(2, 0, np.empty((4, N_POS, D_MODEL), np.float32))


def test_state_dict_of_another_filter_or_store_is_refused(store, tmp_path):
    state = loader(store).state_dict()
    with pytest.raises(ValueError, match="the state dict is of where="):
        loader(store, where='role == "answer"').load_state_dict(state)
    other = loader(token_store(tmp_path / "other.zarr"))
    with pytest.raises(ValueError, match="the state dict is of another store"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match=r"pending=\[\[0, 23\]\] is not a list of each consumer's \[start, stop\] ranges"):
        loader(store).load_state_dict({**state, "pending": [[0, 23]]})  # the form of an earlier version


@pytest.mark.slow
def test_readme_example_trains_a_probe_on_a_shipped_models_store(tmp_path, monkeypatch):
    import re
    from pathlib import Path

    from orthosphere.extract.job import ExtractJob, run_job

    repo = Path(__file__).resolve().parents[1]
    readme = (repo / "README.md").read_text()
    example = re.search(r"## Training on a store.*?```python\n(.*?)```", readme, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    run_job(ExtractJob(model=str(repo / "workflows" / "models" / "pre"), task="arithmetic:split=test,seed=2001",
                       out="runs/quickstart/stores/pre-test.zarr", n_samples=64, device="cpu"), progress=False)
    exec(compile(example, "README.md", "exec"), {})
