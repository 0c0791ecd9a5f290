"""Extraction from Python: ``orthosphere.extract(model, data, out, ...)``, what ``orthosphere extract`` runs.

``model`` is a path (a model directory, a .gguf file, an orthosphere checkpoint) or a model loaded
in this process (a transformers model of a supported family, with its ``tokenizer``, or an
orthosphere arithmetic model); ``data`` a task spec (the CLI's ``--task``) or a data object
(``orthosphere.corpus.jsonl(...)``, ``orthosphere.tasks.arithmetic(...)``). Returns the store,
opened lazily (``orthosphere.store.open_store``).
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import xarray as xr

from orthosphere.store import open_store

from .data import ArithmeticData, CorpusData
from .defaults import DEFAULT_BATCH_SIZE
from .job import ExtractJob, run_job


def extract(model, data: str | ArithmeticData | CorpusData, out: str | os.PathLike, *, tokenizer=None,
            sites: str | Iterable[str] | None = None, layers: Sequence[int] | None = None, dtype: str = "float32",
            n_samples: int | None = None, batch_size: int = DEFAULT_BATCH_SIZE, n_shards: int = 1,
            samples_per_chunk: int | None = None, pred: bool = True, mode: str = "new", break_lock: bool = False,
            device: str = "auto", model_dtype: str | None = None, storage_options: dict | None = None,
            client=None, progress: bool = False) -> xr.Dataset:
    """Run (or, with mode="resume", continue) an extraction of `model` over `data` into the store
    `out` and return the store. The keywords are the CLI's options (``orthosphere extract --help``):
    sites (default all but pattern, z, attn_out, mlp_in, mlp_norm_scale, mlp_out), layers (default all), dtype of the store, n_samples (default
    the whole task or corpus), batch_size, n_shards, samples_per_chunk, pred (False: no predictions,
    and the forward pass stops after the last of the layers), mode ("new": refuse an existing store;
    "resume": continue an interrupted job, a complete store left alone; "overwrite": replace the
    store), break_lock (break a lock that looks alive), device, model_dtype (a
    path only), storage_options (fsspec, for an object-storage `out`), client (a
    distributed.Client: shards on its workers; a path only)."""
    url = os.fspath(out)
    job = ExtractJob(
        model=model, task=data, out=url, n_samples=n_samples, sites=_names(sites),
        layers=layers, dtype=dtype, batch_size=batch_size, n_shards=n_shards,
        samples_per_chunk=samples_per_chunk, pred=pred, mode=mode, break_lock=break_lock,
        device=device, model_dtype=model_dtype, storage_options=storage_options, tokenizer=tokenizer,
    )
    run_job(job, client=client, progress=progress)
    return open_store(url, storage_options=storage_options)


def _names(sites) -> tuple[str, ...] | None:
    """Sites as a tuple: a comma-separated text or any iterable of names."""
    if sites is None:
        return None
    return tuple(sites.split(",")) if isinstance(sites, str) else tuple(sites)
