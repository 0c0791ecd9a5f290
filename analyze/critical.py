"""Critical noise levels of sparse instances: the level at which a draw's noise first moves the arg-max.

With common random numbers a draw fixes unit noise u_q (the query) and u_t (each key); at level s
the factors are 1 + s u_q and 1 + s u_t. With x_t the scaled clean dot product of key t and b_t
what the score adds after the soft-cap (position bias, mask), key t beats the clean winner t* iff

    D_t(s) = (1 + s u_q) [(x_t - x*) + s (x_t u_t - x* u*)] + (b_t - b*) > 0,

a quadratic A s^2 + B s + C with A = u_q beta, B = beta + u_q alpha, C = alpha + (b_t - b*),
alpha = x_t - x*, beta = x_t u_t - x* u* (a soft-cap, strictly increasing, keeps the order of the
capped terms, so it is left out; it cannot be combined with a bias). Theorem 7's first order drops
the s^2 term (C + B s > 0) and the exact condition drops the query noise (C + beta s > 0): both are
linear in s, so each collapses on a ray (s_c, inf). The measured collapse holds on a ray too unless
some key's D_t is positive only between two roots (a factor 1 + s u_q <= 0, or a bias): such rows
are flagged and evaluated at the points asked for.

Every array here is (key, row) for rows of sparse instances, float64.
"""
from __future__ import annotations

import numpy as np


def key_coefficients(x: np.ndarray, bias: np.ndarray, u_key: np.ndarray, u_query: np.ndarray,
                     winner: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(A, B, C, beta) of D_t(s) for every key and row; C is -inf for keys the query may not see and at
    most 0 (the winner holds the largest clean score; a float32 near-tie counts as a tie)."""
    rows = np.arange(x.shape[1])
    x_win, u_win, b_win = x[winner, rows], u_key[winner, rows], bias[winner, rows]
    alpha = x - x_win
    beta = x * u_key - x_win * u_win
    with np.errstate(invalid="ignore"):
        constant = np.minimum(alpha + (bias - b_win), 0.0)
    constant[winner, rows] = 0.0
    beta[winner, rows] = 0.0
    alpha[winner, rows] = 0.0
    return u_query * beta, beta + u_query * alpha, constant, beta


def linear_critical(constant: np.ndarray, slope: np.ndarray) -> np.ndarray:
    """(row,) smallest s >= 0 beyond which some key has constant + slope s > 0; inf if none."""
    rising = slope > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        level = np.divide(constant, slope, out=np.full(slope.shape, -np.inf), where=rising)
    return np.nan_to_num(-np.fmax.reduce(level, axis=0), nan=np.inf)  # fmax: a NaN (of NaN inputs) is no level


def quadratic_critical(a: np.ndarray, b: np.ndarray, c: np.ndarray, s_max: float) -> tuple[np.ndarray, np.ndarray]:
    """(row,) smallest s in [0, s_max] beyond which D(s) = a s^2 + b s + c > 0 for some key up to
    s_max (inf if none), and (row,) flags of rows whose collapse is not one ray in (0, s_max].
    The roots are computed only for the keys positive at s_max, the flags' tests only for keys whose
    D can peak inside (0, s_max) (a < 0, b > 0): a few of every (key, row)."""
    with np.errstate(invalid="ignore", over="ignore"):
        ray = ((a * s_max + b) * s_max + c) > 0
    critical = np.full(a.shape[1], np.inf)
    key, row = np.nonzero(ray)
    np.minimum.at(critical, row, _entry(a[key, row], b[key, row], c[key, row], s_max))
    flagged = np.zeros(a.shape[1], bool)
    key, row = np.nonzero(~ray & (a < 0) & (b > 0))
    flagged[row[_peaks_inside(a[key, row], b[key, row], c[key, row], s_max)]] = True
    return critical, flagged


def _entry(a: np.ndarray, b: np.ndarray, c: np.ndarray, s_max: float) -> np.ndarray:
    """Where D (positive at s_max) turns positive, clipped to [0, s_max]: its root in [0, s_max] if the
    larger-magnitude one is, else the other (the numerically stable pair)."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        root = np.sqrt(np.maximum(b * b - 4 * a * c, 0.0))
        half = -0.5 * (b + np.copysign(root, b))
        first, second = half / a, c / half
    inside = (first >= 0) & (first <= s_max)
    entry = np.nan_to_num(np.where(inside, first, second), nan=0.0)  # b = c = 0: positive from 0 on
    return np.clip(entry, 0.0, s_max)


def _peaks_inside(a: np.ndarray, b: np.ndarray, c: np.ndarray, s_max: float) -> np.ndarray:
    """Whether D, not positive at s_max, is positive at its vertex inside (0, s_max): a collapse that
    does not persist."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        vertex = -b / (2 * a)
        peak = c - b * b / (4 * a)
    return (a < 0) & (vertex > 0) & (vertex < s_max) & (peak > 0)


def collapsed_at(a: np.ndarray, b: np.ndarray, c: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """(row, level) some key has D(s) > 0 at each level: the direct evaluation for flagged rows."""
    s = np.asarray(levels, np.float64)[:, None, None]
    with np.errstate(invalid="ignore"):
        return (((a * s + b) * s + c) > 0).any(axis=1).T
