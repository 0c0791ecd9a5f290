"""Every shipped checkpoint loads and reproduces its recorded in-distribution accuracy on a
freshly generated test set."""

import json
from pathlib import Path

import pytest

from orthosphere.extract import tasks
from orthosphere.extract.model import load_model
from orthosphere.workflows import train as training

MODELS = Path(training.__file__).parent / "models"
PLACEMENTS = ("pre", "qkv", "none", "post")
FRESH_SEED = 20261130  # differs from every config's seed, so the examples are new
TOLERANCE = 0.03  # per-token accuracy on 300 examples (~1300 answer tokens) vs the recorded 2000


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.slow
def test_shipped_checkpoint_reproduces_its_recorded_accuracy(placement):
    directory = MODELS / placement
    metrics = json.loads((directory / "metrics.json").read_text())
    config = training.load_config(directory / training.CONFIG_COPY)
    model = load_model(directory)
    assert model.config == config.model and model.config.norm_placement == placement
    assert metrics["eval_seed"] != FRESH_SEED
    fresh = tasks.generate("test", 300, FRESH_SEED, config.task)
    measured = training.evaluate(model, fresh)
    recorded = metrics["final"]["test"]["token_accuracy"]
    assert measured["token_accuracy"] == pytest.approx(recorded, abs=TOLERANCE)
    assert (directory / "model.safetensors").stat().st_size < 4_000_000


@pytest.mark.parametrize("placement", ("pre", "qkv"))
def test_pre_and_qkv_reach_the_target_accuracy(placement):
    metrics = json.loads((MODELS / placement / "metrics.json").read_text())
    assert metrics["final"]["test"]["token_accuracy"] >= 0.95
    for split in ("test", "interpolation", "extrapolation"):
        assert set(metrics["final"][split]) >= {"token_accuracy", "answer_accuracy"}


def test_shipped_configs_match_the_workflow_configs():
    for placement in PLACEMENTS:
        shipped = training.load_config(MODELS / placement / training.CONFIG_COPY)
        assert shipped == training.load_config(MODELS.parent / "configs" / f"{placement}.toml")
