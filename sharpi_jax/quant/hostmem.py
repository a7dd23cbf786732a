"""Weight bytes for XLA's CPU client on transparent huge pages, used in place.

`jnp.asarray` copies host bytes into XLA's own allocation, which the kernel backs with 4 KiB pages. The
ggml products stream their weights, the grouped expert op from dozens of scattered slabs a layer, and with
4 KiB pages every 4 KiB of that stream is a page walk: on the 35B-A3B-shaped slice the grouped op of 8
tokens ran 6.0-6.2 ms from XLA's buffers and 4.7-5.2 ms from huge-page ones (Intel Xeon, 2 threads). So on
the CPU backend a weight of 4 MiB or more is copied once into a numpy buffer aligned to 2 MiB and advised
`MADV_HUGEPAGE` before it is written (the kernel backs each whole 2 MiB of it with a huge page where it can;
the last partial 2 MiB is advised `MADV_NOHUGEPAGE`, so no page holds more than the weight), and handed to
XLA with `jax.device_put`, which uses a 64-byte-aligned host array in place. Same bytes, and the copy
replaces XLA's rather than sitting beside it; without huge pages (another OS, THP off) it is an ordinary
copy. `SHARPI_HUGE_PAGES=0` in the environment turns it off (to measure it, or where load time matters more:
in this project's VMs a huge page's first touch is slow, and the slice loads in 6-8 s instead of 2).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

ENABLED = os.environ.get("SHARPI_HUGE_PAGES", "1") != "0"
HUGE_PAGE = 2 << 20
MIN_BYTES = 4 << 20  # smaller weights gain little and would round up to whole huge pages
_MADV_HUGEPAGE, _MADV_NOHUGEPAGE = 14, 15  # Linux, every architecture


@functools.cache
def _madvise():
    """libc's madvise, or None where there is none to call (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def _advise(addr: int, n: int, advice: int) -> None:
    """madvise on [addr, addr + n), page-aligned by the caller (where `_madvise` found one); a refusal only
    costs the huge pages."""
    if n > 0:
        _madvise()(addr, n, advice)


def device_bytes(raw: np.ndarray) -> jax.Array:
    """`raw` (any host array) as a jax array on the default device: on the CPU backend, from 4 MiB up, a copy
    on huge pages that XLA uses in place (module docstring); otherwise `jnp.asarray(raw)`."""
    raw = np.asarray(raw)
    if not ENABLED or raw.nbytes < MIN_BYTES or jax.default_backend() != "cpu" or _madvise() is None:
        return jnp.asarray(raw)
    buf = np.empty(raw.nbytes + HUGE_PAGE, np.uint8)
    start = buf.ctypes.data + (-buf.ctypes.data) % HUGE_PAGE
    whole = raw.nbytes // HUGE_PAGE * HUGE_PAGE
    _advise(start, whole, _MADV_HUGEPAGE)
    tail = -(-raw.nbytes // 4096) * 4096 - whole  # the last partial huge page, in 4 KiB pages
    _advise(start + whole, tail, _MADV_NOHUGEPAGE)
    host = buf[start - buf.ctypes.data:][:raw.nbytes].view(raw.dtype).reshape(raw.shape)
    np.copyto(host, raw)
    return jax.device_put(host)
