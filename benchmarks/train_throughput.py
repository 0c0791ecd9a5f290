"""Training throughput of the shipped model size, for every norm placement, side by side.

Times ``train_step`` (data generation, forward, backward, AdamW) on the batches the real
run would see, after a short warm-up, and reports training tokens per second (non-padding
tokens, as the training log counts them) and each placement's ratio to Pre-Norm, plus the
share of a step spent generating the batch.

    python benchmarks/train_throughput.py [--steps 30] [--threads 1]
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch

from orthosphere.workflows import train as training

CONFIGS = Path(training.__file__).parent / "configs"
PLACEMENTS = ("pre", "qkv", "none", "post")


def measure(placement: str, steps: int, warmup: int) -> dict:
    config = training.load_config(CONFIGS / f"{placement}.toml")
    model, optimizer = training.build(config, "cpu")
    model.train()
    for step in range(warmup):
        training.train_step(config, model, optimizer, step, "cpu")
    tokens, started = 0, time.perf_counter()
    for step in range(warmup, warmup + steps):
        tokens += training.train_step(config, model, optimizer, step, "cpu")[1]
    seconds = time.perf_counter() - started
    generation_started = time.perf_counter()
    for step in range(warmup, warmup + steps):
        training._batch(config, step, "cpu")
    generation = time.perf_counter() - generation_started
    return {"placement": placement, "parameters": model.n_parameters(),
            "batch": config.train.batch_size, "tokens_per_s": tokens / seconds,
            "ms_per_step": 1000 * seconds / steps, "data_share": generation / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"train throughput: {platform.machine()}, torch {torch.__version__}, "
          f"{args.threads} thread(s), {args.steps} timed steps after {args.warmup} warm-up")
    results = [measure(placement, args.steps, args.warmup) for placement in PLACEMENTS]
    reference = results[0]["tokens_per_s"]
    print(f"{'placement':<10}{'params':>9}{'batch':>7}{'tokens/s':>11}{'ms/step':>9}"
          f"{'vs pre':>8}{'data gen':>10}")
    for r in results:
        print(f"{r['placement']:<10}{r['parameters']:>9}{r['batch']:>7}{r['tokens_per_s']:>11.0f}"
              f"{r['ms_per_step']:>9.1f}{r['tokens_per_s'] / reference:>8.2f}"
              f"{100 * r['data_share']:>9.0f}%")


if __name__ == "__main__":
    main()
