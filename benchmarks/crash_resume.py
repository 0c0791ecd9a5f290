"""Crash safety, measured: SIGKILL whole sharded extraction jobs at random moments, resume each
once, and compare the result with an uninterrupted store, file by file.

Each job is the real CLI (`orthosphere extract`) in its own process group: 96 samples of the
arithmetic task through the shipped `pre` model, 4 samples a chunk, 6 shards, in one process or
on a LocalCluster of 2 workers (`--workers 2`). The kills take turns through these kinds, each
drawn at random within its kind, so that even a short run meets creation and finish:

- creation: a named point (``ORTHOSPHERE_CRASH_AT``, see ``orthosphere.store.faults``) while the
  store is created (the lock written aside or taken, the root, the k-th array, the progress
  record), with a random occurrence;
- progress: draw a fraction uniformly in [0, 1), wait until the store holds that fraction of the
  files of an uninterrupted store (array metadata while it is created, then chunks), wait a
  further 0-50 ms, then SIGKILL the process group (the job and its workers). Unlike a timer, this
  lands uniformly over the writes however loaded the machine is;
- finish: a named point inside ``finish()`` or just before it;
- overwrite: the job run with `--overwrite` over a copy of the uninterrupted store, killed at a
  named point of the replacement (the k-th entry cleared, the store cleared, the new root or k-th
  array written);
- shards (one process only): the k-th chunk write or shard completion.

A named point must kill the job (the job killed by SIGKILL at it); a job that ends without
meeting its point is counted as unreached, apart from the kills. After each kill, one `--resume`
must exit 0, leave no lock, validate in full, and give the same files as the uninterrupted store:
every chunk and array metadata byte for byte, the root's attributes but its provenance (time,
command) equal.

Usage: python benchmarks/crash_resume.py [--kills 20] [--worker-kills 12] [--seed 0] [--dir DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import zarr

from orthosphere.store import DEFAULT_SITES, validate
from orthosphere.store.location import as_location
from orthosphere.store.lock import HEARTBEAT_NAME, LOCK_NAME
from orthosphere.store.schema import variables_for
from orthosphere.store.state import inspect

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "workflows" / "models" / "pre"
CLI = Path(sys.executable).parent / "orthosphere"
JOB = ["--task", "arithmetic:split=test,seed=5", "--samples", "96", "--samples-per-chunk", "4", "--shards", "6",
       "--batch-size", "8", "--device", "cpu"]
N_SHARDS = 6
N_ARRAYS = len(variables_for(DEFAULT_SITES, with_weights=True))
N_BLOCK_WRITES = 96 // 8
"""One write of whole chunks per batch of 8 samples (two chunks of 4)."""
CREATION_POINTS = ["lock-written-aside", "lock-taken", "root-written", "array-created", "progress-created",
                   "store-created"]
FINISH_POINTS = ["before-finish", "finish-consolidated", "finished"]
OVERWRITE_POINTS = ["lock-taken", "clearing", "cleared", "root-written", "array-created"]
SHARD_POINTS = ["chunk-written", "shard-complete"]
"""Met by the process that writes the shards: named only in one-process jobs."""
KINDS = {0: ["creation", "finish", "progress", "overwrite", "shards", "progress"],
         2: ["creation", "finish", "progress", "overwrite"]}
"""The kinds of kill, in the order they take turns, by number of workers."""
OCCURRENCES = {"array-created": N_ARRAYS, "chunk-written": N_BLOCK_WRITES, "shard-complete": N_SHARDS}
IGNORED = {"zarr.json", LOCK_NAME, HEARTBEAT_NAME}


def launch(out: Path, workers: int, resume: bool = False, crash_at: str | None = None,
           overwrite: bool = False) -> subprocess.Popen:
    arguments = [str(CLI), "extract", str(MODEL), *JOB, "--out", str(out)]
    arguments += ["--workers", str(workers)] if workers else []
    arguments += ["--resume"] if resume else []
    arguments += ["--overwrite"] if overwrite else []
    environment = {key: value for key, value in os.environ.items() if key != "ORTHOSPHERE_CRASH_AT"}
    environment["OMP_NUM_THREADS"] = "1"
    if crash_at:
        environment["ORTHOSPHERE_CRASH_AT"] = crash_at
    log = open(out.parent / f"{out.name}.log", "a")
    return subprocess.Popen(arguments, env=environment, stdout=log, stderr=log, start_new_session=True)


def kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def wait_for_folder(out: Path, process: subprocess.Popen) -> None:
    while not out.exists():
        if process.poll() is not None:
            raise RuntimeError(f"the job ended before creating {out}: see {out}.log")
        time.sleep(0.002)


def uninterrupted(directory: Path, workers: int) -> Path:
    out = directory / f"reference-{workers}.zarr"
    if launch(out, workers).wait() != 0:
        raise RuntimeError(f"the uninterrupted job failed: see {out}.log")
    return out


def count_files(out: Path) -> int:
    return sum(len(names) for _, _, names in os.walk(out))


def state_after_kill(out: Path) -> str:
    """Where the kill landed, read from what it left."""
    found = inspect(as_location(str(out)))
    if found.kind != "store":
        return found.kind
    if found.attrs.get("complete") and found.consolidated:
        return "complete, lock left" if (out / LOCK_NAME).exists() else "complete, lock released"
    done = int(zarr.open_array(str(out / "_progress" / "shard_complete"), mode="r")[:].sum())
    return f"store, {done}/{N_SHARDS} shards complete"


def differences(reference: Path, out: Path) -> list[str]:
    """Files that differ between two stores (the root's provenance aside)."""
    def files(root: Path) -> dict[str, bytes]:
        return {str(path.relative_to(root)): path.read_bytes() for path in root.rglob("*")
                if path.is_file() and str(path.relative_to(root)) not in IGNORED}

    expected, found = files(reference), files(out)
    problems = [f"{name}: {'missing' if name not in found else 'extra' if name not in expected else 'differs'}"
                for name in sorted(set(expected) | set(found)) if expected.get(name) != found.get(name)]
    roots = [json.loads((root / "zarr.json").read_text()) for root in (reference, out)]
    for root in roots:
        root["attributes"].pop("provenance")
    if roots[0] != roots[1]:
        problems.append("zarr.json: attributes or consolidated metadata differ")
    return problems


def one_kill(directory: Path, index: int, workers: int, reference: Path, kind: str, rng: random.Random) -> dict:
    """One job killed as `kind` says, then resumed once; `recovered` is None where no kill happened
    (a progress kill drawn after the job ended, or a named point the job never met)."""
    out = directory / f"kill-{index:03d}.zarr"
    if kind == "progress":
        fraction = rng.random()
        target = fraction * count_files(reference)
        process = launch(out, workers)
        wait_for_folder(out, process)
        while process.poll() is None and count_files(out) < target:
            time.sleep(0.005)
        time.sleep(rng.uniform(0, 0.05))
        ended_first = process.poll() is not None
        kill_group(process)
        how = f"at {fraction:.0%} of the files"
        if ended_first:
            return {"how": how, "landed": "job had ended", "recovered": None}
    else:
        overwrite = kind == "overwrite"
        if overwrite:
            shutil.copytree(reference, out)
        point = draw_point(rng, kind, len(os.listdir(reference)))
        process = launch(out, workers, crash_at=point, overwrite=overwrite)
        code = process.wait()
        kill_group(process)
        how = f"{point}{' (--overwrite)' if overwrite else ''}"
        if code == 0:
            shutil.rmtree(out)
            return {"how": how, "landed": "point never met: the job ended", "recovered": None, "unreached": True}
        if code != -signal.SIGKILL:
            return {"how": how, "landed": f"job exited {code} before its point", "recovered": False,
                    "problems": [f"see {out}.log"]}
    landed = state_after_kill(out)
    resumed = launch(out, workers, resume=True)
    code = resumed.wait()
    problems = [f"resume exited {code}: see {out}.log"] if code else []
    if not problems:
        problems += [f"lock left: {name}" for name in (LOCK_NAME, HEARTBEAT_NAME) if (out / name).exists()]
        problems += validate(str(out), full=True)
        problems += differences(reference, out)
    if not problems:
        shutil.rmtree(out)
    return {"how": how, "landed": landed, "recovered": not problems, "problems": problems[:3]}


def draw_point(rng: random.Random, kind: str, n_entries: int) -> str:
    """A named point of `kind` with a random occurrence; `n_entries`: what replacing a store clears."""
    points = {"creation": CREATION_POINTS, "finish": FINISH_POINTS, "overwrite": OVERWRITE_POINTS,
              "shards": SHARD_POINTS}[kind]
    point = rng.choice(points)
    occurrences = n_entries if point == "clearing" else OCCURRENCES.get(point)
    return f"{point}:{rng.randint(1, occurrences)}" if occurrences else point


def run(n_kills: int, workers: int, directory: Path, rng: random.Random, references: dict) -> list[dict]:
    reference = uninterrupted(directory, workers)
    if references and differences(next(iter(references.values())), reference):
        raise RuntimeError("the uninterrupted stores of one process and of --workers 2 differ")
    references[workers] = reference
    print(f"\n--workers {workers or 'none (one process)'}: an uninterrupted store holds {count_files(reference)} files")
    kinds = KINDS[workers]
    results = []
    while sum(result["recovered"] is not None for result in results) < n_kills:
        if len(results) >= 3 * n_kills + len(kinds):
            raise RuntimeError(f"only {sum(r['recovered'] is not None for r in results)} of {len(results)} "
                               "attempts killed the job: see the list above")
        index = len(results)
        kind = kinds[index % len(kinds)]
        result = {"kind": kind, **one_kill(directory, len(references) * 100 + index, workers, reference, kind, rng)}
        results.append(result)
        state = {None: "no kill", True: "recovered, identical", False: "FAILED"}[result["recovered"]]
        print(f"  {index + 1:2d}. {result['how']:<34} left: {result['landed']:<32} {state} {result.get('problems') or ''}",
              flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20, help="kills of one-process jobs")
    parser.add_argument("--worker-kills", type=int, default=12, help="kills of --workers 2 jobs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default=None, help="where to write the stores (default: a temporary folder)")
    arguments = parser.parse_args()
    rng = random.Random(arguments.seed)
    directory = Path(arguments.dir or tempfile.mkdtemp(prefix="orthosphere-crash-"))
    directory.mkdir(parents=True, exist_ok=True)
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, "
          f"seed {arguments.seed}, stores in {directory}")
    started = time.perf_counter()
    references: dict = {}
    results = run(arguments.kills, 0, directory, rng, references)
    results += run(arguments.worker_kills, 2, directory, rng, references)
    kills = [result for result in results if result["recovered"] is not None]
    recovered = sum(result["recovered"] for result in kills)
    unreached = [result["how"] for result in results if result.get("unreached")]
    too_late = len(results) - len(kills) - len(unreached)
    print(f"\n{len(kills)} kills, {recovered} recovered with one --resume to an identical store, "
          f"{len(kills) - recovered} failed; not kills: {too_late} progress kills drawn after the job ended, "
          f"{len(unreached)} named points never met{': ' + ', '.join(unreached) if unreached else ''}; "
          f"{time.perf_counter() - started:.0f} s")
    print("kills of each kind:", dict(Counter(result["kind"] for result in kills)))
    print("where the kills landed:", dict(Counter(result["landed"] for result in kills)))
    if recovered == len(kills) and not arguments.dir:
        shutil.rmtree(directory)
    sys.exit(0 if recovered == len(kills) else 1)


if __name__ == "__main__":
    main()
