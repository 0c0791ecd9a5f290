"""What the stores' CRC-32C chunk checksums cost: writing and reading the same float32 activations
with and without Zarr's crc32c codec, side by side, alternating, in one process.

Prints the median CPU and wall time of each and their ratios (checksums / none). Reads go through
``open_store``'s guarded reads, which verify each checksum once more to name a damaged chunk.
Usage: python benchmarks/checksum_cost.py [--megabytes 256] [--repeats 5] [--dir DIR]
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time

import numpy as np
import zarr
from zarr.codecs import Crc32cCodec

from orthosphere.store.integrity import GuardedStore, promises

CHUNK = (4, 1, 64, 512)  # 512 kB of float32: one layer of 4 samples of 64 positions, d_model 512


def timed(work) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    work()
    return time.perf_counter() - wall, time.process_time() - cpu


def one_round(directory: str, data: np.ndarray, copies: int, checksum: bool) -> tuple[tuple, tuple]:
    path = os.path.join(directory, f"{'crc' if checksum else 'none'}.zarr")
    group = zarr.open_group(path, mode="w", zarr_format=3)
    group.attrs.update({"shards": [[0, copies * len(data)]], "layers": list(range(data.shape[1]))})
    array = group.create_array("resid_pre", shape=(copies * len(data),) + data.shape[1:], chunks=CHUNK, dtype="float32",
                               dimension_names=("sample", "layer", "pos", "d_model"),
                               compressors=(Crc32cCodec(),) if checksum else None)

    def write():
        for copy in range(copies):
            array[copy * len(data):(copy + 1) * len(data)] = data

    written = timed(write)
    promised = promises(group, dict(group.attrs), np.array([True]), False)
    guarded = zarr.open_group(GuardedStore(group.store, path, promised), mode="r")
    read = timed(lambda: guarded["resid_pre"][:])
    shutil.rmtree(path)
    return written, read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None)
    arguments = parser.parse_args()
    data = np.random.default_rng(0).standard_normal((64, 8, 64, 512), dtype=np.float32)  # 64 MB
    copies = max(1, arguments.megabytes // 64)
    directory = tempfile.mkdtemp(dir=arguments.dir)
    times: dict[tuple[bool, str], list] = {}
    for _ in range(arguments.repeats):
        for checksum in (False, True):
            written, read = one_round(directory, data, copies, checksum)
            times.setdefault((checksum, "write"), []).append(written)
            times.setdefault((checksum, "read"), []).append(read)
    shutil.rmtree(directory)
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
          f"{copies * 64} MB of float32 in {np.prod(CHUNK) * 4 // 1024} kB chunks, median of {arguments.repeats}")
    for operation in ("write", "read"):
        none, crc = ([statistics.median(t[i] for t in times[(checksum, operation)]) for i in (0, 1)]
                     for checksum in (False, True))
        print(f"{operation:<5}  none: wall {none[0]:.2f} s, CPU {none[1]:.2f} s   crc32c: wall {crc[0]:.2f} s, "
              f"CPU {crc[1]:.2f} s   ratio wall {crc[0] / none[0]:.2f}, CPU {crc[1] / none[1]:.2f}")


if __name__ == "__main__":
    main()
