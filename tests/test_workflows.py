"""Workflows: the pipeline (skips, force, bad configs), the report, the notebook, and the same
results on a LocalCluster, with a worker killed mid-analysis, and with everything on S3."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from orthosphere.analyze import open_results
from orthosphere.extract.model import ConfigError
from orthosphere.store.lifecycle import IDENTITY_KEYS
from orthosphere.workflows.backend import Backend
from orthosphere.workflows.cli import main
from orthosphere.workflows.pipeline import _analysed, load_pipeline, run_pipeline
from tests.synthetic import write_store

REPO = Path(__file__).resolve().parents[1]
TINY_TRAINING = REPO / "workflows" / "configs" / "tiny.toml"
NOTEBOOK = REPO / "workflows" / "notebooks" / "explore.ipynb"

PIPELINE = f"""
name = "tiny"
root = "{{root}}"
local_root = "{{local_root}}"

[models.pre]
train = "{TINY_TRAINING}"

[data.test]
task = "arithmetic:split=test,seed=11"
samples = 48

[data.extrapolation]
task = "arithmetic:split=extrapolation,seed=12"
samples = 48

[extract]
batch_size = 16
shards = 3

[analyze]
online = ["test"]
online_samples = 16

[analyze.options]
"replay.n_draws" = 4
"replay.n_bootstrap" = 40

[report]
title = "tiny pipeline"
"""


def write_pipeline(folder: Path, root: str | None = None, data=("test", "extrapolation")) -> Path:
    """The tiny pipeline's config in `folder`, keeping only the named data sets."""
    folder.mkdir(parents=True, exist_ok=True)
    text = PIPELINE.format(root=root or str(folder / "out"), local_root=str(folder / "out"))
    for name in {"test", "extrapolation"} - set(data):
        start = text.index(f"[data.{name}]")
        text = text[:start] + text[text.index("[", start + 1):]
    path = folder / "pipeline.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The tiny pipeline run once in this process: (config path, output root)."""
    folder = tmp_path_factory.mktemp("tiny-run")
    config = write_pipeline(folder)
    run_pipeline(load_pipeline(config))
    return config, folder / "out"


def data_of(tree) -> dict[str, np.ndarray]:
    """Every data variable of every group, by path."""
    values = {}
    for node in tree.subtree:
        for name, variable in node.dataset.data_vars.items():
            values[f"{node.path}/{name}"] = variable.values
    return values


def assert_same_results(first_url: str, second_url: str) -> None:
    first, second = data_of(open_results(first_url).load()), data_of(open_results(second_url).load())
    assert sorted(first) == sorted(second)
    for name, values in first.items():
        if values.dtype.kind in "fc":
            np.testing.assert_allclose(second[name], values, rtol=1e-9, atol=1e-12, equal_nan=True, err_msg=name)
        else:
            np.testing.assert_array_equal(second[name], values, err_msg=name)


@pytest.mark.slow
def test_pipeline_writes_stores_results_and_report(tiny_run):
    _, out = tiny_run
    assert sorted(p.name for p in (out / "stores").iterdir()) == ["pre-extrapolation.zarr", "pre-test.zarr"]
    tree = open_results(str(out / "results" / "pre-test.zarr"))
    assert set(tree.children) >= {"accuracy", "norms", "subspaces", "spheres", "neighbours", "replay"}
    html = (out / "report" / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 5
    markdown = (out / "report" / "report.md").read_text()
    assert "| Pre-Norm / QKV-Norm: per-token accuracy, test |" in markdown
    assert "n/a (needs both placements)" in markdown
    assert "noise RMS at which 1 % of sparse (query, head) instances collapse" in markdown
    assert "store" in markdown and "pre-test.zarr" in markdown
    assert "online" in tree["replay"].children
    assert "accuracy drop with 1 % noise in all layers" in markdown
    for figure in ("norm_spread", "angles", "spheres", "collapse", "max_attention", "accuracy", "accuracy_under_noise"):
        assert (out / "report" / "figures" / f"{figure}.png").stat().st_size > 5000, figure


@pytest.mark.slow
def test_rerun_skips_complete_steps_and_force_redoes_them(tiny_run, tmp_path, caplog):
    config, out = tiny_run
    results = out / "results" / "pre-test.zarr" / "zarr.json"
    before = results.stat().st_mtime_ns
    with caplog.at_level("INFO"):
        run_pipeline(load_pipeline(config))
    assert results.stat().st_mtime_ns == before
    assert "already complete" in caplog.text and "skipping the analyses" in caplog.text

    forced = write_pipeline(tmp_path, data=("test",))
    run_pipeline(load_pipeline(forced))
    store = tmp_path / "out" / "stores" / "pre-test.zarr" / "zarr.json"
    stamps = store.stat().st_mtime_ns, (tmp_path / "out" / "results" / "pre-test.zarr" / "zarr.json").stat().st_mtime_ns
    outcome = CliRunner().invoke(main, ["run", str(forced), "--force"])
    assert outcome.exit_code == 0, outcome.output
    assert store.stat().st_mtime_ns > stamps[0]
    assert (tmp_path / "out" / "results" / "pre-test.zarr" / "zarr.json").stat().st_mtime_ns > stamps[1]


def test_changed_analysis_options_make_the_results_again_and_the_same_ones_keep_them(tmp_path, caplog):
    q = np.random.default_rng(0).normal(size=(6, 1, 5, 2, 4)).astype("float32")
    store = write_store(tmp_path / "store.zarr", {"resid_pre": q.reshape(6, 1, 5, 8), "q": q, "k": q})
    out = str(tmp_path / "results.zarr")
    config = tmp_path / "p.toml"

    def analyse(mass: float) -> str:
        config.write_text(f"[models.a]\npath='x'\n[data.t]\ntask='arithmetic:split=test'\n[analyze]\nonly=['norms']\n"
                          f"[analyze.options]\n'norms.mass'={mass}\n")
        caplog.clear()
        with caplog.at_level("INFO", logger="orthosphere.pipeline"):
            _analysed(store, out, load_pipeline(config), False, None)
        return caplog.text

    first, same, changed = analyse(0.5), analyse(0.5), analyse(0.6)
    assert "analysing" in first and "analysing" not in same
    assert "analysing" in changed and open_results(out)["norms"].attrs["options"]["mass"] == 0.6
    assert "with the same analyses and options: kept" in same


@pytest.mark.slow
def test_report_verb(tiny_run, tmp_path):
    _, out = tiny_run
    results = [str(p) for p in sorted((out / "results").glob("*.zarr"))]
    outcome = CliRunner().invoke(main, ["report", *results, "--out", str(tmp_path / "report")])
    assert outcome.exit_code == 0, outcome.output
    assert (tmp_path / "report" / "report.html").exists()


@pytest.mark.slow
def test_notebook_runs_top_to_bottom(tiny_run):
    nbclient = pytest.importorskip("nbclient")
    import nbformat

    _, out = tiny_run
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    os.environ["ORTHOSPHERE_RUN"] = str(out)
    try:
        nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    finally:
        del os.environ["ORTHOSPHERE_RUN"]
    errors = [output for cell in notebook.cells for output in cell.get("outputs", []) if output.get("output_type") == "error"]
    assert not errors
    images = [o for cell in notebook.cells for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) >= 4


@pytest.mark.slow
def test_local_cluster_gives_the_same_results(tiny_run, tmp_path):
    _, out = tiny_run
    config = write_pipeline(tmp_path)
    run_pipeline(load_pipeline(config), backend=Backend(workers=2))
    for name in ("pre-test.zarr", "pre-extrapolation.zarr"):
        assert_same_results(str(out / "results" / name), str(tmp_path / "out" / "results" / name))


@pytest.mark.slow
def test_worker_killed_mid_analysis_gives_the_same_results(tiny_run, tmp_path):
    from distributed import Client, LocalCluster

    from orthosphere.analyze import analyze

    _, out = tiny_run
    store = str(out / "stores" / "pre-test.zarr")
    options = {"replay": {"n_draws": 64, "n_bootstrap": 40}}
    expected = str(tmp_path / "expected.zarr")
    analyze(store, expected, analyses=["replay"], **options)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, Client(cluster) as client:
        pids = client.run(os.getpid)
        outcome = {}
        worker = threading.Thread(target=lambda: outcome.setdefault("tree", analyze(store, str(tmp_path / "killed.zarr"), analyses=["replay"], **options)))
        worker.start()
        deadline = time.time() + 60
        while not any(client.processing().values()) and time.time() < deadline:
            time.sleep(0.02)
        assert any(client.processing().values()) and worker.is_alive(), "no task was running to be interrupted"
        victim = next(iter(pids))
        os.kill(pids[victim], 9)
        worker.join(timeout=300)
        assert "tree" in outcome, "the analysis did not survive the killed worker"
    assert_same_results(expected, str(tmp_path / "killed.zarr"))


@pytest.mark.slow
def test_pipeline_on_s3_gives_the_same_results(tiny_run, s3_bucket, tmp_path):
    _, out = tiny_run
    config = write_pipeline(tmp_path, root=f"{s3_bucket}/tiny", data=("test",))
    run_pipeline(load_pipeline(config))
    assert_same_results(str(out / "results" / "pre-test.zarr"), f"{s3_bucket}/tiny/results/pre-test.zarr")
    assert (tmp_path / "out" / "report" / "report.html").exists()


@pytest.mark.parametrize(
    "text, message",
    [
        ("[models.a]\npath='x'\n", "needs at least one"),
        ("colour = 1\n[models.a]\npath='x'\n[data.t]\ntask='arithmetic:split=test'\n", r"unknown keys \['colour'\]"),
        ("[models.a]\n[data.t]\ntask='arithmetic:split=test'\n", "give `path`"),
        ("[models.a]\npath='x'\nseed=1\n[data.t]\ntask='arithmetic:split=test'\n", "give it with `train`"),
        ("[models.a]\npath='x'\n[data.t]\nsamples=3\n", "needs `task`"),
        ("[models.a]\npath='x'\n[data.t]\ntask='arithmetic:split=test'\n[analyze]\nonline=['u']\n", r"online names \['u'\]"),
        ("[models.a\n", "not valid TOML"),
        ("models = 'x'\n", r"`models` = 'x': expected a table"),
        ("[models.a]\npath='x'\n[data.t]\ntask=5\n", "expected a task spec string"),
        ("[models.a]\npath='x'\n[data.t]\ntask='arithmetic:split=dev'\n",
         r"bad.toml \[data.t\] task = 'arithmetic:split=dev': .*dev"),
        ("[models.a]\npath='x'\n[data.t]\ntask='text:context=8'\n", r"\[data.t\] task = 'text:context=8': "),
        ("[models.a]\npath='x'\n[data.t]\ntask='arithmetic:split=test'\n[extract]\nshards=0\n",
         r"bad.toml \[extract\] shards = 0: expected a positive integer"),
        ("[models.a]\npath='x'\n[data.t]\ntask='arithmetic:split=test'\n[backend]\nworkers='2'\n", "workers = '2'"),
        ("[models.a]\npath='x'\n[data.t]\ntask='arithmetic:split=test'\n[backend]\nworkers=2\nscheduler='tcp://h:1'\n", "not both"),
        ("[models.a]\npath='x'\n[data.t]\ntask='arithmetic:split=test'\n[analyze]\nonly='replay'\n", "expected a non-empty list"),
        ("[models.a]\npath='x'\n[data.t]\ntask='arithmetic:split=test'\n[analyze]\nonly=[]\n", "expected a non-empty list"),
        ("[models.a]\npath='x'\n[data.t]\ntask='arithmetic:split=test'\n[analyze]\nonly=['nope']\n",
         r"bad.toml \[analyze\] only = \['nope'\]: unknown analyses \['nope'\]; expected some of"),
        ("root = 5\n[models.a]\npath='x'\n[data.t]\ntask='arithmetic:split=test'\n", r"bad.toml: `root` = 5: expected a non-empty string"),
        ("name = 1\n[models.a]\npath='x'\n[data.t]\ntask='arithmetic:split=test'\n", r"bad.toml: `name` = 1: expected a non-empty string"),
        ("[models.a]\npath='x'\n[data.t]\ntask='arithmetic:split=test'\nsamples=-1\n", r"\[data.t\] samples = -1: expected a positive"),
        ("[models.a]\npath='x'\n[data.t]\ntask='arithmetic:split=test'\n[report]\ntitle=3\n", r"\[report\]: `title` = 3"),
        ("[models.a]\npath='x'\n[data.t]\ntask='arithmetic:split=test'\n[analyze]\nonly=['norms']\nonline=['t']\n", "add \"replay\""),
    ],
)
def test_bad_pipeline_configs(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_pipeline(path)


def test_a_pipelines_task_specs_are_parsed_when_it_is_loaded(tmp_path):
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "p.toml").write_text("[models.a]\npath='x'\n[data.c]\ntask='text:path=corpus.txt,context=8'\n"
                                   "[data.t]\ntask='arithmetic:split=interpolation,seed=3'\n")
    corpus, arithmetic = (entry.task for entry in load_pipeline(folder / "p.toml").data)
    assert (corpus.source, corpus.path, corpus.layout, corpus.length) == ("text", str(folder / "corpus.txt"), "packed", 8)
    assert (arithmetic.split, arithmetic.seed) == ("interpolation", 3)


@pytest.mark.parametrize("entry, message", [
    ("train='bad.toml'", r"p.toml \[models.b\]: .*bad.toml: \[train\] steps = 0: expected a positive integer"),
    ("train='nowhere.toml'", r"p.toml \[models.b\]: .*nowhere.toml not found"),
    (f"train='{TINY_TRAINING}'\nseed=-3", r"p.toml \[models.b\] seed = -3: expected a non-negative integer"),
])
def test_every_models_training_config_is_checked_when_the_pipeline_is_loaded(tmp_path, entry, message):
    (tmp_path / "bad.toml").write_text(TINY_TRAINING.read_text().replace("steps = 40", "steps = 0"))
    (tmp_path / "p.toml").write_text(f"[models.a]\ntrain='{TINY_TRAINING}'\n[models.b]\n{entry}\n"
                                     "[data.t]\ntask='arithmetic:split=test'\n")
    with pytest.raises(ConfigError, match=message):
        load_pipeline(tmp_path / "p.toml")


def test_a_store_made_with_other_samples_gives_the_pipelines_advice(tmp_path, monkeypatch):
    import orthosphere.extract.job as job_module
    from orthosphere.store.lifecycle import check_same_job

    def mismatch(job, **_):
        check_same_job(job.out, {"n_samples": 16}, {**dict.fromkeys(IDENTITY_KEYS), "n_samples": 24})

    monkeypatch.setattr(job_module, "run_job", mismatch)
    (tmp_path / "p.toml").write_text(f"root='{tmp_path}'\n[models.a]\npath='x'\n[data.t]\ntask='arithmetic:split=test'\n")
    result = CliRunner().invoke(main, ["run", str(tmp_path / "p.toml")])
    assert result.exit_code != 0 and "its n_samples is 16, this job's is 24" in result.output
    assert "orthosphere run --force" in result.output and f"delete {tmp_path}/stores/a-t.zarr" in result.output
    assert "orthosphere extract" not in result.output and "overwrite" not in result.output


def test_missing_pipeline_config(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_pipeline(tmp_path / "nowhere.toml")


@pytest.mark.slow
def test_hf_text_pipeline_runs_on_the_shipped_stand_in_checkpoint(tmp_path):
    pipeline = load_pipeline(REPO / "workflows" / "configs" / "hf-text.toml", root=str(tmp_path / "hf"))
    report = run_pipeline(pipeline)
    tree = open_results(str(tmp_path / "hf" / "results" / "demo-llama-sentences.zarr"))
    assert set(tree.children) == {"accuracy", "norms", "neighbours", "replay"}
    assert tree.attrs["model"]["family"] == "llama" and tree.attrs["model"]["n_kv_heads"] == 2
    assert tree.attrs["task"]["name"] == "text"
    assert (report / "report.html").exists()


@pytest.mark.parametrize("name", ["quickstart", "paper", "hf-text"])
def test_shipped_pipeline_configs_parse_and_point_at_what_is_shipped(name):
    pipeline = load_pipeline(REPO / "workflows" / "configs" / f"{name}.toml")
    for model in pipeline.models:
        assert (model.train or model.path / "config.json").exists(), model
    assert pipeline.data and pipeline.root == f"runs/{name}"
