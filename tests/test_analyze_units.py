"""Resampling units: documents across packed windows, a user's grouping label, too few units."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from orthosphere.analyze import AnalysisError, open_for_analysis
from orthosphere.analyze import analyze as orthosphere_analyze
from orthosphere.analyze.subspaces import FactorSubspaces
from orthosphere.analyze.units import bootstrap_group, main_units, resampling_units, token_groups, token_units
from tests.synthetic import NOT_APPLICABLE, write_store

N_POS = 8


def packed_store(url, documents: np.ndarray, *, topic: np.ndarray | None = None, seed: int = 0) -> str:
    """A store of windows (sample, N_POS) whose tokens carry `documents` (position 0, the BOS, has no document),
    a label `parity` (the position's parity) and pure noise in d_model 4."""
    n_samples = len(documents)
    rng = np.random.default_rng(seed)
    labels = {"document": np.asarray(documents, "int16"),
              "parity": np.broadcast_to(np.arange(N_POS) % 2, (n_samples, N_POS)).astype("int16")}
    if topic is not None:
        labels["topic"] = np.asarray(topic, "int16")
    return write_store(url, {"resid_pre": rng.normal(size=(n_samples, 1, N_POS, 4))}, labels=labels, with_weights=False)


def windows_of(document_lengths: list[int]) -> np.ndarray:
    """The document of every token of documents packed one after the other into windows of N_POS tokens,
    each window starting with a BOS that has no document."""
    stream = np.concatenate([np.full(length, doc) for doc, length in enumerate(document_lengths)])
    per_window = N_POS - 1
    stream = stream[: len(stream) // per_window * per_window].reshape(-1, per_window)
    return np.hstack([np.full((len(stream), 1), NOT_APPLICABLE), stream])


def test_main_units_take_the_value_holding_most_of_a_samples_tokens():
    # sample 0: 3 tokens of value 1, 1 of value 0; sample 1: a tie of values 0 and 2 (the first); sample 2: none
    rows, codes, counts = np.array([0, 0, 1, 1]), np.array([0, 1, 0, 2]), np.array([1, 3, 2, 2])
    np.testing.assert_array_equal(main_units(np.arange(3), rows, codes, counts, 3), [1, 0, 3 + 2])


def test_every_token_of_a_document_lands_in_one_group_across_windows_and_a_shared_window_splits(tmp_path):
    # document 0 spans windows 0-2 and ends in window 3, whose rest starts document 1 (to window 4);
    # document 2 fills window 5 exactly; then one short document per window
    lengths = [24, 11, 7] + [7] * 40
    documents = windows_of(lengths)
    dataset = open_for_analysis(packed_store(tmp_path / "packed.zarr", documents))
    units = resampling_units(dataset, None)
    assert units.label == "document" and units.n_units == len(lengths)  # one unit a document, none chained
    np.testing.assert_array_equal(units.sample_key[:6], [0, 0, 0, 1, 1, 2])  # window 3: 3 tokens of 0, 4 of 1
    groups = token_groups(token_units(dataset, units), 3, 32).compute()
    expected = bootstrap_group(np.where(documents >= 0, documents, units.sample_key[:, None]), 3, 32)
    np.testing.assert_array_equal(groups, expected)  # each token its document's group; the BOS its window's main one
    assert len(set(groups[:3].ravel())) == 1 and set(groups[3, 1:]) == {expected[0, 1], expected[4, 1]}
    assert units.attrs(3, 32)["occupied_groups"] == len(np.unique(bootstrap_group(np.arange(len(lengths)), 3, 32)))


def test_stores_without_documents_keep_one_sample_a_unit_in_the_groups_they_always_had(tmp_path):
    url = write_store(tmp_path / "plain.zarr", {"resid_pre": np.zeros((5, 1, 3, 4))}, with_weights=False)
    dataset = open_for_analysis(url)
    units = resampling_units(dataset, None)
    assert units.label == "sample" and units.n_units == 5
    np.testing.assert_array_equal(units.sample_key, np.arange(5))
    np.testing.assert_array_equal(token_groups(token_units(dataset, units), 3, 32).compute(),
                                  np.repeat(bootstrap_group(np.arange(5), 3, 32)[:, None], 3, axis=1))


def test_group_by_a_label_ties_the_tokens_that_share_its_values(tmp_path):
    documents = np.arange(12)[:, None].repeat(N_POS, axis=1)
    topic = (np.arange(12) // 3)[:, None].repeat(N_POS, axis=1)
    dataset = open_for_analysis(packed_store(tmp_path / "topics.zarr", documents, topic=topic))
    np.testing.assert_array_equal(resampling_units(dataset, "topic").sample_key, np.repeat([0, 1, 2, 3], 3))
    np.testing.assert_array_equal(resampling_units(dataset, "sample").sample_key, np.arange(12))
    fitted = FactorSubspaces(factors=["parity"], group_by="topic", rank=1, n_bootstrap=0, n_null=99).fit(dataset)
    result = fitted.to_dataset()
    assert (result.attrs["group_by"], result.attrs["n_units"]) == ("topic", 4)
    assert result.attrs["fit"]["group_by"] == "topic"


def test_group_by_a_label_the_store_lacks_is_refused(tmp_path):
    dataset = open_for_analysis(packed_store(tmp_path / "packed.zarr", np.arange(40)[:, None].repeat(N_POS, axis=1)))
    with pytest.raises(AnalysisError, match=r"group_by='topic': store .* has no label 'topic'.*'document'"):
        FactorSubspaces(factors=["parity"], group_by="topic", rank=1).fit(dataset)


def test_a_store_of_one_document_is_refused_and_fewer_documents_than_groups_are_logged(tmp_path, caplog):
    one = open_for_analysis(packed_store(tmp_path / "one.zarr", windows_of([7 * 40])))
    with pytest.raises(AnalysisError, match=r"holds 1 resampling unit \(tokens tied by label 'document'.*"
                                            r"at least 2 independent units"):
        FactorSubspaces(factors=["parity"], rank=1, n_bootstrap=0, n_null=99).fit(one)
    few = open_for_analysis(packed_store(tmp_path / "few.zarr", windows_of([7 * 5] * 6)))
    with caplog.at_level(logging.WARNING, logger="orthosphere.analyze"):
        result = FactorSubspaces(factors=["parity"], rank=1, n_bootstrap=0, n_null=99).fit(few).to_dataset()
    assert "holds 6 resampling units" in caplog.text and "fewer than bootstrap_groups=32" in caplog.text
    assert result.attrs["n_units"] == 6 and result.attrs["occupied_groups"] <= 6


def test_a_huge_dimension_shared_within_documents_does_not_set_the_share_of_the_others(tmp_path, monkeypatch):
    """Independent noise in 15 dimensions and, in a 16th of 6 times their spread, an offset per document of
    30 times (as a document's sink-like tokens give): the tests are whitened there, and the share of noise
    shared within documents is judged whitened, where that dimension is one of 16; judged raw, it alone
    sets a share four times larger, and every other dimension's noise would be corrected as shared."""
    rng = np.random.default_rng(4)
    n_samples, d = 400, 16
    documents = windows_of([int(n) for n in rng.integers(3, 30, size=200)])[:n_samples]
    x = rng.normal(size=(len(documents), 1, N_POS, d))
    offsets = 30.0 * rng.normal(size=documents.max() + 1)
    x[..., 0] += 6.0 * rng.normal(size=x.shape[:3]) + np.where(documents >= 0, offsets[np.maximum(documents, 0)], 0.0)[:, None]
    labels = {"document": np.asarray(documents, "int16"),
              "parity": np.broadcast_to(np.arange(N_POS) % 2, documents.shape).astype("int16")}
    url = write_store(tmp_path / "rogue-documents.zarr", {"resid_pre": x}, labels=labels, with_weights=False)
    whitened = FactorSubspaces(factors=["parity"], seed=1).fit(open_for_analysis(url)).to_dataset()
    assert bool(whitened["whitened"].values[0]) and whitened["unit_shared_noise"].values[0] < 0.08
    monkeypatch.setattr("orthosphere.analyze.inference.NoiseSpectrum.shrunk", lambda spectrum, n_samples: None)
    raw = FactorSubspaces(factors=["parity"], seed=1).fit(open_for_analysis(url)).to_dataset()
    assert raw["unit_shared_noise"].values[0] > 0.12


def test_with_few_units_the_structure_p_value_is_never_below_what_their_signs_can_resolve(tmp_path):
    """Three documents give the signs 2^2 different draws: a null factor's p-value is at least 1/4 (with
    the measurement beyond every draw it read 1 / (1 + n_null) and false structure was 22 % at 3 units)."""
    rng = np.random.default_rng(3)
    stores = [packed_store(tmp_path / f"three-{seed}.zarr", windows_of([7 * 10] * 3), seed=seed) for seed in range(4)]
    for url in stores:
        result = FactorSubspaces(factors=["parity"], rank=1, n_bootstrap=0, n_null=999, seed=int(rng.integers(100))).fit(
            open_for_analysis(url)).to_dataset()
        assert result.attrs["occupied_groups"] == 3
        assert float(result["structure_p"].min()) >= 0.25


def shared_noise_store(url, windows_per_document: list[int], *, layers: int = 4, d: int = 16, seed: int = 0) -> str:
    """Documents of the given numbers of windows, each token's noise half shared by its document; a null label
    `topic` (4 classes) that half of each document's tokens take from their document, and a label `b` of
    4 classes with a clear effect in 2 directions."""
    rng = np.random.default_rng(seed)
    documents = np.repeat(np.arange(len(windows_per_document)), windows_per_document)
    n_samples = len(documents)
    offsets = np.arange(n_samples) - np.searchsorted(documents, documents)  # each window's place in its document
    own = rng.integers(0, 4, size=len(windows_per_document))[documents][:, None]
    topic = np.where(rng.random((n_samples, N_POS)) < 0.5, own, rng.integers(0, 4, size=(n_samples, N_POS)))
    b = rng.integers(0, 4, size=(n_samples, N_POS))
    effects = 3.0 * rng.normal(size=(layers, 4, 2)) @ np.linalg.qr(rng.normal(size=(d, 2)))[0].T
    shared = rng.normal(size=(layers, len(windows_per_document), d))
    x = np.stack([effects[layer][b] + np.sqrt(0.5) * (shared[layer][documents][:, None] + rng.normal(size=(n_samples, N_POS, d)))
                  for layer in range(layers)], axis=1)
    labels = {"document": np.repeat(documents[:, None], N_POS, axis=1).astype("int16"), "topic": topic.astype("int16"),
              "b": b.astype("int16"), "offset": (offsets[:, None] * N_POS + np.arange(N_POS)).astype("int64")}
    return write_store(url, {"resid_pre": x}, labels=labels, with_weights=False, label_dtypes={"offset": "int64"})


def test_a_few_documents_shared_noise_is_not_taken_for_anisotropy_by_the_whitening(tmp_path):
    """Sixteen documents of 16 windows, half of each token's noise shared by its document: their 16 shared
    vectors make the tokens' covariance look anisotropic in d 32, and a whitening fitted as if every token were
    independent shrank exactly those directions (here the share read 0.26-0.41 and the null label "structure"
    in 5 of 6 layers). The design effect on the covariance keeps the share near its 0.5."""
    url = shared_noise_store(tmp_path / "sixteen.zarr", [16] * 16, layers=6, d=32)
    result = FactorSubspaces(factors=["topic", "b"], seed=2).fit(open_for_analysis(url)).to_dataset()
    assert result.attrs["n_units"] == 16
    assert 0.35 < float(result["unit_shared_noise"].mean()) < 0.8
    assert float(result["effective_groups"].min()) >= 10
    assert int((result["structure_q"].sel(factor="topic") <= 0.05).sum()) <= 1


def test_claims_are_withheld_where_shared_noise_sits_in_a_few_groups(tmp_path, caplog):
    """One document holding half the windows, the rest one window each: the shared noise sits in one group
    (effective_groups about 1), and no resampling of the groups recovers it, so the layers' relations and
    sphere verdicts read undetermined, and the log says why."""
    url = shared_noise_store(tmp_path / "one-huge.zarr", [64] + [1] * 64, layers=2)
    with caplog.at_level(logging.WARNING, logger="orthosphere.analyze"):
        tree = orthosphere_analyze(url, analyses=["subspaces", "spheres"], factors=["topic", "b"])
    subspaces, spheres = tree["subspaces"].to_dataset(), tree["spheres"].to_dataset()
    assert (subspaces["unit_shared_noise"] > 0).all() and (subspaces["effective_groups"] < 3).all()
    assert set(subspaces["relation"].sel(factor="b", other="topic").values) <= {"undetermined", "no structure"}
    assert set(spheres["sphere"].sel(factor="b").values) == {"undetermined"}
    assert "effective groups" in caplog.text and "withheld" in caplog.text
