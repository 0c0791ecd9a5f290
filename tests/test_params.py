"""Typed configurations: the constraint vocabulary, the analyses' registry of objects, and one message
for one bad value from Python, the CLI and a TOML pipeline (each naming the option as its caller did)."""
from __future__ import annotations

import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from orthosphere.analyze import ANALYSES
from orthosphere.analyze.options import AnalysisConfig, nested, parse_assignment, parse_options
from orthosphere.analyze.registry import Analysis
from orthosphere.analyze.results import configure
from orthosphere.analyze.spheres import SpheresConfig
from orthosphere.analyze.subspaces import FactorSubspaces, SubspacesConfig
from orthosphere.errors import AnalysisError, AnalysisParameterError, ConfigError, ParameterError
from orthosphere.params import Config, Flag, Interval, Items, OneOf, Text, checked, parameter
from orthosphere.workflows.cli import main
from orthosphere.workflows.pipeline import load_pipeline
from tests.synthetic import write_store

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Example(Config):
    rate: float = parameter(0.5, Interval(float, 0, 1, closed="right"), help="a share")
    count: int | None = parameter(None, Interval(int, 2), None)
    names: tuple[str, ...] = parameter(("a",), Items(Text()))
    flag: bool = parameter(True, Flag())

    def check(self) -> None:
        if self.count is not None and self.count > 10 and not self.flag:
            raise self.error("count", self.count, "at most 10 without flag")


@pytest.mark.parametrize("constraint, good, bad, expected", [
    (Interval(float, 0, 1, closed="right"), [1, 0.5, np.float32(0.2)], [0, 1.5, True, "0.5", None], "a number in (0, 1]"),
    (Interval(float, 0, 1, closed="neither"), [0.5], [0.0, 1.0], "a number strictly between 0 and 1"),
    (Interval(int, 2), [2, np.int64(7)], [1, 2.5, True, "3"], "an integer >= 2"),
    (Interval(int, 2, 9), [2, 9], [10], "an integer from 2 to 9"),
    (Interval(float, 0, closed="neither"), [1e-9], [0, -1], "a positive number"),
    (OneOf(("x", "y")), ["x"], ["z", 1], "one of ['x', 'y']"),
    (Flag(), [True, False], [1, 0, "true"], "true or false"),
    (Items(Interval(float, 0, 1), increasing=True), [[0.1, 0.2], (0.3,), np.array([0.1, 0.5])],
     [[], [0.2, 0.1], [0.1, 0.1], "0.1", [2]], "a non-empty list of strictly increasing items, each a number in [0, 1]"),
])
def test_each_constraint_accepts_what_it_describes_and_refuses_the_rest(constraint, good, bad, expected):
    assert constraint.expected == expected
    for value in good:
        assert constraint.accepts(value), value
    for value in bad:
        assert not constraint.accepts(value), value


def test_a_configuration_checks_its_fields_converts_them_and_names_a_refused_one():
    example = Example(names=["b", "c"], count=np.int64(3))
    assert example.names == ("b", "c") and example.count == 3 and type(example.count) is int
    assert Example.defaults() == {"rate": 0.5, "count": None, "names": ("a",), "flag": True}
    assert example.changed() == {"count": 3, "names": ("b", "c")}
    with pytest.raises(ParameterError, match=r"^rate=2: expected a number in \(0, 1\]$") as error:
        Example(rate=2)
    assert (error.value.parameter, error.value.value, error.value.expected) == ("rate", 2, "a number in (0, 1]")
    with pytest.raises(ParameterError, match=r"^count=1: expected an integer >= 2, or none$"):
        Example(count=1)
    with pytest.raises(ParameterError, match="expected a list, not a single string"):
        Example(names="b")
    with pytest.raises(ParameterError, match="count=11: expected at most 10 without flag"):
        Example(count=11, flag=False)
    with pytest.raises(ParameterError, match=r"^colour: not known: expected a parameter of Example, one of \['count', "):
        Example.of({"colour": "red"})
    named = pickle.loads(pickle.dumps(error.value.named('pipeline.toml [t] "x.rate"')))
    assert str(named) == 'pipeline.toml [t] "x.rate"=2: expected a number in (0, 1]' and named.parameter == "rate"


def test_none_is_refused_unless_declared():
    with pytest.raises(ParameterError, match="rate=None: expected a number"):
        Example(rate=None)
    assert checked("x", None, (Interval(int, 0), None)) is None


def test_every_analysis_is_a_registered_object_with_a_configuration_of_checked_defaults():
    assert list(ANALYSES) == ["accuracy", "norms", "subspaces", "spheres", "neighbours", "norm_geometry", "replay"]
    for name, analysis in ANALYSES.items():
        assert isinstance(analysis, Analysis) and analysis.name == name
        assert issubclass(analysis.config, AnalysisConfig) or analysis.config is SpheresConfig
        assert analysis.configure({}).as_dict().keys() == analysis.defaults.keys()
        assert analysis.reads and analysis.summary
        for parameter_name, declared in analysis.config.parameters().items():
            assert declared.metadata["constraints"], (name, parameter_name)
    assert ANALYSES["accuracy"].needs == ("pred",) and ANALYSES["spheres"].takes == ("subspaces",)
    assert list(SpheresConfig.parameters()) == list(SubspacesConfig.parameters())
    assert set(SpheresConfig.defaults().values()) == {None}
    with pytest.raises(AnalysisParameterError, match="rank=0: expected an integer >= 1, or none"):
        SpheresConfig(rank=0)


def test_the_estimator_takes_its_configuration_or_its_keywords_not_both():
    config = SubspacesConfig(rank=2, seed=3)
    assert FactorSubspaces(config).fit_options == FactorSubspaces(rank=2, seed=3).fit_options
    with pytest.raises(AnalysisError, match="not both"):
        FactorSubspaces(config, rank=2)
    with pytest.raises(AnalysisParameterError, match=r"colour: not known: expected a parameter of FactorSubspaces"):
        FactorSubspaces(colour=1)


def test_an_option_is_named_as_its_caller_gave_it():
    analyses = [ANALYSES["norms"], ANALYSES["replay"]]
    with pytest.raises(AnalysisParameterError, match=r"^replay\.n_draws=0: expected an integer >= 1"):
        configure(analyses, {"replay": {"n_draws": 0}})
    with pytest.raises(AnalysisParameterError, match=r"^replay\.n_draws=0: expected an integer >= 1"):
        configure(analyses, {"n_draws": 3, "replay": {"n_draws": 0}})
    with pytest.raises(AnalysisParameterError, match=r"^n_draws=0: expected an integer >= 1"):
        configure(analyses, {"n_draws": 0})
    with pytest.raises(AnalysisParameterError, match=r"^option replay\.n_draws=0: expected an integer >= 1"):
        parse_assignment("replay.n_draws=0", ANALYSES.values())
    with pytest.raises(AnalysisError, match=r"\['mas'\] are not options of the chosen analyses"):
        configure(analyses, {"mas": 0.5})


def test_options_given_as_text_are_read_once_into_one_configuration_per_analysis():
    given = parse_options(["mass=0.8", "replay.n_draws=8", "replay.seed=2", "seed=1", "reply.x=1"], ANALYSES.values())
    assert given == {"mass": 0.8, "replay": {"n_draws": 8, "seed": 2}, "seed": 1, "reply.x": 1}
    with pytest.raises(AnalysisError, match=r"\['reply.x'\] are not options of the chosen analyses"):
        configure(ANALYSES.values(), given)
    del given["reply.x"]
    configs = configure([ANALYSES["norms"], ANALYSES["subspaces"], ANALYSES["replay"]], given)
    assert configs["norms"].mass == 0.8 and configs["subspaces"].seed == 1  # a shared option goes to every taker
    assert (configs["replay"].n_draws, configs["replay"].seed) == (8, 2)  # an analysis's own value wins
    assert nested({"replay.n_draws": 8, "replay": {"seed": 2}}, ANALYSES.values()) == {"replay": {"n_draws": 8, "seed": 2}}


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory):
    return write_store(tmp_path_factory.mktemp("params") / "s.zarr",
                       {"resid_pre": np.ones((2, 2, 3, 4), np.float32)}, with_weights=False)


@pytest.mark.parametrize("key, value, expected", [
    ("mass", 1.5, r"expected a number in \(0, 1\]"),
    ("n_draws", 0, "expected an integer >= 1, noise draws per level"),
    ("orthogonality_deg", 95, "expected a tolerance in degrees strictly between 0 and 90"),
    ("distribution", "cauchy", r"expected one of \['uniform', 'gaussian'\]"),
])
def test_one_bad_value_gives_one_message_from_python_the_cli_and_a_pipeline(tmp_path, tiny_store, key, value, expected):
    import orthosphere

    text = f"{value!r}" if isinstance(value, str) else f"{value}"
    with pytest.raises(AnalysisParameterError, match=rf"^{key}={text}: {expected}"):
        orthosphere.analyze(tiny_store, **{key: value})
    json_value = f'"{value}"' if isinstance(value, str) else text
    result = CliRunner().invoke(main, ["analyze", str(tiny_store), "--out", str(tmp_path / "r.zarr"), "--option",
                                       f"{key}={json_value}"])
    assert result.exit_code != 0
    assert f"option {key}={text}: " in result.output and "expected" in result.output, result.output
    config = tmp_path / "p.toml"
    config.write_text('[models.pre]\npath = "m"\n[data.test]\ntask = "arithmetic:split=test"\nsamples = 4\n'
                      f'[analyze.options]\n{key} = {json_value}\n')
    with pytest.raises(ConfigError, match=rf"{config} \[analyze.options\] {key} = {text}: {expected}"):
        load_pipeline(config)


def test_a_parameter_error_names_its_table_and_key_whether_the_value_is_bad_or_the_key_unknown():
    bad = ParameterError("steps", 0, "a positive integer")
    assert str(bad.in_table("run.toml [train]", "steps")) == "run.toml [train] steps = 0: expected a positive integer"
    unknown = ParameterError("colour", 3, "a parameter of TrainConfig, one of ['steps']", unknown=True)
    assert str(unknown.in_table("run.toml [train]", "colour")) == (
        "run.toml [train] colour: not known: expected a parameter of TrainConfig, one of ['steps']")


@pytest.mark.parametrize("parameter, flag, key, value, expected", [
    ("batch_size", "--batch-size", "batch_size", 0, "expected a positive integer"),
    ("n_shards", "--shards", "shards", -2, "expected a positive integer"),
    ("dtype", "--dtype", "dtype", "float64", r"expected one of \['float16', 'bfloat16', 'float32'\]"),
    ("device", "--device", "device", "gpu", "expected auto, cpu, cuda or cuda:N"),
])
def test_one_bad_extraction_setting_gives_one_message_from_python_the_cli_and_a_pipeline(tmp_path, parameter, flag, key,
                                                                                         value, expected):
    import orthosphere

    out = tmp_path / "s.zarr"
    text = repr(value)
    with pytest.raises(ParameterError, match=rf"^{parameter}={text}: {expected}"):
        orthosphere.extract(ROOT / "workflows" / "models" / "pre", "arithmetic:split=test", out, **{parameter: value})
    result = CliRunner().invoke(main, ["extract", str(ROOT / "workflows" / "models" / "pre"), "--task", "arithmetic",
                                       "--out", str(out), flag, str(value)])
    assert result.exit_code != 0
    if flag != "--dtype":  # click refuses a --dtype outside its choices before the job is built
        assert f"Error: {flag}={text}: " in result.output and re.search(expected, result.output), result.output
    config = tmp_path / "p.toml"
    toml_value = f'"{value}"' if isinstance(value, str) else text
    config.write_text('[models.pre]\npath = "m"\n[data.test]\ntask = "arithmetic:split=test"\nsamples = 4\n'
                      f'[extract]\n{key} = {toml_value}\n')
    with pytest.raises(ConfigError, match=rf"{config} \[extract\] {key} = {text}: {expected}"):
        load_pipeline(config)
    assert not out.exists()


def test_training_and_model_configs_declare_their_constraints():
    from orthosphere.extract.model import ModelConfig
    from orthosphere.workflows.train import TrainConfig

    with pytest.raises(ParameterError, match=r"^eval_every=0: expected a positive integer$"):
        TrainConfig(steps=10, batch_size=2, eval_every=0)
    with pytest.raises(ParameterError, match=r"^warmup_steps=20: expected an integer from 0 to steps = 10$"):
        TrainConfig(steps=10, batch_size=2, warmup_steps=20)
    with pytest.raises(ConfigError, match=r"^\[train\] learning_rate = -1.0: expected a positive number$"):
        TrainConfig.from_table({"steps": 10, "batch_size": 2, "learning_rate": -1.0}, "train")
    with pytest.raises(ConfigError, match=r"^train config is incomplete: missing \['batch_size'\]$"):
        TrainConfig.from_table({"steps": 10}, "train")
    assert TrainConfig(steps=10, batch_size=2, warmup_steps=3).changed() == {"steps": 10, "batch_size": 2, "warmup_steps": 3}
    model = ModelConfig(n_layers=1, d_model=8, n_heads=2, d_ff=16, norm_placement="qkv")
    assert model.d_head == 4
    from orthosphere.extract.tasks import TaskSpec

    assert TaskSpec(train_counts=[6, 3, 4, 3]).train_counts == (3, 4, 6) and TaskSpec(digit_lengths=2).digit_lengths == (2,)
    with pytest.raises(ParameterError, match=r"^train_counts=\[0\]: expected a positive integer, or a non-empty list"):
        TaskSpec(train_counts=[0])
    with pytest.raises(ConfigError, match=r"^\[task\] digit_lengths = True: expected a positive integer"):
        TaskSpec.from_table({"digit_lengths": True}, "task")
    with pytest.raises(ParameterError, match=r"^norm_eps=0.0: expected a positive number$"):
        ModelConfig(n_layers=1, d_model=8, n_heads=2, d_ff=16, norm_placement="qkv", norm_eps=0.0)
