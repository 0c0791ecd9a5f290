"""The Python API: ``orthosphere.extract``, ``orthosphere.analyze``, the data objects and the
top-level names; the README's example runs as written; a model object extracts what its directory
does; bad input gets one clear error naming the parameter."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import orthosphere
from orthosphere.extract.data import parse_task
from orthosphere.extract.families import UnsupportedModelError
from orthosphere.extract.model import ConfigError
from tests.test_extract_models import word_tokenizer, write_text
from tests.tiny_families import tiny_model

ROOT = Path(__file__).resolve().parents[1]
SITES = ["resid_pre", "attn_in", "q", "k", "v", "resid_post"]


def readme_example() -> str:
    section = (ROOT / "README.md").read_text().split("## From Python", 1)[1]
    return section.split("```python", 1)[1].split("```", 1)[0]


def test_the_readme_python_example_runs(tmp_path, monkeypatch):
    (tmp_path / "workflows").symlink_to(ROOT / "workflows")
    monkeypatch.chdir(tmp_path)
    exec(compile(readme_example(), "README.md (From Python)", "exec"), {})
    assert orthosphere.validate("runs/python/pre.zarr") == []
    results = orthosphere.open_results("runs/python/pre-results.zarr")
    assert results["norms"].attrs["options"]["mass"] == 0.8 and results["norms"].attrs["options"]["layers"] == [0, 1]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama saved with its tokenizer, and a text file."""
    folder = tmp_path_factory.mktemp("api")
    model = tiny_model("llama")
    model.save_pretrained(folder / "model", safe_serialization=True)
    word_tokenizer("llama").save_pretrained(folder / "model")
    return folder, write_text(folder / "text.txt")


def test_a_model_object_extracts_what_its_directory_does(llama, tmp_path):
    import transformers

    folder, text = llama
    data = orthosphere.corpus.text(text, max_length=12)
    from_path = orthosphere.extract(folder / "model", data, tmp_path / "path.zarr", sites=SITES, dtype="float32")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder / "model")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder / "model")
    from_object = orthosphere.extract(model, data, tmp_path / "object.zarr", tokenizer=tokenizer, sites=SITES,
                                      dtype="float32")
    for name in [*SITES, "tokens", "valid", "pred", "target"]:
        np.testing.assert_array_equal(from_object[name].values, from_path[name].values, err_msg=name)
    described, stored = from_object.attrs["model"], from_path.attrs["model"]
    assert described["source"] == "in memory (LlamaForCausalLM)" and described["format"] == "in-memory"
    differing = {key for key in stored if described.get(key) != stored[key]}
    assert differing == {"source", "format", "weights_sha256"}
    assert from_object.attrs["task"] == from_path.attrs["task"]
    # the hash of the tensors is the same each time, so the job resumes (here: already complete)
    again = orthosphere.extract(model, data, tmp_path / "object.zarr", tokenizer=tokenizer, sites=SITES,
                                dtype="float32", mode="resume")
    assert again.attrs["model"]["weights_sha256"] == described["weights_sha256"]


def test_an_arithmetic_model_object_and_the_task_object(tmp_path):
    from orthosphere.extract.model import load_model

    model_dir = ROOT / "workflows" / "models" / "pre"
    task = orthosphere.tasks.arithmetic("test", seed=2)
    assert task == parse_task("arithmetic:split=test,seed=2")
    from_path = orthosphere.extract(model_dir, "arithmetic:split=test,seed=2", tmp_path / "a.zarr", n_samples=8)
    from_object = orthosphere.extract(load_model(model_dir), task, tmp_path / "b.zarr", n_samples=8)
    np.testing.assert_array_equal(from_object.resid_pre.values, from_path.resid_pre.values)


def test_data_objects_are_the_task_specs(tmp_path):
    path = str(tmp_path / "c.jsonl")
    assert orthosphere.corpus.jsonl(path, field="body", context=64, bos=False, separator=7) == parse_task(
        f"jsonl:path={path},field=body,context=64,bos=none,separator=7")
    assert orthosphere.corpus.parquet(path, column="ids", tokenized=True, max_length=16) == parse_task(
        f"parquet:path={path},column=ids,tokenized=true,max_length=16")
    assert orthosphere.corpus.hf(path, split="train") == parse_task(f"hf:path={path},split=train")
    assert orthosphere.corpus.text(path, document="file", context=32) == parse_task(
        f"text:path={path},document=file,context=32")
    assert orthosphere.tasks.arithmetic("extrapolation", 3, extrapolation_counts=[7, 8]) == parse_task(
        "arithmetic:split=extrapolation,seed=3,extrapolation_counts=7/8")
    odd = tmp_path / "a,b=c.txt"  # a path the spec string cannot hold
    assert orthosphere.corpus.text(odd).path == str(odd)


@pytest.mark.parametrize("call, error, message", [
    (lambda: orthosphere.corpus.text("c.txt", context=16, max_length=8), ConfigError,
     r"text corpus c.txt: context=N .* and max_length=N .* exclude each other"),
    (lambda: orthosphere.corpus.jsonl("c.jsonl", context=0), ConfigError, r"jsonl corpus c.jsonl: context=0 is too short"),
    (lambda: orthosphere.corpus.text("c.txt", document="page"), ConfigError, r"document='page': expected line"),
    (lambda: orthosphere.tasks.arithmetic("dev"), ConfigError, r"arithmetic task: .*dev"),
    (lambda: orthosphere.corpus.text("c.txt", field="body"), ConfigError,
     r"text corpus c.txt: unknown text option\(s\) \['field'\]; expected \['bos', 'context', 'document', "),
    (lambda: orthosphere.corpus.jsonl("c.jsonl", context=8, bos=-1), ConfigError, r"bos=-1: expected True .* or a token id"),
    (lambda: orthosphere.corpus.hf("d", tokenized="yes"), ConfigError, r"hf corpus d: tokenized='yes': expected true or false"),
])
def test_bad_data_objects_name_the_parameter(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("keywords, options", [
    ({"context": 1}, "context=1"),
    ({"document": "page"}, "document=page"),
    ({"context": 8, "max_length": 8}, "context=8,max_length=8"),
    ({"max_length": 8, "separator": False}, "max_length=8,separator=none"),
])
def test_a_bad_value_gets_the_same_message_from_python_and_a_spec(keywords, options):
    with pytest.raises(ConfigError) as from_python:
        orthosphere.corpus.text("c.txt", **keywords)
    with pytest.raises(ConfigError) as from_spec:
        parse_task(f"text:path=c.txt,{options}")
    detail = str(from_python.value).removeprefix("text corpus c.txt: ")
    assert detail != str(from_python.value) and f"does not parse ({detail}): expected" in str(from_spec.value)


def test_bad_extraction_input_names_the_parameter(llama, tmp_path):
    folder, text = llama
    data = orthosphere.corpus.text(text, max_length=12)
    out = tmp_path / "s.zarr"
    cases = [
        (dict(model=torch.nn.Linear(2, 2), data=data), UnsupportedModelError,
         r"a Linear \(neither a transformers model nor an orthosphere arithmetic model\) is not supported"),
        (dict(model=42, data=data), ConfigError, r"model of type int: expected a path"),
        (dict(model=folder / "model", data=42), ConfigError, r"data 42 \(int\): expected a task spec"),
        (dict(model=folder / "model", data=["text"]), ConfigError, r"data \['text'\] \(list\): expected a task spec"),
        (dict(model=folder / "model", data=data, batch_size=0), ConfigError,
         r"^batch_size=0: expected a positive integer$"),
        (dict(model=folder / "model", data=data, tokenizer=object()), ConfigError, r"tokenizer= goes with a model object"),
        (dict(model=tiny_model("llama"), data=data, tokenizer="vocab.txt"), ConfigError,
         r"tokenizer of type str: expected a transformers tokenizer"),
        (dict(model=tiny_model("llama"), data=data, model_dtype="bfloat16"), ConfigError,
         r"model_dtype='bfloat16' with a model object"),
        (dict(model=tiny_model("llama"), data=data, client=object()), ConfigError, r"a model object runs in this process"),
    ]
    for keywords, error, message in cases:
        keywords = dict(keywords)
        with pytest.raises(error, match=message):
            orthosphere.extract(keywords.pop("model"), keywords.pop("data"), out, **keywords)
        assert not out.exists()


def test_analyze_takes_each_analysis_options_by_name(tmp_path):
    store = tmp_path / "s.zarr"
    orthosphere.extract(ROOT / "workflows" / "models" / "pre", orthosphere.tasks.arithmetic(), store, n_samples=8,
                        sites=["resid_pre"])
    tree = orthosphere.analyze(store, analyses="norms", layers=[1], norms={"mass": 0.5},
                               weight_by_attention=False)
    assert list(tree.children) == ["norms"]
    assert tree["norms"].attrs["options"]["mass"] == 0.5 and tree["norms"].attrs["options"]["layers"] == [1]
    with pytest.raises(orthosphere.analyze.AnalysisError, match=r"option\(s\) \['norms.masss'\]"):
        orthosphere.analyze(store, analyses=["norms"], norms={"masss": 0.5})


def test_import_orthosphere_stays_light():
    code = ("import sys, orthosphere; orthosphere.open_store; orthosphere.open_results; orthosphere.validate; "
            "orthosphere.corpus.text('c.txt', context=8); orthosphere.tasks.arithmetic('extrapolation', seed=1); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    with pytest.raises(AttributeError, match="no attribute 'extractt'"):
        orthosphere.extractt  # noqa: B018


def test_every_error_is_in_one_hierarchy():
    import importlib
    import inspect
    import pkgutil

    from orthosphere import errors

    found = set()
    for package in ("orthosphere.extract", "orthosphere.store", "orthosphere.analyze", "orthosphere.workflows"):
        for module_info in pkgutil.walk_packages(importlib.import_module(package).__path__, f"{package}."):
            module = importlib.import_module(module_info.name)
            found |= {value for value in vars(module).values()
                      if inspect.isclass(value) and issubclass(value, Exception) and value.__module__.startswith("orthosphere")}
    assert {error.__name__ for error in found} >= {"ConfigError", "StoreError", "AnalysisError", "ReplayError"}
    for error in found:
        assert error.__module__ == "orthosphere.errors" and issubclass(error, errors.OrthosphereError), error


@pytest.mark.parametrize("layers, message", [
    ([1.5], r"layers: 1.5 is not a layer index: expected integers"),
    (["1"], r"layers: '1' is not a layer index: expected integers"),
    ([True], r"layers: True is not a layer index: expected integers"),
    ("1", r"layers='1': expected a list of layer indices"),
    ([], r"layers=\[\]: expected at least one layer index"),
])
def test_layers_are_checked_once_and_alike_by_extraction_the_store_and_the_analyses(tmp_path, layers, message):
    from orthosphere.analyze.errors import AnalysisError
    from orthosphere.store import StoreError, create_store
    from tests.synthetic import write_store

    model_dir = ROOT / "workflows" / "models" / "pre"
    with pytest.raises(ConfigError, match=message):
        orthosphere.extract(model_dir, orthosphere.tasks.arithmetic(), tmp_path / "s.zarr", n_samples=4, layers=layers)
    with pytest.raises(StoreError, match=message):
        create_store(tmp_path / "c.zarr", model={"n_layers": 2, "d_model": 4, "n_heads": 1, "n_kv_heads": 1, "d_head": 4},
                     task={}, n_samples=2, n_pos=3, sites=["resid_pre"], layers=layers)
    url = write_store(tmp_path / "w.zarr", {"resid_pre": np.zeros((2, 2, 3, 4), np.float32)}, with_weights=False)
    with pytest.raises(AnalysisError, match=message):
        orthosphere.analyze(url, analyses=["norms"], layers=layers, weight_by_attention=False)


def test_a_store_interrupted_before_the_configuration_layer_resumes_and_validates(tmp_path):
    """tests/data/interrupted-0.1.0.zarr: written by the code before the typed configurations
    (commit 40ce851), killed after its first of two shards (ORTHOSPHERE_CRASH_AT=shard-complete), on another machine:
    its shard holds that CPU's float32 rounding."""
    store = tmp_path / "old.zarr"
    shutil.copytree(ROOT / "tests" / "data" / "interrupted-0.1.0.zarr", store)
    options = dict(n_samples=4, sites=["resid_pre", "q", "k"], layers=[1], n_shards=2, samples_per_chunk=2, batch_size=2)
    data = "arithmetic:split=test,seed=5"
    with pytest.raises(orthosphere.store.IncompleteStoreError):
        orthosphere.open_store(store)
    resumed = orthosphere.extract(ROOT / "workflows" / "models" / "pre", data, store, mode="resume", **options)
    assert orthosphere.validate(store) == []
    fresh = orthosphere.extract(ROOT / "workflows" / "models" / "pre", data, tmp_path / "fresh.zarr", **options)
    for name in ("w_q", "tokens", "pred"):
        np.testing.assert_array_equal(resumed[name].values, fresh[name].values, err_msg=name)
    for name in ("resid_pre", "q", "k"):  # computed activations
        old_shard, new_shard = resumed[name].values, fresh[name].values
        # the shard resumed here (samples 2-3) is this machine's forward pass: bit for bit
        np.testing.assert_array_equal(old_shard[2:], new_shard[2:], err_msg=name)
        # the fixture's shard (samples 0-1) came from another CPU: equal within float32 rounding
        scale = np.abs(new_shard[:2]).max()
        np.testing.assert_allclose(old_shard[:2], new_shard[:2], rtol=0, atol=64 * np.finfo(np.float32).eps * scale,
                                   err_msg=name)


def test_extract_takes_the_jobs_parameters_by_their_names_and_lists_them(tmp_path):
    from orthosphere.errors import ParameterError
    from orthosphere.extract.api import extract
    from orthosphere.extract.job import ExtractJob

    with pytest.raises(ParameterError, match=r"n_sample: not known: expected a parameter of orthosphere.extract, one of .*'n_samples'"):
        orthosphere.extract("model", "arithmetic:split=test,seed=0", tmp_path / "s.zarr", n_sample=8)
    with pytest.raises(ParameterError, match=r"mode='continue': expected one of \['new', 'resume', 'overwrite'\]"):
        orthosphere.extract("model", "arithmetic:split=test,seed=0", tmp_path / "s.zarr", mode="continue")
    assert not (tmp_path / "s.zarr").exists()
    listed = {line.split()[1] for line in extract.__doc__.splitlines() if line.strip().startswith("- ")}
    assert listed == set(ExtractJob.parameters()) - {"model", "task", "out", "command"}
