"""Training: the loss falls, a killed run resumes exactly, bad configs and outputs are errors."""

import json
import tomllib
from pathlib import Path

import pytest
import torch

from orthosphere.extract import tasks
from orthosphere.extract.model import ArithmeticTransformer, ConfigError, load_model
from orthosphere.workflows import train as training

CONFIGS = Path(training.__file__).parent / "configs"
TINY = CONFIGS / "tiny.toml"


def write_config(path: Path, text: str = TINY.read_text(), **changes) -> Path:
    """The tiny config with ``table.key = value`` lines replaced (changes as table__key=...)."""
    lines = text.splitlines()
    for name, value in changes.items():
        table, key = name.split("__")
        start = lines.index(f"[{table}]")
        for index in range(start + 1, len(lines)):
            if lines[index].startswith(f"{key} ="):
                lines[index] = f"{key} = {value}"
                break
        else:
            lines.insert(start + 1, f"{key} = {value}")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow
def test_the_loss_falls_and_the_model_is_saved(tmp_path):
    config = training.load_config(TINY)
    torch.manual_seed(config.seed)
    untrained = ArithmeticTransformer(config.model)
    batch = tasks.generate("test", 64, config.seed, config.task)
    before = training.evaluate(untrained, batch)
    metrics = training.train(TINY, tmp_path / "run", progress=False, threads=1)
    after = training.evaluate(load_model(tmp_path / "run"), batch)
    assert after["loss"] < 0.8 * before["loss"]
    assert metrics["final"]["test"]["loss"] == pytest.approx(after["loss"], rel=1e-5)
    assert [r["step"] for r in metrics["history"]] == [20, 40]
    assert metrics["history"][-1]["train_loss"] < 0.8 * before["loss"]
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert saved["final"]["test"]["token_accuracy"] == after["token_accuracy"]
    assert set(saved["final"]) == {"test", "interpolation", "extrapolation"}
    assert (tmp_path / "run" / "train.toml").read_text() == TINY.read_text()
    assert not (tmp_path / "run" / training.CHECKPOINT_FILE).exists()


class Killed(Exception):
    """Stands in for the process being killed right after a checkpoint."""


def test_a_killed_run_resumes_from_its_checkpoint_exactly(tmp_path, monkeypatch):
    config = write_config(tmp_path / "c.toml", train__steps=12, train__checkpoint_every=5,
                          train__eval_every=6)
    training.train(config, tmp_path / "whole", progress=False)

    save = training._save_checkpoint

    def save_then_die(*args):
        save(*args)
        raise Killed

    monkeypatch.setattr(training, "_save_checkpoint", save_then_die)
    with pytest.raises(Killed):
        training.train(config, tmp_path / "killed", progress=False)
    assert (tmp_path / "killed" / training.CHECKPOINT_FILE).is_file()
    assert not (tmp_path / "killed" / "model.safetensors").exists()
    with pytest.raises(ConfigError, match="holds a checkpoint of this config; resume it"):
        training.train(config, tmp_path / "killed", progress=False)

    monkeypatch.setattr(training, "_save_checkpoint", save)
    steps_run = []
    make_batch = training._batch
    monkeypatch.setattr(training, "_batch", lambda c, step, d: steps_run.append(step) or make_batch(c, step, d))
    resumed = training.train(config, tmp_path / "killed", resume=True, progress=False)
    assert steps_run == list(range(5, 12))  # continued from step 5, not from the start

    whole, killed = load_model(tmp_path / "whole"), load_model(tmp_path / "killed")
    for (name, a), (_, b) in zip(whole.state_dict().items(), killed.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    expected = json.loads((tmp_path / "whole" / "metrics.json").read_text())
    assert resumed["history"] == expected["history"]
    assert resumed["final"] == expected["final"]
    # resuming a finished run changes nothing
    assert training.train(config, tmp_path / "killed", resume=True, progress=False)["final"] == expected["final"]


def test_resuming_with_another_number_of_threads_warns(tmp_path, monkeypatch):
    config = write_config(tmp_path / "c.toml", train__steps=6, train__warmup_steps=1, train__checkpoint_every=3)
    save = training._save_checkpoint
    monkeypatch.setattr(training, "_save_checkpoint", lambda *args: save(*args) or (_ for _ in ()).throw(Killed()))
    threads = torch.get_num_threads()
    try:
        with pytest.raises(Killed):
            training.train(config, tmp_path / "run", progress=False, threads=1)
        monkeypatch.setattr(training, "_save_checkpoint", save)
        with pytest.warns(UserWarning, match=r"checkpoint was trained with 1 torch thread\(s\), and resumes with 2: .* --threads 1"):
            training.train(config, tmp_path / "run", resume=True, progress=False, threads=2)
    finally:
        torch.set_num_threads(threads)


def test_learning_rate_warms_up_then_decays():
    settings = training.TrainConfig(steps=100, batch_size=1, learning_rate=1.0,
                                    warmup_steps=10, min_lr_ratio=0.1)
    assert settings.learning_rate_at(0) == pytest.approx(0.1)
    assert settings.learning_rate_at(9) == pytest.approx(1.0)
    assert settings.learning_rate_at(55) == pytest.approx(0.55)
    assert settings.learning_rate_at(100) == pytest.approx(0.1)


def test_shipped_configs_are_valid_and_differ_only_in_placement():
    family = {name: training.load_config(CONFIGS / f"{name}.toml") for name in ("pre", "qkv", "none", "post")}
    for name, config in family.items():
        assert config.model.norm_placement == name
        reference = family["pre"].to_dict()
        reference["model"]["norm_placement"] = name
        assert config.to_dict() == reference


def test_paper_task_configs_are_valid_and_differ_only_in_placement():
    pre, qkv = (training.load_config(CONFIGS / f"paper-task-{name}.toml") for name in ("pre", "qkv"))
    assert pre.task.digit_lengths == (1, 2) and pre.task.train_counts == (3, 4, 6)
    reference = pre.to_dict()
    reference["model"]["norm_placement"] = "qkv"
    assert qkv.to_dict() == reference
    exact = training.load_config(CONFIGS / "paper-task-exact.toml")
    assert exact.task.digit_lengths == (2, 3) and exact.task.counts("extrapolation") == (7, 8, 9)
    assert (exact.model.n_layers, exact.model.d_model, exact.model.n_heads, exact.model.d_head) == (10, 512, 12, 64)
    assert exact.train.learning_rate == 3e-4


def test_a_seed_replaces_the_configs_seed_in_the_run_and_its_saved_copy(tmp_path):
    config = write_config(tmp_path / "c.toml", train__steps=2, train__warmup_steps=1)
    assert training.load_config(config, seed=7).to_dict() == {**training.load_config(config).to_dict(), "seed": 7}
    training.train(config, tmp_path / "s7", progress=False, seed=7)
    copy = tmp_path / "s7" / training.CONFIG_COPY
    assert training.load_config(copy).seed == 7
    assert training.train(config, tmp_path / "s7", resume=True, progress=False, seed=7)["eval_seed"] == 7
    with pytest.raises(ConfigError, match="already holds a different model .*seed"):
        training.train(config, tmp_path / "s7", resume=True, progress=False, seed=8)
    with pytest.raises(ConfigError, match="expected a non-negative integer"):
        training.load_config(config, seed=-1)
    unseeded = tmp_path / "unseeded.toml"
    unseeded.write_text(config.read_text().replace("seed = 0", ""))
    with pytest.raises(ConfigError, match="no top-level `seed = ...` line"):
        training.load_config(unseeded, seed=1)


@pytest.mark.parametrize("changes, message", [
    ({"model__norm_placement": '"sandwich"'}, r"bad.toml: \[model\] norm_placement = 'sandwich': expected one of"),
    ({"model__norm_type": '"batch"'}, "norm_type = 'batch': expected one of"),
    ({"model__d_model": "33"}, "d_model = 33 is not divisible by n_heads = 2"),
    ({"model__dropout": "0.1"}, "unknown model keys \\['dropout'\\]"),
    ({"train__optimiser": '"sgd"'}, "unknown train keys \\['optimiser'\\]"),
    ({"task__max_digits": "3"}, "unknown task keys \\['max_digits'\\]"),
    ({"model__vocab_size": "20"}, "vocab_size = 20"),
    ({"train__warmup_steps": "100"}, r"\[train\] warmup_steps = 100: expected an integer from 0 to steps = "),
    ({"train__beta2": "1.5"}, r"\[train\] beta2 = 1.5: expected a number in \[0, 1\)"),
    ({"train__beta1": "1.0"}, r"\[train\] beta1 = 1.0: expected a number in \[0, 1\)"),
    ({"train__beta2": "1.0"}, r"\[train\] beta2 = 1.0: expected a number in \[0, 1\)"),
    ({"model__positions": '"learned"', "model__max_position_offset": "0", "model__max_len": "20"},
     "max_len = 20 is shorter than the task's longest sequence"),
])
def test_bad_configs_are_config_errors(tmp_path, changes, message):
    config = write_config(tmp_path / "bad.toml", **changes)
    with pytest.raises(ConfigError, match=message):
        training.train(config, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_unknown_top_level_keys_and_missing_files_are_config_errors(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("epochs = 3\n" + TINY.read_text())
    with pytest.raises(ConfigError, match="unknown top-level keys \\['epochs'\\]"):
        training.load_config(config)
    with pytest.raises(ConfigError, match="not found"):
        training.load_config(tmp_path / "missing.toml")
    config.write_text("seed = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        training.load_config(config)
    config.write_text("seed = 0\n[task]\n[model]\n")
    with pytest.raises(ConfigError, match="no \\[train\\] table"):
        training.load_config(config)


def test_an_output_directory_holding_something_else_is_refused(tmp_path):
    config = write_config(tmp_path / "c.toml", train__steps=2, train__warmup_steps=1)
    training.train(config, tmp_path / "run", progress=False)
    with pytest.raises(ConfigError, match="already holds the finished model of this config"):
        training.train(config, tmp_path / "run", progress=False)
    other = write_config(tmp_path / "other.toml", train__steps=2, train__warmup_steps=1,
                         model__norm_placement='"qkv"')
    with pytest.raises(ConfigError, match="already holds a different model .*model.norm_placement"):
        training.train(other, tmp_path / "run", resume=True, progress=False)
    (tmp_path / "stranger").mkdir()
    (tmp_path / "stranger" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="holds no train.toml"):
        training.train(config, tmp_path / "stranger", progress=False)
    with pytest.raises(ConfigError, match="unknown device 'tpu'"):
        training.train(config, tmp_path / "new", device="tpu", progress=False)


def test_a_run_that_failed_before_its_first_checkpoint_leaves_the_folder_to_a_corrected_config(tmp_path, monkeypatch):
    config = write_config(tmp_path / "c.toml", train__steps=2, train__warmup_steps=1)
    broken = write_config(tmp_path / "broken.toml", train__steps=3, train__warmup_steps=1)
    build = training.build
    monkeypatch.setattr(training, "build", lambda *args: (_ for _ in ()).throw(Killed()))
    with pytest.raises(Killed):
        training.train(broken, tmp_path / "run", progress=False)
    monkeypatch.setattr(training, "build", build)
    training.train(config, tmp_path / "run", progress=False)
    assert training.load_config(tmp_path / "run" / training.CONFIG_COPY).train.steps == 2


def test_an_output_folder_that_cannot_be_created_is_named(tmp_path):
    (tmp_path / "afile").write_text("")
    out = tmp_path / "afile" / "run"
    with pytest.raises(ConfigError, match=rf"cannot write the output folder {out} \(--out\): Not a directory; pass a folder"):
        training.train(TINY, out, progress=False)


def test_the_tiny_config_parses_to_the_documented_task():
    values = tomllib.loads(TINY.read_text())
    assert training.parse_config(values).task == tasks.DEFAULT_SPEC


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_asking_for_cuda_without_it_is_a_config_error():
    with pytest.raises(ConfigError, match="torch sees no CUDA device"):
        training.select_device("cuda:0")
    assert training.select_device("auto").type == "cpu"
