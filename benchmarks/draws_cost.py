"""What the statistics' noise draws cost per layer against d_model: planted stores (tests/planted_cells.py)
of the same design (two factors, 8 and 4 classes, a pair at 60 degrees, moderate signal) at several
d_model, analysed with default options on one thread; the time spent in each layer's draws (ranks,
intervals, claims, spheres: ``layer._infer``), apart from the pass that reads the store and the fit.

    python benchmarks/draws_cost.py                       # d_model 64, 576, 2304; 20 layers each
    python benchmarks/draws_cost.py --d-model 64 4096 --layers 10

The draws work in the span of the fitted bases and of the groups' influences (at most groups x
classes of them), so their time should stop growing once d_model passes that.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' planted cells

import dask  # noqa: E402

import orthosphere.analyze.layer as layer  # noqa: E402
from tests.planted_cells import Cell, plant, run  # noqa: E402


def timed_draws(cell: Cell, root: Path) -> float:
    """Seconds spent in the layers' draws of one planted store, per layer."""
    spent = []
    infer = layer._infer

    def timed(*args, **kwargs):
        started = time.perf_counter()
        infer(*args, **kwargs)
        spent.append(time.perf_counter() - started)

    layer._infer = timed
    try:
        run(plant(cell, root))
    finally:
        layer._infer = infer
    return sum(spent) / len(spent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, nargs="+", default=[64, 576, 2304])
    parser.add_argument("--layers", type=int, default=20)
    args = parser.parse_args()
    dask.config.set(scheduler="synchronous")  # one thread: the draws' own time
    base = Cell(n_classes=8, n_layers=args.layers)
    with tempfile.TemporaryDirectory(prefix="draws-cost-") as root:
        for d_model in args.d_model:
            seconds = timed_draws(replace(base, d_model=d_model), Path(root))
            print(f"d_model {d_model}: {1000 * seconds:.0f} ms of draws per layer "
                  f"({32 * (8 + 4)} influence rows of 32 groups)", flush=True)


if __name__ == "__main__":
    main()
