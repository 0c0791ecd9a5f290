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
    assert ",rotary,2,4," in (out / "atlas.csv").read_text()  # whole numbers as integers


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
    with pytest.raises(ConfigError, match=r"atlas samples = 0: expected a positive number of samples"):
        orthosphere.atlas(llama, f"text:path={SENTENCES},context=16", tmp_path / "out", samples=0)


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
    one = orthosphere.atlas(MODELS / "demo-llama", f"text:path={SENTENCES},context=16", tmp_path / "one", samples=2,
                            analyses="norms")  # one model, one analysis, neither in a list
    assert xr.open_datatree(one / "atlas.zarr", engine="zarr").to_dataset().status.sel(model="demo-llama").item() == "ok"
    table = xr.open_datatree(root / "atlas.zarr", engine="zarr").to_dataset()
    assert table.status.sel(model="loaded").item() == "ok"
    assert np.isfinite(table.massive_ratio.sel(model="loaded").item())
    with pytest.raises(ConfigError, match="needs a name: pass the models as a dict"):
        orthosphere.atlas([model], str(SENTENCES), tmp_path / "other")


def test_the_shipped_atlas_config_loads():
    atlas = load_atlas(MODELS.parent / "configs" / "atlas.toml")
    assert [model.name for model in atlas.models] == ["demo-llama", "arithmetic-pre", "arithmetic-qkv"]
    assert atlas.samples == 4 and atlas.options == {"replay": {"n_draws": 8, "smooth_draws": 0}}


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


LLAMA_ENTRY = f'[[models]]\nname = "llama"\npath = "{MODELS / "demo-llama"}"\n'


@pytest.mark.parametrize("text, message", [
    (LLAMA_ENTRY + "[extract]\nbogus = 1\n", r"atlas.toml \[extract\]: unknown keys \['bogus'\]; expected some of"),
    (LLAMA_ENTRY + "task = 5\n", r"\[\[models\]\] #1 task = 5: expected a task spec string"),
    ('[[models]]\nname = 5\npath = "m"\n', r"atlas.toml: model name 5: expected a string"),
    ('[[models]]\nname = true\npath = "m"\n', r"model name True: expected a string"),
    ('[[models]]\nname = "status"\npath = "m"\n', r"model name 'status' is the name of a column of the atlas's table"),
    ('[[models]]\nname = "model"\npath = "m"\n', r"model name 'model' is the name of a column"),
    (LLAMA_ENTRY + "[analyze]\nonly = []\n", r"\[analyze\] only = \[\]: expected a non-empty list"),
    (LLAMA_ENTRY + "[analyze]\nonly = [\"nope\"]\n", r"\[analyze\] only = \['nope'\]: unknown analyses \['nope'\]"),
])
def test_bad_values_in_an_atlas_config_name_their_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_atlas(write_config(tmp_path, text))


@pytest.mark.parametrize("top, message", [
    ("root = 5\n", r"atlas.toml: `root` = 5: expected a non-empty string"),
    ('name = ["a"]\n', r"atlas.toml: `name` = \['a'\]: expected a non-empty string"),
    ("[corpus]\ntask = 5\n", r"atlas.toml \[corpus\] task = 5: expected a task spec string"),
])
def test_bad_top_level_values_name_their_key(tmp_path, top, message):
    config = tmp_path / "atlas.toml"
    corpus = "" if "[corpus]" in top else f'[corpus]\ntask = "text:path={SENTENCES},context=16"\n'
    config.write_text(top + corpus + LLAMA_ENTRY)
    with pytest.raises(ConfigError, match=message):
        load_atlas(config)


def test_an_output_root_that_is_a_file_is_refused_before_any_work(tmp_path):
    from orthosphere.workflows.atlas import run_atlas

    (tmp_path / "out").write_text("")
    with pytest.raises(ConfigError, match=r"its output root .*out is a file: give a folder \(the config's `root`, or --root\)"):
        run_atlas(load_atlas(write_config(tmp_path, LLAMA_ENTRY)))


def test_a_models_own_sample_count_applies_with_the_shared_corpus(tmp_path, monkeypatch):
    import orthosphere.extract.job as job_module
    from orthosphere.workflows.atlas import _extract_and_analyse

    asked = []

    def stop(job, **_):
        asked.append(job.n_samples)
        raise RuntimeError("stop here")

    monkeypatch.setattr(job_module, "run_job", stop)
    atlas = load_atlas(write_config(tmp_path, LLAMA_ENTRY + "samples = 2\n" + LLAMA_ENTRY.replace('"llama"', '"shared"')))
    for model in atlas.models:
        with pytest.raises(RuntimeError, match="stop here"):
            _extract_and_analyse(atlas, model, False, None)
    assert asked == [2, 4]


@pytest.mark.slow
def test_changed_options_redo_the_analyses_and_a_run_where_every_model_fails_keeps_the_comparison(atlas_run, tmp_path):
    out, _, config = atlas_run
    shutil.copytree(out, tmp_path / "out")
    text = config.read_text().replace(str(out), str(tmp_path / "out"))
    changed = tmp_path / "changed.toml"
    changed.write_text(text.replace('"replay.n_draws" = 2', '"replay.n_draws" = 3'))
    result = CliRunner().invoke(main, ["atlas", str(changed)])
    assert result.exit_code == 0, result.output
    tree = xr.open_datatree(tmp_path / "out" / "atlas.zarr", engine="zarr")
    assert np.isfinite(tree.to_dataset().analyse_s.sel(model="llama").item())  # analysed again ...
    assert np.isnan(tree.to_dataset().extract_s.sel(model="llama").item())  # ... from the store it had
    assert tree["llama"]["replay"].attrs["options"]["n_draws"] == 3
    before = (tmp_path / "out" / "atlas.md").read_text()
    fewer = tmp_path / "fewer.toml"
    fewer.write_text(text.replace("samples = 4", "samples = 3").replace("samples = 16", "samples = 12"))
    result = CliRunner().invoke(main, ["atlas", str(fewer)])
    assert result.exit_code != 0 and "every model of atlas tiny failed" in result.output
    assert "its n_samples is 4, this job's is 3" in result.output and "rerun with --force" in result.output
    assert (tmp_path / "out" / "atlas.md").read_text() == before
