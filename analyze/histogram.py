"""Spread of a positive quantity (a norm) around its median, from a streaming weighted histogram.

Values go into fine bins of log(value) (width 0.0024, i.e. 0.24 % relative), one histogram per
group, summed over sample chunks; the median, quantiles of value / median, the half-width p of
the band [median (1 - p), median (1 + p)] that holds a given mass, and a coarse histogram of
value / median all follow from the cumulative distribution, interpolated linearly in log(value)
inside each bin. Slot 0 holds values below e^-20 (zeros included), the last slot those above e^20.

Pooling groups (``pooled_ratio_cumulative``, ``ratio_band``): each group's value / median, with the
group's own median, pooled with the group's weights. The pooled distribution's cumulative mass at
each edge r = e^EDGES[j] of value / median is the sum over the groups of their cumulative mass at
value = median * r (each group's cdf as above, so that shifting a group by its median costs no
accuracy at the edges), linear in log(r) between edges.
"""
from __future__ import annotations

import numpy as np

LOG_LOW, LOG_HIGH = -20.0, 20.0
N_BINS = 16384
N_SLOTS = N_BINS + 2
BIN_WIDTH = (LOG_HIGH - LOG_LOW) / N_BINS
EDGES = np.linspace(LOG_LOW, LOG_HIGH, N_BINS + 1)
BLOCK = 512  # groups summarised at once
POOL_BLOCK = 64
"""Groups shifted to value / median at once when pooling: a few MiB per (groups, N_BINS + 1) array."""


def log_histogram(values: np.ndarray, weights: np.ndarray | None = None, groups: np.ndarray | None = None,
                  n_groups: int = 1) -> np.ndarray:
    """Weighted counts (n_groups, N_SLOTS) of values per group (arrays of one shape); without weights
    every value counts once, without groups all are in one."""
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.log(np.asarray(values, dtype="float32").ravel())
        logs -= np.float32(LOG_LOW)
        logs *= np.float32(1 / BIN_WIDTH)
    np.floor(logs, out=logs)
    np.nan_to_num(logs, copy=False, nan=-1.0, neginf=-1.0, posinf=N_SLOTS)
    np.clip(logs, -1, N_SLOTS - 2, out=logs)
    index = logs.astype(np.intp) + 1  # slot 0: below e^LOG_LOW, zeros and NaN included
    if groups is not None:
        index += np.asarray(groups).ravel() * N_SLOTS
    weights = None if weights is None else np.asarray(weights, dtype="float64").ravel()
    counts = np.bincount(index, weights=weights, minlength=n_groups * N_SLOTS)
    return counts.reshape(n_groups, N_SLOTS).astype("float64")


def _cumulative(flat: np.ndarray) -> np.ndarray:
    """Mass at or below each edge of EDGES, per row of flat (groups, N_SLOTS): (groups, N_BINS + 1)."""
    cumulative = np.empty((len(flat), N_BINS + 1))
    cumulative[:, 0] = 0.0
    np.cumsum(flat[:, 1:-1], axis=1, out=cumulative[:, 1:])
    cumulative += flat[:, :1]
    return cumulative


def _cdf(cumulative: np.ndarray, rows: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Mass at or below `values` of cumulative[rows] (broadcast): np.interp of log(value) through
    (EDGES, cumulative row), clamped to the end values outside the edges; 0 for values <= 0."""
    positive = values > 0
    logs = np.log(np.where(positive, values, 1.0))
    j = np.clip(np.searchsorted(EDGES, logs, side="right") - 1, 0, N_BINS - 1)
    below, above = cumulative[rows, j], cumulative[rows, j + 1]
    with np.errstate(invalid="ignore"):
        inside = (above - below) / (EDGES[j + 1] - EDGES[j]) * (logs - EDGES[j]) + below
    clamped = np.where(logs < EDGES[0], cumulative[rows, 0], np.where(logs >= EDGES[-1], cumulative[rows, -1], inside))
    return np.where(positive, clamped, 0.0)


def _first_reaching(cumulative: np.ndarray, rows: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Per element, the first index j with cumulative[rows, j] >= targets (N_BINS where none is):
    np.searchsorted(side="left") of each row, by bisection over all rows at once."""
    low, high = np.zeros(targets.shape, dtype="int64"), np.full(targets.shape, N_BINS)
    for _ in range(N_BINS.bit_length()):
        middle = (low + high) // 2
        short = cumulative[rows, middle] < targets
        low, high = np.where(short, middle + 1, low), np.where(short, high, middle)
    return high


def _quantile(cumulative: np.ndarray, rows: np.ndarray, total: np.ndarray, fractions) -> np.ndarray:
    """Values (rows, fractions) below which each fraction of the total lies: 0 when it lies in slot 0,
    inf when past e^20, else linear in log(value) inside its bin."""
    rows = rows[:, None]
    target = np.asarray(fractions, dtype="float64") * total[:, None]
    j = np.clip(_first_reaching(cumulative, rows, target), 1, N_BINS)
    below, above = cumulative[rows, j - 1], cumulative[rows, j]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inside = np.exp(EDGES[j - 1] + (target - below) / (above - below) * BIN_WIDTH)
    return np.where(target <= cumulative[rows, 0], 0.0, np.where(target > cumulative[rows, -1], np.inf, inside))


def _band(cumulative: np.ndarray, rows: np.ndarray, centre: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Smallest p per row such that [centre (1 - p), centre (1 + p)] holds `target`: `high` doubles
    from 1 until it holds (NaN once centre (1 + high) passes e^LOG_HIGH), then 60 bisection steps."""

    def held(p, at=slice(None)):
        return _cdf(cumulative, rows[at], centre[at] * (1 + p)) - _cdf(cumulative, rows[at], centre[at] * (1 - p))

    high = np.ones(len(rows))
    short = held(high) < target
    while short.any():
        high[short] *= 2
        lost = short & (centre * (1 + high) > np.exp(LOG_HIGH))
        high[lost] = np.nan
        short &= ~lost
        short[short] = held(high[short], short) < target[short]
    low = np.zeros(len(rows))
    for _ in range(60):
        middle = (low + high) / 2
        enough = held(middle) >= target
        low, high = np.where(enough, low, middle), np.where(enough, middle, high)
    return high


def _summarise_block(flat: np.ndarray, mass: float, quantiles, ratio_edges: np.ndarray) -> dict[str, np.ndarray]:
    """summarise for the groups of flat (groups, N_SLOTS), all at once."""
    total, cumulative = flat.sum(axis=1), _cumulative(flat)
    median = _quantile(cumulative, np.arange(len(flat)), total, [0.5])[:, 0]
    rows = np.flatnonzero((0 < median) & (median < np.inf))
    centre, weight = median[rows], total[rows]
    below = _cdf(cumulative, rows[:, None], centre[:, None] * ratio_edges)
    found = {
        "median": centre,
        "band": _band(cumulative, rows, centre, mass * weight),
        "quantile": _quantile(cumulative, rows, weight, quantiles) / centre[:, None],
        "histogram": np.diff(below, axis=1) / weight[:, None],
        "beyond": 1 - below[:, -1] / weight,
    }
    out = {"total": total}
    for name, value in found.items():
        out[name] = np.full((len(flat),) + value.shape[1:], np.nan)
        out[name][rows] = value
    return out


def summarise(counts: np.ndarray, *, mass: float, quantiles, ratio_edges: np.ndarray) -> dict[str, np.ndarray]:
    """Per group (leading dims of counts): total weight, median, band half-width holding `mass`,
    quantiles of value / median, and the fraction of the mass per bin of value / median
    (`ratio_edges`; `beyond` holds the fraction past the last edge). All but total are NaN where
    the median is 0 or inf (an empty group included). Vectorised over blocks of BLOCK groups
    (which bounds the memory of the cumulative sums)."""
    counts = np.asarray(counts, dtype="float64")
    groups = counts.shape[:-1]
    flat = counts.reshape(-1, N_SLOTS)
    edges = np.asarray(ratio_edges, dtype="float64")
    blocks = [_summarise_block(flat[start:start + BLOCK], mass, quantiles, edges)
              for start in range(0, max(len(flat), 1), BLOCK)]
    return {name: np.concatenate([block[name] for block in blocks]).reshape(groups + blocks[0][name].shape[1:])
            for name in blocks[0]}


def pooled_ratio_cumulative(counts: np.ndarray, median: np.ndarray, pools: np.ndarray,
                            n_pools: int) -> tuple[np.ndarray, np.ndarray]:
    """Cumulative mass (n_pools, N_BINS + 1) of value / median at or below each e^EDGES[j], and the total
    mass (n_pools,), of the groups of `counts` (groups..., N_SLOTS) pooled as `pools` (groups..., the pool
    of each group) says: each group's values divided by its own `median` (groups...), each group counted
    with its weights. Groups whose median is 0, inf or NaN (an empty group included) are left out.
    Pooled cumulatives of disjoint pools add up to the cumulative of their union."""
    flat, median, pools = counts.reshape(-1, N_SLOTS), np.ravel(median), np.ravel(pools)
    kept = np.flatnonzero((0 < median) & (median < np.inf))
    cumulative, total = np.zeros((n_pools, N_BINS + 1)), np.zeros(n_pools)
    for start in range(0, len(kept), POOL_BLOCK):
        rows = kept[start:start + POOL_BLOCK]
        at_edges = _at_shifted_edges(_cumulative(flat[rows]), np.log(median[rows]))
        for pool in np.unique(pools[rows]):
            mine = pools[rows] == pool
            cumulative[pool] += at_edges[mine].sum(axis=0)
            total[pool] += flat[rows[mine]].sum()
    return cumulative, total


def _at_shifted_edges(cumulative: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """Each row's cdf (rows, N_BINS + 1 edges) at every edge + shift[row] in log(value), as ``_cdf`` at
    median e^EDGES: the shifted edges lie a whole number of bins and one fraction of a bin from the
    edges, so each value is the same blend of two neighbouring edges' cumulative masses (clamped to the
    end values outside the edges)."""
    bins = shift / BIN_WIDTH
    whole = np.floor(bins)
    fraction = (bins - whole)[:, None]
    below = np.arange(N_BINS + 1) + whole.astype("int64")[:, None]  # the edge at or below each shifted edge
    low = np.take_along_axis(cumulative, np.clip(below, 0, N_BINS), axis=1)
    high = np.take_along_axis(cumulative, np.clip(below + 1, 0, N_BINS), axis=1)
    return low + fraction * (high - low)


def ratio_band(cumulative: np.ndarray, total: np.ndarray, mass: float) -> np.ndarray:
    """Per pool (rows of ``pooled_ratio_cumulative``'s output), the smallest p such that
    [1 - p, 1 + p] holds `mass` of the pooled value / median; NaN for an empty pool."""
    rows = np.flatnonzero(total > 0)
    band = np.full(len(total), np.nan)
    band[rows] = _band(cumulative, rows, np.ones(len(rows)), mass * total[rows])
    return band


def spread_variables(counts: np.ndarray, *, group_dims: tuple[str, ...], coords: dict, median_name: str, mass: float,
                     quantiles, ratio_max: float, ratio_bins: int) -> dict:
    """Variables `median_name`, band, ratio_quantile, histogram, beyond, weight_total from histograms
    (*group_dims, slot), with the coords of quantile and ratio added to `coords`."""
    edges = np.linspace(0.0, ratio_max, ratio_bins + 1)
    summary = summarise(counts, mass=mass, quantiles=quantiles, ratio_edges=edges)
    coords.update({"quantile": list(quantiles), "ratio": (edges[:-1] + edges[1:]) / 2})
    return {
        median_name: (group_dims, summary["median"]),
        "band": (group_dims, summary["band"]),
        "ratio_quantile": (group_dims + ("quantile",), summary["quantile"]),
        "histogram": (group_dims + ("ratio",), summary["histogram"]),
        "beyond": (group_dims, summary["beyond"]),
        "weight_total": (group_dims, summary["total"]),
    }
