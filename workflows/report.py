"""Reports: `orthosphere report RESULTS... --out DIR` writes report.html (figures embedded) and
report.md (figures beside it in figures/) from analysis results.

Each results tree is one (model, data) pair: the model's identity (its folder's name, or that
and a hash prefix where two models share a name) and the data's split label it. Models whose
descriptions differ only in their weights are seeds of one variant. The report draws the norm
spread, the smallest principal angles per layer with their intervals and relations, the spheres'
radius spread and cross terms per layer with their intervals, the collapse rate against noise
beside Theorem 7's prediction, the max-attention histograms and the accuracy per split, and puts
the headline figures beside the paper's (Theorem 7's recall and precision among them): each as the
mean over seeds with its [min–max], and whether the paper's Pre-Norm / QKV-Norm direction holds
beyond the seed spread.
"""
from __future__ import annotations

import base64
import html
import io
import json
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import xarray as xr  # noqa: E402

from orthosphere.analyze import open_results  # noqa: E402
from orthosphere.analyze.description import describe_norms  # noqa: E402
from orthosphere.analyze.options import as_attrs  # noqa: E402
from orthosphere.analyze.results import get_analysis  # noqa: E402
from orthosphere.errors import AnalysisError  # noqa: E402

PAPER = {
    "accuracy": {"pre": {"test": 91.38, "interpolation": 87.46, "extrapolation": 66.65},
                 "qkv": {"test": 90.99, "interpolation": 82.54, "extrapolation": 46.76}},
    "size": "10 layers, d_model 512, 12 heads of 64",
}
SPLIT_ORDER = ("test", "interpolation", "extrapolation")
PLACEMENT_ORDER = ("pre", "qkv", "none", "post")


IDENTITY_KEYS = ("source", "weights_sha256", "format")
"""Model description keys that tell one trained model from another of the same variant."""
PLACEMENT_KEYS = ("norm_placement", "norms", "qk_norm", "v_norm", "n_parameters")
"""Model description keys that follow from the norm placement (QKV-Norm adds per-head norms and
their parameters): two configurations that differ only in these differ only in the placement."""


@dataclass
class Run:
    """One results tree: which model on which data, and its groups. ``name`` identifies the
    model (its folder's name, made unique by load_runs); runs of models that differ only in
    their weights (seeds) share a ``variant``."""

    url: str
    tree: xr.DataTree
    name: str = ""

    @property
    def model(self) -> dict:
        return self.tree.attrs.get("model", {})

    @property
    def placement(self) -> str:
        return str(self.model.get("norm_placement") or self.model.get("family") or "model")

    @property
    def split(self) -> str:
        task = self.tree.attrs.get("task", {})
        return str(task.get("split") or task.get("name") or "data")

    @property
    def label(self) -> str:
        return f"{self.name}/{self.split}"

    @property
    def variant(self) -> str:
        """The model's description without its identity, with the task it was made for: equal
        for the seeds of one configuration."""
        description = {key: value for key, value in self.model.items() if key not in IDENTITY_KEYS}
        return json.dumps([description, self.tree.attrs.get("task", {}).get("spec")], sort_keys=True, default=str)

    def group(self, path: str) -> xr.Dataset | None:
        try:
            return self.tree[path].to_dataset()
        except KeyError:
            return None


def _model_name(model: dict) -> str:
    source = str(model.get("source") or model.get("family") or "model")
    return source.rstrip("/").rsplit("/", 1)[-1] or source


def load_runs(urls) -> list[Run]:
    """Open results; runs of one model (same weights) share a name, two models never do."""
    return name_runs([Run(str(url), open_results(url).load()) for url in urls])


def name_runs(runs: list[Run]) -> list[Run]:
    """Name every run by its model (folder name, with a hash prefix where two models share one)
    and sort them by placement, model and split."""
    if not runs:
        raise ValueError("no results given: pass one or more results written by `orthosphere analyze`")
    identities: dict[str, set] = {}
    for run in runs:
        identities.setdefault(_model_name(run.model), set()).add(run.model.get("weights_sha256"))
    for run in runs:
        name = _model_name(run.model)
        clash = len(identities[name]) > 1
        run.name = f"{name}@{str(run.model.get('weights_sha256'))[:8]}" if clash else name
    order = {name: i for i, name in enumerate(PLACEMENT_ORDER)}
    splits = {name: i for i, name in enumerate(SPLIT_ORDER)}
    return sorted(runs, key=lambda run: (order.get(run.placement, 99), run.placement, run.name,
                                         splits.get(run.split, 99), run.split))


def groups(runs: list[Run], path: str, variable: str) -> list[tuple[Run, xr.Dataset]]:
    """(run, group) for each model's in-distribution run whose group `path` holds `variable`."""
    found = [(run, run.group(path)) for run in in_distribution(runs)]
    return [(run, group) for run, group in found if group is not None and variable in group]


def in_distribution(runs: list[Run]) -> list[Run]:
    """One run per model: its in-distribution data where there is one, else its first."""
    chosen: dict[str, Run] = {}
    for run in runs:
        if run.name not in chosen or (run.split == "test" and chosen[run.name].split != "test"):
            chosen[run.name] = run
    return list(chosen.values())


def variants(runs: list[Run]) -> dict[str, list[Run]]:
    """variant -> its models' in-distribution runs (one per seed), in run order."""
    found: dict[str, list[Run]] = {}
    for run in in_distribution(runs):
        found.setdefault(run.variant, []).append(run)
    return found


# Figures -------------------------------------------------------------------------------------

def _axes_grid(n: int, width: float = 4.2, height: float = 3.2):
    columns = min(n, 4)
    rows = int(np.ceil(n / columns))
    figure, axes = plt.subplots(rows, columns, figsize=(width * columns, height * rows), squeeze=False,
                                layout="constrained")
    for axis in axes.flat[n:]:
        axis.set_visible(False)
    return figure, list(axes.flat[:n])


def figure_norm_spread(runs: list[Run]):
    """|x| / median of the attention input, per layer (each head's ratios to its own median, pooled over the
    layer's heads with their weights), one panel per placement; the legend gives each layer's band
    (band_layer), the title the band over every layer and head (band_pooled)."""
    panels = groups(runs, "norms/resid_pre", "histogram")
    if not panels:
        return None
    figure, axes = _axes_grid(len(panels))
    for axis, (run, norms) in zip(axes, panels):
        histogram = norms.histogram
        if "head" in histogram.dims:
            weights = norms.weight_total.fillna(0)
            histogram = (histogram * weights).sum("head") / weights.sum("head")
        for layer in histogram.layer.values:
            curve = histogram.sel(layer=layer)
            band = float(norms.band_layer.sel(layer=layer)) * 100
            axis.plot(curve.ratio, curve / curve.sum(), label=f"layer {layer}: band ±{band:.0f} %")
        axis.axvspan(0.8, 1.2, color="0.9", zorder=0, label="±20 % (paper)")
        axis.set(title=f"{run.name}: band ±{float(norms.band_pooled) * 100:.0f} % (layers and heads pooled)",
                 xlabel="|resid_pre| / median", ylabel="share of attention", xlim=(0, float(curve.ratio.max())))
        axis.legend(fontsize=7)
    pooled = ", each head's |x| over its own median, heads pooled" if "head" in norms.band.dims else ""
    figure.suptitle(f"Norm spread of the attention input ({norms.attrs['weighting']} weighting{pooled}; "
                    f"bands hold {norms.attrs['mass'] * 100:.0f} %)")
    return figure


RELATION_MARKERS = {"orthogonal": "o", "independent": "s", "dependent": "v", "undetermined": "x", "no structure": "."}
SPHERE_MARKERS = {"on sphere": "o", "off sphere": "s", "undetermined": "x", "no structure": "."}


def _pairs(names: list[str]) -> list[tuple[str, str]]:
    return [(first, second) for a, first in enumerate(names) for second in names[a + 1:]]


def _with_interval(axis, x, estimate, interval, verdicts, markers, colour, label):
    """A line of estimates per layer with their intervals as error bars, each point marked by its verdict."""
    estimate, low, high = np.asarray(estimate, float), *np.asarray(interval, float).T
    axis.errorbar(x, estimate, yerr=[np.maximum(estimate - low, 0), np.maximum(high - estimate, 0)], color=colour,
                  capsize=2, lw=1, label=label)
    for layer, value, verdict in zip(x, estimate, verdicts):
        if np.isfinite(value):
            axis.plot(layer, value, markers.get(str(verdict), "."), color=colour, ms=6, mfc="none" if verdict == "undetermined" else colour)


def figure_angles(runs: list[Run]):
    """Per placement, the smallest principal angle of each pair of factors per layer: its noise-corrected
    estimate, its interval (error bars) and the pair's relation (marker), the claims' tolerances shaded."""
    panels = groups(runs, "subspaces", "min_angle_ci")
    if not panels:
        return None
    figure, axes = _axes_grid(len(panels), width=4.8, height=3.6)
    for axis, (run, subspaces) in zip(axes, panels):
        pairs = _pairs([str(f) for f in subspaces.factor.values])
        for number, (first, second) in enumerate(pairs):
            pair = subspaces.sel(factor=first, other=second)
            _with_interval(axis, subspaces.layer.values, pair.min_angle_estimate.values, pair.min_angle_ci.values,
                           pair.relation.values, RELATION_MARKERS, f"C{number}", f"{first} / {second}")
        axis.axhspan(90 - subspaces.attrs["orthogonality_deg"], 90, color="0.92", zorder=0)
        axis.axhspan(0, subspaces.attrs["independence_deg"], color="0.92", zorder=0)
        axis.set(title=f"{run.name}: smallest angle (°)", xlabel="layer", ylim=(0, 92),
                 xticks=subspaces.layer.values)
        axis.legend(fontsize=6)
    shown = ", ".join(f"{marker} {name}" for name, marker in RELATION_MARKERS.items())
    figure.suptitle(f"Smallest principal angle between factor subspaces per layer: noise-corrected estimate, "
                    f"{panels[0][1].attrs['confidence'] * 100:.0f} % interval, relation ({shown}; shaded: the claims' "
                    "tolerances)", fontsize=9)
    return figure


def figure_association(runs: list[Run]):
    """Per placement and pair of factors: how associated their labels are (NMI), the smallest angle per
    layer (estimate [interval]) beside what chance gives (the null's, mean over layers), and each layer's
    relation."""
    panels = groups(runs, "subspaces", "label_nmi")
    if not panels:
        return None
    rows = []
    for run, subspaces in panels:
        for first, second in _pairs([str(name) for name in subspaces.factor.values]):
            pair = subspaces.sel(factor=first, other=second)
            layers = "; ".join(_angle_cell(estimate, interval, relation) for estimate, interval, relation in
                               zip(pair.min_angle_estimate.values, pair.min_angle_ci.values, pair.relation.values))
            null = pair.null_min_angle.mean("layer").item() if "null_min_angle" in pair else np.nan
            rows.append([run.name, first, second, f"{pair.label_nmi.item():.2f}",
                         f"{pair.min_angle.mean('layer').item():.1f}", f"{null:.1f}", layers])
    figure, axis = plt.subplots(figsize=(15, 0.3 * len(rows) + 0.9))
    axis.axis("off")
    table = axis.table(cellText=rows, loc="upper center", cellLoc="left",
                       colLabels=["model", "factor", "other", "label NMI", "smallest angle (°)", "null (°)",
                                  "per layer: estimate [interval] relation"])
    table.auto_set_font_size(False)
    table.set_fontsize(6)
    table.auto_set_column_width(list(range(7)))
    axis.set_title(f"Label association and angles against chance (estimator: {panels[0][1].attrs.get('estimator')}, "
                   f"intercepts: {panels[0][1].attrs.get('intercepts', 'none')})")
    return figure


def _angle_cell(estimate: float, interval, relation) -> str:
    if not np.isfinite(estimate):
        return str(relation) or "–"
    return f"{estimate:.0f} [{interval[0]:.0f}, {interval[1]:.0f}] {relation}"


def figure_spheres(runs: list[Run]):
    """Per placement: each factor's radius spread per layer (estimate, interval, verdict; the tolerance
    dashed), and each pair's cross term per layer (interval, and the range noise gives with orthogonal
    subspaces as a band)."""
    panels = groups(runs, "spheres", "radius_cv_ci")
    if not panels:
        return None
    columns = len(panels)
    figure, axes = plt.subplots(2, columns, figsize=(4.6 * columns, 6.4), squeeze=False, layout="constrained")
    for column, (run, spheres) in enumerate(panels):
        top, bottom = axes[0, column], axes[1, column]
        for number, factor in enumerate(str(f) for f in spheres.factor.values):
            one = spheres.sel(factor=factor)
            _with_interval(top, spheres.layer.values, one.radius_cv_estimate.values, one.radius_cv_ci.values,
                           one.sphere.values, SPHERE_MARKERS, f"C{number}", factor)
        top.axhline(spheres.attrs["radius_cv_tolerance"], color="0.5", ls="--", lw=1)
        top.set_yscale("symlog", linthresh=0.2)  # spreads near the tolerance stay readable beside large ones
        top.set(title=f"{run.name}: radius spread (CV over classes)", xlabel="layer", ylim=(0, None),
                xticks=spheres.layer.values)
        top.legend(fontsize=6)
        for number, (first, second) in enumerate(_pairs([str(f) for f in spheres.factor.values])):
            pair = spheres.sel(factor=first, other=second)
            low, high = pair.cross_term_ci.values.T
            bottom.errorbar(spheres.layer.values, pair.cross_term.values, color=f"C{number}", capsize=2, lw=1,
                            yerr=[np.maximum(pair.cross_term.values - low, 0), np.maximum(high - pair.cross_term.values, 0)],
                            marker="o", label=f"{first} / {second}")
            null_low, null_high = pair.cross_term_null_ci.values.T
            bottom.fill_between(spheres.layer.values, null_low, null_high, color=f"C{number}", alpha=0.15)
        bottom.set(title="cross term (rms cosine of the components)", xlabel="layer", ylim=(0, None),
                   xticks=spheres.layer.values)
        bottom.legend(fontsize=6)
    shown = ", ".join(f"{marker} {name}" for name, marker in SPHERE_MARKERS.items())
    figure.suptitle(f"Orthogonal spheres per layer: radius spread with its interval and verdict ({shown}); cross terms "
                    "with their interval, shaded where noise alone puts them", fontsize=9)
    return figure


def pooled_rates(replay: xr.Dataset) -> tuple[xr.DataArray, xr.DataArray]:
    """Measured and Theorem-7 collapse rates against noise, pooled over layers and heads."""
    weights = replay.n_sparse.fillna(0)
    measured = replay.collapse_rate.sel(definition="collapse")
    predicted = replay.predicted_collapse_rate
    total = weights.sum()
    return ((measured.fillna(0) * weights).sum(("layer", "head")) / total,
            (predicted.fillna(0) * weights).sum(("layer", "head")) / total)


def figure_collapse(runs: list[Run]):
    lines = groups(runs, "replay", "collapse_rate")
    if not lines:
        return None
    figure, axis = plt.subplots(figsize=(6.0, 4.0))
    without = []
    for index, (run, replay) in enumerate(lines):
        if int(replay.n_sparse.sum()) == 0:
            without.append(run.name)
            continue
        measured, predicted = pooled_rates(replay)
        color = f"C{index}"
        axis.plot(replay.level * 100, measured * 100, marker="o", color=color, label=f"{run.name} measured")
        axis.plot(replay.level * 100, predicted * 100, ls="--", color=color, label=f"{run.name} Theorem 7")
    if len(without) < len(lines):
        axis.axhline(1, color="0.5", lw=0.8)
        axis.set_xscale("log")
        axis.legend(fontsize=7)
    if without:
        axis.text(0.02, 0.95, f"no sparse heads: {', '.join(without)}", transform=axis.transAxes, va="top")
    axis.set(xlabel="noise RMS (%)", ylabel="sparse heads collapsed (%)",
             title="Circuit collapse under norm noise (one layer at a time)")
    return figure


def figure_max_attention(runs: list[Run]):
    lines = groups(runs, "replay", "max_attention_hist")
    if not lines:
        return None
    figure, axis = plt.subplots(figsize=(6.0, 3.8))
    for run, replay in lines:
        counts = replay.max_attention_hist.sum(("layer", "head"))
        axis.step(replay.max_attention_bin, counts / counts.sum(), where="mid", label=run.name)
    axis.set(xlabel="max attention of a query", ylabel="share of queries", yscale="log",
             title="Max attention (Pre-Norm peaks at 1 in the paper)")
    axis.legend()
    return figure


def figure_accuracy_under_noise(runs: list[Run]):
    """Online check: per-token accuracy with the noise injected into every layer at once."""
    lines = [(run, run.group("replay/online")) for run in runs]
    lines = [(run, online) for run, online in lines if online is not None]
    if not lines:
        return None
    figure, axis = plt.subplots(figsize=(6.0, 3.8))
    for run, online in lines:
        accuracy = online.accuracy.sel(perturbation="all layers") * 100
        axis.plot(online.level * 100, accuracy, marker="o", label=f"{run.label} (clean {float(online.clean_accuracy) * 100:.1f} %)")
    axis.set(xscale="log", xlabel="noise RMS (%)", ylabel="per-token accuracy (%)", ylim=(0, 100),
             title="Accuracy with norm noise in all layers (online check)")
    axis.legend(fontsize=7)
    return figure


def accuracy_table(runs: list[Run]) -> dict[str, dict[str, float]]:
    """model name -> split -> per-token answer accuracy (%)."""
    table: dict[str, dict[str, float]] = {}
    for run in runs:
        accuracy = run.group("accuracy")
        if accuracy is not None:
            table.setdefault(run.name, {})[run.split] = float(accuracy.token_accuracy) * 100
    return table


NORM_TYPE_WORDS = {"rms": "RMSNorm", "layer": "LayerNorm"}


def model_label(model: dict) -> str:
    """The model's identity in a few words: its family (model_type) and where its norms sit, e.g.
    "qwen3: pre RMSNorm + QK-norm", "gemma2: sandwich RMSNorm", "phi: pre LayerNorm, parallel"."""
    placement = str(model.get("norm_placement") or "no norm placement")
    kind = model.get("norm_type")
    norms = " ".join([placement] + ([NORM_TYPE_WORDS.get(kind, str(kind))] if kind else []))
    if placement != "qkv":  # the arithmetic family's QKV-Norm names its q, k and v norms already
        norms += "".join(f" + {site}-norm" for site, key in (("QK", "qk_norm"), ("V", "v_norm")) if model.get(key))
    parallel = ", parallel" if model.get("parallel") else ""
    return f"{model.get('family') or 'model'}: {norms}{parallel}"


def variant_labels(runs: list[Run]) -> dict[str, str]:
    """variant -> a readable label: its model's identity (``model_label``), with its size where
    variants of one identity differ in size, and its first model's name where that still leaves
    two variants one label."""
    found = variants(runs)
    identities = {variant: model_label(members[0].model) for variant, members in found.items()}
    sizes = {variant: _size(members[0].model) for variant, members in found.items()}
    labels = {variant: identity + f" ({sizes[variant]})"
              if len({sizes[other] for other in found if identities[other] == identity}) > 1 else identity
              for variant, identity in identities.items()}
    counts = list(labels.values())
    return {variant: label if counts.count(label) == 1 else f"{label} [{found[variant][0].name}]"
            for variant, label in labels.items()}


def figure_accuracy(runs: list[Run]):
    """Per-token accuracy per split and variant: the mean over its seeds, bars from min to max."""
    table = accuracy_table(runs)
    if not table:
        return None
    splits = [s for s in SPLIT_ORDER if any(s in row for row in table.values())]
    splits += sorted({s for row in table.values() for s in row} - set(splits))
    labels = variant_labels(runs)
    figure, axis = plt.subplots(figsize=(6.5, 3.8))
    width = 0.8 / len(labels)
    for index, (variant, members) in enumerate(variants(runs).items()):
        values = np.array([[table.get(run.name, {}).get(s, np.nan) for s in splits] for run in members])
        mean = np.nanmean(values, axis=0) if np.isfinite(values).any() else values[0]
        spread = np.stack([mean - np.nanmin(values, axis=0), np.nanmax(values, axis=0) - mean])
        axis.bar(np.arange(len(splits)) + index * width, mean, width, yerr=spread if len(members) > 1 else None,
                 capsize=3, label=f"{labels[variant]} ({len(members)} model{'s' if len(members) > 1 else ''})")
    axis.set_xticks(np.arange(len(splits)) + 0.4 - width / 2, splits)
    axis.set(ylabel="per-token answer accuracy (%)", ylim=(0, 100),
             title="Accuracy per split (mean over seeds, bars: min to max)")
    axis.legend(fontsize=8)
    return figure


def training_history(run: Run) -> list[dict]:
    """The evaluation history saved with the run's model (metrics.json beside the checkpoint), when
    the model folder is readable here; else empty."""
    path = Path(str(run.model.get("source", ""))) / "metrics.json"
    try:
        return list(json.loads(path.read_text()).get("history", []))
    except (OSError, ValueError):
        return []


def figure_learning_curves(runs: list[Run]):
    """Per-token accuracy on each split against training steps, one line per model, one colour per
    variant (from the models' own metrics.json)."""
    curves = [(run, training_history(run)) for run in in_distribution(runs)]
    curves = [(run, history) for run, history in curves if history]
    if not curves:
        return None
    labels = variant_labels(runs)
    colours = {variant: f"C{index}" for index, variant in enumerate(labels)}
    figure, axes = _axes_grid(len(SPLIT_ORDER), width=4.4, height=3.4)
    for axis, split in zip(axes, SPLIT_ORDER):
        for run, history in curves:
            steps = [record["step"] for record in history]
            values = [record.get(f"{split}_token_accuracy", np.nan) * 100 for record in history]
            axis.plot(steps, values, color=colours[run.variant], lw=1, label=f"{labels[run.variant]}: {run.name}")
        axis.set(title=split, xlabel="training step", ylabel="per-token accuracy (%)", ylim=(0, 100))
    axes[0].legend(fontsize=6)
    figure.suptitle("Learning curves (the models' evaluation during training)")
    return figure


FIGURES = {
    "norm_spread": ("Norm spread", figure_norm_spread),
    "angles": ("Principal angles", figure_angles),
    "association": ("Label association and chance", figure_association),
    "spheres": ("Sphere structure", figure_spheres),
    "collapse": ("Collapse against noise", figure_collapse),
    "max_attention": ("Max attention", figure_max_attention),
    "accuracy": ("Accuracy per split", figure_accuracy),
    "accuracy_under_noise": ("Accuracy under noise", figure_accuracy_under_noise),
    "learning_curves": ("Learning curves", figure_learning_curves),
}


# Headline ------------------------------------------------------------------------------------

def _percent(value) -> str:
    return "n/a" if value is None or not np.isfinite(value) else f"{value * 100:.1f} %"


def _measured(values: list[float]) -> list[float]:
    """The values a seed measured: None and NaN dropped; an infinite collapse level (never reached
    within the noise tested) is a measurement, and compares as beyond every finite one."""
    return [v for v in values if v is not None and not np.isnan(v)]


def _spread(values: list[float], scale: float = 100, unit: str = " %") -> str:
    """A quantity over seeds: its mean and [min–max] (the value alone for one seed); an infinite
    value (a collapse level that the noise tested never reaches) is counted, never averaged."""
    measured = _measured(values)
    values = [v for v in measured if np.isfinite(v)]
    unreached = len(measured) - len(values)
    note = f" (never reached by {unreached} of {len(measured)})" if unreached and values else ""
    if not values:
        return f"never reached ({unreached} of {unreached})" if unreached else "n/a"
    if len(values) == 1:
        return f"{values[0] * scale:.1f}{unit}{note}"
    return f"{np.mean(values) * scale:.1f}{unit} [{min(values) * scale:.1f}–{max(values) * scale:.1f}]{note}"


def direction_verdict(pre: list[float], qkv: list[float], paper_direction: int) -> str:
    """Whether the paper's direction (+1: Pre-Norm above QKV-Norm, -1: below, 0: the paper
    compares nothing) holds beyond the seed spread: min of one above max of the other."""
    pre, qkv = _measured(pre), _measured(qkv)
    if not paper_direction:
        return "—"
    if not pre or not qkv:
        return "n/a (needs both placements)"
    higher, lower = (pre, qkv) if paper_direction > 0 else (qkv, pre)
    seeds = f"{len(pre)} / {len(qkv)} seeds"
    means = "same direction" if np.mean(higher) > np.mean(lower) else "reversed"
    if min(len(pre), len(qkv)) < 2:
        return f"cannot be told from seed noise with one seed; means: {means} ({seeds})"
    if min(higher) > max(lower):
        return f"holds beyond the seed spread ({seeds})"
    if max(higher) < min(lower):
        return f"reversed beyond the seed spread ({seeds})"
    return f"within the seed spread; means: {means} ({seeds})"


def families(runs: list[Run]) -> list[dict[str, list[Run]]]:
    """Per configuration of the project's arithmetic transformers that differs only in its norm
    placement: placement -> its models' in-distribution runs (one per seed), for the Pre-Norm and
    QKV-Norm placements (the paper's pair; other families' placements are not the paper's)."""
    found: dict[str, dict[str, list[Run]]] = {}
    for members in variants(runs).values():
        first = members[0]
        if first.model.get("family") == "arithmetic" and first.placement in ("pre", "qkv"):
            without = json.loads(first.variant)
            for key in PLACEMENT_KEYS:
                without[0].pop(key, None)
            found.setdefault(json.dumps(without, sort_keys=True), {})[first.placement] = members
    return list(found.values())


def _band(run: Run) -> float | None:
    """The band of the attention input's |x| / median pooled over layers and heads (band_pooled)."""
    norms = run.group("norms/resid_pre")
    return None if norms is None else float(norms.band_pooled)


def _collapse_level(definition: str):
    def measure(run: Run) -> float | None:
        replay = run.group("replay")
        return None if replay is None else float(replay.collapse_level_pooled.sel(definition=definition))
    return measure


def _sparse_share(run: Run) -> float | None:
    """Share of (query, head) instances whose max attention is at least the sparse threshold."""
    replay = run.group("replay")
    if replay is None or int(replay.n_instances.sum()) == 0:
        return None
    return float(replay.n_sparse.sum() / replay.n_instances.sum())


THEORY_LEVEL = 0.1
"""The noise level of the headline's recall and precision of Theorem 7 (about the paper's collapse level)."""


def _theory(measure: str):
    """The recall or precision of Theorem 7's first-order condition against the measured collapses at
    THEORY_LEVEL, pooled over layers and heads; None where the replay did not sweep that level or
    its results predate recall and precision."""
    def value(run: Run) -> float | None:
        replay = run.group("replay")
        name = f"theory_{measure}_pooled"
        if replay is None or name not in replay or THEORY_LEVEL not in replay.level.values:
            return None
        return float(replay[name].sel(level=THEORY_LEVEL))
    return value


def _online_drop(run: Run) -> float | None:
    """The online check's accuracy drop at 1 % noise in all layers, on the model's test data."""
    online = run.group("replay/online")
    if online is None or 0.01 not in online.level.values:
        return None
    return float(online.accuracy_drop.sel(perturbation="all layers", level=0.01))


HEADLINE = (
    ("half-width of the band holding 90 % of |x| / median (each head's ratios to its own median, "
     "attention-weighted, pooled over layers and heads)",
     _band, "±20 % / much wider", -1),
    ("noise RMS at which 1 % of sparse heads collapse", _collapse_level("collapse"), "11 % (Pre-Norm)", 0),
    ("noise RMS at which 1 % of sparse heads strictly collapse", _collapse_level("strict"), "17 % (Pre-Norm)", 0),
    ("per-token accuracy drop with 1 % noise in all layers (online check)", _online_drop, "≳10 % (Pre-Norm)", 0),
    ("share of queries and heads with max attention ≥ 0.95 (sparse), among queries with at least the replay's "
     "min_keys allowed keys", _sparse_share, "peaks at 1 / does not", 1),
    (f"Theorem 7's first-order condition at {THEORY_LEVEL * 100:g} % noise, layers and heads pooled: recall "
     "(share of the measured collapses it predicted)", _theory("recall"), "—", 0),
    (f"Theorem 7's first-order condition at {THEORY_LEVEL * 100:g} % noise, layers and heads pooled: precision "
     "(share of its predicted collapses that happened)", _theory("precision"), "—", 0),
)
"""(quantity, measure of one model's in-distribution run, the paper's figure, the paper's
direction: +1 Pre-Norm above QKV-Norm, -1 below, 0 no comparison)."""


def headline_rows(runs: list[Run]) -> list[tuple[str, str, str, str]]:
    """(quantity, ours: Pre-Norm / QKV-Norm as mean [min–max] over seeds, paper, whether the
    paper's direction holds beyond the seed spread) rows of the headline table."""
    rows = []
    accuracy = accuracy_table(runs)
    found = families(runs)
    for family in found:
        pre, qkv = family.get("pre", []), family.get("qkv", [])
        prefix = f"{_size((pre or qkv)[0].model)}: " if len(found) > 1 else ""
        for quantity, measure, paper, direction in HEADLINE:
            values = [[measure(run) for run in members] for members in (pre, qkv)]
            if any(v is not None for v in values[0] + values[1]):
                rows.append((f"{prefix}Pre-Norm / QKV-Norm: {quantity}", " / ".join(_spread(v) for v in values),
                             paper, direction_verdict(*values, direction)))
        for split in SPLIT_ORDER:
            values = [[accuracy.get(run.name, {}).get(split, np.nan) / 100 for run in members] for members in (pre, qkv)]
            if any(np.isfinite(v) for v in values[0] + values[1]):
                paper = " / ".join(f"{PAPER['accuracy'][p][split]:.1f} %" for p in ("pre", "qkv"))
                direction = int(np.sign(PAPER["accuracy"]["pre"][split] - PAPER["accuracy"]["qkv"][split]))
                rows.append((f"{prefix}Pre-Norm / QKV-Norm: per-token accuracy, {split}",
                             " / ".join(_spread(v) for v in values), paper, direction_verdict(*values, direction)))
        rows.append((f"{prefix}Seeds (models) per placement, Pre-Norm / QKV-Norm", f"{len(pre)} / {len(qkv)}", "1 / 1", "—"))
    sizes = sorted({_size(run.model) for run in runs})
    rows.append(("Model size", "; ".join(sizes), PAPER["size"], "—"))
    return rows


def _size(model: dict) -> str:
    return f"{model.get('n_layers')} layers, d_model {model.get('d_model')}, {model.get('n_heads')} heads of {model.get('d_head')}"


# Writing -------------------------------------------------------------------------------------

def _png(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(figure)
    return buffer.getvalue()


def _provenance(runs: list[Run]) -> list[str]:
    """One line a run: its results, store, model, data, the analysis options that differ from their
    defaults (every option is in configuration.json) and package version."""
    lines = []
    for run in runs:
        made = run.tree.attrs.get("provenance", {})
        task = run.tree.attrs.get("task", {})
        data = " ".join(f"{key}={task[key]}" for key in ("name", "split", "seed", "counts", "path") if key in task)
        changed = {name: options for name, options in non_default_options(run).items() if options}
        lines.append(
            f"{run.label}: results {_shown(run.url)} of store {_shown(run.tree.attrs.get('store', '?'))}; model "
            f"{_shown(run.model.get('source', '?'))} ({_size(run.model)}; {describe_norms(run.model)}); "
            f"data {data}; analyses {list(run.tree.children)}, "
            + (f"options beside the defaults {changed}" if changed else "every option at its default")
            + f"; orthosphere {made.get('package_version')} (commit {made.get('git_commit')}), {made.get('created')}"
        )
    return lines


def run_options(run: Run) -> dict[str, dict]:
    """Each analysis of a run with every option it ran with."""
    return {name: dict(run.tree[name].attrs.get("options", {})) for name in run.tree.children}


def non_default_options(run: Run) -> dict[str, dict]:
    """Each analysis of a run with the options whose value is not the analysis's default."""
    changed = {}
    for name, options in run_options(run).items():
        try:
            defaults = as_attrs(get_analysis(name).defaults)
        except AnalysisError:  # an analysis this installation lacks: every option shown
            defaults = {}
        changed[name] = {key: value for key, value in options.items() if key not in defaults or defaults[key] != value}
    return changed


def _configuration(runs: list[Run]) -> dict:
    """configuration.json: per run, its results, store and every option of every analysis."""
    return {run.label: {"results": str(run.url), "store": run.tree.attrs.get("store"), "options": run_options(run)}
            for run in runs}


def _shown(location: str) -> str:
    """A local path relative to the current folder when it lies inside it (reports travel)."""
    if "://" in str(location) or not os.path.isabs(str(location)):
        return str(location)
    relative = os.path.relpath(location)
    return location if relative.startswith("..") else relative


def write_report(results, out_dir, title: str = "orthosphere report") -> Path:
    """Write report.html and report.md (with figures/) for the given results; returns out_dir."""
    runs = load_runs(results)
    out_dir = Path(out_dir)
    (out_dir / "figures").mkdir(parents=True, exist_ok=True)
    figures = {}
    for name, (caption, draw) in FIGURES.items():
        figure = draw(runs)
        if figure is not None:
            figures[name] = (caption, _png(figure))
            (out_dir / "figures" / f"{name}.png").write_bytes(figures[name][1])
    rows = headline_rows(runs)
    made = f"orthosphere {metadata.version('orthosphere')}, {datetime.now(UTC).isoformat(timespec='seconds')}"
    provenance = _provenance(runs)
    (out_dir / "report.md").write_text(_markdown(title, rows, figures, provenance, made))
    (out_dir / "report.html").write_text(_html(title, rows, figures, provenance, made))
    (out_dir / "configuration.json").write_text(json.dumps(_configuration(runs), indent=2, default=str) + "\n")
    return out_dir


HEADLINE_COLUMNS = ("quantity", "here: mean [min–max] over seeds", "paper", "paper's direction beyond the seed spread?")


def _markdown(title, rows, figures, provenance, made) -> str:
    lines = [f"# {title}", "", f"Made by {made}.", "", "## Headline: this project beside the paper", "",
             f"| {' | '.join(HEADLINE_COLUMNS)} |", "|---|---|---|---|"]
    lines += [f"| {' | '.join(_cell(text) for text in row)} |" for row in rows]
    for name, (caption, _) in figures.items():
        lines += ["", f"## {caption}", "", f"![{caption}](figures/{name}.png)"]
    lines += ["", "## What produced this report", "", "Every option of every run: configuration.json.", ""]
    lines += [f"- {line}" for line in provenance]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    """Markdown table cell text (a bare | would end the cell)."""
    return text.replace("|", "\\|")


def _html(title, rows, figures, provenance, made) -> str:
    table = "".join("<tr>" + "".join(f"<td>{html.escape(text)}</td>" for text in row) + "</tr>" for row in rows)
    header = "".join(f"<th>{html.escape(text)}</th>" for text in HEADLINE_COLUMNS)
    sections = "".join(
        f"<h2>{html.escape(caption)}</h2><img alt='{html.escape(caption)}' "
        f"src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
        for caption, png in figures.values()
    )
    sources = "".join(f"<li>{html.escape(line)}</li>" for line in provenance)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;max-width:1200px;margin:2em auto;padding:0 1em}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:4px 8px}}img{{max-width:100%}}
li{{font-size:0.85em;margin-bottom:0.4em}}</style></head><body>
<h1>{html.escape(title)}</h1><p>Made by {html.escape(made)}.</p>
<h2>Headline: this project beside the paper</h2>
<table><tr>{header}</tr>{table}</table>
{sections}
<h2>What produced this report</h2><p>Every option of every run: configuration.json.</p><ul>{sources}</ul>
</body></html>
"""
