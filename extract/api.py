"""Extraction from Python: ``orthosphere.extract(model, data, out, ...)``, what ``orthosphere extract`` runs.

``model`` is a path (a model directory, a .gguf file, an orthosphere checkpoint) or a model loaded
in this process (a transformers model of a supported family, with its ``tokenizer``, or an
orthosphere arithmetic model); ``data`` a task spec (the CLI's ``--task``) or a data object
(``orthosphere.corpus.jsonl(...)``, ``orthosphere.tasks.arithmetic(...)``). Returns the store,
opened lazily (``orthosphere.store.open_store``).
"""
from __future__ import annotations

import os
import textwrap

import xarray as xr

from orthosphere.store import open_store

from .data import ArithmeticData, CorpusData
from .job import ExtractJob, run_job


def extract(model, data: str | ArithmeticData | CorpusData, out: str | os.PathLike, *, client=None,
            progress: bool = False, **parameters) -> xr.Dataset:
    """Run (or, with mode="resume", continue) an extraction of `model` over `data` into the store
    `out` and return the store. `client`: a distributed.Client (the shards run on its workers; a
    model path only); `progress`: show a progress bar. The other keywords are the parameters of
    ``ExtractJob``, the CLI's options by their Python names (``orthosphere extract --help``):

"""
    job = ExtractJob.of({"model": model, "task": data, "out": out, **parameters}, owner="orthosphere.extract")
    run_job(job, client=client, progress=progress)
    return open_store(job.out, storage_options=job.storage_options)


extract.__doc__ += textwrap.indent(ExtractJob.described(leave=("model", "task", "out", "command")), "    ")
