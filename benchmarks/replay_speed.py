"""The perturbation study offline (from the store) beside online (through the model).

For one arithmetic checkpoint: extract q, k, v of the test split into a store, then run the
same study -- every stored layer perturbed one at a time, the same noise levels and draws --
with ``orthosphere.analyze.replay.replay`` (offline, from the stored tensors) and with
``orthosphere.workflows.online_check.online_check`` (online, forward passes of the model with
the draws injected). Prints both times, the ratio online / offline (target: at least 10x),
and checks that the two give the same sparse instances and the same collapse rates.

Usage: python benchmarks/replay_speed.py [--model DIR] [--samples N] [--draws N] [--dir DIR]
Without --model it uses the shipped Pre-Norm checkpoint (workflows/models/pre), or else trains
the tiny config for a few seconds; the samples come from the test split of the model's task.
"""
from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from orthosphere.analyze.replay import replay
from orthosphere.analyze.replay_blocks import DEFAULT_LEVELS, ReplaySettings
from orthosphere.extract.job import ExtractJob, run_job
from orthosphere.store import open_store
from orthosphere.workflows import train as training
from orthosphere.workflows.online_check import online_check

WORKFLOWS = Path(training.__file__).parent


def checkpoint(directory: Path) -> Path:
    """The shipped Pre-Norm checkpoint, or the tiny config trained into `directory`."""
    shipped = WORKFLOWS / "models" / "pre"
    if (shipped / "model.safetensors").is_file():
        return shipped
    training.train(WORKFLOWS / "configs" / "tiny.toml", directory / "tiny", device="cpu", threads=1, progress=False)
    return directory / "tiny"


def task_spec(model: Path) -> str:
    """The test split of the task the model was trained on (from its training config, if saved)."""
    config = model / training.CONFIG_COPY
    if not config.is_file():
        return "arithmetic:split=test,seed=0"
    fields = training.load_config(config).task.to_dict()
    return "arithmetic:split=test,seed=0," + ",".join(f"{name}={'/'.join(map(str, values))}" for name, values in fields.items())


def timed(function, *args, **kwargs):
    """The function's result, wall-clock seconds and CPU seconds of this process (all threads)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = function(*args, **kwargs)
    return result, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--draws", type=int, default=8)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    arguments = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=arguments.dir) as scratch:
        scratch = Path(scratch)
        model = arguments.model or checkpoint(scratch)
        store = str(scratch / "store.zarr")
        run_job(ExtractJob(model=str(model), task=task_spec(model), out=store, n_samples=arguments.samples,
                           sites=("q", "k", "v"), device="cpu"), progress=False)
        ds = open_store(store)
        settings = ReplaySettings(levels=DEFAULT_LEVELS, n_draws=arguments.draws, seed=0)
        warm_up = ReplaySettings(levels=(0.1,), n_draws=1)  # imports and first calls, outside the timings
        replay(ds.isel(sample=slice(0, 8)), levels=warm_up.levels, n_draws=1, n_bootstrap=1)
        online_check(ds, model, settings=warm_up, max_samples=8, compare_offline=False)

        offline, offline_wall, offline_cpu = timed(
            replay, ds, levels=settings.levels, n_draws=settings.n_draws, seed=settings.seed, n_bootstrap=200)
        online, online_wall, online_cpu = timed(online_check, ds, model, settings=settings, compare_offline=False,
                                                batch_size=64)

        same_sparse = np.array_equal(online.n_sparse.values, offline.n_sparse.values)
        difference = float(np.nanmax(np.abs(online.collapse_rate.values - offline.collapse_rate.values), initial=0.0))
        described = ds.attrs["model"]
        print(f"machine   {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} (1 thread)")
        print(f"model     {model.name}: {described['n_layers']} layers, d_model {described['d_model']}, "
              f"{described['n_heads']} heads, {described['norm_placement']}-norm")
        print(f"study     {arguments.samples} samples x {ds.sizes['pos']} positions, {len(settings.levels)} levels "
              f"x {settings.n_draws} draws, layers {[int(x) for x in offline.layer.values]} one at a time")
        print(f"sparse    {int(offline.n_sparse.sum())} instances; pooled collapse rate at 30 % noise "
              f"{float(offline.collapse_rate_pooled.sel(definition='collapse').values[-1]):.4f}")
        print(f"offline   {offline_wall:8.2f} s wall, {offline_cpu:8.2f} s CPU  (replay from the store, incl. theory, "
              "TV, output change, bootstrap)")
        print(f"online    {online_wall:8.2f} s wall, {online_cpu:8.2f} s CPU  (forward passes with the draws injected, "
              "incl. accuracy)")
        print(f"ratio     {online_wall / offline_wall:8.1f} x wall, {online_cpu / offline_cpu:6.1f} x CPU  online / offline "
              "(target >= 10)")
        print(f"agree     sparse instances identical: {same_sparse}; max |collapse rate online - offline| = {difference:.2e}")
        if not same_sparse or difference > 0:
            raise SystemExit("online and offline disagree")


if __name__ == "__main__":
    main()
