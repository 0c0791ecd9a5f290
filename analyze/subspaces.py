"""Factor subspaces: where each factor (a label, or the position) lives in the residual stream,
how its subspace sits against the others' and against each head's read subspace, judged against
the noise of the fit.

``FactorSubspaces`` (scikit-learn style: parameters, ``fit(dataset)``, fitted attributes ending in
``_``) fits every chosen factor at every chosen layer in one streamed pass over the activations
(after two cheap passes over the labels), from the sufficient statistics of ``design.py``:
per-(group, class) sums of the vectors and the class co-occurrence counts. With
``estimator="joint"`` (the default) all factors are fitted together, so correlated labels do not
leak into each other's subspace, and tokens of different kinds (the classes of ``intercepts``,
by default their role) get their own intercepts, so that a factor read on several kinds does not
absorb their differences; ``"marginal"`` takes each factor's own class means. A factor's subspace
is spanned by the leading right singular vectors of its count-weighted centred effects; its rank
is ``rank`` or the number of directions that stand above noise (``inference.noise_rank``).

Factors with many classes (token identity over a real vocabulary) keep their ``max_classes - 1``
most frequent classes and pool the rest into one class; the position is cut into ``max_classes``
contiguous ranges instead (``factors.cap_classes``): the streamed sums and every draw then cost the
same whatever the vocabulary or context. Classes whose tokens all lie in one group of samples are
pooled too (their noise could not be resampled).

Every statistic is judged against noise draws: the groups' corrected influences with random signs
(``bootstrap_groups`` seeded groups of resampling units, so tokens of one document, which are not
independent, stay together: ``units.py``; ``design.py`` for the correction, ``inference.py`` for the
methods):

- ``structure_p`` (``n_null`` draws): does the factor show more than noise;
- the rank, and each pair's angles with median-unbiased estimates and ``confidence`` intervals
  inverted from draws around truths at other angles (``n_bootstrap`` draws);
- the **null angles**: principal angles between a factor's noise-only subspace (same rank) and the
  other factor's fitted subspace: what chance gives, reported beside the measured ones;
- a pair's **claims** with their p-values at the boundaries of their nulls: "orthogonal" (every
  principal angle above 90 - ``orthogonality_deg``), "dependent" (a shared direction: the smallest
  angle below ``independence_deg``), "independent" (the smallest angle shown between the two).

The relation of a pair is the claim shown at ``significance`` after Benjamini-Hochberg's
correction over every claim of the run ("undetermined" when none is; "no structure" when either
factor shows none, after the same correction of the structure tests over layers and factors; "below
relevance floor" when both show structure but a factor's significant directions each carry less than
``relevance_floor`` of its between-class variance).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial

import dask
import numpy as np
import xarray as xr
from scipy import sparse
from scipy.stats import entropy
from sklearn.metrics import mutual_info_score

from orthosphere.params import Text, parameter

from .blocks import Packer, sample_block_sums, tree_sum
from .design import (
    ESTIMATORS,
    Counts,
    JointSolution,
    Layout,
    SharedNoise,
    check_shared_tokens,
    count_block,
    count_units,
    noise_traces,
    solve_joint,
    stacked_unit_grams,
)
from .errors import AnalysisError
from .factors import Discovery, FactorClasses, design_columns, discover_classes, parse_factors, parse_intercepts
from .inference import CLAIMS, TAIL_DRAWS, benjamini_hochberg, rademacher
from .inputs import (
    D_MODEL_SITES,
    SITES,
    FiniteCheck,
    check_layers,
    layer_data,
    require_site,
    square_norms,
    store_url,
    token_mask,
)
from .layer import MIN_EFFECTIVE_GROUPS, DrawSettings, LayerFit, fit_layer
from .multiplicity import state_multiplicity
from .options import CONFIDENCE, FLAG, FLOOR, LAYERS, NAMES, POSITIVE, PROBABILITY, SITE, TOLERANCE_DEG, AnalysisConfig, as_attrs, choice, integer
from .plan import Plan, run_plans
from .registry import Analysis, describe
from .units import GROUP_BY, GROUP_BY_HELP, Units, bootstrap_group, check_units, resampling_units, token_groups, token_units, warn_fewer_units_than_groups

log = logging.getLogger("orthosphere.analyze")

BOUNDS = ("low", "high")
NULL_DRAWS = 9999
"""The structure test's draws unless the false-discovery correction needs more (each costs groups^2)."""
RELEVANCE_FLOOR = 0.01
"""The default relevance floor: a direction carrying less than 1 % of its factor's between-class variance
is not part of the factor's subspace, however significant (with 10^5 tokens and more every direction is)."""
OUTLIER_NORM = 10.0
"""An analysed token whose norm exceeds this multiple of the median norm of its block of samples is
counted as an outlier (a sink beyond the start token): counted, not left out; its variance enters the
noise covariance that whitens the rank's test."""
CONDITION_WARNING = 100.0
"""A joint fit whose condition number (of the unit-diagonal Z'Z) exceeds this is logged as a warning."""


def d_model_site(dataset: xr.Dataset, site: str, purpose: str) -> xr.DataArray:
    """A residual-stream site (sample, layer, pos, d_model) of the store."""
    if site not in D_MODEL_SITES and site in SITES:
        raise AnalysisError(f"{purpose} reads a residual-stream site, one of {list(D_MODEL_SITES)}; got {site!r}")
    return require_site(dataset, site, purpose)


# ---------------------------------------------------------------------------------------------
# The streamed pass: per block of samples, sums of the vectors and squared norms per (group, column).


def _design_sums(x, groups, columns, *, packer: Packer, n_columns: int, n_groups: int):
    """Sums of the token vectors per (group, design column), of their squared norms per column, their
    second moments X'X (d, d: for the noise covariance that whitens the tests), the count of non-finite
    ones and of outliers (analysed tokens whose norm exceeds OUTLIER_NORM times the block's median).
    Summed in float64: the fit and the noise covariance subtract the means' part from these sums, and a
    noise far below the tokens' magnitude (a residual stream's mean, strong class effects) would be lost
    to float32's rounding."""
    squares = square_norms(x).ravel()
    vectors = x.reshape(-1, x.shape[-1]).astype("float64")
    columns = columns.reshape(len(vectors), -1)
    token_group = groups.ravel()
    rows, which = np.nonzero(columns >= 0)
    index = token_group[rows] * n_columns + columns[rows, which]
    onehot = sparse.csr_matrix((np.ones(rows.size), (index, rows)), shape=(n_groups * n_columns, len(vectors)))
    column_squares = np.bincount(columns[rows, which], weights=squares[rows].astype("float64"), minlength=n_columns)
    analysed = columns[:, 0] >= 0
    counted = squares[analysed]
    outliers = np.count_nonzero(counted > OUTLIER_NORM**2 * np.median(counted)) if counted.size else 0
    found = {"nonfinite": np.count_nonzero(~np.isfinite(squares)), "outliers": outliers, "sums": onehot @ vectors,
             "squares": column_squares}
    if "gram" in packer.shapes:  # only where the tests can be whitened
        tokens = vectors[analysed]
        with np.errstate(invalid="ignore", over="ignore"):  # non-finite tokens are counted, and the layer reported
            found["gram"] = tokens.T @ tokens
    return packer.pack(found)


# ---------------------------------------------------------------------------------------------
# The estimator.


@dataclass
class Design:
    """What the label passes found: the factors' classes and intercept cells, the design's layout and
    counts, and the joint fit's solution (None for the marginal estimator)."""

    discovery: Discovery
    layout: Layout
    counts: Counts
    solution: JointSolution | None
    association: np.ndarray  # (factor, other) normalised mutual information of the labels
    shared_tokens: np.ndarray  # (factor, other)
    traces: list | None  # design.noise_traces, None without groups
    shared_noise: SharedNoise | None  # None for the marginal estimator, without groups or with units of one token

    @property
    def classes(self) -> dict[str, FactorClasses]:
        return self.discovery.classes


@dataclass(frozen=True)
class SubspacesConfig(AnalysisConfig):
    """The options of ``subspaces``: the parameters of the fit (``FactorSubspaces``), which the spheres
    read too (see the module docstring and ``inference``)."""

    site: str = parameter("resid_pre", SITE, help="the residual-stream site fitted")
    factors: tuple[str, ...] | None = parameter(None, NAMES, None, help="factor specs (default: the task's, "
                                                "factors.default_factor_specs)")
    layers: tuple[int, ...] | None = parameter(None, LAYERS, None, help="layers (default: every one stored)")
    exclude_start: bool = parameter(True, FLAG, help="leave out each sequence's start token")
    estimator: str = parameter("joint", choice(*ESTIMATORS), help="the factors fitted jointly or one at a time")
    intercepts: str | None = parameter(None, Text("a label name, or 'none' for one intercept per pattern"), None,
                                       help="the label whose classes get their own intercepts (default: "
                                            "factors.default_intercepts)")
    rank: int | None = parameter(None, integer(1), None, help="a fixed rank (default: the noise-aware rank)")
    rank_significance: float = parameter(0.01, PROBABILITY, help="each step of the noise-aware rank's test")
    relevance_floor: float = parameter(RELEVANCE_FLOOR, FLOOR, help="share of its factor's between-class variance "
                                       "below which a significant direction does not count in the rank")
    max_classes: int | None = parameter(64, integer(2, "the most classes a factor keeps (its rarest classes beyond "
                                                     "that are pooled into one)"), None,
                                        help="none keeps every class")
    n_bootstrap: int = parameter(200, integer(0), help="noise draws of the ranks, intervals, claims and spheres")
    bootstrap_groups: int = parameter(32, integer(2), help="groups of samples the draws resample")
    group_by: str | None = parameter(None, GROUP_BY, None, help=GROUP_BY_HELP)
    confidence: float = parameter(0.9, CONFIDENCE, help="the intervals' confidence")
    n_null: int | None = parameter(None, integer(0), None, help="draws of the structure test (default: enough for "
                                                               "the correction)")
    significance: float = parameter(0.05, PROBABILITY, help="of the tests and claims, after the correction")
    seed: int = parameter(0, integer(0), help="seed of the draws and groups")
    independence_deg: float = parameter(10.0, TOLERANCE_DEG, help="the claim 'dependent': smallest angle below this")
    orthogonality_deg: float = parameter(10.0, TOLERANCE_DEG, help="the claim 'orthogonal': every angle within this "
                                                                   "of 90")
    radius_cv_tolerance: float = parameter(0.1, POSITIVE, help="the spheres' claims: radius CV below / above this")

    def check(self) -> None:
        """The draws must be able to answer what is asked: a noise-aware rank needs noise draws, and
        their quantiles at the confidence and significance need enough of them."""
        if self.independence_deg >= 90 - self.orthogonality_deg:
            raise AnalysisError(
                f"independence_deg={self.independence_deg} and orthogonality_deg={self.orthogonality_deg}: the claims "
                f"'dependent' (smallest angle below {self.independence_deg}) and 'orthogonal' (every angle above "
                f"{90 - self.orthogonality_deg}) would overlap; choose independence_deg < 90 - orthogonality_deg"
            )
        if self.rank is None and not self.n_bootstrap:
            raise AnalysisError(
                "n_bootstrap=0 leaves no noise draws for the noise-aware rank: give n_bootstrap (200 by default) "
                "or a fixed rank"
            )
        needed = int(np.ceil(max(TAIL_DRAWS / min(self.significance, (1 - self.confidence) / 2),
                                 2 / self.rank_significance)))
        if 0 < self.n_bootstrap < needed:
            raise AnalysisError(
                f"n_bootstrap={self.n_bootstrap} is too few noise draws for quantiles at significance="
                f"{self.significance}, confidence={self.confidence} and rank_significance={self.rank_significance}: "
                f"give n_bootstrap >= {needed} (or 0 with a fixed rank: no intervals, claims or spheres)"
            )


class FactorSubspaces:
    """Factor subspaces of a residual-stream site, fitted jointly (default) or per factor, with what
    their noise draws say of them.

    Parameters: a ``SubspacesConfig``, or its parameters as keywords (site, factors, layers, ...;
    see ``SubspacesConfig``, the module docstring and ``inference``).

    Fitted attributes: ``site_``, ``layers_``, ``factors_`` (names), ``classes_`` ({factor:
    FactorClasses}), ``n_tokens_``, ``design_`` (counts, association, condition), ``fits_``
    ({layer: LayerFit}); ``bases(layer)`` gives each factor's orthonormal basis (d_model, rank).
    """

    def __init__(self, config: SubspacesConfig | None = None, /, **options):
        self.config = config if config is not None else SubspacesConfig.of(options, owner="FactorSubspaces")
        if config is not None and options:
            raise AnalysisError("FactorSubspaces takes a SubspacesConfig or options, not both")
        for name, value in self.config.as_dict().items():
            setattr(self, name, value)

    def _null_draws(self, n_tests: int) -> int:
        """The structure test's draws: n_null, or (None) enough that the smallest p-value, 1 / (n_null + 1),
        can pass the false-discovery correction over every layer and factor (NULL_DRAWS at least)."""
        needed = int(np.ceil(n_tests / self.significance)) - 1
        if self.n_null is None:
            return max(NULL_DRAWS, 2 * (needed + 1) - 1)
        if self.n_null and self.n_null < needed:
            raise AnalysisError(
                f"n_null={self.n_null} is too few null draws for the false-discovery correction over {n_tests} "
                f"structure tests (layers x factors) at significance={self.significance}: the smallest p-value "
                f"1/(n_null + 1) must be at most significance / tests; give n_null >= {needed} (the draws are "
                "cheap), or leave it unset"
            )
        return self.n_null

    @property
    def fit_options(self) -> dict:
        """The parameters that fix the fit, as fitted (layers and factors resolved)."""
        options = self.config.as_dict()
        if hasattr(self, "layers_"):
            options.update(layers=list(self.layers_), factors=list(self.factors_), intercepts=self.intercepts_,
                           group_by=self.units_.label)
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
        self.n_null_ = self._null_draws(len(layers) * len(factors))
        url = store_url(dataset)
        mask = token_mask(dataset, self.exclude_start)
        n_groups = self.bootstrap_groups if (self.n_bootstrap or self.n_null_) else 1
        units = resampling_units(dataset, self.group_by)
        if n_groups > 1:
            check_units(units, url)
            warn_fewer_units_than_groups(units, self.seed, n_groups, url)
        keys = token_units(dataset, units).rechunk(mask.chunks)
        groups = token_groups(keys, self.seed, n_groups)
        intercepts = parse_intercepts(dataset, self.intercepts, factors)
        discovery = discover_classes(dataset, factors, mask, self.max_classes, groups, n_groups, intercepts)
        classes = discovery.classes
        names = [factor.name for factor in factors]
        self._check_rank(classes, dataset.sizes["d_model"])
        layout = Layout(tuple(names), tuple(classes[name].size for name in names), tuple(int(c) for c in discovery.cells))
        columns = design_columns(dataset, factors, discovery, layout, mask)
        design = self._design(discovery, layout, columns, groups, keys, units, n_groups, url)
        d_model = dataset.sizes["d_model"]
        shapes = {"nonfinite": (), "outliers": (), "sums": (n_groups, layout.n_columns, d_model), "squares": (layout.n_columns,)}
        if self._whitens(n_groups):
            shapes["gram"] = (d_model, d_model)
        packer = Packer(shapes)
        kernel = partial(_design_sums, packer=packer, n_columns=layout.n_columns, n_groups=n_groups)
        settings = self._draw_settings(n_groups)
        heads = head_read_weights(dataset, layers)
        shared = dask.delayed(design, pure=True)
        finite = FiniteCheck(dataset)
        lazy = {}
        for layer in layers:
            vector = sample_block_sums(kernel, packer.size, layer_data(array, layer), groups, columns)
            (chunk,) = vector.to_delayed(optimize_graph=False)  # unoptimised: its reads stay shared
            fit = dask.delayed(_fit_layer_of_design)(chunk, shared, packer=packer, settings=settings,
                                                     heads=heads.get(layer, {}), dtype=dataset.attrs.get("dtype"))
            lazy[layer] = (vector[packer.offsets["nonfinite"]], fit)
            finite.reads(layer, (self.site, layer))

        def finish(computed):
            finite.check({layer: nonfinite for layer, (nonfinite, _) in computed.items()})
            self.site_, self.layers_, self.factors_, self.intercepts_ = self.site, layers, names, intercepts
            self.classes_, self.design_, self.units_ = classes, design, units
            self.resampling_ = units.attrs(self.seed, n_groups)
            self.n_tokens_ = {name: int(classes[name].counts.sum()) for name in names}
            self.fits_ = {layer: fit for layer, (_, fit) in computed.items()}
            _warn_rounding(self.fits_, dataset.attrs.get("dtype"), url)
            _warn_few_groups(self.fits_, url)
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
                    "(then each factor's rank is the number of its directions that stand above noise)"
                )

    def _whitens(self, n_groups: int) -> bool:
        """Whether the fit has draws and a common fit: the shared noise's share is estimated and the tests
        can be whitened (the joint estimator with groups)."""
        return self.estimator == "joint" and n_groups > 1

    def _design(self, discovery: Discovery, layout: Layout, columns, groups, keys, units: Units, n_groups: int,
                url: str) -> Design:
        """The second label pass: co-occurrence counts (per group, and per resampling unit where the shared
        noise is estimated), then the joint solution, the association and what the noise draws need."""
        n = layout.n_columns
        columns, groups, keys = (array.to_delayed().ravel() for array in (columns, groups, keys))
        parts = tree_sum([dask.delayed(count_block)(c, g, n, n_groups) for c, g in zip(columns, groups)])
        per_unit = tree_sum([dask.delayed(count_units)(c, k, units.token_keys, n) for c, k in zip(columns, keys)])
        stacked, unit_counts = dask.compute(parts, per_unit if self._whitens(n_groups) else None)
        gram = np.asarray(sum(stacked[g * n: (g + 1) * n] for g in range(n_groups)).todense())
        unit_grams = None if unit_counts is None else stacked_unit_grams(
            unit_counts.tocsr(), bootstrap_group(units.token_keys, self.seed, n_groups), n_groups)
        counts = Counts(gram, stacked.tocsr(), n_groups, unit_grams)
        solution = shared_noise = None
        if self.estimator == "joint":
            check_shared_tokens(counts, layout, url)
            solution = solve_joint(counts, layout, url)
            shared_noise = SharedNoise.of(counts, layout, solution)
        association, shared = label_association(counts, layout)
        traces = noise_traces(counts, layout, solution) if n_groups > 1 else None
        design = Design(discovery, layout, counts, solution, association, shared, traces, shared_noise)
        _log_design(design, url)
        return design

    def _draw_settings(self, n_groups: int) -> DrawSettings:
        rng = np.random.default_rng(self.seed)
        draws = rademacher(rng, self.n_bootstrap, n_groups)
        null = rademacher(rng, self.n_null_, n_groups)
        return DrawSettings(self.rank, null, draws, self.confidence, self.significance, self.rank_significance,
                            self.relevance_floor, 90.0 - self.orthogonality_deg, self.independence_deg,
                            self.radius_cv_tolerance)

    def bases(self, layer: int) -> list[np.ndarray]:
        """Each factor's orthonormal basis (d_model, rank) at a fitted layer, in the order of factors_."""
        return self.fits_[layer].basis

    def to_dataset(self) -> xr.Dataset:
        """The results group /subspaces (see the package docstring for its variables)."""
        return subspace_dataset(self)


def _fit_layer_of_design(vector, design: Design, **kwargs) -> LayerFit:
    return fit_layer(vector, counts=design.counts, layout=design.layout, solution=design.solution,
                     traces=design.traces, shared=design.shared_noise, radial=[design.classes[name].sphere_classes for name in design.layout.names],
                     **kwargs)


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


def _warn_rounding(fits: dict[int, LayerFit | None], dtype: str | None, url: str) -> None:
    """Say which layers' class means the store's rounding moves more than their noise does."""
    biased = [layer for layer, fit in fits.items() if fit is not None and fit.rounding_bias > 1]
    if biased:
        worst = max(fits[layer].rounding_bias for layer in biased)
        log.warning(
            "subspaces of %s: in layers %s the %s rounding of the stored values can move a class mean up to %.3g times "
            "its noise (rounding_bias): their draws carry that rounding (rounding_inflation), so their intervals are "
            "wider than the noise alone makes them; store float32 activations to narrow them", url, biased, dtype, worst)


def _warn_few_groups(fits: dict[int, LayerFit | None], url: str) -> None:
    """Say which layers' claims were withheld for too few effective groups (``layer.MIN_EFFECTIVE_GROUPS``)."""
    few = [layer for layer, fit in fits.items()
           if fit is not None and fit.shared_noise > 0 and fit.effective_groups < MIN_EFFECTIVE_GROUPS]
    if few:
        log.warning(
            "subspaces of %s: in layers %s the noise, partly shared within units, is carried by about %.3g effective groups (effective_groups; at least "
            "%g needed): their relations and sphere verdicts are withheld (undetermined), and their structure tests and "
            "ranks may find structure in noise; analyse more (or shorter) documents, or group_by a label with more values",
            url, few, min(fits[layer].effective_groups for layer in few), MIN_EFFECTIVE_GROUPS)


def head_read_weights(dataset: xr.Dataset, layers: list[int]) -> dict[int, dict[str, np.ndarray]]:
    """Per layer, each head's read weights w_q[h] and w_k[g] (heads, d_model, d_head), whose column spaces
    the layer's task compares the factors' subspaces with (``layer.fit_layer``); empty without weights."""
    if "w_q" not in dataset.data_vars:
        return {}
    weights = dataset[["w_q", "w_k"]].sel(layer=layers).compute()
    return {layer: {name: weights[f"w_{name}"].sel(layer=layer).values for name in "qk"} for layer in layers}


# ---------------------------------------------------------------------------------------------
# The results group.


BELOW_FLOOR = "below relevance floor"
"""The verdict of a factor whose structure is shown and whose directions are significant, but none of them
carries ``relevance_floor`` of its between-class variance (its rank is 0 by the floor alone)."""


def below_floor(rank: np.ndarray, significance_rank: np.ndarray, structure_q: np.ndarray, significance: float) -> np.ndarray:
    """(layer, factor) factors of rank 0 whose structure is shown and whose significance rank is not 0."""
    return (rank == 0) & (significance_rank > 0) & ~(structure_q > significance)


def relations(rank: np.ndarray, structure_q: np.ndarray, claim_q: np.ndarray, significance: float,
              drawn: bool, floored: np.ndarray) -> np.ndarray:
    """(layer, factor, other) relation from the ranks (layer, factor), the structure tests' adjusted
    p-values (NaN without a null), the claims' adjusted p-values (layer, factor, other, claim; NaN
    without draws) and the factors below the relevance floor (``below_floor``): see ``RELATION_RULE``."""
    structured = (rank > 0) & ~(structure_q > significance)
    both = structured[:, :, None] & structured[:, None, :]
    shown = claim_q <= significance
    relation = np.select([shown[..., i] for i in range(len(CLAIMS))], list(CLAIMS), "undetermined")
    relation = np.where(both, relation, "no structure")
    present = structured | floored  # structure shown, relevant or not
    relation = np.where(present[:, :, None] & present[:, None, :] & ~both, BELOW_FLOOR, relation)
    tested = ~both | drawn  # with draws every structured pair has claims (NaN where withheld: undetermined)
    n = rank.shape[1]
    relation = np.where(tested & ~np.eye(n, dtype=bool)[None], relation, "")
    return relation.astype(object)


RANK_RULE = (
    "a fixed rank is the rank; else the structure test decides whether a factor has a subspace (subspace_rank 0 "
    "when structure_q > significance) and the significant directions (significance_rank) how many, counted while "
    "each carries at least relevance_floor of the factor's between-class variance (variance_share); the angles, "
    "claims, head angles and bases of a factor of rank 0 are NaN"
)

RELATION_RULE = (
    "no structure: either factor's structure_q > significance, or its subspace_rank is 0 with no significant direction; "
    "below relevance floor: else either factor's subspace_rank is 0 because its significant directions each carry less "
    "than relevance_floor of its between-class variance; else the claim whose "
    "claim_q <= significance (Benjamini-Hochberg over every claim of the run): orthogonal (every principal "
    "angle above 90 - orthogonality_deg), dependent (the smallest angle below independence_deg), "
    "independent (neither: the smallest angle shown between them); undetermined when no claim is shown; "
    "empty without noise draws"
)


def _padded(values: dict, shape: tuple, width: int, *extra) -> np.ndarray:
    """Angles (or intervals) by index into a NaN array shape + (width,) + extra."""
    out = np.full(shape + (width,) + extra, np.nan)
    for index, value in values.items():
        out[index][: len(value)] = value
    return out


def _largest(padded: np.ndarray) -> np.ndarray:
    """The last angle of each NaN-padded row of angles (NaN where there is none)."""
    count = np.sum(np.isfinite(padded), axis=-1)
    last = np.take_along_axis(padded, np.maximum(count - 1, 0)[..., None], axis=-1)[..., 0]
    return np.where(count > 0, last, np.nan)


def _overlap(angles: dict, shape: tuple) -> np.ndarray:
    """Mean squared cosine of each entry's principal angles (0 orthogonal, 1 one span inside the other)."""
    out = np.full(shape, np.nan)
    for index, value in angles.items():
        out[index] = np.mean(np.cos(np.radians(value)) ** 2)
    return out


def _symmetric(pairs: dict, shape: tuple, name: str) -> dict:
    """{(layer, a, b) and (layer, b, a): getattr(pair, name)} of the layers' PairFits (a < b)."""
    found = {}
    for (i, a, b), pair in pairs.items():
        value = getattr(pair, name)
        if value is not None:
            found[i, a, b] = found[i, b, a] = value
    return found


def subspace_dataset(fitted: FactorSubspaces) -> xr.Dataset:
    """The results group /subspaces of a fitted FactorSubspaces."""
    layers, names = fitted.layers_, fitted.factors_
    fits, design = fitted.fits_, fitted.design_
    n_layers, n_factors = len(layers), len(names)
    max_rank = max([rank for fit in fits.values() for rank in fit.rank] + [1])
    n_components = max(len(factor.singular) for fit in fits.values() for factor in fit.factors)
    shape = (n_layers, n_factors)
    singular, explained = np.full(shape + (n_components,), np.nan), np.full(shape + (n_components,), np.nan)
    noise_singular, white_singular = np.full(shape + (n_components,), np.nan), np.full(shape + (n_components,), np.nan)
    share, site_share = np.full(shape + (n_components,), np.nan), np.full(shape + (n_components,), np.nan)
    significance_rank = np.full(shape, np.nan)
    basis = np.full(shape + (fitted.d_model_, max_rank), np.nan)
    pairs, null_angles, heads = {}, {}, {"q": {}, "k": {}}
    for i, layer in enumerate(layers):
        fit = fits[layer]
        for a, factor in enumerate(fit.factors):
            variance = factor.singular**2
            singular[i, a, : len(variance)] = factor.singular
            noise_singular[i, a, : len(factor.noise_singular)] = factor.noise_singular
            if factor.significance_rank is not None:
                significance_rank[i, a] = factor.significance_rank
                white_singular[i, a, : len(variance)] = factor.white_singular
                share[i, a, : len(variance)] = factor.variance_share
                if factor.site_variance > 0:
                    site_share[i, a, : len(variance)] = factor.signal_variance / factor.site_variance
            if variance.sum() > 0:
                explained[i, a, : len(variance)] = np.cumsum(variance) / variance.sum()
            basis[i, a, :, : factor.rank] = factor.basis
        pairs.update({(i, a, b): pair for (a, b), pair in fit.pairs.items()})
        null_angles.update({(i, a, b): value for (a, b), value in fit.null_angles.items()})
        for (kind, a, h), value in fit.head_angles.items():
            heads[kind][i, a, h] = value
    structure_p = np.array([[factor.structure_p for factor in fits[layer].factors] for layer in layers])
    structure_q = benjamini_hochberg(structure_p)
    rank = np.array([fits[layer].rank for layer in layers], dtype="int64")
    if fitted.rank is None:  # the structure test decides whether there is a subspace: see RANK_RULE
        rank = np.where(structure_q > fitted.significance, 0, rank)
    structured = rank > 0
    both = structured[:, :, None] & structured[:, None, :]
    basis[~structured] = np.nan
    pair_shape = shape + (n_factors,)
    angles = _padded(_symmetric(pairs, pair_shape, "angles"), pair_shape, max_rank)
    estimate = _padded(_symmetric(pairs, pair_shape, "estimate"), pair_shape, max_rank)
    extremes_ci = _padded(_symmetric(pairs, pair_shape, "extremes_ci"), pair_shape, 2, 2)
    claim_p = np.full(pair_shape + (len(CLAIMS),), np.nan)
    for index, value in _symmetric(pairs, pair_shape, "claim_p").items():
        claim_p[index] = value
    for values in (angles, estimate, extremes_ci, claim_p):
        values[~both] = np.nan
    upper = np.triu(np.ones((n_factors, n_factors), bool), 1)[None, :, :, None] & np.isfinite(claim_p)
    claim_q = np.full(claim_p.shape, np.nan)
    claim_q[upper] = benjamini_hochberg(claim_p[upper])
    claim_q = np.fmin(claim_q, np.swapaxes(claim_q, 1, 2))
    null_median = _padded({index: value[0] for index, value in null_angles.items()}, pair_shape, max_rank)
    null_ci = _padded({index: value[1] for index, value in null_angles.items()}, pair_shape, max_rank, 2)
    null_median[~both], null_ci[~both] = np.nan, np.nan
    floored = below_floor(rank, significance_rank, structure_q, fitted.significance)
    relation = relations(rank, structure_q, claim_q, fitted.significance, bool(fitted.n_bootstrap), floored)
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
        "subspace_rank": (fd, rank),
        "significance_rank": (fd, significance_rank),
        "variance_share": (fd + ("component",), share),
        "site_variance_share": (fd + ("component",), site_share),
        "singular_value": (fd + ("component",), singular),
        "noise_singular_value": (fd + ("component",), noise_singular),
        "whitened_singular_value": (fd + ("component",), white_singular),
        "explained": (fd + ("component",), explained),
        "outlier_tokens": (("layer",), [fits[layer].outlier_tokens for layer in layers]),
        "unit_shared_noise": (("layer",), [fits[layer].shared_noise for layer in layers]),
        "effective_groups": (("layer",), [fits[layer].effective_groups for layer in layers]),
        "whitened": (("layer",), [fits[layer].whitened for layer in layers]),
        "whitening_understatement": (("layer",), [fits[layer].understatement for layer in layers]),
        "rounding_bias": (("layer",), [fits[layer].rounding_bias for layer in layers]),
        "rounding_inflation": (("layer",), [fits[layer].rounding_inflation for layer in layers]),
        "between_fraction": (fd, np.array([[f.between_fraction for f in fits[layer].factors] for layer in layers])),
        "structure_p": (fd, structure_p),
        "structure_q": (fd, structure_q),
        "basis": (fd + ("d_model", "basis_vector"), basis),
        "angles": (pair + ("angle",), angles),
        "angles_estimate": (pair + ("angle",), estimate),
        "min_angle": (pair, angles[..., 0]),
        "min_angle_estimate": (pair, estimate[..., 0]),
        "min_angle_ci": (pair + ("bound",), extremes_ci[..., 0, :]),
        "max_angle": (pair, _largest(angles)),
        "max_angle_estimate": (pair, _largest(estimate)),
        "max_angle_ci": (pair + ("bound",), extremes_ci[..., 1, :]),
        "overlap": (pair, np.where(both, _overlap(_symmetric(pairs, pair_shape, "angles"), pair_shape), np.nan)),
        "null_angles": (pair + ("angle",), null_median),
        "null_angles_ci": (pair + ("angle", "bound"), null_ci),
        "null_min_angle": (pair, null_median[..., 0]),
        "null_min_angle_ci": (pair + ("bound",), null_ci[..., 0, :]),
        "claim_p": (pair + ("claim",), claim_p),
        "claim_q": (pair + ("claim",), claim_q),
        "relation": (pair, relation),
    }
    if fitted.has_weights_:
        for kind, head_dim in (("q", "head"), ("k", "kv_head")):
            table = _padded(heads[kind], shape + (len(fitted.heads_[kind]),), max_rank)
            head_overlap = _overlap(heads[kind], shape + (len(fitted.heads_[kind]),))
            table[~structured], head_overlap[~structured] = np.nan, np.nan
            data.update({
                f"{kind}_angles": (fd + (head_dim, "angle"), table),
                f"{kind}_min_angle": (fd + (head_dim,), table[..., 0]),
                f"{kind}_overlap": (fd + (head_dim,), head_overlap),
            })
    coords = {"layer": layers, "factor": np.array(names, dtype=object), "other": np.array(names, dtype=object),
              "bound": np.array(BOUNDS, dtype=object), "claim": np.array(CLAIMS, dtype=object),
              "head": fitted.heads_["q"], "kv_head": fitted.heads_["k"]}
    attrs = {
        "site": fitted.site_, "factors": names, "estimator": fitted.estimator, "intercepts": fitted.intercepts_ or "none",
        "classes": {name: design.classes[name].names for name in names},
        "head_angles": "computed from w_q, w_k" if fitted.has_weights_ else "not computed: the store has no weights",
        "fit": fitted.fit_options,
        "relation_rule": RELATION_RULE,
        "rank_rule": RANK_RULE,
        "n_null": fitted.n_null_,
        **fitted.resampling_,
        **{name: getattr(fitted, name) for name in ("n_bootstrap", "bootstrap_groups", "confidence", "significance",
                                                    "seed", "independence_deg", "orthogonality_deg", "relevance_floor")},
    }
    result = xr.Dataset(data, coords=coords, attrs=as_attrs(attrs))
    return state_multiplicity(describe(result, DESCRIPTIONS), "subspaces")


_HEAD_SPACE = {"q": "each head's read subspace, the column space of w_q[head] in d_model (the directions of the "
                    "attention's input, attn_in, that its queries read)",
               "k": "each kv_head's read subspace, the column space of w_k[kv_head] in d_model (the directions of the "
                    "attention's input, attn_in, that its keys read)"}

DESCRIPTIONS = {
    "n_classes": "classes the factor is read with, the pooled class (attrs classes: '<N other classes>') included",
    "n_tokens": "analysed tokens the factor is read on (those its label applies to)",
    "pooled_classes": "classes pooled into one: beyond max_classes (the rarest), or whose tokens lie in too few groups "
                      "of samples for their noise to be resampled; 0 when none is",
    "pooled_tokens": "tokens of the pooled class (0 without one)",
    "label_nmi": "normalised mutual information of the two factors' labels on the tokens both read (arithmetic-mean "
                 "normalisation): 0 unrelated, 1 each determines the other; NaN on the diagonal and without shared tokens",
    "shared_tokens": "analysed tokens both factors are read on",
    "variance_inflation": "noise variance of the joint fit's centred effects of the factor over that of a fit of the factor "
                          "alone: 1 for a balanced crossed design, larger the more the labels are correlated; NaN with "
                          "the marginal estimator",
    "condition_number": "condition number of the joint fit's unit-diagonal Z'Z beyond its trivial null directions (above "
                        "CONDITION_WARNING, 100, a warning is logged: the factors' labels are strongly associated); NaN "
                        "with the marginal estimator",
    "singular_value": "singular values, descending, of the factor's count-weighted centred effects sqrt(n_c) E[c] (class x "
                      "d_model; joint or marginal estimator), in the site's units; NaN pads the components the factor lacks (at most classes - 1)",
    "explained": "cumulative share of the factor's between-class variance (its squared singular values) carried by the "
                 "leading components",
    "between_fraction": "the factor's between-class variance (sum of its squared singular values) over the total variance "
                        "of its tokens around their mean, in [0, 1]",
    "basis": "orthonormal basis of the factor's subspace in d_model (coordinate basis_vector: the leading right singular "
             "vectors of its weighted effects, estimated whitened and mapped back where the layer is whitened); NaN "
             "beyond subspace_rank",
    "angles": "principal angles in degrees, ascending (dim angle), between the two factors' subspaces; NaN beyond the "
              "smaller rank, on the diagonal and where either factor's rank is 0",
    "min_angle": "the smallest principal angle between the two factors' subspaces, in degrees (0: a shared direction)",
    "min_angle_estimate": "the smallest angle corrected for the noise's bias (median-unbiased), in degrees",
    "max_angle": "the largest principal angle between the two factors' subspaces, in degrees (90: orthogonal)",
    "max_angle_estimate": "the largest angle corrected for the noise's bias (median-unbiased), in degrees",
    "overlap": "mean squared cosine of the principal angles: 0 for orthogonal subspaces, 1 when one lies inside the other",
    "null_angles_ci": "central 1 - significance interval (dim bound) of the null angles: the principal angles, in degrees, "
                      "between the factor's noise-only subspaces (same rank) and the other's fitted one",
    "null_min_angle": "median smallest angle, in degrees, between the factor's noise-only subspaces (same rank) and the "
                      "other's fitted one: the smallest angle chance gives",
    "null_min_angle_ci": "central 1 - significance interval of that null smallest angle, in degrees",
    "relation": "the pair's relation: 'no structure', 'below relevance floor', 'orthogonal', 'dependent', 'independent', "
                "'undetermined', or '' "
                "without noise draws (attrs relation_rule)",
    **{f"{kind}_angles": f"principal angles in degrees, ascending (dim angle), between the factor's subspace and "
                         f"{_HEAD_SPACE[kind]}" for kind in "qk"},
    **{f"{kind}_min_angle": f"the smallest of {kind}_angles: the smallest angle, in degrees, between the factor's subspace "
                            f"and {_HEAD_SPACE[kind]}" for kind in "qk"},
    **{f"{kind}_overlap": f"mean squared cosine of {kind}_angles (0: the head reads nothing of the factor's subspace, 1: "
                          "its read subspace holds it or lies inside it)" for kind in "qk"},
    "claim": "the claims on a pair: orthogonal (every principal angle above 90 - orthogonality_deg), dependent (the "
             "smallest angle below independence_deg), independent (the smallest angle shown between the two)",
    "subspace_rank": "the rank that decides the factor's basis, angles, claims and spheres (attrs rank_rule): the "
                     "fixed rank, or the significant directions reaching the relevance floor, 0 when the structure "
                     "test is not shown",
    "significance_rank": "directions of the factor's effects standing above noise (deflated parallel analysis of the "
                         "effects, whitened where the noise is anisotropic, each step at rank_significance), before the relevance floor; NaN without "
                         "noise draws",
    "whitened_singular_value": "singular values of the weighted effects in coordinates whitened by the noise "
                               "covariance where it is anisotropic (inference.NoiseSpectrum; else singular_value): "
                               "what the rank's test compares",
    "variance_share": "each direction's share of the factor's between-class variance: its squared singular value "
                      "without the noise's inflation (inference.shrunk_variances) over that of the significant "
                      "directions together",
    "site_variance_share": "each direction's noise-corrected variance as a share of the site's total variance over the "
                           "factor's tokens",
    "noise_singular_value": "per step of the rank's test: the (1 - rank_significance) quantile of the whitened noise "
                            "draws' largest singular value with the leading directions before it projected out (to "
                            "compare with whitened_singular_value)",
    "structure_p": "p-value of 'the labels carry no information' (sign-flip null of the corrected influences; add-one)",
    "outlier_tokens": "analysed tokens whose norm exceeds OUTLIER_NORM (10) times the median of their block of "
                      "samples (sink tokens beyond the start token): counted, not left out of the fit",
    "unit_shared_noise": "the share of each token's noise that the tokens of its resampling unit share (a random "
                         "effect per document), estimated from the groups' residual sums (whitened where the tests are); the corrections of the "
                         "influences assume it (0: tokens independent; joint estimator only)",
    "effective_groups": "Kish's effective number of bootstrap groups, (sum v_g)^2 / sum v_g^2 with v_g a group's noise "
                        "variance at unit_shared_noise; where that share is above 0 and this below MIN_EFFECTIVE_GROUPS (10) the layer's "
                        "claims are withheld (relations and spheres undetermined): few groups carrying most of the noise make the sign flips too coarse",
    "rounding_bias": "how far the store dtype's rounding can move a class mean, over that mean's noise (the largest "
                     "over factors, classes and coordinates; a class mean averages the roundings of its cells of labels; "
                     "inference.rounding_bias): above 1 the rounding, not the noise, sets the class means' error, and "
                     "the draws carry it (rounding_inflation); NaN where the tokens' covariance is not streamed",
    "rounding_inflation": "by how much the noise draws' variance grows, on average over classes, when they carry the class "
                          "means' rounding in the store's dtype as well as their tokens' noise (layer.cell_rounding, "
                          "inference.rounding_inflation; 1: the rounding averages away, as in float32 stores and at a "
                          "language model's spreads; NaN where the tokens' covariance is not streamed, and the draws carry "
                          "the noise alone)",
    "whitened": "the layer's noise is anisotropic (inference.ANISOTROPY): the structure tests and ranks are judged, and "
                "the bases estimated, in coordinates whitened by the analysed tokens' covariance around the fit "
                "(inference.NoiseSpectrum) and mapped back; the noise draws estimate theirs the same way",
    "whitening_understatement": "the factor by which the structure test's null and the rank's noise are raised in a whitened "
                                "layer: whitened by their own covariance, the residuals' influences understate the noise of the "
                                "effects by m / (m - d_eff - 1) in expectation (an inverse Wishart's mean; m the tokens' degrees of "
                                "freedom, d_eff the dimensions the shrunk whitening takes from the data: inference.NoiseSpectrum."
                                "understatement); 1 where the layer is not whitened",
    "structure_q": "structure_p adjusted for the false-discovery rate over every layer and factor (Benjamini-Hochberg)",
    "angles_estimate": "the principal angles corrected for the noise's bias: the truth whose drawn angles have the "
                       "measured ones as their medians (the smallest and largest kept inside their intervals)",
    "min_angle_ci": "confidence interval of the smallest principal angle, inverted from draws around truths at other "
                    "angles, the other angles equal to it (upper bound) or at an upper estimate of their spread from it "
                    "(lower bound: inference.GAP_QUANTILE) (inference.AngleFamilies)",
    "max_angle_ci": "confidence interval of the largest principal angle (as min_angle_ci: the other angles equal to it "
                    "for the lower bound, at an upper estimate of their spread for the upper)",
    "claim_p": "p-value of each claim (orthogonal, dependent, independent) at its null's boundary, on the smallest angle",
    "claim_q": "claim_p adjusted for the false-discovery rate over every claim of the run (Benjamini-Hochberg)",
    "null_angles": "median angles between the factor's noise-only subspaces (same rank) and the other's fitted one, in "
                   "degrees: what chance gives",
}


def plan_factor_subspaces(dataset: xr.Dataset, config: SubspacesConfig) -> Plan:
    """The fit's Plan, finishing into the fitted FactorSubspaces (whose ``to_dataset()`` is the results
    group /subspaces: ranks, singular values against noise, principal angles between factors and with
    each head's read subspaces, their estimates and intervals, the claims and relations, the null,
    label association)."""
    return FactorSubspaces(config).plan(dataset)


factor_subspaces = Analysis("subspaces", SubspacesConfig, plan_factor_subspaces, reads=(*D_MODEL_SITES, "valid", "w_q",
                            "w_k"), summary="factor subspaces of the residual stream: ranks, angles, claims, relations")
