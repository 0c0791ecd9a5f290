"""Scale benchmark of the analyses, two cases, each against a raw read pass measured in the same run.

(a) out-of-core: norms + subspaces + spheres over a synthetic store several times larger than a
    Dask worker's memory limit, on a LocalCluster: each analysis run on its own (each reading the
    store itself) and all three in one `analyze` call (planned together: one pass for norms and
    subspaces; the spheres read the subspaces' fit, not the store). Prints the
    throughput (bytes of activations read per second, each pass counted) as a ratio to the raw
    pass (target >= 0.7 for the one call), the wall time as a multiple of one raw pass, and the
    workers' peak memory, spill and restarts.
(b) language model: a store shaped like a small real language model (30 layers, d_model 576,
    9 query and 3 key-value heads of 64, 128 positions, float16, every default site) whose
    token-identity label has over 2,000 classes. The default analyses of `orthosphere analyze`
    (default factors for text: token identity, its rarest classes pooled, and position) in one
    call, with Dask's threads as the CLI uses them; their time as a multiple of one raw pass over
    every site (target <= 3x), with and without the replay; and what each part of the subspaces'
    statistics costs there (the fit alone, with the structure test, with every draw, with spheres).

    python benchmarks/analyze_scale.py --case out-of-core        # 2 GB store, 2 workers of 512 MB
    python benchmarks/analyze_scale.py --case out-of-core --size-gb 4 --memory-limit 1GB
    python benchmarks/analyze_scale.py --case language-model [--skip-replay]
    python benchmarks/analyze_scale.py --case language-model --skip-synthetic --repeat 3   # (c) alone, best of 3
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import dask
import numpy as np
from distributed import Client, LocalCluster

from orthosphere.analyze import FactorSubspaces, configure, norm_spread, open_for_analysis, run_analyses, sphere_structure
from orthosphere.analyze.results import chosen_analyses
from orthosphere.store import DEFAULT_SITES, create_store

N_LAYERS, N_POS, D_MODEL, N_HEADS, D_HEAD = 4, 32, 128, 4, 32
SITES = ("resid_pre", "q", "k")
FACTORS = ["alpha", "beta", "pos"]
OPTIONS = {"sites": ["resid_pre", "k"], "factors": FACTORS}
"""(a): norms of resid_pre and k weighted by the attention recomputed from q and k; subspaces of alpha,
beta and pos with their default noise draws; spheres from that fit."""
READS = {"norms": ("resid_pre", "q", "k"), "subspaces": ("resid_pre",), "spheres": ()}
"""The site arrays each analysis reads once (norms reads q and k to recompute the attention)."""


@contextlib.contextmanager
def work_directory(given: str | None, prefix: str):
    """The directory the stores are written to: `given` (kept), or a temporary one removed afterwards."""
    directory = Path(given or tempfile.mkdtemp(prefix=prefix))
    try:
        yield directory
    finally:
        if given is None:
            shutil.rmtree(directory, ignore_errors=True)

LM = {"n_layers": 30, "d_model": 576, "n_heads": 9, "n_kv_heads": 3, "d_head": 64, "n_pos": 128, "n_samples": 64,
      "vocabulary": 49152}


# (a) ------------------------------------------------------------------------------------------

def build_store(path: Path, size_gb: float, seed: int = 0) -> str:
    """A store of random activations, written in chunk blocks, with planted structure in resid_pre:
    random class means of alpha (10 classes) and beta (8), and a rank-6 positional code (sines and
    cosines of three frequencies), as a trained model's positional subspace."""
    per_sample = 4 * N_LAYERS * N_POS * (D_MODEL + 2 * N_HEADS * D_HEAD)
    n_samples = int(size_gb * 2**30 / per_sample)
    model = {"family": "synthetic", "n_layers": N_LAYERS, "d_model": D_MODEL, "n_heads": N_HEADS,
             "n_kv_heads": N_HEADS, "d_head": D_HEAD, "attn_scale": D_HEAD**-0.5, "causal": True}
    writer = create_store(path, model=model, task={"name": "benchmark"}, n_samples=n_samples, n_pos=N_POS,
                          sites=SITES, labels={"alpha": "int16", "beta": "int16"}, overwrite=True)
    rng = np.random.default_rng(seed)
    means = {"alpha": rng.normal(size=(10, D_MODEL)), "beta": rng.normal(size=(8, D_MODEL))}
    angles = np.arange(N_POS)[:, None] * np.array([0.1, 0.3, 0.9])
    positional = np.concatenate([np.sin(angles), np.cos(angles)], axis=1) @ rng.normal(size=(6, D_MODEL))
    block = writer.attrs["samples_per_chunk"] * 4
    for start in range(0, n_samples, block):
        n = min(block, n_samples - start)
        labels = {name: rng.integers(0, len(value), size=(n, N_POS)).astype("int16") for name, value in means.items()}
        resid = rng.normal(size=(n, N_LAYERS, N_POS, D_MODEL)).astype("float32")
        resid += sum(means[name][labels[name]][:, None] for name in means).astype("float32")
        resid += positional.astype("float32")[None, None]
        heads = (n, N_LAYERS, N_POS, N_HEADS, D_HEAD)
        writer.write(start, {"resid_pre": resid, "q": rng.normal(size=heads).astype("float32"),
                             "k": rng.normal(size=heads).astype("float32"), "valid": np.ones((n, N_POS), bool),
                             **labels})
    _finish(writer, rng)
    return str(path)


def _finish(writer, rng) -> None:
    shapes = {name: writer.group[name].shape for name in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o")}
    writer.write_weights({name: (0.05 * rng.normal(size=shape)).astype("float32") for name, shape in shapes.items()})
    writer.mark_shard_complete(0)
    writer.finish()


class MemoryWatch:
    """Samples every worker's resident memory in a background thread; keeps each worker's peak."""

    def __init__(self, client: Client, interval: float = 0.2):
        self.client, self.interval = client, interval
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import psutil

        while not self._stop.is_set():
            try:
                for worker, rss in self.client.run(lambda: psutil.Process().memory_info().rss).items():
                    self.peaks[worker] = max(self.peaks.get(worker, 0), rss)
            except Exception:  # a worker restarting: the restart check reports it
                pass
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def spilled_bytes(client: Client) -> int:
    """Bytes the workers wrote to disk when spilling, since they started."""

    def written(dask_worker):
        metrics = getattr(dask_worker.data, "cumulative_metrics", {})
        return sum(value for (label, unit), value in metrics.items() if "disk-write" in label and unit == "bytes")

    return int(sum(client.run(written).values()))


def site_bytes(dataset, site: str) -> int:
    return int(dataset[site].nbytes)


def raw_pass(dataset, sites) -> float:
    """Seconds to read and sum every chosen site array once."""
    started = time.perf_counter()
    dask.compute([dataset[site].data.sum(dtype="float64") for site in sites])
    return time.perf_counter() - started


def separately(dataset) -> dict[str, float]:
    """Seconds of each analysis run on its own (spheres taking the subspaces' fit, as in one call)."""
    seconds = {}
    started = time.perf_counter()
    norm_spread(dataset, sites=OPTIONS["sites"])
    seconds["norms"] = time.perf_counter() - started
    started = time.perf_counter()
    subspaces = FactorSubspaces(factors=FACTORS).fit(dataset)
    subspaces.to_dataset()
    seconds["subspaces"] = time.perf_counter() - started
    started = time.perf_counter()
    sphere_structure(dataset, subspaces=subspaces)
    seconds["spheres"] = time.perf_counter() - started
    return seconds


def out_of_core(args) -> None:
    with work_directory(args.dir, "analyze-scale-") as directory:
        started = time.perf_counter()
        url = build_store(directory / "store.zarr", args.size_gb)
        dataset = open_for_analysis(url)
        total = sum(site_bytes(dataset, site) for site in SITES)
        print(f"(a) store: {total / 2**30:.2f} GiB of activations ({dataset.sizes['sample']} samples, {N_LAYERS} layers, "
              f"{N_POS} positions, d_model {D_MODEL}, {N_HEADS} heads of {D_HEAD}), written in "
              f"{time.perf_counter() - started:.0f} s")
        with LocalCluster(n_workers=args.workers, threads_per_worker=1, memory_limit=args.memory_limit,
                          dashboard_address=None) as cluster, Client(cluster) as client:
            limit = next(iter(client.scheduler_info()["workers"].values()))["memory_limit"]
            print(f"cluster: {args.workers} workers x 1 thread, memory limit {limit / 2**20:.0f} MiB each "
                  f"(store = {total / limit:.1f} x one worker's limit)")
            workers_before = set(client.scheduler_info()["workers"])
            raw_pass(dataset, SITES)  # warm the page cache and the workers alike for every pass
            raw_seconds = raw_pass(dataset, SITES)
            raw_rate = total / raw_seconds
            print(f"raw pass (read + sum {', '.join(SITES)}): {raw_seconds:.1f} s, {raw_rate / 2**20:.0f} MiB/s")
            seconds = separately(dataset)
            for name, elapsed in seconds.items():
                read = sum(site_bytes(dataset, site) for site in READS[name])
                print(f"  alone: {name:<10} {elapsed:6.1f} s, reads {read / 2**30:.2f} GiB: "
                      f"{read / elapsed / 2**20:5.0f} MiB/s, ratio to the raw pass {read / elapsed / raw_rate:.2f}")
            read = sum(site_bytes(dataset, site) for name in READS for site in READS[name])
            alone = sum(seconds.values())
            print(f"  alone, the three: {alone:6.1f} s, reads {read / 2**30:.2f} GiB: ratio to the raw pass "
                  f"{read / alone / raw_rate:.2f}; wall time {alone / raw_seconds:.1f} x one raw pass")
            with MemoryWatch(client) as watch:
                started = time.perf_counter()
                run_analyses(dataset, configure(chosen_analyses(dataset, list(READS)), OPTIONS))
                together = time.perf_counter() - started
            print(f"  one analyze call: {together:6.1f} s, reads {total / 2**30:.2f} GiB (every site once): ratio to "
                  f"the raw pass {total / together / raw_rate:.2f}; wall time {together / raw_seconds:.1f} x one raw "
                  f"pass, {alone / together:.2f} x faster than alone")
            peaks = ", ".join(f"{peak / 2**20:.0f}" for peak in watch.peaks.values())
            restarted = set(client.scheduler_info()["workers"]) != workers_before
            print(f"peak worker memory (MiB): {peaks} (limit {limit / 2**20:.0f}); spilled to disk: "
                  f"{spilled_bytes(client) / 2**20:.0f} MiB; worker restarted: {'yes' if restarted else 'no'}")


# (b) ------------------------------------------------------------------------------------------

def token_ids(rng: np.random.Generator, shape, vocabulary: int) -> np.ndarray:
    """Token ids drawn from a Zipf-like law over the vocabulary, as in text (a few frequent tokens, a long tail)."""
    ranks = np.arange(1, vocabulary + 1)
    weights = 1.0 / (ranks + 2.7) ** 0.9
    return rng.choice(vocabulary, size=shape, p=weights / weights.sum())


def build_language_model_store(path: Path, seed: int = 0) -> str:
    """Every default site of a small language model's shape in float16; the residual stream holds a
    token embedding (in 128 of the 576 dimensions), a positional code of rank 12 and noise, drifting
    across layers; labels token_str and position as the text task writes them."""
    layers, d, n_pos, n_samples = LM["n_layers"], LM["d_model"], LM["n_pos"], LM["n_samples"]
    model = {"family": "llama", "source": "synthetic", "norm_placement": "pre", "norm_type": "rms",
             "n_layers": layers, "d_model": d, "n_heads": LM["n_heads"], "n_kv_heads": LM["n_kv_heads"],
             "d_head": LM["d_head"], "attn_scale": LM["d_head"] ** -0.5, "causal": True}
    writer = create_store(path, model=model, task={"name": "text", "max_length": n_pos}, n_samples=n_samples,
                          n_pos=n_pos, sites=DEFAULT_SITES, dtype="float16",
                          labels={"token_str": "str", "position": "int32"}, overwrite=True)
    rng = np.random.default_rng(seed)
    tokens = token_ids(rng, (n_samples, n_pos), LM["vocabulary"])
    used, codes = np.unique(tokens, return_inverse=True)
    embedding = rng.normal(size=(len(used), 128)) @ np.linalg.qr(rng.normal(size=(d, 128)))[0].T
    frequencies = np.arange(n_pos)[:, None] * np.geomspace(0.01, 1.0, 6)
    positional = np.concatenate([np.sin(frequencies), np.cos(frequencies)], axis=1) @ rng.normal(size=(12, d))
    drift = rng.normal(size=(layers, d)) * 0.5
    block = writer.attrs["samples_per_chunk"]
    for start in range(0, n_samples, block):
        stop = min(start + block, n_samples)
        n = stop - start
        base = 3 * embedding[codes.reshape(tokens.shape)[start:stop]] + positional[None]
        resid = base[:, None] + drift[None, :, None] + rng.normal(size=(n, layers, n_pos, d))
        arrays = {"resid_pre": resid, "resid_mid": resid + 0.3 * rng.normal(size=resid.shape),
                  "resid_post": resid + 0.5 * rng.normal(size=resid.shape),
                  "attn_in": resid / np.sqrt(np.mean(resid**2, axis=-1, keepdims=True)),
                  "q": rng.normal(size=(n, layers, n_pos, LM["n_heads"], LM["d_head"])),
                  "k": rng.normal(size=(n, layers, n_pos, LM["n_kv_heads"], LM["d_head"])),
                  "v": rng.normal(size=(n, layers, n_pos, LM["n_kv_heads"], LM["d_head"]))}
        arrays = {name: value.astype("float16") for name, value in arrays.items()}
        ids = tokens[start:stop]
        arrays.update({"tokens": ids.astype("int32"), "valid": np.ones((n, n_pos), bool),
                       "target": np.roll(ids, -1, axis=1).astype("int32"), "scored": np.ones((n, n_pos), bool),
                       "token_str": np.char.add("t", ids.astype(str)).astype(object),
                       "position": np.broadcast_to(np.arange(n_pos, dtype="int32"), (n, n_pos))})
        writer.write(start, arrays)
    _finish(writer, rng)
    return str(path)


def language_model(args) -> None:
    with work_directory(args.dir, "analyze-lm-") as directory:
        started = time.perf_counter()
        url = build_language_model_store(directory / "store.zarr")
        dataset = open_for_analysis(url)
        total = sum(site_bytes(dataset, site) for site in DEFAULT_SITES)
        n_classes = len(np.unique(dataset["token_str"].values))
        print(f"(b) store: {total / 2**30:.2f} GiB of float16 activations, sites {', '.join(DEFAULT_SITES)}; "
              f"{LM['n_samples']} samples x {LM['n_pos']} positions, {LM['n_layers']} layers, d_model {LM['d_model']}, "
              f"{LM['n_heads']} / {LM['n_kv_heads']} heads of {LM['d_head']}; token_str has {n_classes} classes; "
              f"written in {time.perf_counter() - started:.0f} s")
        raw_pass(dataset, DEFAULT_SITES)
        raw_seconds = raw_pass(dataset, DEFAULT_SITES)
        print(f"raw pass (read + sum every site): {raw_seconds:.1f} s, {total / raw_seconds / 2**20:.0f} MiB/s")
        fit_only = {"rank": 8, "n_bootstrap": 0, "n_null": 0}
        runs = {"subspaces, the fit alone (rank 8, no noise draws)": (["subspaces"], fit_only),
                "subspaces with the structure test (no rank, interval or claim draws)": (["subspaces"], {"rank": 8, "n_bootstrap": 0}),
                "subspaces, every default statistic": (["subspaces"], {}),
                "subspaces and spheres, every default statistic": (["subspaces", "spheres"], {}),
                "default analyses but the replay": (["accuracy", "norms", "subspaces", "spheres", "neighbours"], {})}
        if not args.skip_replay:
            runs["default analyses"] = (None, {})
        for label, (only, options) in runs.items():
            started = time.perf_counter()
            results = run_analyses(dataset, configure(chosen_analyses(dataset, only), options))
            elapsed = time.perf_counter() - started
            print(f"{label}: {elapsed:.1f} s = {elapsed / raw_seconds:.1f} x one raw pass")
        subspaces = results["subspaces"].to_dataset()
        print(f"  subspaces: factors {subspaces.attrs['factors']}, classes {subspaces['n_classes'].values.tolist()} "
              f"({subspaces['pooled_classes'].values.tolist()} pooled), ranks at layer 0 "
              f"{subspaces['subspace_rank'].isel(layer=0).values.tolist()}")


def timed_command(arguments: list[str]) -> float:
    """Seconds of one whole CLI command (a fresh process: imports and model load included)."""
    started = time.perf_counter()
    subprocess.run([str(Path(sys.executable).parent / "orthosphere"), *arguments], check=True,
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def extracted_language_model(args) -> None:
    """(c) `orthosphere extract` of a SmolLM2-135M-shaped model (random weights) over packed prose, then
    every default analysis in one `orthosphere analyze`; the ratio of the whole commands, at --windows
    and at 4x as many windows (with --repeat, the fastest of that many runs of each), and each analysis's time
    alone (and the norms and the replay together, which compute each block's attention once for both)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from extract_overhead import build

    with work_directory(args.dir, "analyze-extracted-") as directory:
        model_dir, corpus = build(str(directory), layers=30, n_paragraphs=40 * args.windows)
        for windows in (args.windows, 4 * args.windows):
            store, results = directory / f"store-{windows}.zarr", directory / f"results-{windows}.zarr"
            runs = []
            for _ in range(args.repeat):  # extraction and analysis alternately: a load that comes and goes hits both
                shutil.rmtree(store, ignore_errors=True)
                shutil.rmtree(results, ignore_errors=True)
                runs.append((timed_command(["extract", model_dir, "--task", f"text:path={corpus},context=128", "--samples",
                                            str(windows), "--dtype", "float16", "--out", str(store)]),
                             timed_command(["analyze", str(store), "--out", str(results)])))
                loads = ", ".join(f"{load:.1f}" for load in os.getloadavg())
                print(f"    extract {runs[-1][0]:.1f} s, analyze {runs[-1][1]:.1f} s (load average after: {loads})")
            extract_seconds, analyze_seconds = (min(seconds) for seconds in zip(*runs))
            print(f"(c) {windows} windows of 128 tokens: orthosphere extract {extract_seconds:.1f} s, orthosphere analyze "
                  f"(every default analysis) {analyze_seconds:.1f} s: analysis / extraction {analyze_seconds / extract_seconds:.2f}"
                  + (f" (the fastest of {args.repeat} runs each)" if args.repeat > 1 else ""))
            if windows == args.windows:
                dataset = open_for_analysis(str(store))
                for names in (["accuracy"], ["norms"], ["subspaces", "spheres"], ["neighbours"], ["replay"],
                              ["norms", "replay"]):
                    started = time.perf_counter()
                    alone = run_analyses(dataset, configure(chosen_analyses(dataset, names)))
                    print(f"    {' and '.join(names)} alone: {time.perf_counter() - started:.1f} s")
                replay_result = alone["replay"].to_dataset()
                print(f"    replay: {int(replay_result.n_sparse.sum())} sparse instances of "
                      f"{int(replay_result.n_instances.sum())}; pooled collapse rate at the swept levels "
                      f"{np.round(replay_result.collapse_rate_pooled.sel(definition='collapse').values, 5).tolist()}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=("out-of-core", "language-model", "both"), default="both")
    parser.add_argument("--size-gb", type=float, default=2.0, help="(a) store size (default 2)")
    parser.add_argument("--memory-limit", default="512MB", help="(a) memory limit of each worker (default 512MB)")
    parser.add_argument("--workers", type=int, default=2, help="(a) workers of the LocalCluster")
    parser.add_argument("--dir", default=None, help="where to write the stores (default: a temporary directory)")
    parser.add_argument("--log", action="store_true", help="show the analyses' progress log")
    parser.add_argument("--skip-replay", action="store_true", help="(b) leave out the run of every default analysis")
    parser.add_argument("--windows", type=int, default=64, help="(c) windows of the extracted store (and 4x as many)")
    parser.add_argument("--skip-synthetic", action="store_true", help="language-model: only (c), the extracted store")
    parser.add_argument("--repeat", type=int, default=1,
                        help="(c) extract and analyze alternately this many times, and take each one's fastest run "
                             "(on a shared machine, where other work comes and goes)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO if args.log else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.case in ("out-of-core", "both"):
        out_of_core(args)
    if args.case in ("language-model", "both"):
        if not args.skip_synthetic:
            language_model(args)
        extracted_language_model(args)


if __name__ == "__main__":
    main()
