"""Crash safety: SIGKILL an extraction at several points, resume it, get a bitwise identical store.

Each run is the real CLI in a subprocess. ORTHOSPHERE_CRASH_AT makes the process SIGKILL
itself at a named point of the job (see orthosphere.extract.job). One store is killed four
times, each kill during the resume of the previous one: right after the store is created,
in the middle of a shard, after a shard is recorded complete, and after every shard is
complete but before the store is finished. The last resume must give the same bytes as an
uninterrupted run, and a further resume must do nothing.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import zarr

from orthosphere.store import open_store, read_attrs
from tests.test_extract_models import write_arithmetic_model

N_SAMPLES, SAMPLES_PER_CHUNK, N_SHARDS = 30, 4, 4  # shards of 8, 8, 8 and 6 samples
CLI = os.path.join(os.path.dirname(sys.executable), "orthosphere")


def run_cli(model, out, crash_at=None, resume=False):
    arguments = [CLI, "extract", str(model),
                 "--task", "arithmetic:split=test,seed=2", "--samples", str(N_SAMPLES), "--out", str(out),
                 "--samples-per-chunk", str(SAMPLES_PER_CHUNK), "--shards", str(N_SHARDS),
                 "--batch-size", "3", "--device", "cpu"]
    if resume:
        arguments.append("--resume")
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
    result = arrays_of(out)
    assert result.keys() == uninterrupted.keys()
    for name, values in uninterrupted.items():
        np.testing.assert_array_equal(result[name], values, err_msg=name)
    again = run_cli(model_dir, out, resume=True)
    assert again.returncode == 0 and "already complete (30 samples): nothing to do" in again.stdout
