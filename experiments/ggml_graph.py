"""ggml itself, through ctypes on the libggml-python libraries: the independent reference for the ggml backend
(tests/quant/test_ggml.py) and the engine it is timed against (experiments/bench_ggml.py).

`MulMat(raw, qtype, m)` builds a ggml graph `ggml_mul_mat(W, x)` on a copy of the blocks once;
`.compute(x, threads)` has ggml's CPU backend compute it (`ggml_graph_compute_with_ctx`);
`mul_mat(x, raw, qtype)` does both. `quantize(w, qtype)` makes valid blocks of any
type with ggml's own quantizer (`ggml_quantize_chunk`, an all-ones importance matrix where a type
requires one). Nothing here touches sharpi_jax's extension.
"""

from __future__ import annotations

import ctypes
import functools
import os

import numpy as np


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


@functools.cache
def _libs():
    import libggml

    lib = os.path.join(os.path.dirname(libggml.__file__), "lib64")
    base = ctypes.CDLL(os.path.join(lib, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(os.path.join(lib, "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    p = ctypes.c_void_p
    base.ggml_init.argtypes, base.ggml_init.restype = [_InitParams], p
    base.ggml_free.argtypes = [p]
    base.ggml_new_tensor_2d.argtypes, base.ggml_new_tensor_2d.restype = [p, ctypes.c_int, ctypes.c_int64,
                                                                         ctypes.c_int64], p
    base.ggml_mul_mat.argtypes, base.ggml_mul_mat.restype = [p, p, p], p
    base.ggml_new_graph.argtypes, base.ggml_new_graph.restype = [p], p
    base.ggml_build_forward_expand.argtypes = [p, p]
    base.ggml_get_data.argtypes, base.ggml_get_data.restype = [p], p
    base.ggml_nbytes.argtypes, base.ggml_nbytes.restype = [p], ctypes.c_size_t
    base.ggml_row_size.argtypes, base.ggml_row_size.restype = [ctypes.c_int, ctypes.c_int64], ctypes.c_size_t
    base.ggml_quantize_requires_imatrix.argtypes, base.ggml_quantize_requires_imatrix.restype = [ctypes.c_int], \
        ctypes.c_bool
    base.ggml_quantize_chunk.argtypes = [ctypes.c_int, p, p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, p]
    base.ggml_quantize_chunk.restype = ctypes.c_size_t
    cpu.ggml_graph_compute_with_ctx.argtypes, cpu.ggml_graph_compute_with_ctx.restype = [p, p, ctypes.c_int], \
        ctypes.c_int
    cpu.ggml_cpu_init()
    return base, cpu


def has_llamafile() -> bool:
    """Whether this ggml's mul_mat may route products to llamafile's sgemm instead of vec_dot."""
    return bool(_libs()[1].ggml_cpu_has_llamafile())


class MulMat:
    """A ggml context holding W (a copy of `raw`), an f32 input of `m` rows and y = ggml_mul_mat(W, x)."""

    def __init__(self, raw: np.ndarray, qtype: int, m: int):
        base, _ = _libs()
        raw = np.ascontiguousarray(raw, np.uint8)
        self.n, self.m = raw.shape[0], m
        block = base.ggml_row_size(int(qtype), 256)  # bytes of 256 values (every served type divides 256)
        self.k = raw.shape[1] * 256 // block
        assert base.ggml_row_size(int(qtype), self.k) == raw.shape[1]
        mem = raw.nbytes + self.k * m * 4 * 6 + m * self.n * 4 + (1 << 22)
        self.ctx = base.ggml_init(_InitParams(mem, None, False))
        w_t = base.ggml_new_tensor_2d(self.ctx, int(qtype), self.k, self.n)
        self.x_t = base.ggml_new_tensor_2d(self.ctx, 0, self.k, m)
        ctypes.memmove(base.ggml_get_data(w_t), raw.ctypes.data, raw.nbytes)
        self.y_t = base.ggml_mul_mat(self.ctx, w_t, self.x_t)  # ne = [N, M]: row m holds the N outputs of x[m]
        self.graph = base.ggml_new_graph(self.ctx)
        base.ggml_build_forward_expand(self.graph, self.y_t)

    def compute(self, x: np.ndarray, threads: int = 1) -> np.ndarray:
        """y[M, N] for x[M, K], as ggml's CPU backend computes it with `threads` threads."""
        base, cpu = _libs()
        x = np.ascontiguousarray(x, np.float32)
        assert x.shape == (self.m, self.k)
        ctypes.memmove(base.ggml_get_data(self.x_t), x.ctypes.data, x.nbytes)
        assert cpu.ggml_graph_compute_with_ctx(self.ctx, self.graph, threads) == 0
        y = np.empty((self.m, self.n), np.float32)
        ctypes.memmove(y.ctypes.data, base.ggml_get_data(self.y_t), y.nbytes)
        return y

    def __del__(self):
        if getattr(self, "ctx", None):
            try:
                _libs()[0].ggml_free(self.ctx)
            except TypeError:  # interpreter shutdown: module globals already gone, the process frees it
                pass
            self.ctx = None


def mul_mat(x: np.ndarray, raw: np.ndarray, qtype: int, threads: int = 1) -> np.ndarray:
    """f32[M, N] = x[M, K] @ W.T as ggml's CPU backend computes `ggml_mul_mat(W, x)`."""
    return MulMat(raw, qtype, x.shape[0]).compute(x, threads)


def quantize(w: np.ndarray, qtype: int) -> np.ndarray:
    """ggml's own blocks uint8[rows, row_bytes] of float rows `w` (an all-ones imatrix where required)."""
    base, _ = _libs()
    w = np.ascontiguousarray(w, np.float32)
    rows, cols = w.shape
    out = np.zeros((rows, base.ggml_row_size(int(qtype), cols)), np.uint8)
    imatrix = np.ones(cols, np.float32)
    im = imatrix.ctypes.data if base.ggml_quantize_requires_imatrix(int(qtype)) else None
    written = base.ggml_quantize_chunk(int(qtype), w.ctypes.data, out.ctypes.data, 0, rows, cols, im)
    assert written == out.nbytes
    return out
