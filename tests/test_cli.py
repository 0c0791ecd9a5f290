"""The command line: help for every verb, `info`, `validate`, the Dask back-end options, and every
bad input as one clear line."""
import json
import os
import re
import shutil
import uuid

import pytest
from click.testing import CliRunner

from orthosphere.store import IncompleteStoreError, open_store
from orthosphere.store.location import as_location
from orthosphere.store.lock import LOCK_NAME, STALE_SECONDS
from orthosphere.workflows.cli import layer_list, main
from tests.test_extract_models import write_arithmetic_model, write_hf_model
from tests.test_store import edit_root_attributes, fill, foreign_lock, make_store, sample_block


@pytest.fixture
def store(tmp_path):
    url = str(tmp_path / "store.zarr")
    fill(make_store(url))
    return url


def test_every_verb_has_help():
    runner = CliRunner()
    result = runner.invoke(main, ["--help"])
    assert result.exit_code == 0
    for name, command in main.commands.items():
        verb_help = runner.invoke(main, [name, "--help"])
        assert verb_help.exit_code == 0, name
        assert command.help and command.help.split()[0] in verb_help.output


def test_info_text(store):
    result = CliRunner().invoke(main, ["info", store])
    assert result.exit_code == 0, result.output
    assert "complete: 3/3 shards" in result.output
    assert "resid_pre   float32  (sample, layer, pos, d_model) = (11, 3, 5, 8)" in result.output


def test_info_json(store):
    result = CliRunner().invoke(main, ["info", store, "--json"])
    summary = json.loads(result.output)
    assert summary["n_samples"] == 11 and summary["complete"] is True
    assert summary["arrays"]["k"]["dims"] == ["sample", "layer", "pos", "kv_head", "d_head"]


def test_info_on_missing_store_is_one_clear_line(tmp_path):
    result = CliRunner().invoke(main, ["info", str(tmp_path / "missing.zarr")])
    assert result.exit_code == 1
    assert result.output.startswith("Error: no store at") and "Traceback" not in result.output


def test_info_on_a_store_without_its_sites_attribute_is_one_clear_line(store):
    """A root attribute deleted from zarr.json is named as damaged root metadata, not an unexpected ZeroDivisionError."""
    edit_root_attributes(store, lambda attrs: attrs.pop("sites"))
    expected = f"{store}: the store's root metadata (zarr.json) is damaged: root attribute 'sites' is missing"
    line = error_line(run("info", store))
    assert line.startswith(f"Error: {expected}") and "`orthosphere extract ... --overwrite`" in line, line
    checked = run("validate", store)
    assert checked.output.startswith(expected) and error_line(checked) == f"Error: store {store} has 1 problem(s), listed above"


def test_workers_and_scheduler_are_exclusive(store):
    result = CliRunner().invoke(main, ["--workers", "2", "--scheduler", "tcp://127.0.0.1:1", "info", store])
    assert result.exit_code == 2 and "not both" in result.output


def test_layers_parse_and_bad_layers_are_one_line(store):
    assert layer_list(None, None, "0,2,5-7") == (0, 2, 5, 6, 7)
    for text, detail in [("0,x", "'x' is not a layer index or range"), ("5-3", "the range '5-3' runs backwards"), (",", "no layers given")]:
        result = CliRunner().invoke(main, ["analyze", store, "--out", "unused.zarr", "--layers", text])
        assert result.exit_code == 2 and f"Invalid value for '--layers': '{text}': {detail}" in result.output


# Every bad input: one line naming the input, no traceback (only with -v), nothing lost ----------

def run(*arguments):
    return CliRunner().invoke(main, [str(argument) for argument in arguments])


def error_line(result) -> str:
    """The one line of the error (exit status 1, no traceback)."""
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(lines) == 1, result.output
    return lines[0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_arithmetic_model(tmp_path_factory.mktemp("cli") / "model")


def extract_arguments(model, out, *more):
    return ["extract", model, "--task", "arithmetic:split=test,seed=3", "--device", "cpu", "--out", out, *more]


@pytest.mark.parametrize("where, expected", [
    ("local", "has {free} free; ask for fewer samples"),
    ("memory", "but a memory:// store lives in this process's memory, which has {free} free; ask for fewer samples"),
    ("s3", "the store's sample coordinate, which every reader loads into memory, would need 8.0 TB (8 bytes a sample) "
           "but this machine has {free} of memory available; ask for fewer samples"),
])
def test_absurd_sample_count_is_refused_before_anything_is_written(tmp_path, request, model_dir, where, expected):
    if where == "local":
        out = str(tmp_path / "store.zarr")
    elif where == "memory":
        out = f"memory://orthosphere-{uuid.uuid4().hex}/store.zarr"
    else:
        out = f"{request.getfixturevalue('s3_bucket')}/runs/store.zarr"
    line = error_line(run(*extract_arguments(model_dir, out, "--samples", 10**12)))
    assert line.startswith("Error: --samples=1000000000000: the store")  # the library names n_samples=, the CLI its flag
    assert re.search(re.escape(expected).replace(re.escape("{free}"), r"[\d,.]+ [kMGTP]?B"), line), line
    assert not as_location(out).exists()


@pytest.mark.parametrize("option", ["--samples", "--samples-per-chunk", "--batch-size", "--shards"])
def test_counts_that_are_not_positive(tmp_path, model_dir, option):
    arguments = extract_arguments(model_dir, tmp_path / "store.zarr", option, 0)
    if option != "--samples":
        arguments += ["--samples", 8]
    optional = ", or none" if option in ("--samples", "--samples-per-chunk") else ""
    assert error_line(run(*arguments)) == f"Error: {option}=0: expected a positive integer{optional}"
    assert not (tmp_path / "store.zarr").exists()


def test_truncated_weights(tmp_path, model_dir):
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    line = error_line(run(*extract_arguments(model, tmp_path / "store.zarr", "--samples", 8)))
    assert f"weights file {weights} cannot be read (" in line and "truncated, damaged or not a safetensors file" in line
    assert not (tmp_path / "store.zarr").exists()


@pytest.mark.slow
def test_binary_text_input(tmp_path):
    model = write_hf_model(tmp_path / "llama", "llama")
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"the cat sat\n\x89PNG\r\n\x1a\n\x00\xff binary\n")
    result = run("extract", model, "--task", f"text:path={corpus}", "--device", "cpu", "--out", tmp_path / "s.zarr")
    assert error_line(result) == (f"Error: {corpus}, line 2: invalid UTF-8 (invalid start byte at byte 0 of the line): "
                                  "expected UTF-8 text; convert the file to UTF-8 (e.g. iconv -t UTF-8)")


def test_option_value_that_does_not_parse(store, tmp_path):
    result = run("analyze", store, "--out", tmp_path / "results.zarr", "--option", "replay.levels=abc")
    assert error_line(result) == ("Error: option replay.levels='abc': expected a number strictly between 0 and 1, or a "
                                  "non-empty list of strictly increasing items, each a number strictly between 0 and 1, "
                                  "RMS noise levels (0.01 is 1 % noise), e.g. replay.levels=[0.01,0.1]")
    assert not (tmp_path / "results.zarr").exists()


def test_analysing_a_store_with_a_deleted_chunk(store, tmp_path):
    os.unlink(os.path.join(store, "q", "c", "2", "1", "0", "0", "0"))
    line = error_line(run("analyze", store, "--out", tmp_path / "results.zarr", "--only", "norms"))
    assert line.startswith(f"Error: store {store} is damaged (1 chunk): array 'q' chunk (2, 1, 0, 0, 0) "
                           "(samples 4-5, layer 1): missing. To repair it, resume the job that wrote it")


def test_an_incomplete_store_is_refused_with_advice_a_command_line_user_can_follow(tmp_path):
    writer = make_store(str(tmp_path / "store.zarr"))
    writer.write(0, sample_block(*writer.shards[0]))
    writer.mark_shard_complete(0)
    writer.close()
    line = error_line(run("analyze", tmp_path / "store.zarr", "--out", tmp_path / "results.zarr", "--only", "norms"))
    assert line == (f"Error: store {tmp_path / 'store.zarr'} is incomplete: 2 of 3 shards are missing; resume the job that "
                    "wrote it (`orthosphere extract ... --resume`), or read what is there from Python with "
                    "open_store(url, allow_incomplete=True)")


@pytest.mark.slow
def test_analysing_a_store_with_an_overwritten_chunk(store, tmp_path):
    path = os.path.join(store, "k", "c", "0", "2", "0", "0", "0")
    with open(path, "r+b") as handle:
        handle.write(b"\x00" * 8)
    line = error_line(run("analyze", store, "--out", tmp_path / "results.zarr", "--only", "norms"))
    assert ("array 'k' chunk (0, 2, 0, 0, 0) (samples 0-1, layer 2): fails its CRC-32C checksum (overwritten or "
            f"corrupted). To repair it, `orthosphere validate {store} --full --reopen`") in line


@pytest.mark.slow
def test_validate_lists_damage_and_reopens_its_shards(store):
    assert run("validate", store).output.strip() == f"store {store} is valid: every chunk is there"
    os.unlink(os.path.join(store, "resid_pre", "c", "5", "0", "0", "0"))
    with open(os.path.join(store, "v", "c", "1", "0", "0", "0", "0"), "r+b") as handle:
        handle.write(b"\x01" * 4)
    fast = run("validate", store)
    assert fast.output.splitlines()[0] == "array 'resid_pre' chunk (5, 0, 0, 0) (sample 10, layer 0): missing"
    assert error_line(fast) == f"Error: store {store} has 1 problem(s), listed above"
    full = run("validate", store, "--full")
    assert "array 'v' chunk (1, 0, 0, 0, 0) (samples 2-3, layer 0): fails its CRC-32C checksum" in full.output
    assert error_line(full) == f"Error: store {store} has 2 problem(s), listed above"
    reopened = run("validate", store, "--full", "--reopen")
    assert reopened.exit_code == 0 and "reopened shard(s) [0, 2]: resume the job" in reopened.output
    with pytest.raises(IncompleteStoreError, match="2 of 3 shards are missing"):
        open_store(store)


def test_break_lock(tmp_path, model_dir):
    out = tmp_path / "store.zarr"
    assert run(*extract_arguments(model_dir, out, "--samples", 8)).exit_code == 0
    foreign_lock(str(out), seconds_ago=3)
    line = error_line(run(*extract_arguments(model_dir, out, "--samples", 8, "--resume")))
    assert "is locked by a running writer: pid 4242 on gpu-node-7" in line and "pass --break-lock" in line
    result = run(*extract_arguments(model_dir, out, "--samples", 8, "--resume", "--break-lock"))
    assert result.exit_code == 0 and "already complete (8 samples): nothing to do" in result.output
    assert not (out / LOCK_NAME).exists()


def test_a_second_extract_without_resume_is_told_the_store_is_being_written(tmp_path, model_dir):
    out = tmp_path / "store.zarr"
    assert run(*extract_arguments(model_dir, out, "--samples", 8)).exit_code == 0
    foreign_lock(str(out), seconds_ago=3)
    line = error_line(run(*extract_arguments(model_dir, out, "--samples", 8)))
    assert "is being written at" in line and "by a running writer: pid 4242 on gpu-node-7" in line
    assert "wait for it to finish" in line and "--resume" in line and "pass --resume to continue" not in line
    foreign_lock(str(out), seconds_ago=STALE_SECONDS + 5)  # its writer died: resuming is the advice again
    line = error_line(run(*extract_arguments(model_dir, out, "--samples", 8)))
    assert "a store already exists at" in line and "--resume" in line


@pytest.mark.slow
def test_run_breaks_the_lock_of_a_pipeline_store_with_break_lock(tmp_path, model_dir):
    config = tmp_path / "pipeline.toml"
    config.write_text(f"""
name = "locked"
root = "{tmp_path / 'out'}"
[models.tiny]
path = "{model_dir}"
[data.test]
task = "arithmetic:split=test,seed=3"
samples = 8
[extract]
device = "cpu"
[analyze]
only = ["norms"]
""")
    store = tmp_path / "out" / "stores" / "tiny-test.zarr"
    foreign_lock(str(store), seconds_ago=3)  # a job on another host that looks alive
    line = error_line(run("run", config))
    assert "is locked by a running writer: pid 4242 on gpu-node-7" in line and "pass --break-lock" in line
    result = run("run", config, "--break-lock")
    assert result.exit_code == 0, result.output
    assert open_store(str(store)).attrs["complete"] and not (store / LOCK_NAME).exists()


def test_unexpected_errors_are_one_line_and_traceback_with_verbose(store, monkeypatch):
    def broken(url):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr("orthosphere.workflows.cli.info", broken)
    assert error_line(run("info", store)) == ("Error: unexpected RuntimeError: boom second line (run with -v for the "
                                              "traceback; please report it)")
    verbose = run("-v", "info", store)
    assert verbose.exit_code == 1 and isinstance(verbose.exception, RuntimeError)


def test_workers_running_other_orthosphere_code_are_refused(tmp_path, monkeypatch):
    """A cluster's workers must run this process's orthosphere: results and stores carry its provenance. Workers
    on the same code pass; others (another fingerprint) are refused, named, with what to do."""
    from distributed import LocalCluster

    from orthosphere.errors import ClusterError
    from orthosphere.store import provenance
    from orthosphere.workflows.backend import Backend, check_worker_code, dask_client

    with LocalCluster(n_workers=2, processes=False, dashboard_address=None) as cluster:
        address = cluster.scheduler_address
        with dask_client(Backend(scheduler=address)) as client:
            assert len(client.scheduler_info()["workers"]) == 2  # same code: accepted
            with pytest.raises(ClusterError, match=rf"2 of the 2 Dask workers at {re.escape(address)} \(.*\) run other orthosphere "
                                                   r"code than this process \(source fingerprint \w{12} there, 0{12} here\).*"
                                                   "install the same orthosphere on them"):
                check_worker_code(client, address, expected="0" * 64)
    package = tmp_path / "fingerprinted"
    package.mkdir()
    (package / "__init__.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(provenance, "PACKAGES", ("fingerprinted",))
    before = provenance.code_fingerprint()
    assert provenance.code_fingerprint() == before
    (package / "__init__.py").write_text("VALUE = 2\n")  # an edit not committed
    assert provenance.code_fingerprint() != before
