"""Planted stores for calibrating the statistics: one cell of the calibration grid is a store of many
replicate layers sharing one design (labels) and one kind of truth, each layer with its own random
subspaces and noise, written through orthosphere.store and analysed like any store. ``score`` turns
the results into error rates against the planted truth. benchmarks/calibration.py runs the grid;
tests/test_calibration.py a small fixed-seed subset.

The planted model of a layer: x = E_a[c_a] + E_b[c_b] + (role offset) + noise, noise N(0, 1) in every
dimension; factor a has `n_classes` classes (uniform or Zipf), b has 4 (uniform; with `confounded`,
b = a mod 4 on half the tokens); a's subspace has rank min(`rank`, n_classes - 1) (2 by default), b's
rank 2, so that the pair has min(rank_a, 2) principal angles whatever a's rank. Signal
strength is set against the noise: each planted direction's singular value (of the
sqrt(count)-weighted effects) is `SIGNALS[signal]` times the detection threshold (k d)^(1/4) of
noise alone (Benaych-Georges & Nadakuditi 2012): below it no method can see the direction.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from orthosphere.analyze import analyze
from tests.synthetic import NOT_APPLICABLE, bases_at_angles, write_store

SIGNALS = {"none": 0.0, "weak": 1.5, "moderate": 3.0, "strong": 8.0}
TRUTHS = {
    "orthogonal": (90.0, 90.0),
    "oblique": (60.0, 60.0),
    "shared": (0.0, 90.0),
    "orthogonal-edge": (80.0, 90.0),  # the least favourable boundary of the claim "orthogonal" (tolerance 10)
    "dependent-edge": (10.0, 10.0),  # the least favourable boundary of the claim "dependent" (tolerance 10)
}
"""Planted principal angles of the pair (a, b): the smallest first; a rank-1 factor a meets b in the first only."""
OFF_SPHERE_SPREAD = 0.4
"""Off-sphere cells spread the class radii to (1 +- 0.4) times their mean, alternately."""
B_CLASSES = 4


@dataclass(frozen=True)
class Cell:
    """One cell of the grid: the design, the signal, the pair's truth and a's sphere ("on", "off" or
    None: effects spread evenly in their subspace, not on a sphere)."""

    d_model: int = 64
    n_classes: int = 8
    zipf: bool = False
    signal: str = "moderate"
    confounded: bool = False
    subset: bool = False
    truth: str = "oblique"
    sphere: str | None = None
    rank: int = 2
    n_layers: int = 200
    n_samples: int = 256
    n_pos: int = 17

    @property
    def name(self) -> str:
        parts = [f"d{self.d_model}", f"K{self.n_classes}", "zipf" if self.zipf else "uniform", self.signal,
                 "confounded" if self.confounded else "crossed", "subset" if self.subset else "all", self.truth]
        extra = ([f"rank{self.rank}"] if self.rank != 2 else []) + ([f"sphere-{self.sphere}"] if self.sphere else [])
        return "-".join(parts + extra)

    @property
    def rank_a(self) -> int:
        return min(self.rank, self.n_classes - 1)


@dataclass
class Planted:
    """A written cell: the store, each layer's planted smallest and largest angles and a's radius spread."""

    cell: Cell
    url: str
    angles: np.ndarray  # (layer, 2) smallest, largest
    radius_cv: float | np.ndarray  # one per cell, or per layer when cells of several stores are scored together


def class_probabilities(cell: Cell) -> np.ndarray:
    if not cell.zipf:
        return np.full(cell.n_classes, 1 / cell.n_classes)
    weights = 1 / np.arange(1, cell.n_classes + 1) ** 1.1
    return weights / weights.sum()


def _labels(cell: Cell, rng: np.random.Generator):
    n_tokens = cell.n_samples * (cell.n_pos - 1)
    a = rng.choice(cell.n_classes, size=n_tokens, p=class_probabilities(cell))
    b = rng.integers(0, B_CLASSES, n_tokens)
    if cell.confounded:
        b = np.where(rng.random(n_tokens) < 0.5, a % B_CLASSES, b)
    role_x = rng.random(n_tokens) < 0.5 if cell.subset else np.ones(n_tokens, bool)
    return a, b, role_x


def _effects(labels: np.ndarray, n_classes: int, basis: np.ndarray, singular: float, rng) -> np.ndarray:
    """Class effects (class, d) in the span of `basis` whose count-weighted centred effects have every
    singular value `singular` (their subspace has rank basis.shape[1] exactly)."""
    counts = np.bincount(labels, minlength=n_classes).astype(float)
    weights = counts / counts.sum()
    coefficients = rng.normal(size=(n_classes, basis.shape[1]))
    coefficients -= weights @ coefficients
    weighted = np.sqrt(counts)[:, None] * coefficients
    left, _, right_t = np.linalg.svd(weighted, full_matrices=False)
    coefficients = (left * singular) @ right_t / np.sqrt(np.maximum(counts, 1))[:, None]
    return coefficients @ basis.T


def _sphere_points(labels: np.ndarray, n_classes: int, basis: np.ndarray, singular: float, spread: float, rng):
    """Class points (class, d) in the plane (or line) of `basis`, at evenly spaced directions, of
    radius R (1 +- spread) alternately, R such that the weighted spread per direction is singular^2."""
    counts = np.bincount(labels, minlength=n_classes).astype(float)
    rank = basis.shape[1]
    if rank == 1:
        directions = np.where(np.arange(n_classes) % 2 == 0, 1.0, -1.0)[:, None]
    else:
        phase = 2 * np.pi * (np.arange(n_classes) / n_classes + rng.random())
        directions = np.stack([np.cos(phase), np.sin(phase)], axis=1)
    factor = 1 + spread * np.where(np.arange(n_classes) % 2 == 0, 1.0, -1.0)
    points = directions * factor[:, None]
    centred = points - (counts / counts.sum()) @ points
    scale = singular / np.sqrt(np.sum(counts[:, None] * centred**2) / rank)
    return scale * points @ basis.T, factor


def radius_spread(factor: np.ndarray, counts: np.ndarray) -> float:
    weights = counts / counts.sum()
    mean = factor @ weights
    return float(np.sqrt(((factor - mean) ** 2) @ weights) / mean)


def plant(cell: Cell, root: Path, seed: int = 0) -> Planted:
    """Write a cell's store under `root`; returns it with its planted truth."""
    rng = np.random.default_rng(seed)
    a, b, role_x = _labels(cell, rng)
    n_tokens, d = len(a), cell.d_model
    threshold_a = ((cell.n_classes - 1) * d) ** 0.25
    threshold_b = ((B_CLASSES - 1) * d) ** 0.25
    strength = SIGNALS[cell.signal]
    offset = 5.0 * rng.normal(size=d)
    layers, planted_angles, cv = [], [], 0.0
    for _ in range(cell.n_layers):
        angles = np.array(TRUTHS[cell.truth][: cell.rank_a])
        if cell.rank_a > 2:  # b's two directions meet a's span at the planted angles
            basis_a, basis_b = bases_at_angles(d, cell.rank_a, 2, angles, rng)
        else:
            basis_b, basis_a = bases_at_angles(d, 2, cell.rank_a, angles, rng)
        if cell.sphere:
            effect_a, radius_factor = _sphere_points(a[role_x], cell.n_classes, basis_a, strength * threshold_a,
                                                     OFF_SPHERE_SPREAD if cell.sphere == "off" else 0.0, rng)
            cv = radius_spread(radius_factor, np.bincount(a[role_x], minlength=cell.n_classes).astype(float))
        else:
            effect_a = _effects(a[role_x], cell.n_classes, basis_a, strength * threshold_a, rng)
        effect_b = _effects(b, B_CLASSES, basis_b, SIGNALS["moderate" if cell.signal == "none" else cell.signal]
                            * threshold_b, rng)
        x = effect_b[b] + np.where(role_x[:, None], effect_a[a], offset) + rng.normal(size=(n_tokens, d))
        layer = np.zeros((cell.n_samples, cell.n_pos, d), "float32")
        layer[:, 1:] = x.reshape(cell.n_samples, cell.n_pos - 1, d)
        layer[:, 0, 0] = 30.0
        layers.append(layer)
        planted_angles.append([angles.min(), angles.max()])
    labels = {"a": _as_label(cell, np.where(role_x, a, -1)), "b": _as_label(cell, b)}
    if cell.subset:
        roles = np.full((cell.n_samples, cell.n_pos), "start", dtype=object)
        roles[:, 1:] = np.where(role_x, "x", "y").reshape(cell.n_samples, cell.n_pos - 1)
        labels["role"] = roles
    url = write_store(root / f"{cell.name}-{seed}.zarr", {"resid_pre": np.stack(layers, axis=1)}, labels=labels,
                      samples_per_chunk=64, with_weights=False)
    return Planted(cell, url, np.asarray(planted_angles), cv)


def _as_label(cell: Cell, values: np.ndarray) -> np.ndarray:
    label = np.full((cell.n_samples, cell.n_pos), NOT_APPLICABLE, "int16")
    label[:, 1:] = np.where(values >= 0, values, NOT_APPLICABLE).reshape(cell.n_samples, cell.n_pos - 1)
    return label


def run(planted: Planted, **options):
    """The subspaces and spheres of a planted store (a's factor read where it applies), as one analyze call."""
    factors = ["a[role=x]", "b"] if planted.cell.subset else ["a", "b"]
    tree = analyze(planted.url, only=["subspaces", "spheres"],
                   options={"factors": factors, **options})
    return tree["subspaces"].to_dataset(), tree["spheres"].to_dataset()


def score(planted: Planted, subspaces, spheres, significance: float = 0.05) -> dict:
    """Error rates of one cell against its planted truth (shares over the store's layers). An interval's
    coverage is the share of layers whose interval holds the planted value, with the shares that miss it
    below (`_below`: the truth under the lower bound) and above; at a planted 90 (0) degrees, or a radius
    spread of 0, only the upper (lower) bound can miss, so coverage is one-sided there (nominal
    (1 + confidence) / 2)."""
    cell = planted.cell
    a, b = subspaces["factor"].values
    rank = subspaces["subspace_rank"].sel(factor=a).values
    rank_b = subspaces["subspace_rank"].sel(factor=b).values
    scores = {"layers": len(rank), "structure_fp": np.nan, "structure_fp_corrected": np.nan}
    if cell.signal == "none":
        scores["structure_fp"] = float(np.mean(subspaces["structure_p"].sel(factor=a).values <= significance))
        scores["structure_fp_corrected"] = float(np.mean(subspaces["structure_q"].sel(factor=a).values <= significance))
        scores["rank_zero"] = float(np.mean(rank == 0))
        relation = subspaces["relation"].sel(factor=a, other=b).values
        scores["claimed"] = float(np.mean(np.isin(relation, ["orthogonal", "dependent", "independent"])))
        return scores
    exact = (rank == cell.rank_a) & (rank_b == 2)
    scores["rank_exact"] = float(np.mean(rank == cell.rank_a))
    scores["rank_exact_b"] = float(np.mean(rank_b == 2))
    pair = subspaces.sel(factor=a, other=b)
    for name, column in (("min", 0), ("max", 1)):
        low, high = pair[f"{name}_angle_ci"].values.T
        truth = planted.angles[:, column]
        covered = (low - 1e-9 <= truth) & (truth <= high + 1e-9)
        scores[f"{name}_coverage"] = float(np.mean(covered[exact])) if exact.any() else np.nan
        scores[f"{name}_above"] = float(np.mean((truth > high + 1e-9)[exact])) if exact.any() else np.nan
        scores[f"{name}_below"] = float(np.mean((truth < low - 1e-9)[exact])) if exact.any() else np.nan
        scores[f"{name}_bias"] = float(np.mean((pair[f"{name}_angle_estimate"].values - truth)[exact])) if exact.any() else np.nan
        scores[f"{name}_raw_bias"] = float(np.mean((pair[f"{name}_angle"].values - truth)[exact])) if exact.any() else np.nan
    relation = pair["relation"].values
    for verdict in ("orthogonal", "dependent", "independent", "undetermined", "no structure"):
        scores[f"called_{verdict}"] = float(np.mean(relation == verdict))
    claim_p = pair["claim_p"].values
    for index, claim in enumerate(("orthogonal", "dependent", "independent")):
        scores[f"claim_{claim}_p05"] = float(np.mean(claim_p[:, index] <= significance))
    if cell.sphere:
        sphere = spheres["sphere"].sel(factor=a).values
        expected = "on sphere" if cell.sphere == "on" else "off sphere"
        scores["sphere_right"] = float(np.mean(sphere == expected))
        scores["sphere_wrong"] = float(np.mean(sphere == ("off sphere" if cell.sphere == "on" else "on sphere")))
        low, high = spheres["radius_cv_ci"].sel(factor=a).values.T
        scores["radius_cv_coverage"] = float(np.mean((low - 1e-9 <= planted.radius_cv) & (planted.radius_cv <= high + 1e-9)))
        claim_p = spheres["sphere_claim_p"].sel(factor=a).values
        scores["sphere_on_p05"], scores["sphere_off_p05"] = np.mean(claim_p <= significance, axis=0).tolist()
        scores["radius_cv_below"] = float(np.mean(planted.radius_cv < low - 1e-9))
        scores["radius_cv_above"] = float(np.mean(planted.radius_cv > high + 1e-9))
    return scores


def with_layers(cell: Cell, n_layers: int) -> Cell:
    return replace(cell, n_layers=n_layers)
