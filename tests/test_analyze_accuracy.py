"""The accuracy analysis against counts made by hand on planted predictions."""
import numpy as np
import pytest

from orthosphere.analyze import AnalysisError, analyze
from orthosphere.analyze.accuracy import accuracy
from orthosphere.store import create_store, open_store

MODEL = {"n_layers": 1, "d_model": 4, "n_heads": 1, "n_kv_heads": 1, "d_head": 4, "attn_scale": 0.5, "causal": True}


def planted_store(url, scored):
    """Four samples of five positions; target = 1 everywhere, pred wrong at planted places."""
    writer = create_store(url, model=MODEL, task={"name": "planted"}, n_samples=4, n_pos=5, sites=["resid_pre"],
                          with_weights=False)
    pred = np.ones((4, 5), np.int32)
    pred[0, 3] = 0          # sample 0: one scored token wrong
    pred[2, 0] = 0          # sample 2: an unscored token wrong, every scored one right
    pred[3, 3:] = 0         # sample 3: both scored tokens wrong
    valid = np.ones((4, 5), bool)
    valid[1, 4] = False     # a padding position, marked scored: never counted
    writer.write(0, {"pred": pred, "target": np.ones((4, 5), np.int32), "scored": scored, "valid": valid,
                     "resid_pre": np.ones((4, 1, 5, 4), np.float32)})
    writer.mark_shard_complete(0)
    writer.finish()
    return url


def test_token_and_answer_accuracy_match_hand_counts(tmp_path):
    scored = np.zeros((4, 5), bool)
    scored[:, 3:] = True
    result = accuracy(open_store(planted_store(str(tmp_path / "s.zarr"), scored)))
    # scored valid tokens: 2 + 1 + 2 + 2 = 7; wrong: 1 (sample 0) + 2 (sample 3) = 3
    assert int(result.n_scored_tokens) == 7
    assert float(result.token_accuracy) == pytest.approx(4 / 7)
    assert int(result.n_answers) == 4
    assert float(result.answer_accuracy) == pytest.approx(2 / 4)  # samples 1 and 2 are all right


def test_accuracy_runs_in_the_results_tree(tmp_path):
    scored = np.zeros((4, 5), bool)
    scored[:, 3:] = True
    tree = analyze(planted_store(str(tmp_path / "s.zarr"), scored), analyses=["accuracy"])
    assert float(tree["accuracy"]["token_accuracy"]) == pytest.approx(4 / 7)


def test_a_store_without_scored_tokens_is_refused(tmp_path):
    store = open_store(planted_store(str(tmp_path / "s.zarr"), np.zeros((4, 5), bool)))
    with pytest.raises(AnalysisError, match="no scored token"):
        accuracy(store)
