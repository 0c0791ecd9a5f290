"""The least-squares fit of factor effects from streamed sufficient statistics.

**Joint** (the default): each analysed token x is modelled as x = mu_p + sum_a E_a[c_a] + e,
with an intercept mu_p for the token's *cell* p (the set of factors that apply to it, its *pattern*,
and its stratum: its class of the intercept label, such as its role, so that a factor read on
tokens of several kinds does not absorb the kinds' differences) and one effect per applying factor
a for the token's class c_a. A factor that does not apply to a token
(``digit_value[role=digit]`` on a sign, say) adds nothing to that token's row of the one-hot
design Z, and the token's pattern gives it its own intercept, so tokens of another kind never
pull on the factor's effects; tokens to which no factor applies are left out. The effects solve
the normal equations (Z'Z) B = Z'X, where Z'Z holds the class counts and the co-occurrence counts
between factors and Z'X the sums of the vectors per class and per pattern: sums over tokens,
streamed in one pass.

Z'Z is singular: within a pattern each factor's classes add up to the intercept, so each
factor's effects are fixed only up to one constant vector. The fit takes the pseudo-inverse of
Z'Z scaled to unit diagonal (any generalised inverse gives the same fitted values) and centres
each factor's effects with its class counts (sum_c n_c E_a[c] = 0), which removes exactly that
freedom. Anything free beyond it (two factors with identical labels, or groups of classes that
never occur with the rest) leaves centred effects that the data do not determine: the fit then
refuses, naming the factors. The condition number of the scaled Z'Z beyond those trivial
directions and each factor's variance inflation (the noise of its centred effects relative to a
fit of it alone; 1 for a balanced crossed design) say how much correlated labels cost.

**Marginal**: each factor's effects are its class means less the mean of its tokens, as if the
other factors did not exist (correlated factors leak into each other's effects).

Both give, per factor, the count-weighted centred effects W_a = sqrt(n_c) E_a[c] (class x d),
whose leading right singular vectors span the factor's subspace, and the *influence* of each group
of samples: the part of W_a that the group's noise makes, read from its fitted residuals. Fitted
residuals hold only (1 - leverage) of the noise (a group whose tokens make up a share h of a
class's tokens pulls that class's fitted mean towards itself by h), so each group's residual sums
are corrected as in econometrics' CR2 cluster-robust variance (Bell & McCaffrey 2002): multiplied
by (I - H_gg)^(-1/2), the inverse square root of one minus the group's block of the hat matrix.
Then the influences' second moments are exactly those of the noise they stand for when the noise
is independent between tokens with one covariance, whatever the numbers of classes and groups, the
class frequencies or the confounding of the labels. H_gg = Z_g (Z'Z)^- Z_g' acts on the group's
tokens, but the correction of their residual sums Z_g' e_g needs only Z_g'Z_g (the group's counts)
and (Z'Z)^-: Z_g' f(H_gg) = f(Z_g'Z_g (Z'Z)^-) Z_g' for any power series f, computed from two small
eigen-decompositions per group, once per design (``residual_corrections``). A direction that one
group alone determines (H_gg's eigenvalue 1: a class all of whose tokens lie in that group) has no
residual to correct; ``factors.discover_classes`` pools such classes before the fit.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
from scipy import sparse

from .errors import AnalysisError

ESTIMATORS = ("joint", "marginal")
NULL_TOLERANCE = 1e-10
"""Eigenvalues of the unit-diagonal Z'Z below this share of the largest count as zero."""
SHARE_STEP = 1.25
"""The grid of the shared noise's share: relative steps of 25 % (its maps are computed once per step)."""
SHARE_FLOOR = 1e-4
"""A share below this is 0 (tokens independent)."""
SAME_MODELS = 1e-6
"""When the unit-shared and the independent noise models' residual covariances are this close to parallel
(units of one token), the share cannot be told and does not matter."""
FULL_LEVERAGE = 1e-9
"""A group's leverage within this of 1 determines its direction alone: its residual there is zero, left uncorrected."""


@dataclass(frozen=True)
class Layout:
    """The columns of the one-hot design: one intercept per cell, then each factor's classes.

    patterns are the intercept cells, sorted: a token's pattern (bit a set: factor a applies) plus
    the code of its stratum (its class of the intercept label, e.g. its role) shifted past the
    pattern bits, so that tokens of different kinds never share an intercept; sizes are the
    factors' numbers of classes."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    patterns: tuple[int, ...]

    @property
    def n_columns(self) -> int:
        return len(self.patterns) + sum(self.sizes)

    def block(self, factor: int) -> slice:
        start = len(self.patterns) + sum(self.sizes[:factor])
        return slice(start, start + self.sizes[factor])

    def token_columns(self, pattern_bits: np.ndarray, codes: list[np.ndarray]) -> np.ndarray:
        """(..., 1 + factors) int32 design columns of each token: its pattern's intercept, then each
        factor's class column; -1 where the factor does not apply (everywhere for tokens of no factor)."""
        columns = np.full(pattern_bits.shape + (1 + len(codes),), -1, dtype="int32")
        counted = pattern_bits > 0
        columns[..., 0] = np.where(counted, np.searchsorted(self.patterns, pattern_bits), -1)
        for number, code in enumerate(codes):
            columns[..., 1 + number] = np.where(code >= 0, code + self.block(number).start, -1)
        return columns


@dataclass
class Counts:
    """Label-only statistics of a design: Z'Z (columns x columns) and, per bootstrap group, Z_g'Z_g
    stacked as a sparse (groups * columns, columns) matrix."""

    gram: np.ndarray
    group_grams: sparse.csr_matrix
    n_groups: int
    unit_grams: sparse.csr_matrix | None = None
    """Per group, sum over its resampling units u of d_u d_u' (d_u: the unit's tokens per column), stacked
    as group_grams: what noise shared within a unit adds to the group's sums (``working_covariances``)."""

    def factor_counts(self, layout: Layout, factor: int) -> np.ndarray:
        block = layout.block(factor)
        return np.diag(self.gram)[block]

    def contingency(self, layout: Layout, a: int, b: int) -> np.ndarray:
        """Tokens of each pair of classes of factors a and b (class of a x class of b)."""
        return self.gram[layout.block(a), layout.block(b)]

    def group_gram(self, group: int) -> sparse.csr_matrix:
        n = self.gram.shape[0]
        return self.group_grams[group * n: (group + 1) * n]

    def unit_gram(self, group: int) -> sparse.csr_matrix:
        n = self.gram.shape[0]
        return self.unit_grams[group * n: (group + 1) * n]

    def effective_groups(self, layout: Layout, share: float) -> float:
        """Kish's effective number of bootstrap groups, (sum_g v_g)^2 / sum_g v_g^2, v_g the variance of a
        group's noise sum per unit of token variance: (1 - share) n_g + share sum_(u in g) m_u^2 (n_g its tokens,
        m_u a unit's). A few groups carrying most of the noise (one document holding half the store, a handful
        of long ones) leave the sign flips too few independent draws, whatever the number of groups."""
        cells = len(layout.patterns)
        tokens = np.array([self.group_gram(g)[:cells, :cells].diagonal().sum() for g in range(self.n_groups)])
        variance = tokens
        if share > 0 and self.unit_grams is not None:
            squares = np.array([self.unit_gram(g)[:cells, :cells].sum() for g in range(self.n_groups)])
            variance = (1 - share) * tokens + share * squares
        return float(variance.sum() ** 2 / (variance**2).sum()) if variance.sum() > 0 else 0.0

    def tokens_per_unit(self, layout: Layout) -> float:
        """The token-weighted mean tokens of a resampling unit, sum_u m_u^2 / sum_u m_u (each token is in one
        intercept cell, the layout's first columns); 1 without units."""
        cells = len(layout.patterns)
        tokens = np.diag(self.gram)[:cells].sum()
        if self.unit_grams is None or not tokens > 0:
            return 1.0
        squares = sum(self.unit_gram(g)[:cells, :cells].sum() for g in range(self.n_groups))
        return float(squares / tokens)

    def working_covariances(self, share: float) -> list[np.ndarray]:
        """Per group, the covariance of its sums Z_g'e per unit of noise variance when `share` of each
        token's noise is shared by the tokens of its resampling unit (a random effect per unit) and the
        rest is independent: (1 - share) Z_g'Z_g + share sum_u d_u d_u'."""
        grams = [self.group_gram(g).toarray() for g in range(self.n_groups)]
        if share == 0 or self.unit_grams is None:
            return grams
        return [(1 - share) * gram + share * self.unit_gram(g).toarray() for g, gram in enumerate(grams)]


def count_units(columns: np.ndarray, unit_keys: np.ndarray, all_keys: np.ndarray, n_columns: int) -> sparse.csr_matrix:
    """One block's tokens per (resampling unit, design column) (units, columns), units in the order of
    `all_keys` (sorted)."""
    columns = columns.reshape(-1, columns.shape[-1])
    units = np.searchsorted(all_keys, np.asarray(unit_keys).ravel())
    rows, which = np.nonzero(columns >= 0)
    return sparse.csr_matrix((np.ones(rows.size), (units[rows], columns[rows, which])), shape=(len(all_keys), n_columns))


def stacked_unit_grams(unit_counts: sparse.csr_matrix, unit_groups: np.ndarray, n_groups: int) -> sparse.csr_matrix:
    """Per group g, sum over its units of d_u d_u' (rows of `unit_counts`), stacked (groups * columns, columns)."""
    n_columns = unit_counts.shape[1]
    coo = unit_counts.tocoo()
    spread = sparse.csr_matrix((coo.data, (coo.row, unit_groups[coo.row] * n_columns + coo.col)),
                               shape=(unit_counts.shape[0], n_groups * n_columns))
    return (spread.T @ unit_counts).tocsr()


def count_block(columns: np.ndarray, groups: np.ndarray, n_columns: int, n_groups: int) -> sparse.csr_matrix:
    """One block's stacked Z_g'Z_g (groups * columns, columns) from its tokens' design columns and
    (sample, pos) groups."""
    columns = columns.reshape(-1, columns.shape[-1])
    token_group = np.asarray(groups).ravel()
    rows, which = np.nonzero(columns >= 0)
    cols = columns[rows, which]
    ones = np.ones(rows.size)
    design = sparse.csr_matrix((ones, (rows, cols)), shape=(len(columns), n_columns))
    grouped = sparse.csr_matrix((ones, (rows, token_group[rows] * n_columns + cols)),
                                shape=(len(columns), n_groups * n_columns))
    return (grouped.T @ design).tocsr()


@dataclass
class JointSolution:
    """A generalised inverse of Z'Z, what it says about the design, and the maps from each group's
    residual sums to its corrected influence on the factors' effects (None without groups)."""

    g_inverse: np.ndarray  # (columns, columns)
    condition: float  # of the unit-diagonal Z'Z beyond the trivial directions
    variance_inflation: np.ndarray  # (factors,)
    influence_maps: np.ndarray | None = None  # (groups, factor columns, columns) float32


def centre(effects: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Effects (..., class, d) less their count-weighted mean over classes."""
    mean = np.tensordot(counts, effects, axes=(0, -2)) / counts.sum()
    return effects - np.expand_dims(mean, -2)


def solve_joint(counts: Counts, layout: Layout, url: str) -> JointSolution:
    """The joint fit's generalised inverse; an AnalysisError when it cannot separate the factors."""
    gram = counts.gram
    scale = np.sqrt(np.diag(gram))
    values, vectors = np.linalg.eigh(gram / np.outer(scale, scale))
    null = values < NULL_TOLERANCE * values[-1]
    n_factors = len(layout.names)
    if null.sum() > n_factors:
        raise AnalysisError(_confounded_message(vectors[:, null] / scale[:, None], counts, layout, url))
    kept = ~null
    g_inverse = (vectors[:, kept] / values[kept]) @ vectors[:, kept].T / np.outer(scale, scale)
    inflation = np.empty(n_factors)
    for a in range(n_factors):
        n = counts.factor_counts(layout, a)
        block = layout.block(a)
        covariance = centre(centre(g_inverse[block, block], n).T, n)  # C G_aa C'
        inflation[a] = np.trace(np.sqrt(np.outer(n, n)) * covariance) / (len(n) - 1)
    maps = influence_maps(counts, layout, g_inverse) if counts.n_groups > 1 else None
    return JointSolution(g_inverse, float(values[-1] / values[kept][0]), inflation, maps)


def influence_maps(counts: Counts, layout: Layout, g_inverse: np.ndarray, share: float = 0.0) -> np.ndarray:
    """(groups, factor columns, columns) float32: each group's map from its residual sums to its corrected
    influence on the factors' effects, for noise with `share` of it shared within resampling units."""
    start = len(layout.patterns)
    return np.stack([g_inverse[start:] @ correction
                     for correction in residual_corrections(counts, g_inverse, share)]).astype("float32")


@dataclass
class SharedNoise:
    """Estimates, per layer, the share of each token's noise that the tokens of its resampling unit share
    (a random effect per document: topic, style, a long context), from the groups' residual sums R_g
    (columns, d): E[R_g R_g'] = tr(S) (a V0_g + b V1_g), V0_g and V1_g the covariances of R_g per unit of
    independent and of unit-shared noise (``residual_corrections``), fitted by least squares over every
    element of every group; the share is b / (a + b), each clipped at 0, rounded to a grid of relative
    steps of SHARE_STEP (0 below SHARE_FLOOR). ``corrections`` gives the influence maps and traces at a
    share, once per share of the grid."""

    counts: Counts
    layout: Layout
    solution: JointSolution
    independent: np.ndarray  # (groups, columns, columns) V0_g
    shared: np.ndarray  # (groups, columns, columns) V1_g
    normal: np.ndarray  # (2, 2) inner products of the two
    found: dict = field(default_factory=dict)

    @classmethod
    def of(cls, counts: Counts, layout: Layout, solution: JointSolution) -> SharedNoise | None:
        """None without units or groups, or when units of one token make the two models the same."""
        if counts.unit_grams is None or counts.n_groups < 2:
            return None
        parts = []
        for share in (0.0, 1.0):
            covariances = counts.working_covariances(share)
            total = sum(covariances)
            found = []
            for group, covariance in enumerate(covariances):
                found.append(residual_covariance(counts.group_gram(group).toarray(), solution.g_inverse, covariance, total))
            parts.append(np.stack(found))
        normal = np.array([[np.sum(x * y) for y in parts] for x in parts])
        if normal[0, 0] <= 0 or 1 - normal[0, 1] ** 2 / (normal[0, 0] * normal[1, 1]) < SAME_MODELS:
            return None
        return cls(counts, layout, solution, parts[0].astype("float32"), parts[1].astype("float32"), normal)

    def estimate(self, residuals: np.ndarray) -> float:
        """The share, from the groups' residual sums (groups, columns, d), on the grid."""
        return self.share_of(self.readings(residuals))

    def readings(self, residuals: np.ndarray, basis: np.ndarray | None = None) -> np.ndarray:
        """(2, d) what the two models read along each column e of an orthonormal `basis` (d, d; the store's
        coordinates when None): sum_g <V_g, (R_g u_e)(R_g u_e)'> for V_g of independent and of shared noise.
        Residuals whitened by P = U diag(w)^(1/2) U' have R_g P^2 R_g' = sum_e w_e (R_g u_e)(R_g u_e)', so
        ``share_of`` reads them under any such whitening from these (d,) sums alone."""
        residuals = residuals.astype("float32")
        if basis is not None:
            residuals = residuals @ basis.astype("float32")
        return np.stack([np.einsum("gie,gie->e", np.matmul(part, residuals), residuals, dtype="float64")
                         for part in (self.independent, self.shared)])

    def share_of(self, readings: np.ndarray, weights: np.ndarray | None = None) -> float:
        """The share from ``readings``, under the whitening of squared eigenvalues `weights` along their basis
        (none when None), on the grid."""
        projected = readings.sum(axis=1) if weights is None else readings @ weights
        independent, shared = np.maximum(np.linalg.solve(self.normal, projected), 0.0)
        share = shared / (independent + shared) if independent + shared > 0 else 0.0
        if share < SHARE_FLOOR:
            return 0.0
        return float(min(SHARE_STEP ** np.round(np.log(share) / np.log(SHARE_STEP)), 1.0))

    def corrections(self, share: float) -> tuple[np.ndarray, list[NoiseTraces]]:
        """The influence maps and the structure test's traces at `share` (computed once per share)."""
        if share not in self.found:
            maps = influence_maps(self.counts, self.layout, self.solution.g_inverse, share)
            self.found[share] = maps, noise_traces(self.counts, self.layout, replace(self.solution, influence_maps=maps), share)
        return self.found[share]


def residual_corrections(counts: Counts, g_inverse: np.ndarray, share: float = 0.0):
    """Per group g, the (columns, columns) map K_g that gives the group's residual sums R_g = Z_g' e_g
    (e the fitted residuals) the second moment of its true noise sums Z_g' u_g: K_g V_g K_g' = S_g, with
    S_g the working covariance of the group's sums (``Counts.working_covariances``: noise independent
    between tokens when `share` is 0, else partly shared within resampling units) and V_g = Cov(R_g) =
    S_g - Q_g G S_g - S_g G Q_g + Q_g G T G Q_g (Q_g = Z_g'Z_g, G = g_inverse, T = sum_h S_h). In the
    span of Q_g, K_g = S^(1/2) (S^(-1/2) V S^(-1/2))^(-1/2) S^(-1/2); outside it, the identity. With
    share 0 this is CR2's Z_g' (I - H_gg)^(-1/2) e_g exactly; with a share, Bell & McCaffrey's CR2 under
    that working covariance. Directions that the group alone determines (V's eigenvalue 0, FULL_LEVERAGE)
    are left alone."""
    identity = np.eye(g_inverse.shape[0])
    covariances = counts.working_covariances(share)
    total = sum(covariances)
    for group, covariance in enumerate(covariances):
        gram = counts.group_gram(group).toarray()
        values, vectors = np.linalg.eigh(gram)
        kept = values > NULL_TOLERANCE * max(values[-1], 1.0)
        if not kept.any():
            yield identity
            continue
        basis = vectors[:, kept]
        residual = residual_covariance(gram, g_inverse, covariance, total)
        root, inverse_root = _roots(basis.T @ covariance @ basis)
        kept_values, turn = np.linalg.eigh(inverse_root @ (basis.T @ residual @ basis) @ inverse_root)
        partial = kept_values > FULL_LEVERAGE
        scale = np.where(partial, 1 / np.sqrt(np.where(partial, kept_values, 1.0)), 1.0)
        within = root @ (turn * scale) @ turn.T @ inverse_root
        yield identity + basis @ (within - np.eye(len(within))) @ basis.T


def residual_covariance(gram: np.ndarray, g_inverse: np.ndarray, covariance: np.ndarray, total: np.ndarray) -> np.ndarray:
    """Cov(R_g) of a group's residual sums R_g = s_g - Q_g G sum_h s_h, its sums s_g of covariance S_g
    (`covariance`), T = sum_h S_h (`total`), Q_g = Z_g'Z_g (`gram`): S_g - Q_g G S_g - S_g G Q_g + Q_g G T G Q_g."""
    pulled = gram @ g_inverse
    return covariance - pulled @ covariance - covariance @ pulled.T + pulled @ total @ pulled.T


def _roots(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The symmetric square root of a positive definite matrix and its inverse."""
    values, vectors = np.linalg.eigh(matrix)
    values = np.maximum(values, NULL_TOLERANCE * values[-1])
    return (vectors * np.sqrt(values)) @ vectors.T, (vectors / np.sqrt(values)) @ vectors.T


def _confounded_message(null_vectors: np.ndarray, counts: Counts, layout: Layout, url: str) -> str:
    """Which factors' centred effects the null directions of Z'Z move."""
    moved = []
    for a in range(len(layout.names)):
        block = null_vectors[layout.block(a)]
        moved.append(np.linalg.norm(centre(block.T[:, :, None], counts.factor_counts(layout, a))[..., 0]))
    moved = np.asarray(moved)
    names = [name for name, size in zip(layout.names, moved) if size > 1e-3 * moved.max()]
    return (
        f"the joint fit cannot separate factors {names} in store {url}: the data do not determine some of "
        "their effects (their labels are the same or one determines the other, or groups of their classes "
        "never occur with the rest of the classes); drop one of them, choose factors that vary "
        "independently, or fit each factor alone with estimator='marginal'"
    )


def check_shared_tokens(counts: Counts, layout: Layout, url: str) -> None:
    """Every factor of a joint fit must share tokens with another: a factor read on tokens that no
    other factor reads is not fitted jointly with anything."""
    if len(layout.names) < 2:
        return
    for a, name in enumerate(layout.names):
        shared = sum(counts.contingency(layout, a, b).sum() for b in range(len(layout.names)) if b != a)
        if shared == 0:
            raise AnalysisError(
                f"factor {name!r} shares no token of store {url} with the other factors "
                f"{[n for n in layout.names if n != name]}: a joint fit cannot separate what never occurs "
                "together; choose factors that apply to common tokens, or fit each factor alone with "
                "estimator='marginal'"
            )


@dataclass
class FactorEffects:
    """One factor's count-weighted centred effects (class, d) and their influence per group (group, class, d)."""

    weighted: np.ndarray
    influence: np.ndarray


@dataclass
class NoiseTraces:
    """What the structure test needs of a factor's design (``noise_traces``): the (groups, groups) traces
    tr E[I_g I_h'] of its corrected influences per unit of noise, the variance of their diagonal's sum
    (the null's centre, an estimate) as a share of the variance of |W|^2 itself, and the share of that
    variance that comes from each group's own noise (|u_g|^2: the sign flips leave it out)."""

    traces: np.ndarray
    centre_variance: float
    diagonal_share: float


def noise_traces(counts: Counts, layout: Layout, solution: JointSolution | None, share: float = 0.0) -> list[NoiseTraces]:
    """Per factor, ``NoiseTraces`` for noise with one covariance S per token, independent between tokens
    (`share` 0) or with `share` of it shared within resampling units (``Counts.working_covariances``: the
    groups' sums have covariances S_g (x) S). With L_g the map from group g's residual sums R_g to its
    influence I_g, Cov(R_g, R_h) = S_g delta_gh - Q_g G S_h - S_g G Q_h + Q_g G T G Q_h (Q_g = Z_g'Z_g,
    G = (Z'Z)^-, T = sum_g S_g), so Cov(I_g, I_h) = M_gh (x) S with M_gh = L_g Cov(R_g, R_h) L_h'. The
    fitted residuals of different groups are correlated (a class's residuals sum to zero), which the
    influences keep: ``inference.structure_p`` takes tr(M_gh) tr(S) out of their cross products. And
    with Gaussian noise Var(sum_g |I_g|^2) / Var(|W|^2) = |M|_F^2 / |M_W|_F^2 (M the block matrix of the
    M_gh, M_W = A T A' the covariance of W per unit of noise, A the map from Z'X to W) and the share of
    Var(|W|^2) that the groups' own noises u_g make, sum_g |A S_g A'|_F^2 / |M_W|_F^2, neither of which
    depends on S. The marginal estimator (`solution` None) assumes independent tokens."""
    found = []
    for a in range(len(layout.names)):
        block = layout.block(a)
        n = counts.factor_counts(layout, a)
        weight = np.sqrt(n)[:, None]
        if solution is not None:
            start = len(layout.patterns)
            rows = slice(block.start - start, block.stop - start)
            g_inverse = solution.g_inverse
            grams = [counts.group_gram(g).toarray() for g in range(counts.n_groups)]
            covariances = counts.working_covariances(share)
            maps = [weight * centre(solution.influence_maps[g][rows].astype("float64"), n) for g in range(counts.n_groups)]
            fit_map = weight * centre(g_inverse[block], n)
        else:
            g_inverse = np.diag(1 / n)
            grams = covariances = [np.diag(counts.group_gram(g).diagonal()[block]) for g in range(counts.n_groups)]
            maps = [weight * centre(np.diag(_leverage_correction(np.diag(gram) / n) / n), n) for gram in grams]
            fit_map = weight * centre(g_inverse, n)
        total = sum(covariances)
        pulled = np.stack([m @ q for m, q in zip(maps, grams)]) @ g_inverse  # L_g Q_g G
        own = np.stack([m @ c for m, c in zip(maps, covariances)])  # L_g S_g
        # M = X Y' + blockdiag(L_g S_g L_g'), X = [P, -P, -O] and Y = [P T, O, P] (P = pulled, O = own):
        # its traces and Frobenius norm from (groups, class, 3 columns) factors, never the whole M
        left = np.concatenate([pulled, -pulled, -own], axis=2)
        right = np.concatenate([pulled @ total, own, pulled], axis=2)
        diagonal = np.matmul(own, np.swapaxes(np.stack(maps), 1, 2))  # L_g S_g L_g'
        traces = np.einsum("gkc,hkc->gh", left, right)
        traces[np.diag_indices(counts.n_groups)] += np.trace(diagonal, axis1=1, axis2=2)
        flat_left, flat_right = (x.reshape(-1, x.shape[-1]) for x in (left, right))
        square = (np.sum((flat_left.T @ flat_left) * (flat_right.T @ flat_right))
                  + 2 * np.sum(np.matmul(left, np.swapaxes(right, 1, 2)) * diagonal) + np.sum(diagonal**2))
        within = np.sum((fit_map @ total @ fit_map.T) ** 2)
        alone = sum(np.sum((fit_map @ c @ fit_map.T) ** 2) for c in covariances)
        found.append(NoiseTraces(traces, float(square / within), float(alone / within)))
    return found


def _leverage_correction(share: np.ndarray) -> np.ndarray:
    """CR2's factor 1 / sqrt(1 - h) of a class mean's leverage h on a group (1 where h is 1)."""
    return np.where(share < 1 - FULL_LEVERAGE, 1 / np.sqrt(np.maximum(1 - share, FULL_LEVERAGE)), 1.0)


def joint_fit(sums: np.ndarray, counts: Counts, solution: JointSolution) -> tuple[np.ndarray, np.ndarray | None]:
    """The joint fit's coefficients (columns, d) and the groups' residual sums (groups, columns, d; None
    without groups), from the sums of the vectors per (group, column) (groups, columns, d)."""
    theta = solution.g_inverse @ sums.sum(axis=0)
    if solution.influence_maps is None:
        return theta, None
    return theta, np.stack([sums[g] - counts.group_gram(g) @ theta for g in range(sums.shape[0])])


def joint_effects(theta: np.ndarray, residuals: np.ndarray | None, layout: Layout, counts: Counts,
                  maps: np.ndarray | None) -> list[FactorEffects]:
    """Per factor, the joint fit's weighted centred effects and their corrected group influences
    (``joint_fit``; maps: ``influence_maps``)."""
    start = len(layout.patterns)
    if residuals is None:
        influence = np.zeros((1, theta.shape[0] - start, theta.shape[1]))
    else:
        influence = np.matmul(maps, residuals.astype("float32")).astype("float64")
    found = []
    for a in range(len(layout.names)):
        block = layout.block(a)
        n = counts.factor_counts(layout, a)
        weight = np.sqrt(n)[:, None]
        found.append(FactorEffects(weight * centre(theta[block], n),
                                   weight * centre(influence[:, block.start - start: block.stop - start], n)))
    return found


def marginal_effects(sums: np.ndarray, counts: Counts, layout: Layout) -> list[FactorEffects]:
    """Per factor, its class means less the mean of its tokens (weighted), and their corrected group
    influences (a class mean's leverage on a group's tokens is the group's share of the class)."""
    found = []
    for a in range(len(layout.names)):
        block = layout.block(a)
        group_sums = sums[:, block]
        group_counts = np.stack([counts.group_gram(g).diagonal()[block] for g in range(sums.shape[0])])
        n = group_counts.sum(axis=0)
        means = group_sums.sum(axis=0) / n[:, None]
        influence = _leverage_correction(group_counts / n)[..., None] * (group_sums - group_counts[..., None] * means) / n[:, None]
        weight = np.sqrt(n)[:, None]
        found.append(FactorEffects(weight * centre(means, n), weight * centre(influence, n)))
    return found
