"""Linear algebra of subspaces: ranks, leading subspaces, principal angles, head read spaces."""
from __future__ import annotations

import numpy as np


def leading_subspaces(matrices: np.ndarray, rank: int) -> np.ndarray:
    """Orthonormal bases (..., d, rank) of the leading right singular vectors of matrices (..., k, d),
    from the eigenvectors of the smaller Gram matrix (computed in the matrices' precision, decomposed
    in float64): much cheaper than an SVD for the many bootstrap and null draws, and accurate for
    directions whose singular values stand clear of zero."""
    k, d = matrices.shape[-2:]
    if k <= d:
        values, vectors = np.linalg.eigh((matrices @ np.swapaxes(matrices, -1, -2)).astype("float64"))
        top = vectors[..., ::-1][..., :rank]
        norms = np.sqrt(np.maximum(values[..., ::-1][..., None, :rank], np.finfo(float).tiny))
        return np.swapaxes(matrices, -1, -2) @ (top / norms).astype(matrices.dtype)
    _, vectors = np.linalg.eigh((np.swapaxes(matrices, -1, -2) @ matrices).astype("float64"))
    return vectors[..., ::-1][..., :rank]


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
