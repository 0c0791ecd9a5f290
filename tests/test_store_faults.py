"""Faults below the store: local I/O errors and a full disk injected into the layers that write and read
chunks (monkeypatched), and an S3 endpoint behind a small fault proxy on 127.0.0.1. Every failure is one
StorageFailureError naming the store, the array and chunk (or file), the cause and what to do."""
from __future__ import annotations

import errno
import os
import re

import numpy as np
import pytest
import zarr

from orthosphere.errors import StorageFailureError, StoreError
from orthosphere.store import open_store, open_writer, validate
from orthosphere.store import stream as stream_module
from orthosphere.store.chunk_read import ChunkReader
from orthosphere.store.integrity import guarded_group, promises
from orthosphere.store.location import as_location
from orthosphere.store.lock import acquire_lock, read_lock
from orthosphere.store.stream import ChunkStream
from orthosphere.store.writer import store_footprint
from orthosphere.workflows.cli import one_line
from tests.fault_proxy import FaultProxy
from tests.test_store import fill, make_store, sample_block


def os_error(code: int) -> OSError:
    """What the kernel raises from a write or read: an errno, no file name."""
    return OSError(code, os.strerror(code))


def failing_chunk_writes(monkeypatch, fragment: str, code: int) -> None:
    """Direct chunk writes to a path containing `fragment` fail with `code`."""
    real = stream_module._write_bytes

    def write(path, data, offset, truncate, mode):
        if fragment in path:
            raise os_error(code)
        real(path, data, offset, truncate, mode)

    monkeypatch.setattr(stream_module, "_write_bytes", write)


def failing_zarr(monkeypatch, method: str, key: str, code: int) -> None:
    """zarr's LocalStore.<method> of `key` fails with `code`."""
    real = getattr(zarr.storage.LocalStore, method)

    async def call(self, name, *arguments, **options):
        if name == key:
            raise os_error(code)
        return await real(self, name, *arguments, **options)

    monkeypatch.setattr(zarr.storage.LocalStore, method, call)


def test_full_disk_during_a_direct_chunk_write_names_store_array_chunk_and_advice(tmp_path, monkeypatch):
    url = str(tmp_path / "store.zarr")
    writer = make_store(url)
    failing_chunk_writes(monkeypatch, os.path.join("q", "c", "1", "0"), errno.ENOSPC)
    with pytest.raises(StorageFailureError) as caught:
        ChunkStream(writer).add(0, sample_block(0, 4))
    assert str(caught.value) == (
        f"store {url}: the storage failed writing array 'q' chunk (1, 0, 0, 0, 0) (OSError: [Errno 28] No space left "
        'on device); free space there, then resume the job that writes it (mode="resume")')
    writer.close()


@pytest.mark.parametrize(("key", "named", "act"), [
    ("_progress/shard_complete/c/1", "progress flag _progress/shard_complete chunk (1)",
     lambda writer: (writer.write(4, sample_block(4, 8)), writer.mark_shard_complete(1))),
    ("operand/c/0/0", "array 'operand' chunk (0, 0)", lambda writer: writer.write(0, sample_block(0, 4))),
    ("zarr.json", "metadata file zarr.json", lambda writer: fill(writer)),
])
def test_io_error_on_a_zarr_write_names_the_file(tmp_path, monkeypatch, key, named, act):
    url = str(tmp_path / "store.zarr")
    writer = make_store(url)
    failing_zarr(monkeypatch, "set", key, errno.EIO)
    with pytest.raises(StorageFailureError, match=rf"^store {re.escape(url)}: the storage failed writing {re.escape(named)} \(OSError: "
                                                  r"\[Errno 5\] Input/output error\); once the storage works again, "
                                                  r'resume the job that writes it \(mode="resume"\): nothing complete is lost$'):
        act(writer)
    monkeypatch.undo()
    writer.close()


def test_failed_lock_release_after_a_failed_chunk_write_keeps_the_first_failure(tmp_path, monkeypatch, caplog):
    url = str(tmp_path / "store.zarr")
    failing_chunk_writes(monkeypatch, os.path.join("k", "c", "0"), errno.EIO)

    def release(location):
        raise os_error(errno.EIO)

    monkeypatch.setattr("orthosphere.store.writer.release_lock", release)
    with pytest.raises(StorageFailureError, match=r"writing array 'k' chunk \(0, 0, 0, 0, 0\)"), make_store(url) as writer:
        ChunkStream(writer).add(0, sample_block(0, 4))
    assert "could not release its lock after the failure that stopped the job" in caplog.text


def test_io_error_on_a_read_through_xarray_names_store_array_and_chunk(tmp_path, monkeypatch):
    url = str(tmp_path / "store.zarr")
    fill(make_store(url))
    dataset = open_store(url)
    failing_zarr(monkeypatch, "get", "resid_pre/c/0/1/0/0", errno.EIO)
    with pytest.raises(StorageFailureError, match=rf"^store {re.escape(url)}: the storage failed reading array 'resid_pre' chunk "
                                                  r"\(0, 1, 0, 0\) \(OSError: \[Errno 5\].*validate .* --full --reopen"):
        dataset["resid_pre"].sum().compute()


def test_io_error_on_a_direct_chunk_read_names_store_array_and_chunk(tmp_path, monkeypatch):
    url = str(tmp_path / "store.zarr")
    fill(make_store(url))
    location = as_location(url)
    group = zarr.open_group(url, mode="r")
    promised = promises(group, dict(group.attrs), np.ones(3, bool), True)
    reader = ChunkReader(location, guarded_group(location, promised), "resid_pre", promised["resid_pre"])

    def unreadable(descriptor, buffers):
        raise os_error(errno.EIO)

    monkeypatch.setattr("orthosphere.store.chunk_read.read_exactly", unreadable)
    with pytest.raises(StorageFailureError, match=r"reading array 'resid_pre' chunk \(1, 2, 0, 0\)"):
        reader.read(1, 2, np.empty((2, 5, 8), np.float32))


def test_object_store_error_is_a_storage_failure_not_a_bug():
    from botocore.exceptions import EndpointConnectionError

    text = one_line(EndpointConnectionError(endpoint_url="http://127.0.0.1:9"))
    assert text.startswith("the storage failed (EndpointConnectionError: Could not connect")
    assert "please report" not in text


@pytest.mark.parametrize("where", ["local", "memory"])
def test_lock_whose_write_response_was_lost_is_taken_by_its_own_job(tmp_path, monkeypatch, where):
    """The conditional write succeeded but its answer was lost; the retry meets this job's own lock."""
    import orthosphere.store.lock as lock_module

    url = str(tmp_path / "store.zarr") if where == "local" else f"memory://lost-{os.getpid()}/store.zarr"
    real = lock_module._create_exclusively

    def lost_response(location, name, text):
        real(location, name, text)
        raise FileExistsError(errno.EEXIST, "the retried write found the file", location.key(name))

    monkeypatch.setattr(lock_module, "_create_exclusively", lost_response)
    location = as_location(url)
    holder = acquire_lock(location)
    assert read_lock(location) == holder


# S3 behind a fault proxy -------------------------------------------------------------------

@pytest.fixture
def proxy(s3_endpoint):
    with FaultProxy(s3_endpoint) as running:
        yield running


def proxied(proxy, attempts: int = 5) -> dict:
    """Storage options that reach S3 through the proxy, with botocore's attempts as given (under
    s3fs's own five tries of each request)."""
    return {"endpoint_url": proxy.url, "config_kwargs": {"retries": {"max_attempts": attempts, "mode": "standard"}}}


@pytest.mark.slow
def test_s3_faults_are_retried_or_named_and_resuming_after_an_outage_finishes_the_store(s3_bucket, proxy, caplog,
                                                                                         monkeypatch):
    """503 SlowDown answers and a lost answer to the lock's conditional write are retried; an outage
    mid-write stops the writer with the store and chunk named, the lock release's failure logged,
    never raised in place of the first; once the endpoint is back the store is finished."""
    url = f"{s3_bucket}/faults/store.zarr"
    proxy.slow_down(3)  # the next three requests are answered 503 SlowDown
    proxy.lose_response_of(".orthosphere-lock")  # the lock's PUT is done, its answer never arrives
    writer = make_store(url, storage_options=proxied(proxy, attempts=1))
    assert proxy.faults_served == 4
    monkeypatch.setattr("s3fs.S3FileSystem.retries", 2)  # s3fs tries each request 5 times: 2 are quicker
    proxy.go_down()
    with pytest.raises(StorageFailureError, match=rf"^store {re.escape(url)}: the storage failed writing array '\w+' "
                                                  r"chunk \(.*\) \(\w+: .*\); once the storage works again, resume"), writer:
        writer.write(0, sample_block(0, 4))
    assert "could not release its lock" in caplog.text
    proxy.come_back()
    monkeypatch.undo()
    written = fill(open_writer(url, storage_options=proxied(proxy), break_lock=True))
    dataset = open_store(url, storage_options=proxied(proxy))
    np.testing.assert_array_equal(dataset["q"].isel(sample=slice(0, 4)).values, written[0]["q"])


# The up-front space check ------------------------------------------------------------------

def footprint_of(url, block: int) -> int:
    """store_footprint for the store at url (made by make_store), from its own attributes."""
    from orthosphere.store.schema import dim_sizes, variables_for

    attrs = zarr.open_group(url, mode="r").attrs
    sizes = dim_sizes(attrs["model"], attrs["n_samples"], attrs["n_pos"], len(attrs["layers"]))
    variables = variables_for(attrs["sites"], attrs["with_weights"])
    return store_footprint(variables, attrs["labels"], sizes, attrs["dtype"], attrs["samples_per_chunk"],
                           len(attrs["shards"]), block)


@pytest.mark.parametrize("samples_per_chunk", [2, 3])
def test_space_check_counts_at_least_what_the_finished_store_takes_on_disk(tmp_path, samples_per_chunk):
    url = str(tmp_path / "store.zarr")
    fill(make_store(url, samples_per_chunk=samples_per_chunk))
    block = os.statvfs(tmp_path).f_frsize
    on_disk = sum(-(-size // block) * block for size in as_location(url).list_files().values())
    assert on_disk <= footprint_of(url, block) <= 2 * on_disk


def test_space_check_refuses_a_store_without_its_margin_and_says_both_numbers(tmp_path, monkeypatch):
    url = str(tmp_path / "store.zarr")
    fill(make_store(url))
    needed = footprint_of(url, 4096)
    monkeypatch.setattr("orthosphere.store.writer._room", lambda location, memory: (needed, "the disk has", 4096))
    with pytest.raises(StoreError, match=r"^n_samples=11: the store would take ([\d.,]+ MB) there "
                                         r"\(([\d.,]+ MB) with a 5% margin; .* a sample\) but the disk has \1 free"):
        make_store(str(tmp_path / "other.zarr"))
    assert not (tmp_path / "other.zarr").exists()


# Through the command line ------------------------------------------------------------------

def test_full_disk_mid_job_is_one_line_and_resume_finishes_it_bitwise(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from orthosphere.workflows.cli import main
    from tests.test_extract_models import write_arithmetic_model

    model = str(write_arithmetic_model(tmp_path / "model"))

    def extract(out, *more):
        arguments = ["extract", model, "--task", "arithmetic:split=test,seed=4", "--samples", "12", "--out", out,
                     "--samples-per-chunk", "2", "--shards", "3", "--batch-size", "2", "--device", "cpu", *more]
        return CliRunner().invoke(main, arguments)

    reference, out = str(tmp_path / "reference.zarr"), str(tmp_path / "store.zarr")
    assert extract(reference).exit_code == 0
    failing_chunk_writes(monkeypatch, os.path.join("resid_post", "c", "3", "1"), errno.ENOSPC)
    result = extract(out)
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1] == (
        f"Error: store {out}: the storage failed writing array 'resid_post' chunk (3, 1, 0, 0) (OSError: [Errno 28] No "
        "space left on device); free space there, then resume the job that writes it (--resume)")
    monkeypatch.undo()
    assert extract(out, "--resume").exit_code == 0
    finished, expected = open_store(out).load(), open_store(reference).load()
    for name in expected.variables:
        np.testing.assert_array_equal(finished[name].values, expected[name].values)


@pytest.mark.slow
def test_object_store_outage_in_the_cli_is_one_line_naming_the_store(s3_bucket, proxy, monkeypatch):
    import s3fs
    from click.testing import CliRunner

    from orthosphere.workflows.cli import main

    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setattr("s3fs.S3FileSystem.retries", 2)
    s3fs.S3FileSystem.clear_instance_cache()  # an earlier test's file system (and its listings) would answer from memory
    proxy.go_down()
    url = f"{s3_bucket}/down/store.zarr"
    try:
        result = CliRunner().invoke(main, ["validate", url])
    finally:  # fsspec keeps the file system it made (towards the proxy) for the same options: forget it
        s3fs.S3FileSystem.clear_instance_cache()
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert lines[-1].startswith(f"Error: store {url}: the storage failed reading its listing and root metadata ("), lines
    assert "please report" not in result.output and "Traceback" not in result.output


def test_full_validation_stops_at_an_unreadable_chunk_instead_of_calling_it_damaged(tmp_path, monkeypatch):
    url = str(tmp_path / "store.zarr")
    fill(make_store(url))
    failing_zarr(monkeypatch, "get", "k/c/2/0/0/0/0", errno.EIO)
    with pytest.raises(StorageFailureError, match=r"reading array 'k' chunk \(2, 0, 0, 0, 0\)"):
        validate(url, full=True)
    monkeypatch.undo()
    assert validate(url, full=True) == []


def test_cli_drops_asyncio_tracebacks_of_sibling_requests_but_keeps_other_asyncio_logs():
    import logging

    from orthosphere.workflows.cli import quiet_unretrieved_failures

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, None)

    assert not quiet_unretrieved_failures(record("Task exception was never retrieved"))
    assert quiet_unretrieved_failures(record("Executing <Task> took 0.5 seconds"))
