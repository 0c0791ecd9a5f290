"""The spheres' cross term is a cosine: within [0, 1] whatever the components' norms do."""
from __future__ import annotations

import numpy as np
import pytest

from orthosphere.analyze.layer import _cross_term


def cross_term(points_a, points_b, cosine: float, contingency) -> float:
    """The cross term of one-dimensional components whose bases meet at `cosine`."""
    return float(_cross_term(np.asarray(points_a, float)[None], np.asarray(points_b, float)[None],
                             np.array([[[cosine]]]), np.asarray(contingency, float))[0])


@pytest.mark.parametrize("cosine", [0.0, 0.3, 0.9, 1.0])
def test_correlated_norms_give_the_cosine_itself(cosine):
    # class k of a meets class k of b only, and their norms go together (1 with 1, 3 with 3): every token's
    # cosine is `cosine`; a ratio of RMS x_a . x_b to sqrt(mean |x_a|^2 mean |x_b|^2) would read
    # cosine sqrt(41) / 5, 1.15 at 0.9
    assert cross_term([[1.0], [3.0]], [[1.0], [3.0]], cosine, np.diag([5, 5])) == pytest.approx(cosine, abs=1e-12)


def test_mixed_signs_and_norms_stay_within_one():
    rng = np.random.default_rng(0)
    for _ in range(20):
        points_a, points_b = rng.normal(size=(5, 3)) * rng.gamma(0.5, size=(5, 1)), rng.normal(size=(4, 2))
        bases_cosines = np.linalg.qr(rng.normal(size=(3, 3)))[0][:, :2] * rng.uniform(0, 1)
        value = _cross_term(points_a[None], points_b[None], bases_cosines[None], rng.integers(0, 9, size=(5, 4)))[0]
        assert 0.0 <= value <= 1.0 + 1e-12


def test_tokens_with_larger_norms_weigh_more():
    # two kinds of token: cosine 1 with norms 3 x 3 (weight 81), cosine 0 (b along another axis) with norms 1 x 1
    points_a = [[3.0, 0.0], [1.0, 0.0]]
    points_b = [[3.0, 0.0], [0.0, 1.0]]
    value = _cross_term(np.array(points_a)[None], np.array(points_b)[None], np.eye(2)[None], np.diag([1.0, 1.0]))[0]
    assert value == pytest.approx(np.sqrt(81 / 82), abs=1e-12)
