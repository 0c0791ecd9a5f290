"""One layer's fit (a Dask task per layer): every factor's effects, rank and subspace, then what its
noise draws say of them (``inference``): structure, intervals and claims of each pair, spheres."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import numpy as np

from .blocks import Packer
from .design import (
    Counts,
    FactorEffects,
    JointSolution,
    Layout,
    NoiseTraces,
    SharedNoise,
    joint_effects,
    joint_fit,
    marginal_effects,
)
from .geometry import column_space, principal_angles
from .inference import (
    ANGLE_TOLERANCE,
    CLAIMS,
    CV_TOLERANCE,
    EXACT_DTYPES,
    GAP_QUANTILE,
    AngleFamilies,
    Complement,
    Drawn,
    FamilySearch,
    NoiseSpectrum,
    WhitenedDraws,
    add_one_share,
    basic_interval,
    cell_rounding_variance,
    corrected_radii,
    cosine_angles,
    cosines_against,
    defined_quantile,
    denoised,
    drawn_subspaces,
    interval_levels,
    noise_parts,
    noise_rank,
    rademacher,
    relevant_rank,
    rounding_bias,
    rounding_inflation,
    shrunk_variances,
    span_basis,
    structure_p,
    tail_p,
    turned,
    weighted_cv,
    whitened,
)

ESTIMATE_ROUNDS = 2
"""Rounds of the fixed point of the median-unbiased angles (``_median_unbiased``)."""


@dataclass(frozen=True)
class DrawSettings:
    """How the draws of every layer are made and read."""

    rank: int | None
    null: np.ndarray  # (n_null, groups) signs of the structure test
    draws: np.ndarray  # (n_bootstrap, groups) signs of the ranks, intervals and claims
    confidence: float
    significance: float
    rank_significance: float  # the level of each step of the rank's test
    relevance_floor: float  # the share of between-class variance a direction needs to count in the rank
    orthogonal_deg: float  # the boundary of "orthogonal": every angle above it
    dependent_deg: float  # the boundary of "dependent": the smallest angle below it
    radius_cv_tolerance: float
    rounding_groups: int = 0  # the last columns of `draws`: pseudo-groups that carry the rounding (``_with_rounding``)

    @property
    def n_groups(self) -> int:
        """The groups of tokens the draws resample (the intervals' reference counts these alone)."""
        return self.draws.shape[1] - self.rounding_groups


@dataclass
class FactorFit:
    """One factor at one layer."""

    singular: np.ndarray
    rank: int
    basis: np.ndarray  # (d, rank)
    between_fraction: float
    site_variance: float  # the summed squared distances of the factor's tokens from their mean
    structure_p: float = np.nan
    noise_singular: np.ndarray = field(default_factory=lambda: np.zeros(0))
    significance_rank: int | None = None  # directions standing above noise, before the relevance floor
    white_singular: np.ndarray | None = None  # (component,) singular values of the whitened effects
    signal_variance: np.ndarray | None = None  # (component,) squared singular values without their noise
    radii: np.ndarray | None = None  # (classes,) of the class points, noise taken out
    noise_variance: np.ndarray | None = None  # (classes,) of each class effect in the subspace
    radius_cv: float = np.nan
    radius_cv_estimate: float = np.nan
    radius_cv_ci: np.ndarray = field(default_factory=lambda: np.full(2, np.nan))
    sphere_null_p: float = np.nan  # "exactly on a sphere" (cv 0)
    sphere_p: np.ndarray = field(default_factory=lambda: np.full(2, np.nan))  # claims "on", "off"

    @property
    def variance_share(self) -> np.ndarray:
        """Each direction's share of the factor's between-class variance: its noise-free variance over
        that of the significant directions together (NaN without draws or significant directions)."""
        if self.signal_variance is None:
            return np.full(len(self.singular), np.nan)
        return shares_of(self.signal_variance, self.significance_rank)


def shares_of(variances: np.ndarray, significant: int | None) -> np.ndarray:
    """Each direction's noise-free variance over that of the `significant` leading ones together (NaN
    without significant directions)."""
    total = variances[:significant].sum() if significant else 0.0
    return variances / total if total > 0 else np.full(len(variances), np.nan)


@dataclass
class PairFit:
    """Two factors at one layer (a < b): their principal angles and, from the draws, their median-unbiased
    estimates, the intervals of the smallest and the largest, the claims' p-values and the cross term."""

    angles: np.ndarray
    estimate: np.ndarray | None = None  # the angles corrected for the noise's bias
    extremes_ci: np.ndarray = field(default_factory=lambda: np.full((2, 2), np.nan))  # (smallest/largest, bound)
    claim_p: np.ndarray = field(default_factory=lambda: np.full(len(CLAIMS), np.nan))
    cross_term: float = np.nan
    cross_term_ci: np.ndarray = field(default_factory=lambda: np.full(2, np.nan))
    cross_term_null_ci: np.ndarray = field(default_factory=lambda: np.full(2, np.nan))
    cross_term_p: float = np.nan


@dataclass
class LayerFit:
    """One layer: factors (by index), pairs ({(a, b): PairFit}, a < b), null angles ({(a, b): (median,
    interval)} for ordered pairs) and head angles ({(kind, a, head): angles})."""

    factors: list[FactorFit]
    outlier_tokens: int = 0  # analysed tokens of outlying norm (subspaces.OUTLIER_NORM)
    shared_noise: float = 0.0  # the share of a token's noise its resampling unit shares (design.SharedNoise)
    effective_groups: float = np.nan  # Kish's effective number of bootstrap groups at that share (Counts.effective_groups)
    whitened: bool = False  # the noise is anisotropic: structure and ranks judged whitened (inference.NoiseSpectrum)
    understatement: float = 1.0  # the noise's factor the whitened tests add back (inference.NoiseSpectrum.understatement)
    rounding_bias: float = np.nan  # the store's rounding of a class mean over its noise (inference.rounding_bias)
    rounding_inflation: float = np.nan  # the draws' variance factor that carries that rounding (inference.rounding_inflation)
    pairs: dict = field(default_factory=dict)
    null_angles: dict = field(default_factory=dict)
    head_angles: dict = field(default_factory=dict)

    @property
    def rank(self) -> list[int]:
        return [factor.rank for factor in self.factors]

    @property
    def basis(self) -> list[np.ndarray]:
        return [factor.basis for factor in self.factors]


@dataclass
class FactorView:
    """What the draws of one factor need: its effects, class counts, the mean of its tokens, its directions
    and which of its classes enter the radius statistics (``FactorClasses.sphere_classes``)."""

    effects: FactorEffects
    counts: np.ndarray
    mean: np.ndarray
    left: np.ndarray  # (k, p) left singular vectors of the weighted effects
    directions: np.ndarray  # (d, p) right singular vectors of the weighted effects
    radial: np.ndarray  # (k,) bool

    @property
    def weights(self) -> np.ndarray:
        return self.counts / self.counts.sum()

    @property
    def sphere_weights(self) -> np.ndarray:
        """The token weights of the classes in the radius statistics (all zero when none is)."""
        kept = np.where(self.radial, self.counts, 0.0)
        return kept / kept.sum() if kept.sum() > 0 else kept


def fit_layer(vector, *, packer: Packer, counts: Counts, layout: Layout, solution: JointSolution | None,
              traces: list[NoiseTraces] | None, shared: SharedNoise | None, settings: DrawSettings,
              heads: dict[str, np.ndarray], radial: list[np.ndarray], dtype: str | None = None) -> LayerFit | None:
    """Every factor's subspace at one layer and what its draws say (None when the layer holds NaN or
    Inf: the finite check then names them). traces: ``design.noise_traces`` of independent tokens (None
    without groups); shared: the layer's share of noise shared within units is estimated with it, and
    the influences and traces follow it (None: tokens independent); heads: the layer's read weights w_q
    and w_k (heads, d_model, d_head), whose column spaces the subspaces are compared with; radial: per
    factor, which classes enter the radius statistics; dtype: the store's, whose rounding is weighed
    against the noise."""
    parts = packer.unpack(vector)
    if parts["nonfinite"]:
        return None
    sums = parts["sums"]
    share, whitening, understated, bias, inflation, rounding, n_tokens = 0.0, None, 1.0, np.nan, np.nan, None, 0
    if solution is not None:
        theta, residuals = joint_fit(sums, counts, solution)
        covariance = spectrum = None
        if "gram" in parts:  # the tokens' covariance around the fit: whitening and the rounding's weight
            covariance, n_tokens = noise_covariance(parts["gram"], sums.sum(axis=0), theta, counts, layout)
            spectrum = NoiseSpectrum.of(covariance)
        judged_with = n_tokens  # the tokens the whitening is shrunk for
        if shared is not None:  # judged whitened where the tests are: a few huge dimensions do not set it
            share, judged_with = _shared_noise(shared, residuals, spectrum, n_tokens, counts.tokens_per_unit(layout))
        if spectrum is not None:
            whitening = spectrum.whitening(spectrum.shrunk(judged_with))
            understated = spectrum.understatement(judged_with, layout.n_columns)
        if covariance is not None:
            rounding = cell_rounding(covariance, sums, counts, layout, dtype)
            per_class = None if rounding is None else [cells.class_variance for cells in rounding]
            bias = rounding_bias(covariance, per_class)
            inflation = rounding_inflation(covariance, per_class, whitening)
        maps = solution.influence_maps
        if share > 0:
            maps, traces = shared.corrections(share)
        effects = joint_effects(theta, residuals, layout, counts, maps)
    else:
        effects = marginal_effects(sums, counts, layout)
    views = []
    for a, factor in enumerate(effects):
        block = layout.block(a)
        n = counts.factor_counts(layout, a)
        total = sums[:, block].sum(axis=(0, 1))
        left, _, right_t = np.linalg.svd(factor.weighted, full_matrices=False)
        views.append(FactorView(factor, n, total / n.sum(), left, right_t.T, radial[a]))
    fits = [_factor_fit(view, parts["squares"][layout.block(a)], layout.sizes[a], settings,
                        None if traces is None else traces[a], whitening, understated) for a, view in enumerate(views)]
    effective = counts.effective_groups(layout, share) if solution is not None else np.nan
    layer = LayerFit(fits, int(parts["outliers"]), share, effective, whitening is not None, understated, bias, inflation)
    pairs = [(a, b) for a in range(len(fits)) for b in range(a + 1, len(fits))]
    if len(settings.draws):
        drawn_views, drawn_settings = _with_rounding(views, settings, rounding)
        _infer(layer, drawn_views, counts, layout, pairs, drawn_settings, whitening, understated)
        if share > 0 and effective < MIN_EFFECTIVE_GROUPS:
            _withhold_claims(layer)
    spaces = {}  # each head's read subspace, where some factor has a subspace to compare it with
    if any(fit.rank for fit in fits):
        spaces = {kind: [column_space(matrix) for matrix in weights] for kind, weights in heads.items()}
    for a, fit in enumerate(fits):
        if fit.rank and fit.radii is None:
            _class_radii(views[a], fit)
        for kind, kind_spaces in spaces.items():
            for h, space in enumerate(kind_spaces):
                if fit.rank:
                    layer.head_angles[kind, a, h] = principal_angles(fit.basis, space)
    for a, b in pairs:
        if fits[a].rank and fits[b].rank and (a, b) not in layer.pairs:
            layer.pairs[a, b] = PairFit(principal_angles(fits[a].basis, fits[b].basis))
    return layer


@dataclass
class CellRounding:
    """One factor's classes as cells of labels, whose means the store rounds independently: the cells'
    rounding variances (cell, d) (``inference.cell_rounding_variance``), the class's tokens in each cell
    (class, cell), and the pair of factors whose cells they are (two factors of one pair share them)."""

    pair: tuple[int, int]
    members: np.ndarray
    variance: np.ndarray

    @property
    def class_variance(self) -> np.ndarray:
        """W (class, d): a class mean's rounding variance in count-weighted coordinates, sum_j n_j^2 b_j^2 / n_c."""
        return (self.members**2 @ self.variance) / np.maximum(self.members.sum(axis=1), 1)[:, None]

    def drawn(self, cell_noise: np.ndarray) -> np.ndarray:
        """(group, class, d) count-weighted class errors of (group, cell, d) unit noise per cell: sum_j n_j e_j / sqrt(n_c)."""
        errors = np.sqrt(self.variance) * cell_noise
        return (self.members @ errors) / np.sqrt(np.maximum(self.members.sum(axis=1), 1))[:, None]


def cell_rounding(covariance: np.ndarray, sums: np.ndarray, counts: Counts, layout: Layout,
                  dtype: str | None) -> list[CellRounding] | None:
    """Per factor, its classes' rounding as cells (``CellRounding``; none for a store that rounds nothing,
    None for a dtype without a known spacing). The tokens of one cell of labels share their values' place
    on the store's grid. A factor's cells are its classes with the factor that splits them finest (the tokens without that factor's label, and the other
    factor's without this one's, cells of their own; alone, its classes), their means the two classes'
    means less the tokens' mean (the fit's cells, additive)."""
    if str(dtype) in EXACT_DTYPES:
        return []
    totals = sums.sum(axis=0)
    n_tokens = max(np.diag(counts.gram)[: len(layout.patterns)].sum(), 1)
    grand = totals[: len(layout.patterns)].sum(axis=0) / n_tokens  # each token has one intercept cell
    sizes = [counts.factor_counts(layout, a).astype(float) for a in range(len(layout.names))]
    means = [totals[layout.block(a)] / np.maximum(n, 1)[:, None] for a, n in enumerate(sizes)]
    cells = {}
    rounding = []
    for a, n in enumerate(sizes):
        partners = [b for b in range(len(sizes)) if b != a]
        if not partners:
            variance = cell_rounding_variance(covariance, means[a], n, dtype)
            if variance is None:
                return None
            rounding.append(CellRounding((a, a), np.diag(n), variance))
            continue
        b = min(partners, key=lambda b: (counts.contingency(layout, a, b).astype(float) ** 2).sum())
        pair = (min(a, b), max(a, b))
        if pair not in cells:
            cells[pair] = _pair_cells(counts, layout, pair, sizes, means, grand, covariance, dtype)
        members, variance = cells[pair]
        if variance is None:
            return None
        rounding.append(CellRounding(pair, members[pair.index(a)], variance))
    return rounding


def _pair_cells(counts: Counts, layout: Layout, pair: tuple[int, int], sizes, means, grand, covariance, dtype):
    """The cells of a pair of factors: the (first class, second class) pairs with tokens, then each
    factor's tokens without the other's label; the (class, cell) tokens of each factor, and the cells'
    rounding variances."""
    a, b = pair
    table = counts.contingency(layout, a, b).astype(float)
    c, j = np.nonzero(table)
    rest_a, rest_b = sizes[a] - table.sum(axis=1), sizes[b] - table.sum(axis=0)
    only_a, only_b = np.nonzero(rest_a > 0)[0], np.nonzero(rest_b > 0)[0]
    n_cells = len(c) + len(only_a) + len(only_b)
    members_a, members_b = np.zeros((len(sizes[a]), n_cells)), np.zeros((len(sizes[b]), n_cells))
    members_a[c, np.arange(len(c))] = members_b[j, np.arange(len(c))] = table[c, j]
    members_a[only_a, len(c) + np.arange(len(only_a))] = rest_a[only_a]
    members_b[only_b, len(c) + len(only_a) + np.arange(len(only_b))] = rest_b[only_b]
    cell_means = np.concatenate([means[a][c] + means[b][j] - grand, means[a][only_a], means[b][only_b]])
    cell_counts = np.concatenate([table[c, j], rest_a[only_a], rest_b[only_b]])
    variance = cell_rounding_variance(covariance, cell_means, cell_counts, dtype)
    return (members_a, members_b), variance


MIN_EFFECTIVE_GROUPS = 10.0
"""Where noise is shared within units, below this effective number of bootstrap groups (``Counts.effective_groups``)
a layer's claims (relations, sphere verdicts) are withheld: over nine documents, or with one document holding
half the store, null labels clustered by document read "structure" in 50-95 % of layers and a planted sphere
"off" in most, although the share of shared noise was right. Sixteen equal documents (14 effective groups) hold
their rates. The intervals and estimates stay, as what the draws say. (With independent tokens a group's noise
averages its tokens, and few groups only coarsen the draws: ``units.warn_fewer_units_than_groups``.)"""


def _withhold_claims(layer: LayerFit) -> None:
    """The layer's claims left untested: its relations and sphere verdicts read "undetermined"."""
    for pair in layer.pairs.values():
        pair.claim_p = np.full(len(CLAIMS), np.nan)
    for fit in layer.factors:
        fit.sphere_p = np.full(2, np.nan)


SHARE_ROUNDS = 4
"""Rounds of the shared-noise share and the whitening that judges it (``_shared_noise``); they settle in two."""
SETTLED_DESIGN_EFFECT = 0.01
"""A whitening judged with a token count within this fraction of the next round's is kept: OAS's shrinkage
moves by as little."""


def _shared_noise(shared: SharedNoise, residuals: np.ndarray, spectrum: NoiseSpectrum | None, n_tokens: int,
                  unit_tokens: float) -> tuple[float, float]:
    """The share of each token's noise that its unit shares, judged whitened, and the token count its
    whitening is shrunk for (from the noise covariance's `spectrum`; none without one). Noise shared within
    units makes the tokens' covariance 1 + share^2 (m - 1) times noisier (m: the token-weighted mean tokens
    of a unit; the design effect on a second moment), so the whitening is shrunk as for that many times
    fewer tokens: a few units' shared vectors read as anisotropy otherwise, which the whitening then
    shrinks, and the share and every test's noise read low (over 16 documents a share of 0.5 read 0.28, and
    a label clustered by document read "structure" in 75 % of null layers). The residuals are read once
    along the spectrum's eigenvectors (``SharedNoise.readings``): every whitening of a round shares them."""
    readings = shared.readings(residuals, None if spectrum is None else spectrum.vectors)
    shrunk = None if spectrum is None else spectrum.shrunk(n_tokens)
    share = shared.share_of(readings, None if shrunk is None else 1 / shrunk)
    if shrunk is not None:  # from the larger of the two readings: the iteration keeps a low one it starts from
        share = max(share, shared.share_of(readings))
    judged_with = n_tokens  # the tokens `shrunk` was shrunk for
    for _ in range(SHARE_ROUNDS if spectrum is not None else 0):
        effective = n_tokens / (1 + share**2 * (unit_tokens - 1))
        if abs(effective / judged_with - 1) < SETTLED_DESIGN_EFFECT:
            break
        shrunk, judged_with = spectrum.shrunk(effective), effective
        again = shared.share_of(readings, None if shrunk is None else 1 / shrunk)
        if again == share:
            break
        share = again
    return share, judged_with


def noise_covariance(gram: np.ndarray, total: np.ndarray, theta: np.ndarray, counts: Counts,
                     layout: Layout) -> tuple[np.ndarray, int]:
    """The analysed tokens' covariance around the joint fit (d, d) and their number (each has one intercept
    cell), from their Gram matrix X'X, the sums per column Z'X and the fit's coefficients theta:
    (X'X - X'Z theta) / n. (The marginal estimator's factors have no common fit to take out: its tests
    are not whitened.)"""
    n_tokens = int(np.diag(counts.gram)[: len(layout.patterns)].sum())
    return (gram - total.T @ theta) / max(n_tokens, 1), n_tokens


def _factor_fit(view: FactorView, squares: np.ndarray, n_classes: int, settings: DrawSettings,
                traces: NoiseTraces | None, whitening: np.ndarray | None, understated: float) -> FactorFit:
    """Singular values, between-class fraction and structure test of one factor (judged in coordinates
    whitened by the noise covariance where it is anisotropic); its rank when fixed."""
    weighted = view.effects.weighted
    singular = np.linalg.svd(weighted, compute_uv=False)[: min(n_classes - 1, min(weighted.shape))]
    spread = squares.sum() - view.counts.sum() * view.mean @ view.mean
    rank = min(settings.rank, len(singular)) if settings.rank is not None else 0
    fit = FactorFit(singular, rank, view.directions[:, :rank],
                    float((singular**2).sum() / spread) if spread > 0 else np.nan, float(spread))
    if len(settings.null):
        fit.structure_p = structure_p(whitened(view.effects, whitening), settings.null, traces, understated)
    return fit


ROUNDING_GROUPS = 64
"""Pseudo-groups that carry the class means' rounding into the draws (``_with_rounding``)."""


def _with_rounding(views: list[FactorView], settings: DrawSettings, rounding: list[CellRounding] | None):
    """The views and draw settings with the class means' rounding as ROUNDING_GROUPS more groups of
    influences: group g holds a unit normal error per cell and coordinate, scaled by its rounding's spread,
    as each factor's classes average them over their cells (``CellRounding.drawn``: two factors of one pair
    share the errors), divided by sqrt(G); its random signs give each draw class errors of about the
    rounding's covariance; their randomness follows the draws' signs (so the analysis's seed). Unchanged where
    nothing is rounded."""
    if rounding is None or not any(np.any(r.variance > 0) for r in rounding):
        return views, settings
    rng = np.random.default_rng(np.packbits(settings.draws > 0))
    signs = rademacher(rng, len(settings.draws), ROUNDING_GROUPS)
    noise = {}
    rounded = []
    for view, cells in zip(views, rounding):
        if cells.pair not in noise:
            noise[cells.pair] = rng.normal(size=(ROUNDING_GROUPS, *cells.variance.shape)) / np.sqrt(ROUNDING_GROUPS)
        influence = np.concatenate([view.effects.influence, cells.drawn(noise[cells.pair])])
        rounded.append(replace(view, effects=replace(view.effects, influence=influence)))
    return rounded, replace(settings, draws=np.hstack([settings.draws, signs]), rounding_groups=ROUNDING_GROUPS)


def _infer(layer: LayerFit, views: list[FactorView], counts: Counts, layout: Layout, pairs, settings: DrawSettings,
           whitening: np.ndarray | None, understated: float) -> None:
    """Ranks, then intervals, claims and spheres, from one set of noise draws. Where the noise is
    anisotropic (`whitening` P), ranks are judged and subspaces estimated in whitened coordinates and
    mapped back (``_whitened_bases``); the draws estimate theirs the same way, so that the intervals
    and claims are those of the estimator the fit used."""
    widths = [view.directions.shape[1] for view in views]
    columns = np.hstack([view.directions for view in views] + [view.mean[:, None] for view in views])
    noise = noise_parts([view.effects for view in views], settings.draws, columns, pairs)
    starts = np.concatenate([[0], np.cumsum(widths)])
    white = [whitened(view.effects, whitening) for view in views]
    white_noise, white_starts = noise, starts  # the draws above, unless the noise is whitened
    if whitening is not None:
        svds = [np.linalg.svd(factor.weighted, full_matrices=False) for factor in white]
        white_noise = noise_parts(white, settings.draws, np.hstack([right.T for _, _, right in svds]), [])
        white_starts = np.concatenate([[0], np.cumsum([len(right) for _, _, right in svds])])
    white_along = [white_noise.along[a][..., white_starts[a]: white_starts[a + 1]] for a in range(len(views))]
    for a, (fit, view) in enumerate(zip(layer.factors, views)):
        n = len(fit.singular)
        gram, along = white_noise.gram[a], white_along[a]
        if understated != 1.0:  # the rank is judged against the noise the whitened effects hold
            gram, along = gram * understated, along * np.sqrt(understated)
        significance = noise_rank(white[a].weighted, gram, along, settings.rank_significance, n)
        judged = None  # the shares the relevance floor reads: those of the coordinates the rank is judged in
        fit.white_singular = fit.singular
        if whitening is not None:
            left, singular, _ = svds[a]
            fit.white_singular = singular[:n]
            judged = shares_of(shrunk_variances(left[:, :n], singular[:n], gram, along[..., :n]), significance[0])
        _rank(fit, view, significance, noise.gram[a], noise.along[a][..., starts[a]: starts[a + 1]], settings, judged)
    structured = [a for a, fit in enumerate(layer.factors) if fit.rank]
    if not structured:
        return
    if whitening is not None:
        _whitened_bases([layer.factors[a] for a in structured], [svds[a][2] for a in structured], whitening)
    for a in structured:
        _class_radii(views[a], layer.factors[a])
    span = span_basis([layer.factors[a].basis for a in structured])
    kept = [widths[a] if whitening is not None else layer.factors[a].rank for a in structured]  # columns spanning Y
    selected = np.concatenate([np.arange(starts[a], starts[a] + n) for a, n in zip(structured, kept)])
    to_span = np.linalg.lstsq(columns[:, selected], span, rcond=None)[0]
    in_span = {a: noise.along[a][..., selected] @ to_span for a in structured}
    mean_noise = {a: noise.along[a][..., starts[-1] + a] for a in structured}
    truths = {a: denoised(views[a].effects.weighted, layer.factors[a].basis, noise.gram[a],
                          noise.along[a][..., starts[a]: starts[a + 1]] @ (views[a].directions.T @ layer.factors[a].basis))
              for a in structured}
    draws_of = dict.fromkeys(structured)
    if whitening is not None:
        white_span = whitening @ span
        draws_of = {a: WhitenedDraws(white_noise.gram[a], np.tensordot(settings.draws, np.tensordot(
            white[a].influence, white_span, axes=(2, 0)), axes=(1, 0)), white_span.T @ white_span) for a in structured}
    sources = {a: _Source(views[a], layer.factors[a], truths[a], span, noise.gram[a], in_span[a], mean_noise[a], draws_of[a])
               for a in structured}
    for a in structured:
        _spheres(sources[a], settings)
        for b in range(len(views)):
            if b != a and layer.factors[b].rank:
                layer.null_angles[a, b] = _null_angles(sources[a], layer.factors[b].basis, span, settings)
    for a, b in pairs:
        if a in sources and b in sources:
            contingency = counts.contingency(layout, a, b)
            layer.pairs[a, b] = _pair(sources[a], sources[b], noise.cross[a, b], contingency, settings)


def _rank(fit: FactorFit, view: FactorView, significance: tuple[int, np.ndarray], gram: np.ndarray, along: np.ndarray,
          settings: DrawSettings, judged: np.ndarray | None) -> None:
    """The significance rank with its noise thresholds (``noise_rank`` of the whitened effects), each
    direction's variance without its noise, and the rank: the fixed one, or the leading significant
    directions that reach the relevance floor (in `judged`, the whitened directions' shares where the rank
    is judged whitened; else in variance_share). gram: the draws' N N' (draws, k, k); along: N V (draws,
    k, p), in the original coordinates."""
    n = len(fit.singular)
    fit.significance_rank, fit.noise_singular = significance
    fit.signal_variance = shrunk_variances(view.left[:, :n], fit.singular, gram, along[..., :n])
    if settings.rank is None:
        shares = fit.variance_share if judged is None else judged
        relevant = relevant_rank(shares[: fit.significance_rank], settings.relevance_floor)
        fit.rank = min(fit.significance_rank, relevant)
        fit.basis = view.directions[:, : fit.rank]


def _whitened_bases(fits: list[FactorFit], right_ts: list[np.ndarray], whitening: np.ndarray) -> None:
    """In a whitened layer, each factor's basis is its subspace estimated in whitened coordinates, mapped
    back and orthonormalised: the whitened effects' row space is P U for a true basis U (P the whitening),
    and a few dimensions of huge noise (massive activations, sink tokens) no longer decide which
    directions lead. right_ts: the whitened effects' right singular vectors (components, d)."""
    for fit, right_t in zip(fits, right_ts):
        fit.basis = np.linalg.qr(np.linalg.solve(whitening, right_t[: fit.rank].T))[0]


@dataclass
class _Source:
    """One structured factor's fit and draws, in the span Y of the layer's bases."""

    view: FactorView
    fit: FactorFit
    truth: np.ndarray  # (k, d) denoised weighted effects
    span: np.ndarray  # Y (d, q)
    gram: np.ndarray  # (draws, k, k)
    noise: np.ndarray  # N Y (draws, k, q)
    mean_noise: np.ndarray  # N mean (draws, k)
    whitened: WhitenedDraws | None  # in a whitened layer: what the whitened estimate's draws need

    def drawn(self, truth: np.ndarray) -> Drawn:
        """The draws around a truth given by its coordinates (k, q) in the span Y."""
        return drawn_subspaces(truth, self.gram, self.noise, self.fit.rank, self.complement, self.whitened)

    @functools.cached_property
    def at_truth(self) -> Drawn:
        """The draws around the factor's own truth (shared by every pair in which it does not turn)."""
        return self.drawn(self.truth_y)

    @functools.cached_property
    def noise_only(self) -> Drawn:
        """The draws around no truth at all (shared by the null angles against every other factor)."""
        return self.drawn(np.zeros_like(self.truth_y))

    @functools.cached_property
    def truth_y(self) -> np.ndarray:
        return self.truth @ self.span

    @functools.cached_property
    def basis_y(self) -> np.ndarray:
        return self.span.T @ self.fit.basis

    @property
    def draw_cost(self) -> float:
        """What one set of draws costs, relatively: an eigen-decomposition of (k x k) matrices, or a
        Cholesky factor, about four times cheaper, when the factor keeps every direction."""
        return len(self.view.counts) ** 3 * (0.25 if self.complement is not None else 1.0)

    @functools.cached_property
    def complement(self) -> Complement | None:
        """When the factor keeps all k - 1 directions of its centred effects, what its draws need to go
        without an eigen-decomposition (``inference.drawn_subspaces``)."""
        if self.fit.rank != len(self.view.counts) - 1:
            return None
        return Complement.of(self.view.counts, self.gram, self.noise)

    def points(self, effects: np.ndarray, basis: np.ndarray) -> np.ndarray:
        """Class points U'(mean + E[c]) (k, r) of weighted effects in an orthonormal basis."""
        return (self.view.mean + effects / np.sqrt(self.view.counts)[:, None]) @ basis

    def drawn_points(self, drawn: Drawn, mean: np.ndarray) -> np.ndarray:
        """(draws, k, r) class points of draws around a truth whose class points have mean `mean` (d)."""
        coordinates = drawn.coordinates / np.sqrt(self.view.counts)[None, :, None]
        shift = mean - self.view.mean
        offset = drawn.along(self.span.T @ mean, self.mean_noise + self.noise @ (self.span.T @ shift))
        return coordinates + offset[:, None, :]


def _null_angles(source: _Source, other_basis: np.ndarray, span: np.ndarray, settings: DrawSettings):
    """Median and central 1 - significance interval of the angles between the factor's noise-only
    subspaces (its rank) and the other factor's fitted one: what chance gives."""
    coordinates = span.T @ other_basis
    cosines = np.swapaxes(source.noise_only.scaled, -1, -2) @ (source.noise @ coordinates)
    angles = cosine_angles(cosines)
    tails = [settings.significance / 2, 1 - settings.significance / 2]
    return np.median(angles, axis=0), np.moveaxis(np.quantile(angles, tails, axis=0), 0, -1)


def _pair(first: _Source, second: _Source, cross: np.ndarray, contingency: np.ndarray, settings: DrawSettings) -> PairFit:
    """Angles of a pair with their estimates, the intervals of the smallest and largest, the claims'
    p-values and the cross term, from draws around truths turned to other angles (``inference``).
    Only one factor of the pair turns (the one whose draws cost less): the other's draws around its
    truth serve every truth of the pair."""
    pair = PairFit(principal_angles(first.fit.basis, second.fit.basis))
    m = len(pair.angles)
    low, high = interval_levels(settings.confidence, settings.n_groups)
    moving, fixed = (first, second) if first.draw_cost <= second.draw_cost else (second, first)
    against_fixed = cosines_against(fixed.at_truth, moving.noise, cross if fixed is first else np.swapaxes(cross, -1, -2))
    drawn_angles = {}

    def draw(target):
        """(draws, Drawn first, Drawn second, cosines) around the truths turned to `target` (None: the fitted
        truths, whose angles are the measured ones)."""
        drawn_moving = moving.at_truth if target is None else moving.drawn(turned(moving.truth_y, moving.basis_y, fixed.basis_y, target))
        cosines = against_fixed(drawn_moving)
        if fixed is first:
            return cosine_angles(cosines), fixed.at_truth, drawn_moving, cosines
        return cosine_angles(cosines), drawn_moving, fixed.at_truth, np.swapaxes(cosines, -1, -2)

    def angles_at(target):
        key = tuple(np.round(target, 6))
        if key not in drawn_angles:
            drawn_angles[key] = draw(target)[0]
        return drawn_angles[key]

    fitted = draw(None)
    drawn_angles[tuple(np.round(pair.angles, 6))] = fitted_angles = fitted[0]
    families = AngleFamilies(_bias_corrected(pair.angles, pair.angles, fitted_angles))

    def statistic(family, value):
        angles = angles_at(families.truth(family, value))
        return angles[:, -1:] - angles[:, :1] if family == "spread" else angles

    search = FamilySearch(statistic, 0.0, 90.0, ANGLE_TOLERANCE)
    edges = {family: (search.at(family, settings.orthogonal_deg)[:, 0], search.at(family, settings.dependent_deg)[:, 0])
             for family in ("smallest", "equal")}  # the claims' boundaries, drawn first
    if m > 1:
        spread = families.estimate[-1] - families.estimate[0]
        measured = pair.angles[-1] - pair.angles[0]
        families = replace(families, gap=search.crossing("spread", 0, GAP_QUANTILE, measured, spread))
    for index, (lower, upper) in enumerate((("from-smallest", "equal"), ("equal", "from-largest"))):
        column = -index
        angle = pair.angles[column]
        guess_low, guess_high = basic_interval(angle, fitted_angles[:, column], settings.confidence)
        pair.extremes_ci[index] = [search.crossing(lower, column, high, angle, guess_low),
                                   search.crossing(upper, column, low, angle, guess_high)]
    if _unbracketed(pair, settings):
        pair.extremes_ci[:] = np.nan
    else:
        pair.estimate = _median_unbiased(pair.angles, families.estimate, angles_at, pair.extremes_ci)
        first_angle = pair.angles[0]
        pair.claim_p = np.array([
            tail_p(edges["smallest"][0], first_angle, upper=True),
            tail_p(edges["equal"][1], first_angle, upper=False),
            max(tail_p(edges["equal"][0], first_angle, upper=False), tail_p(edges["smallest"][1], first_angle, upper=True)),
        ])
    _pair_cross_terms(pair, first, second, fitted[1:], draw(np.full(m, 90.0))[1:], contingency, settings)
    return pair


def _unbracketed(pair: PairFit, settings: DrawSettings) -> bool:
    """Whether the draws failed to bracket the measurement: the smallest angle's interval pinned at 90
    degrees although the measured smallest angle lies below the orthogonal boundary, or the largest's
    pinned at 0 although the measured largest lies above the dependent one. The draws around every truth
    of the family then lie beyond what was measured (seen where a factor keeping all its directions meets
    one estimated whitened from few tokens, its own estimate's tilt drawn again around it): no truth
    explains the data, and the pair gets no interval, estimate or claim (relation "undetermined")."""
    smallest, largest = pair.extremes_ci
    return bool((np.all(smallest == 90.0) and pair.angles[0] < settings.orthogonal_deg)
                or (np.all(largest == 0.0) and pair.angles[-1] > settings.dependent_deg))


def _bias_corrected(angles: np.ndarray, truth: np.ndarray, drawn: np.ndarray) -> np.ndarray:
    """One round of the median-unbiased correction: the truth moved by the measured angles less the
    median of the angles drawn around it (ascending, within [0, 90])."""
    return np.sort(np.clip(truth + angles - np.median(drawn, axis=0), 0.0, 90.0))


def _median_unbiased(angles: np.ndarray, first_round: np.ndarray, angles_at, extremes_ci: np.ndarray) -> np.ndarray:
    """The principal angles whose draws' medians are the measured ones: the fixed point of
    c <- c + (measured - median of the angles drawn at c) from c = measured, whose first round is
    `first_round` (ESTIMATE_ROUNDS rounds, each kept ascending, within [0, 90] and its extremes inside
    their intervals ``extremes_ci``, so that the next round draws around a truth the data allow)."""
    estimate = _within(first_round, extremes_ci)
    for _ in range(ESTIMATE_ROUNDS - 1):
        estimate = _within(_bias_corrected(angles, estimate, angles_at(estimate)), extremes_ci)
    return estimate


def _within(estimate: np.ndarray, extremes_ci: np.ndarray) -> np.ndarray:
    """The ascending estimate with its smallest and largest angles kept inside their intervals (and
    the others between them): where the noise's pull is large (high ranks, weak directions) an
    uncorrected round would overshoot or fall short of what Neyman's construction brackets."""
    estimate = estimate.copy()
    estimate[0] = np.clip(estimate[0], *extremes_ci[0])
    estimate[-1] = max(np.clip(estimate[-1], *extremes_ci[1]), estimate[0])
    return np.clip(estimate, estimate[0], estimate[-1])


def _pair_cross_terms(pair: PairFit, first: _Source, second: _Source, fitted: tuple, orthogonal: tuple,
                      contingency: np.ndarray, settings: DrawSettings) -> None:
    """The pair's cross term, its basic bootstrap interval (the draws around the fit, `fitted`) and its
    null (the draws around the truths turned orthogonal); each draws' (Drawn a, Drawn b, cosines)."""
    basis_a, basis_b = first.fit.basis, second.fit.basis
    fitted_points = [source.points(source.view.effects.weighted, source.fit.basis) for source in (first, second)]
    pair.cross_term = float(_cross_term(fitted_points[0][None], fitted_points[1][None], (basis_a.T @ basis_b)[None],
                                        contingency)[0])
    drawn = {}
    for name, (drawn_a, drawn_b, cosines) in (("fitted", fitted), ("orthogonal", orthogonal)):
        drawn[name] = _cross_term(first.drawn_points(drawn_a, first.view.mean),
                                  second.drawn_points(drawn_b, second.view.mean), cosines, contingency)
    pair.cross_term_ci = basic_interval(pair.cross_term, drawn["fitted"], settings.confidence)
    pair.cross_term_null_ci = np.quantile(drawn["orthogonal"], [settings.significance / 2, 1 - settings.significance / 2])
    pair.cross_term_p = add_one_share(drawn["orthogonal"] >= pair.cross_term)


def _cross_term(points_a: np.ndarray, points_b: np.ndarray, cosines: np.ndarray, contingency: np.ndarray) -> np.ndarray:
    """(draws,) the RMS cosine between the two components over the tokens both factors read, each token
    weighted by |x_a|^2 |x_b|^2: sqrt(mean (x_a . x_b)^2 / mean |x_a|^2 |x_b|^2) (contingency: tokens per
    pair of classes). Within [0, 1] (Cauchy-Schwarz, token by token), 0 for orthogonal subspaces, the
    cosine itself when every token's is the same; from class points (draws, k, r) and the cosines between
    the two bases (draws, r_a, r_b)."""
    if contingency.sum() == 0:
        return np.full(len(points_a), np.nan)
    products = (points_a @ cosines) @ np.swapaxes(points_b, -1, -2)
    square_a = np.einsum("nkr,nkr->nk", points_a, points_a)
    square_b = np.einsum("nkr,nkr->nk", points_b, points_b)
    norms = np.einsum("nk,nl,kl->n", square_a, square_b, contingency)
    return np.sqrt(np.einsum("nkl,kl->n", products**2, contingency) / np.maximum(norms, np.finfo(float).tiny))


def _class_radii(view: FactorView, fit: FactorFit) -> None:
    """The norms of the factor's class points U'(mean + E[c]), each class effect's noise variance in the
    subspace (from its influences) taken from their squares, and their spread."""
    along = view.effects.influence @ fit.basis  # (groups, k, r), weighted
    variance = np.einsum("gkr,gkr->k", along, along) / view.counts
    points = (view.mean + view.effects.weighted / np.sqrt(view.counts)[:, None]) @ fit.basis
    fit.radii = corrected_radii(points, variance)
    fit.radius_cv = float(weighted_cv(fit.radii, view.sphere_weights))
    fit.noise_variance = variance


def _spheres(source: _Source, settings: DrawSettings) -> None:
    """The radius spread of the factor's class points: estimate, interval, claims, null."""
    fit, view = source.fit, source.view
    variance = fit.noise_variance
    points = source.points(source.truth, fit.basis)
    radii = np.linalg.norm(points, axis=1)
    weights = view.sphere_weights
    spread = float(weighted_cv(radii, weights))
    if not (spread > 0 and np.isfinite(fit.radius_cv)):  # no spread, or every corrected radius within noise
        return
    mean_radius = radii @ weights
    directions = points / np.maximum(radii, np.finfo(float).tiny)[:, None]

    def spreads(drawn, mean):
        return weighted_cv(corrected_radii(source.drawn_points(drawn, mean), variance), weights)

    def draw(family, value):
        """Radius spreads of draws around the truth whose radii are spread to a spread of `value` (the
        classes outside the radius statistics, such as a pooled one, stay where they are)."""
        scaled = directions * (mean_radius + value / spread * (radii - mean_radius))[:, None]
        moved = np.where(view.radial[:, None], scaled, points)
        centre = view.weights @ moved
        mean = view.mean + fit.basis @ (centre - view.mean @ fit.basis)
        return spreads(source.drawn(np.sqrt(view.counts)[:, None] * ((moved - centre) @ source.basis_y.T)), mean)

    search = FamilySearch(draw, 0.0, max(4 * fit.radius_cv, 4 * spread, 4 * settings.radius_cv_tolerance), CV_TOLERANCE)
    search.given("spread", spread, spreads(source.at_truth, view.mean))  # at its own spread the truth is the fitted one
    fitted = search.at("spread", spread)
    guess_low, guess_high = basic_interval(fit.radius_cv, fitted, settings.confidence)
    low, high = interval_levels(settings.confidence, settings.n_groups)
    fit.radius_cv_ci = np.array([search.crossing("spread", None, high, fit.radius_cv, guess_low),
                                 search.crossing("spread", None, low, fit.radius_cv, guess_high)])
    fit.radius_cv_estimate = max(2 * fit.radius_cv - float(defined_quantile(fitted, 0.5)), 0.0)  # less the draws' median bias
    at_tolerance = search.at("spread", settings.radius_cv_tolerance)
    fit.sphere_p = np.array([tail_p(at_tolerance, fit.radius_cv, upper=False), tail_p(at_tolerance, fit.radius_cv, upper=True)])
    fit.sphere_null_p = tail_p(search.at("spread", 0.0), fit.radius_cv, upper=True)
