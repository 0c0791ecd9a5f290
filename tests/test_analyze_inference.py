"""The statistics' building blocks against brute force: the leverage correction of the residuals, the
traces of the structure test, the noise-aware rank, the shrinkage of singular values, the turns to
target angles, the search of a family of truths, Benjamini-Hochberg and the tail p-values."""
from __future__ import annotations

import sys

import numpy as np
import pytest
from scipy import sparse
from scipy.stats import false_discovery_control, norm

from orthosphere.analyze.design import (
    Counts,
    Layout,
    SharedNoise,
    count_units,
    influence_maps,
    noise_traces,
    residual_corrections,
    solve_joint,
    stacked_unit_grams,
)
from orthosphere.analyze.geometry import principal_angles
from orthosphere.analyze.inference import (
    AngleFamilies,
    Complement,
    FamilySearch,
    WhitenedDraws,
    basic_interval,
    benjamini_hochberg,
    cosines_against,
    defined_quantile,
    denoised,
    drawn_subspaces,
    interval_levels,
    noise_rank,
    tail_p,
    turned,
)
from tests.synthetic import bases_at_angles


def small_design(seed: int = 0, n_tokens: int = 300, n_groups: int = 5):
    """Two correlated factors (4 and 3 classes) on one intercept, tokens in groups: the one-hot design Z
    (token, column), the group of each token and the Counts and Layout of the fit."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 4, n_tokens)
    b = np.where(rng.random(n_tokens) < 0.4, a % 3, rng.integers(0, 3, n_tokens))
    groups = rng.integers(0, n_groups, n_tokens)
    columns = np.stack([np.zeros(n_tokens, int), 1 + a, 5 + b], axis=1)
    design = np.zeros((n_tokens, 8))
    design[np.arange(n_tokens)[:, None], columns] = 1
    grams = sparse.vstack([sparse.csr_matrix(design[groups == g].T @ design[groups == g]) for g in range(n_groups)])
    return design, groups, Counts(design.T @ design, grams.tocsr(), n_groups), Layout(("a", "b"), (4, 3), (1,))


def test_the_leverage_correction_is_cr2_on_the_groups_tokens():
    """K_g Z_g' e equals Z_g' (I - H_gg)^(-1/2) e for fitted residuals e, computed on the tokens."""
    design, groups, counts, layout = small_design()
    g_inverse = solve_joint(counts, layout, "test").g_inverse
    hat = design @ g_inverse @ design.T
    residuals = (np.eye(len(design)) - hat) @ np.random.default_rng(1).normal(size=len(design))
    for group, correction in enumerate(residual_corrections(counts, g_inverse)):
        rows = groups == group
        values, vectors = np.linalg.eigh(np.eye(rows.sum()) - hat[np.ix_(rows, rows)])
        root = (vectors / np.sqrt(np.maximum(values, 1e-15))) @ vectors.T
        expected = design[rows].T @ root @ residuals[rows]
        np.testing.assert_allclose(correction @ (design[rows].T @ residuals[rows]), expected,
                                   atol=1e-10 * np.abs(expected).max())


def with_units(n_units: int = 30):
    """small_design's tokens in `n_units` resampling units (unit u in group u % groups), its Counts with
    the units' grams, and the token covariance per unit of noise when `share` of it is shared within units."""
    design, _, counts, layout = small_design()
    units = np.random.default_rng(2).integers(0, n_units, len(design))
    groups = units % counts.n_groups
    grams = sparse.vstack([sparse.csr_matrix(design[groups == g].T @ design[groups == g]) for g in range(counts.n_groups)])
    columns = np.argwhere(design > 0)[:, 1].reshape(len(design), -1)
    unit_grams = stacked_unit_grams(count_units(columns, units, np.arange(n_units), design.shape[1]).tocsr(),
                                    np.arange(n_units) % counts.n_groups, counts.n_groups)
    counts = Counts(counts.gram, grams.tocsr(), counts.n_groups, unit_grams)

    def covariance(share: float) -> np.ndarray:
        return (1 - share) * np.eye(len(design)) + share * (units[:, None] == units[None, :])

    return design, groups, counts, layout, covariance


@pytest.mark.parametrize("share", [0.0, 0.3, 0.9])
def test_the_correction_gives_each_groups_residual_sums_the_second_moment_of_its_noise_sums(share):
    """With `share` of the noise shared within units: K_g Cov(Z_g' e_g) K_g' = Cov(Z_g' u_g) on the tokens
    (e = (I - H) u the fitted residuals, Cov(u) the working covariance)."""
    design, groups, counts, layout, covariance = with_units()
    g_inverse = solve_joint(counts, layout, "test").g_inverse
    residual_map = np.eye(len(design)) - design @ g_inverse @ design.T
    noise = covariance(share)
    for group, correction in enumerate(residual_corrections(counts, g_inverse, share)):
        rows = groups == group
        sums = design[rows].T @ residual_map[rows]  # Z_g' (I - H)_g: residual sums from the noise
        corrected = correction @ sums @ noise @ sums.T @ correction.T
        expected = design[rows].T @ noise[np.ix_(rows, rows)] @ design[rows]
        np.testing.assert_allclose(corrected, expected, atol=1e-9 * np.abs(expected).max())


@pytest.mark.parametrize("share", [0.0, 0.6])
def test_the_traces_under_shared_noise_are_those_of_the_influences_on_the_tokens(share):
    """tr E[I_g I_h'] and the two variance shares, E[u u'] the working covariance with `share`."""
    design, groups, counts, layout, covariance = with_units()
    solution = solve_joint(counts, layout, "test")
    solution.influence_maps = influence_maps(counts, layout, solution.g_inverse, share)
    residual_map = np.eye(len(design)) - design @ solution.g_inverse @ design.T
    noise = covariance(share)
    found = noise_traces(counts, layout, solution, share)
    for a in range(2):
        block = layout.block(a)
        n = counts.factor_counts(layout, a)
        maps = []
        for g in range(counts.n_groups):
            influence = solution.influence_maps[g][block.start - 1: block.stop - 1].astype("float64")
            influence = np.sqrt(n)[:, None] * (influence - n @ influence / n.sum())
            maps.append(influence @ design[groups == g].T @ residual_map[groups == g])
        expected = np.array([[np.trace(m @ noise @ o.T) for o in maps] for m in maps])
        np.testing.assert_allclose(found[a].traces, expected, atol=1e-5 * np.abs(expected).max())
        blocks = np.block([[m @ noise @ o.T for o in maps] for m in maps])
        rows_of_a = solution.g_inverse[block]
        fit_map = np.sqrt(n)[:, None] * (rows_of_a - n @ rows_of_a / n.sum()) @ design.T
        within = fit_map @ noise @ fit_map.T
        assert found[a].centre_variance == pytest.approx(np.sum(blocks**2) / np.sum(within**2), rel=1e-4)
        own = sum(np.sum((fit_map[:, groups == g] @ noise[np.ix_(groups == g, groups == g)] @ fit_map[:, groups == g].T) ** 2)
                  for g in range(counts.n_groups))
        assert found[a].diagonal_share == pytest.approx(own / np.sum(within**2), rel=1e-6)


@pytest.mark.parametrize("share", [0.0, 0.25, 0.7])
def test_the_shared_share_of_the_noise_is_estimated_from_the_groups_residual_sums(share):
    """Noise of 400 dimensions with `share` shared within units: the estimate within 0.1 of it."""
    design, groups, counts, layout, covariance = with_units()
    solution = solve_joint(counts, layout, "test")
    root = np.linalg.cholesky(covariance(share) + 1e-12 * np.eye(len(design)))
    noise = root @ np.random.default_rng(3).normal(size=(len(design), 400))
    residuals = (np.eye(len(design)) - design @ solution.g_inverse @ design.T) @ noise
    sums = np.stack([design[groups == g].T @ residuals[groups == g] for g in range(counts.n_groups)])
    assert SharedNoise.of(counts, layout, solution).estimate(sums) == pytest.approx(share, abs=0.1)


def test_the_share_read_along_the_noise_spectrum_is_the_share_of_the_whitened_residuals():
    """``readings`` along the eigenvectors of an anisotropic covariance, weighted by the inverse shrunk
    eigenvalues, give the share of the residual sums whitened by that spectrum's map, at every token count."""
    from orthosphere.analyze.inference import NoiseSpectrum

    design, groups, counts, layout, covariance = with_units()
    solution = solve_joint(counts, layout, "test")
    rng = np.random.default_rng(5)
    root = np.linalg.cholesky(covariance(0.8) + 1e-12 * np.eye(len(design)))
    noise = np.hstack([30.0 * root @ rng.normal(size=(len(design), 4)),  # a few huge dimensions, shared within units
                       rng.normal(size=(len(design), 36))])  # the rest independent
    residuals = (np.eye(len(design)) - design @ solution.g_inverse @ design.T) @ noise
    sums = np.stack([design[groups == g].T @ residuals[groups == g] for g in range(counts.n_groups)])
    shared = SharedNoise.of(counts, layout, solution)
    spectrum = NoiseSpectrum.of(residuals.T @ residuals / len(design))
    readings = shared.readings(sums, spectrum.vectors)
    assert shared.share_of(readings) == shared.estimate(sums)
    for n_tokens in (len(design), len(design) / 8):
        shrunk = spectrum.shrunk(n_tokens)
        assert shared.share_of(readings, 1 / shrunk) == shared.estimate(sums @ spectrum.whitening(shrunk))
    assert shared.share_of(readings, 1 / spectrum.shrunk(len(design))) < shared.estimate(sums) / 2  # the whitening matters


def test_units_of_one_token_leave_nothing_to_estimate():
    design, groups, counts, layout = small_design()
    columns = np.argwhere(design > 0)[:, 1].reshape(len(design), -1)
    units = np.arange(len(design))
    unit_grams = stacked_unit_grams(count_units(columns, units, units, design.shape[1]).tocsr(), groups, counts.n_groups)
    counts = Counts(counts.gram, counts.group_grams, counts.n_groups, unit_grams)
    assert SharedNoise.of(counts, layout, solve_joint(counts, layout, "test")) is None


def test_the_structure_tests_traces_are_those_of_the_influences_on_the_tokens():
    """tr E[I_g I_h'] per unit of noise from the tokens: I_g = L_g Z_g' (I - H) e, E[e e'] = I."""
    design, groups, counts, layout = small_design()
    solution = solve_joint(counts, layout, "test")
    hat = design @ solution.g_inverse @ design.T
    residual_map = np.eye(len(design)) - hat
    found = noise_traces(counts, layout, solution)
    for a in range(2):
        block = layout.block(a)
        n = counts.factor_counts(layout, a)
        maps = []
        for g in range(counts.n_groups):
            rows = groups == g
            influence = solution.influence_maps[g][block.start - 1: block.stop - 1].astype("float64")
            influence = np.sqrt(n)[:, None] * (influence - n @ influence / n.sum())
            maps.append(influence @ design[rows].T @ residual_map[rows])  # (class, token): I_g = maps[g] e
        expected = np.array([[np.trace(m @ o.T) for o in maps] for m in maps])
        np.testing.assert_allclose(found[a].traces, expected, atol=1e-5 * np.abs(expected).max())
        # the centre's variance over |W|^2's: |M|_F^2 / |M_W|_F^2, M the (class, class) blocks of the maps
        blocks = np.block([[m @ o.T for o in maps] for m in maps])
        rows_of_a = solution.g_inverse[block]
        fit_map = np.sqrt(n)[:, None] * (rows_of_a - n @ rows_of_a / n.sum()) @ design.T  # W = fit_map e
        within = fit_map @ fit_map.T
        assert found[a].centre_variance == pytest.approx(np.sum(blocks**2) / np.sum(within**2), rel=1e-4)
        own = sum(np.sum((fit_map[:, groups == g] @ fit_map[:, groups == g].T) ** 2) for g in range(counts.n_groups))
        assert found[a].diagonal_share == pytest.approx(own / np.sum(within**2), rel=1e-6)


def spiked(rank: int, strength: float, rng, shape=(20, 60), n_draws=300):
    """Effects of `rank` directions of singular value strength x the detection threshold (k d)^(1/4)
    plus unit noise, with noise draws of the same noise: their Gram matrices and coordinates."""
    k, d = shape
    truth = np.zeros(shape)
    left, right = np.linalg.qr(rng.normal(size=(k, rank)))[0], np.linalg.qr(rng.normal(size=(d, rank)))[0]
    singular = strength * (k * d) ** 0.25
    truth = singular * left @ right.T
    weighted = truth + rng.normal(size=shape)
    draws = rng.normal(size=(n_draws,) + shape)
    directions = np.linalg.svd(weighted, full_matrices=False)[2].T
    return weighted, draws @ np.swapaxes(draws, 1, 2), draws @ directions, truth


def test_the_noise_aware_rank_counts_the_directions_above_noise():
    rng = np.random.default_rng(0)
    found = []
    for _ in range(40):
        weighted, gram, along, _ = spiked(3, 3.0, rng)
        rank, thresholds = noise_rank(weighted, gram, along, 0.01, 19)
        found.append(rank)
        tested = np.flatnonzero(np.isfinite(thresholds))
        assert rank in tested and np.all(np.diff(thresholds[tested]) <= 0)  # deflation lowers the bar
        sequential = next((step for step in range(19) if np.linalg.svd(weighted, compute_uv=False)[step]
                           <= noise_rank(weighted, gram, along, 0.01, step + 1)[1][step]), 19)
        assert rank == sequential  # the bisection finds the first step that fails
    assert np.mean(np.array(found) == 3) >= 0.9
    pure = [noise_rank(*spiked(0, 0.0, rng)[:3], 0.05, 19)[0] for _ in range(60)]
    assert np.mean(np.array(pure) > 0) <= 0.15  # about 5 % by construction (60 trials)
    noiseless = np.diag([3.0, 2.0, 0, 0])
    assert noise_rank(noiseless, np.zeros((10, 4, 4)), np.zeros((10, 4, 4)), 0.05, 3)[0] == 2


def test_denoising_shrinks_singular_values_back_to_the_truth():
    """Noise inflates singular values: y^2 = (s^2 + a)(s^2 + b) / s^2; the shrinkage undoes it on average."""
    rng = np.random.default_rng(2)
    errors_raw, errors_shrunk = [], []
    for _ in range(30):
        weighted, gram, along, truth = spiked(2, 2.0, rng)
        s_true = np.linalg.svd(truth, compute_uv=False)[:2]
        errors_raw.append(np.linalg.svd(weighted, compute_uv=False)[:2] - s_true)
        basis = np.linalg.svd(weighted, full_matrices=False)[2][:2].T
        errors_shrunk.append(np.linalg.svd(denoised(weighted, basis, gram, along[..., :2]), compute_uv=False)[:2] - s_true)
    s = 2.0 * (20 * 60) ** 0.25
    assert np.mean(errors_raw) > 0.15 * s  # the noisy singular values sit well above the truth
    assert abs(np.mean(errors_shrunk)) < 0.05 * s


def test_a_turn_reaches_the_target_angles_and_keeps_the_factors_singular_values():
    rng = np.random.default_rng(3)
    basis_a, basis_b = bases_at_angles(12, 3, 2, [30.0, 70.0], rng)
    first = rng.normal(size=(5, 3)) @ basis_a.T
    for target in ([0.0, 45.0], [10.0, 90.0], [80.0, 89.0], [60.0, 60.0], [30.0, 70.0]):
        moved = turned(first, basis_a, basis_b, np.array(target))
        span = np.linalg.svd(moved, full_matrices=False)[2][:3].T
        np.testing.assert_allclose(principal_angles(span, basis_b), target, atol=1e-6)
        np.testing.assert_allclose(np.linalg.svd(moved, compute_uv=False)[:3], np.linalg.svd(first, compute_uv=False)[:3])
    third = basis_a[:, 2]  # a's direction orthogonal to b's span stays where it was
    np.testing.assert_allclose(turned(first, basis_a, basis_b, np.array([5.0, 50.0])) @ third, first @ third, atol=1e-12)


def test_the_families_of_truths():
    """Claims' boundaries at their least favourable configurations; the outer bounds' families keep the
    estimate's shape at the gap found; one angle: every family is that angle."""
    families = AngleFamilies(np.array([40.0, 50.0, 80.0]), gap=20.0)
    assert families.truth("smallest", 80.0).tolist() == [80.0, 90.0, 90.0]
    assert families.truth("equal", 10.0).tolist() == [10.0, 10.0, 10.0]
    np.testing.assert_allclose(families.truth("spread", 40.0), [40.0, 50.0, 80.0])  # through the estimate
    np.testing.assert_allclose(families.truth("spread", 0.0), [60.0, 60.0, 60.0])
    np.testing.assert_allclose(families.truth("from-smallest", 30.0), [30.0, 30.0 + 20 / 4, 50.0])
    np.testing.assert_allclose(families.truth("from-largest", 85.0), [65.0, 70.0, 85.0])
    np.testing.assert_allclose(families.truth("from-smallest", 80.0), [80.0, 85.0, 90.0])  # within [0, 90]
    single = AngleFamilies(np.array([33.0]))
    assert {tuple(single.truth(f, 20.0)) for f in ("smallest", "equal", "from-smallest", "from-largest")} == {(20.0,)}
    with pytest.raises(ValueError, match="unknown family 'widest'"):
        families.truth("widest", 1.0)


def test_the_family_search_finds_the_crossings_of_a_location_family():
    """Draws truth + N(0, 2): the truth whose q quantile is m is m - 2 z_q; ends where the data pass them."""
    noise = 2.0 * np.random.default_rng(4).normal(size=4000)
    calls = []

    def draw(family, value):
        calls.append(value)
        return value + noise

    search = FamilySearch(draw, 0.0, 90.0, 0.05)
    quantile = np.quantile(noise, 0.95)
    assert search.crossing("f", None, 0.95, 50.0, 40.0) == pytest.approx(50.0 - quantile, abs=0.05)
    assert len(calls) <= 4
    assert search.crossing("f", None, 0.05, 50.0, 60.0) == pytest.approx(50.0 - np.quantile(noise, 0.05), abs=0.05)
    assert search.crossing("f", None, 0.95, 1.0, 5.0) == 0.0  # the measurement lies below every truth's draws
    assert search.crossing("f", None, 0.05, 95.0, 80.0) == 90.0


def test_undefined_draws_are_left_out_of_crossings_intervals_and_p_values():
    """A radius spread is undefined (NaN) in a draw whose class radii all lie within noise: such draws,
    and truths with no defined draw, are left out, never read as a truth of NaN (a KeyError before)."""
    noise = 2.0 * np.random.default_rng(4).normal(size=400)

    def draw(family, value):
        drawn = value + noise
        if value >= 60.0:  # a few undefined draws at the family's far truths, none defined at its end
            drawn[:: 50 if value < 90.0 else 1] = np.nan
        return drawn

    search = FamilySearch(draw, 0.0, 90.0, 0.05)
    assert search.crossing("f", None, 0.95, 50.0, float("nan")) == pytest.approx(50.0 - np.quantile(noise, 0.95), abs=0.05)
    assert search.crossing("f", None, 0.95, 70.0, 80.0) == pytest.approx(70.0 - np.quantile(noise, 0.95), abs=0.2)
    beyond = search.crossing("f", None, 0.05, 100.0, 85.0)  # towards the end, whose draws are all undefined
    assert 85.0 <= beyond <= 90.0
    assert all(np.isfinite(value) for _, value in search.cache)
    nowhere = FamilySearch(lambda family, value: np.full(10, np.nan), 0.0, 90.0, 0.05)
    assert np.isnan(nowhere.crossing("f", None, 0.5, 10.0, 20.0))  # no truth with a defined draw: no bound
    with_undefined = np.append(noise, [np.nan] * 10)
    assert np.array_equal(basic_interval(1.0, with_undefined, 0.9), basic_interval(1.0, noise, 0.9))
    assert tail_p(with_undefined, 1.0, upper=True) == tail_p(noise, 1.0, upper=True)
    assert np.isnan(tail_p(np.full(5, np.nan), 1.0, upper=True))
    assert np.isnan(defined_quantile(np.full(5, np.nan), 0.5))


def test_draws_that_keep_every_direction_are_the_eigen_decompositions_subspaces():
    """The Cholesky path (rank k - 1) spans what the eigen-decomposition of (T + N)(T + N)' spans: the same
    projector S S' = ((T + N)(T + N)')^+ on the class side, rows' coordinates with the same Gram."""
    rng = np.random.default_rng(7)
    counts = rng.integers(5, 40, 6).astype(float)
    root = np.sqrt(counts)[:, None]
    centring = np.eye(6) - root @ root.T / counts.sum()
    truth = centring @ rng.normal(size=(6, 9))
    noise_full = centring @ rng.normal(size=(30, 6, 20))  # 30 draws in d = 20; Y: the first 9 coordinates
    gram, noise = noise_full @ np.swapaxes(noise_full, -1, -2), noise_full[..., :9]
    fast = drawn_subspaces(truth, gram, noise, 5, Complement.of(counts, gram, noise))
    slow = drawn_subspaces(truth, gram, noise, 5)  # its leading vectors found in float32
    values, vectors = np.linalg.eigh(truth @ truth.T + truth @ np.swapaxes(noise, -1, -2)
                                     + noise @ truth.T + gram)  # the float64 reference
    scaled = vectors[..., ::-1][..., :5] / np.sqrt(values[:, ::-1][:, None, :5])
    reference = scaled @ np.swapaxes(scaled, -1, -2)
    np.testing.assert_allclose(fast.scaled @ np.swapaxes(fast.scaled, -1, -2), reference, atol=1e-10 * np.abs(reference).max())
    np.testing.assert_allclose(slow.scaled @ np.swapaxes(slow.scaled, -1, -2), reference, atol=1e-5 * np.abs(reference).max())
    coordinates = fast.coordinates @ np.swapaxes(fast.coordinates, -1, -2)
    np.testing.assert_allclose(coordinates, slow.coordinates @ np.swapaxes(slow.coordinates, -1, -2),
                               atol=1e-5 * np.abs(coordinates).max())


def test_draws_estimated_whitened_are_the_whitened_subspaces_mapped_back():
    """With a whitening P, each draw's U* spans P^-1 times the leading right singular vectors of (T + N) P,
    built in d_model in float64 (the draws find their leading vectors in float32); it is orthonormal; and
    its rows' coordinates are (T + N) U*. With P = I it is the unwhitened estimate's subspace."""
    rng = np.random.default_rng(11)
    d, n, k, rank = 14, 25, 6, 2
    span = np.linalg.qr(rng.normal(size=(d, 5)))[0]  # Y
    truth = rng.normal(size=(k, 5)) @ span.T
    noise_full = rng.normal(size=(n, k, d)) * np.r_[8.0, 8.0, np.ones(d - 2)]  # two rogue dimensions
    spread = rng.normal(size=(d, d))
    whitening = spread @ spread.T / d + np.diag(np.r_[0.1, 0.1, np.ones(d - 2)])  # any symmetric positive definite P
    squared = whitening @ whitening

    def drawn(metric):
        white = WhitenedDraws(noise_full @ metric @ np.swapaxes(noise_full, -1, -2), noise_full @ metric @ span,
                              span.T @ metric @ span)
        return drawn_subspaces(truth @ span, noise_full @ np.swapaxes(noise_full, -1, -2), noise_full @ span, rank,
                               whitened=white)

    fast = drawn(squared)
    rows = truth + noise_full  # (n, k, d)
    basis = np.swapaxes(rows, -1, -2) @ fast.scaled  # U* (n, d, r)
    np.testing.assert_allclose(np.swapaxes(basis, -1, -2) @ basis, np.broadcast_to(np.eye(rank), (n, rank, rank)), atol=1e-10)
    for draw in range(n):
        right = np.linalg.svd(rows[draw] @ whitening)[2][:rank].T
        expected = np.linalg.qr(np.linalg.solve(whitening, right))[0]
        np.testing.assert_allclose(basis[draw] @ basis[draw].T, expected @ expected.T, atol=1e-5)  # found in float32
    np.testing.assert_allclose(fast.coordinates, rows @ basis, atol=1e-9)
    plain, identity = drawn_subspaces(truth @ span, noise_full @ np.swapaxes(noise_full, -1, -2), noise_full @ span, rank), \
        drawn(np.eye(d))
    projector = plain.scaled @ np.swapaxes(plain.scaled, -1, -2)
    np.testing.assert_allclose(identity.scaled @ np.swapaxes(identity.scaled, -1, -2), projector,
                               atol=1e-5 * np.abs(projector).max())


def test_leading_vectors_without_torch_and_torchs_threads_set_back(monkeypatch):
    """Without torch the leading vectors come from numpy's float64 decomposition and span what torch's
    float32 one spans; while torch decomposes, its own threads are one (the analyses' threads are Dask's),
    and the caller's setting is back afterwards, also after decompositions on several threads at once."""
    import threading

    import torch

    from orthosphere.analyze import inference

    rng = np.random.default_rng(3)
    rows = rng.normal(size=(20, 8, 30)) * np.r_[5.0, 3.0, np.ones(28)]
    matrices = rows @ np.swapaxes(rows, -1, -2)
    values, vectors = np.linalg.eigh(matrices)
    reference = vectors[..., -3:] @ np.swapaxes(vectors[..., -3:], -1, -2)  # the float64 reference
    seen = []
    original_eigh = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda m: (seen.append(torch.get_num_threads()), original_eigh(m))[1])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        workers = [threading.Thread(target=inference._leading_vectors, args=(matrices, 3)) for _ in range(4)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        with_torch = inference._leading_vectors(matrices, 3)
        assert seen == [1] * 5 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    without_torch = inference._leading_vectors(matrices, 3)
    gap = np.min(values[:, -3] - values[:, -4]) / np.max(values)
    np.testing.assert_allclose(without_torch @ np.swapaxes(without_torch, -1, -2), reference, atol=1e-12 / gap)
    np.testing.assert_allclose(with_torch @ np.swapaxes(with_torch, -1, -2), reference, atol=1e-6 / gap)  # float32


def test_cosines_against_a_fixed_factors_draws_are_those_of_the_subspaces_in_d_model():
    """U*_a' U*_b from the draws' Gram pieces equals the product of the two re-estimated bases built in d_model."""
    rng = np.random.default_rng(9)
    d, n = 15, 20
    span = np.linalg.qr(rng.normal(size=(d, 6)))[0]  # Y
    truths = [rng.normal(size=(k, 6)) @ span.T for k in (5, 4)]  # T in the span
    noises = [rng.normal(size=(n, k, d)) for k in (5, 4)]
    drawn = [drawn_subspaces(t @ span, z @ np.swapaxes(z, -1, -2), z @ span, r)
             for t, z, r in zip(truths, noises, (3, 2))]
    cross = noises[0] @ np.swapaxes(noises[1], -1, -2)
    bases = [np.swapaxes(t + z, -1, -2) @ x.scaled for t, z, x in zip(truths, noises, drawn)]  # U* (n, d, r)
    np.testing.assert_allclose(np.swapaxes(bases[0], -1, -2) @ bases[0], np.broadcast_to(np.eye(3), (n, 3, 3)), atol=1e-10)
    expected = np.swapaxes(bases[0], -1, -2) @ bases[1]
    np.testing.assert_allclose(cosines_against(drawn[0], noises[1] @ span, cross)(drawn[1]), expected, atol=1e-10)
    np.testing.assert_allclose(cosines_against(drawn[1], noises[0] @ span, np.swapaxes(cross, -1, -2))(drawn[0]),
                               np.swapaxes(expected, -1, -2), atol=1e-10)


def test_benjamini_hochberg_is_scipys_on_the_finite_entries():
    p = np.random.default_rng(5).random((6, 7)) ** 3
    p[1, 2] = np.nan
    finite = np.isfinite(p)
    q = benjamini_hochberg(p)
    np.testing.assert_allclose(q[finite], false_discovery_control(p[finite]))
    assert np.isnan(q[1, 2])


def test_tail_p_values_are_shares_of_the_draws_and_normal_tails_beyond_them():
    draws = np.random.default_rng(6).normal(size=200)
    assert tail_p(draws, 1.0, upper=True) == pytest.approx((1 + np.sum(draws >= 1.0)) / 201)
    assert tail_p(draws, -1.0, upper=False) == pytest.approx((1 + np.sum(draws <= -1.0)) / 201)
    far = tail_p(draws, 6.0, upper=True)
    assert far == pytest.approx(norm.sf((6.0 - draws.mean()) / draws.std()), rel=1e-9) and far < 1e-6
    assert tail_p(draws, 2.7, upper=True) <= 5 / 201  # never above the draws' resolution


def test_an_estimate_the_fixed_point_left_outside_its_interval_is_brought_inside():
    """The case of a weak high-rank pair (a shipped model's layer 2): the two rounds of the median-
    unbiased fixed point stop at 57.9 degrees, the inverted interval of the smallest angle is [85.8, 90]."""
    from orthosphere.analyze.layer import _within

    estimate = _within(np.array([57.9, 70.0, 81.98]), np.array([[85.8, 90.0], [59.6, 90.0]]))
    np.testing.assert_allclose(estimate, [85.8, 85.8, 85.8])
    inside = np.array([40.0, 50.0, 60.0])
    np.testing.assert_array_equal(_within(inside, np.array([[30.0, 45.0], [55.0, 70.0]])), inside)


def test_noise_draws_in_the_span_of_the_influences_keep_their_inner_products():
    """Fewer influence rows than d_model: the draws' Gram matrices, cross products and coordinates along
    columns equal those of the draws made in d_model (float32 draws against a float64 reference)."""
    from orthosphere.analyze.design import FactorEffects
    from orthosphere.analyze.inference import noise_parts, rademacher

    rng = np.random.default_rng(8)
    effects = [FactorEffects(rng.normal(size=(k, 300)), rng.normal(size=(6, k, 300))) for k in (4, 3)]
    columns = rng.normal(size=(300, 5))
    signs = rademacher(rng, 40, 6)
    parts = noise_parts(effects, signs, columns, [(0, 1)])
    drawn = [np.tensordot(signs, factor.influence, axes=(1, 0)) for factor in effects]
    scale = max(np.abs(d @ np.swapaxes(d, -1, -2)).max() for d in drawn)
    for a, noise in enumerate(drawn):
        np.testing.assert_allclose(parts.gram[a], noise @ np.swapaxes(noise, -1, -2), atol=1e-5 * scale)
        np.testing.assert_allclose(parts.along[a], noise @ columns, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(parts.cross[0, 1], drawn[0] @ np.swapaxes(drawn[1], -1, -2), atol=1e-5 * scale)


def test_interval_levels_are_a_t_references_with_groups_less_one_degrees_of_freedom():
    low, high = interval_levels(0.9, 32)
    assert low == pytest.approx(norm.cdf(-1.6955), abs=2e-5) and high == pytest.approx(1 - low)
    assert interval_levels(0.9, 10_000)[0] == pytest.approx(0.05, abs=1e-4)  # many groups: the draws' own quantiles
    assert interval_levels(0.9, 2)[0] < 1e-6  # two groups hardly estimate the noise's variance


def test_the_rounding_variance_is_a_uniform_errors_below_the_spacing_and_vanishes_above_it():
    """Cells of magnitude 5 in float16 (spacing 2^-8): with noise far below the spacing, a cell mean's
    rounding error is uniform over the spacing, variance 2^-16 / 12; with noise of two spacings it averages
    away. A float32 store holds what the model computed, even without noise: nothing to add; an unknown
    dtype: nothing known. The bias is the largest of sqrt(W / sigma^2); the inflation 1 + W / sigma^2 on average."""
    from orthosphere.analyze.inference import cell_rounding_variance, rounding_bias, rounding_inflation

    spacing = 2.0**-8
    means, sizes = np.full((3, 2), 5.0), np.full(3, 100.0)
    for sigma, expected in ((1e-6, spacing**2 / 12), (2 * spacing, 0.0)):
        stored = np.diag([sigma**2 + (spacing**2 / 12 if sigma > spacing else 0.0)] * 2)  # what rounding adds
        variance = cell_rounding_variance(stored, means, sizes, "float16")
        assert variance == pytest.approx(np.full((3, 2), expected), rel=1e-3, abs=1e-12)
    assert not cell_rounding_variance(np.zeros((2, 2)), means, sizes, "float32").any()  # stored as computed
    assert cell_rounding_variance(np.eye(2), means, sizes, "int8") is None
    covariance, rounding = np.diag([4.0, 1.0]), [np.array([[0.16, 0.0], [0.04, 0.0]])]
    assert rounding_bias(covariance, rounding) == pytest.approx(0.2) and np.isnan(rounding_bias(covariance, None))
    assert rounding_inflation(covariance, rounding, None) == pytest.approx(1 + 0.1 / 5)
    whitening = np.diag([0.5, 1.0])  # whitened, each coordinate's noise is 1 and the first's rounding 0.1 / 4
    assert rounding_inflation(covariance, rounding, whitening) == pytest.approx(1 + 0.025 / 2)
    assert rounding_inflation(covariance, [np.zeros((2, 2))], None) == 1.0
    assert rounding_inflation(np.zeros((2, 2)), rounding, None) == np.inf  # rounding against no noise at all


@pytest.mark.parametrize("sigma_in_spacings", [0.1, 0.25, 0.4])
def test_the_rounding_variance_matches_simulated_cell_means_from_their_stored_spread(sigma_in_spacings):
    """Cells at random places on float16's grid, their tokens spread by sigma: from the stored values'
    pooled spread (which the rounding widens) and the cells' means alone, the variance of a cell mean's
    rounding error is that of the simulation's."""
    from orthosphere.analyze.inference import cell_rounding_variance

    rng = np.random.default_rng(3)
    spacing = 2.0**-8
    sigma = sigma_in_spacings * spacing
    means = 5 + rng.random(2000) * spacing
    true = means[:, None] + sigma * rng.normal(size=(2000, 1000))
    stored = true.astype(np.float16).astype(float)
    errors = (stored - true).mean(axis=1)
    measured = np.mean(errors**2) - np.var(stored - true, axis=1).mean() / 1000  # less the tokens' own averaged noise
    spread = np.var(stored - stored.mean(axis=1, keepdims=True), axis=1).mean()
    variance = cell_rounding_variance(np.diag([spread]), stored.mean(axis=1)[:, None], np.full(2000, 1000.0), "float16")
    assert variance.mean() == pytest.approx(measured, rel=0.1)


def test_a_class_mean_averages_the_roundings_of_its_cells_and_two_factors_share_them():
    """A class of n_c tokens in cells of n_j has rounding variance sum_j n_j^2 b_j^2 / n_c (count-weighted);
    the cells are those of the two factors (their tables' nonzero entries), shared by both, and a draw's
    errors are the cells' averaged the same way."""
    from orthosphere.analyze.layer import cell_rounding

    _, _, counts, layout = small_design(0)
    table = counts.contingency(layout, 0, 1)
    rng = np.random.default_rng(1)
    sums = np.zeros((counts.n_groups, layout.n_columns, 3))
    sums[0] = 5.0 * np.diag(counts.gram)[:, None] * (1 + 1e-3 * rng.random((layout.n_columns, 3)))  # means near 5
    rounding = cell_rounding(np.eye(3) * 1e-12, sums, counts, layout, "float16")
    assert [cells.pair for cells in rounding] == [(0, 1), (0, 1)]
    b2 = 2.0**-16 / 12  # noise far below the spacing: every cell's b^2
    assert rounding[0].variance == pytest.approx(np.full((np.count_nonzero(table), 3), b2), rel=1e-3)
    expected_a = (table**2).sum(axis=1) / table.sum(axis=1) * b2
    assert rounding[0].class_variance == pytest.approx(np.repeat(expected_a[:, None], 3, axis=1), rel=1e-3)
    expected_b = (table**2).sum(axis=0) / table.sum(axis=0) * b2
    assert rounding[1].class_variance == pytest.approx(np.repeat(expected_b[:, None], 3, axis=1), rel=1e-3)
    unit = rng.normal(size=(2000, np.count_nonzero(table), 3))
    drawn_a, drawn_b = rounding[0].drawn(unit), rounding[1].drawn(unit)
    assert np.var(drawn_a, axis=0) == pytest.approx(rounding[0].class_variance, rel=0.15)
    assert abs(np.corrcoef(drawn_a[:, 0, 0], drawn_b[:, 0, 0])[0, 1]) > 0.2  # one cell's error moves both
    assert cell_rounding(np.eye(3) * 1e-12, sums, counts, layout, "float32") == []  # stored as computed
    assert cell_rounding(np.eye(3) * 1e-12, sums, counts, layout, "int8") is None


@pytest.mark.parametrize("n_tokens", [60, 400])
def test_the_understatement_is_what_whitening_by_the_residuals_own_covariance_takes_from_their_noise(n_tokens):
    """Over many samples of residuals with rogue dimensions, the noise of a statistic independent of them
    (tr P Sigma P) exceeds that of the residuals themselves (tr P S P), both whitened by the residuals' own
    OAS-shrunk covariance S, by the mean understatement (Monte Carlo, within 2 %); barely shrunk it is
    m / (m - d - 1), the mean of an inverse Wishart."""
    from orthosphere.analyze.inference import NoiseSpectrum

    rng = np.random.default_rng(8)
    d = 16
    spreads = np.ones(d)
    spreads[:2] = 8.0
    ratios, understatements = [], []
    for _ in range(400):
        tokens = rng.normal(size=(n_tokens, d)) * spreads
        spectrum = NoiseSpectrum.of(tokens.T @ tokens / n_tokens)
        whitening = spectrum.whitening(spectrum.shrunk(n_tokens))
        ratios.append(np.sum(whitening**2 * spreads**2) / np.trace(whitening @ (tokens.T @ tokens / n_tokens) @ whitening))
        understatements.append(spectrum.understatement(n_tokens, 0))
    assert np.mean(understatements) > 1.03
    assert np.mean(ratios) == pytest.approx(np.mean(understatements), rel=0.02)
    values = np.geomspace(1.0, 100.0, d)  # anisotropic; a huge tr(S^2) below: shrinkage 1 / (n + 1)
    barely_shrunk = NoiseSpectrum(values, np.eye(d), float(values.mean()), 1e9)
    assert barely_shrunk.understatement(n_tokens, 4) == pytest.approx((n_tokens - 4) / (n_tokens - 4 - d - 1), rel=0.04)


def test_the_whitening_shrinks_as_scikit_learns_oas_and_whitens_only_anisotropic_noise():
    """P S_oas P = I for S_oas scikit-learn's OAS estimate from the tokens' covariance; none for isotropic
    noise; two dimensions of 8 times the others' spread are whitened."""
    from sklearn.covariance import oas

    from orthosphere.analyze.inference import NoiseSpectrum

    def noise_whitening(covariance, n_tokens):
        spectrum = NoiseSpectrum.of(covariance)
        return spectrum.whitening(spectrum.shrunk(n_tokens))

    rng = np.random.default_rng(4)
    tokens = rng.normal(size=(300, 12))
    tokens[:, :2] *= 8
    covariance = tokens.T @ tokens / len(tokens)
    whitening = noise_whitening(covariance, len(tokens))
    shrunk = oas(tokens, assume_centered=True)[0]
    np.testing.assert_allclose(whitening @ shrunk @ whitening, np.eye(12), atol=1e-9)
    isotropic = rng.normal(size=(300, 12))
    assert noise_whitening(isotropic.T @ isotropic / 300, 300) is None


def test_an_interval_pinned_at_the_end_of_its_family_far_from_the_measurement_withholds_the_pair():
    """The smallest angle's interval at [90, 90] for a measured 34 degrees (every truth's draws fall below
    it) or the largest's at [0, 0] for a measured 70: no truth explains the data. Pinned at 90 for a
    measured 89 is an orthogonal pair's ordinary interval."""
    from types import SimpleNamespace

    from orthosphere.analyze.layer import PairFit, _unbracketed

    settings = SimpleNamespace(orthogonal_deg=80.0, dependent_deg=10.0)
    pinned = PairFit(np.array([34.0, 42.0]), extremes_ci=np.array([[90.0, 90.0], [40.0, 90.0]]))
    assert _unbracketed(pinned, settings)
    low = PairFit(np.array([60.0, 70.0]), extremes_ci=np.array([[50.0, 80.0], [0.0, 0.0]]))
    assert _unbracketed(low, settings)
    orthogonal = PairFit(np.array([89.0, 89.5]), extremes_ci=np.array([[90.0, 90.0], [89.0, 90.0]]))
    assert not _unbracketed(orthogonal, settings)
    ordinary = PairFit(np.array([34.0, 42.0]), extremes_ci=np.array([[30.0, 40.0], [38.0, 50.0]]))
    assert not _unbracketed(ordinary, settings)
