"""The command line: help for every verb, `info`, clean errors, the Dask back-end options."""
import json

import pytest
from click.testing import CliRunner

from orthosphere.workflows.cli import main
from tests.test_store import fill, make_store


@pytest.fixture
def store(tmp_path):
    url = str(tmp_path / "store.zarr")
    fill(make_store(url))
    return url


def test_every_verb_has_help():
    runner = CliRunner()
    result = runner.invoke(main, ["--help"])
    assert result.exit_code == 0
    for name, command in main.commands.items():
        verb_help = runner.invoke(main, [name, "--help"])
        assert verb_help.exit_code == 0, name
        assert command.help and command.help.split()[0] in verb_help.output


def test_info_text(store):
    result = CliRunner().invoke(main, ["info", store])
    assert result.exit_code == 0, result.output
    assert "complete: 3/3 shards" in result.output
    assert "resid_pre   float32  (sample, layer, pos, d_model) = (11, 3, 5, 8)" in result.output


def test_info_json(store):
    result = CliRunner().invoke(main, ["info", store, "--json"])
    summary = json.loads(result.output)
    assert summary["n_samples"] == 11 and summary["complete"] is True
    assert summary["arrays"]["k"]["dims"] == ["sample", "layer", "pos", "kv_head", "d_head"]


def test_info_on_missing_store_is_one_clear_line(tmp_path):
    result = CliRunner().invoke(main, ["info", str(tmp_path / "missing.zarr")])
    assert result.exit_code == 1
    assert result.output.startswith("Error: no store at") and "Traceback" not in result.output


def test_workers_and_scheduler_are_exclusive(store):
    result = CliRunner().invoke(main, ["--workers", "2", "--scheduler", "tcp://127.0.0.1:1", "info", store])
    assert result.exit_code == 2 and "not both" in result.output
