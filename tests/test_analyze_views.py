"""The notebook views ``ds.ortho`` on a store opened lazily: the model's own attention and z, computed
one chunk of samples at a time; views a store cannot give are refused, naming what it lacks.
(Every transformers family: test_extract_families.py.)"""
from __future__ import annotations

import dask
import dask.array
import numpy as np
import pytest

import orthosphere.analyze  # noqa: F401  (registers the accessor)
from orthosphere.analyze import AnalysisError
from orthosphere.extract.job import ExtractJob, run_job
from orthosphere.store import open_store
from tests.test_extract_models import write_arithmetic_model

SITES = ("q", "k", "v", "pattern", "z")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A store of the arithmetic model with the model's own pattern and z, in chunks of 4 samples."""
    folder = tmp_path_factory.mktemp("views")
    model_dir = write_arithmetic_model(folder / "model")
    out = str(folder / "store.zarr")
    run_job(ExtractJob(model=str(model_dir), task="arithmetic:split=test,seed=3", out=out, n_samples=12, sites=SITES,
                       samples_per_chunk=4, batch_size=4, device="cpu"), progress=False)
    return open_store(out)


def test_views_are_the_models_pattern_and_z_one_chunk_at_a_time(store):
    """On the real tokens (the arithmetic model attends from padding to padding too; the store's terms
    leave padding out)."""
    recomputed = store.drop_vars(["pattern", "z"])
    valid = store["valid"].values
    assert not valid.all()
    for layer in store["layer"].values:
        model_pattern = store["pattern"].sel(layer=layer).values.astype(np.float64)
        view = recomputed.ortho.pattern(layer=int(layer), head=[0, 3])
        assert view.data.chunks[0] == (4, 4, 4) and view.dims == ("sample", "head", "qpos", "kpos")
        with dask.config.set(scheduler="synchronous"):
            np.testing.assert_allclose(view.values.transpose(0, 2, 1, 3)[valid],
                                       model_pattern[:, [0, 3]].transpose(0, 2, 1, 3)[valid], rtol=0, atol=1e-5)
            z = recomputed.ortho.z(layer=int(layer)).values[valid]
        model_z = store["z"].sel(layer=layer).values[valid]
        np.testing.assert_allclose(z, model_z, rtol=0, atol=1e-5 * max(1.0, np.abs(model_z).max()))
        assert recomputed.ortho.z(layer=int(layer)).attrs["transformer_lens"] == f"blocks.{layer}.attn.hook_z"


def test_stored_sites_are_returned_as_they_are(store):
    assert store.ortho.pattern(layer=1, head=2).identical(store["pattern"].sel(layer=1, head=[2]))
    assert store.ortho.z(layer=0).identical(store["z"].sel(layer=0, head=[0, 1, 2, 3]))


def test_the_scores_are_masked_where_a_query_may_not_see_a_key(store):
    scores = store.ortho.attn_scores(layer=0, head=1).values
    n_pos = scores.shape[-1]
    assert np.isneginf(scores[..., np.triu_indices(n_pos, 1)[0], np.triu_indices(n_pos, 1)[1]]).all()  # causal
    own = scores[:, 0, np.arange(n_pos), np.arange(n_pos)]  # each query's score of its own position
    valid = store["valid"].values
    assert np.isfinite(own[valid]).all() and np.isneginf(own[~valid]).all()  # padding keys are refused


def test_a_view_the_store_cannot_give_is_refused_naming_what_it_lacks(store):
    with pytest.raises(AnalysisError, match=r"holds no q and k, which the view pattern recomputes the attention from: "
                                            r"extract the store with sites q and k \(or pattern\)"):
        store.drop_vars(["q", "k", "pattern"]).ortho.pattern(layer=0)
    with pytest.raises(AnalysisError, match=r"holds no k, which the view attn_scores"):
        store.drop_vars("k").ortho.attn_scores(layer=0)
    with pytest.raises(AnalysisError, match="holds neither z nor v"):
        store.drop_vars(["z", "v"]).ortho.z(layer=0)
    with pytest.raises(AnalysisError, match=r"head=7: expected a head index or a list of them, each in 0..3"):
        store.ortho.attn_scores(layer=0, head=7)
    with pytest.raises(AnalysisError, match=r"layer\(s\) \[5\] not in store"):
        store.ortho.attn_scores(layer=5)


def test_a_loaded_dataset_gives_the_same_views_chunked_as_the_store(store):
    recomputed = store.drop_vars(["pattern", "z"])
    loaded = recomputed.compute()
    assert not isinstance(loaded["q"].data, dask.array.Array)
    view = loaded.ortho.pattern(layer=1, head=[1])
    assert view.data.chunks[0] == (4, 4, 4)
    with dask.config.set(scheduler="synchronous"):
        np.testing.assert_array_equal(view.values, recomputed.ortho.pattern(layer=1, head=[1]).values)


def test_selections_the_views_cannot_read_are_refused_saying_what_to_do(store):
    with pytest.raises(AnalysisError, match=r"lacks \['layer'\] \(a scalar selection drops a dim\): select with a list"):
        store.sel(layer=1).ortho.pattern(layer=1)
    with pytest.raises(AnalysisError, match=r"lacks \['sample'\]"):
        store.isel(sample=0).ortho.attn_scores(layer=1)
    with pytest.raises(AnalysisError, match=r"holds heads \[2, 3\]: choose heads with the view's head= instead"):
        store.isel(head=[2, 3]).ortho.z(layer=1)
    assert store.isel(sample=[0], layer=[1]).ortho.attn_scores(layer=1).sizes["sample"] == 1
