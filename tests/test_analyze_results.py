"""The results DataTree on disk (local, memory://, s3://), its attrs, merging, and the analyze verb."""
from __future__ import annotations

import logging
import uuid
from collections import Counter

import numpy as np
import pytest
import xarray as xr
import zarr.storage
from click.testing import CliRunner

from orthosphere.analyze import AnalysisError, analyze, configure, neighbours, open_for_analysis, open_results, run_analyses
from orthosphere.analyze.results import chosen_analyses
from orthosphere.workflows.cli import main
from tests.synthetic import PlantedFactor, plane, plant_factors, write_store


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    resid, labels, _ = plant_factors(60, 6, [PlantedFactor("alpha", 5, plane(8), as_strings=True),
                                             PlantedFactor("beta", 4, plane(8, (2, 3)))], noise=0.1)
    resid = np.stack([resid, 2 * resid], axis=1).astype("float32")
    q = np.random.default_rng(0).normal(size=(60, 2, 6, 2, 4)).astype("float32")
    return write_store(tmp_path_factory.mktemp("results") / "store.zarr",
                       {"resid_pre": resid, "resid_post": resid[:, ::-1], "q": q, "k": q}, labels=labels,
                       samples_per_chunk=20)


@pytest.mark.slow
def test_results_round_trip_with_provenance_and_options(store, tmp_path):
    out = tmp_path / "results.zarr"
    tree = analyze(store, out, analyses=["norms", "neighbours"], layers=[1], norms={"mass": 0.5},
                   command="orthosphere analyze test")
    written = open_results(out)
    assert written.attrs["orthosphere_results"] == 1 and written.attrs["store"] == store
    assert written.attrs["analyses"] == ["norms", "neighbours"]
    assert written.attrs["model"]["family"] == "synthetic" and written.attrs["provenance"]["command"] == "orthosphere analyze test"
    assert set(written["norms"].children) == {"resid_pre", "resid_post", "q", "k"}
    norms = written["norms"]
    assert norms.attrs["options"]["mass"] == 0.5 and norms.attrs["options"]["layers"] == [1]
    assert norms.attrs["options"]["weight_by_attention"] is True
    assert written["neighbours"].attrs["options"]["layers"] == [1]
    xr.testing.assert_allclose(written["neighbours"].to_dataset(), tree["neighbours"].to_dataset())
    direct = neighbours(open_for_analysis(store), layers=[1])
    np.testing.assert_allclose(written["neighbours"]["rank_collapse"].values, direct["rank_collapse"].values)
    assert written["norms/resid_pre"]["band"].dims == ("layer", "head")


@pytest.mark.slow
def test_writing_again_replaces_only_the_groups_just_computed(store):
    out = f"memory://results-{uuid.uuid4().hex}"
    analyze(store, out, analyses=["neighbours"], layers=[0])
    analyze(store, out, analyses=["subspaces"], factors=["alpha", "beta"])
    merged = open_results(out)
    assert merged.attrs["analyses"] == ["subspaces", "neighbours"]
    assert merged["subspaces"].attrs["classes"]["alpha"] == ["c0", "c1", "c2", "c3", "c4"]
    assert merged["subspaces"]["factor"].values.tolist() == ["alpha", "beta"]
    analyze(store, out, analyses=["neighbours"], layers=[1])
    assert open_results(out)["neighbours"]["layer"].values.tolist() == [1]
    assert "subspaces" in open_results(out).children


@pytest.mark.slow
def test_results_never_overwrite_what_is_not_theirs(store, tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(AnalysisError, match="exists and is not an orthosphere results tree"):
        analyze(store, tmp_path / "notes", analyses=["neighbours"])
    assert (tmp_path / "notes" / "keep.txt").read_text() == "mine"
    other = write_store(tmp_path / "other.zarr", {"resid_pre": np.ones((4, 1, 3, 8), "float32"),
                                                  "resid_post": np.ones((4, 1, 3, 8), "float32")})
    out = tmp_path / "results.zarr"
    analyze(store, out, analyses=["neighbours"])
    with pytest.raises(AnalysisError, match=r"holds results of store .*overwrite them \(overwrite=True\)"):
        analyze(other, out, analyses=["neighbours"])
    analyze(other, out, analyses=["neighbours"], overwrite=True)
    assert open_results(out).attrs["store"] == other
    with pytest.raises(AnalysisError, match="no results at"):
        open_results(tmp_path / "missing.zarr")


@pytest.mark.slow
def test_results_on_s3(store, s3_bucket):
    out = f"{s3_bucket}/results.zarr"
    analyze(store, out, analyses=["neighbours"])
    assert open_results(out)["neighbours"]["n_sequences"].values.tolist() == [60, 60]


@pytest.mark.slow
def test_the_analyze_verb(store, tmp_path):
    out = str(tmp_path / "cli.zarr")
    runner = CliRunner()
    result = runner.invoke(main, ["analyze", store, "--out", out, "--only", "subspaces,spheres",
                                  "--factor", "alpha", "--factor", "beta", "--layers", "0",
                                  "--bootstrap", "300", "--option", "radius_cv_tolerance=0.2"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"wrote /subspaces, /spheres to {out}"
    written = open_results(out)
    assert written["spheres"].attrs["options"]["radius_cv_tolerance"] == 0.2
    assert written["spheres"].attrs["subspaces"] == "from the subspaces results"
    assert written["subspaces"].attrs["n_bootstrap"] == 300
    failed = runner.invoke(main, ["analyze", store, "--out", out, "--only", "norms", "--sites", "v"])
    assert failed.exit_code == 1 and failed.output.startswith("Error: store ") and "no site 'v'" in failed.output


@pytest.mark.slow
def test_the_analyze_verb_on_a_local_cluster(store, tmp_path):
    out = str(tmp_path / "cluster.zarr")
    result = CliRunner().invoke(main, ["--workers", "1", "analyze", store, "--out", out, "--only", "norms,subspaces",
                                       "--factor", "alpha", "--sites", "resid_pre,k"])
    assert result.exit_code == 0, result.output
    local = analyze(store, analyses=["norms"], sites=["resid_pre", "k"])
    np.testing.assert_allclose(open_results(out)["norms/k"]["band"].values, local["norms/k"]["band"].values)


class Killed(Exception):
    """Stands for a kill: write_results stops where it is, with no clean-up."""


@pytest.mark.slow
def test_a_crash_while_writing_results_never_loses_the_other_analyses(store, tmp_path, monkeypatch):
    out = tmp_path / "results.zarr"
    analyze(store, out, analyses=["norms", "neighbours"], layers=[0], norms={"sites": ["resid_pre"]})
    before = open_results(out).load()

    def kill(*args, **kwargs):
        raise Killed

    monkeypatch.setattr("orthosphere.analyze.results.commit_metadata", kill)  # new group written, not yet listed
    with pytest.raises(Killed):
        analyze(store, out, analyses=["subspaces"], factors=["alpha"], rank=1, n_bootstrap=0)
    after = open_results(out).load()
    assert set(after.children) == {"norms", "neighbours"} and after.attrs["analyses"] == ["norms", "neighbours"]
    xr.testing.assert_identical(after["neighbours"].to_dataset(), before["neighbours"].to_dataset())
    xr.testing.assert_identical(after["norms/resid_pre"].to_dataset(), before["norms/resid_pre"].to_dataset())

    monkeypatch.setattr("orthosphere.analyze.results._write_group", kill)  # while replacing neighbours
    with pytest.raises(Killed):
        analyze(store, out, analyses=["neighbours"], layers=[1])
    after = open_results(out).load()
    assert set(after.children) == {"norms"}  # only the analysis being replaced is lost
    xr.testing.assert_identical(after["norms/resid_pre"].to_dataset(), before["norms/resid_pre"].to_dataset())

    monkeypatch.undo()
    analyze(store, out, analyses=["subspaces"], factors=["alpha"], rank=1, n_bootstrap=0)
    assert set(open_results(out).children) == {"norms", "subspaces"}
    assert sorted(path.name for path in out.iterdir()) == ["norms", "subspaces", "zarr.json"]

def test_groups_an_analysis_was_killed_writing_into_new_results_are_never_read_nor_adopted(store, tmp_path, monkeypatch):
    """Killed before the first listing of new results: the root lists nothing and zarr would find the
    half-written group on disk; neither open_results, the report nor a later analysis takes it."""
    from orthosphere.workflows.report import write_report

    out = tmp_path / "results.zarr"

    def kill(*args, **kwargs):
        raise Killed

    monkeypatch.setattr("orthosphere.analyze.results.commit_metadata", kill)
    with pytest.raises(Killed):
        analyze(store, out, analyses=["neighbours"], layers=[0])
    monkeypatch.undo()
    assert (out / "neighbours").is_dir() and not open_results(out).children
    with pytest.raises(AnalysisError, match=rf"results {out} hold no complete analysis .*run the analyses again"):
        write_report([out], tmp_path / "report")
    analyze(store, out, analyses=["norms"], layers=[0], norms={"sites": ["resid_pre"]})
    assert set(open_results(out).children) == {"norms"} and open_results(out).attrs["analyses"] == ["norms"]


@pytest.fixture
def chunk_reads(monkeypatch):
    """Counts the chunks of each activation variable read from local stores (zarr keys VARIABLE/c/...)."""
    reads = Counter()
    get = zarr.storage.LocalStore.get

    async def counted(self, key, *args, **kwargs):
        variable, _, rest = key.partition("/")
        if rest.startswith("c/") and variable in ("resid_pre", "resid_post", "q", "k"):
            reads[variable] += 1
        return await get(self, key, *args, **kwargs)

    monkeypatch.setattr(zarr.storage.LocalStore, "get", counted)
    return reads


@pytest.mark.slow
def test_all_analyses_read_each_chunk_once_per_pass(store, chunk_reads):
    dataset = open_for_analysis(store, block_bytes=1)  # three blocks of 20 samples, one zarr chunk each
    n_chunks = dataset.sizes["layer"] * len(dataset.chunks["sample"])
    options = {"factors": ["alpha", "beta"]}
    replay = {"replay": {"targets": ["q", "k"], "n_draws": 2, "n_bootstrap": 10}}
    every = configure(chosen_analyses(dataset, ["norms", "subspaces", "neighbours", "replay"]), options | replay)
    run_analyses(dataset, every)
    assert chunk_reads == Counter({"resid_pre": n_chunks, "resid_post": n_chunks, "q": n_chunks, "k": n_chunks})
    chunk_reads.clear()  # the same on a distributed cluster (workers in this process, where the count is)
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster):
        run_analyses(dataset, every)
    assert chunk_reads == Counter({"resid_pre": n_chunks, "resid_post": n_chunks, "q": n_chunks, "k": n_chunks})
    chunk_reads.clear()  # the control: analyses run one by one read the chunks they share again
    for name in ("subspaces", "neighbours"):
        run_analyses(dataset, configure(chosen_analyses(dataset, [name]), options if name == "subspaces" else {}))
    assert chunk_reads == Counter({"resid_pre": 2 * n_chunks, "resid_post": n_chunks})
    chunk_reads.clear()  # the spheres read the fit of the subspaces: no pass of their own
    run_analyses(dataset, configure(chosen_analyses(dataset, ["subspaces", "spheres"]), options))
    assert chunk_reads == Counter({"resid_pre": n_chunks})


def test_every_pass_logs_its_progress_with_an_estimate(store, caplog, monkeypatch):
    monkeypatch.setattr("orthosphere.analyze.plan.LOG_EVERY_SECONDS", 0.0)
    with caplog.at_level(logging.INFO, logger="orthosphere.analyze"):
        analyze(store, analyses=["subspaces", "neighbours"], factors=["alpha", "beta"])
    messages = [record.getMessage() for record in caplog.records]
    assert "analyze pass 1 (subspaces, neighbours): started" in messages
    progress = [m for m in messages if m.startswith("analyze pass 1 (subspaces, neighbours):") and "% of" in m]
    assert progress and all(" s left" in m for m in progress)
    assert any(m.startswith("analyze pass 1 (subspaces, neighbours): done in") for m in messages)


@pytest.mark.slow
def test_the_report_tabulates_label_association_beside_the_angles_and_their_null(store, tmp_path):
    from orthosphere.workflows.figures import figure_association
    from orthosphere.workflows.runs import load_runs

    out = tmp_path / "results.zarr"
    tree = analyze(store, out, analyses=["subspaces"], factors=["alpha", "beta"], rank=2)
    figure = figure_association(load_runs([out]))
    cells = [cell.get_text().get_text() for cell in figure.axes[0].tables[0].get_celld().values()]
    subspaces = tree["subspaces"].to_dataset().sel(factor="alpha", other="beta")
    assert f"{subspaces.label_nmi.item():.2f}" in cells and f"{subspaces.min_angle.mean('layer').item():.1f}" in cells
    assert f"{subspaces.null_min_angle.mean('layer').item():.1f}" in cells and "null (°)" in cells
    per_layer = [f"{layer}: {e:.0f} [{lo:.0f}, {hi:.0f}] {r}" for layer, e, (lo, hi), r in
                 zip(subspaces.layer.values, subspaces.min_angle_estimate.values, subspaces.min_angle_ci.values,
                     subspaces.relation.values)]
    assert "; ".join(per_layer) in cells  # each layer's estimate, interval and relation, named by its layer


@pytest.mark.slow
def test_the_report_draws_each_layers_angle_and_sphere_statistics_with_their_intervals(store, tmp_path):
    from matplotlib.container import ErrorbarContainer

    from orthosphere.workflows.figures import figure_angles, figure_spheres
    from orthosphere.workflows.runs import load_runs

    out = tmp_path / "results.zarr"
    tree = analyze(store, out, analyses=["subspaces", "spheres"], factors=["alpha", "beta"], rank=2)
    runs = load_runs([out])
    angles = figure_angles(runs).axes[0]
    (bars,) = [c for c in angles.containers if isinstance(c, ErrorbarContainer)]  # one pair: alpha / beta
    estimate = tree["subspaces"].to_dataset().sel(factor="alpha", other="beta").min_angle_estimate.values
    np.testing.assert_allclose(bars.lines[0].get_ydata(), estimate)
    spheres = figure_spheres(runs)
    radius_panel, cross_panel = spheres.axes[0], spheres.axes[1]
    assert len([c for c in radius_panel.containers if isinstance(c, ErrorbarContainer)]) == 2  # one per factor
    assert len([c for c in cross_panel.containers if isinstance(c, ErrorbarContainer)]) == 1  # one per pair


def test_results_record_a_local_store_by_its_absolute_path(tmp_path, monkeypatch):
    import os

    from orthosphere.analyze.results import results_tree, write_results

    monkeypatch.chdir(tmp_path)
    tree = results_tree(xr.Dataset(attrs={"url": "store.zarr"}), {})
    assert tree.attrs["store"] == os.path.join(os.getcwd(), "store.zarr")
    assert results_tree(xr.Dataset(attrs={"url": "s3://bucket/store.zarr"}), {}).attrs["store"] == "s3://bucket/store.zarr"
    earlier = results_tree(xr.Dataset(attrs={"url": "store.zarr"}), {})
    earlier.attrs["store"] = "store.zarr"  # as results written before recorded it
    write_results(earlier, "results.zarr")
    write_results(tree, "results.zarr")  # the same store: its results are added to, not refused
    assert open_results("results.zarr").attrs["store"] == os.path.join(os.getcwd(), "store.zarr")
