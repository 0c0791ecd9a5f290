"""The extraction job: task specs, text data, shards on Dask, resuming, the write queue, bad input."""
from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from orthosphere.errors import ConfigError, JobMismatchError
from orthosphere.extract import tasks
from orthosphere.extract.data import ArithmeticData, CorpusData, parse_task
from orthosphere.extract.job import ExtractJob, run_job
from orthosphere.extract.shards import WriteBehind
from orthosphere.store import StoreExistsError, open_store, read_attrs
from orthosphere.store.lifecycle import chunk_samples
from orthosphere.workflows.cli import main
from tests.test_extract_models import write_arithmetic_model, write_hf_model, write_text


@pytest.fixture(scope="module")
def arithmetic_dir(tmp_path_factory):
    return write_arithmetic_model(tmp_path_factory.mktemp("models") / "arithmetic")


def job(model, out, **options) -> ExtractJob:
    options = {"task": "arithmetic:split=test,seed=1", "n_samples": 10, "batch_size": 3, "device": "cpu", **options}
    return ExtractJob(model=str(model), out=str(out), **options)


def arrays_of(url) -> dict[str, np.ndarray]:
    store = open_store(str(url)).load()
    return {name: store[name].values for name in store.variables}


def assert_same_arrays(left: dict, right: dict):
    assert left.keys() == right.keys()
    for name in left:
        np.testing.assert_array_equal(left[name], right[name], err_msg=name)


# --- task specs ----------------------------------------------------------------------------------


def test_task_specs_parse():
    assert parse_task("arithmetic") == ArithmeticData("test", 0, tasks.DEFAULT_SPEC)
    parsed = parse_task("arithmetic:split=extrapolation,seed=7,digit_lengths=1/2/3,extrapolation_counts=8/9")
    assert (parsed.split, parsed.seed) == ("extrapolation", 7)
    assert parsed.spec.digit_lengths == (1, 2, 3) and parsed.spec.extrapolation_counts == (8, 9)
    assert parse_task("text:path=lines.txt,max_length=16") == CorpusData("text", "lines.txt", length=16)
    assert parse_task("jsonl:path=c.jsonl,field=body,context=64,bos=false") == CorpusData(
        "jsonl", "c.jsonl", column="body", layout="packed", length=64, bos=False)


@pytest.mark.parametrize("spec,detail", [
    ("images:path=x", "unknown task 'images'"),
    ("arithmetic:split=holdout", "unknown split 'holdout'"),
    ("arithmetic:seed=one", "seed='one' is not an integer"),
    ("arithmetic:split", "at 'split': expected key=value pairs"),
    ("arithmetic:seed=1,seed=2", "each key once"),
    ("arithmetic:colour=red", r"unknown arithmetic option\(s\) \['colour'\]"),
    ("arithmetic:interpolation_counts=3", "interpolation_counts"),
    ("text:max_length=9", "text needs path="),
    ("text:path=a.txt,max_length=0", "max_length=0 is too short"),
    ("text:path=a.txt,context=1", "context=1 is too short: expected at least 2"),
    ("text:path=a.txt,context=8,max_length=8", "exclude each other"),
    ("text:path=a.txt,bos=false", "give context=N with them"),
    ("text:path=a.txt,document=page", "document='page'"),
    ("text:path=a.txt,field=body", r"unknown text option\(s\) \['field'\]"),
    ("parquet:path=a.parquet,field=body", r"unknown parquet option\(s\) \['field'\]"),
    ("jsonl:path=a.jsonl,context=8,separator=newline", "separator='newline': expected eos or none"),
    ("hf:path=d,tokenized=yes", "tokenized='yes': expected true or false"),
])
def test_task_spec_that_does_not_parse(spec, detail):
    with pytest.raises(ConfigError, match=rf"task spec .* does not parse.*{detail}"):
        parse_task(spec)


# --- data -----------------------------------------------------------------------------------------


def test_arithmetic_samples_and_labels_are_the_tasks(tmp_path, arithmetic_dir):
    run_job(job(arithmetic_dir, tmp_path / "s.zarr", task="arithmetic:split=interpolation,seed=5", n_samples=7),
            progress=False)
    store = open_store(str(tmp_path / "s.zarr"))
    generated = tasks.generate("interpolation", 7, 5)
    np.testing.assert_array_equal(store["tokens"].values, generated.tokens)
    np.testing.assert_array_equal(store["scored"].values, generated.scored)
    np.testing.assert_array_equal(store["target"].values, generated.target)
    for name in ("role", "token_str", "digit_value", "carry"):
        np.testing.assert_array_equal(store[name].values.astype(generated.labels[name].dtype), generated.labels[name])
    assert store.attrs["task"]["split"] == "interpolation" and store.attrs["task"]["seed"] == 5


def test_text_lines_are_tokenised_padded_and_labelled(tmp_path):
    model_dir = write_hf_model(tmp_path / "gpt2", "gpt2")
    text = write_text(tmp_path / "lines.txt", ["the cat sat", "", "a dog ran on the mat", "cat"])
    run_job(job(model_dir, tmp_path / "s.zarr", task=f"text:path={text},max_length=4", n_samples=None), progress=False)
    store = open_store(str(tmp_path / "s.zarr"))
    assert store.sizes["sample"] == 3 and store.sizes["pos"] == 4
    np.testing.assert_array_equal(store["valid"].values, [[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    assert list(store["token_str"].values[1]) == ["a", "dog", "ran", "on"]
    np.testing.assert_array_equal(store["offset"].values[0, :3], [0, 1, 2])
    np.testing.assert_array_equal(store["document"].values[:, 0], [0, 2, 3])  # lines 0, 2 and 3 (line 1 is blank)
    np.testing.assert_array_equal(store["target"].values[0, :2], store["tokens"].values[0, 1:3])
    np.testing.assert_array_equal(store["scored"].values[0], [1, 1, 0, 0])
    assert store.attrs["task"]["target"] == "next token" and len(store.attrs["task"]["sha256"]) == 64


def test_empty_text_file_and_too_few_lines(tmp_path):
    model_dir = write_hf_model(tmp_path / "gpt2", "gpt2")
    empty = write_text(tmp_path / "empty.txt", ["", "   "])
    with pytest.raises(ConfigError, match="holds no documents"):
        run_job(job(model_dir, tmp_path / "a.zarr", task=f"text:path={empty}", n_samples=None), progress=False)
    short = write_text(tmp_path / "short.txt", ["the cat", "a dog"])
    with pytest.raises(ConfigError, match=r"has 2 documents, fewer than n_samples=5: ask for fewer"):
        run_job(job(model_dir, tmp_path / "b.zarr", task=f"text:path={short}", n_samples=5), progress=False)
    with pytest.raises(ConfigError, match="not found"):
        run_job(job(model_dir, tmp_path / "c.zarr", task=f"text:path={tmp_path / 'none.txt'}"), progress=False)
    assert not any(tmp_path.glob("*.zarr"))


def test_text_needs_a_tokenizer(tmp_path):
    model_dir = write_hf_model(tmp_path / "bare", "llama", with_tokenizer=False)
    text = write_text(tmp_path / "lines.txt")
    with pytest.raises(ConfigError, match="a text corpus needs the model's tokenizer"):
        run_job(job(model_dir, tmp_path / "s.zarr", task=f"text:path={text}"), progress=False)


# --- bad input to the job ---------------------------------------------------------------------------


def test_layer_out_of_range_and_missing_site_leave_no_store(tmp_path, arithmetic_dir):
    with pytest.raises(ConfigError, match=r"layer\(s\) \[5\] out of range: the model has 2 layers"):
        run_job(job(arithmetic_dir, tmp_path / "a.zarr", layers=(0, 5)), progress=False)
    with pytest.raises(ConfigError, match=r"site\(s\) \['mlp_hidden'\] cannot be provided"):
        run_job(job(arithmetic_dir, tmp_path / "b.zarr", sites=("q", "mlp_hidden")), progress=False)
    with pytest.raises(ConfigError, match="needs a sample count"):
        run_job(job(arithmetic_dir, tmp_path / "c.zarr", n_samples=None), progress=False)
    with pytest.raises(ConfigError, match=r"mode.*'continue'.*expected one of \['new', 'resume', 'overwrite'\]"):
        job(arithmetic_dir, tmp_path / "d.zarr", mode="continue")
    assert not any(tmp_path.glob("*.zarr"))


@pytest.mark.slow
def test_existing_store_needs_resume_or_overwrite(tmp_path, arithmetic_dir):
    out = tmp_path / "s.zarr"
    run_job(job(arithmetic_dir, out), progress=False)
    with pytest.raises(StoreExistsError, match='already exists .*complete.*mode="resume".*mode="overwrite"'):
        run_job(job(arithmetic_dir, out), progress=False)
    run_job(job(arithmetic_dir, out, mode="overwrite", task="arithmetic:seed=9"), progress=False)
    assert read_attrs(str(out))["task"]["seed"] == 9 and read_attrs(str(out))["complete"]


@pytest.mark.slow
def test_resume_of_a_complete_store_is_a_no_op(tmp_path, arithmetic_dir, caplog):
    out = tmp_path / "s.zarr"
    first = run_job(job(arithmetic_dir, out), progress=False)
    written = arrays_of(out)
    with caplog.at_level(logging.INFO, logger="orthosphere.extract"):
        again = run_job(job(arithmetic_dir, out, mode="resume"), progress=False)
    assert again.already_complete and "already complete" in again.summary() and "nothing to do" in caplog.text
    assert not first.already_complete and first.shards_run == 1
    assert_same_arrays(arrays_of(out), written)


@pytest.mark.parametrize("change,key", [
    ({"task": "arithmetic:split=test,seed=2"}, "task.seed"),
    ({"dtype": "float16"}, "dtype"),
    ({"sites": ("q", "k")}, "sites"),
    ({"layers": (1,)}, "layers"),
    ({"n_samples": 11}, "n_samples"),
])
@pytest.mark.slow
def test_resume_refuses_a_store_made_by_another_job(tmp_path, arithmetic_dir, change, key):
    out = tmp_path / "s.zarr"
    run_job(job(arithmetic_dir, out), progress=False)
    with pytest.raises(JobMismatchError, match=rf'made by a different job: its {key} is .*mode="overwrite"'):
        run_job(job(arithmetic_dir, out, mode="resume", **change), progress=False)


def test_resume_refuses_a_different_model(tmp_path, arithmetic_dir):
    out = tmp_path / "s.zarr"
    run_job(job(arithmetic_dir, out), progress=False)
    other = write_arithmetic_model(tmp_path / "other", seed=1)
    with pytest.raises(JobMismatchError, match="its model.weights_sha256 is"):
        run_job(job(other, out, mode="resume"), progress=False)


# --- shards, Dask, the CLI ------------------------------------------------------------------------


@pytest.mark.slow
def test_shards_on_dask_workers_equal_the_in_process_run(tmp_path, arithmetic_dir, caplog):
    """The CLI with --workers 2: each shard a Dask task in a worker process; bitwise the same store."""
    reference = tmp_path / "in-process.zarr"
    run_job(job(arithmetic_dir, reference, n_samples=23, samples_per_chunk=4, n_shards=4, batch_size=3), progress=False)
    out = tmp_path / "dask.zarr"
    arguments = ["extract", str(arithmetic_dir), "--task", "arithmetic:split=test,seed=1", "--samples", "23",
                 "--out", str(out), "--samples-per-chunk", "4", "--shards", "4", "--batch-size", "3",
                 "--device", "cpu", "--workers", "2"]
    with caplog.at_level(logging.INFO, logger="orthosphere.extract"):
        result = CliRunner().invoke(main, arguments, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert f"store {out} complete: 23 samples; ran 4 of 4 shards" in result.output
    assert f"writing the store at {out}" in caplog.text
    assert read_attrs(str(out))["shards"] == [[0, 8], [8, 12], [12, 16], [16, 23]]
    assert_same_arrays(arrays_of(out), arrays_of(reference))


@pytest.mark.slow
def test_coordinator_never_needs_the_workers_device(tmp_path, monkeypatch):
    """--device cuda on a Dask cluster from a client without CUDA: the coordinating process reads the
    description and weights on the CPU, only the workers load the model on cuda (simulated here by
    workers that run it on the CPU); two shards share one worker's model in two threads."""
    from distributed import Client, LocalCluster

    from orthosphere.extract import job as job_module
    from orthosphere.extract import shards as shards_module

    model_dir = write_hf_model(tmp_path / "llama", "llama")
    text = write_text(tmp_path / "text.txt")
    options = dict(task=f"text:path={text}", n_samples=None, samples_per_chunk=2, n_shards=3, batch_size=2)
    reference = tmp_path / "cpu.zarr"
    run_job(job(model_dir, reference, **options), progress=False)
    requested, real_load = [], job_module.load_source

    def load_source(path, device="auto", model_dtype=None):
        requested.append(device)
        return real_load(path, "cpu" if device == "cuda" else device, model_dtype)

    monkeypatch.setattr(job_module, "load_source", load_source)
    monkeypatch.setattr(shards_module, "load_source", load_source)
    out = tmp_path / "cluster.zarr"
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        run_job(job(model_dir, out, **{**options, "device": "cuda"}), client=client, progress=False)
    assert requested[0] == "cpu" and set(requested[1:]) == {"cuda"}
    assert_same_arrays(arrays_of(out), arrays_of(reference))


def test_a_cluster_without_workers_stops_the_job_saying_so_and_the_job_resumes(tmp_path, arithmetic_dir, monkeypatch):
    """A cluster that has no worker (never given any, or all died) does not leave the job waiting forever:
    after NO_WORKERS_SECONDS it stops, naming the scheduler; the store is left to resume, lock released."""
    from distributed import Client, LocalCluster

    from orthosphere.errors import ClusterError
    from orthosphere.extract import shards as shards_module

    monkeypatch.setattr(shards_module, "NO_WORKERS_SECONDS", 1.0)
    out = tmp_path / "store.zarr"
    with LocalCluster(n_workers=0, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
        with pytest.raises(ClusterError, match=rf"the Dask cluster at {cluster.scheduler_address} has had no worker for 1 s "
                                               r'while 2 shard\(s\) wait: start workers .*resume the job \(mode="resume"\)'):
            run_job(job(arithmetic_dir, out, n_shards=2, samples_per_chunk=2), client=client, progress=False)
    assert not read_attrs(str(out))["complete"] and not (out / ".lock").exists()
    run_job(job(arithmetic_dir, out, n_shards=2, samples_per_chunk=2, mode="resume"), progress=False)
    assert_same_arrays(arrays_of(out), arrays_of(run_job(job(arithmetic_dir, tmp_path / "plain.zarr", n_shards=2,
                                                              samples_per_chunk=2), progress=False).url))


def test_a_shard_that_kills_its_workers_is_named_not_reported_as_unexpected(tmp_path, arithmetic_dir, monkeypatch):
    """A worker killed while running a shard (here by the fault injection; out of memory in practice), as often
    as the cluster allows, stops the job with a ClusterError naming the shard and what to do."""
    import dask
    from distributed import Client, LocalCluster

    from orthosphere.errors import ClusterError
    from orthosphere.store.faults import CRASH_VARIABLE

    monkeypatch.setenv(CRASH_VARIABLE, "chunk-written")  # the workers inherit it; the coordinator writes no chunk
    out = tmp_path / "store.zarr"
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}), \
            LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        with pytest.raises(ClusterError, match=r"shard 0's task killed the Dask workers that ran it.*allowed-failures.*"
                                               r'out of memory.*resume the job \(mode="resume"\)'):
            run_job(job(arithmetic_dir, out, n_shards=1, samples_per_chunk=2), client=client, progress=False)
    assert not read_attrs(str(out))["complete"]


def test_model_dtype_runs_the_extraction_in_that_dtype(tmp_path):
    model_dir = write_hf_model(tmp_path / "llama", "llama")
    text = write_text(tmp_path / "text.txt")
    out = tmp_path / "bf16.zarr"
    run_job(job(model_dir, out, task=f"text:path={text}", n_samples=None, model_dtype="bfloat16"), progress=False)
    store = open_store(str(out)).load()
    assert store.attrs["model"]["dtype"] == "bfloat16" and store["q"].dtype == np.float32
    q = store["q"].values
    np.testing.assert_array_equal(q, torch.from_numpy(q).to(torch.bfloat16).float().numpy())  # bfloat16 values
    with pytest.raises(ConfigError, match=r"model_dtype='float8': expected one of \['float16', 'bfloat16', 'float32'\]"):
        run_job(job(model_dir, tmp_path / "bad.zarr", model_dtype="float8"), progress=False)
    assert not (tmp_path / "bad.zarr").exists()


def test_cli_reports_bad_input_in_one_line(tmp_path, arithmetic_dir):
    result = CliRunner().invoke(main, ["extract", str(arithmetic_dir), "--task", "arithmetic:split=nowhere",
                                       "--samples", "3", "--out", str(tmp_path / "s.zarr")])
    assert result.exit_code != 0
    assert "Error: task spec 'arithmetic:split=nowhere' does not parse" in result.output
    assert "Traceback" not in result.output


def test_cli_model_dtype_and_device_options(tmp_path, arithmetic_dir):
    from tests.test_extract_models import gguf_model, write_gguf

    arguments = ["extract", str(arithmetic_dir), "--task", "arithmetic:split=test", "--samples", "3", "--device", "cpu"]
    result = CliRunner().invoke(main, arguments + ["--out", str(tmp_path / "s.zarr"), "--model-dtype", "float16"])
    assert result.exit_code == 0, result.output
    assert read_attrs(str(tmp_path / "s.zarr"))["model"]["dtype"] == "float16"
    gguf = write_gguf(tmp_path / "tiny.gguf", gguf_model())
    text = write_text(tmp_path / "text.txt", [" the cat"])
    result = CliRunner().invoke(main, ["extract", str(gguf), "--task", f"text:path={text}", "--out",
                                       str(tmp_path / "g.zarr"), "--model-dtype", "bfloat16"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "Error: --model-dtype=bfloat16 with the GGUF file" in result.output
    assert "leave --model-dtype out" in result.output
    result = CliRunner().invoke(main, arguments + ["--out", str(tmp_path / "x.zarr"), "--model-dtype", "int4"])
    assert result.exit_code != 0 and "'int4' is not one of 'float16', 'bfloat16', 'float32'" in result.output


# --- writing behind compute -------------------------------------------------------------------------


SMOLLM2 = {"n_layers": 30, "d_model": 576, "n_heads": 9, "n_kv_heads": 3, "d_head": 64}
TINY = {"n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 4, "d_head": 8}
SITES = ("resid_pre", "resid_mid", "resid_post", "attn_in", "q", "k", "v")


def test_chunks_hold_about_4_mb_fit_in_memory_and_align_with_batches():
    # tiny model: the 4 MB target (4 MB / (26 x 32 x 4 bytes) = 1260 samples), a multiple of the batch
    assert chunk_samples(TINY, 100_000, 26, SITES, 2, "float32", 32) == 1248
    assert chunk_samples(TINY, 500, 26, SITES, 2, "float32", 32) == 500  # everything in one chunk
    # SmolLM2's shape at 128 positions: 25 MB a sample over every site and layer, so 10 fit in 256 MB
    assert chunk_samples(SMOLLM2, 10_000, 128, SITES, 30, "float16", 8) == 8
    assert chunk_samples(SMOLLM2, 10_000, 128, SITES, 30, "float16", 4) == 8
    assert chunk_samples(SMOLLM2, 10_000, 128, SITES, 30, "float16", 12) == 6  # a divisor of the batch
    assert chunk_samples(SMOLLM2, 10_000, 128, SITES, 30, "float16", 7) == 7


def block(start, stop):
    return {"x": np.arange(start, stop)}


class SlowWriter:
    """A store writer whose writes wait for a signal, to watch the queue fill."""

    attrs = {"samples_per_chunk": 1}

    def __init__(self):
        self.release = threading.Event()
        self.written, self.complete = [], []

    def write(self, first, arrays):
        self.release.wait()
        self.written.append(first)

    def mark_shard_complete(self, index, written_elsewhere=()):
        self.complete.append(index)


def test_write_queue_is_bounded_and_blocks_the_producer_only_when_full():
    writer = SlowWriter()
    sink = WriteBehind(writer, depth=2)
    sink.put(0, block(0, 1))  # taken by the writer thread, which now waits
    time.sleep(0.2)
    sink.put(1, block(1, 2))
    sink.put(2, block(2, 3))  # the queue holds two batches
    third = threading.Thread(target=sink.put, args=(3, block(3, 4)))
    third.start()
    third.join(timeout=0.5)
    assert third.is_alive(), "a put into a full queue must wait for the writer"
    writer.release.set()
    third.join(timeout=5)
    sink.end_shard(0)
    sink.close()
    assert writer.written == [0, 1, 2, 3] and writer.complete == [0]


def test_a_writer_thread_that_cannot_start_its_stream_fails_the_producer_instead_of_blocking_it():
    class NoChunking(SlowWriter):
        attrs = {}  # ChunkStream needs samples_per_chunk

    sink = WriteBehind(NoChunking(), depth=1)
    failed = []

    def produce():
        try:
            for start in range(10):
                sink.put(start, block(start, start + 1))
            sink.close()
        except KeyError as error:
            failed.append(error)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    producer.join(timeout=10)
    assert not producer.is_alive(), "the producer waits for a writer thread that has died"
    assert failed and "samples_per_chunk" in str(failed[0])


def test_writer_failure_reaches_the_producer():
    class FailingWriter(SlowWriter):
        def write(self, first, arrays):
            raise OSError("disk full")

    sink = WriteBehind(FailingWriter(), depth=1)
    with pytest.raises(OSError, match="disk full"):
        for start in range(100):
            sink.put(start, block(start, start + 1))
            time.sleep(0.01)


def test_the_arithmetic_task_is_refused_for_a_model_that_reads_text(tmp_path):
    model = write_hf_model(tmp_path / "llama", "llama")
    with pytest.raises(ConfigError, match=r"the arithmetic task with a llama model: the task's tokens are the arithmetic "
                                          r"transformers' character ids.*give it a text corpus"):
        run_job(ExtractJob(model=str(model), task="arithmetic:split=test,seed=1", n_samples=4, out=str(tmp_path / "s.zarr")),
                progress=False)
    assert not (tmp_path / "s.zarr").exists()
