"""ChunkStream: chunk files written directly are byte for byte what zarr writes, for every dtype,
short last chunks, blocks that straddle chunks and layer-major buffers; and misuse is refused."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest
import zarr

from orthosphere.store import StoreError, open_store, validate
from orthosphere.store import stream as stream_module
from orthosphere.store import writer as writer_module
from orthosphere.store.bfloat16 import bfloat16_dtype
from orthosphere.store.schema import WEIGHT_VARIABLES
from orthosphere.store.stream import DIRECT_ALIGNMENT, ChunkAligner, ChunkStream, chunk_files, direct_writes_work
from tests.test_store import MODEL, N_POS, N_SAMPLES, make_store, sample_block, weights

SITES = ("resid_pre", "q", "k")


def chunk_bytes(url) -> dict[str, bytes]:
    """Every chunk file of the store (paths under an array's c/ folder), with its bytes."""
    found = {}
    for folder, _, names in os.walk(url):
        for name in names:
            path = os.path.join(folder, name)
            relative = os.path.relpath(path, url)
            if f"{os.sep}c{os.sep}" in f"{os.sep}{relative}":
                with open(path, "rb") as handle:
                    found[relative] = handle.read()
    return found


def activations(start, stop, dtype, layer_major: bool) -> dict:
    """Samples [start, stop) of sample_block(0, N_SAMPLES)'s sites in the store's dtype; with
    layer_major, held in (layer, sample, ...) memory as a capture's buffers are."""
    whole = sample_block(0, N_SAMPLES)
    block = {}
    for site in SITES:
        values = whole[site][start:stop]
        values = values.astype(bfloat16_dtype()) if dtype == "bfloat16" else values.astype(dtype)
        if layer_major:
            values = np.ascontiguousarray(values.swapaxes(0, 1)).swapaxes(0, 1)
        block[site] = values
    return block


def write_both(tmp_path, dtype, batch, codec="none"):
    """The same samples written by zarr (whole shards via StoreWriter.write) and by ChunkStream
    (batches of `batch`, straddling chunks)."""
    urls = {}
    for how in ("zarr", "stream"):
        url = urls[how] = str(tmp_path / f"{how}.zarr")
        writer = make_store(url, dtype=dtype, samples_per_chunk=3, n_shards=2, codec=codec, sites=SITES)
        stream = ChunkStream(writer)
        for index, (start, stop) in enumerate(writer.shards):
            if how == "zarr":
                writer.write(start, activations(start, stop, dtype, layer_major=False))
            else:
                for first in range(start, stop, batch):
                    stream.add(first, activations(first, min(first + batch, stop), dtype, layer_major=True))
                stream.flush()
            writer.mark_shard_complete(index)
        writer.write_weights(weights(writer))
        writer.finish()
    return urls


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_stream_writes_the_chunk_files_zarr_writes(tmp_path, dtype):
    urls = write_both(tmp_path, dtype, batch=2)  # 11 samples, chunks of 3 (the last holds 2), shards [0, 6) [6, 11)
    written, expected = chunk_bytes(urls["stream"]), chunk_bytes(urls["zarr"])
    assert written.keys() == expected.keys()
    assert [key for key in written if written[key] != expected[key]] == []
    assert validate(urls["stream"], full=True) == []
    stored, reference = open_store(urls["stream"]), open_store(urls["zarr"])
    for site in SITES:
        np.testing.assert_array_equal(stored[site].values.view(np.uint8), reference[site].values.view(np.uint8))


def test_chunk_aligner_hands_out_whole_chunks_only():
    aligner = ChunkAligner(samples_per_chunk=4)
    written = []
    for start in range(8, 19, 3):  # a shard [8, 19): batches of 3; each block is valid until the next call
        written += [(first, list(arrays["x"])) for first, arrays in aligner.add(start, {"x": np.arange(start, min(start + 3, 19))})]
    written += [(first, list(arrays["x"])) for first, arrays in aligner.flush()]
    assert written == [(8, [8, 9, 10, 11]), (12, [12, 13, 14, 15]), (16, [16, 17, 18])]
    with pytest.raises(RuntimeError, match="does not follow"):
        aligner.add(0, {"x": np.arange(0, 3)})
        aligner.add(5, {"x": np.arange(5, 6)})


def test_compressed_store_is_written_through_zarr_in_whole_chunks(tmp_path):
    urls = write_both(tmp_path, "float16", batch=2, codec="zstd")
    writer = make_store(str(tmp_path / "other.zarr"), codec="zstd", sites=SITES)
    assert chunk_files(writer, "q") is None
    written, expected = chunk_bytes(urls["stream"]), chunk_bytes(urls["zarr"])
    assert written == expected


def test_stream_writes_an_uncompressed_local_array_directly(tmp_path):
    writer = make_store(str(tmp_path / "store.zarr"), dtype="float16", sites=SITES)
    files = chunk_files(writer, "q")
    assert files is not None and files.has_layer and files.sample_bytes == N_POS * 4 * 2 * 2
    assert chunk_files(writer, "role") is None  # labels are compressed


def test_weight_maps_are_written_directly_with_zarrs_bytes(tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    maps, written = None, {}
    for how in ("stream", "zarr"):
        writer = make_store(str(tmp_path / f"{how}.zarr"), sites=SITES)
        if how == "zarr":
            monkeypatch.setattr(writer_module, "array_files", lambda *arguments: None)
        else:
            assert all(stream_module.array_files(writer.location, name, writer.group[name]) is not None for name in WEIGHT_VARIABLES)
            maps = {name: rng.normal(size=writer.group[name].shape) for name in WEIGHT_VARIABLES}  # float64, stored float32
        writer.write_weights(maps)
        written[how] = {key: value for key, value in chunk_bytes(writer.url).items() if key.split(os.sep)[0] in WEIGHT_VARIABLES}
        assert writer.weights_written()
        writer.close()
    assert written["stream"].keys() == written["zarr"].keys() and len(written["zarr"]) == len(WEIGHT_VARIABLES) * 3  # a layer a chunk
    assert [key for key in written["stream"] if written["stream"][key] != written["zarr"][key]] == []
    reread = zarr.open_group(str(tmp_path / "stream.zarr"), mode="r")
    for name, values in maps.items():
        np.testing.assert_array_equal(reread[name][...], values.astype(np.float32))


def test_blocks_out_of_order_or_of_the_wrong_shape_are_refused(tmp_path):
    writer = make_store(str(tmp_path / "store.zarr"), dtype="float16", samples_per_chunk=4, n_shards=1, sites=SITES)
    stream = ChunkStream(writer)
    stream.add(0, {"q": activations(0, 2, "float16", True)["q"]})
    with pytest.raises(RuntimeError, match="do not follow"):
        stream.add(3, {"q": activations(3, 4, "float16", True)["q"]})
    with pytest.raises(StoreError, match="'k' takes blocks of shape"):
        stream.add(0, {"k": np.zeros((2, 3, N_POS, 4, 2), np.float16)})
    with pytest.raises(StoreError, match="dtype float16"):
        stream.add(0, {"k": np.zeros((2, 3, N_POS, 2, 2), np.float32)})


def test_a_shard_that_ends_inside_a_chunk_is_refused(tmp_path):
    writer = make_store(str(tmp_path / "store.zarr"), dtype="float16", samples_per_chunk=4, n_shards=1, sites=SITES)
    stream = ChunkStream(writer)
    stream.add(0, {"q": activations(0, 2, "float16", True)["q"]})
    with pytest.raises(RuntimeError, match="unfinished"):
        stream.flush()


# --- direct (O_DIRECT) writes -------------------------------------------------------------------

ALIGNED_MODEL = {**MODEL, "d_model": 64, "n_heads": 4, "n_kv_heads": 1, "d_head": 16}
"""With 16 positions in float32, a sample of resid_pre or q is 4096 bytes (aligned), of k 1024: pieces
of k of one or two samples are never aligned."""


def aligned_layer_major(values: np.ndarray, shift: int = 0) -> np.ndarray:
    """values held in (layer, sample, ...) memory starting `shift` bytes past a DIRECT_ALIGNMENT boundary."""
    raw = np.empty(values.nbytes + 2 * DIRECT_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % DIRECT_ALIGNMENT + shift
    held = raw[start: start + values.nbytes].view(values.dtype).reshape((values.shape[1], values.shape[0]) + values.shape[2:])
    held[...] = values.swapaxes(0, 1)
    return held.swapaxes(0, 1)


def write_aligned_both(tmp_path, shift=0):
    """Random float32 sites written by zarr (whole shards) and by ChunkStream (batches of 2 in
    buffers `shift` bytes past alignment, straddling chunks of 3)."""
    rng = np.random.default_rng(0)
    shapes = {"resid_pre": (3, 16, 64), "q": (3, 16, 4, 16), "k": (3, 16, 1, 16)}
    values = {site: rng.normal(size=(N_SAMPLES,) + shape).astype("float32") for site, shape in shapes.items()}
    urls = {}
    for how in ("zarr", "stream"):
        url = urls[how] = str(tmp_path / f"{how}.zarr")
        writer = make_store(url, model=ALIGNED_MODEL, n_pos=16, samples_per_chunk=3, n_shards=2, sites=SITES)
        stream = ChunkStream(writer)
        for index, (start, stop) in enumerate(writer.shards):
            if how == "zarr":
                writer.write(start, {site: value[start:stop] for site, value in values.items()})
            else:
                for first in range(start, stop, 2):
                    last = min(first + 2, stop)
                    stream.add(first, {site: aligned_layer_major(value[first:last], shift) for site, value in values.items()})
                stream.flush()
            writer.mark_shard_complete(index)
        writer.write_weights(weights(writer))
        writer.finish()
    return urls


def site_of(path) -> str | None:
    """The site array whose chunk file `path` is, or None (another array, or not a chunk file)."""
    array, found, _ = str(path).partition(f"{os.sep}c{os.sep}")
    return os.path.basename(array) if found and os.path.basename(array) in SITES else None


def opened_directly(monkeypatch) -> list[str]:
    """The site arrays whose chunk files will be opened with O_DIRECT (the weight maps' may be too,
    where numpy's memory happens to be aligned)."""
    opened, real_open = [], os.open

    def recording_open(path, flags, *args):
        if flags & os.O_DIRECT and site_of(path) is not None:
            opened.append(site_of(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", recording_open)
    return opened


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this system")
@pytest.mark.parametrize("shift", [0, 64])
def test_aligned_pieces_go_to_the_disk_directly_and_the_files_are_zarrs(tmp_path, monkeypatch, shift):
    if not direct_writes_work(str(tmp_path)):
        pytest.skip("the temporary folder's file system takes no direct writes")
    opened = opened_directly(monkeypatch)
    urls = write_aligned_both(tmp_path, shift)
    written, expected = chunk_bytes(urls["stream"]), chunk_bytes(urls["zarr"])
    assert written.keys() == expected.keys() and [key for key in written if written[key] != expected[key]] == []
    assert validate(urls["stream"], full=True) == []
    if shift == 0:  # resid_pre and q: aligned samples; k: 2048-byte samples, through the page cache
        # 8 pieces a layer: [0, 2) [2, 3) | [3, 4) [4, 6) || [6, 8) [8, 9) | [9, 10) [10, 11)
        assert set(opened) == {"resid_pre", "q"} and opened.count("q") == opened.count("resid_pre") == 3 * 8
    else:  # buffers off alignment: every piece through the page cache
        assert opened == []


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this system")
def test_a_file_system_that_refuses_direct_writes_gets_buffered_ones(tmp_path, monkeypatch):
    real_open, refused = os.open, []

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            refused.append(site_of(path))
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(stream_module, "direct_writes_work", lambda folder: True)
    monkeypatch.setattr(os, "open", refusing_open)
    urls = write_aligned_both(tmp_path)
    written, expected = chunk_bytes(urls["stream"]), chunk_bytes(urls["zarr"])
    assert written.keys() == expected.keys() and [key for key in written if written[key] != expected[key]] == []
    # one refusal each for resid_pre and q, whose aligned pieces are then written buffered (and at
    # most one for each weight map, where numpy's memory happens to be aligned)
    assert sorted(site for site in refused if site is not None) == ["q", "resid_pre"]


def test_direct_writes_only_on_local_disk_file_systems(tmp_path, monkeypatch):
    probe = direct_writes_work.__wrapped__  # uncached
    if os.path.exists("/proc/self/mountinfo"):
        assert isinstance(stream_module.file_system_type(str(tmp_path)), str)
    for remote in ("nfs4", "tmpfs", "fuse.sshfs", "overlay", None):
        monkeypatch.setattr(stream_module, "file_system_type", lambda path, kind=remote: kind)
        assert probe(str(tmp_path)) is False
    assert os.listdir(tmp_path) == []  # no probe file left behind
