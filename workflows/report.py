"""Reports: `orthosphere report RESULTS... --out DIR` writes report.html (figures embedded) and
report.md (figures beside it in figures/) from analysis results.

Each results tree is one (model, data) pair: the model's norm placement and the data's split
label it. The report draws the norm spread, the principal angles, the sphere-structure
deviation, the collapse rate against noise beside Theorem 7's prediction, the max-attention
histograms and the accuracy per split, and puts the headline figures beside the paper's.
"""
from __future__ import annotations

import base64
import html
import io
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

PAPER = {
    "band": "±20 %",
    "collapse_level": "11 %",
    "strict_level": "17 %",
    "accuracy": {"pre": {"test": 91.38, "interpolation": 87.46, "extrapolation": 66.65},
                 "qkv": {"test": 90.99, "interpolation": 82.54, "extrapolation": 46.76}},
    "size": "10 layers, d_model 512, 12 heads of 64",
    "drop": "≳10 % (Pre-Norm)",
}
SPLIT_ORDER = ("test", "interpolation", "extrapolation")
PLACEMENT_ORDER = ("pre", "qkv", "none", "post")


@dataclass
class Run:
    """One results tree: which model on which data, and its groups."""

    url: str
    tree: xr.DataTree

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
        return f"{self.placement}/{self.split}"

    def group(self, path: str) -> xr.Dataset | None:
        try:
            return self.tree[path].to_dataset()
        except KeyError:
            return None


def load_runs(urls) -> list[Run]:
    runs = [Run(str(url), open_results(url).load()) for url in urls]
    if not runs:
        raise ValueError("no results given: pass one or more results written by `orthosphere analyze`")
    order = {name: i for i, name in enumerate(PLACEMENT_ORDER)}
    splits = {name: i for i, name in enumerate(SPLIT_ORDER)}
    return sorted(runs, key=lambda run: (order.get(run.placement, 99), run.placement, splits.get(run.split, 99), run.split))


def groups(runs: list[Run], path: str, variable: str) -> list[tuple[Run, xr.Dataset]]:
    """(run, group) for each placement's in-distribution run whose group `path` holds `variable`."""
    found = [(run, run.group(path)) for run in in_distribution(runs)]
    return [(run, group) for run, group in found if group is not None and variable in group]


def in_distribution(runs: list[Run]) -> list[Run]:
    """One run per placement: its in-distribution data where there is one, else its first."""
    chosen: dict[str, Run] = {}
    for run in runs:
        if run.placement not in chosen or (run.split == "test" and chosen[run.placement].split != "test"):
            chosen[run.placement] = run
    return list(chosen.values())


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
    """|x| / median of the attention input, per layer, one panel per placement."""
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
            axis.plot(curve.ratio, curve / curve.sum(), label=f"layer {layer}")
        axis.axvspan(0.8, 1.2, color="0.9", zorder=0, label="±20 % (paper)")
        axis.set(title=f"{run.placement}: band {np.nanmedian(norms.band.values) * 100:.0f} %",
                 xlabel="|resid_pre| / median", ylabel="share of attention", xlim=(0, float(curve.ratio.max())))
        axis.legend(fontsize=7)
    figure.suptitle(f"Norm spread of the attention input ({norms.attrs.get('weighting', '')} weighting)")
    return figure


def figure_angles(runs: list[Run]):
    """Smallest principal angle between factor subspaces (mean over layers), per placement."""
    panels = groups(runs, "subspaces", "min_angle")
    if not panels:
        return None
    figure, axes = _axes_grid(len(panels), width=4.6, height=4.0)
    for axis, (run, subspaces) in zip(axes, panels):
        angles = subspaces.min_angle.mean("layer")
        image = axis.imshow(angles.values, vmin=0, vmax=90, cmap="viridis")
        names = [str(f) for f in angles.factor.values]
        axis.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=7)
        axis.set_yticks(range(len(names)), names, fontsize=7)
        for (i, j), value in np.ndenumerate(angles.values):
            if np.isfinite(value):
                axis.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=6, color="w" if value < 45 else "k")
        axis.set_title(f"{run.placement}: smallest angle (°)")
        figure.colorbar(image, ax=axis, fraction=0.046)
    figure.suptitle("Principal angles between factor subspaces (90° = orthogonal, 0° = dependent)")
    return figure


def figure_association(runs: list[Run]):
    """Per placement and pair of factors: how associated their labels are (NMI), the smallest angle
    (mean over layers) beside what chance gives (the null's), and the most frequent relation."""
    panels = groups(runs, "subspaces", "label_nmi")
    if not panels:
        return None
    rows = []
    for run, subspaces in panels:
        names = [str(name) for name in subspaces.factor.values]
        for a, first in enumerate(names):
            for second in names[a + 1:]:
                pair = {"factor": first, "other": second}
                relations, counts = np.unique([str(value) for value in subspaces.relation.sel(pair).values], return_counts=True)
                null = subspaces.null_min_angle.sel(pair).mean("layer").item() if "null_min_angle" in subspaces else np.nan
                rows.append([run.placement, first, second, f"{subspaces.label_nmi.sel(pair).item():.2f}",
                             f"{subspaces.min_angle.sel(pair).mean('layer').item():.1f}", f"{null:.1f}",
                             str(relations[np.argmax(counts)])])
    figure, axis = plt.subplots(figsize=(11, 0.3 * len(rows) + 0.9))
    axis.axis("off")
    table = axis.table(cellText=rows, loc="upper center", cellLoc="left",
                       colLabels=["model", "factor", "other", "label NMI", "smallest angle (°)", "null (°)",
                                  "relation (most layers)"])
    table.auto_set_font_size(False)
    table.set_fontsize(7)
    axis.set_title(f"Label association and angles against chance (estimator: {panels[0][1].attrs.get('estimator')})")
    return figure


def figure_sphere_deviation(runs: list[Run]):
    lines = groups(runs, "spheres", "deviation")
    if not lines:
        return None
    figure, axis = plt.subplots(figsize=(5.5, 3.6))
    for run, spheres in lines:
        axis.plot(spheres.layer, spheres.deviation, marker="o", label=run.placement)
    axis.set_xticks(lines[0][1].layer.values)
    axis.set(xlabel="layer", ylabel="deviation from orthogonal spheres", ylim=(0, None),
             title="Sphere structure (0 = perfect orthogonal spheres)")
    axis.legend()
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
            without.append(run.placement)
            continue
        measured, predicted = pooled_rates(replay)
        color = f"C{index}"
        axis.plot(replay.level * 100, measured * 100, marker="o", color=color, label=f"{run.placement} measured")
        axis.plot(replay.level * 100, predicted * 100, ls="--", color=color, label=f"{run.placement} Theorem 7")
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
        axis.step(replay.max_attention_bin, counts / counts.sum(), where="mid", label=run.placement)
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
    """placement -> split -> per-token answer accuracy (%)."""
    table: dict[str, dict[str, float]] = {}
    for run in runs:
        accuracy = run.group("accuracy")
        if accuracy is not None:
            table.setdefault(run.placement, {})[run.split] = float(accuracy.token_accuracy) * 100
    return table


def figure_accuracy(runs: list[Run]):
    table = accuracy_table(runs)
    if not table:
        return None
    splits = [s for s in SPLIT_ORDER if any(s in row for row in table.values())]
    splits += sorted({s for row in table.values() for s in row} - set(splits))
    figure, axis = plt.subplots(figsize=(6.0, 3.6))
    width = 0.8 / len(table)
    for index, (placement, row) in enumerate(table.items()):
        positions = np.arange(len(splits)) + index * width
        axis.bar(positions, [row.get(s, np.nan) for s in splits], width, label=placement)
    axis.set_xticks(np.arange(len(splits)) + 0.4 - width / 2, splits)
    axis.set(ylabel="per-token answer accuracy (%)", ylim=(0, 100), title="Accuracy per split")
    axis.legend(fontsize=8)
    return figure


FIGURES = {
    "norm_spread": ("Norm spread", figure_norm_spread),
    "angles": ("Principal angles", figure_angles),
    "association": ("Label association and chance", figure_association),
    "sphere_deviation": ("Sphere structure", figure_sphere_deviation),
    "collapse": ("Collapse against noise", figure_collapse),
    "max_attention": ("Max attention", figure_max_attention),
    "accuracy": ("Accuracy per split", figure_accuracy),
    "accuracy_under_noise": ("Accuracy under noise", figure_accuracy_under_noise),
}


# Headline ------------------------------------------------------------------------------------

def _percent(value) -> str:
    return "n/a" if value is None or not np.isfinite(value) else f"{value * 100:.1f} %"


def _run_of(runs, placement) -> Run | None:
    """The placement's in-distribution run (see in_distribution), or None."""
    return {run.placement: run for run in in_distribution(runs)}.get(placement)


def headline_rows(runs: list[Run]) -> list[tuple[str, str, str]]:
    """(quantity, ours, paper) rows of the headline table."""
    rows = []
    pre = _run_of(runs, "pre")
    norms = pre.group("norms/resid_pre") if pre else None
    if norms is not None:
        band = norms.band.values
        rows.append(("Pre-Norm: half-width of the band holding 90 % of |x| / median (attention-weighted; median over layers and heads)",
                     f"±{np.nanmedian(band) * 100:.0f} % (heads: {np.nanmin(band) * 100:.0f}–{np.nanmax(band) * 100:.0f} %)",
                     PAPER["band"]))
    replay = pre.group("replay") if pre else None
    if replay is not None:
        for definition, paper in (("collapse", PAPER["collapse_level"]), ("strict", PAPER["strict_level"])):
            level = float(replay.collapse_level_pooled.sel(definition=definition))
            low, high = replay.collapse_level_pooled_ci.sel(definition=definition).values
            rows.append((f"Pre-Norm: noise RMS at which 1 % of sparse heads {'strictly ' if definition == 'strict' else ''}collapse",
                         f"{_percent(level)} [{_percent(low)}, {_percent(high)}]", paper))
    drops = {placement: _online_drop(runs, placement) for placement in ("pre", "qkv")}
    if any(drop is not None for drop in drops.values()):
        rows.append(("Per-token accuracy drop with 1 % noise in all layers, Pre-Norm / QKV-Norm (online check)",
                     " / ".join(_percent(drop) for drop in drops.values()), PAPER["drop"]))
    accuracy = accuracy_table(runs)
    for split in SPLIT_ORDER:
        if split in accuracy.get("pre", {}) or split in accuracy.get("qkv", {}):
            ours = " / ".join(f"{accuracy.get(p, {}).get(split, float('nan')):.1f}" for p in ("pre", "qkv"))
            paper = " / ".join(f"{PAPER['accuracy'][p][split]:.1f}" for p in ("pre", "qkv"))
            rows.append((f"Per-token accuracy, Pre-Norm / QKV-Norm, {split} (%)", ours, paper))
    sizes = sorted({_size(run.model) for run in runs})
    rows.append(("Model size", "; ".join(sizes), PAPER["size"]))
    return rows


def _online_drop(runs: list[Run], placement: str) -> float | None:
    """The online check's accuracy drop at 1 % noise in all layers, on the placement's test data."""
    run = _run_of(runs, placement)
    online = run.group("replay/online") if run else None
    if online is None or 0.01 not in online.level.values:
        return None
    return float(online.accuracy_drop.sel(perturbation="all layers", level=0.01))


def _size(model: dict) -> str:
    return f"{model.get('n_layers')} layers, d_model {model.get('d_model')}, {model.get('n_heads')} heads of {model.get('d_head')}"


# Writing -------------------------------------------------------------------------------------

def _png(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(figure)
    return buffer.getvalue()


def _provenance(runs: list[Run]) -> list[str]:
    """One line a run: its results, store, model, data, analysis options and package version."""
    lines = []
    for run in runs:
        made = run.tree.attrs.get("provenance", {})
        task = run.tree.attrs.get("task", {})
        data = " ".join(f"{key}={task[key]}" for key in ("name", "split", "seed", "counts", "path") if key in task)
        options = {name: run.tree[name].attrs.get("options", {}) for name in run.tree.children}
        lines.append(
            f"{run.label}: results {_shown(run.url)} of store {_shown(run.tree.attrs.get('store', '?'))}; model "
            f"{_shown(run.model.get('source', '?'))} ({_size(run.model)}; {describe_norms(run.model)}); "
            f"data {data}; analyses {list(options)} with options {options}; "
            f"orthosphere {made.get('package_version')} (commit {made.get('git_commit')}), {made.get('created')}"
        )
    return lines


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
    return out_dir


def _markdown(title, rows, figures, provenance, made) -> str:
    lines = [f"# {title}", "", f"Made by {made}.", "", "## Headline: this project beside the paper", "",
             "| quantity | here | paper |", "|---|---|---|"]
    lines += [f"| {_cell(quantity)} | {_cell(ours)} | {_cell(paper)} |" for quantity, ours, paper in rows]
    for name, (caption, _) in figures.items():
        lines += ["", f"## {caption}", "", f"![{caption}](figures/{name}.png)"]
    lines += ["", "## What produced this report", ""] + [f"- {line}" for line in provenance]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    """Markdown table cell text (a bare | would end the cell)."""
    return text.replace("|", "\\|")


def _html(title, rows, figures, provenance, made) -> str:
    table = "".join(
        f"<tr><td>{html.escape(q)}</td><td>{html.escape(o)}</td><td>{html.escape(p)}</td></tr>" for q, o, p in rows
    )
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
<table><tr><th>quantity</th><th>here</th><th>paper</th></tr>{table}</table>
{sections}
<h2>What produced this report</h2><ul>{sources}</ul>
</body></html>
"""
