"""The atlas: many models over one corpus in one command, with failures named and bad input refused."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from click.testing import CliRunner

import orthosphere
from orthosphere.errors import ConfigError
from orthosphere.workflows.atlas import load_atlas
from orthosphere.workflows.cli import main

MODELS = Path(__file__).resolve().parent.parent / "workflows" / "models"
SENTENCES = MODELS.parent / "data" / "sentences.txt"
FAST = '"replay.n_draws" = 2\n"replay.n_bootstrap" = 20\n'


def write_config(folder: Path, models: str, samples: int = 4, context: int = 16) -> Path:
    config = folder / "atlas.toml"
    config.write_text(f'name = "tiny"\nroot = "{folder / "out"}"\n'
                      f'[corpus]\ntask = "text:path={SENTENCES},context={context}"\nsamples = {samples}\n'
                      f"{models}\n[analyze.options]\n{FAST}")
    return config


@pytest.fixture(scope="module")
def atlas_run(tmp_path_factory):
    """An atlas of a Llama, an arithmetic model, a path that is no model and a model without tokenizer."""
    folder = tmp_path_factory.mktemp("atlas")
    untokenized = folder / "no-tokenizer"
    untokenized.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(MODELS / "demo-llama" / name, untokenized / name)
    config = write_config(folder, f'[[models]]\nname = "llama"\npath = "{MODELS / "demo-llama"}"\n'
                                  f'[[models]]\nname = "broken"\npath = "{folder / "missing"}"\n'
                                  f'[[models]]\npath = "{untokenized}"\n'
                                  f'[[models]]\nname = "pre"\npath = "{MODELS / "pre"}"\n'
                                  'task = "arithmetic:split=test,seed=1"\nsamples = 16\n')
    result = CliRunner().invoke(main, ["atlas", str(config)])
    return folder / "out", result, config


@pytest.mark.slow
def test_an_atlas_compares_the_models_and_names_the_failures(atlas_run):
    out, result, _ = atlas_run
    assert result.exit_code == 0, result.output
    tree = xr.open_datatree(out / "atlas.zarr", engine="zarr")
    table = tree.to_dataset()
    assert list(table.model.values) == ["llama", "broken", "no-tokenizer", "pre"]
    status = dict(zip(table.model.values, table.status.values))
    assert status["llama"] == status["pre"] == "ok"
    assert "broken" in result.output or "not found" in status["broken"]
    assert "missing not found" in status["broken"]
    assert "needs the model's tokenizer" in status["no-tokenizer"]
    assert set(tree.children) == {"llama", "pre"}
    assert {"norms", "norm_geometry", "replay", "spheres", "subspaces"} <= set(tree["llama"].children)
    llama = table.sel(model="llama")
    assert llama.family.item() == "llama" and llama.norm.item() == "pre rms" and llama.positions.item() == "rotary"
    assert llama.windows.item() == 4 and llama.layers.item() == 2
    for name in ("norm_band", "norm_scale_cv", "growth_per_layer", "massive_ratio", "sink_share", "sparse_share"):
        assert np.isfinite(llama[name].item()), name
    assert llama.sink_share_low.item() <= llama.sink_share.item() <= llama.sink_share_high.item()
    assert table.sel(model="pre").family.item() == "arithmetic"
    markdown = (out / "atlas.md").read_text()
    assert "| broken | failed: ConfigError: model" in markdown and "| llama | ok | llama |" in markdown
    assert (out / "atlas.png").stat().st_size > 0 and (out / "atlas.csv").read_text().startswith("model,status,")


@pytest.mark.slow
def test_a_second_run_skips_what_is_complete(atlas_run, caplog):
    out, _, config = atlas_run
    with caplog.at_level(logging.INFO, logger="orthosphere.atlas"):
        result = CliRunner().invoke(main, ["atlas", str(config)])
    assert result.exit_code == 0, result.output
    assert "model broken failed" in caplog.text  # the failure is logged, not only tabled
    table = xr.open_datatree(out / "atlas.zarr", engine="zarr").to_dataset()
    assert np.isnan(table.extract_s.sel(model="llama").item()) and np.isnan(table.analyse_s.sel(model="llama").item())


def test_two_models_with_the_same_name_are_refused(tmp_path):
    llama = MODELS / "demo-llama"
    config = write_config(tmp_path, f'[[models]]\npath = "{llama}"\n[[models]]\npath = "{tmp_path / "demo-llama"}"\n')
    with pytest.raises(ConfigError, match=r"two or more models are named \['demo-llama'\]: give each model its own `name`"):
        load_atlas(config)
    with pytest.raises(ConfigError, match="two or more models are named"):
        orthosphere.atlas([llama, tmp_path / "demo-llama"], f"text:path={SENTENCES},context=16", tmp_path / "out")


def test_a_corpus_too_short_for_the_windows_fails_every_model_with_its_message(tmp_path):
    config = write_config(tmp_path, f'[[models]]\npath = "{MODELS / "demo-llama"}"\n', samples=20, context=64)
    result = CliRunner().invoke(main, ["atlas", str(config)])
    assert result.exit_code != 0
    assert "every model of atlas tiny failed: demo-llama:" in result.output
    assert "fewer than n_samples=20" in result.output and "ask for fewer samples or give a longer corpus" in result.output


def test_bad_configs_name_the_file_and_key(tmp_path):
    config = write_config(tmp_path, '[[models]]\nname = "x"\n')
    with pytest.raises(ConfigError, match=r"\[\[models\]\] #1: needs `path`"):
        load_atlas(config)
    config.write_text('[corpus]\ntask = "text:path=x.txt"\nsamples = 0\n[[models]]\npath = "m"\n')
    with pytest.raises(ConfigError, match=r"\[corpus\] samples = 0: expected a positive number"):
        load_atlas(config)


@pytest.mark.slow
def test_a_model_loaded_in_python_joins_the_atlas(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(MODELS / "demo-llama")
    tokenizer = AutoTokenizer.from_pretrained(MODELS / "demo-llama")
    root = orthosphere.atlas({"loaded": (model, tokenizer)}, orthosphere.corpus.text(str(SENTENCES), context=16),
                             tmp_path / "out", samples=4, analyses=["norms", "norm_geometry"])
    table = xr.open_datatree(root / "atlas.zarr", engine="zarr").to_dataset()
    assert table.status.sel(model="loaded").item() == "ok"
    assert np.isfinite(table.massive_ratio.sel(model="loaded").item())
    with pytest.raises(ConfigError, match="needs a name: pass the models as a dict"):
        orthosphere.atlas([model], str(SENTENCES), tmp_path / "other")


def test_the_shipped_atlas_config_loads():
    atlas = load_atlas(MODELS.parent / "configs" / "atlas.toml")
    assert [model.name for model in atlas.models] == ["demo-llama", "arithmetic-pre", "arithmetic-qkv"]
    assert atlas.samples == 4 and atlas.options == {"replay": {"n_draws": 8}}


def test_the_shipped_size_series_is_three_sizes_of_the_pre_norm_family_that_the_atlas_finds():
    """atlas-sizes.toml names the arithmetic Pre-Norm model at three sizes, two seeds each; every path
    is a shipped checkpoint whose training config is the size it claims."""
    import json

    configs = Path(__file__).resolve().parents[1] / "workflows" / "configs"
    atlas = load_atlas(configs / "atlas-sizes.toml")
    layers = {}
    for model in atlas.models:
        shipped = json.loads((Path(model.model) / "config.json").read_text())
        assert shipped["norm_placement"] == "pre", model.name
        layers.setdefault(shipped["n_layers"], []).append(model.name)
    assert {n: len(names) for n, names in layers.items()} == {2: 2, 3: 2, 4: 2}
