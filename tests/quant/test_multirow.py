"""Multi-row kernels (csrc/multirow*.cc): each weight chunk unpacked once for a group of rows, ggml's bits.

References independent of the kernels: ggml's own graph (`ggml_mul_mat` on ggml's CPU backend through
ctypes, experiments/ggml_graph.py) and ggml's vec_dot path of the same extension (`set_multirow(False)`,
one ggml vec_dot per element). Blocks are real: fixture tensors and ggml's own quantizer at K = 2048 (the
35B hidden size: several super-blocks per row) with a partial last tile of weight rows. Row counts cover
the K-quant kernels' one-row form (`multirow_min_rows` 1), both sides of Q8_0's and F32's vec_dot / kernel switch (2 rows;
F32 rows of 100 values keep vec_dot),
every group size of the kernels and many groups: AVX2 groups of 2 to 4 rows (M = 5, 6 and 17 run as 2 + 3, 3 + 3 and 3 + 3 + 3 + 4 + 4),
AVX-512 groups of 2 to 8 (M = 17 and 37 run as 5 + 6 + 6 and 7 + 7 + 7 + 8 + 8). Every test runs once per
instruction set this CPU runs (the `isa` fixture); the AVX-512 set is skipped, with the reason, on a CPU
without AVX-512 F / BW / VL / VNNI.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from sharpi_jax.quant import ggml
from tests.bitwise import assert_bitwise_equal
from tests.quant.test_ggml import _blocks, _cols, _experts, _ids, _reference, _x
from gguf import GGMLQuantizationType as Q

K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
# Q8_0: a kernel on AVX-512 only (the AVX2 runs check its vec_dot path); F32 (the routers of a Q4_K_M file): from 2
# rows, rows of a multiple of 32 values.
TYPES = K_QUANTS + (Q.Q8_0, Q.F32)
FAST_MS = (1, 2, 3, 4, 5, 6, 8, 16, 17, 37, 64)


def _cpu_runs_avx512() -> bool:
    flags = ""
    try:
        with open("/proc/cpuinfo") as fh:
            flags = next((line for line in fh if line.startswith("flags")), "")
    except OSError:
        pass
    return all(f in flags.split() for f in ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"))


@pytest.fixture(params=["avx2", "avx512"])
def isa(request):
    """A test once per instruction set of the kernels (the best set is restored after)."""
    if request.param == "avx512" and not _cpu_runs_avx512():
        pytest.skip("this CPU has no AVX-512 F / BW / VL / VNNI: the AVX-512 kernels cannot run here")
    assert ggml.set_multirow_isa(request.param)
    assert ggml.multirow_isa() == request.param
    yield request.param
    ggml.set_multirow_isa("best")


def test_best_isa_is_the_cpus():
    """By default the kernels are the best set this CPU runs (read from /proc/cpuinfo, not the extension)."""
    ggml.set_multirow_isa("best")
    assert ggml.multirow_isa() == ("avx512" if _cpu_runs_avx512() else "avx2")


@pytest.fixture
def vec_dot_path(isa):
    """Runs the body's calls with the multi-row kernels off, then turns them back on (under the test's
    instruction set, so both paths of a comparison run on one set)."""
    ggml.set_multirow(False)
    yield
    ggml.set_multirow(True)


def test_multirow_serves_the_k_quants(isa):
    """On these machines (x86 with AVX2, some with AVX-512) the K-quants of Q4_K_M / Q5_K_M / Q6_K files run
    multi-row with either instruction set, Q8_0 with the AVX-512 set."""
    assert all(ggml.multirow(t) for t in K_QUANTS)
    assert ggml.multirow(Q.Q8_0) == (isa == "avx512")
    assert ggml.multirow(Q.F32) and not ggml.multirow(Q.F16)
    # K-quants: every product from one row, long rows (2048) and short ones (the experts' down projections,
    # 512): M = 1 runs the kernel's one-row form, which the bitwise tests compare with ggml's graph. Q8_0 from
    # two rows (one row: the prefetched vec_dot is faster).
    assert all(ggml.multirow_min_rows(t, 2048) == 1 and ggml.multirow_min_rows(t, 512) == 1 for t in K_QUANTS)
    assert ggml.multirow_min_rows(Q.Q8_0, 2048) == 2
    assert ggml.multirow_min_rows(Q.F32, 2048) == 2 and ggml.multirow_min_rows(Q.F32, 100) > 1 << 40
    assert all(_cols(_weights(t)[0], t) <= 1024 < _cols(_weights(t)[1], t) for t in TYPES)


def _weights(qt):
    ws = (_blocks(qt, rows=100), _blocks(qt, rows=100, cols=2048, fixture=False, seed=5))
    if qt == Q.Q8_0:  # an odd block count: the AVX-512 kernel's last block runs alone
        ws += (_blocks(qt, rows=37, cols=96, fixture=False, seed=7),)
    if qt == Q.F32:  # rows of 100 values keep vec_dot (its scalar tail); 96: three 32-value steps
        ws += (_blocks(qt, rows=37, cols=100, fixture=False, seed=7), _blocks(qt, rows=37, cols=96, fixture=False, seed=8))
    return ws


def _check(qt, ms):
    f = jax.jit(lambda x, raw: ggml.matmul(x, raw, qt))
    for raw in _weights(qt):
        x_all = _x(max(ms), _cols(raw, qt), seed=9) * 3.0
        for m in ms:
            x = x_all[:m]
            y = np.asarray(f(x, raw))
            assert_bitwise_equal(y, _reference().mul_mat(x, raw, qt))
            assert_bitwise_equal(ggml.host_matmul(x, raw, qt, threads=2), y)
            assert_bitwise_equal(y, np.asarray(f(x_all, raw))[:m])  # row-stable across the switch


@pytest.mark.usefixtures("isa")
@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_matmul_is_ggml_bitwise_at_every_width(qt):
    _check(qt, FAST_MS)


@pytest.mark.usefixtures("isa")
@pytest.mark.slow
@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_matmul_is_ggml_bitwise_every_m(qt):
    _check(qt, tuple(range(1, 65)))


@pytest.mark.usefixtures("isa")
@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_multirow_equals_vec_dot_path(qt, request):
    raw = _weights(qt)[1]
    x = _x(37, _cols(raw, qt), seed=2)
    on = ggml.host_matmul(x, raw, qt, threads=2)
    request.getfixturevalue("vec_dot_path")
    assert_bitwise_equal(ggml.host_matmul(x, raw, qt, threads=1), on)


@pytest.mark.usefixtures("isa")
def test_q8_0_extreme_quants_are_ggml_bitwise():
    """Q8_0 blocks holding -128 (ggml's quantizer never writes it; a file may): vpsignb wraps -(-128) to -128,
    and the AVX-512 kernel's masked negation and vpdpbusd must give the same lane sums as ggml's graph."""
    rng = np.random.default_rng(11)
    n, k = 40, 2048 + 32  # 65 blocks: pairs and an odd last block
    nb = k // 32
    blk = np.zeros((n, nb, 34), np.uint8)
    blk[:, :, :2] = (rng.standard_normal((n, nb)) * 0.02).astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    qs = rng.integers(-128, 128, (n, nb, 32)).astype(np.int8)
    qs[:, :, :5] = -128
    qs[:, :, 5:8] = 0
    blk[:, :, 2:] = qs.view(np.uint8)
    raw = blk.reshape(n, -1)
    x = _x(17, k, seed=12) * 4.0
    x[:, :64] = -7.0  # activations at their block's extreme: y quantized to -127
    for m in (1, 2, 8, 17):
        assert_bitwise_equal(ggml.host_matmul(x[:m], raw, Q.Q8_0, threads=2), _reference().mul_mat(x[:m], raw, Q.Q8_0))


@pytest.mark.usefixtures("isa")
def test_grouped_experts_multirow_equals_vec_dot_path(request):
    """Experts shared by many tokens (groups of 2+ rows run multi-row) against the vec_dot path."""
    qtypes = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
    gate, up, down = _experts(qtypes, e=4, d=512, f=256, seed=3)
    x = _x(24, 512, seed=4)
    ids = _ids(24, 3, 4, seed=1)  # 72 pairs over 4 experts
    run = jax.jit(lambda x, ids: ggml.expert_rows(x, ids, gate, up, down, qtypes))
    on = np.asarray(run(x, ids))
    request.getfixturevalue("vec_dot_path")
    assert_bitwise_equal(ggml.host_expert_rows(x, ids, gate, up, down, qtypes, "grouped"), on)
    assert_bitwise_equal(ggml.host_expert_rows(x, ids, gate, up, down, qtypes, "per_token"), on)


def test_load_says_once_when_multirow_is_off():
    """A process started with the multi-row kernels off gets one line from sj.load naming why."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    code = ("import warnings, sharpi_jax as sj\nwith warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n    sj.load(kernels='ggml')\n"
            "print([str(x.message) for x in w if 'multi-row' in str(x.message)])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu", "SHARPI_GGML_MULTIROW": "0"})
    assert out.returncode == 0, out.stderr[-800:]
    assert "SHARPI_GGML_MULTIROW=0" in out.stdout.splitlines()[-1]
    assert ggml.multirow_unavailable_reason() is None  # this process: on
