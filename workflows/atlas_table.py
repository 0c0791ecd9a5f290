"""The atlas's comparison: one row per model from its results, the table (``atlas.zarr``'s root,
``atlas.md``, ``atlas.csv``), the results of every model in one DataTree, and the figure of the
models overlaid on a relative-depth axis (layer / (n_layers - 1))."""
from __future__ import annotations

import csv
import math
import shutil
from pathlib import Path

import numpy as np
import xarray as xr
import zarr

from orthosphere.analyze import open_results

from .report import THEORY_LEVEL

COLUMNS = {
    "status": "ok, or the error that stopped the model",
    "family": "the model's family (model_type)",
    "parameters": "the model's parameters",
    "norm": "norm type and placement (pre, post, sandwich, none ...), with QK-norm where the model has it",
    "positions": "how the model encodes positions",
    "layers": "layers",
    "windows": "samples (windows of the corpus) analysed",
    "norm_band": "the paper's band: half-width holding 90 % of |resid_pre| / median, attention-weighted, each head "
                 "over its own median, pooled over layers and heads (/norms/resid_pre band_pooled)",
    "norm_scale_cv": "coefficient of variation of norm_scale within sequences, over layers (/norm_geometry)",
    "growth_per_layer": "residual norm growth per layer, exp of the change of mean log |resid_pre| per layer",
    "massive_ratio": "largest |x_i| / median |x_i| of resid_pre in the layer where it is largest",
    "massive_dimension": "the dimension that carries that largest |x_i| (and its layer)",
    "sink_share": "share of heads whose mean attention on the start token exceeds 0.3, over layers and heads",
    "sparse_share": "share of (query, head) pairs with largest attention >= 0.95, queries with >= min_keys keys",
    "collapse_level": "noise RMS at which 1 % of sparse instances collapse, pooled (/replay collapse_level_pooled)",
    "theory_recall": f"Theorem 7's recall at {THEORY_LEVEL:g} noise, pooled over layers and heads",
    "theory_precision": f"Theorem 7's precision at {THEORY_LEVEL:g} noise, pooled over layers and heads",
    "token_spheres": "sphere verdicts of the token-identity factor over the layers (/spheres sphere)",
    "position_spheres": "sphere verdicts of the position factor over the layers",
    "token_position": "relation of the token-identity and position subspaces over the layers (/subspaces relation)",
    "extract_s": "seconds the extraction took in this run (NaN: already complete)",
    "analyse_s": "seconds the analyses took in this run (NaN: already complete)",
}
INTERVALS = ("norm_scale_cv", "growth_per_layer", "sink_share", "sparse_share", "collapse_level")
"""Columns with an interval (``<column>_low``, ``<column>_high`` in the table)."""
TABLE_VARIABLES = (*COLUMNS, *(f"{name}_{bound}" for name in INTERVALS for bound in ("low", "high")))
"""The table's variables, at atlas.zarr's root beside its coordinate ``model`` and the models' groups."""


def model_row(tree: xr.DataTree, windows: int) -> dict:
    """One model's row of the table from its results tree (NaN or "" where an analysis is missing)."""
    model = tree.attrs.get("model", {})
    row = {"status": "ok", "family": model.get("family", ""), "parameters": model.get("n_parameters", math.nan),
           "norm": _norm(model), "positions": str(model.get("positions", "")), "layers": model.get("n_layers", math.nan),
           "windows": windows}
    row.update(_geometry(tree))
    row.update(_replay(tree))
    row.update(_verdicts(tree))
    norms = tree.children.get("norms")
    row["norm_band"] = float(norms["resid_pre"]["band_pooled"]) if norms and "resid_pre" in norms.children else math.nan
    return row


def _norm(model: dict) -> str:
    norm = f"{model.get('norm_placement', '?')} {model.get('norm_type', '')}".strip()
    return norm + (f" + QK-norm ({model['qk_norm']})" if model.get("qk_norm") else "")


def _with_interval(row: dict, name: str, value, interval) -> None:
    row[name] = float(value)
    row[f"{name}_low"], row[f"{name}_high"] = (float(bound) for bound in np.asarray(interval))


def _geometry(tree: xr.DataTree) -> dict:
    if "norm_geometry" not in tree.children:
        return {}
    geometry = tree["norm_geometry"].to_dataset()
    row: dict = {}
    for name in ("norm_scale_cv", "sink_share", "sparse_share"):
        if f"{name}_pooled" in geometry:
            _with_interval(row, name, geometry[f"{name}_pooled"], geometry[f"{name}_pooled_ci"])
    _with_interval(row, "growth_per_layer", geometry["growth_per_layer"], geometry["growth_per_layer_ci"])
    ratio = geometry["massive_ratio"]
    layer = int(ratio.idxmax("layer")) if np.isfinite(ratio).any() else None
    row["massive_ratio"] = math.nan if layer is None else float(ratio.sel(layer=layer))
    row["massive_dimension"] = "" if layer is None else (
        f"{int(geometry['top_dimension'].sel(layer=layer)[0])} (layer {layer})")
    return row


def _replay(tree: xr.DataTree) -> dict:
    if "replay" not in tree.children:
        return {}
    replay = tree["replay"].to_dataset()
    row: dict = {}
    _with_interval(row, "collapse_level", replay["collapse_level_pooled"].sel(definition="collapse"),
                   replay["collapse_level_pooled_ci"].sel(definition="collapse"))
    for measure in ("recall", "precision"):
        pooled = replay[f"theory_{measure}_pooled"]
        row[f"theory_{measure}"] = float(pooled.sel(level=THEORY_LEVEL)) if THEORY_LEVEL in pooled.level else math.nan
    return row


def _verdicts(tree: xr.DataTree) -> dict:
    """Counts of the sphere verdicts of the token-identity factor (token_str, or the first factor that
    is not pos) and of pos, and of their subspaces' relation, over the layers."""
    if "spheres" not in tree.children:
        return {}
    spheres = tree["spheres"].to_dataset()
    factors = [str(factor) for factor in spheres.factor.values]
    token = "token_str" if "token_str" in factors else next((f for f in factors if f != "pos"), None)
    row = {"token_spheres": _counts(spheres["sphere"].sel(factor=token)) if token else "",
           "position_spheres": _counts(spheres["sphere"].sel(factor="pos")) if "pos" in factors else ""}
    row["token_position"] = (_counts(spheres["relation"].sel(factor=token, other="pos"))
                             if token and "pos" in factors else "")
    return row


def _counts(verdicts: xr.DataArray) -> str:
    """"off sphere 12, undetermined 3" over the layers, most frequent first."""
    values, counts = np.unique([str(value) for value in np.ravel(verdicts.values)], return_counts=True)
    order = np.argsort(-counts, kind="stable")
    return ", ".join(f"{values[i] or 'none'} {counts[i]}" for i in order)


def failed_row(message: str) -> dict:
    return {"status": f"failed: {message}"}


def table_dataset(rows: dict[str, dict]) -> xr.Dataset:
    """The table as a Dataset with dim model (numbers as float64, text as str)."""
    variables = {}
    for name in TABLE_VARIABLES:
        values = [row.get(name) for row in rows.values()]
        numeric = all(value is None or isinstance(value, (int, float)) for value in values) and name not in (
            "status", "family", "norm", "positions", "massive_dimension")
        data = (np.array([math.nan if v is None else float(v) for v in values]) if numeric
                else np.array(["" if v is None else str(v) for v in values], dtype=str))
        description = COLUMNS.get(name) or f"{'lower' if name.endswith('low') else 'upper'} bound of the 90 % interval"
        variables[name] = (("model",), data, {"description": description})
    return xr.Dataset(variables, coords={"model": list(rows)})


def _cell(value) -> str:
    if isinstance(value, (float, np.floating)):
        if not np.isfinite(value):
            return "–"
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    return str(value)


def _csv_cell(value):
    """A whole number as an integer (the table holds numbers as float64), anything else as it is."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def table_markdown(table: xr.Dataset) -> str:
    """The table in Markdown, intervals in brackets after their value."""
    shown = [name for name in COLUMNS]
    lines = ["| model | " + " | ".join(shown) + " |", "|" + "---|" * (len(shown) + 1)]
    for model in table.model.values:
        cells = []
        for name in shown:
            value = table[name].sel(model=model).item()
            cell = _cell(value)
            if name in INTERVALS and cell != "–":
                low, high = (_cell(table[f"{name}_{bound}"].sel(model=model).item()) for bound in ("low", "high"))
                cell += f" [{low}, {high}]"
            cells.append(cell.replace("|", "/"))
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_tree(table: xr.Dataset, results: dict[str, Path], path: Path) -> None:
    """One Zarr DataTree at `path`: the table at its root, each model's results (a copy of its results
    folder) as the group of its name, listed in the root's consolidated metadata. Written beside, then
    moved in place, so that a crash never leaves half a tree."""
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    table.to_zarr(partial, mode="w", consolidated=False, zarr_format=3)
    for name, folder in results.items():
        shutil.copytree(folder, partial / name)
    zarr.consolidate_metadata(str(partial))
    shutil.rmtree(path, ignore_errors=True)
    partial.rename(path)


def write_comparison(atlas, outcomes: dict) -> None:
    """atlas.zarr (the table at the root, each model's results as its group), atlas.md, atlas.csv,
    atlas.png, from each model's outcome (its paths and timings, or its error)."""
    rows, trees = {}, {}
    for model in atlas.models:
        outcome = outcomes[model.name]
        if isinstance(outcome, str):
            rows[model.name] = failed_row(outcome)
            continue
        tree = open_results(str(outcome["results"])).load()
        windows = int(xr.open_zarr(outcome["store"]).sizes["sample"])
        rows[model.name] = model_row(tree, windows) | {"extract_s": outcome["extract_seconds"],
                                                       "analyse_s": outcome["analyse_seconds"]}
        trees[model.name] = tree
    table = table_dataset(rows)
    table.attrs.update({"atlas": atlas.name, "models": list(rows)})
    write_tree(table, {name: outcomes[name]["results"] for name in trees}, atlas.root / "atlas.zarr")
    (atlas.root / "atlas.md").write_text(f"# atlas {atlas.name}\n\n" + table_markdown(table))
    with open(atlas.root / "atlas.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["model", *table.data_vars])
        for model in table.model.values:
            writer.writerow([model, *(_csv_cell(table[name].sel(model=model).item()) for name in table.data_vars)])
    from .atlas_figure import write_figure

    write_figure(trees, atlas.root / "atlas.png")
