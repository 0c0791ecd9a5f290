"""What naming storage failures costs a read: one array of many small chunks read whole through zarr's
LocalStore, and through the NamedFailuresStore that every store access goes through
(``orthosphere.store.failures``), alternately in one run; the best of each, and their ratio.

    python benchmarks/named_failures_cost.py [--chunks 4000] [--repeat 5]
"""
from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import zarr
from zarr.storage import LocalStore

from orthosphere.store.failures import NamedFailuresStore


def read_seconds(store) -> float:
    array = zarr.open_array(store, mode="r")
    started = time.perf_counter()
    array[:]
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=4000, help="chunks of 1 kB (256 float32 values)")
    parser.add_argument("--repeat", type=int, default=5)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/array.zarr"
        array = zarr.create_array(LocalStore(path), shape=(options.chunks, 256), chunks=(1, 256), dtype="float32")
        array[:] = np.random.default_rng(0).random((options.chunks, 256), dtype=np.float32)
        plain, named = [], []
        for _ in range(options.repeat):
            plain.append(read_seconds(LocalStore(path, read_only=True)))
            named.append(read_seconds(NamedFailuresStore(LocalStore(path, read_only=True), path)))
    print(f"{options.chunks} chunks of 1 kB, best of {options.repeat}: LocalStore {min(plain):.3f} s, "
          f"NamedFailuresStore {min(named):.3f} s, ratio {min(named) / min(plain):.2f}")


if __name__ == "__main__":
    main()
