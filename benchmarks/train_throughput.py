"""Training throughput of the shipped model sizes, side by side: per config, per batch size, and
with torch.compile where it is asked for and available.

Times ``train_step`` (data generation, forward, backward, AdamW) on the batches the real
run would see, after a short warm-up, and reports training tokens per second (non-padding
tokens, as the training log counts them), each row's ratio to the first row, and the share of
a step spent generating the batch.

    python benchmarks/train_throughput.py [--steps 30] [--threads 1]
    python benchmarks/train_throughput.py --configs paper-task-pre paper-task-qkv --batch-sizes 64 256 --compile
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import time
from pathlib import Path

import torch

from orthosphere.workflows import train as training

CONFIGS = Path(training.__file__).parent / "configs"
PLACEMENTS = ("pre", "qkv", "none", "post")


def measure(name: str, steps: int, warmup: int, batch_size: int | None, compiled: bool) -> dict:
    config = training.load_config(CONFIGS / f"{name}.toml")
    if batch_size:
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, batch_size=batch_size))
    model, optimizer = training.build(config, "cpu")
    model.train()
    step_model = torch.compile(model) if compiled else model
    for step in range(warmup):
        training.train_step(config, step_model, optimizer, step, "cpu")
    tokens, started = 0, time.perf_counter()
    for step in range(warmup, warmup + steps):
        tokens += training.train_step(config, step_model, optimizer, step, "cpu")[1]
    seconds = time.perf_counter() - started
    generation_started = time.perf_counter()
    for step in range(warmup, warmup + steps):
        training._batch(config, step, "cpu")
    generation = time.perf_counter() - generation_started
    return {"config": name + (" (compiled)" if compiled else ""), "parameters": model.n_parameters(),
            "batch": config.train.batch_size, "tokens_per_s": tokens / seconds,
            "ms_per_step": 1000 * seconds / steps, "data_share": generation / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--configs", nargs="+", default=list(PLACEMENTS), help="training configs in workflows/configs")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[0], help="batch sizes (0: the config's)")
    parser.add_argument("--compile", action="store_true", help="also time each model under torch.compile")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"train throughput: {platform.machine()}, torch {torch.__version__}, "
          f"{args.threads} thread(s), {args.steps} timed steps after {args.warmup} warm-up")
    results = []
    for name in args.configs:
        for batch_size in args.batch_sizes:
            for compiled in (False, True) if args.compile else (False,):
                try:
                    results.append(measure(name, args.steps, args.warmup, batch_size, compiled))
                except Exception as error:  # torch.compile needs a C++ compiler: say so, go on
                    print(f"{name} batch {batch_size or 'default'} compiled={compiled}: not measured "
                          f"({type(error).__name__}: {str(error).splitlines()[0][:120]})")
    reference = results[0]["tokens_per_s"]
    print(f"{'config':<28}{'params':>9}{'batch':>7}{'tokens/s':>11}{'ms/step':>9}{'vs first':>9}{'data gen':>10}")
    for r in results:
        print(f"{r['config']:<28}{r['parameters']:>9}{r['batch']:>7}{r['tokens_per_s']:>11.0f}"
              f"{r['ms_per_step']:>9.1f}{r['tokens_per_s'] / reference:>9.2f}{100 * r['data_share']:>9.0f}%")


if __name__ == "__main__":
    main()
