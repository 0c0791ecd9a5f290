"""The report: runs keyed by model identity (never by placement alone), seeds of one variant
summarised as mean [min–max], and whether the paper's direction holds beyond the seed spread."""

import numpy as np
import pytest
import xarray as xr

from orthosphere.workflows import figures, report
from orthosphere.workflows import runs as run_model

SPEC = {"train_counts": [3, 4, 6], "digit_lengths": [1, 2]}


def results_tree(source: str, sha: str, placement: str, split: str, accuracy: float, band: float = 0.2,
                 sparse: int = 50, d_model: int = 64, recall: float = 0.9, precision: float = 0.8,
                 collapse_target: float = 0.01, sparse_threshold: float = 0.95) -> xr.DataTree:
    """A results tree holding what the headline reads, for one (model, data) pair."""
    per_head = placement == "qkv"  # what a store's description says of the placement, beyond its name
    norms = [{"site": site, "type": "layer", "scope": "head" if per_head else "d_model"}
             for site in (("q", "k", "v") if per_head else ("attn_input",))]
    model = {"family": "arithmetic", "norm_placement": placement, "n_layers": 2, "d_model": d_model,
             "n_heads": 4, "d_head": d_model // 4, "source": source, "weights_sha256": sha, "norms": norms,
             "qk_norm": "head" if per_head else None, "v_norm": "head" if per_head else None,
             "n_parameters": 1000 + (64 if per_head else 0)}
    layer_head = {"layer": [0, 1], "head": [0, 1, 2, 3]}
    replay = xr.Dataset({
        "collapse_level_pooled": ("definition", [0.1, 0.2]),
        "n_sparse": (("layer", "head"), np.full((2, 4), sparse)),
        "n_instances": (("layer", "head"), np.full((2, 4), 100)),
        "theory_recall_pooled": ("level", [np.nan, recall]),  # nothing collapses at 5 %
        "theory_precision_pooled": ("level", [0.0, precision]),
    }, coords={"definition": ["collapse", "strict"], "level": [0.05, 0.1], **layer_head},
        attrs={"collapse_target": collapse_target, "sparse_threshold": sparse_threshold, "min_keys": 4})
    tree = xr.DataTree.from_dict({
        "/accuracy": xr.Dataset({"token_accuracy": accuracy}),
        "/norms/resid_pre": norms_group(band, layer_head),
        "/replay": replay,
    })
    tree.attrs = {"model": model, "task": {"name": "arithmetic", "split": split, "spec": SPEC}}
    return tree


def norms_group(band: float, layer_head: dict) -> xr.Dataset:
    """/norms/resid_pre whose pooled band is `band`, its layers' 0.12 and 0.72 and its heads' a tenth of
    it (what the median over heads gave before the pooling)."""
    ratio = np.linspace(0.01, 1.99, 100)
    histogram = np.broadcast_to(np.exp(-((ratio - 1) / 0.1) ** 2), (2, 4, 100))
    return xr.Dataset({
        "band": (("layer", "head"), np.full((2, 4), band / 10)), "band_layer": ("layer", [0.12, 0.72]),
        "band_pooled": ((), band), "histogram": (("layer", "head", "ratio"), histogram / histogram.sum(-1, keepdims=True)),
        "weight_total": (("layer", "head"), np.full((2, 4), 10.0)),
    }, coords={**layer_head, "ratio": ratio}, attrs={"weighting": "attention", "mass": 0.9})


def runs_of(accuracies: dict[str, list[float]], **kwargs) -> list[run_model.Run]:
    """placement -> per-seed test accuracy; seed s of placement p lives in folder p-s{s}."""
    runs = []
    for placement, values in accuracies.items():
        for seed, value in enumerate(values):
            source = f"/models/{placement}-s{seed}"
            for split, shift in (("test", 0.0), ("extrapolation", -0.2)):
                tree = results_tree(source, f"{placement}{seed}" * 8, placement, split, value + shift, **kwargs)
                runs.append(run_model.Run(f"{source}-{split}.zarr", tree))
    return run_model.name_runs(runs)


def test_seeds_of_one_placement_are_all_kept_and_grouped_into_one_variant():
    runs = runs_of({"pre": [0.9, 0.8, 0.85], "qkv": [0.7, 0.75, 0.6]})
    assert [run.name for run in run_model.in_distribution(runs)] == [f"{p}-s{s}" for p in ("pre", "qkv") for s in range(3)]
    assert sorted(len(members) for members in run_model.variants(runs).values()) == [3, 3]
    (family,) = report.families(runs)
    assert [run.name for run in family["pre"]] == ["pre-s0", "pre-s1", "pre-s2"]
    assert run_model.accuracy_table(runs)["qkv-s2"] == pytest.approx({"test": 60.0, "extrapolation": 40.0})


def test_two_models_that_share_a_folder_name_never_collide():
    trees = [results_tree(f"/{where}/pre", sha, "pre", "test", 0.9) for where, sha in (("a", "1" * 64), ("b", "2" * 64))]
    runs = run_model.name_runs([run_model.Run(f"r{i}.zarr", tree) for i, tree in enumerate(trees)])
    assert [run.name for run in runs] == ["pre@11111111", "pre@22222222"]
    assert len(run_model.in_distribution(runs)) == 2


def test_models_of_different_sizes_are_different_variants_and_labelled_by_size():
    runs = run_model.name_runs([run_model.Run("a.zarr", results_tree("/m/small", "1" * 64, "pre", "test", 0.9)),
                             run_model.Run("b.zarr", results_tree("/m/large", "2" * 64, "pre", "test", 0.9, d_model=128))])
    labels = sorted(run_model.variant_labels(runs).values())
    assert labels == ["arithmetic: pre (2 layers, d_model 128, 4 heads of 32)",
                      "arithmetic: pre (2 layers, d_model 64, 4 heads of 16)"]
    assert len(report.families(runs)) == 2


def language_model_tree(source: str, family: str, qk_norm: str | None) -> xr.DataTree:
    """A results tree of a transformers model of `family`: Pre-Norm RMSNorm, QK-norm per head or none."""
    tree = results_tree(source, family * 8, "pre", "test", 0.5)
    tree.attrs["model"] |= {"family": family, "norm_type": "rms", "qk_norm": qk_norm, "v_norm": None,
                            "parallel": False}
    tree.attrs["task"] = {"name": "corpus", "split": "test"}
    return tree


def test_models_of_equal_size_and_placement_are_labelled_by_family_and_norms():
    runs = run_model.name_runs([run_model.Run("a.zarr", language_model_tree("/hub/llama-tiny", "llama", None)),
                             run_model.Run("b.zarr", language_model_tree("/hub/qwen3-tiny", "qwen3", "head"))])
    labels = run_model.variant_labels(runs)
    assert sorted(labels.values()) == ["llama: pre RMSNorm", "qwen3: pre RMSNorm + QK-norm"]
    assert report.families(runs) == []  # the headline's Pre-Norm / QKV-Norm pair is the arithmetic family's
    legend = [text.get_text() for text in figures.figure_accuracy(runs).axes[0].get_legend().get_texts()]
    assert sorted(legend) == ["llama: pre RMSNorm (1 model)", "qwen3: pre RMSNorm + QK-norm (1 model)"]


def test_parallel_and_sandwich_models_say_so_and_one_identity_of_one_size_is_told_apart_by_name():
    parallel = language_model_tree("/hub/phi-tiny", "phi", None)
    parallel.attrs["model"] |= {"norm_type": "layer", "parallel": True}
    sandwich = language_model_tree("/hub/gemma2-tiny", "gemma2", None)
    sandwich.attrs["model"]["norm_placement"] = "sandwich"
    twins = [language_model_tree(f"/hub/llama-{n}", "llama", None) for n in ("a", "b")]
    twins[1].attrs["model"]["d_ff"] = 99  # another variant of the same identity and size
    runs = run_model.name_runs([run_model.Run(f"{i}.zarr", tree) for i, tree in enumerate([parallel, sandwich, *twins])])
    assert sorted(run_model.variant_labels(runs).values()) == [
        "gemma2: sandwich RMSNorm", "llama: pre RMSNorm [llama-a]", "llama: pre RMSNorm [llama-b]",
        "phi: pre LayerNorm, parallel"]


def test_the_headline_pairs_only_the_arithmetic_familys_pre_and_qkv_variants():
    runs = runs_of({"pre": [0.9, 0.8], "qkv": [0.7, 0.75]})
    runs = run_model.name_runs(runs + [run_model.Run("lm.zarr", language_model_tree("/hub/llama-tiny", "llama", None))])
    (family,) = report.families(runs)
    assert {placement: [run.name for run in members] for placement, members in family.items()} == {
        "pre": ["pre-s0", "pre-s1"], "qkv": ["qkv-s0", "qkv-s1"]}
    rows = {row[0]: row[1] for row in report.headline_rows(runs)}
    assert rows["Seeds (models) per placement, Pre-Norm / QKV-Norm"] == "2 / 2"


def test_headline_gives_mean_and_spread_over_seeds_and_judges_the_direction():
    runs = runs_of({"pre": [0.9, 0.8, 0.85], "qkv": [0.7, 0.75, 0.6]}, band=0.2)
    rows = {row[0]: row[1:] for row in report.headline_rows(runs)}
    test = rows["Pre-Norm / QKV-Norm: per-token accuracy, test"]
    assert test[0] == "85.0 % [80.0–90.0] / 68.3 % [60.0–75.0]"
    assert test[1] == "91.4 % / 91.0 %"
    assert test[2] == "holds beyond the seed spread (3 / 3 seeds)"
    band = rows["Pre-Norm / QKV-Norm: half-width of the band holding 90 % of |x| / median "
                "(each head's ratios to its own median, attention-weighted, pooled over layers and heads)"]
    assert band[0] == "20.0 % [20.0–20.0] / 20.0 % [20.0–20.0]"
    assert band[2].startswith("within the seed spread")
    sparse = "share of queries and heads with max attention ≥ 0.95 (sparse), among queries with at least the replay's min_keys"
    assert rows[f"Pre-Norm / QKV-Norm: {sparse} allowed keys"][0].startswith("50.0 %")
    assert rows["Seeds (models) per placement, Pre-Norm / QKV-Norm"][0] == "3 / 3"


def test_headline_gives_theorem_7s_recall_and_precision_at_10_percent_noise_where_swept():
    runs = runs_of({"pre": [0.9, 0.8], "qkv": [0.7, 0.75]}, recall=0.9, precision=0.75)
    rows = {row[0]: row[1:] for row in report.headline_rows(runs)}
    theorem = ("Pre-Norm / QKV-Norm: Theorem 7's first-order condition at 10 % noise, (query, head, draw) instances "
               "of every layer and head pooled: ")
    assert rows[theorem + "recall (share of the measured collapses it predicted)"][0] == (
        "90.0 % [90.0–90.0] / 90.0 % [90.0–90.0]")
    assert rows[theorem + "precision (share of its predicted collapses that happened)"] == (
        "75.0 % [75.0–75.0] / 75.0 % [75.0–75.0]", "—", "—")
    for run in runs:  # a replay that did not sweep 10 %: no row
        run.tree["replay"] = xr.DataTree(run.tree["replay"].to_dataset().isel(level=[0]))
    assert not [row for row in report.headline_rows(runs) if "Theorem 7" in row[0]]


def test_one_seeds_headline_gives_its_interval_from_resampling_documents():
    runs = runs_of({"pre": [0.9], "qkv": [0.7]})
    for run in runs:
        replay = run.tree["replay"].to_dataset()
        replay["collapse_level_pooled_ci"] = (("definition", "bound"), [[0.09, 0.115], [0.18, np.inf]])
        replay["theory_recall_pooled_ci"] = (("level", "bound"), [[np.nan, np.nan], [0.85, 0.95]])
        replay.attrs["confidence"] = 0.95
        run.tree["replay"] = xr.DataTree(replay)
    rows = {row[0]: row[1] for row in report.headline_rows(runs)}
    collapse = "noise RMS at which 1 % of sparse (query, head) instances collapse, counted over instances and noise draws"
    assert rows[f"Pre-Norm / QKV-Norm: {collapse}"] == " / ".join(
        ["10.0 % (95 % interval 9.0 %–11.5 %, documents resampled)"] * 2)
    strict = [value for key, value in rows.items() if "strictly collapse" in key]
    assert strict == [" / ".join(["20.0 % (95 % interval 18.0 %–beyond the noise tested, documents resampled)"] * 2)]
    recall = [value for key, value in rows.items() if "Theorem 7" in key and "recall" in key]
    assert recall == [" / ".join(["90.0 % (95 % interval 85.0 %–95.0 %, documents resampled)"] * 2)]


def test_the_norm_spread_figure_gives_each_layers_band_and_the_pooled_one():
    figure = figures.figure_norm_spread(runs_of({"pre": [0.9], "qkv": [0.7]}, band=0.25))
    first = figure.axes[0]
    assert first.get_title() == "pre-s0: band ±25 % (layers and heads pooled)"
    legend = [text.get_text() for text in first.get_legend().get_texts()]
    assert legend == ["layer 0: band ±12 %", "layer 1: band ±72 %", "±20 % (paper)"]
    assert "heads pooled" in figure.get_suptitle() and "90 %" in figure.get_suptitle()


@pytest.mark.parametrize("pre, qkv, direction, verdict", [
    ([0.9, 0.8], [0.7, 0.6], 1, "holds beyond the seed spread (2 / 2 seeds)"),
    ([0.6, 0.5], [0.7, 0.8], 1, "reversed beyond the seed spread (2 / 2 seeds)"),
    ([0.9, 0.6], [0.7, 0.65], 1, "within the seed spread; means: same direction (2 / 2 seeds)"),
    ([0.9, 0.6], [0.7, 0.65], -1, "within the seed spread; means: reversed (2 / 2 seeds)"),
    ([0.1], [0.3], -1, "cannot be told from seed noise with one seed; means: same direction (1 / 1 seeds)"),
    ([0.1, 0.2], [0.3, np.nan], -1, "cannot be told from seed noise with one seed; means: same direction (2 / 1 seeds)"),
    ([0.1], [], 1, "n/a (needs both placements)"),
    ([0.1], [0.2], 0, "—"),
])
def test_direction_verdict(pre, qkv, direction, verdict):
    assert report.direction_verdict(pre, qkv, direction) == verdict


def test_the_accuracy_figure_draws_one_bar_group_per_variant():
    figure = figures.figure_accuracy(runs_of({"pre": [0.9, 0.8], "qkv": [0.7, 0.75]}))
    legend = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert legend == ["arithmetic: pre (2 models)", "arithmetic: qkv (2 models)"]


def test_learning_curves_come_from_the_models_metrics_where_readable(tmp_path):
    import json

    runs = runs_of({"pre": [0.9], "qkv": [0.7]})
    assert figures.figure_learning_curves(runs) is None  # the model folders are not here
    folder = tmp_path / "pre-s0"
    folder.mkdir()
    history = [{"step": s, "test_token_accuracy": a, "interpolation_token_accuracy": a,
                "extrapolation_token_accuracy": a / 2} for s, a in ((1000, 0.5), (2000, 0.8))]
    (folder / "metrics.json").write_text(json.dumps({"history": history}))
    runs[0].tree.attrs["model"]["source"] = str(folder)
    assert run_model.training_history(runs[0]) == history
    figure = figures.figure_learning_curves(runs)
    (line,) = figure.axes[0].get_lines()
    assert list(line.get_ydata()) == [50.0, 80.0]


def test_a_level_some_seeds_never_reach_is_counted_not_averaged():
    assert report._spread([0.2, 0.22, np.inf]) == "21.0 % [20.0–22.0] (never reached by 1 of 3)"
    assert report._spread([np.inf, np.inf, None]) == "never reached (2 of 2)"
    assert report._spread([0.1, None]) == "10.0 %"
    assert report._spread([None, np.nan]) == "n/a"


def test_models_that_differ_only_in_placement_pair_up_from_the_extractors_own_descriptions():
    """The pairing read from real store descriptions (the extractor's, every placement), so that a
    key the extractor adds for one placement cannot split the Pre-Norm / QKV-Norm pair unnoticed."""
    pytest.importorskip("torch")
    from orthosphere.extract.adapters import adapter_for
    from orthosphere.extract.model import NORM_PLACEMENTS, ArithmeticTransformer, ModelConfig

    runs = []
    for placement in NORM_PLACEMENTS:
        model = ArithmeticTransformer(ModelConfig(n_layers=2, d_model=32, n_heads=4, d_ff=64, norm_placement=placement))
        for seed in range(2):
            tree = results_tree(f"/models/{placement}-s{seed}", f"{placement}{seed}" * 8, placement, "test", 0.8)
            tree.attrs["model"] = {**adapter_for(model).describe(), "source": f"/models/{placement}-s{seed}",
                                   "weights_sha256": f"{placement}{seed}" * 8}
            runs.append(run_model.Run(f"{placement}-s{seed}.zarr", tree))
    (family,) = report.families(run_model.name_runs(runs))
    assert {placement: [run.name for run in members] for placement, members in family.items()} == {
        "pre": ["pre-s0", "pre-s1"], "qkv": ["qkv-s0", "qkv-s1"]}


def test_a_run_is_named_by_the_options_that_differ_from_the_defaults_and_configuration_json_holds_all(tmp_path):
    from orthosphere.analyze.options import as_attrs
    from orthosphere.analyze.results import get_analysis

    runs = runs_of({"pre": [0.9]})
    defaults = as_attrs(get_analysis("norms").defaults)
    for run in runs:
        run.tree["norms"].attrs["options"] = {**defaults, "mass": 0.5}
        run.tree["accuracy"].attrs["options"] = {}
    line = report._provenance(runs)[0]
    assert "options beside the defaults {'norms': {'mass': 0.5}}" in line and "quantiles" not in line
    configuration = report._configuration(runs)
    assert configuration[runs[0].label]["options"]["norms"] == {**defaults, "mass": 0.5}
    for run in runs:
        run.tree["norms"].attrs["options"] = defaults
    assert "every option at its default" in report._provenance(runs)[0]


def written(tree: xr.DataTree, path) -> str:
    """`tree` written as results of a store at /stores/s.zarr; returns its path."""
    from orthosphere.analyze.results import write_results

    tree.attrs |= {"orthosphere_results": 1, "store": "/stores/s.zarr"}
    write_results(tree, path)
    return str(path)


def test_a_store_given_as_results_is_refused_with_what_to_do(tmp_path):
    import zarr

    zarr.create_group(str(tmp_path / "s.zarr"), zarr_format=3, attributes={"schema": 1})
    with pytest.raises(report.AnalysisError, match=r"s.zarr is a store, not analysis results: analyze it first \(orthosphere "
                       r"analyze .*s.zarr --out RESULTS\)"):
        report.write_report(str(tmp_path / "s.zarr"), tmp_path / "report")
    zarr.create_group(str(tmp_path / "other.zarr"), zarr_format=3)
    with pytest.raises(report.AnalysisError, match="other.zarr is not orthosphere results"):
        report.write_report(str(tmp_path / "other.zarr"), tmp_path / "report")
    assert not (tmp_path / "report").exists()


def test_report_takes_one_path_or_a_list_and_the_keyword_out(tmp_path):
    results = written(results_tree("/models/pre", "1" * 64, "pre", "test", 0.9), tmp_path / "r.zarr")
    assert (report.write_report(results, tmp_path / "one") / "report.md").is_file()
    assert (report.write_report([results], out=tmp_path / "list") / "report.md").is_file()
    with pytest.raises(TypeError, match="results of type DataTree: .* pass the path that `orthosphere.analyze"):
        report.write_report(results_tree("/models/pre", "1" * 64, "pre", "test", 0.9), tmp_path / "tree")
    with pytest.raises(TypeError, match="results of type int: expected the path or URL of results"):
        report.write_report([results, 3], tmp_path / "int")


def test_a_report_into_an_earlier_reports_folder_removes_only_its_stale_figures(tmp_path):
    results = written(results_tree("/models/pre", "1" * 64, "pre", "test", 0.9), tmp_path / "r.zarr")
    out = tmp_path / "report"
    (out / "figures").mkdir(parents=True)
    for name in ("angles.png", "mine.png"):
        (out / "figures" / name).write_bytes(b"old")
    report.write_report(results, out)
    drawn = {path.name for path in (out / "figures").iterdir()}
    assert "angles.png" not in drawn and "mine.png" in drawn and "norm_spread.png" in drawn


def test_two_results_of_one_model_on_one_data_are_refused_not_dropped():
    trees = [results_tree("/models/pre", "1" * 64, "pre", "test", accuracy) for accuracy in (0.9, 0.8)]
    with pytest.raises(report.AnalysisError, match=r"results a.zarr and b.zarr are both of model pre on data 'test': .*"
                       "report them separately"):
        run_model.name_runs([run_model.Run("a.zarr", trees[0]), run_model.Run("b.zarr", trees[1])])


def test_damaged_results_are_refused_naming_the_results_and_the_array_and_no_report_is_left(tmp_path):
    import shutil

    results = written(results_tree("/models/pre", "1" * 64, "pre", "test", 0.9), tmp_path / "r.zarr")
    shutil.copytree(results, tmp_path / "fine.zarr")
    shutil.rmtree(tmp_path / "r.zarr" / "replay" / "n_sparse")
    with pytest.raises(report.AnalysisError, match=r"r.zarr are damaged: replay/n_sparse/zarr.json, replay/n_sparse/c/0/0 are "
                       r"missing; re-run `orthosphere analyze /stores/s.zarr --out .*r.zarr --only replay`"):
        report.write_report(results, tmp_path / "report")
    shutil.copytree(tmp_path / "fine.zarr", tmp_path / "chunk.zarr")
    (tmp_path / "chunk.zarr" / "accuracy" / "token_accuracy" / "c").unlink()
    with pytest.raises(report.AnalysisError, match=r"damaged: accuracy/token_accuracy/c is missing; .* --only accuracy`"):
        report.write_report(str(tmp_path / "chunk.zarr"), tmp_path / "report")
    chunk = next(path for path in (tmp_path / "fine.zarr" / "replay" / "n_instances").rglob("*") if path.is_file()
                 and path.name != "zarr.json")
    chunk.write_bytes(chunk.read_bytes()[:5])
    with pytest.raises(report.AnalysisError, match=r"fine.zarr are damaged: array replay/n_instances does not decode"):
        report.write_report(str(tmp_path / "fine.zarr"), tmp_path / "report")
    (tmp_path / "fine.zarr" / "zarr.json").write_text('{"attributes": {')
    with pytest.raises(report.AnalysisError, match=r"fine.zarr are damaged: their root metadata .*zarr.json does not parse"):
        report.write_report(str(tmp_path / "fine.zarr"), tmp_path / "report")
    assert not (tmp_path / "report").exists()


def test_headline_and_figures_word_each_runs_settings_and_say_where_the_compared_runs_differ():
    runs = runs_of({"pre": [0.9]}, collapse_target=0.05, sparse_threshold=0.8) + runs_of({"qkv": [0.7]})
    runs = run_model.name_runs(runs)
    runs[0].tree["norms/resid_pre"].attrs |= {"mass": 0.5, "weighting": "uniform"}
    quantities = [row[0] for row in report.headline_rows(runs)]
    assert any("band holding 50 % / 90 % (Pre-Norm / QKV-Norm) of |x| / median (each head's ratios to its own median, "
               "unweighted (every token alike) / attention-weighted (Pre-Norm / QKV-Norm)," in quantity for quantity in quantities)
    assert any("at which 5 % / 1 % (Pre-Norm / QKV-Norm) of sparse (query, head) instances collapse" in quantity
               for quantity in quantities)
    assert any("max attention ≥ 0.8 / 0.95 (Pre-Norm / QKV-Norm) (sparse)" in quantity for quantity in quantities)
    notes = run_model.setting_differences(runs)
    assert len(notes) == 4 and notes[0].startswith("The runs compared differ in the share of |x| a norm band holds "
                                                   "(norms mass): 50 % (pre-s0); 90 % (qkv-s0).")
    spread = figures.figure_norm_spread(runs)
    assert [axis.get_ylabel() for axis in spread.axes] == ["share of tokens", "share of attention"]
    assert "bands hold 50 % or 90 %" in spread.get_suptitle()
    for run in runs:
        replay = run.tree["replay"].to_dataset()
        replay["collapse_rate"] = xr.zeros_like(replay.n_sparse * replay.level * replay.definition.size)
        replay["collapse_rate"] = replay.collapse_rate.expand_dims(definition=replay.definition)
        replay["predicted_collapse_rate"] = replay.collapse_rate.sel(definition="collapse", drop=True)
        run.tree["replay"] = xr.DataTree(replay)
    collapse = figures.figure_collapse(runs).axes[0]
    assert sorted(line.get_ydata()[0] for line in collapse.get_lines() if line.get_label().startswith("collapse level")) == [1, 5]
    assert run_model.setting_differences(runs_of({"pre": [0.9], "qkv": [0.7]})) == []


def test_verdicts_without_an_estimate_are_marked_at_the_foot_of_the_panel():
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots()
    figures._with_interval(axis, [0, 1, 2], [10.0, np.nan, np.nan], [[8, 12], [np.nan, np.nan], [np.nan, np.nan]],
                           ["orthogonal", "undetermined", "no structure"], figures.RELATION_MARKERS, "C0", "a / b")
    markers = [line.get_marker() for line in axis.get_lines() if line.get_marker() not in ("None", "_")]  # no caps
    assert markers == ["o", "x", "."]
    plt.close(figure)


def subspaces_group(estimator: str) -> xr.Dataset:
    """/subspaces with two factors over layers 3 and 4, the second layer's estimate undetermined."""
    pair = (("factor", "other", "layer"), np.full((2, 2, 2), 40.0))
    group = xr.Dataset({
        "min_angle": pair, "min_angle_estimate": pair, "label_nmi": (("factor", "other"), np.zeros((2, 2))),
        "min_angle_ci": (("factor", "other", "layer", "bound"), np.full((2, 2, 2, 2), 35.0)),
        "relation": (("factor", "other", "layer"), np.full((2, 2, 2), "independent", dtype=object)),
    }, coords={"factor": ["a", "b"], "other": ["a", "b"], "layer": [3, 4]}, attrs={"estimator": estimator, "intercepts": "role"})
    group["min_angle_estimate"][0, 1, 1] = np.nan
    group["relation"][0, 1, 1] = "undetermined"
    return group


def test_the_association_table_names_each_layer_and_every_runs_fit():
    runs = runs_of({"pre": [0.9], "qkv": [0.7]})
    for run, estimator in zip(run_model.in_distribution(runs), ("joint", "separate")):
        run.tree["subspaces"] = xr.DataTree(subspaces_group(estimator))
    axis = figures.figure_association(runs).axes[0]
    cells = [cell.get_text().get_text() for cell in axis.tables[0].get_celld().values()]
    assert "3: 40 [35, 35] independent; 4: undetermined" in cells
    assert axis.get_title() == ("Label association and angles against chance (estimator: joint, intercepts: role (pre-s0); "
                                "estimator: separate, intercepts: role (qkv-s0))")


def test_the_report_says_which_sites_norms_it_shows_and_which_it_leaves_out(tmp_path):
    runs = runs_of({"pre": [0.9]})
    assert report.site_notes(runs) == []
    runs[0].tree["norms/q"] = xr.DataTree(runs[0].tree["norms/resid_pre"].to_dataset())
    (note,) = report.site_notes(runs)
    assert note.startswith("Norms: the results hold those of q, resid_pre; the report shows those of resid_pre (the "
                           "attention input) and leaves out q")
    tree = results_tree("/models/pre", "1" * 64, "pre", "test", 0.9)
    tree["norms/attn_in"] = xr.DataTree(tree["norms/resid_pre"].to_dataset())
    out = report.write_report(written(tree, tmp_path / "r.zarr"), tmp_path / "report")
    assert "leaves out attn_in" in (out / "report.md").read_text() and "leaves out attn_in" in (out / "report.html").read_text()
