"""Calibration of the statistics over planted truth: error rates of every test, rank, interval and
verdict of /subspaces and /spheres, per cell of a grid (tests/planted_cells.py: each cell one store of
many replicate layers written through orthosphere.store, analysed with default options).

Groups of cells (``--groups``, default all):

- null: labels that carry nothing (factor a's effects zero; b structured), over d_model 16 / 64 / 256 /
  576, classes 2 / 8 / 64, uniform and Zipf, crossed and confounded labels: the false-positive rate
  of "structure" (structure_p <= 0.05; target 3.5-6.5 %), the uniformity of its p-values as a whole
  (Kolmogorov-Smirnov) and the rate of any claim about the pair;
- signal: a planted pair at 60 degrees, weak / moderate / strong signal, over the same sizes: exact
  ranks (target >= 95 % at moderate), coverage of the 90 % intervals of the smallest and largest
  principal angle (target within 5 points), and the bias of the raw and corrected angles;
- truth: moderate signal, d 64, 8 classes, every planted relation: orthogonal (90, 90), 60 degrees,
  a shared direction (0, 90), and the least favourable boundaries of the claims "orthogonal" (80, 90)
  and "dependent" (10, 10): how often each verdict is called (orthogonal pairs called dependent and
  60 degree pairs called orthogonal: target <= 5 %), and each claim's rate of p <= 0.05 at its
  boundary (its size: nominal 5 %);
- ranks: a factor of rank 6 (16 classes, d_model 64 and 256) beside one of rank 2, moderate and strong signal,
  60 degrees and orthogonal: ranks, coverage and verdicts where many noisy directions pull the
  smallest angle down;
- design: confounded labels and a factor read on a subset of tokens (whose other tokens sit elsewhere);
- spheres: class points on a sphere, and with radii spread +-40 %: told apart (target >= 95 %);
- departures: how real activations differ from the planted model, one departure a cell, each beside
  its twin without it (same sizes, effects and total variance; tests/planted_cells.py DEPARTURES):
  documents across 4 packed windows with labels clustered by document (a null label, and ranks
  [2, 3]), bursty null labels, rogue dimensions and sinks (ranks [2, 3]), float16 rounding (ranks
  [3, 2], orthogonal with confounded labels, oblique with crossed ones), a pooled Zipf vocabulary on a sphere and binned positions on a circle (sphere
  "on" or "undetermined", never "off"), an interaction of the two factors (ranks [2, 2], 60 degrees:
  the interaction lives in a plane of its own and belongs to neither factor). Their targets are the
  other groups' (with rogue dimensions and sinks: within 5 points of the twin).

Coverage at a planted angle of 0 or 90 degrees, or a radius spread of 0 (on a sphere), is one-sided:
only one bound can miss there (nominal 95 % for a 90 % interval); the truth and spheres groups show
the shares missed below and above.

    python benchmarks/calibration.py                      # every group, 200 layers a cell
    python benchmarks/calibration.py --groups null --layers 400
    python benchmarks/calibration.py --quick              # 40 layers a cell, a few cells per group
    python benchmarks/calibration.py --groups departures --layers 48

Prints one line per cell as it finishes (with its seconds per layer, for planning a run), then the
table (markdown) for benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' planted stores

import numpy as np  # noqa: E402
import xarray as xr  # noqa: E402
from scipy.stats import kstest  # noqa: E402

from tests.planted_cells import Cell, Planted, plant, run, score, twin_of  # noqa: E402

CHUNK_LAYERS = 200
"""A cell of more layers is planted as several stores of at most this many (seeds 0, 1, ...; each its own
design), so that a store stays a few GB at d_model 576; their results are scored together."""


def grid(group: str, n_layers: int, quick: bool) -> list[Cell]:
    """The cells of one group."""
    base = Cell(n_layers=n_layers)
    sizes = [(16, 2), (16, 64), (64, 8), (64, 64), (256, 8), (256, 64), (576, 8), (576, 64)]
    if quick:
        sizes = [(16, 64), (64, 8), (256, 8)]
    if group == "null":
        return [replace(base, d_model=d, n_classes=k, zipf=zipf, confounded=confounded, signal="none")
                for d, k in sizes for zipf in (False, True) for confounded in (False, True)
                if not (zipf and k == 2) and not (quick and confounded)]
    if group == "signal":
        return [replace(base, d_model=d, n_classes=k, zipf=zipf, signal=signal)
                for d, k in sizes for zipf in (False, True) for signal in ("weak", "moderate", "strong")
                if not (zipf and k == 2) and not (quick and zipf)]
    if group == "truth":
        return [replace(base, truth=truth, signal=signal) for truth in
                ("orthogonal", "oblique", "shared", "orthogonal-edge", "dependent-edge")
                for signal in ("moderate", "strong")]
    if group == "ranks":
        return [replace(base, d_model=d, n_classes=k, rank=6, signal=signal, truth=truth)
                for d, k in ((64, 16), (256, 16)) for signal in ("moderate", "strong") for truth in ("oblique", "orthogonal")
                if not (quick and d == 256)]
    if group == "design":
        return [replace(base, confounded=True), replace(base, subset=True), replace(base, zipf=True, confounded=True),
                replace(base, n_classes=64, zipf=True, confounded=True, subset=True)]
    if group == "spheres":
        return [replace(base, sphere=sphere, truth="orthogonal", signal=signal, n_classes=k, zipf=zipf)
                for sphere in ("on", "off") for signal in ("moderate", "strong") for k, zipf in ((8, False), (64, True))]
    if group == "departures":
        return [each for cell in departures(base) for each in (cell, twin_of(cell))]
    raise SystemExit(f"unknown group {group!r}: expected any of {GROUPS}")


def departures(base: Cell) -> list[Cell]:
    """One cell per departure from the planted model (their twins beside them in the grid)."""
    return [
        replace(base, departure="documents", signal="none", b_classes=8, rank_b=3),
        replace(base, departure="documents", b_classes=8, rank_b=3),
        replace(base, departure="bursty", signal="none", n_classes=64),
        replace(base, departure="rogue", signal="none", b_classes=8, rank_b=3),
        replace(base, departure="rogue", b_classes=8, rank_b=3),
        replace(base, departure="float16", n_classes=6, rank=3, truth="orthogonal", confounded=True, signal="strong"),
        replace(base, departure="float16", n_classes=6, rank=3, truth="oblique", signal="strong"),
        replace(base, departure="vocabulary", n_classes=20000, zipf=True, rank=3, sphere="on", truth="orthogonal",
                n_samples=512, n_pos=33),
        replace(base, departure="circle", d_model=32, n_pos=129, sphere="on", truth="orthogonal"),
        replace(base, departure="interaction"),
    ]


GROUPS = ("null", "signal", "truth", "ranks", "design", "spheres", "departures")
COLUMNS = {
    "null": ("structure_fp", "structure_fp_corrected", "structure_uniform_p", "rank_zero", "claimed"),
    "signal": ("rank_exact", "rank_exact_b", "min_coverage", "max_coverage", "min_raw_bias", "min_bias",
               "max_raw_bias", "max_bias"),
    "truth": ("rank_exact", "min_coverage", "min_below", "min_above", "max_coverage", "max_below", "max_above",
              "called_orthogonal", "called_dependent", "called_independent", "called_undetermined", "claim_orthogonal_p05",
              "claim_dependent_p05", "claim_independent_p05"),
    "ranks": ("rank_exact", "rank_exact_b", "min_coverage", "max_coverage", "min_bias", "max_bias", "called_orthogonal",
              "called_dependent", "called_independent", "called_undetermined"),
    "design": ("rank_exact", "rank_exact_b", "min_coverage", "max_coverage", "min_raw_bias", "called_independent"),
    "spheres": ("rank_exact", "sphere_right", "sphere_wrong", "sphere_on_p05", "sphere_off_p05", "radius_cv_coverage",
                "radius_cv_below", "radius_cv_above"),
    "departures": ("structure_fp", "structure_fp_corrected", "structure_found", "rank_exact", "rank_exact_b", "rank_mean",
                   "rank_b_mean", "intervals_given", "min_coverage", "max_coverage", "min_raw_bias", "called_orthogonal",
                   "called_dependent", "called_independent", "sphere_right", "sphere_wrong", "seconds_per_layer"),
}


def measure(cell: Cell, root: Path) -> dict:
    """Plant, analyse and score one cell (in stores of at most CHUNK_LAYERS layers)."""
    planted, subspaces, spheres = [], [], []
    for seed, start in enumerate(range(0, cell.n_layers, CHUNK_LAYERS)):
        chunk = plant(replace(cell, n_layers=min(CHUNK_LAYERS, cell.n_layers - start)), root, seed=seed)
        found = run(chunk)
        shutil.rmtree(chunk.url)
        planted.append(chunk)
        subspaces.append(found[0].assign_coords(layer=found[0]["layer"].values + start))
        spheres.append(found[1].assign_coords(layer=found[1]["layer"].values + start))
    together = Planted(cell, "", np.concatenate([chunk.angles for chunk in planted]),
                       np.concatenate([np.full(len(chunk.angles), chunk.radius_cv) for chunk in planted]))
    subspaces = _stacked(subspaces)
    scores = score(together, subspaces, _stacked(spheres))
    if cell.signal == "none":  # the whole null distribution, beyond its 5 % tail: uniform p-values
        scores["structure_uniform_p"] = float(kstest(subspaces["structure_p"].sel(factor="a").values, "uniform").pvalue)
    return scores


def _stacked(chunks: list[xr.Dataset]) -> xr.Dataset:
    """The chunks' results along one layer axis (variables over dimensions whose size differs, such
    as a fitted basis, left out)."""
    sizes = [dict(chunk.sizes) for chunk in chunks]
    varying = {dim for dim in sizes[0] if dim != "layer" and any(size.get(dim) != sizes[0][dim] for size in sizes)}
    kept = [chunk.drop_vars([name for name, array in chunk.variables.items() if varying & set(array.dims)])
            for chunk in chunks]
    return xr.concat(kept, "layer", data_vars="all", coords="minimal", compat="override", join="override")


def binomial_range(share: float, n: int) -> str:
    """The 95 % range of a share of n trials (normal approximation), for reading the table."""
    half = 1.96 * math.sqrt(max(share * (1 - share), 1e-12) / n)
    return f"+-{half * 100:.1f}"


def _shown(value: float | None) -> str:
    """A score as the table shows it: three decimals, a dash where the cell has none."""
    return "-" if value is None or math.isnan(value) else f"{value:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", nargs="+", default=list(GROUPS), choices=GROUPS)
    parser.add_argument("--layers", type=int, default=200, help="replicate layers per cell (default 200)")
    parser.add_argument("--null-layers", type=int, default=None,
                        help="replicate layers per cell of the null group (default: --layers)")
    parser.add_argument("--quick", action="store_true", help="40 layers a cell and a few cells per group")
    parser.add_argument("--after", metavar="CELL", help="resume a long run: skip the cells up to this one (its name "
                        "as printed) in the first group given")
    parser.add_argument("--cells", nargs="+", metavar="CELL", help="run only these cells (names as printed)")
    args = parser.parse_args()
    n_layers = 40 if args.quick else args.layers
    root = Path(tempfile.mkdtemp(prefix="orthosphere-calibration-"))
    tables = {}
    try:
        for group in args.groups:
            rows = []
            layers = args.null_layers if group == "null" and args.null_layers and not args.quick else n_layers
            cells = grid(group, layers, args.quick)
            if args.after and group == args.groups[0]:
                names = [cell.name for cell in cells]
                if args.after not in names:
                    raise SystemExit(f"--after {args.after!r}: not a cell of group {group!r}; its cells: {names}")
                cells = cells[names.index(args.after) + 1:]
            if args.cells:
                cells = [cell for cell in cells if cell.name in args.cells]
            for cell in cells:
                started = time.perf_counter()
                scores = measure(cell, root)
                seconds = time.perf_counter() - started
                scores["seconds_per_layer"] = seconds / scores["layers"]
                rows.append((cell, scores))
                shown = ", ".join(f"{name} {_shown(scores.get(name))}" for name in COLUMNS[group])
                print(f"{group} {cell.name} ({scores['layers']} layers, {seconds:.0f} s, "
                      f"{scores['seconds_per_layer']:.2f} s a layer): {shown}", flush=True)
            tables[group] = rows
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for group, rows in tables.items():
        layers = rows[0][1]["layers"] if rows else n_layers
        print(f"\n### {group} ({layers} layers a cell; 95 % range of a 5 % rate: {binomial_range(0.05, layers)} points)\n")
        print("| cell | " + " | ".join(COLUMNS[group]) + " |")
        print("|---|" + "---|" * len(COLUMNS[group]))
        for cell, scores in rows:
            cells = [_shown(scores.get(name)) for name in COLUMNS[group]]
            print(f"| {cell.name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
