"""Linear algebra of subspaces: bases from class means, principal angles, head read spaces."""
from __future__ import annotations

import numpy as np


def between_class_svd(sums: np.ndarray, counts: np.ndarray):
    """SVD of the sqrt(n_c)-weighted, centred class means (classes with no tokens dropped).

    sums (..., class, d), counts (..., class). Returns singular values (..., k) and right singular
    vectors (..., k, d), k = min(class, d): the directions of between-class variance, largest first.
    """
    counts = np.asarray(counts, dtype="float64")
    present = counts > 0
    safe = np.where(present, counts, 1.0)
    means = sums / safe[..., None]
    grand = sums.sum(axis=-2) / counts.sum(axis=-1)[..., None]
    weighted = np.where(present[..., None], np.sqrt(counts)[..., None] * (means - grand[..., None, :]), 0.0)
    _, singular, directions = np.linalg.svd(weighted, full_matrices=False)
    return singular, directions


def choose_rank(singular: np.ndarray, n_classes: int, threshold: float, fixed: int | None) -> int:
    """The fixed rank, or the fewest directions holding `threshold` of the between-class variance;
    never more than n_classes - 1 (centred means span no more)."""
    limit = min(n_classes - 1, len(singular))
    if fixed is not None:
        return min(fixed, limit)
    variance = singular[:limit] ** 2
    if variance.sum() <= 0:
        return 0
    explained = np.cumsum(variance) / variance.sum()
    return int(min(np.searchsorted(explained, threshold - 1e-12) + 1, limit))


def column_space(matrix: np.ndarray, tolerance: float = 1e-6) -> np.ndarray:
    """Orthonormal basis (d, r) of the column space of a (d, n) matrix."""
    left, singular, _ = np.linalg.svd(np.asarray(matrix, dtype="float64"), full_matrices=False)
    if singular.size == 0 or singular[0] == 0:
        return left[:, :0]
    return left[:, singular > tolerance * singular[0]]


def principal_angles(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Principal angles in degrees, ascending, between the spans of orthonormal columns of
    a (..., d, ra) and b (..., d, rb): min(ra, rb) of them. Small angles come from sines and
    large ones from cosines, so both ends are accurate."""
    if a.shape[-1] < b.shape[-1]:
        a, b = b, a
    if b.shape[-1] == 0:
        return np.zeros(a.shape[:-2] + (0,))
    overlap = np.swapaxes(a, -1, -2) @ b
    cosines = np.clip(np.linalg.svd(overlap, compute_uv=False), 0.0, 1.0)
    sines = np.clip(np.linalg.svd(b - a @ overlap, compute_uv=False)[..., ::-1], 0.0, 1.0)
    angles = np.where(cosines**2 >= 0.5, np.arcsin(sines), np.arccos(cosines))
    return np.degrees(angles)


def overlap_fraction(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Mean squared cosine of the principal angles: 1 when one span contains the other, 0 when orthogonal."""
    rank = min(a.shape[-1], b.shape[-1])
    if rank == 0:
        return np.full(a.shape[:-2], np.nan)
    return ((np.swapaxes(a, -1, -2) @ b) ** 2).sum(axis=(-1, -2)) / rank
