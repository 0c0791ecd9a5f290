"""The report: runs keyed by model identity (never by placement alone), seeds of one variant
summarised as mean [min–max], and whether the paper's direction holds beyond the seed spread."""

import numpy as np
import pytest
import xarray as xr

from orthosphere.workflows import report

SPEC = {"train_counts": [3, 4, 6], "digit_lengths": [1, 2]}


def results_tree(source: str, sha: str, placement: str, split: str, accuracy: float, band: float = 0.2,
                 sparse: int = 50, d_model: int = 64) -> xr.DataTree:
    """A results tree holding what the headline reads, for one (model, data) pair."""
    model = {"family": "arithmetic", "norm_placement": placement, "n_layers": 2, "d_model": d_model,
             "n_heads": 4, "d_head": d_model // 4, "source": source, "weights_sha256": sha}
    layer_head = {"layer": [0, 1], "head": [0, 1, 2, 3]}
    replay = xr.Dataset({
        "collapse_level_pooled": ("definition", [0.1, 0.2]),
        "n_sparse": (("layer", "head"), np.full((2, 4), sparse)),
        "n_instances": (("layer", "head"), np.full((2, 4), 100)),
    }, coords={"definition": ["collapse", "strict"], **layer_head})
    tree = xr.DataTree.from_dict({
        "/accuracy": xr.Dataset({"token_accuracy": accuracy}),
        "/norms/resid_pre": xr.Dataset({"band": (("layer", "head"), np.full((2, 4), band))}, coords=layer_head),
        "/replay": replay,
    })
    tree.attrs = {"model": model, "task": {"name": "arithmetic", "split": split, "spec": SPEC}}
    return tree


def runs_of(accuracies: dict[str, list[float]], **kwargs) -> list[report.Run]:
    """placement -> per-seed test accuracy; seed s of placement p lives in folder p-s{s}."""
    runs = []
    for placement, values in accuracies.items():
        for seed, value in enumerate(values):
            source = f"/models/{placement}-s{seed}"
            for split, shift in (("test", 0.0), ("extrapolation", -0.2)):
                tree = results_tree(source, f"{placement}{seed}" * 8, placement, split, value + shift, **kwargs)
                runs.append(report.Run(f"{source}-{split}.zarr", tree))
    return report.name_runs(runs)


def test_seeds_of_one_placement_are_all_kept_and_grouped_into_one_variant():
    runs = runs_of({"pre": [0.9, 0.8, 0.85], "qkv": [0.7, 0.75, 0.6]})
    assert [run.name for run in report.in_distribution(runs)] == [f"{p}-s{s}" for p in ("pre", "qkv") for s in range(3)]
    assert sorted(len(members) for members in report.variants(runs).values()) == [3, 3]
    (family,) = report.families(runs)
    assert [run.name for run in family["pre"]] == ["pre-s0", "pre-s1", "pre-s2"]
    assert report.accuracy_table(runs)["qkv-s2"] == pytest.approx({"test": 60.0, "extrapolation": 40.0})


def test_two_models_that_share_a_folder_name_never_collide():
    trees = [results_tree(f"/{where}/pre", sha, "pre", "test", 0.9) for where, sha in (("a", "1" * 64), ("b", "2" * 64))]
    runs = report.name_runs([report.Run(f"r{i}.zarr", tree) for i, tree in enumerate(trees)])
    assert [run.name for run in runs] == ["pre@11111111", "pre@22222222"]
    assert len(report.in_distribution(runs)) == 2


def test_models_of_different_sizes_are_different_variants_and_labelled_by_size():
    runs = report.name_runs([report.Run("a.zarr", results_tree("/m/small", "1" * 64, "pre", "test", 0.9)),
                             report.Run("b.zarr", results_tree("/m/large", "2" * 64, "pre", "test", 0.9, d_model=128))])
    labels = sorted(report.variant_labels(runs).values())
    assert labels == ["pre (2 layers, d_model 128, 4 heads of 32)", "pre (2 layers, d_model 64, 4 heads of 16)"]
    assert len(report.families(runs)) == 2


def test_headline_gives_mean_and_spread_over_seeds_and_judges_the_direction():
    runs = runs_of({"pre": [0.9, 0.8, 0.85], "qkv": [0.7, 0.75, 0.6]}, band=0.2)
    rows = {row[0]: row[1:] for row in report.headline_rows(runs)}
    test = rows["Pre-Norm / QKV-Norm: per-token accuracy, test"]
    assert test[0] == "85.0 % [80.0–90.0] / 68.3 % [60.0–75.0]"
    assert test[1] == "91.4 % / 91.0 %"
    assert test[2] == "holds beyond the seed spread (3 / 3 seeds)"
    band = rows["Pre-Norm / QKV-Norm: half-width of the band holding 90 % of |x| / median "
                "(attention-weighted; median over layers and heads)"]
    assert band[0] == "20.0 % [20.0–20.0] / 20.0 % [20.0–20.0]"
    assert band[2].startswith("within the seed spread")
    assert rows["Pre-Norm / QKV-Norm: share of queries and heads with max attention ≥ 0.95 (sparse)"][0].startswith("50.0 %")
    assert rows["Seeds (models) per placement, Pre-Norm / QKV-Norm"][0] == "3 / 3"


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
    figure = report.figure_accuracy(runs_of({"pre": [0.9, 0.8], "qkv": [0.7, 0.75]}))
    legend = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert legend == ["pre (2 models)", "qkv (2 models)"]


def test_learning_curves_come_from_the_models_metrics_where_readable(tmp_path):
    import json

    runs = runs_of({"pre": [0.9], "qkv": [0.7]})
    assert report.figure_learning_curves(runs) is None  # the model folders are not here
    folder = tmp_path / "pre-s0"
    folder.mkdir()
    history = [{"step": s, "test_token_accuracy": a, "interpolation_token_accuracy": a,
                "extrapolation_token_accuracy": a / 2} for s, a in ((1000, 0.5), (2000, 0.8))]
    (folder / "metrics.json").write_text(json.dumps({"history": history}))
    runs[0].tree.attrs["model"]["source"] = str(folder)
    assert report.training_history(runs[0]) == history
    figure = report.figure_learning_curves(runs)
    (line,) = figure.axes[0].get_lines()
    assert list(line.get_ydata()) == [50.0, 80.0]
