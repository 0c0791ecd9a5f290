"""`orthosphere verify`: samples of a store recomputed from its model and compared with the stored values;
the recorded hashes of the model's weights and the corpus checked; every bad input named."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import zarr
from click.testing import CliRunner

import orthosphere
from orthosphere.errors import ParameterError, VerificationError
from orthosphere.store.location import as_location, commit_metadata
from orthosphere.workflows.cli import main
from tests.test_extract_models import write_arithmetic_model, write_hf_model, write_text

N_SAMPLES, BATCH = 10, 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_arithmetic_model(tmp_path_factory.mktemp("verify") / "model")


@pytest.fixture(scope="module")
def written(model_dir, tmp_path_factory):
    """An arithmetic store of two shards (batches of 4 from each shard's start)."""
    out = str(tmp_path_factory.mktemp("verify") / "store.zarr")
    orthosphere.extract(str(model_dir), "arithmetic:split=test,seed=2", out, n_samples=N_SAMPLES, batch_size=BATCH,
                        samples_per_chunk=2, n_shards=2, device="cpu")
    return out


def copy_of(store, tmp_path) -> str:
    copy = str(tmp_path / "copy.zarr")
    shutil.copytree(store, copy)
    return copy


def test_a_clean_store_is_verified_bitwise_per_site_and_layer(written, model_dir):
    report = orthosphere.verify(written, str(model_dir), samples=4, batch_size=BATCH, exact=True, device="cpu")
    assert report.ok, report.format()
    assert len(report.samples) == 4 and report.samples == sorted(set(report.samples))
    layered = {(item.name, item.layer) for item in report.comparisons if item.layer is not None}
    assert {("q", 0), ("q", 1), ("resid_pre", 1), ("k", 0)} <= layered
    assert {"tokens", "pred", "role"} <= {item.name for item in report.comparisons}
    assert all(item.bitwise for item in report.comparisons)
    assert report.checks[0].name == "task" and report.checks[0].state == "ok"


def test_the_model_the_store_records_is_used_when_none_is_given_and_the_draw_is_seeded(written):
    first = orthosphere.verify(written, samples=3, seed=5, batch_size=BATCH, device="cpu")
    again = orthosphere.verify(written, samples=3, seed=5, batch_size=BATCH, device="cpu")
    assert first.ok and first.samples == again.samples


def test_other_batches_are_compared_within_the_stated_tolerance(written, model_dir):
    report = orthosphere.verify(written, str(model_dir), samples=N_SAMPLES, batch_size=3, device="cpu")
    assert report.ok, report.format()
    assert {item.tolerance for item in report.comparisons if item.name == "q"} == {1e-4}


def test_one_edited_value_is_found_and_named(written, model_dir, tmp_path):
    store = copy_of(written, tmp_path)
    q = zarr.open_group(store, mode="r+")["q"]
    original = float(q[7, 1, 3, 2, 1])
    q[7, 1, 3, 2, 1] = original + 0.5  # written through zarr: its checksum is right, its value is not
    report = orthosphere.verify(store, str(model_dir), samples=N_SAMPLES, batch_size=BATCH, device="cpu")
    assert not report.ok
    failures = report.failures()
    assert len(failures) == 1, failures
    assert failures[0].startswith("q layer 1: DIFFERS: 1 of ")
    assert f"at sample 7, pos 3, head 2, d_head 1: stored {np.float32(original + 0.5)!r}" in failures[0]


def test_a_store_of_another_model_is_refused_by_the_hashes(written, tmp_path):
    other = write_arithmetic_model(tmp_path / "other", seed=1)
    recorded = zarr.open_group(written, mode="r").attrs["model"]["weights_sha256"]
    with pytest.raises(VerificationError, match=rf"model {other} is not the store's: its weights' SHA-256 is [0-9a-f]{{64}}, "
                                                rf"the store was extracted from weights with SHA-256 {recorded}"):
        orthosphere.verify(written, str(other), samples=2, device="cpu")


def test_a_model_no_longer_where_the_store_records_it_is_asked_for(written, model_dir, tmp_path):
    moved = tmp_path / "moved"
    shutil.copytree(model_dir, moved)
    store = copy_of(written, tmp_path)
    recorded = zarr.open_group(store, mode="r").attrs["model"]
    commit_metadata(as_location(store), {"model": {**recorded, "source": str(tmp_path / "gone")}})
    with pytest.raises(VerificationError, match=r"the store's model '.*gone' is not there \(any more\): give the model"):
        orthosphere.verify(store, samples=2, device="cpu")
    assert orthosphere.verify(store, str(moved), samples=2, batch_size=BATCH, device="cpu").ok


def test_zero_samples_is_refused_by_the_cli_and_python(written):
    result = CliRunner().invoke(main, ["verify", written, "--samples", "0", "--device", "cpu"])
    assert result.exit_code != 0
    assert "Error: --samples=0: expected a positive integer" in result.output, result.output
    with pytest.raises(ParameterError, match=r"^samples=0: expected a positive integer"):
        orthosphere.verify(written, samples=0)


def test_cli_prints_the_report_and_fails_on_a_difference(written, model_dir, tmp_path):
    result = CliRunner().invoke(main, ["verify", written, str(model_dir), "--samples", "2", "--batch-size", str(BATCH),
                                       "--exact", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "q layer 1: ok, bitwise equal" in result.output and f"store {written}: verified" in result.output
    store = copy_of(written, tmp_path)
    zarr.open_group(store, mode="r+")["resid_pre"][:, 0] = 1.0
    result = CliRunner().invoke(main, ["verify", store, str(model_dir), "--samples", "2", "--device", "cpu"])
    assert result.exit_code == 1
    assert f"Error: store {store} is not verified: resid_pre layer 0: DIFFERS" in result.output


def test_a_corpus_no_longer_where_it_was_is_named_and_the_rest_verified(tmp_path):
    model = write_hf_model(tmp_path / "model", "gpt2")
    corpus = write_text(tmp_path / "corpus.txt")
    out = str(tmp_path / "store.zarr")
    orthosphere.extract(str(model), f"text:path={corpus},context=8,bos=none,separator=none", out, batch_size=BATCH, device="cpu")
    report = orthosphere.verify(out, str(model), samples=3, batch_size=BATCH, exact=True, device="cpu")
    assert report.ok and [check.state for check in report.checks] == ["ok", "ok"], report.format()
    corpus.rename(tmp_path / "elsewhere.txt")
    report = orthosphere.verify(out, str(model), samples=3, batch_size=BATCH, exact=True, device="cpu")
    assert report.ok, report.format()
    assert str(report.checks[0]) == (f"corpus: missing: {corpus} is not there (any more): its SHA-256 is not checked; "
                                     "the samples are recomputed from the tokens the store holds")
    assert any(item.name == "q" for item in report.comparisons)
    write_text(corpus, ["a changed corpus"])
    assert [check.state for check in orthosphere.verify(out, str(model), samples=1, device="cpu").checks] == \
        ["differs", "ok"]


@pytest.mark.slow
def test_a_store_on_object_storage_is_verified(written, model_dir, s3_bucket):
    import fsspec

    url = f"{s3_bucket}/verify/store.zarr"
    fsspec.filesystem("s3").put(written, url, recursive=True)
    report = orthosphere.verify(url, str(model_dir), samples=2, batch_size=BATCH, exact=True, device="cpu")
    assert report.ok and report.url == url, report.format()
