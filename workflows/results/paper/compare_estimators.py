"""How the joint factor fit moved this run's subspace and sphere figures: the test-split stores of
`orthosphere run workflows/configs/paper.toml`, analysed again with the per-factor class means
(`estimator=marginal`, the estimator of the first run of this table), side by side with the
pipeline's results (the joint fit, the default). Prints a Markdown table.

    python workflows/results/paper/compare_estimators.py [--root runs/paper]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import numpy as np

from orthosphere.analyze import open_results

MODELS = ("pre", "qkv", "none", "post")


def marginal_results(root: Path, model: str) -> Path:
    """The marginal-estimator subspaces and spheres of a model's test store (computed once)."""
    out = root / "marginal" / f"{model}-test.zarr"
    if not out.exists():
        subprocess.run([sys.executable, "-m", "orthosphere", "analyze", str(root / "stores" / f"{model}-test.zarr"),
                        "--out", str(out), "--only", "subspaces,spheres", "--option", "estimator=marginal"], check=True)
    return out


def summary(results: Path) -> dict[str, str]:
    """Mean smallest angle over layers per factor pair (with the most frequent relation), mean rank
    per factor, and the sphere deviation (layer 0; mean over layers)."""
    tree = open_results(results)
    subspaces, spheres = tree["subspaces"].to_dataset(), tree["spheres"].to_dataset()
    row = {}
    for a, b in combinations(subspaces.factor.values.tolist(), 2):
        pair = subspaces.sel(factor=a, other=b)
        relations, counts = np.unique([str(r) for r in pair["relation"].values], return_counts=True)
        relation = f", {relations[np.argmax(counts)]}" if relations.size and relations[np.argmax(counts)] else ""
        row[f"{a} / {b}"] = f"{float(pair['min_angle'].mean()):.1f}°{relation}"
    for factor in subspaces.factor.values.tolist():
        row[f"rank {factor}"] = f"{float(subspaces['subspace_rank'].sel(factor=factor).mean()):.1f}"
    deviation = spheres["deviation"].values
    row["sphere deviation"] = f"{deviation[0]:.2f}; {np.mean(deviation):.2f}"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("runs/paper"))
    args = parser.parse_args()
    rows = {}
    for model in MODELS:
        rows[f"{model}, joint"] = summary(args.root / "results" / f"{model}-test.zarr")
        rows[f"{model}, marginal"] = summary(marginal_results(args.root, model))
    columns = list(next(iter(rows.values())))
    print("| model, estimator | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(row[column] for column in columns) + " |")


if __name__ == "__main__":
    main()
