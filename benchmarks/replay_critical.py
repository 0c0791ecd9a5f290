"""Critical levels against the grid evaluation: the replay's collapse counts, both ways, on sharp heads.

One layer's block of a language model's shape (default 64 windows of 128 positions, 9 heads over 3
key-value heads of 64), q and k drawn so that most instances are sparse. For every draw: the grid
evaluation (``HeadBlock.perturb`` at each level: the float32 softmax the replay ran before, which
the online check still uses) and the critical levels (``SparseRows.count_draw``: one pass a draw).
Prints both times, their ratio and whether the counts of collapses, strict collapses and both
conditions agree at every level (they must, up to near-ties within float32 rounding).

Usage: python benchmarks/replay_critical.py [--samples 64] [--draws 8]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from orthosphere.analyze.attention import ScoreTerms
from orthosphere.analyze.replay_blocks import DEFAULT_LEVELS, PREDICTIONS, HeadBlock, ReplaySettings, SparseRows


def sharp_block(n_samples: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = (2.5 * rng.normal(size=(n_samples, 128, 9, 64))).astype(np.float32)
    k = (2.5 * rng.normal(size=(n_samples, 128, 3, 64))).astype(np.float32)
    return q, k, np.ones((n_samples, 128), bool)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--draws", type=int, default=8)
    args = parser.parse_args()
    q, k, valid = sharp_block(args.samples)
    terms = ScoreTerms(64**-0.5, True)
    settings = ReplaySettings(levels=DEFAULT_LEVELS, n_draws=args.draws, targets=("q", "k"))
    block = HeadBlock(q, k, valid, terms, settings.sparse_threshold, min_keys=settings.min_keys)
    samples = np.arange(args.samples)
    n_levels, n_heads = len(settings.levels), block.n_heads
    zeros = lambda: np.zeros((n_levels, n_heads))  # noqa: E731
    grid = {name: zeros() for name in ("collapse", "strict", "theory_predicted", "exact_predicted")}
    critical = {"collapses": np.zeros((2, n_levels, n_heads)), "sample_collapses": np.zeros((args.samples, 2, n_levels)),
                "sample_curve": np.zeros((args.samples, len(settings.curve_levels))),
                **{f"{rule}_{count}": zeros() for rule in PREDICTIONS for count in ("predicted", "missed", "false_alarm")}}
    grid_seconds = critical_seconds = 0.0
    rows = SparseRows(block, settings)
    for draw in range(args.draws):
        unit = {t: settings.kappa(t, 0, samples, draw, 128, n) for t, n in (("q", 9), ("k", 3))}
        started = time.perf_counter()
        for index, level in enumerate(settings.levels):
            effects = block.perturb(level * unit["q"], level * unit["k"])
            for name in grid:
                grid[name][index] += effects[name].sum(axis=(0, 2))
        grid_seconds += time.perf_counter() - started
        started = time.perf_counter()
        rows.count_draw(critical, unit["q"], unit["k"])
        critical_seconds += time.perf_counter() - started
    same = {"collapse": np.array_equal(critical["collapses"][0], grid["collapse"]),
            "strict": np.array_equal(critical["collapses"][1], grid["strict"]),
            **{rule: np.array_equal(critical[f"{rule}_predicted"], grid[f"{rule}_predicted"]) for rule in PREDICTIONS}}
    print(f"{args.samples} windows x 128 positions, 9 / 3 heads of 64, {args.draws} draws x {n_levels} levels; "
          f"{int(block.sparse.sum())} sparse instances of {int(block.instance.sum())}")
    print(f"grid evaluation {grid_seconds:.2f} s, critical levels {critical_seconds:.2f} s: "
          f"{grid_seconds / critical_seconds:.1f}x; identical counts: {same}")
    print("pooled collapse rate at the levels:",
          np.round(critical["collapses"][0].sum(axis=1) / (block.sparse.sum() * args.draws), 5).tolist())


if __name__ == "__main__":
    main()
