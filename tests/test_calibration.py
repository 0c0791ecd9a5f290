"""A small fixed-seed subset of benchmarks/calibration.py's grid: planted stores of many replicate
layers, each statistic's error rate held to what its nominal rate allows (bounds from the binomial
distribution: a correct method falls outside them with probability below about 0.001)."""
from __future__ import annotations

import pytest
from scipy.stats import binom

from tests.planted_cells import Cell, plant, run, score


def highest(rate: float, n: int) -> float:
    """The largest share of n trials that a method of error rate `rate` exceeds with probability < 0.001."""
    return binom.ppf(0.999, n, rate) / n


def lowest(rate: float, n: int) -> float:
    return binom.ppf(0.001, n, rate) / n


def scored(cell: Cell, tmp_path) -> dict:
    planted = plant(cell, tmp_path)
    return score(planted, *run(planted))


@pytest.mark.slow
@pytest.mark.parametrize("cell", [Cell(d_model=16, n_classes=64, zipf=True, signal="none", n_layers=200),
                                  Cell(d_model=64, n_classes=8, confounded=True, signal="none", n_layers=200)],
                         ids=["zipf-64-classes", "confounded"])
def test_labels_that_carry_nothing_find_structure_at_the_nominal_rate(cell, tmp_path):
    found = scored(cell, tmp_path)
    assert lowest(0.05, 200) <= found["structure_fp"] <= highest(0.05, 200)
    assert found["claimed"] == 0.0 and found["rank_zero"] >= 1 - highest(0.01, 200)


@pytest.mark.slow
def test_intervals_cover_and_ranks_are_exact_at_moderate_signal(tmp_path):
    found = scored(Cell(d_model=64, n_classes=8, truth="oblique", n_layers=100), tmp_path)
    assert found["rank_exact"] >= 0.9
    for name in ("min_coverage", "max_coverage"):  # 90 % intervals, covering at 90 % (not conservatively)
        assert lowest(0.9, 100) <= found[name] <= highest(0.9, 100), name
    assert abs(found["max_bias"]) < abs(found["max_raw_bias"]) / 2  # the noise's bias mostly removed
    assert found["called_orthogonal"] == 0.0 and found["called_dependent"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("truth, claim", [("orthogonal-edge", "orthogonal"), ("dependent-edge", "dependent")])
def test_each_claim_holds_its_level_at_its_least_favourable_boundary(truth, claim, tmp_path):
    found = scored(Cell(d_model=64, n_classes=8, truth=truth, n_layers=100), tmp_path)
    assert found[f"claim_{claim}_p05"] <= highest(0.05, 100)
    assert found[f"called_{claim}"] <= highest(0.05, 100)


@pytest.mark.slow
def test_an_orthogonal_pair_is_shown_orthogonal_at_strong_signal_and_never_dependent(tmp_path):
    found = scored(Cell(d_model=64, n_classes=8, truth="orthogonal", signal="strong", n_layers=60), tmp_path)
    assert found["called_orthogonal"] >= 0.5 and found["called_dependent"] == 0.0
    assert found["min_coverage"] >= lowest(0.95, 60)  # the truth, 90, is the edge: one-sided coverage


@pytest.mark.slow
def test_a_factor_read_on_some_tokens_is_not_biased_by_the_others(tmp_path):
    """Factor a on the role-x tokens, the role-y tokens offset elsewhere: role intercepts keep the offset out."""
    found = scored(Cell(d_model=64, n_classes=8, subset=True, truth="oblique", signal="strong", n_layers=60), tmp_path)
    assert found["rank_exact"] >= 0.9 and abs(found["min_raw_bias"]) < 3.0
    assert lowest(0.9, 60) <= found["min_coverage"]


@pytest.mark.slow
@pytest.mark.parametrize("sphere", ["on", "off"])
def test_class_points_on_spheres_and_off_them_are_told_apart(sphere, tmp_path):
    found = scored(Cell(d_model=64, n_classes=8, truth="orthogonal", signal="strong", sphere=sphere, n_layers=60), tmp_path)
    assert found["sphere_right"] >= 0.9 and found["sphere_wrong"] == 0.0
    stated = 0.95 if sphere == "on" else 0.9  # a spread of 0 is the end of its range: one-sided there
    assert lowest(stated, 60) <= found["radius_cv_coverage"] <= highest(stated, 60)


@pytest.mark.slow
def test_a_factor_of_many_directions_keeps_its_rank_and_its_intervals_cover(tmp_path):
    """Rank 6 beside rank 2: many noisy directions pull the smallest angle down; the intervals still cover."""
    found = scored(Cell(d_model=64, n_classes=16, rank=6, truth="oblique", n_layers=60), tmp_path)
    assert found["rank_exact"] >= 0.9 and found["rank_exact_b"] >= 0.9
    for name in ("min_coverage", "max_coverage"):
        assert lowest(0.9, 60) <= found[name], name
    assert found["called_orthogonal"] == 0.0 and found["called_dependent"] == 0.0
