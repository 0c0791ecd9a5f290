"""Reports: `orthosphere report RESULTS... --out DIR` writes report.html (figures embedded) and
report.md (figures beside it in figures/) from analysis results.

The runs (``runs.py``) and the figures (``figures.py``) have their own modules; this one puts the
headline beside the paper's and writes the report. Each results tree is one (model, data) pair: the model's identity (its folder's name, or that
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
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import xarray as xr  # noqa: E402

from orthosphere.analyze.description import describe_norms  # noqa: E402
from orthosphere.analyze.options import as_attrs  # noqa: E402
from orthosphere.analyze.results import get_analysis  # noqa: E402
from orthosphere.errors import AnalysisError  # noqa: E402

from .figures import FIGURES  # noqa: E402
from .runs import (  # noqa: E402
    PLACEMENT_KEYS,
    SETTINGS,
    SPLIT_ORDER,
    Run,
    accuracy_table,
    load_runs,
    model_size,
    setting_differences,
    setting_words,
    variants,
)

PAPER = {
    "accuracy": {"pre": {"test": 91.38, "interpolation": 87.46, "extrapolation": 66.65},
                 "qkv": {"test": 90.99, "interpolation": 82.54, "extrapolation": 46.76}},
    "size": "10 layers, d_model 512, 12 heads of 64",
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


def _collapse_level_interval(definition: str):
    """The pooled collapse level's interval from resampling documents (None where the replay has none)."""
    def interval(run: Run) -> tuple[float, float, float] | None:
        replay = run.group("replay")
        if replay is None or "collapse_level_pooled_ci" not in replay:
            return None
        return _replay_interval(replay, replay.collapse_level_pooled_ci.sel(definition=definition))
    return interval


def _replay_interval(replay, bounds) -> tuple[float, float, float] | None:
    """(low, high, confidence) of a replay interval; None where it was not computed (no resamples)."""
    low, high = (float(value) for value in bounds.values)
    return None if np.isnan(low) or np.isnan(high) else (low, high, float(replay.attrs["confidence"]))


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


def _theory_interval(measure: str):
    """The interval of ``_theory(measure)`` from resampling documents (None where the replay has none)."""
    def interval(run: Run) -> tuple[float, float, float] | None:
        replay = run.group("replay")
        name = f"theory_{measure}_pooled_ci"
        if replay is None or name not in replay or THEORY_LEVEL not in replay.level.values:
            return None
        return _replay_interval(replay, replay[name].sel(level=THEORY_LEVEL))
    return interval


def _online_drop(run: Run) -> float | None:
    """The online check's accuracy drop at 1 % noise in all layers, on the model's test data."""
    online = run.group("replay/online")
    if online is None or 0.01 not in online.level.values:
        return None
    return float(online.accuracy_drop.sel(perturbation="all layers", level=0.01))


HEADLINE = (
    ("half-width of the band holding {mass} of |x| / median (each head's ratios to its own median, "
     "{weighting}, pooled over layers and heads)",
     _band, "±20 % / much wider", -1, None),
    ("noise RMS at which {collapse_target} of sparse (query, head) instances collapse, counted over instances and noise "
     "draws", _collapse_level("collapse"), "11 % (Pre-Norm)", 0, _collapse_level_interval("collapse")),
    ("noise RMS at which {collapse_target} of sparse (query, head) instances strictly collapse, counted over instances "
     "and noise draws", _collapse_level("strict"), "17 % (Pre-Norm)", 0, _collapse_level_interval("strict")),
    ("per-token accuracy drop with 1 % noise in all layers (online check)", _online_drop, "≳10 % (Pre-Norm)", 0, None),
    ("share of queries and heads with max attention ≥ {sparse_threshold} (sparse), among queries with at least the "
     "replay's min_keys allowed keys", _sparse_share, "peaks at 1 / does not", 1, None),
    (f"Theorem 7's first-order condition at {THEORY_LEVEL * 100:g} % noise, (query, head, draw) instances of every "
     "layer and head pooled: recall (share of the measured collapses it predicted)", _theory("recall"), "—", 0,
     _theory_interval("recall")),
    (f"Theorem 7's first-order condition at {THEORY_LEVEL * 100:g} % noise, (query, head, draw) instances of every "
     "layer and head pooled: precision (share of its predicted collapses that happened)", _theory("precision"), "—", 0,
     _theory_interval("precision")),
)
"""(quantity, with SETTINGS' names in braces for the runs' values, measure of one model's in-distribution run, the paper's figure, the paper's
direction: +1 Pre-Norm above QKV-Norm, -1 below, 0 no comparison, the measure's interval within one
run (from resampling documents) or None)."""


def _with_interval(text: str, interval: tuple[float, float, float] | None) -> str:
    """One run's value with its interval from resampling the run's documents (its samples where it has none)."""
    if interval is None:
        return text
    low, high = ("beyond the noise tested" if np.isinf(bound) else f"{bound * 100:.1f} %" for bound in interval[:2])
    return f"{text} ({interval[2] * 100:g} % interval {low}–{high}, documents resampled)"


def _placement_words(placements: tuple[list[Run], list[Run]], name: str) -> str:
    """A setting in words for the headline's Pre-Norm / QKV-Norm pair: one value, or each placement's in that order."""
    each = [setting_words(members, name) for members in placements]
    return each[0] if each[0] == each[1] or not placements[1] else each[1] if not placements[0] else \
        f"{each[0]} / {each[1]} (Pre-Norm / QKV-Norm)"


def headline_rows(runs: list[Run]) -> list[tuple[str, str, str, str]]:
    """(quantity, ours: Pre-Norm / QKV-Norm as mean [min–max] over seeds, paper, whether the
    paper's direction holds beyond the seed spread) rows of the headline table."""
    rows = []
    accuracy = accuracy_table(runs)
    found = families(runs)
    for family in found:
        pre, qkv = family.get("pre", []), family.get("qkv", [])
        prefix = f"{model_size((pre or qkv)[0].model)}: " if len(found) > 1 else ""
        words = {name: _placement_words((pre, qkv), name) for name in SETTINGS}
        for quantity, measure, paper, direction, interval in HEADLINE:
            values = [[measure(run) for run in members] for members in (pre, qkv)]
            if any(v is not None for v in values[0] + values[1]):
                shown = [_with_interval(_spread(v), interval(members[0]) if interval and len(members) == 1 else None)
                         for v, members in zip(values, (pre, qkv))]
                rows.append((f"{prefix}Pre-Norm / QKV-Norm: {quantity.format(**words)}", " / ".join(shown),
                             paper, direction_verdict(*values, direction)))
        for split in SPLIT_ORDER:
            values = [[accuracy.get(run.name, {}).get(split, np.nan) / 100 for run in members] for members in (pre, qkv)]
            if any(np.isfinite(v) for v in values[0] + values[1]):
                paper = " / ".join(f"{PAPER['accuracy'][p][split]:.1f} %" for p in ("pre", "qkv"))
                direction = int(np.sign(PAPER["accuracy"]["pre"][split] - PAPER["accuracy"]["qkv"][split]))
                rows.append((f"{prefix}Pre-Norm / QKV-Norm: per-token accuracy, {split}",
                             " / ".join(_spread(v) for v in values), paper, direction_verdict(*values, direction)))
        rows.append((f"{prefix}Seeds (models) per placement, Pre-Norm / QKV-Norm", f"{len(pre)} / {len(qkv)}", "1 / 1", "—"))
    sizes = sorted({model_size(run.model) for run in runs})
    rows.append(("Model size", "; ".join(sizes), PAPER["size"], "—"))
    return rows


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
            f"{_shown(run.model.get('source', '?'))} ({model_size(run.model)}; {describe_norms(run.model)}); "
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


def write_report(results, out, title: str = "orthosphere report") -> Path:
    """Write report.html, report.md (with figures/) and configuration.json for the given results (one
    path or URL, or a list of them) into the folder `out`; returns it. Everything is computed before
    anything is written, and figures an earlier report wrote there that this one does not draw are removed."""
    runs = load_runs(result_paths(results))
    figures = {}
    for name, (caption, draw) in FIGURES.items():
        figure = draw(runs)
        if figure is not None:
            figures[name] = (caption, _png(figure))
    rows = headline_rows(runs)
    made = f"orthosphere {metadata.version('orthosphere')}, {datetime.now(UTC).isoformat(timespec='seconds')}"
    provenance = _provenance(runs)
    notes = setting_differences(runs) + site_notes(runs)
    files = {"report.md": _markdown(title, rows, notes, figures, provenance, made),
             "report.html": _html(title, rows, notes, figures, provenance, made),
             "configuration.json": json.dumps(_configuration(runs), indent=2, default=str) + "\n"}
    out = Path(out)
    (out / "figures").mkdir(parents=True, exist_ok=True)
    for name in FIGURES:
        path = out / "figures" / f"{name}.png"
        if name in figures:
            path.write_bytes(figures[name][1])
        else:
            path.unlink(missing_ok=True)  # an earlier report's, stale beside this one
    for name, text in files.items():
        (out / name).write_text(text)
    return out


def site_notes(runs: list[Run]) -> list[str]:
    """Which analysed sites' norms the report shows (the attention input, resid_pre) and which it leaves out."""
    sites = {site for run in runs if "norms" in run.tree.children for site in run.tree["norms"].children}
    if not sites - {"resid_pre"}:
        return []
    shown = "shows those of resid_pre (the attention input)" if "resid_pre" in sites else "shows none (only resid_pre's are drawn)"
    return [f"Norms: the results hold those of {', '.join(sorted(sites))}; the report {shown} and leaves out "
            f"{', '.join(sorted(sites - {'resid_pre'}))} (read them with orthosphere.open_results(RESULTS)['norms/SITE'])."]


def result_paths(results) -> list[str]:
    """The results' paths or URLs: one, or a list of them."""
    if isinstance(results, (str, os.PathLike)):
        return [os.fspath(results)]
    if isinstance(results, (list, tuple)) and all(isinstance(result, (str, os.PathLike)) for result in results):
        return [os.fspath(result) for result in results]
    given = results if isinstance(results, (list, tuple)) else [results]
    wrong = next(result for result in given if not isinstance(result, (str, os.PathLike)))
    hint = ("; a results tree in memory cannot be reported: pass the path that `orthosphere.analyze(store, out)` wrote "
            "it to" if isinstance(wrong, xr.DataTree) else "")
    raise TypeError(f"results of type {type(wrong).__name__}: expected the path or URL of results written by "
                    f"`orthosphere analyze`, or a list of them{hint}")


HEADLINE_COLUMNS = ("quantity", "here: mean [min–max] over seeds (one seed: its value and its interval within the run)",
                    "paper", "paper's direction beyond the seed spread?")


def _markdown(title, rows, notes, figures, provenance, made) -> str:
    lines = [f"# {title}", "", f"Made by {made}.", "", "## Headline: this project beside the paper", "",
             f"| {' | '.join(HEADLINE_COLUMNS)} |", "|---|---|---|---|"]
    lines += [f"| {' | '.join(_cell(text) for text in row)} |" for row in rows]
    lines += [line for note in notes for line in ("", note)]
    for name, (caption, _) in figures.items():
        lines += ["", f"## {caption}", "", f"![{caption}](figures/{name}.png)"]
    lines += ["", "## What produced this report", "", "Every option of every run: configuration.json.", ""]
    lines += [f"- {line}" for line in provenance]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    """Markdown table cell text (a bare | would end the cell)."""
    return text.replace("|", "\\|")


def _html(title, rows, notes, figures, provenance, made) -> str:
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
{"".join(f"<p>{html.escape(note)}</p>" for note in notes)}
{sections}
<h2>What produced this report</h2><p>Every option of every run: configuration.json.</p><ul>{sources}</ul>
</body></html>
"""
