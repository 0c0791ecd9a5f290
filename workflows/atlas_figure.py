"""The atlas's figure: per-layer measures of every model overlaid on a relative-depth axis
(layer / (n_layers - 1): 0 the first layer, 1 the last), so that models of different depths compare."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import xarray as xr  # noqa: E402

PANELS = (
    ("norm_geometry", "median_norm", "median |resid_pre| / first layer's", "log", True),
    ("norm_geometry", "massive_ratio", "largest |x_i| / median |x_i|", "log", False),
    ("norm_geometry", "sink_share", "share of sink heads (attention on start > 0.3)", "linear", False),
    ("norm_geometry", "norm_scale_cv", "norm_scale: CV within sequences", "linear", False),
    ("norms/resid_pre", "band_layer", "band of |resid_pre| / median (90 %)", "linear", False),
    ("norm_geometry", "sparse_share", "share of sparse (query, head) pairs", "linear", False),
)
"""(group, variable with dim layer, title, y scale, divided by its first layer's value)."""


def _curve(tree: xr.DataTree, group: str, name: str, relative: bool):
    node = tree
    for part in group.split("/"):
        node = node.children.get(part) if node is not None else None
    if node is None or name not in node.data_vars:
        return None
    values = node[name]
    n_layers = int(tree.attrs.get("model", {}).get("n_layers", values.layer.max() + 1))
    depth = values.layer.values / max(n_layers - 1, 1)
    data = np.asarray(values.values, dtype=float)
    return depth, data / data[0] if relative else data


def write_figure(trees: dict[str, xr.DataTree], path: Path) -> Path | None:
    """atlas.png with one panel per measure (PANELS), one line per model; None without models."""
    if not trees:
        return None
    figure, axes = plt.subplots(2, 3, figsize=(14, 7.5), layout="constrained")
    for axis, (group, name, title, scale, relative) in zip(axes.flat, PANELS):
        for model, tree in trees.items():
            curve = _curve(tree, group, name, relative)
            if curve is not None:
                axis.plot(*curve, marker=".", label=model)
        axis.set(title=title, xlabel="relative depth (layer / last layer)", yscale=scale)
    axes.flat[0].legend(fontsize=8)
    figure.suptitle("The atlas: normalisation geometry per layer, models overlaid on relative depth")
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
