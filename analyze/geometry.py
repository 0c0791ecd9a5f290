"""Linear algebra of subspaces: column spaces, principal angles, head read spaces."""
from __future__ import annotations

import numpy as np


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
