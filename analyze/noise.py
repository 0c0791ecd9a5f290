"""The replay's noise draws: a counter-based hash (SplitMix64's finaliser), a pure function of the
indices (seed, target, layer, sample, draw, position, head), so the same seed gives the same draws
for any chunking and any number of workers, and the online check injects exactly these values."""
from __future__ import annotations

import math

import numpy as np

_TARGET_CODE = {"q": 1, "k": 2, "m": 3}


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


_MIX1 = np.uint64(0xBF58476D1CE4E5B9)


_MIX2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def _absorb(state: np.ndarray, key) -> np.ndarray:
    """Fold one more index (scalar or array) into the hash state."""
    key = np.asarray(key, dtype=np.int64).astype(np.uint64)
    return _mix(state ^ _mix(key + _GOLDEN))


def _uniform_bits(seed: int, keys: tuple, samples, n_pos: int, n_heads: int) -> np.ndarray:
    """Uniform [0, 1) floats of shape (len(samples), n_pos, n_heads) hashed from the indices."""
    with np.errstate(over="ignore"):
        state = _mix(np.asarray(seed, dtype=np.int64).astype(np.uint64) + _GOLDEN)
        for key in keys:
            state = _absorb(state, key)
        state = _absorb(state, np.asarray(samples).reshape(-1, 1, 1))
        state = _absorb(state, np.arange(n_pos).reshape(1, -1, 1))
        state = _absorb(state, np.arange(n_heads).reshape(1, 1, -1))
    return (state >> np.uint64(11)).astype(np.float64) * 2.0**-53


def unit_noise(seed: int, target: str, layer: int, samples, draw: int, n_pos: int, n_heads: int,
               distribution: str = "uniform") -> np.ndarray:
    """Unit-RMS noise of shape (len(samples), n_pos, n_heads) for one target, layer and draw.

    ``samples`` are the samples' global indices; the value at (sample, pos, head) depends only
    on (seed, target, layer, sample, draw, pos, head).
    """
    keys = (_TARGET_CODE[target], layer, draw)
    uniform = _uniform_bits(seed, keys + (0,), samples, n_pos, n_heads)
    if distribution == "uniform":
        return math.sqrt(3.0) * (2.0 * uniform - 1.0)
    angle = _uniform_bits(seed, keys + (1,), samples, n_pos, n_heads)
    return np.sqrt(-2.0 * np.log1p(-uniform)) * np.cos(2.0 * np.pi * angle)
