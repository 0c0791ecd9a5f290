"""What a test of "on sphere" can show in the calibration's sphere cells (tests/planted_cells.py): an
oracle that knows each factor's subspace, each class point's noise exactly and the pattern of the
radii at the claim's boundary (the planted alternating pattern scaled to a radius spread of
radius_cv_tolerance, 0.1) tests the spread of the noise-corrected radii (the analysis's statistic)
at its level, with none of the analysis's own uncertainty (the subspace, the noise, the pattern).

For 8 equally frequent classes there is a bound for every valid test that treats the classes alike:
the radial noise of each class point is (to first order) N(0, s^2) with s the same for every class,
so the sum of squared deviations of the radii from their mean over s^2 is chi-square with 7 degrees
of freedom, noncentral at the boundary (noncentrality 8 R^2 0.1^2 / s^2); the best such test rejects
for its small values, and no such test has more power.

    python benchmarks/sphere_power.py      # a few seconds, no store written

Prints, per cell: the mean radius R of the class points, the noise of one class point's radius
against R, the median and spread of the radius spread measured on a sphere and at the boundary, and
the oracle's power at the levels 0.05 and 0.025 (about what Benjamini-Hochberg leaves each test when
half the tests are true), beside the noncentral chi-square bound.
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' planted cells

import numpy as np  # noqa: E402
from scipy.stats import chi2, ncx2  # noqa: E402

from tests.planted_cells import SIGNALS, Cell, _labels, _sphere_points  # noqa: E402

TOLERANCE = 0.1
LEVELS = (0.05, 0.025)
DRAWS = 20000


def weighted_cv(radii: np.ndarray, weights: np.ndarray) -> np.ndarray:
    mean = radii @ weights
    return np.sqrt(np.maximum(((radii - mean[..., None]) ** 2) @ weights, 0.0)) / mean


def measured_cv(points: np.ndarray, noise_sd: np.ndarray, weights: np.ndarray, rng) -> np.ndarray:
    """(DRAWS,) radius spreads of class points (k, 2) measured with their noise, each radius squared
    less its known noise variance (as the analysis corrects them)."""
    noisy = points[None] + rng.normal(size=(DRAWS,) + points.shape) * noise_sd[None, :, None]
    radii = np.sqrt(np.maximum(np.sum(noisy**2, axis=-1) - 2 * noise_sd**2, 0.0))
    return weighted_cv(radii, weights)


def cell_power(cell: Cell, rng) -> str:
    a, _, role_x = _labels(cell, np.random.default_rng(0))
    counts = np.bincount(a[role_x], minlength=cell.n_classes).astype(float)
    weights = counts / counts.sum()
    singular = SIGNALS[cell.signal] * ((cell.n_classes - 1) * cell.d_model) ** 0.25
    plane = np.eye(2)

    def points(spread: float) -> np.ndarray:
        return _sphere_points(a[role_x], cell.n_classes, plane, singular, spread, np.random.default_rng(1))[0]

    spread = TOLERANCE
    for _ in range(40):  # the alternating pattern's spread whose radius CV is the tolerance
        spread *= TOLERANCE / weighted_cv(np.linalg.norm(points(spread), axis=1), weights)
    noise_sd = 1 / np.sqrt(counts)  # a class mean's noise per dimension (unit noise per token)
    radius = float(np.linalg.norm(points(0.0), axis=1) @ weights)
    on, boundary = measured_cv(points(0.0), noise_sd, weights, rng), measured_cv(points(spread), noise_sd, weights, rng)
    line = (f"{cell.name}: R {radius:.3f}, one class point's radius noise / R {np.median(noise_sd) / radius:.3f} "
            f"(median over classes); radius CV measured on a sphere {np.median(on):.3f} (sd {on.std():.3f}), at the "
            f"tolerance {np.median(boundary):.3f} (sd {boundary.std():.3f}); oracle power")
    line += ", ".join(f" {np.mean(on < np.quantile(boundary, level)):.3f} at {level}" for level in LEVELS)
    if not cell.zipf:
        noncentrality = cell.n_classes * TOLERANCE**2 * radius**2 / np.median(noise_sd) ** 2
        bounds = [chi2.cdf(ncx2.ppf(level, cell.n_classes - 1, noncentrality), cell.n_classes - 1) for level in LEVELS]
        line += "; best invariant test" + ", ".join(f" {bound:.3f} at {level}" for bound, level in zip(bounds, LEVELS))
    return line


def main() -> None:
    rng = np.random.default_rng(0)
    base = Cell(truth="orthogonal", sphere="on")
    for signal in ("moderate", "strong"):
        for k, zipf in ((8, False), (64, True)):
            print(cell_power(replace(base, signal=signal, n_classes=k, zipf=zipf), rng), flush=True)


if __name__ == "__main__":
    main()
