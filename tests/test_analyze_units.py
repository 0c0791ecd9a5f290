"""Resampling units: documents chained across packed windows, a user's grouping label, too few units."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from orthosphere.analyze import AnalysisError, open_for_analysis
from orthosphere.analyze.subspaces import FactorSubspaces
from orthosphere.analyze.units import bootstrap_group, chained_units, resampling_units, unit_groups
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


def test_chained_units_join_samples_that_share_a_value_through_any_chain():
    # samples 0-1 share document 10, 1-2 share 11 (0, 1, 2 chained); 3 and 5 share 12; 4 holds no document
    rows = [np.array([0, 1, 1, 2]), np.array([3, 5])]
    values = [np.array([10, 10, 11, 11]), np.array([12, 12])]
    np.testing.assert_array_equal(chained_units(6, rows, values), [0, 0, 0, 3, 4, 3])


def test_a_document_across_windows_lands_in_one_group(tmp_path):
    # document 0 spans windows 0-2 and ends in window 3, whose rest starts document 1 (to window 4);
    # document 2 fills window 5 exactly; then one short document per window
    lengths = [24, 11, 7] + [7] * 40
    documents = windows_of(lengths)
    dataset = open_for_analysis(packed_store(tmp_path / "packed.zarr", documents))
    units = resampling_units(dataset, None)
    assert units.label == "document"
    np.testing.assert_array_equal(units.key[:6], [0, 0, 0, 0, 0, 5])
    np.testing.assert_array_equal(units.key[6:], np.arange(6, len(documents)))
    assert units.n_units == len(documents) - 4
    groups = unit_groups(units, 3, 32)
    assert len(set(groups[:5])) == 1  # every token of documents 0 and 1, chained through window 3
    np.testing.assert_array_equal(groups[5:], bootstrap_group(np.arange(5, len(documents)), 3, 32))


def test_stores_without_documents_keep_one_sample_a_unit(tmp_path):
    url = write_store(tmp_path / "plain.zarr", {"resid_pre": np.zeros((5, 1, 3, 4))}, with_weights=False)
    units = resampling_units(open_for_analysis(url), None)
    assert units.label == "sample"
    np.testing.assert_array_equal(units.key, np.arange(5))


def test_group_by_a_label_ties_the_samples_that_share_its_values(tmp_path):
    documents = np.arange(12)[:, None].repeat(N_POS, axis=1)
    topic = (np.arange(12) // 3)[:, None].repeat(N_POS, axis=1)
    dataset = open_for_analysis(packed_store(tmp_path / "topics.zarr", documents, topic=topic))
    np.testing.assert_array_equal(resampling_units(dataset, "topic").key, np.repeat([0, 3, 6, 9], 3))
    np.testing.assert_array_equal(resampling_units(dataset, "sample").key, np.arange(12))
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
    with pytest.raises(AnalysisError, match=r"holds 1 resampling unit \(samples tied by label 'document'.*"
                                            r"at least 2 independent units"):
        FactorSubspaces(factors=["parity"], rank=1, n_bootstrap=0, n_null=99).fit(one)
    few = open_for_analysis(packed_store(tmp_path / "few.zarr", windows_of([7 * 5] * 6)))
    with caplog.at_level(logging.WARNING, logger="orthosphere.analyze"):
        result = FactorSubspaces(factors=["parity"], rank=1, n_bootstrap=0, n_null=99).fit(few).to_dataset()
    assert "holds 6 resampling units" in caplog.text and "fewer than bootstrap_groups=32" in caplog.text
    assert result.attrs["n_units"] == 6 and result.attrs["occupied_groups"] <= 6
