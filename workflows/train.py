"""Train an arithmetic transformer from a TOML config: ``train(config, out)`` (its options: ``TrainJob``).

A config has a top-level ``seed`` and three tables, each checked for unknown keys:
``[task]`` (TaskSpec), ``[model]`` (ModelConfig) and ``[train]`` (TrainConfig). Training
draws fresh examples of the ``train`` split every step (batch ``s`` holds examples
``s * batch_size ...``), so on one device and at a fixed number of torch threads (``threads``,
``--threads``) a run is a pure function of its config and seed, and a run resumed from a checkpoint
continues exactly as if it had never stopped. Another thread count sums in another order, and the
weights differ (by up to 2.7e-4 after 200 steps of a tiny model, 1 thread against 2). The
checkpoint records its thread count, and resuming with another warns.

The output directory receives ``train.toml`` (the config; a folder holding only it, left by a run
that stopped before its first checkpoint, counts as empty), ``checkpoint.safetensors`` while
training (weights, optimizer state, step, history; written atomically) and, at the end,
``config.json``, ``model.safetensors`` and ``metrics.json``. Nothing is pickled.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
import tomllib
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

from orthosphere.errors import ConfigError
from orthosphere.extract import tasks
from orthosphere.extract.model import (
    METRICS_FILE,
    WEIGHTS_FILE,
    ArithmeticTransformer,
    ModelConfig,
    save_model,
)
from orthosphere.params import (
    NON_NEGATIVE_INTEGER,
    POSITIVE_INTEGER,
    POSITIVE_NUMBER,
    REQUIRED,
    UNIT_INTERVAL,
    Config,
    Flag,
    Interval,
    Normalised,
    Text,
    parameter,
)

CONFIG_COPY = "train.toml"
CHECKPOINT_FILE = "checkpoint.safetensors"
EVAL_SPLITS = ("test", "interpolation", "extrapolation")
BETA = Interval(float, 0, 1, closed="left")
"""An Adam moment's decay: torch refuses 1."""


@dataclass(frozen=True)
class TrainConfig(Config):
    """Optimisation and evaluation settings (AdamW, linear warm-up, cosine decay)."""

    steps: int = parameter(REQUIRED, POSITIVE_INTEGER, help="optimiser steps")
    batch_size: int = parameter(REQUIRED, POSITIVE_INTEGER, help="samples per step")
    learning_rate: float = parameter(1e-3, POSITIVE_NUMBER, help="peak learning rate")
    weight_decay: float = parameter(0.01, UNIT_INTERVAL, help="AdamW weight decay")
    beta1: float = parameter(0.9, BETA, help="AdamW beta1")
    beta2: float = parameter(0.98, BETA, help="AdamW beta2")
    warmup_steps: int = parameter(200, NON_NEGATIVE_INTEGER, help="steps of linear warm-up (at most steps)")
    min_lr_ratio: float = parameter(0.05, UNIT_INTERVAL, help="the cosine decay's floor, a share of learning_rate")
    grad_clip: float = parameter(1.0, POSITIVE_NUMBER, help="gradient norm clip")
    eval_every: int = parameter(500, POSITIVE_INTEGER, help="steps between evaluations")
    eval_samples: int = parameter(1000, POSITIVE_INTEGER, help="samples of each evaluation split")
    checkpoint_every: int = parameter(500, POSITIVE_INTEGER, help="steps between checkpoints")

    def check(self) -> None:
        if self.warmup_steps > self.steps:
            raise self.error("warmup_steps", self.warmup_steps, f"an integer from 0 to steps = {self.steps}")

    def learning_rate_at(self, step: int) -> float:
        """Linear warm-up to ``learning_rate``, then cosine decay to ``min_lr_ratio`` of it."""
        if step < self.warmup_steps:
            return self.learning_rate * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return self.learning_rate * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine)


@dataclass(frozen=True)
class RunConfig:
    """A whole training config: seed, task, model and training settings."""

    seed: int
    task: tasks.TaskSpec
    model: ModelConfig
    train: TrainConfig

    def to_dict(self) -> dict:
        return {"seed": self.seed, "task": self.task.to_dict(), "model": self.model.to_dict(),
                "train": asdict(self.train)}


def _table(values: dict, name: str) -> dict:
    table = values.get(name)
    if not isinstance(table, dict):
        raise ConfigError(f"config has no [{name}] table; expected tables [task], [model] "
                          f"and [train] and a top-level seed")
    return table


def parse_config(values: dict, source: str = "config") -> RunConfig:
    """Validate a parsed TOML config; every problem is a ConfigError naming ``source``."""
    unknown = sorted(set(values) - {"seed", "task", "model", "train"})
    if unknown:
        raise ConfigError(f"{source}: unknown top-level keys {unknown}; expected seed, "
                          f"[task], [model] and [train]")
    seed = values.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ConfigError(f"{source}: seed = {seed!r}; expected a non-negative integer")
    try:
        train_config = TrainConfig.from_table(_table(values, "train"), "train")
        task = tasks.TaskSpec.from_table(_table(values, "task"), "task")
        model = ModelConfig.from_table(_table(values, "model"), "model")
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}") from None
    if model.vocab_size != tasks.VOCAB_SIZE:
        raise ConfigError(f"{source}: model vocab_size = {model.vocab_size}, but the task has "
                          f"{tasks.VOCAB_SIZE} tokens; set vocab_size = {tasks.VOCAB_SIZE}")
    longest = max(task.max_length(split) for split in tasks.SPLITS)
    if model.positions == "learned" and model.max_len < longest:
        raise ConfigError(f"{source}: model max_len = {model.max_len} is shorter than the "
                          f"task's longest sequence ({longest}); raise max_len")
    return RunConfig(seed, task, model, train_config)


def config_text(path, seed: int | None = None) -> str:
    """The text of a TOML training config; ``seed`` replaces its top-level seed (one config
    file serves every seed of a model)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found; pass the path of a TOML "
                          f"training config") from None
    if seed is None:
        return text
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ConfigError(f"seed = {seed!r} for {path}: expected a non-negative integer")
    text, found = re.subn(r"(?m)^seed[ \t]*=.*$", f"seed = {seed}", text, count=1)
    if not found:
        raise ConfigError(f"config file {path} has no top-level `seed = ...` line to replace; "
                          f"add one before its tables")
    return text


def load_config(path, seed: int | None = None) -> RunConfig:
    """Read and validate a TOML training config, its seed replaced by ``seed`` if given."""
    text = config_text(path, seed)
    try:
        values = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config file {path} is not valid TOML: {error}") from None
    return parse_config(values, str(path))


def select_device(device: str = "auto") -> torch.device:
    """``auto`` picks CUDA when available, else the CPU; ``cpu``, ``cuda`` and ``cuda:N``
    are taken as given."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device != "cpu" and not device.startswith("cuda"):
        raise ConfigError(f"unknown device {device!r}; expected auto, cpu, cuda or cuda:N")
    try:
        chosen = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"unknown device {device!r}; expected auto, cpu, cuda or cuda:N") from None
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} asked for, but torch sees no CUDA device; "
                          f"use device 'cpu' or 'auto'")
    return chosen


@torch.no_grad()
def evaluate(model: ArithmeticTransformer, batch: tasks.ArithmeticBatch,
             device: torch.device | str = "cpu", chunk: int = 500) -> dict:
    """Per-token answer accuracy (over scored positions), whole-answer accuracy (every
    scored position of an example right) and mean loss on scored positions."""
    was_training = model.training
    model.eval()
    correct_tokens = scored_tokens = correct_answers = 0
    loss_sum = 0.0
    for begin in range(0, len(batch), chunk):
        tokens = torch.from_numpy(batch.tokens[begin:begin + chunk]).long().to(device)
        target = torch.from_numpy(batch.target[begin:begin + chunk]).long().to(device)
        scored = torch.from_numpy(batch.scored[begin:begin + chunk]).to(device)
        logits = model(tokens)
        right = (logits.argmax(-1) == target) & scored
        correct_tokens += int(right.sum())
        scored_tokens += int(scored.sum())
        correct_answers += int((right == scored).all(dim=1).sum())
        loss_sum += float(F.cross_entropy(logits[scored], target[scored], reduction="sum"))
    model.train(was_training)
    return {"token_accuracy": correct_tokens / scored_tokens,
            "answer_accuracy": correct_answers / len(batch),
            "loss": loss_sum / scored_tokens, "n_samples": len(batch), "n_tokens": scored_tokens}


def _parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only, not on gains, biases or embeddings."""
    decay, no_decay = [], []
    for name, weight in model.named_parameters():
        is_matrix = weight.dim() >= 2 and "embed" not in name
        (decay if is_matrix else no_decay).append(weight)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def _batch(config: RunConfig, step: int, device: torch.device):
    """The training batch of ``step`` and its random sinusoidal position offsets."""
    size = config.train.batch_size
    batch = tasks.generate("train", size, config.seed, config.task, start=step * size)
    offsets = None
    if config.model.max_position_offset:
        generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
        offsets = torch.randint(0, config.model.max_position_offset + 1, (size,),
                                generator=generator).to(device)
    as_tensor = lambda array: torch.from_numpy(array).to(device)  # noqa: E731
    return (as_tensor(batch.tokens).long(), as_tensor(batch.target).long(),
            as_tensor(batch.scored), offsets, int(batch.valid.sum()))


def _save_checkpoint(path: Path, model, optimizer, state: dict) -> None:
    """Weights, optimizer moments and run state in one safetensors file, replaced atomically."""
    from safetensors.torch import save_file

    tensors = {f"model.{name}": value.detach().cpu().contiguous()
               for name, value in model.state_dict().items()}
    optimizer_state = optimizer.state_dict()
    for index, moments in optimizer_state["state"].items():
        for name, value in moments.items():
            tensors[f"optimizer.{index}.{name}"] = value.detach().cpu().contiguous()
    metadata = {"state": json.dumps(state),
                "param_groups": json.dumps([{k: v for k, v in group.items() if k != "params"}
                                            for group in optimizer_state["param_groups"]])}
    partial = path.with_suffix(".partial")
    save_file(tensors, str(partial), metadata=metadata)
    os.replace(partial, path)


def _load_checkpoint(path: Path, model, optimizer, device) -> dict:
    """Restore weights and optimizer moments; returns the run state saved with them."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    model.load_state_dict({key.removeprefix("model."): value for key, value in tensors.items()
                           if key.startswith("model.")})
    model.to(device)
    moments: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer."):
            _, index, name = key.split(".")
            moments.setdefault(int(index), {})[name] = value
    optimizer_state = optimizer.state_dict()
    for group, saved in zip(optimizer_state["param_groups"], json.loads(metadata["param_groups"])):
        group.update(saved)
    optimizer_state["state"] = moments
    optimizer.load_state_dict(optimizer_state)
    return json.loads(metadata["state"])


def _flatten(values: dict, prefix: str = "") -> dict:
    """Nested tables as one dict keyed ``table.key``."""
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _prepare_output(out_dir: Path, config: RunConfig, config_text: str, resume: bool) -> str:
    """Check ``out_dir`` against the run; returns ``fresh``, ``resume`` or ``finished``."""
    copy = out_dir / CONFIG_COPY
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"output {out_dir} is a file; pass a directory")
    if not out_dir.exists() or {path.name for path in out_dir.iterdir()} <= {CONFIG_COPY}:
        # empty, or holding only the config of a run that stopped before its first checkpoint
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            copy.write_text(config_text)
        except OSError as error:
            raise ConfigError(f"cannot write the output folder {out_dir} (--out): {error.strerror or error}; pass a folder "
                              "that can be created and written, e.g. runs/NAME") from None
        return "fresh"
    if not copy.is_file():
        raise ConfigError(f"output directory {out_dir} is not empty and holds no {CONFIG_COPY}; "
                          f"it holds something other than a training run: choose a new or "
                          f"empty directory")
    existing = parse_config(tomllib.loads(copy.read_text()), str(copy)).to_dict()
    wanted = config.to_dict()
    if existing != wanted:
        existing, wanted = _flatten(existing), _flatten(wanted)
        differing = sorted(key for key in existing.keys() | wanted.keys()
                           if existing.get(key) != wanted.get(key))
        raise ConfigError(f"output directory {out_dir} already holds a different model "
                          f"(its {CONFIG_COPY} differs in {', '.join(differing)}); choose a "
                          f"new directory or delete that one")
    if (out_dir / METRICS_FILE).is_file() and (out_dir / WEIGHTS_FILE).is_file():
        if resume:
            return "finished"
        raise ConfigError(f"output directory {out_dir} already holds the finished model of "
                          f"this config; choose a new directory to train again")
    if (out_dir / CHECKPOINT_FILE).is_file():
        if resume:
            return "resume"
        raise ConfigError(f"output directory {out_dir} holds a checkpoint of this config; "
                          f"resume it (resume=True) or choose a new directory")
    return "fresh"


@dataclass(frozen=True)
class TrainJob(Config):
    """What `orthosphere train` is asked to do: the command line's options and ``train``'s keywords."""

    config: str = parameter(REQUIRED, Normalised(os.fspath, "a path"), help="the TOML config of the run")
    out: str = parameter(REQUIRED, Normalised(os.fspath, "a path"), help="folder for the checkpoint, metrics and training state")
    resume: bool = parameter(False, Flag(), help="continue an interrupted run from its checkpoint in the output folder")
    device: str = parameter("auto", Text("a device"), help="where the model runs: auto, cpu, cuda or cuda:N")
    threads: int | None = parameter(None, POSITIVE_INTEGER, None, help="torch CPU threads (None: torch's choice)")
    seed: int | None = parameter(None, NON_NEGATIVE_INTEGER, None, help="replaces the config's seed (one config, several seeds)")
    progress: bool = parameter(True, Flag(), help="show a progress bar")


def train(config, out, **options) -> dict:
    """Train the model of the TOML config at ``config`` into the folder ``out`` and return its metrics;
    `options` are TrainJob's other parameters.

    ``resume`` continues from the checkpoint in ``out`` (a finished run is returned as is).
    ``threads`` sets torch's CPU threads. ``seed`` replaces the config's seed (the copy saved in
    ``out`` says which). Bad configs, devices and output directories raise ConfigError.
    """
    job = TrainJob(config=config, out=out, **options)
    config = load_config(job.config, job.seed)
    out_dir = Path(job.out)
    torch_device = select_device(job.device)
    status = _prepare_output(out_dir, config, config_text(job.config, job.seed), job.resume)
    if status == "finished":
        return json.loads((out_dir / METRICS_FILE).read_text())
    if job.threads:
        torch.set_num_threads(job.threads)

    model, optimizer = build(config, torch_device)
    state = {"step": 0, "train_seconds": 0.0, "wall_seconds": 0.0, "train_tokens": 0, "history": [],
             "interval_loss": 0.0, "interval_steps": 0, "torch_num_threads": torch.get_num_threads()}
    if status == "resume":
        state = _load_checkpoint(out_dir / CHECKPOINT_FILE, model, optimizer, torch_device)
        _warn_of_other_threads(state)
    eval_sets = {split: tasks.generate(split, config.train.eval_samples, config.seed, config.task)
                 for split in EVAL_SPLITS}
    _run(config, model, optimizer, state, eval_sets, out_dir, torch_device, job.progress)

    final = {split: evaluate(model, batch, torch_device) for split, batch in eval_sets.items()}
    metrics = {
        "norm_placement": config.model.norm_placement, "norm_type": config.model.norm_type,
        "n_parameters": model.n_parameters(), "steps": config.train.steps,
        "batch_size": config.train.batch_size, "train_tokens": state["train_tokens"],
        "train_seconds": round(state["train_seconds"], 1),
        "wall_seconds": round(state["wall_seconds"], 1),
        "tokens_per_second": round(state["train_tokens"] / max(state["train_seconds"], 1e-9)),
        "device": torch_device.type, "torch_num_threads": torch.get_num_threads(),
        "torch_version": torch.__version__, "eval_seed": config.seed,
        "eval_samples": config.train.eval_samples, "task": config.task.to_dict(),
        "final": final, "history": state["history"],
    }
    save_model(model, out_dir, metrics)
    (out_dir / CHECKPOINT_FILE).unlink(missing_ok=True)
    return metrics


def _warn_of_other_threads(state: dict) -> None:
    """Warn when a checkpoint resumes with another number of torch threads than it was trained with
    (its weights then differ from an uninterrupted run's in their last digits); the state records the new one."""
    saved, now = state.get("torch_num_threads"), torch.get_num_threads()
    if saved is not None and saved != now:
        warnings.warn(f"the checkpoint was trained with {saved} torch thread(s), and resumes with {now}: the weights will "
                      f"differ slightly from an uninterrupted run's; resume with --threads {saved} (threads={saved}) to "
                      "continue it exactly", stacklevel=3)
    state["torch_num_threads"] = now


def build(config: RunConfig, device: torch.device | str = "cpu"):
    """The seeded, untrained model of a config and its AdamW optimizer."""
    torch.manual_seed(config.seed)
    model = ArithmeticTransformer(config.model).to(device)
    optimizer = torch.optim.AdamW(_parameter_groups(model, config.train.weight_decay),
                                  lr=config.train.learning_rate,
                                  betas=(config.train.beta1, config.train.beta2))
    return model, optimizer


def train_step(config: RunConfig, model, optimizer, step: int, device) -> tuple[float, int]:
    """One optimisation step on the batch of ``step``; returns its loss and its number of
    (non-padding) tokens."""
    tokens, target, scored, offsets, n_tokens = _batch(config, step, device)
    for group in optimizer.param_groups:
        group["lr"] = config.train.learning_rate_at(step)
    logits = model(tokens, offsets)
    loss = F.cross_entropy(logits[scored], target[scored])
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), config.train.grad_clip)
    optimizer.step()
    return loss.item(), n_tokens


def _run(config, model, optimizer, state, eval_sets, out_dir, device, progress) -> None:
    """The optimisation loop from ``state['step']`` to the configured number of steps."""
    from tqdm.auto import tqdm

    settings = config.train
    bar = tqdm(total=settings.steps, initial=state["step"], disable=not progress,
               desc=f"train {config.model.norm_placement}", dynamic_ncols=True)
    model.train()
    last_accuracy = state["history"][-1]["test_token_accuracy"] if state["history"] else float("nan")
    while state["step"] < settings.steps:
        step = state["step"]
        started = time.perf_counter()
        loss, n_tokens = train_step(config, model, optimizer, step, device)
        state["train_seconds"] += time.perf_counter() - started
        state["train_tokens"] += n_tokens
        state["step"] = step + 1
        state["interval_loss"] += loss
        state["interval_steps"] += 1
        mean_loss = state["interval_loss"] / state["interval_steps"]

        if state["step"] % settings.eval_every == 0 or state["step"] == settings.steps:
            record = {"step": state["step"], "train_loss": round(mean_loss, 5),
                      "learning_rate": settings.learning_rate_at(step)}
            for split, batch in eval_sets.items():
                result = evaluate(model, batch, device)
                record[f"{split}_token_accuracy"] = result["token_accuracy"]
                record[f"{split}_answer_accuracy"] = result["answer_accuracy"]
            state["history"].append(record)
            last_accuracy = record["test_token_accuracy"]
            state["interval_loss"], state["interval_steps"] = 0.0, 0
        if state["step"] % settings.checkpoint_every == 0 and state["step"] < settings.steps:
            _save_checkpoint(out_dir / CHECKPOINT_FILE, model, optimizer, state)
        state["wall_seconds"] += time.perf_counter() - started
        bar.update(1)
        bar.set_postfix(loss=f"{mean_loss:.3f}", acc=f"{last_accuracy:.3f}",
                        tok_s=f"{state['train_tokens'] / state['train_seconds']:.0f}")
    bar.close()
