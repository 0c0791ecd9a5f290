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

from dataclasses import dataclass

import numpy as np
from scipy import sparse

from .errors import AnalysisError

ESTIMATORS = ("joint", "marginal")
NULL_TOLERANCE = 1e-10
"""Eigenvalues of the unit-diagonal Z'Z below this share of the largest count as zero."""
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

    def factor_counts(self, layout: Layout, factor: int) -> np.ndarray:
        block = layout.block(factor)
        return np.diag(self.gram)[block]

    def contingency(self, layout: Layout, a: int, b: int) -> np.ndarray:
        """Tokens of each pair of classes of factors a and b (class of a x class of b)."""
        return self.gram[layout.block(a), layout.block(b)]

    def group_gram(self, group: int) -> sparse.csr_matrix:
        n = self.gram.shape[0]
        return self.group_grams[group * n: (group + 1) * n]


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
    maps = None
    if counts.n_groups > 1:
        start = len(layout.patterns)
        maps = np.stack([g_inverse[start:] @ correction
                         for correction in residual_corrections(counts, g_inverse)]).astype("float32")
    return JointSolution(g_inverse, float(values[-1] / values[kept][0]), inflation, maps)


def residual_corrections(counts: Counts, g_inverse: np.ndarray):
    """Per group g, the (columns, columns) map K_g with K_g Z_g' e = Z_g' (I - H_gg)^(-1/2) e for the
    group's fitted residuals e, H_gg = Z_g G Z_g' (G = g_inverse): with Z_g'Z_g = W L W' and
    L^(1/2) W' G W L^(1/2) = O M O' (M: H_gg's non-zero eigenvalues), K_g = I + W L^(1/2) O
    ((1 - M)^(-1/2) - 1) O' L^(-1/2) W'. Eigenvalues of 1 (FULL_LEVERAGE) are left alone."""
    identity = np.eye(g_inverse.shape[0])
    for group in range(counts.n_groups):
        values, vectors = np.linalg.eigh(counts.group_gram(group).toarray())
        kept = values > NULL_TOLERANCE * max(values[-1], 1.0)
        if not kept.any():
            yield identity
            continue
        root = vectors[:, kept] * np.sqrt(values[kept])
        leverage, turn = np.linalg.eigh(root.T @ g_inverse @ root)
        partial = leverage < 1 - FULL_LEVERAGE
        boost = np.where(partial, 1 / np.sqrt(np.where(partial, 1 - leverage, 1.0)) - 1, 0.0)
        inverse_root = vectors[:, kept] / np.sqrt(values[kept])
        yield identity + (root @ turn) @ (boost[:, None] * (turn.T @ inverse_root.T))


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


def noise_traces(counts: Counts, layout: Layout, solution: JointSolution | None) -> list[NoiseTraces]:
    """Per factor, ``NoiseTraces`` for noise independent between tokens with one covariance S. With L_g
    the map from group g's residual sums R_g to its influence I_g, Cov(R_g, R_h) = Q_g delta_gh - Q_g G Q_h
    (Q_g = Z_g'Z_g, G = (Z'Z)^-), so Cov(I_g, I_h) = M_gh (x) S with M_gh = L_g Cov(R_g, R_h) L_h'. The
    fitted residuals of different groups are correlated (a class's residuals sum to zero), which the
    influences keep: ``inference.structure_p`` takes tr(M_gh) tr(S) out of their cross products. And
    with Gaussian noise Var(sum_g |I_g|^2) / Var(|W|^2) = |M|_F^2 / |M_W|_F^2 (M the block matrix of the
    M_gh, M_W the covariance of W per unit of noise) and the share of Var(|W|^2) that the groups' own
    noises u_g make, sum_g |M'_g|_F^2 / |M_W|_F^2 (M'_g = A Q_g A', A the map from Z'X to W), neither
    of which depends on S."""
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
            maps = [weight * centre(solution.influence_maps[g][rows].astype("float64"), n) for g in range(counts.n_groups)]
            covariance = centre(centre(g_inverse[block, block], n).T, n)
            fit_map = weight * centre(g_inverse[block], n)
        else:
            g_inverse = np.diag(1 / n)
            grams = [np.diag(counts.group_gram(g).diagonal()[block]) for g in range(counts.n_groups)]
            maps = [weight * centre(np.diag(_leverage_correction(np.diag(gram) / n) / n), n) for gram in grams]
            covariance = centre(centre(g_inverse, n).T, n)
            fit_map = weight * centre(g_inverse, n)
        along = np.stack([m @ q for m, q in zip(maps, grams)])  # L_g Q_g
        flat = along.reshape(-1, along.shape[-1])
        blocks = -((flat @ g_inverse) @ flat.T).reshape(along.shape[0], along.shape[1], along.shape[0], along.shape[1])
        for g, (m, a_g) in enumerate(zip(maps, along)):
            blocks[g, :, g, :] += a_g @ m.T
        traces = np.einsum("gkhk->gh", blocks)
        within = np.sum((weight * covariance * weight.T) ** 2)  # |M_W|^2, M_W the covariance of W per unit of noise
        own = sum(np.sum((fit_map @ gram @ fit_map.T) ** 2) for gram in grams)
        found.append(NoiseTraces(traces, float(np.sum(blocks**2) / within), float(own / within)))
    return found


def _leverage_correction(share: np.ndarray) -> np.ndarray:
    """CR2's factor 1 / sqrt(1 - h) of a class mean's leverage h on a group (1 where h is 1)."""
    return np.where(share < 1 - FULL_LEVERAGE, 1 / np.sqrt(np.maximum(1 - share, FULL_LEVERAGE)), 1.0)


def joint_effects(sums: np.ndarray, counts: Counts, layout: Layout, solution: JointSolution) -> list[FactorEffects]:
    """Per factor, the joint fit's weighted centred effects and their corrected group influences, from
    the sums of the vectors per (group, column) (groups, columns, d)."""
    theta = solution.g_inverse @ sums.sum(axis=0)
    start = len(layout.patterns)
    if solution.influence_maps is None:
        influence = np.zeros((1, theta.shape[0] - start, theta.shape[1]))
    else:
        residuals = np.stack([sums[g] - counts.group_gram(g) @ theta for g in range(sums.shape[0])])
        influence = np.matmul(solution.influence_maps, residuals.astype("float32")).astype("float64")
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
