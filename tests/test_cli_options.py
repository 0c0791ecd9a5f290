"""The command line's options of extract, analyze and train are the configurations' parameters:
generated from their fields (help, defaults, choices), spelled by one table, and the same spelling
names a parameter in the CLI's error messages."""
from dataclasses import dataclass

import click
import pytest
from click.testing import CliRunner

from orthosphere.analyze import ANALYSES
from orthosphere.extract.job import ExtractJob
from orthosphere.extract.sources import MODEL_DTYPES
from orthosphere.params import Config, OneOf, parameter
from orthosphere.store.schema import ACTIVATION_DTYPES
from orthosphere.workflows.cli import NOT_EXPOSED, SPELLINGS, main
from orthosphere.workflows.cli_options import ConfigCommand, ConfigOptions, ParameterArgument, ParameterOption, Spelled, Spelling
from orthosphere.workflows.train import TrainJob

CONFIGS = {"extract": [ExtractJob], "analyze": [analysis.config for analysis in ANALYSES.values()], "train": [TrainJob]}
"""The configurations whose parameters each verb's options are."""

CLI_ONLY = {
    "extract": {"workers", "scheduler"},
    "analyze": {"store", "out", "only", "extra", "overwrite", "online_model", "online_samples"},
    "train": set(),
}
"""The options of each verb that set no configuration's parameter (the group's: --workers, --scheduler, -v)."""


def params(verb: str) -> list[click.Parameter]:
    command = main.commands[verb]
    command.get_params(click.Context(command))  # generates the options
    return command.params


@pytest.mark.parametrize("verb", sorted(CONFIGS))
def test_the_options_of_a_verb_and_its_configurations_parameters_are_the_same_set(verb):
    declared = {name for config in CONFIGS[verb] for name in config.parameters()}
    generated = {param.parameter for param in params(verb) if isinstance(param, (ParameterOption, ParameterArgument))}
    assert generated == declared - set(NOT_EXPOSED), "a parameter without an option must be listed in NOT_EXPOSED"
    assert all(param.help for param in params(verb) if isinstance(param, ParameterOption)), "an option shows its field's help"
    assert {param.name for param in params(verb)
            if not isinstance(param, (ParameterOption, ParameterArgument))} == CLI_ONLY[verb]
    assert {param.name for param in main.params} == {"workers", "scheduler", "verbose", "version"}


def test_the_spellings_and_the_hidden_parameters_name_parameters_that_exist():
    for key in SPELLINGS:
        verb, _, name = key.rpartition(".")
        assert any(name in config.parameters() for config in CONFIGS.get(verb) or sum(CONFIGS.values(), [])), key
    for name in NOT_EXPOSED:
        assert any(name in config.parameters() for config in sum(CONFIGS.values(), [])), name


def test_help_defaults_and_choices_come_from_the_fields():
    options = {param.name: param for param in params("extract")}
    fields = ExtractJob.parameters()
    assert options["dtype"].type.choices == ACTIVATION_DTYPES and options["dtype"].default == "float32"
    assert options["model_dtype"].type.choices == MODEL_DTYPES
    assert options["batch_size"].default == fields["batch_size"].default and options["batch_size"].type is click.INT
    assert options["n_shards"].opts == ["--shards"] and options["n_shards"].help.startswith("Chunk-aligned shards")
    help_text = CliRunner().invoke(main, ["extract", "--help"]).output
    assert "--samples INTEGER" in help_text and "[default: 64]" in help_text and "--no-pred" in help_text


def test_an_option_several_analyses_take_is_one_option_with_each_ones_help_and_default():
    option = next(param for param in params("analyze") if param.name == "n_bootstrap")
    assert option.opts == ["--bootstrap"] and option.default is None
    assert "subspaces, spheres: noise draws" in option.help and "(default 200)" in option.help
    assert "replay: bootstrap resamples" in option.help and "(default 1000)" in option.help


def test_messages_name_parameters_by_the_verbs_flags():
    extract = Spelled(main.commands["extract"])
    assert extract("fewer than n_samples=20: ask for fewer") == "fewer than --samples=20: ask for fewer"
    assert extract("n_samples=N or n_shards=3; leave model_dtype= out") == "--samples=N or --shards=3; leave --model-dtype out"
    assert extract("pass break_lock=True; pred=False; mode=\"resume\"") == "pass --break-lock; --no-pred; --resume"
    assert extract("with mode='overwrite'") == "with --overwrite"
    assert extract("model_dtype='x', dtype='y', replay.n_samples=2") == "--model-dtype='x', --dtype='y', replay.n_samples=2"
    analyze = Spelled(main.commands["analyze"])
    assert analyze("rank=0: expected; option seed=-1; overwrite=True") == "rank=0: expected; option seed=-1; --overwrite"
    assert Spelled(main.commands["run"])("pass break_lock=True") == "pass --break-lock"
    assert Spelled(main)("workers=0: expected") == "--workers=0: expected"


@dataclass(frozen=True)
class Job(Config):
    mode: str = parameter("new", OneOf(("new", "resume", "overwrite")), help="what to do with an existing store")


def test_flags_that_each_set_one_value_of_a_parameter_exclude_each_other():
    spellings = {"mode": Spelling(values={"resume": "--resume", "overwrite": "--overwrite"})}

    @click.command(cls=ConfigCommand, options=lambda: ConfigOptions(Job, spellings, {}, "job"))
    @click.pass_context
    def job(ctx, **given):
        click.echo(Job(**ctx.command.options.values(given)).mode)

    runner = CliRunner()
    assert [runner.invoke(job, flags).output.strip() for flags in ([], ["--resume"], ["--overwrite"])] == [
        "new", "resume", "overwrite"]
    both = runner.invoke(job, ["--resume", "--overwrite"])
    assert both.exit_code == 2 and "--resume and --overwrite contradict each other: give one" in both.output
    assert Spelled(job)('pass mode="resume" or mode=\'overwrite\'') == "pass --resume or --overwrite"


def test_a_parameter_without_a_command_line_form_must_be_spelled_or_hidden():
    @dataclass(frozen=True)
    class Loaded(Config):
        model: object = parameter(None, help="a model object")

    with pytest.raises(TypeError, match="parameter model of job has no command-line form"):
        ConfigOptions(Loaded, {}, {}, "job").params()
    assert ConfigOptions(Loaded, {}, {"model": "an object"}, "job").params() == []


def test_bad_training_options_name_their_flags(tmp_path):
    result = CliRunner().invoke(main, ["train", str(tmp_path / "none.toml"), "--out", str(tmp_path), "--seed", "-1"])
    assert result.exit_code == 1 and "Error: --seed=-1: expected an integer >= 0, or none" in result.output


def test_extract_resume_and_overwrite_set_the_jobs_mode_and_exclude_each_other(tmp_path):
    command = ["extract", str(tmp_path / "model"), "--task", "arithmetic:split=test,seed=0", "--out", str(tmp_path / "s.zarr")]
    both = CliRunner().invoke(main, [*command, "--resume", "--overwrite"])
    assert both.exit_code == 2 and "--resume and --overwrite contradict each other: give one" in both.output
    command_line = main.commands["extract"]
    modes = []
    for flags in ([], ["--resume"], ["--overwrite"]):
        context = command_line.make_context("extract", [str(tmp_path / "model"), "--out", str(tmp_path / "s.zarr"), *flags])
        modes.append(command_line.options.values(dict(context.params))["mode"])
    assert modes == ["new", "resume", "overwrite"]
    assert not (tmp_path / "s.zarr").exists()
