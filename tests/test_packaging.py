"""Packaging: the version, `python -m orthosphere`, py.typed, and analysis without PyTorch."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata, resources

import numpy as np
import pytest

import orthosphere
from orthosphere.workflows.cli import EXTRA_MODULES
from tests.synthetic import write_store

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WITHOUT_EXTRACT = """
import sys

class NotInstalled:
    '''Behave as if the `extract` extra were not installed.'''
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "transformers", "safetensors", "gguf", "accelerate", "tqdm", "pyarrow"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NotInstalled())
import orthosphere.analyze
from orthosphere.workflows.cli import main

try:
    main(sys.argv[1:], prog_name="orthosphere")
finally:
    print("torch imported:", "torch" in sys.modules, file=sys.stderr)
"""


def run_without_extract(*arguments):
    return subprocess.run([sys.executable, "-c", WITHOUT_EXTRACT, *arguments], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_version_and_python_m():
    assert orthosphere.__version__ == metadata.version("orthosphere")
    result = subprocess.run([sys.executable, "-m", "orthosphere", "--version"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == f"orthosphere, version {orthosphere.__version__}"
    assert resources.files("orthosphere").joinpath("py.typed").is_file()


@pytest.mark.slow
def test_importing_analyze_store_and_the_cli_imports_no_torch():
    code = ("import sys, orthosphere.analyze, orthosphere.store, orthosphere.workflows.cli; "
            "print(sorted({name.split('.')[0] for name in sys.modules} & {'torch', 'transformers', 'safetensors'}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr


@pytest.mark.slow
def test_analysis_needs_no_torch(tmp_path):
    rng = np.random.default_rng(0)
    sites = {"resid_pre": (6, 2, 5, 8), "resid_post": (6, 2, 5, 8), "q": (6, 2, 5, 2, 4), "k": (6, 2, 5, 2, 4)}
    store = write_store(tmp_path / "store.zarr", {name: rng.normal(size=shape) for name, shape in sites.items()})
    results = str(tmp_path / "results.zarr")
    for arguments in (["info", store], ["validate", store, "--full"],
                      ["analyze", store, "--out", results, "--only", "accuracy,norms,neighbours"]):
        result = run_without_extract(*arguments)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "torch imported: False" in result.stderr
    extract = run_without_extract("extract", "some-model", "--task", "arithmetic", "--samples", "4", "--out",
                                  str(tmp_path / "new.zarr"))
    assert extract.returncode == 1 and "Traceback" not in extract.stderr
    needs = re.search(r"Error: this needs (\w+), which is not installed: install the extract extra "
                      r"\(pip install 'orthosphere\[extract\]'\)", extract.stderr)
    assert needs is not None and needs.group(1) in EXTRA_MODULES, extract.stderr
