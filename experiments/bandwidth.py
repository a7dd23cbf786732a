"""The machine's measured copy bandwidth: the ceiling a weight-streaming kernel is compared against.

    python -m experiments.bandwidth            # 512 MiB buffer, 7 rounds
    python -m experiments.bandwidth 2048       # a 2 GiB buffer

`copy_bandwidth()` times `np.copyto` of a large float buffer (larger than any cache) into another and
reports GB/s of bytes read (the figure a matmul's "GB/s of weight bytes" is set beside: a copy also
writes as many bytes, so a streaming read can approach 2x this on some machines), median/min/max over
rounds. One thread: numpy's copy is single-threaded.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from experiments.cli import fail
from experiments.timing import spread


def copy_bandwidth(mib: int = 512, rounds: int = 7) -> dict[str, float]:
    """{"median", "min", "max"} GB/s (1e9 bytes/s) of bytes read by a numpy copy of `mib` MiB."""
    src = np.ones(mib * 2**20 // 8, np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # first touch of both buffers, unrecorded
    rates = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        rates.append(src.nbytes / (time.perf_counter() - t0) / 1e9)
    return spread(rates)


USAGE = "usage: bandwidth [MIB]   (the buffer size in MiB, default 512)"


def main(argv=None) -> int:
    args = list(argv[1:]) if argv else []
    if args and args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if len(args) > 1 or args and not (args[0].isdigit() and int(args[0]) > 0):
        return fail(f"{' '.join(args)!r} is not a buffer size in MiB\n{USAGE}")
    mib = int(args[0]) if args else 512
    s = copy_bandwidth(mib)
    print(f"copy bandwidth ({mib} MiB, numpy, 1 thread): {s['median']:.2f} GB/s [{s['min']:.2f}-{s['max']:.2f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
