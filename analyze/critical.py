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

Every array here is (key, row) for rows of sparse instances, float64, or flat entries (key, row) of
such arrays with their rows' indices.

Bounded noise (uniform unit-RMS noise lies within sqrt(3)) lets most keys be left out of the measured
and the exact collapse: with |u| <= U and s <= s_max < 1 / U, D_t(s) <= (1 - s_max U) m_t + (b_t - b*)
when m_t = alpha + s_max U (|x_t| + |x*|) <= 0, and C + beta s <= C + s_max U (|x_t| + |x*|); a key for
which both bounds stay below zero can never overtake its winner up to s_max in any draw
(``near_keys``). In a real model's sparse rows about 1 % of the (key, row) entries remain. Theorem 7's
first order keeps every key (its u_q alpha s term is not bounded by the clean gap).
"""
from __future__ import annotations

import numpy as np


def clean_differences(x: np.ndarray, bias: np.ndarray, winner: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(alpha, C) of D_t(s), which no draw changes: alpha = x_t - x*, C = alpha + (b_t - b*), -inf for keys
    the query may not see and at most 0 (the winner holds the largest clean score; a float32 near-tie
    counts as a tie); both 0 at the winner."""
    rows = np.arange(x.shape[1])
    alpha = x - x[winner, rows]
    with np.errstate(invalid="ignore"):
        constant = np.minimum(alpha + (bias - bias[winner, rows]), 0.0)
    constant[winner, rows] = 0.0
    alpha[winner, rows] = 0.0
    return alpha, constant


def noise_slopes(x: np.ndarray, u_key: np.ndarray, winner: np.ndarray) -> np.ndarray:
    """beta = x_t u_t - x* u* of one draw (0 at the winner)."""
    rows = np.arange(x.shape[1])
    beta = x * u_key
    beta -= beta[winner, rows]
    return beta


def near_keys(x: np.ndarray, winner: np.ndarray, alpha: np.ndarray, constant: np.ndarray, s_max: float,
              bound: float | None) -> tuple[np.ndarray, np.ndarray]:
    """The flat entries (key, row), sorted by row, of the keys that noise within `bound` (the largest
    |u|; None: unbounded) may let overtake their row's winner up to s_max, in the measured collapse
    (the quadratic) or the exact condition (alpha, C: ``clean_differences``): every seen key but the
    winner when the noise is unbounded or can reverse a factor (s_max bound >= 1). The margins cover
    float64's rounding of D."""
    seen = np.isfinite(constant)
    seen[winner, np.arange(x.shape[1])] = False
    if bound is not None and s_max * bound < 1:
        reach = s_max * bound * (np.abs(x) + np.abs(x[winner, np.arange(x.shape[1])]))
        with np.errstate(invalid="ignore"):
            gap = constant - alpha  # b_t - b* where C is not clipped
            margin = 1e-9 * (1.0 + np.abs(alpha) + reach + np.abs(np.where(seen, gap, 0.0)))
            highest = alpha + reach
            measured = (highest > -margin) | ((1 - s_max * bound) * highest + gap > -margin) | (constant == 0)
            seen &= measured | (constant + reach > -margin)
    row, key = np.nonzero(seen.T)
    return key, row


def linear_critical(constant: np.ndarray, slope: np.ndarray, rows: np.ndarray | None = None, n_rows: int = 0) -> np.ndarray:
    """(row,) smallest s >= 0 beyond which some key has constant + slope s > 0; inf if none. Dense
    (key, row) arrays, or flat entries with their `rows` (of n_rows)."""
    rising = slope > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        level = np.divide(constant, slope, out=np.full(slope.shape, -np.inf), where=rising)
    if rows is None:
        return np.nan_to_num(-np.fmax.reduce(level, axis=0), nan=np.inf)  # fmax: a NaN (of NaN inputs) is no level
    critical = np.full(n_rows, np.inf)
    np.fmin.at(critical, rows[rising], -level[rising])
    return critical


def quadratic_critical(a: np.ndarray, b: np.ndarray, c: np.ndarray, s_max: float, rows: np.ndarray,
                       n_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(row,) smallest s in [0, s_max] beyond which D(s) = a s^2 + b s + c > 0 for some key up to
    s_max (inf if none), and (row,) flags of rows whose collapse is not one ray in (0, s_max], from
    flat entries with their `rows` (of n_rows). The roots are computed only for the keys positive at
    s_max, the flags' tests only for keys whose D can peak inside (0, s_max) (a < 0, b > 0)."""
    with np.errstate(invalid="ignore", over="ignore"):
        ray = ((a * s_max + b) * s_max + c) > 0
    critical = np.full(n_rows, np.inf)
    np.minimum.at(critical, rows[ray], _entry(a[ray], b[ray], c[ray], s_max))
    flagged = np.zeros(n_rows, bool)
    peaking = ~ray & (a < 0) & (b > 0)
    flagged[rows[peaking][_peaks_inside(a[peaking], b[peaking], c[peaking], s_max)]] = True
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


def collapsed_at(a: np.ndarray, b: np.ndarray, c: np.ndarray, levels: np.ndarray, rows: np.ndarray,
                 n_rows: int) -> np.ndarray:
    """(row, level) some key has D(s) > 0 at each level, from flat entries with their `rows` (of
    n_rows): the direct evaluation for flagged rows."""
    s = np.asarray(levels, np.float64)[:, None]
    with np.errstate(invalid="ignore"):
        positive = (((a * s + b) * s + c) > 0).T  # (entry, level)
    collapsed = np.zeros((n_rows, len(levels)), bool)
    np.logical_or.at(collapsed, rows, positive)
    return collapsed
