"""Crash safety: SIGKILL an extraction at several points, resume it, get a bitwise identical store.

Each run is the real CLI in a subprocess. ORTHOSPHERE_CRASH_AT makes the process SIGKILL
itself at a named point of the job (see orthosphere.extract.job). One store is killed four
times, each kill during the resume of the previous one: right after the store is created,
in the middle of a shard, after a shard is recorded complete, and after every shard is
complete but before the store is finished. The last resume must give the same bytes as an
uninterrupted run, and a further resume must do nothing.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
import zarr

from orthosphere.store import DamagedStoreError, StoreError, open_store, read_attrs
from tests.test_extract_models import write_arithmetic_model

N_SAMPLES, SAMPLES_PER_CHUNK, N_SHARDS = 30, 4, 4  # shards of 8, 8, 8 and 6 samples
CLI = os.path.join(os.path.dirname(sys.executable), "orthosphere")


def run_cli(model, out, crash_at=None, resume=False, extra=()):
    arguments = [CLI, "extract", str(model),
                 "--task", "arithmetic:split=test,seed=2", "--samples", str(N_SAMPLES), "--out", str(out),
                 "--samples-per-chunk", str(SAMPLES_PER_CHUNK), "--shards", str(N_SHARDS),
                 "--batch-size", "3", "--device", "cpu"]
    if resume:
        arguments.append("--resume")
    arguments.extend(extra)
    environment = {key: value for key, value in os.environ.items() if key != "ORTHOSPHERE_CRASH_AT"}
    if crash_at:
        environment["ORTHOSPHERE_CRASH_AT"] = crash_at
    return subprocess.run(arguments, env=environment, capture_output=True, text=True, timeout=300)


def arrays_of(url) -> dict[str, np.ndarray]:
    store = open_store(str(url)).load()
    return {name: store[name].values for name in store.variables}


def shards_complete(url) -> list[bool]:
    return zarr.open_group(str(url), mode="r")["_progress/shard_complete"][:].tolist()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_arithmetic_model(tmp_path_factory.mktemp("crash") / "model")


@pytest.fixture(scope="module")
def uninterrupted(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "store.zarr"
    result = run_cli(model_dir, out)
    assert result.returncode == 0, result.stderr
    return arrays_of(out)


CRASHES = [  # (where the run kills itself, which shards are complete afterwards)
    ("store-created", [False, False, False, False]),
    ("chunk-written:3", [True, False, False, False]),  # mid-way through the second shard
    ("shard-complete:2", [True, True, True, False]),  # the second shard this run completes
    ("before-finish", [True, True, True, True]),  # every shard written, the store not finished
]


@pytest.mark.slow
def test_killed_extraction_resumes_to_a_bitwise_identical_store(tmp_path, model_dir, uninterrupted):
    out = tmp_path / "store.zarr"
    for attempt, (point, complete_after) in enumerate(CRASHES):
        result = run_cli(model_dir, out, crash_at=point, resume=attempt > 0)
        assert result.returncode == -signal.SIGKILL, f"expected a SIGKILL at {point}: {result.stderr[-2000:]}"
        assert not read_attrs(str(out))["complete"]
        assert shards_complete(out) == complete_after, point
    resumed = run_cli(model_dir, out, resume=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "complete: 30 samples; ran 0 of 4 shards" in resumed.stdout and "breaking the stale lock" in resumed.stderr
    assert read_attrs(str(out))["complete"]
    assert_identical(out, uninterrupted)
    again = run_cli(model_dir, out, resume=True)
    assert again.returncode == 0 and "already complete (30 samples): nothing to do" in again.stdout


def assert_identical(url, uninterrupted):
    result = arrays_of(url)
    assert result.keys() == uninterrupted.keys()
    for name, values in uninterrupted.items():
        np.testing.assert_array_equal(result[name], values, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["lock-written-aside", "root-written", "array-created:5", "finish-consolidated", "finished"])
def test_kill_while_the_store_is_created_or_finished_resumes_with_one_resume(tmp_path, model_dir, uninterrupted, point):
    out = tmp_path / "store.zarr"
    killed = run_cli(model_dir, out, crash_at=point)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    if point == "finished":  # complete, only its lock left behind
        open_store(str(out))
    else:
        with pytest.raises(StoreError):  # never readable as a finished store
            open_store(str(out))
    resumed = run_cli(model_dir, out, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_identical(out, uninterrupted)


@pytest.mark.slow
@pytest.mark.parametrize("point, recovery", [
    ("cleared", "--overwrite"),  # the old store emptied
    ("clearing:1", "--resume"),  # its first entry removed: chunks and metadata of the old store remain
    ("clearing:7", "--overwrite"),
])
def test_kill_while_overwriting_leaves_a_store_that_overwrite_or_resume_replaces(tmp_path, model_dir, uninterrupted,
                                                                                point, recovery):
    out = tmp_path / "store.zarr"
    assert run_cli(model_dir, out).returncode == 0
    killed = run_cli(model_dir, out, crash_at=point, extra=["--overwrite"])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    refused = run_cli(model_dir, out)
    assert refused.returncode == 1
    assert "creation or replacement was interrupted (nothing in it can be resumed): pass --resume" in refused.stderr
    again = run_cli(model_dir, out, extra=[recovery])
    assert again.returncode == 0, again.stderr[-2000:]
    assert_identical(out, uninterrupted)


@pytest.mark.slow
def test_remnant_of_an_older_version_is_replaced(tmp_path, model_dir, uninterrupted):
    """The state the first version left when killed mid-creation: a root group without attributes,
    its lock, some empty arrays."""
    out = tmp_path / "store.zarr"
    group = zarr.open_group(str(out), mode="w", zarr_format=3)
    group.create_array("tokens", shape=(N_SAMPLES, 4), dtype="int32")
    (out / ".orthosphere-lock").write_text(json.dumps({"host": socket.gethostname(), "pid": 2**22 + 1}))
    resumed = run_cli(model_dir, out, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_identical(out, uninterrupted)


@pytest.mark.slow
def test_resume_rewrites_a_deleted_chunk_of_a_complete_store(tmp_path, model_dir, uninterrupted):
    out = tmp_path / "store.zarr"
    assert run_cli(model_dir, out).returncode == 0
    os.unlink(out / "k" / "c" / "3" / "1" / "0" / "0" / "0")  # samples 12-15: shard 1
    with pytest.raises(DamagedStoreError, match=r"array 'k' chunk \(3, 1, 0, 0, 0\) \(samples 12-15, layer 1\): missing"):
        open_store(str(out))
    resumed = run_cli(model_dir, out, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "rewriting shard(s) [1]" in resumed.stderr and "ran 1 of 4 shards" in resumed.stdout
    assert_identical(out, uninterrupted)


@pytest.mark.slow
@pytest.mark.parametrize("lost", ["folder", "metadata"])
def test_resume_restores_an_array_whose_folder_or_metadata_was_deleted(tmp_path, model_dir, uninterrupted, lost):
    """The root's consolidated metadata still describes the array: resume writes its zarr.json back from
    it (and its chunks, where they went with the folder), and validate says how before."""
    from orthosphere.store import validate

    out = tmp_path / "store.zarr"
    assert run_cli(model_dir, out).returncode == 0
    if lost == "folder":
        shutil.rmtree(out / "q")
    else:
        os.unlink(out / "v" / "zarr.json")
    name = "q" if lost == "folder" else "v"
    assert validate(str(out)) == [f"variable {name!r} is missing: its metadata ({name}/zarr.json) is gone, but the store's "
                                  "consolidated metadata still describes it; resume the job that made the store (`orthosphere "
                                  "extract ... --resume`) to restore it and rewrite any chunk it lost"]
    resumed = run_cli(model_dir, out, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"the metadata of array(s) ['{name}'] was missing; restored" in resumed.stderr
    assert ("rewriting shard(s) [0, 1, 2, 3]" in resumed.stderr) == (lost == "folder")
    assert validate(str(out)) == []
    assert_identical(out, uninterrupted)


@pytest.mark.slow
def test_a_truncated_string_chunk_is_found_without_full_validation_and_resume_rewrites_it(tmp_path, model_dir, uninterrupted):
    """String labels (role) have no fixed chunk size: their chunks are decoded by every damage check."""
    from orthosphere.store import validate

    out = tmp_path / "store.zarr"
    assert run_cli(model_dir, out).returncode == 0
    chunk = out / "role" / "c" / "1" / "0"
    chunk.write_bytes(chunk.read_bytes()[:-40])
    assert [problem.split(" (")[0] for problem in validate(str(out))] == ["array 'role' chunk"]
    assert "does not decode" in validate(str(out))[0]
    resumed = run_cli(model_dir, out, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "array 'role' chunk (1, 0)" in resumed.stderr and "rewriting shard(s) [" in resumed.stderr
    assert_identical(out, uninterrupted)
