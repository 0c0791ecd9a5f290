"""The store: round trips, completeness, locking, URLs, validation and every bad input."""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime

import dask.array
import numpy as np
import pytest
import zarr

from orthosphere.errors import JobMismatchError
from orthosphere.store import (
    DamagedStoreError,
    IncompleteStoreError,
    StoreError,
    StoreExistsError,
    StoreLockedError,
    StoreNotFoundError,
    create_store,
    format_info,
    info,
    open_store,
    open_writer,
    read_attrs,
    validate,
)
from orthosphere.store.lifecycle import (
    COMPLETE,
    CREATED,
    IDENTITY_KEYS,
    RECREATED,
    REPLACED,
    RESUMED,
    check_location,
    open_for_job,
)
from orthosphere.store.location import Location, as_location
from orthosphere.store.lock import HEARTBEAT_NAME, LOCK_NAME, STALE_SECONDS, read_lock, stale_reason
from orthosphere.store.schema import WEIGHT_VARIABLES
from orthosphere.store.state import DAMAGED, REMNANT, inspect
from orthosphere.store.writer import new_store

MODEL = {"family": "test", "n_layers": 3, "d_model": 8, "n_heads": 4, "n_kv_heads": 2, "d_head": 2, "attn_scale": 0.7, "causal": True}
TASK = {"name": "synthetic", "seed": 0}
LABELS = {"role": "str", "operand": "int16"}
N_SAMPLES, N_POS = 11, 5


def make_store(url, **overrides):
    arguments = dict(
        model=MODEL, task=TASK, n_samples=N_SAMPLES, n_pos=N_POS, labels=LABELS,
        samples_per_chunk=2, n_shards=3, dtype="float32",
    )
    arguments.update(overrides)
    return create_store(url, **arguments)


def sample_block(start, stop, layers=3):
    """Deterministic contents of samples [start, stop): every value encodes its sample index."""
    n = stop - start
    base = np.arange(start, stop, dtype=np.float32)[:, None, None, None]
    rng = np.random.default_rng(start)
    roles = np.where(rng.random((n, N_POS)) < 0.5, "digit", "operator")
    return {
        "tokens": np.tile(np.arange(start, stop, dtype=np.int32)[:, None], (1, N_POS)),
        "valid": np.ones((n, N_POS), bool),
        "resid_pre": base + rng.normal(size=(n, layers, N_POS, 8)).astype(np.float32),
        "q": rng.normal(size=(n, layers, N_POS, 4, 2)).astype(np.float32),
        "k": rng.normal(size=(n, layers, N_POS, 2, 2)).astype(np.float32),
        "role": roles,
        "operand": rng.integers(-1, 3, size=(n, N_POS)).astype(np.int16),
    }


def weights(writer):
    return {name: np.full(writer.group[name].shape, 0.5, np.float32) for name in WEIGHT_VARIABLES}


def fill(writer, order=None):
    """Write every shard (in the given order) and finish; returns what was written."""
    written = {}
    for index in order if order is not None else range(len(writer.shards)):
        start, stop = writer.shards[index]
        block = sample_block(start, stop)
        writer.write(start, block)
        writer.mark_shard_complete(index)
        written[start] = block
    writer.write_weights(weights(writer))
    writer.finish()
    return written


def assert_round_trip(dataset, written):
    for start, block in written.items():
        stop = start + len(block["tokens"])
        for name, values in block.items():
            stored = dataset[name].isel(sample=slice(start, stop)).values
            if name == "role":
                assert stored.tolist() == values.tolist()
            else:
                np.testing.assert_array_equal(stored, values)


@pytest.mark.slow
def test_round_trip_out_of_order(tmp_path):
    url = str(tmp_path / "store.zarr")
    writer = make_store(url)
    assert writer.shards == [(0, 4), (4, 8), (8, 11)]
    written = fill(writer, order=[2, 0, 1])
    dataset = open_store(url)
    assert_round_trip(dataset, written)
    assert dict(dataset.sizes) == {"sample": 11, "layer": 3, "pos": 5, "d_model": 8, "head": 4, "kv_head": 2, "d_head": 2}
    assert set(dataset.coords) >= {"sample", "layer", "pos", "head", "kv_head", "role", "operand"}
    assert dataset.resid_pre.chunks[0] == (2, 2, 2, 2, 2, 1)
    assert dataset.resid_pre.chunks[1] == (1, 1, 1)
    assert float(dataset.w_o.sum()) == pytest.approx(0.5 * 3 * 4 * 2 * 8)
    assert validate(url) == []


@pytest.mark.slow
def test_dataset_is_lazy_and_selectable(tmp_path):
    url = str(tmp_path / "store.zarr")
    fill(make_store(url))
    dataset = open_store(url)
    assert isinstance(dataset.resid_pre.data, dask.array.Array)
    written = np.concatenate([sample_block(start, stop)["role"] for start, stop in [(0, 4), (4, 8), (8, 11)]])
    assert int((dataset.role == "digit").sum()) == int((written == "digit").sum())


def test_root_attributes_and_provenance(tmp_path):
    url = str(tmp_path / "store.zarr")
    writer = make_store(url, layers=[0, 2], n_shards=1, command="orthosphere extract test")
    writer.write(0, {name: values for name, values in sample_block(0, N_SAMPLES, layers=2).items()})
    writer.mark_shard_complete(0)
    writer.write_weights({name: np.zeros(writer.group[name].shape, np.float32) for name in WEIGHT_VARIABLES})
    writer.finish()
    attrs = read_attrs(url)
    assert attrs["schema"] == 1 and attrs["model"] == MODEL and attrs["task"] == TASK
    assert attrs["sites"] == ["resid_pre", "resid_mid", "resid_post", "attn_in", "norm_scale", "q", "k", "v", "q_norm_scale",
                             "k_norm_scale"]
    assert attrs["layers"] == [0, 2] and attrs["dtype"] == "float32" and attrs["complete"] is True
    provenance = attrs["provenance"]
    assert provenance["command"] == "orthosphere extract test"
    assert provenance["package_version"] and provenance["torch_version"] and provenance["created"]
    assert open_store(url).layer.values.tolist() == [0, 2]


def test_float16_store_and_chunk_size(tmp_path):
    url = str(tmp_path / "store.zarr")
    model = dict(MODEL, d_model=512, n_heads=8, n_kv_heads=8, d_head=64)
    writer = create_store(url, model=model, task=TASK, n_samples=4000, n_pos=32, dtype="float16")
    chunk = writer.group["resid_pre"].chunks
    chunk_bytes = np.prod(chunk) * 2
    assert chunk[1] == 1 and 2**20 <= chunk_bytes <= 16 * 2**20
    assert writer.group["q"].dtype == np.float16
    writer.close()


@pytest.mark.slow
def test_incomplete_store_is_refused_until_finished(tmp_path):
    url = str(tmp_path / "store.zarr")
    writer = make_store(url)
    start, stop = writer.shards[1]
    writer.write(start, sample_block(start, stop))
    writer.mark_shard_complete(1)
    with pytest.raises(IncompleteStoreError, match='2 of 3 shards are missing.*mode="resume"'):
        open_store(url)
    with pytest.raises(IncompleteStoreError, match="2 of 3 shards are not complete"):
        writer.finish()
    partial = open_store(url, allow_incomplete=True)
    assert list(partial.sample.values) == list(range(start, stop)) and partial.attrs["samples_written"].startswith(f"{stop - start} of")
    np.testing.assert_array_equal(partial.tokens.values, sample_block(start, stop)["tokens"])
    assert "w_q" not in partial  # the weight maps were never written: not read as zeros
    assert any("incomplete" in problem for problem in validate(url))
    writer.close()

    resumed = open_writer(url)
    assert resumed.pending_shards() == [0, 2]
    fill(resumed, order=resumed.pending_shards())
    assert open_store(url).attrs["complete"] is True


def test_finish_requires_weights(tmp_path):
    writer = make_store(str(tmp_path / "store.zarr"))
    for index, (start, stop) in enumerate(writer.shards):
        writer.write(start, sample_block(start, stop))
        writer.mark_shard_complete(index)
    with pytest.raises(IncompleteStoreError, match="attention maps were never written"):
        writer.finish()
    writer.close()


def test_block_may_not_straddle_shards(tmp_path):
    writer = make_store(str(tmp_path / "store.zarr"))
    with pytest.raises(StoreError, match=r"samples \[2, 6\) do not lie inside one shard"):
        writer.write(2, sample_block(2, 6))
    writer.close()


@pytest.mark.slow
def test_memory_url_round_trip():
    url = f"memory://orthosphere-{uuid.uuid4().hex}/store.zarr"
    written = fill(make_store(url))
    assert_round_trip(open_store(url), written)
    assert validate(url) == []


@pytest.mark.slow
def test_s3_round_trip(s3_bucket):
    url = f"{s3_bucket}/runs/store.zarr"
    written = fill(make_store(url))
    assert_round_trip(open_store(url), written)
    assert validate(url) == []
    assert info(url)["size_bytes"] > 0

def test_store_at_the_root_of_a_zip_file_or_a_reference_filesystem(tmp_path):
    """A store that is a whole filesystem (its root ""): every chunk found, read, validated and described."""
    import zipfile

    url = str(tmp_path / "store.zarr")
    written = fill(make_store(url))
    files = {os.path.relpath(os.path.join(folder, name), url).replace(os.sep, "/"): os.path.join(folder, name)
             for folder, _, names in os.walk(url) for name in names}
    with zipfile.ZipFile(tmp_path / "store.zip", "w") as archive:
        for key, path in files.items():
            archive.write(path, key)
    references = {"version": 1, "refs": {key: [path, 0, os.path.getsize(path)] for key, path in files.items()}}
    for root, options in [(f"zip://::{tmp_path / 'store.zip'}", {}), ("reference://", {"fo": references})]:
        assert validate(root, storage_options=options, full=True) == [], root
        assert_round_trip(open_store(root, storage_options=options), written)
        assert info(root, storage_options=options)["complete"], root


# Locking -------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.slow
def test_lock_is_created_exclusively(tmp_path, request, monkeypatch, where):
    """Two writers that both saw no lock: only one creates it (O_EXCL locally, a conditional write on S3)."""
    url = str(tmp_path / "store.zarr") if where == "local" else f"{request.getfixturevalue('s3_bucket')}/runs/store.zarr"
    fill(make_store(url))
    foreign_lock(url, seconds_ago=0)
    monkeypatch.setattr("orthosphere.store.lock.current_lock", lambda location: (None, None))
    with pytest.raises(StoreLockedError, match="locked by another writer a moment ago"):
        open_writer(url)
    monkeypatch.undo()
    assert read_lock(as_location(url))["host"] == "gpu-node-7"


def test_lock_whose_copy_written_aside_vanishes_before_it_is_linked_is_another_writers(tmp_path, monkeypatch):
    """Another writer took the lock and cleared the store between this one writing its lock aside
    and linking it into place: the clear lock error, never a traceback."""
    url = str(tmp_path / "store.zarr")
    make_store(url).close()

    def cleared_before_the_link(source, destination):
        os.unlink(source)
        raise FileNotFoundError(2, "No such file or directory", source)

    monkeypatch.setattr("orthosphere.store.lock.os.link", cleared_before_the_link)
    with pytest.raises(StoreLockedError, match="locked by another writer a moment ago; try again"):
        open_writer(url)
    monkeypatch.undo()
    assert not [entry for entry in os.listdir(tmp_path / "store.zarr") if entry.endswith(".partial")]
    open_writer(url).close()


HOLD_LOCK = """
import sys, time
from orthosphere.store import create_store
from tests.test_store import MODEL, TASK
writer = create_store(sys.argv[1], model=MODEL, task=TASK, n_samples=4, n_pos=3)
print("locked", flush=True)
if sys.argv[2] == "die":
    import os; os._exit(0)
time.sleep(60)
"""


def hold_lock(url, mode):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    process = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, url, mode], cwd=root, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "locked"
    return process


@pytest.mark.slow
def test_lock_names_a_running_holder(tmp_path):
    url = str(tmp_path / "store.zarr")
    holder = hold_lock(url, "wait")
    try:
        with pytest.raises(StoreLockedError, match=f"running writer: pid {holder.pid}"):
            open_writer(url)
        with pytest.raises(StoreLockedError, match="running writer"):
            create_store(url, model=MODEL, task=TASK, n_samples=4, n_pos=3, overwrite=True)
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow
def test_lock_of_a_dead_process_of_this_host_is_broken_with_a_warning(tmp_path, caplog):
    url = str(tmp_path / "store.zarr")
    holder = hold_lock(url, "die")
    holder.wait()
    writer = open_writer(url)
    assert f"breaking the stale lock of {url} held by pid {holder.pid}" in caplog.text
    assert "no longer runs on this host" in caplog.text
    lock = json.loads((tmp_path / "store.zarr" / LOCK_NAME).read_text())
    assert lock["pid"] == os.getpid()
    writer.close()
    assert not (tmp_path / "store.zarr" / LOCK_NAME).exists()
    assert not (tmp_path / "store.zarr" / HEARTBEAT_NAME).exists()


def foreign_lock(url, seconds_ago, token="theirs"):
    """A lock left by a job on another host whose last heartbeat was `seconds_ago` seconds ago."""
    location = as_location(url)
    location.fs.makedirs(location.root, exist_ok=True)
    since = datetime.fromtimestamp(time.time() - seconds_ago - 60, UTC).isoformat(timespec="seconds")
    holder = {"host": "gpu-node-7", "pid": 4242, "command": "orthosphere extract ...", "since": since, "token": token}
    location.fs.pipe_file(location.key(LOCK_NAME), json.dumps(holder).encode())
    location.fs.pipe_file(location.key(HEARTBEAT_NAME), json.dumps({"token": token, "at": time.time() - seconds_ago}).encode())


@pytest.mark.parametrize("where", ["local", "memory"])
@pytest.mark.slow
def test_lock_of_another_host_is_stale_once_its_heartbeat_stops(tmp_path, caplog, where):
    url = str(tmp_path / "store.zarr") if where == "local" else f"memory://orthosphere-{uuid.uuid4().hex}/store.zarr"
    fill(make_store(url))
    foreign_lock(url, seconds_ago=5)
    with pytest.raises(StoreLockedError, match=r"running writer: pid 4242 on gpu-node-7.*last heartbeat \d+ s ago.*"
                                               r"pass break_lock=True"):
        open_writer(url)
    foreign_lock(url, seconds_ago=STALE_SECONDS + 5)
    open_writer(url).close()
    assert "breaking the stale lock" in caplog.text and "its last heartbeat was" in caplog.text
    foreign_lock(url, seconds_ago=5)
    writer = open_writer(url, break_lock=True)
    assert "breaking the live lock" in caplog.text and read_lock(as_location(url))["pid"] == os.getpid()
    writer.close()
    assert read_lock(as_location(url)) is None


@pytest.mark.slow
def test_heartbeat_refreshes_and_a_broken_lock_stops_the_writer(tmp_path, monkeypatch):
    monkeypatch.setattr("orthosphere.store.lock.HEARTBEAT_SECONDS", 0.05)
    url = str(tmp_path / "store.zarr")
    writer = make_store(url)
    first = json.loads((tmp_path / "store.zarr" / HEARTBEAT_NAME).read_text())["at"]
    time.sleep(0.5)
    assert json.loads((tmp_path / "store.zarr" / HEARTBEAT_NAME).read_text())["at"] > first
    (tmp_path / "store.zarr" / LOCK_NAME).unlink()
    foreign_lock(url, seconds_ago=0)  # another writer broke the lock and took it
    time.sleep(0.5)
    with pytest.raises(StoreLockedError, match="was broken by another writer: this job stopped writing"):
        writer.write(0, sample_block(0, 4))
    writer.close()
    assert read_lock(as_location(url))["host"] == "gpu-node-7"  # the other writer's lock stays


def test_heartbeat_is_replaced_in_one_step_never_rewritten_in_place(tmp_path, monkeypatch):
    """A reader sees the previous beat or the next, never an empty or half-written file."""
    monkeypatch.setattr("orthosphere.store.lock.HEARTBEAT_SECONDS", 0.05)
    url = str(tmp_path / "store.zarr")
    writer = make_store(url)
    path = tmp_path / "store.zarr" / HEARTBEAT_NAME
    with open(path) as previous:
        first = previous.read()
        time.sleep(0.5)
        assert os.stat(path).st_ino != os.fstat(previous.fileno()).st_ino  # a new file renamed into place
        previous.seek(0)
        assert previous.read() == first
    assert json.loads(path.read_text())["at"] > json.loads(first)["at"]
    writer.close()


def test_heartbeat_that_cannot_check_the_lock_stops_the_writer_loudly(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr("orthosphere.store.lock.HEARTBEAT_SECONDS", 0.05)
    url = str(tmp_path / "store.zarr")
    writer = make_store(url)
    lock, copy = tmp_path / "store.zarr" / LOCK_NAME, tmp_path / "lock-copy"
    copy.write_text(lock.read_text())
    lock.unlink()
    lock.symlink_to(copy)  # the heartbeat refuses to read it: the writer must not go on as if it held the lock
    time.sleep(0.5)
    with pytest.raises(StoreLockedError, match=r"could not be checked \(.*is a symbolic link.*this job stopped writing"):
        writer.write(0, sample_block(0, 4))
    assert "this job stops writing" in caplog.text
    lock.unlink()
    lock.write_text(copy.read_text())
    writer.close()


@pytest.mark.parametrize("where", ["local", "memory"])
@pytest.mark.slow
def test_stale_lock_that_another_writer_broke_meanwhile_is_left_to_it(tmp_path, monkeypatch, where):
    """Two writers judge one lock stale: the one that breaks it second must not remove the first one's new lock."""
    url = str(tmp_path / "store.zarr") if where == "local" else f"memory://orthosphere-{uuid.uuid4().hex}/store.zarr"
    fill(make_store(url))
    foreign_lock(url, seconds_ago=STALE_SECONDS + 5)
    def judged_while_another_writer_takes_it(location, holder):
        reason = stale_reason(location, holder)
        foreign_lock(url, seconds_ago=0, token="newer")  # the other writer broke the stale lock and took it
        return reason

    monkeypatch.setattr("orthosphere.store.lock.stale_reason", judged_while_another_writer_takes_it)
    with pytest.raises(StoreLockedError, match="locked by another writer a moment ago; try again"):
        open_writer(url)
    assert read_lock(as_location(url))["token"] == "newer"


@pytest.mark.slow
def test_unreadable_lock_needs_break_lock(tmp_path):
    url = str(tmp_path / "store.zarr")
    fill(make_store(url))
    (tmp_path / "store.zarr" / LOCK_NAME).write_text("")  # a writer killed while taking the lock
    with pytest.raises(StoreLockedError, match="unreadable lock file.*pass break_lock=True if no writer is running"):
        open_writer(url)
    open_writer(url, break_lock=True).close()


@pytest.mark.slow
def test_lock_file_that_is_a_symbolic_link_is_never_written_through(tmp_path):
    url = str(tmp_path / "store.zarr")
    fill(make_store(url))
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    (tmp_path / "store.zarr" / LOCK_NAME).symlink_to(target)
    with pytest.raises(StoreLockedError, match="is a symbolic link: orthosphere never follows.*pass break_lock=True"):
        open_writer(url)
    with pytest.raises(StoreLockedError, match="is a symbolic link"):
        make_store(url, overwrite=True)
    open_writer(url, break_lock=True).close()
    assert target.read_text() == "keep me" and not (tmp_path / "store.zarr" / LOCK_NAME).exists()


@pytest.mark.slow
def test_overwrite_through_a_symlinked_store_replaces_the_target_and_keeps_the_link(tmp_path):
    target, link = tmp_path / "disk" / "store.zarr", tmp_path / "store.zarr"
    fill(make_store(str(target)))
    link.symlink_to(target, target_is_directory=True)
    writer = make_store(str(link), overwrite=True, n_samples=4)
    writer.close()
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert read_attrs(str(target))["n_samples"] == 4 and not (target / LOCK_NAME).exists()


class Killed(BaseException):
    """Stands for a SIGKILL: nothing after it runs, nothing catches it."""


@pytest.mark.slow
def test_overwrite_killed_at_any_instant_of_clearing_leaves_a_remnant_that_overwrite_replaces(tmp_path, monkeypatch):
    url = str(tmp_path / "store.zarr")
    location = as_location(url)
    remove_entry = Location.remove_entry
    for removals in range(100):
        writer = make_store(url, overwrite=True, sites=["q"], labels={}, with_weights=False, n_shards=1)
        writer.write(0, {"q": sample_block(0, N_SAMPLES)["q"]})
        writer.mark_shard_complete(0)
        writer.finish()
        calls = []

        def killed_after_some_removals(self, name, calls=calls, removals=removals):
            if len(calls) == removals:
                raise Killed
            calls.append(name)
            remove_entry(self, name)

        monkeypatch.setattr(Location, "remove_entry", killed_after_some_removals)
        try:
            make_store(url, overwrite=True).close()
            break  # clearing finished before the kill
        except Killed:
            pass
        finally:
            monkeypatch.undo()
        assert inspect(location).kind == REMNANT, f"killed after removing {calls}"
        with pytest.raises(StoreExistsError, match=r"creation or replacement was interrupted \(nothing in it can be resumed\)"):
            make_store(url)
    assert removals > 10
    fill(make_store(url, overwrite=True))
    assert read_attrs(url)["complete"]


@pytest.mark.parametrize("name", [LOCK_NAME, HEARTBEAT_NAME])
@pytest.mark.slow
def test_folder_holding_only_a_lock_taken_half_way_is_a_remnant(tmp_path, name):
    """A writer killed while taking a new store's lock leaves the lock written aside, never linked into place."""
    folder = tmp_path / "store.zarr"
    folder.mkdir()
    holder = {"host": socket.gethostname(), "pid": 2**22 + 1, "token": "dead"}
    (folder / f"{name}.{uuid.uuid4().hex}.partial").write_text(json.dumps(holder))
    assert inspect(as_location(str(folder))).kind == REMNANT
    with pytest.raises(StoreExistsError, match=r"creation or replacement was interrupted \(nothing in it can be resumed\)"):
        make_store(str(folder))
    fill(make_store(str(folder), overwrite=True))
    assert not [entry for entry in os.listdir(folder) if entry.endswith(".partial")]
    assert read_attrs(str(folder))["complete"]


def test_store_being_created_by_a_running_writer_is_said_to_be_so_not_interrupted(tmp_path):
    """A live writer's lock on a store whose progress record is not written yet: creation is under way, so a
    second job, validate and the readers say to wait for that writer, not to create the store afresh."""
    url = str(tmp_path / "store.zarr")
    make_store(url).close()
    shutil.rmtree(os.path.join(url, "_progress"))
    foreign_lock(url, seconds_ago=3)
    assert inspect(as_location(url)).kind == REMNANT
    running = r"by a running writer: pid 4242 on gpu-node-7.*wait for it to finish"
    with pytest.raises(StoreExistsError, match=rf"a store is being created at {re.escape(url)} now {running}") as refused:
        make_store(url)
    assert "interrupted" not in str(refused.value)
    for reading in (open_store, info, read_attrs):
        with pytest.raises(StoreError, match=rf"{re.escape(url)} is a store being created now {running}, then read it"):
            reading(url)
    assert re.search(running, validate(url)[0]) and "interrupted" not in validate(url)[0]
    foreign_lock(url, seconds_ago=STALE_SECONDS + 5)  # its writer died: the creation was interrupted after all
    with pytest.raises(StoreExistsError, match="creation or replacement was interrupted"):
        make_store(url)
    with pytest.raises(StoreError, match="creation or replacement was interrupted"):
        open_store(url)


def test_lock_files_written_aside_in_a_created_store_are_removed_when_its_writer_finishes(tmp_path):
    """A resume killed while taking the lock, or a writer killed while beating, leaves a copy
    written aside; the next writer removes them when it gives the lock back."""
    url = str(tmp_path / "store.zarr")
    make_store(url).close()
    holder = {"host": socket.gethostname(), "pid": 2**22 + 1, "token": "dead"}
    for name in (LOCK_NAME, HEARTBEAT_NAME):
        (tmp_path / "store.zarr" / f"{name}.{uuid.uuid4().hex}.partial").write_text(json.dumps(holder))
    fill(open_writer(url))
    assert not [entry for entry in os.listdir(tmp_path / "store.zarr") if entry.startswith(LOCK_NAME)]
    assert read_attrs(url)["complete"]


def test_finish_releases_the_lock(tmp_path):
    url = str(tmp_path / "store.zarr")
    fill(make_store(url))
    assert not (tmp_path / "store.zarr" / LOCK_NAME).exists()


# A job's mode ------------------------------------------------------------------------------

def job_store(url, mode, **overrides):
    """open_for_job in `mode` for make_store's store (changed by `overrides`), with its identity."""
    arguments = dict(model=MODEL, task=TASK, n_samples=N_SAMPLES, n_pos=N_POS, labels=LABELS, samples_per_chunk=2, n_shards=3)
    new = new_store(**{**arguments, **overrides})
    return open_for_job(as_location(url), mode, {key: new.attributes[key] for key in IDENTITY_KEYS}, new)


@pytest.mark.slow
def test_a_jobs_mode_decides_what_it_does_with_a_store(tmp_path):
    url = str(tmp_path / "store.zarr")
    opened = job_store(url, "new")
    assert (opened.outcome, opened.n_shards, opened.news) == (CREATED, 3, f"writing the store at {url}")
    opened.writer.close()
    with pytest.raises(StoreExistsError, match=r'already exists .* \(incomplete\): pass mode="resume"'):
        check_location(as_location(url), "new")
    with pytest.raises(StoreError, match=r"mode='continue': expected one of \['new', 'resume', 'overwrite'\]"):
        check_location(as_location(url), "continue")
    opened = job_store(url, "resume")
    assert opened.outcome == RESUMED and opened.writer.pending_shards() == [0, 1, 2]
    fill(opened.writer)
    opened = job_store(url, "resume")
    assert (opened.outcome, opened.writer, opened.n_shards) == (COMPLETE, None, 3)
    assert opened.news == f"store {url} is already complete: nothing to do"
    with pytest.raises(JobMismatchError, match=r"its n_pos is 5, this job's is 6; .* pass mode=\"overwrite\""):
        job_store(url, "resume", n_pos=6)
    opened = job_store(url, "overwrite", n_pos=6)
    assert opened.outcome == REPLACED and read_attrs(url)["n_pos"] == 6 and not read_attrs(url)["complete"]
    opened.writer.close()


@pytest.mark.slow
def test_a_jobs_mode_decides_what_it_does_with_a_remnant_a_damaged_store_and_a_foreign_folder(tmp_path):
    remnant = tmp_path / "remnant.zarr"
    remnant.mkdir()
    (remnant / f"{LOCK_NAME}.{uuid.uuid4().hex}.partial").write_text("{}")
    with pytest.raises(StoreExistsError, match=r"creation or replacement was interrupted .*: pass mode=\"resume\""):
        job_store(str(remnant), "new")
    opened = job_store(str(remnant), "resume")
    assert opened.outcome == RECREATED and "created it afresh" in opened.news
    fill(opened.writer)

    damaged = str(tmp_path / "damaged.zarr")
    fill(make_store(damaged))
    as_location(damaged).remove_entry("_progress")
    assert inspect(as_location(damaged)).kind == DAMAGED
    for mode in ("new", "resume"):
        with pytest.raises(StoreError, match=r"is a damaged orthosphere store.*with mode=\"overwrite\""):
            job_store(damaged, mode)
    fill(job_store(damaged, "overwrite").writer)
    assert read_attrs(damaged)["complete"]

    folder = tmp_path / "papers"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    for mode in ("new", "resume", "overwrite"):
        with pytest.raises(StoreError, match="not a Zarr store; refusing"):
            job_store(str(folder), mode)
    assert os.listdir(folder) == ["notes.txt"]


# Bad input -----------------------------------------------------------------------------

@pytest.mark.slow
def test_existing_store_is_not_overwritten_unless_asked(tmp_path):
    url = str(tmp_path / "store.zarr")
    fill(make_store(url))
    with pytest.raises(StoreExistsError, match='already exists.*mode="overwrite"'):
        make_store(url)
    writer = make_store(url, overwrite=True, n_samples=4)
    assert read_attrs(url)["n_samples"] == 4 and read_attrs(url)["complete"] is False
    writer.close()


def test_non_store_directory_is_never_overwritten(tmp_path):
    folder = tmp_path / "papers"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    with pytest.raises(StoreError, match="not a Zarr store; refusing"):
        make_store(str(folder), overwrite=True)
    assert (folder / "notes.txt").read_text() == "keep me"


def test_missing_path(tmp_path):
    with pytest.raises(StoreNotFoundError, match="does not exist"):
        open_store(str(tmp_path / "nowhere.zarr"))


def test_directory_that_is_not_zarr(tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(StoreError, match="is not a Zarr store"):
        open_store(str(tmp_path / "plain"))


def test_zarr_store_that_is_not_orthosphere(tmp_path):
    url = str(tmp_path / "foreign.zarr")
    zarr.open_group(url, mode="w", zarr_format=3).create_array("x", shape=(2,), dtype="f4")
    with pytest.raises(StoreError, match="not an orthosphere store"):
        open_store(url)
    assert "not an orthosphere store" in validate(url)[0]


def test_schema_attribute_that_is_not_a_version(tmp_path):
    url = str(tmp_path / "store.zarr")
    fill(make_store(url))
    zarr.open_group(url, mode="r+").attrs["schema"] = "1"
    with pytest.raises(StoreError, match="not a schema version"):
        open_store(url)


def test_newer_schema_version(tmp_path):
    url = str(tmp_path / "store.zarr")
    fill(make_store(url))
    zarr.open_group(url, mode="r+").attrs["schema"] = 2
    with pytest.raises(StoreError, match="schema version 2, newer.*upgrade orthosphere"):
        open_store(url)


def edit_root_attributes(url, edit):
    """Apply `edit` to the root attributes in the store's zarr.json, as damage or a hand edit would."""
    path = os.path.join(url, "zarr.json")
    with open(path) as handle:
        document = json.load(handle)
    edit(document["attributes"])
    with open(path, "w") as handle:
        json.dump(document, handle)


@pytest.mark.parametrize("edit, expected", [
    (lambda attrs: attrs.pop("sites"), "root attribute 'sites' is missing"),
    (lambda attrs: attrs.update(n_samples="sixty"), "root attribute 'n_samples' is 'sixty', expected a positive integer"),
    (lambda attrs: attrs.update(sites=[]), "root attribute 'sites' is [], expected a non-empty list of site names"),
    (lambda attrs: attrs.update(shards=[[0, 4], "x"]), "root attribute 'shards' is [[0, 4], 'x'], expected a non-empty list"),
    (lambda attrs: attrs.update(model={"n_layers": 3}), "root attribute 'model': model description lacks"),
], ids=["sites deleted", "n_samples a word", "no sites", "shards not ranges", "model without sizes"])
def test_root_attributes_of_the_wrong_type_or_missing_are_refused_as_damaged_root_metadata(tmp_path, edit, expected):
    """open_store, validate, info and read_attrs refuse a root attribute the schema promises that is missing or of
    the wrong type, naming it, rather than crash or go on."""
    url = str(tmp_path / "store.zarr")
    fill(make_store(url))
    edit_root_attributes(url, edit)
    message = rf"{re.escape(url)}: the store's root metadata \(zarr.json\) is damaged: {re.escape(expected)}.*replace the store"
    for reading in (open_store, info, read_attrs):
        with pytest.raises(StoreError, match=message):
            reading(url)
    assert len(validate(url)) == 1 and re.match(message, validate(url)[0])


def test_validate_reports_missing_variables_and_mismatched_shapes(tmp_path):
    url = str(tmp_path / "store.zarr")
    fill(make_store(url))
    group = zarr.open_group(url, mode="r+")
    del group["k"]
    del group["operand"]
    group.attrs["model"] = dict(MODEL, d_model=16)
    problems = validate(url)
    assert "variable 'k' is missing" in problems
    assert "label coordinate 'operand' is missing" in problems
    assert any("'resid_pre' has shape (11, 3, 5, 8), expected (11, 3, 5, 16)" in p for p in problems)


def test_validate_reports_wrong_dtype(tmp_path):
    url = str(tmp_path / "store.zarr")
    fill(make_store(url))
    group = zarr.open_group(url, mode="r+")
    del group["v"]
    group.create_array("v", shape=(11, 3, 5, 2, 2), dtype="float64", dimension_names=("sample", "layer", "pos", "kv_head", "d_head"))
    assert any("'v' has dtype float64, expected float32" in p for p in validate(url))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"sites": ["resid_pre", "attn_hidden"]}, r"unknown site\(s\) \['attn_hidden'\]: expected any of"),
        ({"n_samples": 0}, r"n_samples=0: expected a positive integer"),
        ({"n_pos": -1}, r"n_pos=-1: expected a positive integer"),
        ({"dtype": "float64"}, r"dtype 'float64' is not supported"),
        ({"layers": [0, 5]}, r"layer\(s\) \[5\] out of range: the model has 3 layers"),
        ({"labels": {"role": "float32"}}, r"label 'role' has dtype 'float32'"),
        ({"labels": {"tokens": "str"}}, r"label name 'tokens' clashes"),
        ({"model": {"n_layers": 2}}, r"model description lacks"),
        ({"model": dict(MODEL, n_kv_heads=3)}, r"not a multiple of n_kv_heads=3"),
        ({"codec": "gzip"}, r"codec 'gzip'"),
        ({"task": "arithmetic"}, r"task='arithmetic': expected a dict"),
    ],
)
def test_bad_create_arguments(tmp_path, overrides, message):
    with pytest.raises(StoreError, match=message):
        make_store(str(tmp_path / "store.zarr"), **overrides)
    assert not (tmp_path / "store.zarr").exists()


def test_bad_writes(tmp_path):
    writer = make_store(str(tmp_path / "store.zarr"))
    with pytest.raises(StoreError, match=r"'resid_pre' has shape \(4, 3, 5, 7\): expected \(4, 3, 5, 8\)"):
        writer.write(0, {"resid_pre": np.zeros((4, 3, 5, 7))})
    with pytest.raises(StoreError, match="no per-sample array 'pattern'"):
        writer.write(0, {"pattern": np.zeros((4, 3, 4, 5, 5))})
    with pytest.raises(StoreError, match="missing"):
        writer.write_weights({"w_q": np.zeros((3, 4, 8, 2))})
    writer.close()


# info ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_info_summary_and_text(tmp_path):
    url = str(tmp_path / "store.zarr")
    fill(make_store(url))
    summary = info(url)
    assert summary["complete"] and summary["shards_done"] == summary["shards_total"] == 3
    assert summary["arrays"]["q"]["shape"] == [11, 3, 5, 4, 2]
    assert summary["arrays"]["q"]["chunks"] == [2, 1, 5, 4, 2]
    assert summary["size_bytes"] > 11 * 3 * 5 * 8 * 4
    text = format_info(summary)
    assert "complete: 3/3 shards)" in text and "q           float32" in text and "labels    role, operand" in text
    assert summary["damaged_chunks"] == [] and "damage" not in text
    os.unlink(chunk_path(url, "k", (2, 0, 0, 0, 0)))  # the flag still says complete: the listing does not
    summary = info(url)
    assert summary["complete"] and summary["damaged_chunks"] == ["array 'k' chunk (2, 0, 0, 0, 0) (samples 4-5, layer 0): missing"]
    text = format_info(summary)
    assert "complete: 3/3 shards, DAMAGED)" in text
    assert "damage    1 chunk(s) missing, of the wrong size or not files, e.g. array 'k' chunk (2, 0, 0, 0, 0)" in text


@pytest.mark.parametrize("score,message", [
    ({"scale": [0.5]}, "expected a dict with keys"),
    ({"scale": [0.5], "sliding_window": [None, 4], "softcap": [None, None], "alibi_slopes": None},
     r"score.scale=\[0.5\]: expected a list of one entry per layer \(2\)"),
    ({"scale": [0.5, 0.5], "sliding_window": [None, 4], "softcap": [None, None], "alibi_slopes": [[0.5], [0.5]]},
     "expected 4 slopes"),
])
def test_malformed_score_terms_are_refused(score, message):
    from orthosphere.store.schema import check_model

    model = {"n_layers": 2, "d_model": 16, "n_heads": 4, "n_kv_heads": 4, "d_head": 4, "score": score}
    with pytest.raises(StoreError, match=message):
        check_model(model)
    good = {"scale": [0.5, 0.5], "sliding_window": [None, 4], "softcap": [None, 30.0], "alibi_slopes": None}
    assert check_model({**model, "score": good})["score"] == good

# Damaged chunks ------------------------------------------------------------------------

def chunk_path(url, array, coords):
    return os.path.join(url, array, "c", *map(str, coords))


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
@pytest.mark.slow
def test_missing_or_truncated_chunk_is_reported_on_open_with_its_array_and_chunk(tmp_path, damage):
    url = str(tmp_path / "store.zarr")
    fill(make_store(url))
    path = chunk_path(url, "q", (1, 2, 0, 0, 0))
    if damage == "deleted":
        os.unlink(path)
    else:
        with open(path, "r+b") as handle:
            handle.truncate(10)
    problem = "missing" if damage == "deleted" else r"has 10 bytes, expected 324 \(truncated or overwritten\)"
    expected = rf"array 'q' chunk \(1, 2, 0, 0, 0\) \(samples 2-3, layer 2\): {problem}"
    with pytest.raises(DamagedStoreError, match=rf'store {url} is damaged \(1 chunk\): {expected}.*resume the job that wrote it \(mode="resume"\)'):
        open_store(url)
    assert len(validate(url)) == 1 and re.fullmatch(expected, validate(url)[0])
    lazy = open_store(url, check_chunks=False)
    with pytest.raises(DamagedStoreError, match=expected):  # never read as zeros
        lazy.q.isel(sample=slice(2, 4)).load()


def test_directory_where_a_chunk_file_should_be_is_named_and_resume_says_to_remove_it(tmp_path):
    """A directory in a chunk's place is no missing chunk: validate names it, and resume, which cannot write
    over it, says to remove it (and gives the lock back) rather than fail on IsADirectoryError every time."""
    url = str(tmp_path / "store.zarr")
    fill(make_store(url))
    path = chunk_path(url, "q", (1, 2, 0, 0, 0))
    os.unlink(path)
    os.makedirs(os.path.join(path, "stray"))
    expected = "array 'q' chunk (1, 2, 0, 0, 0) (samples 2-3, layer 2): a directory where the chunk file should be: remove it"
    assert validate(url) == [expected]
    with pytest.raises(DamagedStoreError, match=re.escape(expected)):
        open_store(url)
    with pytest.raises(StoreError, match=rf"store {re.escape(url)} cannot be resumed: 1 chunk path\(s\) inside it hold a directory "
                                         r"where the chunk file should be \(q/c/1/2/0/0/0\): remove them, then resume"):
        job_store(url, "resume")
    assert not os.path.exists(os.path.join(url, LOCK_NAME))
    shutil.rmtree(path)
    resumed = job_store(url, "resume").writer
    assert resumed.pending_shards() == [0]
    fill(resumed, order=resumed.pending_shards())
    assert validate(url, full=True) == []


def test_symbolic_link_where_a_chunk_file_should_be_is_named_and_never_written_through(tmp_path):
    """A chunk file that is a link is named as one (not as truncated), and resume replaces the link by the
    chunk, leaving the file it pointed to, outside the store, as it was; so does a streamed write."""
    from orthosphere.store.stream import _write_at

    url = str(tmp_path / "store.zarr")
    fill(make_store(url))
    path = chunk_path(url, "q", (1, 2, 0, 0, 0))
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not a chunk")
    os.unlink(path)
    os.symlink(outside, path)
    expected = ("array 'q' chunk (1, 2, 0, 0, 0) (samples 2-3, layer 2): a symbolic link where a chunk file should be: replace "
                "it with the file it points to, or remove it")
    assert validate(url) == [expected]
    with pytest.raises(DamagedStoreError, match=re.escape(expected)):
        open_store(url)
    resumed = job_store(url, "resume").writer
    assert resumed.pending_shards() == [0]
    fill(resumed, order=resumed.pending_shards())
    assert validate(url, full=True) == [] and not os.path.islink(path)
    assert outside.read_bytes() == b"not a chunk"
    os.unlink(path)
    os.symlink(outside, path)
    _write_at(path, np.zeros(8, np.uint8), 0, truncate=True)
    assert not os.path.islink(path) and outside.read_bytes() == b"not a chunk"


@pytest.mark.slow
def test_overwritten_chunk_fails_its_checksum_when_read_and_in_full_validation(tmp_path):
    url = str(tmp_path / "store.zarr")
    fill(make_store(url))
    path = chunk_path(url, "resid_pre", (4, 0, 0, 0))
    size = os.path.getsize(path)
    with open(path, "wb") as handle:
        handle.write(np.random.default_rng(0).bytes(size))
    expected = r"array 'resid_pre' chunk \(4, 0, 0, 0\) \(samples 8-9, layer 0\): fails its CRC-32C checksum"
    dataset = open_store(url)  # the fast check sees every chunk there, of its size
    assert validate(url) == []
    with pytest.raises(DamagedStoreError, match=expected):
        dataset.resid_pre.sum().compute()
    restored = pickle.loads(pickle.dumps(dataset))  # as Dask ships it to workers
    with pytest.raises(DamagedStoreError, match=expected):
        restored.resid_pre.load()
    problems = validate(url, full=True)
    assert len(problems) == 1 and re.match(expected, problems[0])


def test_only_complete_shards_promise_their_chunks(tmp_path):
    url = str(tmp_path / "store.zarr")
    writer = make_store(url)
    start, stop = writer.shards[1]
    writer.write(start, sample_block(start, stop))
    writer.mark_shard_complete(1)
    writer.close()
    partial = open_store(url, allow_incomplete=True)
    assert list(partial.sample.values) == list(range(start, stop))  # shards 0 and 2 never written: left out, not zeros
    os.unlink(chunk_path(url, "k", (2, 0, 0, 0, 0)))
    with pytest.raises(DamagedStoreError, match=r"array 'k' chunk \(2, 0, 0, 0, 0\) \(samples 4-5, layer 0\): missing"):
        open_store(url, allow_incomplete=True)


def test_arrays_not_written_in_a_shard_are_filled_when_it_completes(tmp_path):
    url = str(tmp_path / "store.zarr")
    fill(make_store(url))  # writes resid_pre, q, k and two labels; never resid_mid, v, pred, ...
    dataset = open_store(url)
    assert float(abs(dataset.v).sum()) == 0 and int(abs(dataset.pred).sum()) == 0
    assert os.path.exists(chunk_path(url, "v", (5, 2, 0, 0, 0)))
    assert validate(url, full=True) == []
