"""The report's figures: one function a figure, each taking the runs (``runs.Run``) and returning a
matplotlib figure, or None where no run holds what it draws (``FIGURES``: name -> title, function)."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import xarray as xr  # noqa: E402
from matplotlib.transforms import blended_transform_factory  # noqa: E402

from .runs import (  # noqa: E402
    SPLIT_ORDER,
    Run,
    accuracy_table,
    groups,
    in_distribution,
    setting,
    setting_words,
    training_history,
    variant_labels,
    variants,
)


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
                 xlabel="|resid_pre| / median", xlim=(0, float(curve.ratio.max())),
                 ylabel="share of attention" if setting(run, "weighting") == "attention" else "share of tokens")
        axis.legend(fontsize=7)
    pooled = ", each head's |x| over its own median, heads pooled" if "head" in norms.band.dims else ""
    shown = [run for run, _ in panels]
    figure.suptitle(f"Norm spread of the attention input ({setting_words(shown, 'weighting')}{pooled}; "
                    f"bands hold {setting_words(shown, 'mass')})")
    return figure


RELATION_MARKERS = {"orthogonal": "o", "independent": "s", "dependent": "v", "undetermined": "x", "no structure": ".",
                    "below relevance floor": "_"}


SPHERE_MARKERS = {"on sphere": "o", "off sphere": "s", "undetermined": "x", "no structure": ".", "below relevance floor": "_"}


def _pairs(names: list[str]) -> list[tuple[str, str]]:
    return [(first, second) for a, first in enumerate(names) for second in names[a + 1:]]


def _with_interval(axis, x, estimate, interval, verdicts, markers, colour, label):
    """A line of estimates per layer with their intervals as error bars, each point marked by its verdict; a
    verdict without an estimate (undetermined, no structure) is marked at the foot of the panel."""
    estimate, low, high = np.asarray(estimate, float), *np.asarray(interval, float).T
    axis.errorbar(x, estimate, yerr=[np.maximum(estimate - low, 0), np.maximum(high - estimate, 0)], color=colour,
                  capsize=2, lw=1, label=label)
    foot = blended_transform_factory(axis.transData, axis.transAxes)
    for layer, value, verdict in zip(x, estimate, verdicts):
        style = {"color": colour, "ms": 6, "mfc": "none" if verdict == "undetermined" else colour}
        if np.isfinite(value):
            axis.plot(layer, value, markers.get(str(verdict), "."), **style)
        elif str(verdict):
            axis.plot(layer, 0.03, markers.get(str(verdict), "."), transform=foot, clip_on=False, **style)


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
            layers = "; ".join(f"{layer}: {_angle_cell(estimate, interval, relation)}" for layer, estimate, interval, relation
                               in zip(subspaces.layer.values, pair.min_angle_estimate.values, pair.min_angle_ci.values,
                                      pair.relation.values))
            null = pair.null_min_angle.mean("layer").item() if "null_min_angle" in pair else np.nan
            rows.append([run.name, first, second, f"{pair.label_nmi.item():.2f}",
                         f"{pair.min_angle.mean('layer').item():.1f}", f"{null:.1f}", layers])
    figure, axis = plt.subplots(figsize=(15, 0.3 * len(rows) + 0.9))
    axis.axis("off")
    table = axis.table(cellText=rows, loc="upper center", cellLoc="left",
                       colLabels=["model", "factor", "other", "label NMI", "smallest angle (°)", "null (°)",
                                  "layer: estimate [interval] relation"])
    table.auto_set_font_size(False)
    table.set_fontsize(6)
    table.auto_set_column_width(list(range(7)))
    fits: dict[str, list[str]] = {}
    for run, subspaces in panels:
        fit = f"estimator: {subspaces.attrs.get('estimator')}, intercepts: {subspaces.attrs.get('intercepts', 'none')}"
        fits.setdefault(fit, []).append(run.name)
    shown = [fit if len(fits) == 1 else f"{fit} ({', '.join(names)})" for fit, names in fits.items()]
    axis.set_title(f"Label association and angles against chance ({'; '.join(shown)})")
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
        bottom.set(title="cross term (RMS cosine of the components, norm-weighted)", xlabel="layer", ylim=(0, None),
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
        for target in sorted({setting(run, "collapse_target") for run, _ in lines} - {None}):
            axis.axhline(target * 100, color="0.5", lw=0.8, label=f"collapse level's {target * 100:g} %")
        axis.set_xscale("log")
        axis.legend(fontsize=7)
    if without:
        axis.text(0.02, 0.95, f"no sparse heads: {', '.join(without)}", transform=axis.transAxes, va="top")
    axis.set(xlabel="noise RMS (%)", ylabel="sparse (query, head, draw) instances collapsed (%)",
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
