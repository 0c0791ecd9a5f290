"""Factor subspaces: where each factor (a label, or the position) lives in the residual stream,
how its subspace sits against the others' and against each head's read subspace, judged against
what chance gives.

``FactorSubspaces`` (scikit-learn style: parameters, ``fit(dataset)``, fitted attributes ending in
``_``) fits every chosen factor at every chosen layer in one streamed pass over the activations
(after two cheap passes over the labels), from the sufficient statistics of ``design.py``:
per-(group, class) sums of the vectors and the class co-occurrence counts. With
``estimator="joint"`` (the default) all factors are fitted together, so correlated labels do not
leak into each other's subspace; ``"marginal"`` takes each factor's own class means. A factor's
subspace is spanned by the leading right singular vectors of its count-weighted centred effects;
its rank is ``rank`` or the fewest directions holding ``rank_threshold`` of their variance.

Factors with many classes (token identity over a real vocabulary) keep their ``max_classes - 1``
most frequent classes and pool the rest into one class; the position is cut into ``max_classes``
contiguous ranges instead (``factors.cap_classes``): the streamed sums and every bootstrap or null
draw then cost the same whatever the vocabulary or context.

Uncertainty and chance, both from ``bootstrap_groups`` seeded groups of samples (so tokens of
one sequence, which are not independent, stay together):

- **bootstrap** (``n_bootstrap``): groups resampled with replacement, each replicate's effects
  taken to first order (the fit's influence of each group), giving ``confidence`` intervals of
  the principal angles between factors;
- **null** (``n_null``): the effects a factor would show if its labels carried no information,
  drawn by flipping the signs of the groups' residual sums (a wild cluster bootstrap, the
  label-permutation null of a linear fit without re-reading the data). It gives each factor's
  ``structure_p`` (the share of null draws whose effects hold as much variance as the measured
  ones) and the **null angles**: principal angles between a factor's null subspace (same rank)
  and the other factor's fitted subspace, reported beside the measured ones.

A pair's relation is judged by two nulls of the pair, each drawn like the null above (the groups'
influences with random signs, shared by both factors) around the two fitted effects turned, by
rotations in the planes of their principal vectors, to the null's boundary: **orthogonality**
(every principal angle at least 90 - ``orthogonality_deg``) and **dependence** (the smallest angle
at most ``independence_deg``: the subspaces share a direction). Each gives the share of draws whose
smallest angle lies as far from the null as the measured one (``orthogonal_p``, ``dependent_p``).
At ``significance``: "orthogonal" when only dependence is rejected, "dependent" when only
orthogonality is, "independent" when both are, "undetermined" when neither is (the data cannot
tell); "no structure" when either factor's structure_p exceeds ``significance`` (its angles would
be those of noise); empty without null draws. The bootstrap interval is reported beside.
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from functools import partial

import dask
import numpy as np
import xarray as xr
from scipy import sparse
from scipy.stats import entropy
from sklearn.metrics import mutual_info_score

from .blocks import Packer, sample_block_sums, tree_sum
from .design import (
    Counts,
    FactorEffects,
    JointSolution,
    Layout,
    check_shared_tokens,
    count_block,
    joint_effects,
    marginal_effects,
    solve_joint,
)
from .errors import AnalysisError
from .factors import FactorClasses, design_columns, discover_classes, parse_factors
from .geometry import choose_rank, column_space, leading_subspaces, principal_angles
from .inputs import (
    D_MODEL_SITES,
    SITES,
    FiniteCheck,
    check_layers,
    layer_data,
    require_site,
    sample_values,
    square_norms,
    store_url,
    token_mask,
)
from .options import as_attrs, check_options
from .plan import Plan, run_plans

log = logging.getLogger("orthosphere.analyze")

BOUNDS = ("low", "high")
CONDITION_WARNING = 100.0
"""A joint fit whose condition number (of the unit-diagonal Z'Z) exceeds this is logged as a warning."""
DRAW_BATCH = 32
"""Bootstrap and null draws are computed this many at a time (their effects: batch x classes x d)."""
TRUTH_ITERATIONS = 4
"""Rounds of matching the singular values of a pair null's truth to the fit's (see ``denoised``)."""
FIT_OPTIONS = ("site", "factors", "layers", "exclude_start", "estimator", "rank_threshold", "rank", "max_classes")
"""The parameters that fix the bases (the spheres reuse fitted subspaces only when these agree)."""


def bootstrap_group(samples: np.ndarray, seed: int, n_groups: int) -> np.ndarray:
    """A seeded hash (splitmix64) of each sample index into one of n_groups groups."""
    z = (np.uint64(seed) << np.uint64(32)) ^ np.asarray(samples).astype(np.uint64)
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z % np.uint64(n_groups)).astype("int64")


def d_model_site(dataset: xr.Dataset, site: str, purpose: str) -> xr.DataArray:
    """A residual-stream site (sample, layer, pos, d_model) of the store."""
    if site not in D_MODEL_SITES and site in SITES:
        raise AnalysisError(f"{purpose} reads a residual-stream site, one of {list(D_MODEL_SITES)}; got {site!r}")
    return require_site(dataset, site, purpose)


# ---------------------------------------------------------------------------------------------
# The streamed pass: per block of samples, sums of the vectors and squared norms per (group, column).


def _design_sums(x, groups, columns, *, packer: Packer, n_columns: int, n_groups: int):
    """Sums of the token vectors per (group, design column), of their squared norms per column, and
    the count of non-finite ones. A (group, class) cell of one block sums few tokens, so float32
    sums lose nothing that matters; blocks are then accumulated in float64."""
    squares = square_norms(x).ravel()
    vectors = x.reshape(-1, x.shape[-1])
    columns = columns.reshape(len(vectors), -1)
    token_group = np.repeat(groups, x.shape[1])
    rows, which = np.nonzero(columns >= 0)
    index = token_group[rows] * n_columns + columns[rows, which]
    onehot = sparse.csr_matrix((np.ones(rows.size, dtype=vectors.dtype), (index, rows)),
                               shape=(n_groups * n_columns, len(vectors)))
    column_squares = np.bincount(columns[rows, which], weights=squares[rows].astype("float64"), minlength=n_columns)
    return packer.pack({"nonfinite": np.count_nonzero(~np.isfinite(squares)), "sums": onehot @ vectors,
                        "squares": column_squares})


# ---------------------------------------------------------------------------------------------
# One layer's fit: effects, subspaces, draws and angles (a Dask task per layer).


@dataclass(frozen=True)
class DrawSettings:
    """How the bootstrap and null draws of every layer are made and read."""

    rank_threshold: float
    rank: int | None
    bootstrap: np.ndarray  # (n_bootstrap, groups) coefficients: resampling weights less one
    null: np.ndarray  # (n_null, groups) random signs
    confidence: float
    significance: float
    orthogonal_deg: float  # the null of orthogonality: every principal angle at least this
    dependent_deg: float  # the null of dependence: the smallest principal angle at most this


@dataclass
class LayerFit:
    """One layer's factor subspaces and angles (lists by factor; dicts by (factor, other) or (factor, head))."""

    singular: list[np.ndarray]
    rank: list[int]
    basis: list[np.ndarray]
    between_fraction: list[float]
    structure_p: list[float]
    angles: dict = field(default_factory=dict)
    angles_ci: dict = field(default_factory=dict)
    null_angles: dict = field(default_factory=dict)
    null_angles_ci: dict = field(default_factory=dict)
    orthogonal_p: dict = field(default_factory=dict)
    dependent_p: dict = field(default_factory=dict)
    head_angles: dict = field(default_factory=dict)


def _draws(effects: FactorEffects, coefficients: np.ndarray, rank: int, with_effects: bool):
    """Leading subspaces (draws, d, rank) and total variances (draws,) of drawn effects: the groups'
    influences weighted by the coefficients, added to the fitted effects (bootstrap) or alone (null).
    In float32: a draw's subspace needs no more precision than its sampling spread allows."""
    influence = effects.influence32
    bases, totals = [], []
    for start in range(0, len(coefficients), DRAW_BATCH):
        drawn = np.tensordot(coefficients[start: start + DRAW_BATCH].astype("float32"), influence, axes=(1, 0))
        if with_effects:
            drawn += effects.weighted.astype("float32")
        totals.append(np.einsum("nkd,nkd->n", drawn, drawn, dtype="float64"))
        bases.append(leading_subspaces(drawn, rank))
    return np.concatenate(bases), np.concatenate(totals)


def fit_layer(vector, *, packer: Packer, counts: Counts, layout: Layout, solution: JointSolution | None,
              settings: DrawSettings, heads: dict[str, list[np.ndarray]]) -> LayerFit | None:
    """Every factor's subspace at one layer, its bootstrap and null draws, and the angles (None when
    the layer holds NaN or Inf: the finite check then names them)."""
    parts = packer.unpack(vector)
    if parts["nonfinite"]:
        return None
    sums = parts["sums"]
    effects = (joint_effects(sums, counts, layout, solution) if solution is not None
               else marginal_effects(sums, counts, layout))
    fit = LayerFit([], [], [], [], [])
    for a, factor in enumerate(effects):
        block = layout.block(a)
        total = sums[:, block].sum(axis=(0, 1))
        spread = parts["squares"][block].sum() - total @ total / counts.factor_counts(layout, a).sum()
        singular, rank, basis = _subspace(factor, layout.sizes[a], settings)
        fit.singular.append(singular)
        fit.rank.append(rank)
        fit.basis.append(basis)
        fit.between_fraction.append(float((singular**2).sum() / spread) if spread > 0 else np.nan)
        fit.structure_p.append(np.nan)
    replicates = [_draws(factor, settings.bootstrap, rank, True)[0] if len(settings.bootstrap) and rank else None
                  for factor, rank in zip(effects, fit.rank)]
    for a, factor in enumerate(effects):
        null_bases = None
        if len(settings.null):
            null_bases, null_totals = _draws(factor, settings.null, max(fit.rank[a], 1), False)
            measured = (fit.singular[a] ** 2).sum()
            fit.structure_p[a] = float((1 + np.count_nonzero(null_totals >= measured)) / (1 + len(null_totals)))
        for b in range(len(effects)):
            if b != a and fit.rank[a] and fit.rank[b]:
                _pair_angles(fit, a, b, replicates, null_bases, settings)
                if b < a and len(settings.null):
                    _pair_tests(fit, effects, a, b, settings)
        for kind, spaces in heads.items():
            for h, space in enumerate(spaces):
                if fit.rank[a]:
                    fit.head_angles[kind, a, h] = principal_angles(fit.basis[a], space)
    return fit


def _subspace(factor: FactorEffects, n_classes: int, settings: DrawSettings):
    """Singular values (at most classes - 1), chosen rank and orthonormal basis (d, rank) of a factor."""
    singular, directions = np.linalg.svd(factor.weighted, full_matrices=False)[1:]
    singular = singular[: min(n_classes - 1, len(singular))]
    rank = choose_rank(singular, n_classes, settings.rank_threshold, settings.rank)
    return singular, rank, directions[:rank].T


def _pair_angles(fit: LayerFit, a: int, b: int, replicates: list, null_bases, settings: DrawSettings) -> None:
    """The angles of factor a with factor b, their bootstrap interval, and those of a's null draws."""
    fit.angles[a, b] = principal_angles(fit.basis[a], fit.basis[b])
    if replicates[a] is not None and replicates[b] is not None:
        fit.angles_ci[a, b] = _interval(principal_angles(replicates[a], replicates[b]), settings.confidence)
    if null_bases is not None:
        null_angles = principal_angles(null_bases[..., : fit.rank[a]], fit.basis[b])
        fit.null_angles[a, b] = np.median(null_angles, axis=0)
        fit.null_angles_ci[a, b] = _interval(null_angles, 1 - settings.significance)


def _pair_tests(fit: LayerFit, effects: list[FactorEffects], a: int, b: int, settings: DrawSettings) -> None:
    """p-values of the pair's two nulls, orthogonality and dependence: both factors' effects, denoised
    (``denoised``), are turned to the null's boundary (``boundary_turns``), then drawn again with the noise
    of the fit (the groups' influences with random signs, the same signs for both factors, whose
    noise comes from the same tokens); the share of draws whose smallest angle lies as far from the
    null as the measured one is its p-value (add-one)."""
    measured = fit.angles[a, b][0]
    bases, ranks = (fit.basis[a], fit.basis[b]), (fit.rank[a], fit.rank[b])
    truths = [denoised(effects[f], fit.basis[f], settings.null) for f in (a, b)]
    orthogonal = _boundary_angles(effects[a], effects[b], truths, bases, ranks, settings.null,
                                  lambda angles: np.maximum(angles, settings.orthogonal_deg))
    dependent = _boundary_angles(effects[a], effects[b], truths, bases, ranks, settings.null,
                                 lambda angles: np.minimum(angles, np.where(np.arange(len(angles)) == 0,
                                                                            settings.dependent_deg, 90.0)))
    fit.orthogonal_p[a, b] = fit.orthogonal_p[b, a] = _add_one_share(orthogonal <= measured)
    fit.dependent_p[a, b] = fit.dependent_p[b, a] = _add_one_share(dependent >= measured)


def _add_one_share(extreme: np.ndarray) -> float:
    return float((1 + np.count_nonzero(extreme)) / (1 + len(extreme)))


def denoised(effects: FactorEffects, basis: np.ndarray, coefficients: np.ndarray) -> np.ndarray:
    """The factor's effects (k, d) as the truth of a null: their leading `basis` directions only, with
    singular values chosen so that draws around them (the groups' influences weighted by the first
    coefficients) show on average the fitted singular values (noise inflates leading singular values,
    and more than its average energy: the leading directions are those where it adds most)."""
    along = effects.weighted @ basis  # (k, rank): the effects in their own basis
    rank = basis.shape[1]
    fitted = np.linalg.svd(along, compute_uv=False) ** 2
    noise = np.tensordot(coefficients[:DRAW_BATCH], effects.influence, axes=(1, 0))
    target = fitted.copy()
    for _ in range(TRUTH_ITERATIONS):
        truth = _scaled(along, np.sqrt(target / np.maximum(fitted, np.finfo(float).tiny))) @ basis.T
        drawn = truth + noise
        drawn = np.linalg.eigvalsh(drawn @ np.swapaxes(drawn, -1, -2))[:, ::-1][:, :rank]
        target = np.maximum(target + fitted - drawn.mean(axis=0), 0.0)
    return _scaled(along, np.sqrt(target / np.maximum(fitted, np.finfo(float).tiny))) @ basis.T


def _scaled(matrix: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The matrix with its singular values (descending) multiplied by scale."""
    left, singular, right_t = np.linalg.svd(matrix, full_matrices=False)
    return (left * (singular * scale)) @ right_t


def _boundary_angles(first: FactorEffects, second: FactorEffects, truths: list, bases: tuple, ranks: tuple,
                     coefficients: np.ndarray, target) -> np.ndarray:
    """Smallest principal angle (draws,) between the two factors' subspaces drawn around their
    denoised effects turned so that their principal angles become target(angles)."""
    turned = boundary_turns(*truths, *bases, target)
    smallest = []
    for start in range(0, len(coefficients), DRAW_BATCH):
        batch = coefficients[start: start + DRAW_BATCH].astype("float32")
        spans = [leading_subspaces(np.tensordot(batch, effects.influence32, axes=(1, 0))
                                   + weighted.astype("float32"), rank)
                 for effects, weighted, rank in zip((first, second), turned, ranks)]
        smallest.append(principal_angles(*spans)[..., 0])
    return np.concatenate(smallest)


def boundary_turns(first: np.ndarray, second: np.ndarray, basis_first: np.ndarray, basis_second: np.ndarray,
                   target) -> tuple[np.ndarray, np.ndarray]:
    """The rows of two effect matrices (k, d) turned so that the principal angles between the bases'
    spans become target(angles): each pair of principal vectors p_i, q_i is rotated symmetrically
    about its bisector, in its own plane (the planes of different pairs are orthogonal), p_i's
    rotation applied to `first` and the opposite one to `second`. A pair that shares its direction
    is opened towards a direction outside both spans."""
    left, cosines, right_t = np.linalg.svd(basis_first.T @ basis_second)
    m = len(cosines)
    p, q = basis_first @ left[:, :m], basis_second @ right_t[:m].T
    angles = np.degrees(np.arccos(np.clip(cosines, 0.0, 1.0)))
    half_now, half_then = np.radians(angles) / 2, np.radians(target(angles)) / 2
    bisector, across = p + q, p - q
    bisector /= np.linalg.norm(bisector, axis=0)
    across_norm = np.linalg.norm(across, axis=0)
    shared = across_norm < 1e-6
    if shared.any():
        across[:, shared] = _outside(np.hstack([basis_first, basis_second]), int(shared.sum()))
        across_norm[shared] = 1.0
    across /= across_norm
    turn = half_then - half_now
    return _rotate(first, bisector, across, turn), _rotate(second, bisector, across, -turn)


def _outside(spanned: np.ndarray, n: int) -> np.ndarray:
    """n orthonormal directions (d, n) orthogonal to the columns of `spanned` (a fixed choice)."""
    seeded = np.random.default_rng(0).standard_normal((spanned.shape[0], n))
    basis = column_space(spanned)
    return np.linalg.qr(seeded - basis @ (basis.T @ seeded))[0]


def _rotate(rows: np.ndarray, first_axis: np.ndarray, second_axis: np.ndarray, turn: np.ndarray) -> np.ndarray:
    """Rows (k, d) rotated by `turn` (radians, one per plane) in the planes of orthonormal axes
    (d, m), from the first axis towards the second."""
    along, across = rows @ first_axis, rows @ second_axis
    cos, sin = np.cos(turn) - 1, np.sin(turn)
    return (rows + (along * cos - across * sin) @ first_axis.T + (along * sin + across * cos) @ second_axis.T)


def _interval(draws: np.ndarray, level: float) -> np.ndarray:
    """Central interval (..., bound) holding `level` of the draws (first axis)."""
    return np.moveaxis(np.percentile(draws, [50 * (1 - level), 50 * (1 + level)], axis=0), 0, -1)


# ---------------------------------------------------------------------------------------------
# The estimator.


@dataclass
class Design:
    """What the label passes found: the factors' classes, the design's layout and counts, and the
    joint fit's solution (None for the marginal estimator)."""

    classes: dict[str, FactorClasses]
    layout: Layout
    counts: Counts
    solution: JointSolution | None
    association: np.ndarray  # (factor, other) normalised mutual information of the labels
    shared_tokens: np.ndarray  # (factor, other)


class FactorSubspaces:
    """Factor subspaces of a residual-stream site, fitted jointly (default) or per factor.

    Parameters (all keyword): site; factors (specs, default ``factors.default_factor_specs``);
    layers (default all); exclude_start; estimator ("joint" or "marginal"); rank_threshold, rank;
    max_classes (None: keep every class); n_bootstrap, bootstrap_groups, confidence; n_null,
    significance; seed; independence_deg, orthogonality_deg. See the module docstring.

    Fitted attributes: ``site_``, ``layers_``, ``factors_`` (names), ``classes_`` ({factor:
    FactorClasses}), ``n_tokens_``, ``design_`` (counts, association, condition), ``fits_``
    ({layer: LayerFit}); ``bases(layer)`` gives each factor's orthonormal basis (d_model, rank).
    """

    def __init__(self, *, site: str = "resid_pre", factors=None, layers=None, exclude_start: bool = True,
                 estimator: str = "joint", rank_threshold: float = 0.95, rank: int | None = None,
                 max_classes: int | None = 64, n_bootstrap: int = 200, bootstrap_groups: int = 32,
                 confidence: float = 0.9, n_null: int = 100, significance: float = 0.05, seed: int = 0,
                 independence_deg: float = 10.0, orthogonality_deg: float = 10.0):
        options = check_options(site=site, factors=factors, layers=layers, exclude_start=exclude_start,
                                estimator=estimator, rank_threshold=rank_threshold, rank=rank,
                                max_classes=max_classes, n_bootstrap=n_bootstrap, bootstrap_groups=bootstrap_groups,
                                confidence=confidence, n_null=n_null, significance=significance, seed=seed,
                                independence_deg=independence_deg, orthogonality_deg=orthogonality_deg)
        for name, value in options.items():
            setattr(self, name, value)

    @property
    def fit_options(self) -> dict:
        """The parameters that fix the bases, as fitted (layers and factors resolved)."""
        options = {name: getattr(self, name) for name in FIT_OPTIONS}
        if hasattr(self, "layers_"):
            options.update(layers=list(self.layers_), factors=list(self.factors_))
        return as_attrs(options)

    def fit(self, dataset: xr.Dataset) -> FactorSubspaces:
        """Fit on an opened store (``open_for_analysis``); returns self."""
        run_plans({"subspaces": self.plan(dataset)})
        return self

    def plan(self, dataset: xr.Dataset) -> Plan:
        """Read the labels now (two cheap passes), and return the Plan of the streamed pass, which
        finishes into this estimator, fitted."""
        array = d_model_site(dataset, self.site, "factor subspaces")
        layers = check_layers(dataset, self.layers)
        factors = parse_factors(dataset, self.factors)
        url = store_url(dataset)
        mask = token_mask(dataset, self.exclude_start)
        classes, patterns = discover_classes(dataset, factors, mask, self.max_classes)
        names = [factor.name for factor in factors]
        self._check_rank(classes, dataset.sizes["d_model"])
        layout = Layout(tuple(names), tuple(classes[name].size for name in names), tuple(int(p) for p in patterns))
        n_groups = self.bootstrap_groups if (self.n_bootstrap or self.n_null) else 1
        groups = sample_values(dataset, mask).map_blocks(bootstrap_group, self.seed, n_groups, dtype="int64")
        columns = design_columns(dataset, factors, classes, layout, mask)
        design = self._design(classes, layout, columns, groups, n_groups, url)
        packer = Packer({"nonfinite": (), "sums": (n_groups, layout.n_columns, dataset.sizes["d_model"]),
                         "squares": (layout.n_columns,)})
        kernel = partial(_design_sums, packer=packer, n_columns=layout.n_columns, n_groups=n_groups)
        settings = self._draw_settings(n_groups)
        heads = head_read_spaces(dataset, layers)
        shared = dask.delayed(design, pure=True)
        finite = FiniteCheck(dataset)
        lazy = {}
        for layer in layers:
            vector = sample_block_sums(kernel, packer.size, layer_data(array, layer), groups, columns)
            (chunk,) = vector.to_delayed(optimize_graph=False)  # unoptimised: its reads stay shared
            fit = dask.delayed(_fit_layer_of_design)(chunk, shared, packer=packer, settings=settings,
                                                     heads=heads.get(layer, {}))
            lazy[layer] = (vector[packer.offsets["nonfinite"]], fit)
            finite.reads(layer, (self.site, layer))

        def finish(computed):
            finite.check({layer: nonfinite for layer, (nonfinite, _) in computed.items()})
            self.site_, self.layers_, self.factors_ = self.site, layers, names
            self.classes_, self.design_ = classes, design
            self.n_tokens_ = {name: int(classes[name].counts.sum()) for name in names}
            self.fits_ = {layer: fit for layer, (_, fit) in computed.items()}
            self.has_weights_ = bool(heads)
            self.d_model_ = dataset.sizes["d_model"]
            self.heads_ = {"q": dataset["head"].values, "k": dataset["kv_head"].values}
            return self

        return Plan(lazy, finish)

    def _check_rank(self, classes: dict[str, FactorClasses], d_model: int) -> None:
        if self.rank is None:
            return
        for name, found in classes.items():
            limit = min(found.size - 1, d_model)
            if self.rank > limit:
                raise AnalysisError(
                    f"rank={self.rank} is more than factor {name!r} allows: its {found.size} classes span at most "
                    f"{limit} dimension(s) of d_model {d_model}; choose rank <= {limit} or leave rank unset "
                    "(then rank_threshold chooses each factor's rank)"
                )

    def _design(self, classes, layout: Layout, columns, groups, n_groups: int, url: str) -> Design:
        """The second label pass: co-occurrence counts, then the joint solution and the association."""
        parts = [dask.delayed(count_block)(c, g, layout.n_columns, n_groups)
                 for c, g in zip(columns.to_delayed().ravel(), groups.to_delayed().ravel())]
        (stacked,) = dask.compute(tree_sum(parts))
        n = layout.n_columns
        gram = np.asarray(sum(stacked[g * n: (g + 1) * n] for g in range(n_groups)).todense())
        counts = Counts(gram, stacked.tocsr(), n_groups)
        solution = None
        if self.estimator == "joint":
            check_shared_tokens(counts, layout, url)
            solution = solve_joint(counts, layout, url)
        association, shared = label_association(counts, layout)
        design = Design(classes, layout, counts, solution, association, shared)
        _log_design(design, url)
        return design

    def _draw_settings(self, n_groups: int) -> DrawSettings:
        rng = np.random.default_rng(self.seed)
        bootstrap = (rng.multinomial(n_groups, np.full(n_groups, 1 / n_groups), size=self.n_bootstrap) - 1.0
                     if self.n_bootstrap else np.zeros((0, n_groups)))
        null = rng.choice([-1.0, 1.0], size=(self.n_null, n_groups)) if self.n_null else np.zeros((0, n_groups))
        return DrawSettings(self.rank_threshold, self.rank, bootstrap, null, self.confidence, self.significance,
                            90.0 - self.orthogonality_deg, self.independence_deg)

    def bases(self, layer: int) -> list[np.ndarray]:
        """Each factor's orthonormal basis (d_model, rank) at a fitted layer, in the order of factors_."""
        return self.fits_[layer].basis

    def to_dataset(self) -> xr.Dataset:
        """The results group /subspaces (see the package docstring for its variables)."""
        return subspace_dataset(self)


def _fit_layer_of_design(vector, design: Design, **kwargs) -> LayerFit:
    return fit_layer(vector, counts=design.counts, layout=design.layout, solution=design.solution, **kwargs)


def label_association(counts: Counts, layout: Layout) -> tuple[np.ndarray, np.ndarray]:
    """(factor, other) normalised mutual information of the labels on the tokens both read
    (arithmetic-mean normalisation, as sklearn's default: 0 unrelated, 1 one determines the other
    and back), and the number of those tokens."""
    n = len(layout.names)
    association, shared = np.full((n, n), np.nan), np.zeros((n, n), dtype="int64")
    for a in range(n):
        for b in range(n):
            table = counts.contingency(layout, a, b)
            shared[a, b] = int(table.sum())
            if a == b or not shared[a, b]:
                continue
            table = table[table.sum(axis=1) > 0][:, table.sum(axis=0) > 0]
            denominator = (entropy(table.sum(axis=1)) + entropy(table.sum(axis=0))) / 2
            information = mutual_info_score(None, None, contingency=table)
            association[a, b] = information / denominator if denominator > 0 else 1.0
    return association, shared


def _log_design(design: Design, url: str) -> None:
    layout, solution = design.layout, design.solution
    described = ", ".join(
        f"{name}: {found.size} classes" + (f" (the last pooling {found.pooled_classes} less frequent ones)" if found.pooled_classes else "")
        for name, found in design.classes.items())
    log.info("subspaces of %s: %s", url, described)
    if solution is None:
        return
    log.info("subspaces: joint fit, condition number %.3g, variance inflation %s", solution.condition,
             {name: round(float(value), 2) for name, value in zip(layout.names, solution.variance_inflation)})
    if solution.condition > CONDITION_WARNING:
        n = len(layout.names)
        pairs = sorted(((design.association[a, b], layout.names[a], layout.names[b])
                        for a in range(n) for b in range(a + 1, n) if np.isfinite(design.association[a, b])), reverse=True)
        strongest = "; ".join(f"{a} ~ {b}: NMI {value:.2f}" for value, a, b in pairs[:3])
        log.warning(
            "subspaces of %s: the joint fit is ill-conditioned (condition number %.3g > %g): the factors' labels are "
            "strongly associated (%s), which inflates the noise of their effects %s-fold; read their angles with "
            "their intervals, or drop one of the associated factors", url, solution.condition, CONDITION_WARNING,
            strongest, {name: round(float(v), 1) for name, v in zip(layout.names, solution.variance_inflation)})


def head_read_spaces(dataset: xr.Dataset, layers: list[int]) -> dict[int, dict[str, list[np.ndarray]]]:
    """Per layer, orthonormal bases of each head's read subspaces in d_model (column spaces of w_q[h],
    w_k[g]); empty without weights."""
    if "w_q" not in dataset.data_vars:
        return {}
    weights = dataset[["w_q", "w_k"]].sel(layer=layers).compute()
    return {
        layer: {name: [column_space(matrix) for matrix in weights[f"w_{name}"].sel(layer=layer).values] for name in "qk"}
        for layer in layers
    }


# ---------------------------------------------------------------------------------------------
# The results group.


def _relation(structure_p: np.ndarray, orthogonal_p: np.ndarray, dependent_p: np.ndarray, *,
              significance: float) -> np.ndarray:
    """(layer, factor, other) relation from the factors' structure p-values (layer, factor) and the
    pair's p-values of the nulls of orthogonality and dependence (see the module docstring)."""
    structured = ~(structure_p > significance)
    both = structured[:, :, None] & structured[:, None, :]
    orthogonal, dependent = orthogonal_p > significance, dependent_p > significance
    relation = np.select([orthogonal & ~dependent, dependent & ~orthogonal, ~orthogonal & ~dependent],
                         ["orthogonal", "dependent", "independent"], "undetermined")
    relation = np.where(both, relation, "no structure")
    return np.where(np.isnan(orthogonal_p), "", relation).astype(object)


def _padded(values: dict, shape: tuple, width: int, *extra) -> np.ndarray:
    """Angles (or intervals) by index into a NaN array shape + (width,) + extra."""
    out = np.full(shape + (width,) + extra, np.nan)
    for index, value in values.items():
        out[index][: len(value)] = value
    return out


def _scalars(values: dict, shape: tuple) -> np.ndarray:
    """Numbers by index into a NaN array of shape."""
    out = np.full(shape, np.nan)
    for index, value in values.items():
        out[index] = value
    return out


def _overlap(angles: dict, shape: tuple) -> np.ndarray:
    """Mean squared cosine of each entry's principal angles (0 orthogonal, 1 one span inside the other)."""
    out = np.full(shape, np.nan)
    for index, value in angles.items():
        out[index] = np.mean(np.cos(np.radians(value)) ** 2)
    return out


def subspace_dataset(fitted: FactorSubspaces) -> xr.Dataset:
    """The results group /subspaces of a fitted FactorSubspaces."""
    layers, names = fitted.layers_, fitted.factors_
    fits, design = fitted.fits_, fitted.design_
    n_layers, n_factors = len(layers), len(names)
    max_rank = max([rank for fit in fits.values() for rank in fit.rank] + [1])
    n_components = max(len(s) for fit in fits.values() for s in fit.singular)
    shape = (n_layers, n_factors)
    singular, explained = np.full(shape + (n_components,), np.nan), np.full(shape + (n_components,), np.nan)
    basis = np.full(shape + (fitted.d_model_, max_rank), np.nan)
    per_pair = {name: {} for name in ("angles", "angles_ci", "null_angles", "null_angles_ci", "orthogonal_p",
                                      "dependent_p")}
    heads = {"q": {}, "k": {}}
    for i, layer in enumerate(layers):
        fit = fits[layer]
        for a in range(n_factors):
            variance = fit.singular[a] ** 2
            singular[i, a, : len(variance)] = fit.singular[a]
            if variance.sum() > 0:
                explained[i, a, : len(variance)] = np.cumsum(variance) / variance.sum()
            basis[i, a, :, : fit.rank[a]] = fit.basis[a]
        for name in per_pair:
            per_pair[name].update({(i, a, b): value for (a, b), value in getattr(fit, name).items()})
        for (kind, a, h), value in fit.head_angles.items():
            heads[kind][i, a, h] = value
    pair_shape = shape + (n_factors,)
    angles = _padded(per_pair["angles"], pair_shape, max_rank)
    angles_ci = _padded(per_pair["angles_ci"], pair_shape, max_rank, 2)
    null_angles = _padded(per_pair["null_angles"], pair_shape, max_rank)
    null_angles_ci = _padded(per_pair["null_angles_ci"], pair_shape, max_rank, 2)
    structure_p = np.array([fits[layer].structure_p for layer in layers])
    overlap = _overlap(per_pair["angles"], pair_shape)
    orthogonal_p, dependent_p = (_scalars(per_pair[name], pair_shape) for name in ("orthogonal_p", "dependent_p"))
    relation = _relation(structure_p, orthogonal_p, dependent_p, significance=fitted.significance)
    fd, pair = ("layer", "factor"), ("layer", "factor", "other")
    solution = design.solution
    data = {
        "n_classes": (("factor",), [design.classes[name].size for name in names]),
        "n_tokens": (("factor",), [fitted.n_tokens_[name] for name in names]),
        "pooled_classes": (("factor",), [design.classes[name].pooled_classes for name in names]),
        "pooled_tokens": (("factor",), [design.classes[name].pooled_tokens for name in names]),
        "label_nmi": (("factor", "other"), design.association),
        "shared_tokens": (("factor", "other"), design.shared_tokens),
        "variance_inflation": (("factor",), solution.variance_inflation if solution else np.full(n_factors, np.nan)),
        "condition_number": ((), solution.condition if solution else np.nan),
        "subspace_rank": (fd, np.array([fits[layer].rank for layer in layers], dtype="int64")),
        "singular_value": (fd + ("component",), singular),
        "explained": (fd + ("component",), explained),
        "between_fraction": (fd, np.array([fits[layer].between_fraction for layer in layers])),
        "structure_p": (fd, structure_p),
        "basis": (fd + ("d_model", "basis_vector"), basis),
        "angles": (pair + ("angle",), angles),
        "angles_ci": (pair + ("angle", "bound"), angles_ci),
        "min_angle": (pair, angles[..., 0]),
        "min_angle_ci": (pair + ("bound",), angles_ci[..., 0, :]),
        "overlap": (pair, overlap),
        "null_angles": (pair + ("angle",), null_angles),
        "null_angles_ci": (pair + ("angle", "bound"), null_angles_ci),
        "null_min_angle": (pair, null_angles[..., 0]),
        "null_min_angle_ci": (pair + ("bound",), null_angles_ci[..., 0, :]),
        "orthogonal_p": (pair, orthogonal_p),
        "dependent_p": (pair, dependent_p),
        "relation": (pair, relation),
    }
    if fitted.has_weights_:
        for kind, head_dim in (("q", "head"), ("k", "kv_head")):
            table = _padded(heads[kind], shape + (len(fitted.heads_[kind]),), max_rank)
            head_overlap = _overlap(heads[kind], shape + (len(fitted.heads_[kind]),))
            data.update({
                f"{kind}_angles": (fd + (head_dim, "angle"), table),
                f"{kind}_min_angle": (fd + (head_dim,), table[..., 0]),
                f"{kind}_overlap": (fd + (head_dim,), head_overlap),
            })
    coords = {"layer": layers, "factor": np.array(names, dtype=object), "other": np.array(names, dtype=object),
              "bound": np.array(BOUNDS, dtype=object), "head": fitted.heads_["q"], "kv_head": fitted.heads_["k"]}
    attrs = {
        "site": fitted.site_, "factors": names, "estimator": fitted.estimator,
        "classes": {name: design.classes[name].names for name in names},
        "head_angles": "computed from w_q, w_k" if fitted.has_weights_ else "not computed: the store has no weights",
        "fit": fitted.fit_options,
        "relation_rule": ("no structure: a factor's structure_p > significance; else by the pair's two nulls at "
                          "significance: orthogonal (every angle >= 90 - orthogonality_deg) not rejected and dependent "
                          "(smallest angle <= independence_deg) rejected: orthogonal; the reverse: dependent; both "
                          "rejected: independent; neither: undetermined; empty without null draws"),
        **{name: getattr(fitted, name) for name in ("n_bootstrap", "bootstrap_groups", "confidence", "n_null",
                                                    "significance", "seed", "independence_deg", "orthogonality_deg")},
    }
    return xr.Dataset(data, coords=coords, attrs=as_attrs(attrs))


def factor_subspaces(dataset: xr.Dataset, **options) -> xr.Dataset:
    """Factor subspaces at a residual-stream site, as the results group /subspaces: ranks, explained
    variance, principal angles between factors and with each head's read subspaces, bootstrap
    intervals, the null, label association and each pair's relation. The options are the
    parameters of ``FactorSubspaces`` (see the module docstring)."""
    return FactorSubspaces(**options).fit(dataset).to_dataset()


factor_subspaces.__signature__ = inspect.signature(factor_subspaces).replace(parameters=[
    inspect.signature(factor_subspaces).parameters["dataset"], *inspect.signature(FactorSubspaces).parameters.values()])
factor_subspaces.plan = lambda dataset, **options: FactorSubspaces(**options).plan(dataset)
