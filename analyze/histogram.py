"""Spread of a positive quantity (a norm) around its median, from a streaming weighted histogram.

Values go into fine bins of log(value) (width 0.0024, i.e. 0.24 % relative), one histogram per
group, summed over sample chunks; the median, quantiles of value / median, the half-width p of
the band [median (1 - p), median (1 + p)] that holds a given mass, and a coarse histogram of
value / median all follow from the cumulative distribution, interpolated linearly in log(value)
inside each bin. Slot 0 holds values below e^-20 (zeros included), the last slot those above e^20.
"""
from __future__ import annotations

import numpy as np

LOG_LOW, LOG_HIGH = -20.0, 20.0
N_BINS = 16384
N_SLOTS = N_BINS + 2
BIN_WIDTH = (LOG_HIGH - LOG_LOW) / N_BINS
EDGES = np.linspace(LOG_LOW, LOG_HIGH, N_BINS + 1)


def log_histogram(values: np.ndarray, weights: np.ndarray, groups: np.ndarray, n_groups: int) -> np.ndarray:
    """Weighted counts (n_groups, N_SLOTS) of values per group (arrays of one shape)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.log(np.asarray(values, dtype="float32").ravel())
    slots = np.floor((logs - np.float32(LOG_LOW)) * np.float32(1 / BIN_WIDTH)) + 1
    slots = np.clip(np.nan_to_num(slots, nan=0.0, neginf=0.0, posinf=N_SLOTS - 1), 0, N_SLOTS - 1)
    index = np.asarray(groups).ravel() * N_SLOTS + slots.astype("int64")
    counts = np.bincount(index, weights=np.asarray(weights, dtype="float64").ravel(), minlength=n_groups * N_SLOTS)
    return counts.reshape(n_groups, N_SLOTS)


class Distribution:
    """The weighted distribution of one group's values, from its histogram (N_SLOTS,)."""

    def __init__(self, counts: np.ndarray):
        counts = np.asarray(counts, dtype="float64")
        self.total = counts.sum()
        self.cumulative = counts[0] + np.concatenate([[0.0], np.cumsum(counts[1:-1])])

    def cdf(self, value: float) -> float:
        """Mass at or below `value`."""
        if value <= 0:
            return 0.0
        return float(np.interp(np.log(value), EDGES, self.cumulative))

    def quantile(self, fraction: float) -> float:
        """The value below which `fraction` of the mass lies (inf when it lies past e^20)."""
        target = fraction * self.total
        if target <= self.cumulative[0]:
            return 0.0
        if target > self.cumulative[-1]:
            return np.inf
        j = int(np.searchsorted(self.cumulative, target, side="left"))
        below, above = self.cumulative[j - 1], self.cumulative[j]
        return float(np.exp(EDGES[j - 1] + (target - below) / (above - below) * BIN_WIDTH))

    def band(self, centre: float, mass: float) -> float:
        """Smallest p such that [centre (1 - p), centre (1 + p)] holds `mass` of the total."""
        target = mass * self.total

        def held(p):
            return self.cdf(centre * (1 + p)) - self.cdf(centre * (1 - p))

        high = 1.0
        while held(high) < target:
            high *= 2
            if centre * (1 + high) > np.exp(LOG_HIGH):
                return np.nan
        low = 0.0
        for _ in range(60):
            middle = (low + high) / 2
            low, high = (low, middle) if held(middle) >= target else (middle, high)
        return high


def summarise(counts: np.ndarray, *, mass: float, quantiles, ratio_edges: np.ndarray) -> dict[str, np.ndarray]:
    """Per group (leading dims of counts): total weight, median, band half-width holding `mass`,
    quantiles of value / median, and the fraction of the mass per bin of value / median
    (`ratio_edges`; `beyond` holds the fraction past the last edge)."""
    counts = np.asarray(counts, dtype="float64")
    groups = counts.shape[:-1]
    flat = counts.reshape(-1, N_SLOTS)
    out = {
        "total": np.zeros(len(flat)),
        "median": np.full(len(flat), np.nan),
        "band": np.full(len(flat), np.nan),
        "quantile": np.full((len(flat), len(quantiles)), np.nan),
        "histogram": np.full((len(flat), len(ratio_edges) - 1), np.nan),
        "beyond": np.full(len(flat), np.nan),
    }
    for index, group_counts in enumerate(flat):
        distribution = Distribution(group_counts)
        out["total"][index] = distribution.total
        median = distribution.quantile(0.5) if distribution.total > 0 else 0.0
        if not 0 < median < np.inf:
            continue
        out["median"][index] = median
        out["band"][index] = distribution.band(median, mass)
        out["quantile"][index] = [distribution.quantile(q) / median for q in quantiles]
        below = np.array([distribution.cdf(median * edge) for edge in ratio_edges])
        out["histogram"][index] = np.diff(below) / distribution.total
        out["beyond"][index] = 1 - below[-1] / distribution.total
    return {name: value.reshape(groups + value.shape[1:]) for name, value in out.items()}


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
