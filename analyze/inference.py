"""Inference on factor subspaces: what a layer's fitted effects say once their noise is accounted for.

Every statistic here is judged against the noise of the fit itself. A factor's fitted effects
W = sqrt(n_c) E[c] (class x d, ``design.FactorEffects``) are its true effects plus noise, and the
corrected influences I_g of the groups of samples stand for that noise: a *noise draw* is
N = sum_g s_g I_g with random signs s_g (a wild cluster bootstrap; the CR2 correction of the
influences makes its second moments those of the noise). One set of signs serves every factor of a
layer, so that the draws keep the correlation of factors read on the same tokens.

- **Structure** (is there anything but noise?): the statistic is |W|^2 (the count-weighted
  between-class variance); its null is |N|^2 = s' Gamma s with Gamma_gh = <I_g, I_h>, so the
  ``n_null`` draws cost G^2 each and p-values can be small enough for a false-discovery correction.
- **Rank** (how many directions stand above noise?): deflated parallel analysis (Horn 1965;
  Dobriban & Owen 2019). Step k compares the (k+1)-th singular value of W with the (1 - rank_significance)
  quantile of the largest singular value of the noise draws with W's k leading directions (left
  and right) projected out; the rank is the first step whose singular value does not stand above
  (found by bisection over the steps). Where the noise is anisotropic (``NoiseSpectrum``) W and
  the draws are whitened by its covariance first (for the structure test too), and the draws' noise
  raised by what that whitening, estimated from the residuals the draws come from, takes from it
  (``NoiseSpectrum.understatement``); directions carrying
  less than the relevance floor of the factor's noise-corrected between-class variance
  (``shrunk_variances``, in the coordinates the rank is judged in) end the count.
- **Draws of subspaces around a truth**: a truth T (class x d, in the span Y of the fitted bases)
  plus a noise draw, and the leading subspace of T + N re-estimated as the fit estimates it. Only
  Gram matrices are needed: (T + N)(T + N)' = AA' + A(NY)' + (NY)A' + NN' with A = TY, so each draw
  costs its noise's Gram matrices once, and each truth a (class x class) eigen-decomposition (a
  Cholesky factor when the factor keeps every direction), whatever d_model. In a whitened layer the
  fit's subspaces are estimated whitened and mapped back, and so are the draws' (``WhitenedDraws``).
- **Truths** to draw around: the fitted effects projected on the factor's basis, each singular value
  shrunk to what it would be without the noise (``denoised``), so that draws around them are as noisy
  as the fit.
- **Angles**: noise biases principal angles (towards 90 degrees for the noise it adds to each
  direction, towards 0 when it tilts the two estimates together, and each sorted angle by the
  others near it), so the intervals of the smallest and the largest angle come from inverting
  draws (Neyman's construction): one factor's denoised effects are turned (``turned``) to truths
  at other principal angles, and a bound is the truth at which the draws' (1 + confidence) / 2 or
  (1 - confidence) / 2 quantile reaches the measured angle (found by a few secant steps from the
  basic bootstrap interval: ``FamilySearch``). The other angles are nuisances that pull the drawn
  one (``AngleFamilies``): for the inner bounds (the smallest angle's upper, the largest's lower)
  they sit at the bounded angle ("equal", the configuration that pulls most, which is also how
  sorted estimates of equal angles behave); for the outer bounds (the smallest's lower, the
  largest's upper) at a spread between the largest and smallest angle estimated from the draws
  (an upper estimate: ``GAP_QUANTILE``), in the shape of the estimate ("from-smallest",
  "from-largest"). Taking every nuisance at its least favourable value instead would cover at
  about 95 % for a stated 90 % (one bound exact, the other conservative); these cover within a few
  points of the stated confidence (``benchmarks/calibration.py``). The bounds are read at the
  draws' quantiles of a t reference with groups - 1 degrees of freedom (``interval_levels``). The
  estimate is the truth whose draws' medians are the measured angles (a fixed point, kept inside
  the intervals).
- **Claims** about a pair, tested on the smallest angle at the least favourable configuration of
  their nulls' boundaries: "orthogonal" (every angle within ``orthogonality_deg`` of 90: H0 smallest
  <= 90 - tol, drawn at (90 - tol, 90, ...)), "dependent" (a shared direction: H0 smallest >=
  ``independence_deg``, drawn at (tol, tol, ...)), "independent" (neither: both smallest >= 90 - tol,
  drawn at (90 - tol, ...), and smallest <= independence_deg, drawn at (tol, 90, ...), rejected; the
  larger p-value of the two).
  Each p-value is the add-one share of draws at the boundary at least as extreme as the measurement
  (below TAIL_DRAWS of them, a normal tail: ``tail_p``); ``subspaces`` controls the false-discovery
  rate over every claim of a run (Benjamini-Hochberg).
- **Spheres** (Theorem 2 of the paper: every component of constant norm): a factor's class points
  are the projections U'(mean + E[c]) of its class means onto its fitted subspace (class means hold
  little within-class noise; what they hold, each class effect's noise in the subspace, is taken from
  their radii squared). Their radius spread (coefficient of variation over classes, token-weighted)
  is inverted like the angles, over truths whose radii are spread t times as much (t = 0: a
  perfect sphere), with claims "on sphere" (H0 cv >= ``radius_cv_tolerance``) and "off sphere"
  (H0 cv <= tolerance). The **cross term** of two factors, the RMS cosine between the class points of
  their components over their shared tokens, each token weighted by |x_a|^2 |x_b|^2 (within [0, 1]; 0
  for orthogonal subspaces), has an interval from the draws around the fit (basic bootstrap) and a
  null from draws around orthogonal subspaces.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy.linalg.lapack import dtrtri
from scipy.stats import norm
from scipy.stats import t as student_t

from .design import FactorEffects, NoiseTraces
from .geometry import column_space

DRAW_BATCH = 32
"""Noise draws are made this many at a time (each batch: draws x classes x d in float32)."""
ANGLE_TOLERANCE = 0.25
"""Degrees within which a bound of an angle is settled (``FamilySearch``)."""
CV_TOLERANCE = 0.002
"""Within this a bound of a radius spread is settled (``FamilySearch``)."""
GAP_QUANTILE = 0.25
"""The outer bounds of the angles take the other angles at the spread whose draws' GAP_QUANTILE quantile
is the measured spread (``AngleFamilies``): an upper estimate, leaning towards the least favourable
side, because a spread estimated too small costs those bounds more than one too large does (at a
median-unbiased spread a planted (80, 90) pair's smallest angle fell below its interval in 10 % of
layers instead of 5 %)."""
NUMERICAL_ZERO = 1e-6
"""Singular values below this share of the largest are rounding, whatever the noise (noiseless data)."""
TAIL_DRAWS = 5
"""Below this many draws as extreme as a measurement, its p-value comes from a normal tail (``tail_p``)."""
CLAIMS = ("orthogonal", "dependent", "independent")
SPHERE_CLAIMS = ("on", "off")


def rademacher(rng: np.random.Generator, n: int, n_groups: int) -> np.ndarray:
    """(n, groups) random signs."""
    return rng.choice([-1.0, 1.0], size=(n, n_groups)) if n else np.zeros((0, n_groups))


def add_one_share(extreme: np.ndarray) -> float:
    """A Monte Carlo p-value: (1 + extreme draws) / (1 + draws)."""
    return float((1 + np.count_nonzero(extreme)) / (1 + len(extreme)))


def tail_p(draws: np.ndarray, measured: float, upper: bool) -> float:
    """p-value of a measurement against draws of its null: the share of draws at least as extreme
    (add-one) when TAIL_DRAWS or more are; beyond the draws' resolution, the tail of a normal
    distribution with the draws' mean and standard deviation, never above that resolution (so that a
    false-discovery correction over many tests can succeed without ever more draws)."""
    draws = draws[~np.isnan(draws)]  # undefined draws (radii all within noise) say nothing either way
    if not draws.size:
        return float("nan")
    extreme = draws >= measured if upper else draws <= measured
    if np.count_nonzero(extreme) >= TAIL_DRAWS:
        return add_one_share(extreme)
    spread = np.std(draws)
    z = (measured - np.mean(draws)) / spread if spread > 0 else (np.inf if measured != np.mean(draws) else 0.0)
    return float(min(norm.sf(z if upper else -z), TAIL_DRAWS / (1 + len(draws))))


def benjamini_hochberg(p: np.ndarray) -> np.ndarray:
    """Benjamini-Hochberg adjusted p-values of every finite entry together (NaN stays NaN)."""
    p = np.asarray(p, float)
    q = np.full(p.shape, np.nan)
    finite = np.isfinite(p)
    values = p[finite]
    if values.size:
        order = np.argsort(values)
        ranked = values[order] * values.size / np.arange(1, values.size + 1)
        adjusted = np.minimum.accumulate(ranked[::-1])[::-1]
        out = np.empty_like(values)
        out[order] = np.minimum(adjusted, 1.0)
        q[finite] = out
    return q


# ---------------------------------------------------------------------------------------------
# Whitening: which directions stand above the noise is judged against the noise's own covariance.


ANISOTROPY = 4.0
"""The tests are whitened only when the shrunk noise covariance's largest eigenvalue exceeds this
multiple of its median (a dimension with twice the others' spread): noise that is nearly isotropic is
judged as it is, and its results are those of the unwhitened tests exactly."""


@dataclass(frozen=True)
class NoiseSpectrum:
    """A layer's noise covariance S (d, d) per token (the tokens' covariance around the fit,
    ``layer.noise_covariance``) as its eigen-decomposition, from which ``whitening`` builds a symmetric map P
    with P S' P = I, S' shrunk towards a multiple of the identity by the oracle approximating shrinkage (OAS,
    Chen et al. 2010, as scikit-learn's), for any token count without decomposing S again (OAS keeps S's
    eigenvectors and moves its eigenvalues by a shrinkage that depends on the count only). A few dimensions
    of huge variance (massive activations, sink tokens) then do not hide directions that stand above the
    noise elsewhere; no whitening when the noise is nearly isotropic (``ANISOTROPY``). S comes from every
    analysed token, not from the groups' influences that the tests draw: whitened by their own estimate, the
    influences under-state the noise of the effects in the directions that estimate happens to shrink (by
    20 % on planted rogue dimensions), and the tests find structure in noise."""

    values: np.ndarray  # ascending, clipped at 0
    vectors: np.ndarray  # (d, d), columns
    level: float  # tr(S) / d
    square: float  # tr(S^2) / d

    @classmethod
    def of(cls, covariance: np.ndarray) -> NoiseSpectrum | None:
        """None without noise."""
        d = len(covariance)
        level = np.trace(covariance) / d
        if not level > 0:
            return None
        values, vectors = np.linalg.eigh(covariance)
        return cls(np.maximum(values, 0.0), vectors, float(level), float(np.sum(covariance * covariance.T) / d))

    def shrinkage(self, n_samples: float) -> float:
        """OAS's shrinkage for `n_samples` tokens (scikit-learn's form: tr(S^2)/d + tr(S)^2/d over
        (n + 1)(tr(S^2)/d - (tr(S)/d)^2))."""
        numerator = self.square + self.level**2 * len(self.values)
        denominator = (n_samples + 1) * (self.square - self.level**2)
        return 1.0 if denominator == 0 else min(numerator / denominator, 1.0)

    def shrunk(self, n_samples: float) -> np.ndarray | None:
        """The OAS-shrunk eigenvalues for `n_samples` tokens; None where the noise is nearly isotropic (no
        whitening)."""
        shrinkage = self.shrinkage(n_samples)
        shrunk = (1 - shrinkage) * self.values + shrinkage * self.level
        if not shrunk.min() > NUMERICAL_ZERO * self.level or shrunk[-1] <= ANISOTROPY * np.median(shrunk):
            return None
        return shrunk

    def whitening(self, shrunk: np.ndarray | None) -> np.ndarray | None:
        """P = V diag(shrunk)^(-1/2) V' (None for None)."""
        return None if shrunk is None else (self.vectors / np.sqrt(shrunk)) @ self.vectors.T

    def understatement(self, n_samples: float, n_fitted: int) -> float:
        """How many times the noise of a statistic independent of the residuals (the class means' noise)
        exceeds, in expectation, that of the residuals' own influences once both are whitened by the
        residuals' shrunk covariance (1 without a whitening). Whitened by its own estimate S, noise reads
        tr(S^-1 S) = d where noise independent of S reads E tr(S^-1 Sigma) = d m / (m - d - 1) (the mean of an
        inverse Wishart, m = n_samples - n_fitted degrees of freedom): the influences' null would sit low by
        that factor, and the structure test and the ranks read structure in noise (7.7 % of 400 null layers
        beside rogue dimensions at a nominal 5 %). Shrinkage takes d_eff = (1 - shrinkage) sum_i s_i / shrunk_i
        of the d dimensions from S, which replaces d."""
        shrunk = self.shrunk(n_samples)
        if shrunk is None:
            return 1.0
        taken = float((1 - self.shrinkage(n_samples)) * np.sum(self.values / shrunk))
        freedom = n_samples - n_fitted
        return float(freedom / max(freedom - taken - 1, 1.0)) if freedom > 0 else 1.0


ROUNDING_BITS = {"float16": 10, "bfloat16": 7}
"""The store dtypes narrower than the models' float32 arithmetic, with their fraction bits: a value of magnitude m
is stored on a grid of spacing 2^(floor(log2 m) - bits)."""
EXACT_DTYPES = ("float32", "float64")
"""Store dtypes that hold what the model computed as it is: nothing is rounded by the store."""


def cell_rounding_variance(covariance: np.ndarray, cell_means: np.ndarray, cell_counts: np.ndarray,
                           dtype: str) -> np.ndarray | None:
    """(cell, d): the variance b^2 of each cell mean's rounding error in the store's dtype (zeros for a store
    that rounds nothing, None for a dtype without a known spacing). The tokens of one cell of labels spread
    by sigma around its mean, of magnitude m, and are rounded on the grid of spacing D there; b^2, the mean
    square over the mean's unknown place on that grid of its tokens' mean rounding error, is
    D^2 / (2 pi^2) sum_k exp(-4 pi^2 k^2 sigma^2 / D^2) / k^2 (``_mean_rounding_variance``: D^2 / 12 when
    sigma << D, nothing once sigma exceeds D). sigma is the noise before rounding: the stored `covariance`'s
    diagonal less what rounding added to each token (``_noise_before_rounding``, over the cells' magnitudes
    weighted by their `cell_counts`)."""
    if str(dtype) in EXACT_DTYPES:
        return np.zeros(cell_means.shape)
    bits = ROUNDING_BITS.get(str(dtype))
    if bits is None:
        return None
    magnitudes = np.abs(cell_means)
    with np.errstate(divide="ignore"):
        spacing = np.where(magnitudes > 0, np.exp2(np.floor(np.log2(magnitudes)) - bits), 0.0)
    stored = np.maximum(np.diag(covariance), 0.0)
    variance = np.zeros(cell_means.shape)
    # where even the least noise the stored spread allows, stored - D^2 / 12, leaves exp(-a) below 1e-26
    # in every cell, the rounding averages away: only the other coordinates need the bisection
    least = np.maximum(stored - spacing**2 / 12, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        rounded = np.any(~(4 * np.pi**2 * least > 60 * spacing**2), axis=0)
    if np.any(rounded):
        weights = cell_counts / max(cell_counts.sum(), 1)
        noise = _noise_before_rounding(stored[rounded], spacing[:, rounded], weights)
        variance[:, rounded] = _mean_rounding_variance(noise, spacing[:, rounded])
    return variance


def _mean_rounding_variance(noise_variance: np.ndarray, spacing: np.ndarray) -> np.ndarray:
    """b^2 = D^2 / (2 pi^2) f(4 pi^2 sigma^2 / D^2), f(a) = sum_k exp(-a k^2) / k^2: its series where it
    converges fast (a >= 1, eight terms), below that its Poisson-summed form pi^2 / 6 - sqrt(pi a) + a / 2
    (both to within 1e-4 of f(1)); nothing where the spacing is 0 (a value of 0 rounds exactly)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.where(spacing > 0, 4 * np.pi**2 * noise_variance / spacing**2, np.inf)
    small = np.minimum(a, 1.0)
    closed = np.pi**2 / 6 - np.sqrt(np.pi * small) + small / 2
    large = np.where(np.isfinite(a), np.maximum(a, 1.0), np.inf)[..., None]
    harmonics = np.arange(1, 9)
    series = np.sum(np.exp(-large * harmonics**2) / harmonics**2, axis=-1)
    return spacing**2 / (2 * np.pi**2) * np.where(a < 1, closed, series)


def _noise_before_rounding(stored_variance: np.ndarray, spacing: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Per coordinate, the noise variance sigma^2 before rounding that the stored values' variance implies:
    a token's rounding adds what its cell mean's does not, D^2 / 12 - b^2 (averaged over the cells, rows of
    `spacing`, with `weights`), and stored = sigma^2 + that; the sum grows with sigma^2, so bisection finds
    it (40 halvings)."""
    low, high = np.zeros_like(stored_variance), stored_variance.copy()
    for _ in range(40):
        middle = (low + high) / 2
        added = weights @ (spacing**2 / 12 - _mean_rounding_variance(middle, spacing))
        below = middle + added < stored_variance
        low, high = np.where(below, middle, low), np.where(below, high, middle)
    return (low + high) / 2


def rounding_bias(covariance: np.ndarray, class_rounding: list[np.ndarray] | None) -> float:
    """How far the store's rounding can move a class mean, against that mean's noise: the largest over
    factors, classes and coordinates of sqrt(W / sigma^2), with W a class's rounding variance in count-
    weighted coordinates (``layer.CellRounding.class_variance``; None: a dtype without a known spacing) and sigma^2 the
    diagonal of `covariance`, a weighted class mean's noise. Above 1 the rounding, not the noise, sets
    the class means' error."""
    if class_rounding is None:
        return np.nan
    noise = np.maximum(np.diag(covariance), 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = [np.where(noise > 0, np.sqrt(w / noise), np.where(w > 0, np.inf, 0.0)) for w in class_rounding]
    return float(max((r.max() for r in ratios if r.size), default=0.0))


def rounding_inflation(covariance: np.ndarray, class_rounding: list[np.ndarray] | None,
                       whitening: np.ndarray | None) -> float:
    """By how much, on average over factors and classes, the draws' variance grows when they carry the
    class means' rounding: 1 + tr(P W P') / tr(P S P'), with W a class's rounding variances (diagonal, in
    count-weighted coordinates), S the tokens' noise covariance and P the whitening the layer is judged in
    (the identity without one); 1 where the dtype's spacing is far below the noise (float32, or float16 at
    a language model's spreads)."""
    if class_rounding is None or not any(np.any(w > 0) for w in class_rounding):
        return 1.0
    P = np.eye(len(covariance)) if whitening is None else whitening
    noise = np.trace(P @ covariance @ P.T)
    rounding = np.mean(np.concatenate(class_rounding), axis=0)
    return float(1.0 + np.einsum("ij,j,ij->", P, rounding, P) / noise) if noise > 0 else np.inf  # rounding and no noise


def whitened(effects: FactorEffects, whitening: np.ndarray | None) -> FactorEffects:
    """A factor's effects and influences in whitened coordinates (as they are without a whitening)."""
    if whitening is None:
        return effects
    return FactorEffects(effects.weighted @ whitening, effects.influence @ whitening)


# ---------------------------------------------------------------------------------------------
# Structure and rank.


def structure_p(effects: FactorEffects, signs: np.ndarray, design: NoiseTraces, understated: float) -> float:
    """p-value of "the factor's labels carry no information": the share of noise draws whose
    between-class variance reaches the fit's |W|^2 (add-one). A draw is |N|^2 = s' Gamma s with
    Gamma_gh = <I_g, I_h>; its cross products Gamma_gh (g != h) lose what the correlation of the
    groups' residuals puts into them (tau tr(M_gh), tau the noise variance that matches the diagonal:
    true noises of different groups are independent), and its spread around the centre sum_g
    Gamma_gg (itself an estimate of E|W|^2) grows to what the centre's own variance adds and the
    groups' own noises (which sign flips cannot move) would have added (``design.noise_traces``).
    With G groups holding the factor's tokens the signs give at most 2^(G - 1) different draws, and
    the measurement stands for one of them: the p-value is never below 2^-(G - 1) (with 2-5 groups
    no test can reject at 5 %; without the floor a measurement beyond every draw read 1 / (1 + draws)).
    `understated`: the factor by which the influences understate the effects' noise (whitened by the
    residuals' own covariance: ``NoiseSpectrum.understatement``), which scales the null."""
    flat = effects.influence.reshape(len(effects.influence), -1)
    gram = flat @ flat.T
    diagonal = np.diag(gram).copy()
    scale = diagonal.sum() / np.trace(design.traces) if np.trace(design.traces) > 0 else 0.0
    cross = gram - scale * design.traces
    cross[np.diag_indices(len(cross))] = 0.0
    spread = ((signs @ cross) * signs).sum(axis=1)
    null = understated * (diagonal.sum() + np.sqrt((1 + design.centre_variance) / (1 - design.diagonal_share)) * spread)
    resolution = 2.0 ** (1 - np.count_nonzero(diagonal > 0))
    return max(add_one_share(null >= np.sum(effects.weighted**2)), resolution)


def noise_rank(weighted: np.ndarray, gram: np.ndarray, along: np.ndarray, significance: float,
               limit: int) -> tuple[int, np.ndarray]:
    """Deflated parallel analysis: the rank and, per step tested (NaN for the others), the noise's
    singular value it was compared with. gram: the draws' N N' (draws, k, k); along: N V (draws, k, p),
    V the right singular vectors of `weighted` (at least `limit` of them). The rank is the first step
    whose singular value does not stand above the noise's, found by bisection: a step that fails is
    followed by failing ones (the singular values fall faster than the deflated noise's edge)."""
    left, singular, _ = np.linalg.svd(weighted)
    thresholds = np.full(limit, np.nan)
    gram_left = left.T @ gram @ left  # the draws in W's left singular vectors: each step is a corner of them
    along_left = left.T @ along

    def stands_above(step: int) -> bool:
        kept = along_left[:, step:, :step]  # the class directions left once the leading ones are projected out
        rest = gram_left[:, step:, step:] - kept @ np.swapaxes(kept, -1, -2)
        top = np.linalg.eigvalsh(rest)[:, -1]
        thresholds[step] = np.sqrt(max(np.quantile(top, 1 - significance), 0.0))
        return singular[step] > max(thresholds[step], NUMERICAL_ZERO * singular[0])

    low, high = 0, limit  # steps below `low` stand above; `high` and beyond do not
    while low < high:
        middle = (low + high) // 2
        if stands_above(middle):
            low = middle + 1
        else:
            high = middle
    return low, thresholds


# ---------------------------------------------------------------------------------------------
# The noise draws of one layer, reduced to what every later use needs.


@dataclass
class NoiseParts:
    """Per factor: its draws' Gram N N' (draws, k, k) and N times the columns of `columns` (draws, k, c);
    per pair (a, b), a < b: N_a N_b' (draws, k_a, k_b)."""

    gram: list[np.ndarray]
    along: list[np.ndarray]
    cross: dict


def noise_parts(effects: list[FactorEffects], signs: np.ndarray, columns: np.ndarray, pairs) -> NoiseParts:
    """The draws' Gram matrices and coordinates (``NoiseParts``), batch by batch, at a cost per draw that
    d_model bounds but does not set: a draw's coordinates along `columns` are the same combination of
    the influences' (``influence_coordinates``: computed once), and its inner products are those of its
    coordinates in an orthonormal basis of the influences' rows (groups x classes of them, fewer than
    d_model in a wide model)."""
    n = len(effects)
    influences, along_once = influence_coordinates(effects, columns)
    gram = [[] for _ in range(n)]
    cross = {pair: [] for pair in pairs}
    for start in range(0, len(signs), DRAW_BATCH):
        batch = signs[start: start + DRAW_BATCH].astype("float32")
        drawn = [np.tensordot(batch, influence, axes=(1, 0)) for influence in influences]
        for a, noise in enumerate(drawn):
            gram[a].append(np.matmul(noise, np.swapaxes(noise, -1, -2)).astype("float64"))
        for a, b in pairs:
            cross[a, b].append(np.matmul(drawn[a], np.swapaxes(drawn[b], -1, -2)).astype("float64"))
    along = [np.tensordot(signs, once, axes=(1, 0)) for once in along_once]
    return NoiseParts([np.concatenate(g) for g in gram], along, {pair: np.concatenate(c) for pair, c in cross.items()})


def influence_coordinates(effects: list[FactorEffects], columns: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per factor, its influences (groups, k, m) in float32, in an orthonormal basis of every factor's
    influence rows when those are fewer than d_model (m = their number; else the influences as they are,
    m = d), and their coordinates along `columns` (groups, k, p) in float64."""
    d = columns.shape[0]
    along = [np.tensordot(factor.influence, columns, axes=(2, 0)) for factor in effects]
    stacked = np.concatenate([factor.influence.reshape(-1, d) for factor in effects])
    if len(stacked) >= d:
        return [factor.influence.astype("float32") for factor in effects], along
    rows = np.linalg.qr(stacked.T)[1].T  # stacked = rows Q': the same inner products
    sizes = np.cumsum([0] + [factor.influence.shape[0] * factor.influence.shape[1] for factor in effects])
    return [rows[begin:end].reshape(factor.influence.shape[:2] + (-1,)).astype("float32")
            for factor, begin, end in zip(effects, sizes[:-1], sizes[1:])], along


@dataclass
class Drawn:
    """The leading subspaces U* of draws T + N around one truth: `scaled` (draws, k, r) maps the rows of
    T + N to U* (U* = (T + N)' scaled); with the truth's coordinates A = T Y and its noise's N Y, and
    `rows` (a function, called once when needed: most draws never need it) giving the rows' coordinates
    in U*, (T + N) U* (draws, k, r)."""

    scaled: np.ndarray
    truth: np.ndarray
    noise: np.ndarray
    rows: Callable[[], np.ndarray]

    @functools.cached_property
    def coordinates(self) -> np.ndarray:
        return self.rows()

    def along(self, direction: np.ndarray, noise_along: np.ndarray) -> np.ndarray:
        """(draws, r) U*' v for a vector v with Y-coordinates `direction` and N v = noise_along (draws, k)."""
        rows = self.truth @ direction + noise_along  # (T + N) v
        return np.einsum("nkr,nk->nr", self.scaled, rows)


@dataclass
class Complement:
    """What the draws of a factor that keeps every direction of its centred effects (rank k - 1) need: an
    orthonormal basis Q (k, k - 1) of the rows' space (orthogonal to sqrt(counts)) and its noise draws in
    it, Q'NN'Q (draws, k - 1, k - 1) and Q'NY (draws, k - 1, q)."""

    basis: np.ndarray
    gram: np.ndarray
    noise: np.ndarray

    @classmethod
    def of(cls, counts: np.ndarray, gram: np.ndarray, noise: np.ndarray) -> Complement:
        root = np.sqrt(counts)[:, None]
        basis = np.linalg.svd(np.eye(len(root)) - (root @ root.T) / counts.sum())[0][:, : len(counts) - 1]
        return cls(basis, basis.T @ gram @ basis, basis.T @ noise)


@dataclass
class WhitenedDraws:
    """What the draws of a subspace estimated in whitened coordinates need, P the whitening: N P^2 N'
    (draws, k, k), N P^2 Y (draws, k, q) and Y' P^2 Y (q, q)."""

    gram: np.ndarray
    noise: np.ndarray
    span: np.ndarray


def drawn_subspaces(truth: np.ndarray, gram: np.ndarray, noise: np.ndarray, rank: int,
                    complement: Complement | None = None, whitened: WhitenedDraws | None = None) -> Drawn:
    """The leading `rank` subspaces of the draws T + N around a truth with Y-coordinates `truth` (k, q),
    from the draws' Gram N N' (draws, k, k) and N Y (draws, k, q). With `complement` (a rank of k - 1),
    T + N keeps every direction of its rows' space: its basis comes from a Cholesky factor of
    Q'(T + N)(T + N)'Q = L L' (U* = (T + N)'Q L^-T, its rows' coordinates (T + N) U* = Q L) instead of an
    eigen-decomposition, several times cheaper. With `whitened`, the subspace is estimated as the fit's is
    in a whitened layer: the leading right singular vectors of (T + N) P mapped back by P^-1, which span
    (T + N)'u for the leading eigenvectors u of (T + N) P^2 (T + N)'; orthonormalised, U* = (T + N)'u C with
    C = (u'(T + N)(T + N)'u)^(-1/2)."""
    if complement is not None:
        rows = complement.basis.T @ truth
        mixed = rows @ np.swapaxes(complement.noise, -1, -2)
        try:
            lower = np.linalg.cholesky(_drawn_gram(rows @ rows.T, mixed, complement.gram))
        except np.linalg.LinAlgError:  # some draw spans fewer directions (little noise, d < k - 1)
            lower = None
        if lower is not None:
            inverse = np.stack([dtrtri(factor, lower=1)[0] for factor in lower])
            return Drawn(complement.basis @ np.swapaxes(inverse, -1, -2), truth, noise, lambda: complement.basis @ lower)
    total = _drawn_gram(truth @ truth.T, truth @ np.swapaxes(noise, -1, -2), gram)
    estimated_from = total
    if whitened is not None:
        estimated_from = _drawn_gram(truth @ whitened.span @ truth.T, truth @ np.swapaxes(whitened.noise, -1, -2), whitened.gram)
    scaled = _orthonormalising(_leading_vectors(estimated_from, rank), total)
    return Drawn(scaled, truth, noise, lambda: total @ scaled)


def _drawn_gram(square: np.ndarray, mixed: np.ndarray, gram: np.ndarray) -> np.ndarray:
    """(T + N)(T + N)' (draws, k, k) = T T' + T N' + N T' + N N' from T T' (`square`), T N' (`mixed`) and
    N N' (`gram`), summed in that order into one new array."""
    total = square + mixed
    total += np.swapaxes(mixed, -1, -2)
    total += gram
    return total


def _leading_vectors(matrices: np.ndarray, rank: int) -> np.ndarray:
    """Eigenvectors of the `rank` largest eigenvalues of symmetric matrices (draws, k, k): torch's batched
    decomposition in float32 where torch is installed (several times faster than numpy's in float64 at
    k = 64), numpy's otherwise. Only their span is used, and ``_orthonormalising`` makes the basis exact
    in float64. (A block Krylov space from the draws' mean matrix was tried for low ranks: the weak
    directions that decide a rank sit within a few per cent of the noise's bulk, and most draws did
    not converge.)"""
    try:
        import torch
    except ImportError:
        return np.linalg.eigh(matrices)[1][..., ::-1][..., :rank]
    with one_torch_thread(torch):
        vectors = torch.linalg.eigh(torch.from_numpy(np.ascontiguousarray(matrices, dtype=np.float32)))[1].numpy()
    return vectors[..., ::-1][..., :rank].astype(np.float64)


_torch_threads = {"lock": threading.Lock(), "users": 0, "saved": 1}


@contextlib.contextmanager
def one_torch_thread(torch):
    """torch's own threads held at one while any thread decomposes, and set back after the last: the
    analyses' parallelism is Dask's threads, one a core, and torch's threads on top oversubscribe
    the cores (the language-model store's subspaces: 60 s instead of 43 s)."""
    state = _torch_threads
    with state["lock"]:
        if state["users"] == 0:
            state["saved"] = torch.get_num_threads()
            torch.set_num_threads(1)
        state["users"] += 1
    try:
        yield
    finally:
        with state["lock"]:
            state["users"] -= 1
            if state["users"] == 0:
                torch.set_num_threads(state["saved"])


def _orthonormalising(leading: np.ndarray, total: np.ndarray) -> np.ndarray:
    """C such that U* = (T + N)' u C is orthonormal, u the `leading` vectors (draws, k, r) and total
    (T + N)(T + N)' (draws, k, k): C = L^-T with L L' = u' total u (an inverse square root where some
    draw spans fewer than r directions)."""
    inner = np.swapaxes(leading, -1, -2) @ total @ leading
    try:
        return leading @ np.swapaxes(np.linalg.inv(np.linalg.cholesky(inner)), -1, -2)
    except np.linalg.LinAlgError:
        values, vectors = np.linalg.eigh(inner)
        root = vectors / np.sqrt(np.maximum(values, np.finfo(float).tiny))[:, None, :]
        return leading @ root @ np.swapaxes(vectors, -1, -2)


def cosines_against(fixed: Drawn, other_noise: np.ndarray, cross: np.ndarray) -> Callable[[Drawn], np.ndarray]:
    """U*_f' U*_o (draws, r_f, r_o) between the draws of a fixed truth of one factor, f, and those of any
    truth of another, o, whose noise is `other_noise` (N_o Y), from N_f N_o' (draws, k_f, k_o). With
    (T_f + N_f)(T_o + N_o)' = (A_f + N_f Y) A_o' + A_f (N_o Y)' + N_f N_o', what depends on f's draws alone
    (U*_f in Y, (A_f + N_f Y)' S_f, and S_f'(A_f (N_o Y)' + N_f N_o')) is computed once, so that each truth of
    o costs products of (draws, r_f, q) and (draws, r_f, k_o) matrices."""
    in_span = np.swapaxes(fixed.truth + fixed.noise, -1, -2) @ fixed.scaled
    constant = np.swapaxes(fixed.scaled, -1, -2) @ (fixed.truth @ np.swapaxes(other_noise, -1, -2) + cross)

    def cosines(other: Drawn) -> np.ndarray:
        return (np.swapaxes(in_span, -1, -2) @ other.truth.T + constant) @ other.scaled

    return cosines


def cosine_angles(cosines: np.ndarray) -> np.ndarray:
    """Principal angles (degrees, ascending) from matrices of cosines (..., r_a, r_b) between orthonormal
    bases: the squared cosines are the eigenvalues of the smaller Gram matrix of the cosines."""
    small = np.swapaxes(cosines, -1, -2) @ cosines if cosines.shape[-1] <= cosines.shape[-2] else \
        cosines @ np.swapaxes(cosines, -1, -2)
    squares = np.clip(np.linalg.eigvalsh(small)[..., ::-1], 0.0, 1.0)
    return np.degrees(np.arccos(np.sqrt(squares)))


# ---------------------------------------------------------------------------------------------
# Truths: the fit's effects without the noise that inflates them, and turned.


def denoised(weighted: np.ndarray, basis: np.ndarray, gram: np.ndarray, noise: np.ndarray) -> np.ndarray:
    """The factor's effects (k, d) projected on its basis (d, r) as a truth to draw around: each singular
    value y of the projection shrunk to the s whose noisy version would read y. For a direction with left
    and right singular vectors u, v and the noise's energies a = E|N v|^2 and b = E|N' u|^2 along them,
    y^2 = (s^2 + a)(s^2 + b) / s^2 (Benaych-Georges & Nadakuditi 2012; with noise of variance s2 in
    every entry, a = s2 k and b = s2 d), so s^2 = (y^2 - a - b + sqrt((y^2 - a - b)^2 - 4ab)) / 2.
    gram: the draws' N N' (draws, k, k); noise: N times the basis (draws, k, r). With the leading right
    singular vectors as the basis, the truth is the shrunk truncated SVD."""
    left, singular, right_t = np.linalg.svd(weighted @ basis, full_matrices=False)
    shrunk = shrunk_variances(left, singular, gram, noise @ right_t.T)
    return (left * np.sqrt(shrunk)) @ (basis @ right_t.T).T


def shrunk_variances(left: np.ndarray, singular: np.ndarray, gram: np.ndarray, along: np.ndarray) -> np.ndarray:
    """Each direction's squared singular value s^2 without the noise that inflates it (see ``denoised``),
    from its left singular vectors (k, p), singular values (p,), the draws' N N' (draws, k, k) and N V
    (draws, k, p)."""
    right_energy = np.mean(np.sum(along**2, axis=1), axis=0)
    left_energy = np.einsum("kr,kl,lr->r", left, gram.mean(axis=0), left)
    excess = singular**2 - right_energy - left_energy
    return np.maximum((excess + np.sqrt(np.maximum(excess**2 - 4 * right_energy * left_energy, 0.0))) / 2, 0.0)


def relevant_rank(shares: np.ndarray, floor: float) -> int:
    """The number of leading directions whose share of their factor's between-class variance reaches
    the relevance floor (the first one below it ends the count)."""
    below = np.flatnonzero(~(shares >= floor))
    return int(below[0]) if below.size else len(shares)


def turned(rows: np.ndarray, basis: np.ndarray, other: np.ndarray, target: np.ndarray) -> np.ndarray:
    """A factor's effect rows (k, d) turned so that the principal angles between their span (`basis`,
    (d, r)) and another factor's (`other`, fixed) become `target` (degrees, ascending, one per angle):
    each principal vector p_i of `basis` turns in the plane of p_i and its partner q_i, from q_i
    towards e_i (the part of p_i orthogonal to q_i); the planes of different angles are orthogonal
    and the factor's other directions (orthogonal to the other's span) stay. A rotation: the rows keep
    their singular values. Turning one factor of a pair leaves the other's draws the same for every
    truth of the pair (``layer._pair``)."""
    left, cosines, right_t = np.linalg.svd(basis.T @ other)
    m = len(cosines)
    p, q = basis @ left[:, :m], other @ right_t[:m].T
    now = np.arccos(np.clip(cosines, 0.0, 1.0))
    across = p - q * cosines
    across /= np.maximum(np.linalg.norm(across, axis=0), np.finfo(float).tiny)
    turn = np.radians(np.asarray(target, float)) - now
    along, away = rows @ q, rows @ across
    cos, sin = np.cos(turn) - 1, np.sin(turn)
    return rows + (along * cos - away * sin) @ q.T + (along * sin + away * cos) @ across.T


ANGLE_FAMILIES = ("smallest", "equal", "spread", "from-smallest", "from-largest")


@dataclass(frozen=True)
class AngleFamilies:
    """One-parameter families of truths (m principal angles, ascending) to draw around.

    - "smallest" (v, 90, ...) and "equal" (v, ..., v): the least favourable configurations of the
      claims' boundaries (under the first the drawn smallest angle is largest, under the second smallest);
      "equal" is also the family of the inner bounds (the smallest angle's upper, the largest's lower),
      where the other angles pull the drawn one towards them most;
    - "spread" (v: the spread between the largest and the smallest angle): the estimate's angles
      `estimate` moved apart or together about their middle, keeping their `shape` (where each lies
      between the smallest, 0, and the largest, 1), to find the spread the draws put at the measured
      one (``GAP_QUANTILE``);
    - "from-smallest" (v, v + gap * shape) and "from-largest" (v - gap * (1 - shape), v): the outer
      bounds' families, the other angles at that `gap` from the one bounded.
    Every truth is clipped to [0, 90]; with one angle every family is (v)."""

    estimate: np.ndarray
    gap: float = 0.0

    @property
    def shape(self) -> np.ndarray:
        m = len(self.estimate)
        width = self.estimate[-1] - self.estimate[0]
        if m == 1:
            return np.zeros(1)
        return (self.estimate - self.estimate[0]) / width if width > 0 else np.linspace(0.0, 1.0, m)

    def truth(self, family: str, value: float) -> np.ndarray:
        m, shape = len(self.estimate), self.shape
        if family == "smallest":
            angles = np.array([value] + [90.0] * (m - 1))
        elif family == "equal":
            angles = np.full(m, float(value))
        elif family == "spread":
            middle = (self.estimate[0] + self.estimate[-1]) / 2
            angles = np.sort(middle + value * (shape - 0.5))
        elif family == "from-smallest":
            angles = value + self.gap * shape
        elif family == "from-largest":
            angles = value - self.gap * (1 - shape)
        else:
            raise ValueError(f"unknown family {family!r}: expected one of {ANGLE_FAMILIES}")
        return np.clip(angles, 0.0, 90.0)


# ---------------------------------------------------------------------------------------------
# Inverting draws into estimates and intervals.


class FamilySearch:
    """Draws of a statistic around the truths of one-parameter families (``draw(family, value)`` ->
    (draws, ...) array), each drawn once, and the truths at which their quantiles cross a measurement:
    the bounds and medians of Neyman's construction, found by a few secant steps from a guess instead
    of a whole grid of truths (each truth costs a set of draws)."""

    def __init__(self, draw, low: float, high: float, tolerance: float):
        self.draw, self.low, self.high, self.tolerance = draw, low, high, tolerance
        self.cache: dict = {}

    def at(self, family: str, value: float) -> np.ndarray:
        key = self._key(family, value)
        if key not in self.cache:
            self.cache[key] = self.draw(family, key[1])
        return self.cache[key]

    def given(self, family: str, value: float, drawn: np.ndarray) -> None:
        """Record the draws at a truth that were drawn elsewhere (a factor's draws around its fitted truth)."""
        self.cache[self._key(family, value)] = drawn

    def _key(self, family: str, value: float) -> tuple[str, float]:
        return family, round(float(np.clip(value, self.low, self.high)), 6)

    def curve(self, family: str, column, level: float) -> tuple[np.ndarray, np.ndarray]:
        """The truths drawn so far in a family (ascending) and the `level` quantiles of their draws
        (of `column`, or the whole draw when None), made non-decreasing in the truth."""
        values = np.array(sorted(value for name, value in self.cache if name == family))
        draws = [self.cache[family, value] for value in values]
        quantiles = np.array([defined_quantile(d if column is None else d[:, column], level) for d in draws])
        defined = np.isfinite(quantiles)  # a truth whose draws are all undefined (e.g. radii all within noise)
        return values[defined], np.maximum.accumulate(quantiles[defined])

    def crossing(self, family: str, column, level: float, measured: float, guess: float) -> float:
        """The truth whose draws' `level` quantile is `measured`: linear between the two drawn truths that
        bracket it, the family's end (low or high) when its draws lie beyond (SEARCH_STEPS new truths at most)."""
        value = guess if np.isfinite(guess) else (self.low + self.high) / 2
        for _ in range(SEARCH_STEPS):
            self.at(family, value)
            values, quantiles = self.curve(family, column, level)
            if not len(values):  # no truth drawn so far has a defined draw
                return float("nan")
            value, settled = _next_truth(values, quantiles, measured, self.low, self.high, self.tolerance)
            if settled:
                return value
        return value


SEARCH_STEPS = 3
"""New truths a crossing may draw (``FamilySearch.crossing``): a guess and two secant steps, beside
the truths of the family drawn already (the claims' boundaries are drawn first). With one step fewer,
bounds at an end of a family (0 or 90 degrees) stay short of it: the lower bound of a planted 0-degree
angle missed it in 9 % of layers instead of 5 % (about 16 truths a pair against 20)."""


def _next_truth(values, quantiles, measured, low, high, tolerance) -> tuple[float, bool]:
    """The next truth to draw towards the crossing, and whether it is settled (bracketed within
    `tolerance` of a drawn truth, or at an end of the family that the draws already pass)."""
    above = quantiles >= measured
    if above.all() or not above.any():
        end = 0 if above.all() else -1
        if values[end] == (low if above.all() else high):
            return float(values[end]), True
        slope = 1.0
        if len(values) > 1:
            near = slice(0, 2) if above.all() else slice(-2, None)
            rise, run_ = np.diff(quantiles[near])[0], np.diff(values[near])[0]
            slope = max(rise / run_, 0.2) if run_ > 0 else 1.0
        step = (measured - quantiles[end]) / slope
        return float(np.clip(values[end] + step * 1.25, low, high)), False
    i = int(np.argmax(above))
    span = quantiles[i] - quantiles[i - 1]
    share = (measured - quantiles[i - 1]) / span if span > 0 else 0.5
    value = float(values[i - 1] + share * (values[i] - values[i - 1]))
    return value, bool(min(value - values[i - 1], values[i] - value) <= tolerance)


def interval_levels(confidence: float, n_groups: int) -> tuple[float, float]:
    """The quantile levels of the draws at which an interval's bounds are inverted: those of a t
    distribution with n_groups - 1 degrees of freedom, read on the normal scale. The draws combine
    n_groups influences, so the noise's variance they carry is estimated with n_groups - 1 degrees of
    freedom, which their quantiles alone would ignore (the reference of the CR2 correction: Bell &
    McCaffrey 2002); with 32 groups a 90 % interval is read at 4.5 % and 95.5 %, 3 % wider."""
    low = float(norm.cdf(student_t.ppf((1 - confidence) / 2, n_groups - 1)))
    return low, 1 - low


def basic_interval(measured: float, draws: np.ndarray, confidence: float) -> np.ndarray:
    """The basic bootstrap interval [2m - q_high, 2m - q_low] of draws around the fit."""
    low, high = defined_quantile(draws, [(1 - confidence) / 2, (1 + confidence) / 2])
    return np.array([2 * measured - high, 2 * measured - low])


def defined_quantile(draws: np.ndarray, level):
    """Quantiles of draws, leaving out the undefined ones (NaN: a radius spread whose radii all lie
    within noise); NaN when none is defined."""
    draws = draws[~np.isnan(draws)]
    return np.quantile(draws, level) if draws.size else np.full(np.shape(level), np.nan)


def weighted_cv(radii: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Coefficient of variation of radii (..., k) over classes weighted by `weights` (k,), summing to 1."""
    mean = radii @ weights
    spread = np.sqrt(np.maximum((radii - mean[..., None]) ** 2 @ weights, 0.0))
    return np.divide(spread, mean, out=np.full(mean.shape, np.nan), where=mean > 0)


def corrected_radii(points: np.ndarray, noise_variance: np.ndarray) -> np.ndarray:
    """Radii (..., k) of class points (..., k, r) with each class effect's noise variance (k,) taken
    from their squares."""
    return np.sqrt(np.maximum(np.einsum("...kr,...kr->...k", points, points) - noise_variance, 0.0))


def span_basis(bases: list[np.ndarray]) -> np.ndarray:
    """An orthonormal basis Y (d, q) of the span of every factor's basis."""
    return column_space(np.hstack(bases))
