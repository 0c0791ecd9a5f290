"""The figures the results READMEs quote, from a pipeline's results: per model (test split), each pair
of factors' smallest angle per layer (noise-corrected estimate [interval] relation), each factor's
rank per layer, its sphere verdict (radius spread [interval]) per layer, and the norm band per layer
and pooled; with `--intercepts`, the test stores' operand / position angle analysed again with
one intercept for all tokens and with the position read on digits only (what the default's role
intercepts change). Prints Markdown.

    python workflows/results/summarise.py runs/paper-task [--intercepts]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import numpy as np

from orthosphere.analyze import open_results


def _interval(estimate: float, interval) -> str:
    return "–" if not np.isfinite(estimate) else f"{estimate:.0f} [{interval[0]:.0f}, {interval[1]:.0f}]"


def model_rows(results: Path) -> dict[str, str]:
    """One model's figures, by column."""
    tree = open_results(results)
    subspaces, spheres = tree["subspaces"].to_dataset(), tree["spheres"].to_dataset()
    row = {}
    for a, b in combinations(subspaces.factor.values.tolist(), 2):
        pair = subspaces.sel(factor=a, other=b)
        row[f"{a} / {b}"] = "; ".join(f"{_interval(e, i)} {r}" for e, i, r in zip(
            pair.min_angle_estimate.values, pair.min_angle_ci.values, pair.relation.values))
    for factor in subspaces.factor.values.tolist():
        row[f"rank {factor}"] = ", ".join(str(int(r)) for r in subspaces.subspace_rank.sel(factor=factor).values)
        one = spheres.sel(factor=factor)
        row[f"sphere {factor}"] = "; ".join(f"{_interval(e, i)} {v}" for e, i, v in zip(
            100 * one.radius_cv_estimate.values, 100 * one.radius_cv_ci.values, one.sphere.values))
    norms = tree["norms/resid_pre"].to_dataset()
    row["band per layer; pooled (%)"] = (", ".join(f"{100 * b:.0f}" for b in norms.band_layer.values)
                                         + f"; {100 * float(norms.band_pooled):.0f}")
    return row


def intercept_rows(root: Path, store: Path) -> dict[str, str]:
    """The operand / position smallest angle per layer with the default role intercepts, with one
    intercept for all tokens, and with the position read on digits only."""
    variants = {"role intercepts (default)": [], "one intercept": ["--intercepts", "none"],
                "pos[role=digit]": ["--factor", "digit_value[role=digit]", "--factor", "operand[role=digit]",
                                    "--factor", "pos[role=digit]"]}
    rows = {}
    for name, arguments in variants.items():
        out = root / "intercepts" / f"{store.stem}-{name.split()[0].replace('[', '-').strip(']')}.zarr"
        if not out.exists():
            done = subprocess.run([sys.executable, "-m", "orthosphere", "analyze", str(store), "--out", str(out),
                                   "--only", "subspaces", *arguments], capture_output=True, text=True)
            if done.returncode != 0:  # e.g. factors this store's labels cannot separate
                rows[name] = "refused: " + done.stderr.strip().splitlines()[-1].removeprefix("Error: ").split(":")[0]
                continue
        subspaces = open_results(out)["subspaces"].to_dataset()
        position = next(f for f in subspaces.factor.values if str(f).startswith("pos"))
        pair = subspaces.sel(factor="operand[role=digit]", other=position)
        rows[name] = "; ".join(f"{_interval(e, i)} {r}" for e, i, r in zip(
            pair.min_angle_estimate.values, pair.min_angle_ci.values, pair.relation.values))
    return rows


def table(rows: dict[str, dict[str, str]]) -> str:
    columns = list(next(iter(rows.values())))
    lines = ["| model | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(row[column] for column in columns) + " |" for name, row in rows.items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="a pipeline's root, e.g. runs/paper-task")
    parser.add_argument("--intercepts", action="store_true", help="also analyse the test stores' intercept variants")
    args = parser.parse_args()
    results = sorted((args.root / "results").glob("*-test.zarr"))
    print(table({path.name.removesuffix("-test.zarr"): model_rows(path) for path in results}))
    if args.intercepts:
        rows = {path.name.removesuffix("-test.zarr"): intercept_rows(args.root, args.root / "stores" / path.name)
                for path in results}
        print("\noperand / position, smallest angle per layer:\n")
        print(table(rows))


if __name__ == "__main__":
    main()
