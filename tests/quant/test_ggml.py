"""The "ggml" backend (sharpi_jax.quant.ggml): ggml's own bits, row-stable, within the activation-rounding bound.

References, all independent of the extension: ggml's own graph (`ggml_mul_mat` computed by ggml's CPU
backend through ctypes, experiments/ggml_graph.py) and the exact float product with gguf-py's numpy
dequantizer. Blocks are real: the fixture files' tensors, and ggml's own quantizer for the types no
fixture holds.

The bound. The backend rounds each activation row to the weight type's vec_dot_type, then the block
products are exact integer sums scaled in float32. Per block b of the activation row with amax_b:
- Q8_0 / Q8_1 (32 values): q = round(x / d), d = amax_b / 127 stored as f16, so
  |x - x~| <= d/2 + 127 |d - f16(d)| <= d (1/2 + 127 * 2^-11) per value; Q8_1 also stores
  s = f16(d * sum q) for the weight's min m: + |m| 2^-11 (sum|x_b| + 32 e_b) per block.
- Q8_K (256 values): d = amax_b / 127 in float32: |x - x~| <= d (1/2 + 2^-10) (float rounding slack).
- F16 / BF16: |x - x~| <= 2^-11 |x| (+ 2^-25) / 2^-8 |x| (+ 2^-133). F32: exact.
So |y - x @ W.T| <= sum_i e_i |w_i| (+ the Q8_1 term) + (K/16 + 16) 2^-24 sum_i |w_i| (|x_i| + e_i), the last
term for float32 accumulation (vec_dot sums at most K/16 + 16 roundings per output).
"""

from __future__ import annotations

import functools
import glob
import os
import subprocess
import sys

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharpi_jax.errors import InputError, UnsupportedQuantError
from sharpi_jax.gguf import GGUFFile
from sharpi_jax.quant import ggml
from tests.bitwise import assert_bitwise_equal
from tests.conftest import FIXTURES, REPO_ROOT

Q = gguf.GGMLQuantizationType

if not ggml.available():
    if os.environ.get("CI"):
        pytest.fail(f"CI: the ggml extension must be built: {ggml.unavailable_reason()}", pytrace=False)
    pytest.skip(f"ggml extension not built: {ggml.unavailable_reason()}", allow_module_level=True)

# ggml-cpu's vec_dot_type of each served type (ggml-cpu.c type_traits_cpu); checked against the extension.
VEC_DOT_TYPE = {Q.F32: Q.F32, Q.F16: Q.F16, Q.BF16: Q.BF16, Q.Q4_0: Q.Q8_0, Q.Q5_0: Q.Q8_0, Q.Q8_0: Q.Q8_0,
                Q.IQ4_NL: Q.Q8_0, Q.MXFP4: Q.Q8_0, Q.Q4_1: Q.Q8_1, Q.Q5_1: Q.Q8_1}
VEC_DOT_TYPE.update({t: Q.Q8_K for t in ggml.SERVED_TYPES if t not in VEC_DOT_TYPE})
ALL_TYPES = sorted(ggml.SERVED_TYPES, key=int)


@functools.cache
def _reference():
    from experiments import ggml_graph

    return ggml_graph


@functools.cache
def _fixture_tensors() -> dict:
    """qtype -> (path, tensor name) of one 2-D fixture matrix of that type with >= 64 rows."""
    found = {}
    for path in sorted(glob.glob(str(FIXTURES / "*" / "*.gguf"))):
        f = GGUFFile(path)
        for t in f:
            if len(t.shape) == 2 and t.shape[0] >= 64 and t.qtype in ggml.SERVED_TYPES:
                found.setdefault(t.qtype, (path, t.name))
        f.close()
    return found


@functools.cache
def _blocks(qt: Q, rows: int = 64, cols: int = 256, seed: int = 0, fixture: bool = True) -> np.ndarray:
    """Real blocks uint8[rows, row_bytes]: a fixture tensor's first rows (its own cols), else (or with
    fixture=False) ggml's own quantizer on random rows of `cols` values. Cached: callers must not write."""
    if fixture and qt in _fixture_tensors():
        path, name = _fixture_tensors()[qt]
        raw = GGUFFile(path).raw(name)
        return np.array(raw[:rows])
    w = (np.random.default_rng(seed).standard_normal((rows, cols)) * 0.05).astype(np.float32)
    return w.view(np.uint8) if qt == Q.F32 else _reference().quantize(w, qt)


def _cols(raw: np.ndarray, qt: Q) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qt]
    return raw.shape[1] // size * block


def _x(m: int, k: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)


def _jit_matmul(qt):
    return jax.jit(lambda x, raw: ggml.matmul(x, raw, qt))


def _activation_error(x: np.ndarray, qt: Q) -> np.ndarray:
    """Per-value bound e_i on |x - x~| for the activation rounding of qt's vec_dot_type (module doc)."""
    vdt = VEC_DOT_TYPE[qt]
    ax = np.abs(x.astype(np.float64))
    if vdt == Q.F32:
        return np.zeros_like(ax)
    if vdt == Q.F16:
        return ax * 2.0**-11 + 2.0**-25
    if vdt == Q.BF16:
        return ax * 2.0**-8 + 2.0**-133
    block, slack = (256, 2.0**-10) if vdt == Q.Q8_K else (32, 127 * 2.0**-11)
    amax = ax.reshape(*x.shape[:-1], -1, block).max(-1, keepdims=True)
    return np.broadcast_to(amax / 127 * (0.5 + slack), (*x.shape[:-1], x.shape[-1] // block, block)).reshape(x.shape)


def _bound(x: np.ndarray, raw: np.ndarray, qt: Q) -> tuple[np.ndarray, np.ndarray]:
    """(exact float64 product, the stated bound on |ggml product - exact|), both [M, N]."""
    w = np.asarray(gguf.quants.dequantize(raw, qt), np.float64).reshape(raw.shape[0], -1)
    x64 = x.astype(np.float64)
    e = _activation_error(x, qt)
    aw = np.abs(w)
    bound = e @ aw.T + (x.shape[1] / 16 + 16) * 2.0**-24 * ((np.abs(x64) + e) @ aw.T)
    if VEC_DOT_TYPE[qt] == Q.Q8_1:  # the f16-rounded s = d * sum(q) times the weight block's min m
        nb = x.shape[1] // 32
        m = np.abs(raw.reshape(raw.shape[0], nb, -1)[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64))
        sx = np.abs(x64).reshape(x.shape[0], nb, 32).sum(-1) + 32 * e.reshape(x.shape[0], nb, 32)[..., 0]
        bound += 2.0**-11 * (sx @ m.T)
    return x64 @ w.T, bound


# ----- ggml's own graph: same bits -----------------------------------------------------------------

def test_vec_dot_types_match_ggml():
    for qt in ALL_TYPES:
        assert ggml._ext().vec_dot_type(int(qt)) == VEC_DOT_TYPE[qt], qt.name


@pytest.mark.parametrize("qt", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_is_ggml_mul_mat_bitwise(qt):
    """This ggml has no llamafile sgemm (asserted), so its mul_mat is vec_dot at every M: same bits."""
    assert not _reference().has_llamafile()
    f = _jit_matmul(qt)
    for raw in (_blocks(qt), _blocks(qt, rows=16, cols=1024, fixture=False)):  # 1024: several super-blocks
        for m in (1, 3, 17):
            x = _x(m, _cols(raw, qt), seed=m)
            assert_bitwise_equal(np.asarray(f(x, raw)), _reference().mul_mat(x, raw, qt))


def test_fixture_blocks_cover_the_file_types():
    """The fixture-backed types are the ones the zoo holds (real blocks, not only ggml-quantized ones)."""
    have = set(_fixture_tensors())
    if not have:
        pytest.skip(f"no fixture GGUFs under {FIXTURES}")
    assert {Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL,
            Q.IQ4_XS} <= have


# ----- the activation-rounding bound, every M ------------------------------------------------------

def _check_bound(qt, ms):
    raw = _blocks(qt)
    f = _jit_matmul(qt)
    x_all = _x(max(ms), _cols(raw, qt), seed=7) * 2.0
    worst = 0.0
    for m in ms:
        x = x_all[:m]
        y = np.asarray(f(x, raw), np.float64)
        exact, bound = _bound(x, raw, qt)
        err = np.abs(y - exact)
        assert (err <= bound).all(), f"{qt.name} M={m}: max excess {(err - bound).max()}"
        worst = max(worst, float((err / bound).max()))
    if VEC_DOT_TYPE[qt] != Q.F32:  # the bound is tight enough to be reached in part: not vacuous
        assert worst > 0.02, f"{qt.name}: errors reach only {worst:.3g} of the bound"


@pytest.mark.parametrize("qt", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_within_activation_rounding_bound(qt):
    _check_bound(qt, (1, 2, 7, 16, 64, 256))


@pytest.mark.slow
@pytest.mark.parametrize("qt", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_within_bound_every_m(qt):
    _check_bound(qt, tuple(range(1, 257)))


# ----- row stability -------------------------------------------------------------------------------

@pytest.mark.parametrize("qt", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_1, Q.Q4_K, Q.Q6_K, Q.IQ4_XS], ids=lambda t: t.name)
def test_rows_are_batch_independent_bitwise(qt):
    f = _jit_matmul(qt)
    # 100 rows: the last tile of weight rows is partial; K = 2048 (the 35B hidden size) and a fixture's 256.
    for raw in (_blocks(qt, rows=100), _blocks(qt, rows=100, cols=2048, fixture=False)):
        x = _x(37, _cols(raw, qt), seed=3)
        full = np.asarray(f(x, raw))
        for m in range(37):
            assert_bitwise_equal(np.asarray(f(x[m:m + 1], raw)), full[m:m + 1])
        assert_bitwise_equal(np.asarray(f(x[5:21], raw)), full[5:21])
        assert_bitwise_equal(ggml.host_matmul(x, raw, qt, threads=2), full)
        assert_bitwise_equal(ggml.host_matmul(x, raw, qt, threads=1), full)


@pytest.mark.parametrize("qt", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.F32])
def test_matmul_skips_padding_rows(qt):
    """rows=r (traced): rows [0, r) keep their bits, the padding rows after them are +0.0 (not computed)."""
    raw = _blocks(qt, rows=40)
    x = _x(6, _cols(raw, qt), seed=4)
    full = np.asarray(_jit_matmul(qt)(x, raw))
    run = jax.jit(lambda x, raw, r: ggml.matmul(x, raw, qt, rows=r))
    for r in (0, 1, 4, 6, 9):
        y = np.asarray(run(x, raw, np.int32(r)))
        m = min(r, 6)
        assert_bitwise_equal(y[:m], full[:m])
        assert_bitwise_equal(y[m:], np.zeros_like(full[m:]))


def test_matmul_leading_axes_and_mmap_views():
    """x [..., K] keeps its leading axes; host_matmul takes the read-only mmap view of a GGUF as is."""
    path, name = _fixture_tensors().get(Q.Q6_K, (None, None))
    if path is None:
        pytest.skip("no Q6_K fixture tensor")
    raw = GGUFFile(path).raw(name)
    assert not raw.flags.writeable
    x = _x(6, _cols(raw, Q.Q6_K)).reshape(2, 3, -1)
    y = np.asarray(_jit_matmul(Q.Q6_K)(x, np.array(raw)))
    assert y.shape == (2, 3, raw.shape[0])
    assert_bitwise_equal(ggml.host_matmul(x, raw, Q.Q6_K), y)


# ----- bad input -----------------------------------------------------------------------------------

def test_bad_input_is_one_line_error():
    raw = _blocks(Q.Q4_K)
    with pytest.raises(InputError, match="(?i)q4_K row of 256 values is 144 bytes, got 72"):
        ggml.matmul(jnp.zeros((1, 256)), raw[:, :72], Q.Q4_K)
    with pytest.raises(InputError, match="multiple of 256"):
        ggml.matmul(jnp.zeros((1, 100)), raw, Q.Q4_K)
    with pytest.raises(UnsupportedQuantError, match="Q8_K"):
        ggml.matmul(jnp.zeros((1, 256)), raw, Q.Q8_K)
    with pytest.raises(InputError, match="uint8"):
        ggml.matmul(jnp.zeros((1, 256)), raw.astype(np.int32), Q.Q4_K)


def test_missing_extension_names_cause_and_fix():
    code = ("import sys; sys.modules['sharpi_jax.quant._ggml'] = None\n"
            "import sharpi_jax\nfrom sharpi_jax.quant import ggml\n"
            "print(ggml.available(), ggml.serves(12)); print(ggml.unavailable_reason())\n"
            "try:\n    ggml.host_matmul(None, None, 12)\nexcept sharpi_jax.SharpiError as e:\n    print(type(e).__name__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
    lines = out.stdout.splitlines()
    assert lines[0] == "False False", out.stderr
    assert "not built" in lines[1] and "pip install -e ." in lines[1]
    assert lines[2] == "GgmlUnavailableError"


# ----- routed experts ------------------------------------------------------------------------------

def _experts(qtypes, e=6, d=256, f=512, seed=0):
    """Random expert weights [E, rows, bytes] in ggml's own blocks of (gate, up, down) types."""
    rng = np.random.default_rng(seed)
    out = []
    for qt, (rows, cols) in zip(qtypes, ((f, d), (f, d), (d, f))):
        w = (rng.standard_normal((e * rows, cols)) * 0.05).astype(np.float32)
        out.append(_reference().quantize(w, qt).reshape(e, rows, -1))
    return out


def _fixture_experts(layer: int = 1):
    path = FIXTURES / "tiny-qwen35moe" / "tiny-qwen35moe-Q8_0.gguf"
    cands = sorted(glob.glob(str(FIXTURES / "tiny-qwen35moe" / "*.gguf")))
    if not path.exists() and not cands:
        pytest.skip(f"no tiny-qwen35moe fixture under {FIXTURES}")
    for p in ([str(path)] if path.exists() else []) + cands:
        f = GGUFFile(p)
        names = [f"blk.{layer}.ffn_{w}_exps.weight" for w in ("gate", "up", "down")]
        if all(n in f for n in names) and all(f.tensor(n).qtype != Q.F32 for n in names):
            return [f.raw(n) for n in names], [f.tensor(n).qtype for n in names]
    pytest.skip("no quantized tiny-qwen35moe experts")


EXPERT_CASES = {"Q4_K_M-like": (Q.Q4_K, Q.Q4_K, Q.Q6_K), "Q8_0": (Q.Q8_0,) * 3, "mixed": (Q.Q4_K, Q.Q8_0, Q.IQ4_NL)}


def _ids(n, k, e, seed=0):
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32)


@pytest.mark.parametrize("case", list(EXPERT_CASES))
def test_expert_rows_grouped_per_token_host_composition_bitwise(case):
    qtypes = EXPERT_CASES[case]
    gate, up, down = _experts(qtypes)
    n, k = 9, 4
    x = _x(n, gate.shape[1] and down.shape[1], seed=5)
    ids = _ids(n, k, gate.shape[0])
    run = jax.jit(lambda x, ids, mode: ggml.expert_rows(x, ids, gate, up, down, qtypes, mode), static_argnums=2)
    grouped = np.asarray(run(x, ids, "grouped"))
    assert grouped.shape == (n, k, x.shape[1])
    assert_bitwise_equal(np.asarray(run(x, ids, "per_token")), grouped)
    for mode in ggml.MODES:
        for threads in (1, 2):
            assert_bitwise_equal(ggml.host_expert_rows(x, ids, gate, up, down, qtypes, mode, threads), grouped)
    # Composition of the backend's own matmul with the op's SiLU, pair by pair.
    for i in range(n):
        for j in range(k):
            e = ids[i, j]
            g = ggml.host_matmul(x[i:i + 1], gate[e], qtypes[0])
            u = ggml.host_matmul(x[i:i + 1], up[e], qtypes[1])
            y = ggml.host_matmul(ggml.silu_mul(g, u), down[e], qtypes[2])
            assert_bitwise_equal(y[0], grouped[i, j])
    # Row stability: each token alone gives its rows' bits.
    for i in (0, n - 1):
        assert_bitwise_equal(np.asarray(run(x[i:i + 1], ids[i:i + 1], "grouped"))[0], grouped[i])


def test_backend_grouped_op_skips_padding_rows():
    """The ggml backend's grouped op with valid=: valid rows keep their bits, padding rows are +0.0."""
    from sharpi_jax.quant import MatrixFormat, registry

    qtypes = EXPERT_CASES[next(iter(EXPERT_CASES))]
    stacks = _experts(qtypes)
    x = _x(5, stacks[0].shape[1] and stacks[2].shape[1], seed=6)
    ids = _ids(5, 3, stacks[0].shape[0], seed=2)
    full = ggml.host_expert_rows(x, ids, *stacks, qtypes)
    fmt = MatrixFormat("ggml", None)
    qts = tuple(fmt.pack(r, qt, r.shape[:2] + (_cols(r[0], qt),)) for r, qt in zip(stacks, qtypes))
    valid = np.array([True, False, True, True, False])
    y, loads = jax.jit(lambda x, ids, v: registry.get("ggml").expert_rows(
        x, ids, qts, registry.ExpertOptions(), valid=v))(x, ids, valid)
    y = np.asarray(y)
    assert_bitwise_equal(y[valid], full[valid])
    assert_bitwise_equal(y[~valid], np.zeros_like(full[~valid]))
    assert int(loads) == len(set(ids[valid].ravel()))


def test_expert_rows_on_fixture_experts_near_float_reference():
    """Fixture experts from the mmap: host == FFI bitwise; within 2% relative L2 of the float64 SwiGLU."""
    (gate, up, down), qtypes = _fixture_experts()
    e, f, d = gate.shape[0], gate.shape[1], down.shape[1]
    n, k = 5, min(4, e)
    x = _x(n, d, seed=11)
    ids = _ids(n, k, e, seed=2)
    y = ggml.host_expert_rows(x, ids, gate, up, down, qtypes)  # read-only mmap views, no copy
    assert_bitwise_equal(np.asarray(ggml.expert_rows(jnp.asarray(x), jnp.asarray(ids), np.array(gate), np.array(up),
                                                     np.array(down), qtypes)), y)
    deq = [np.asarray(gguf.quants.dequantize(w.reshape(-1, w.shape[-1]), qt), np.float64).reshape(e, -1, dd)
           for w, qt, dd in zip((gate, up, down), qtypes, (d, d, f))]
    for i in range(n):
        for j in range(k):
            g, u = deq[0][ids[i, j]] @ x[i], deq[1][ids[i, j]] @ x[i]
            ref = deq[2][ids[i, j]] @ (g / (1 + np.exp(-g)) * u)
            assert np.linalg.norm(y[i, j] - ref) <= 2e-2 * np.linalg.norm(ref)


def test_silu_mul_is_silu():
    g = np.linspace(-30, 30, 4001, dtype=np.float32)
    u = np.float32(1.5) * np.ones_like(g)
    exact = g.astype(np.float64) / (1 + np.exp(-g.astype(np.float64))) * 1.5
    np.testing.assert_allclose(ggml.silu_mul(g, u), exact, rtol=4e-7, atol=1e-30)


def test_expert_reads_and_bad_ids():
    gate, up, down = _experts(EXPERT_CASES["Q8_0"], e=4, f=64)
    ids = np.array([[0, 1], [1, 3], [0, 3]], np.int32)
    assert int(ggml.expert_reads(jnp.asarray(ids), 4)) == 3
    assert int(ggml.expert_reads(jnp.asarray(ids), 4, "per_token")) == 6
    assert ggml.expert_bytes(gate, up, down) == gate[0].nbytes + up[0].nbytes + down[0].nbytes
    with pytest.raises(InputError, match="expert id 4 out of range"):
        ggml.host_expert_rows(_x(3, 256), ids + 1, gate, up, down, EXPERT_CASES["Q8_0"])
    with pytest.raises(Exception, match="expert id 4 out of range"):  # inside jit: the FFI call fails
        ggml.expert_rows(_x(3, 256), ids + 1, gate, up, down, EXPERT_CASES["Q8_0"]).block_until_ready()
    with pytest.raises(InputError, match="mode"):
        ggml.expert_rows(_x(3, 256), ids, gate, up, down, EXPERT_CASES["Q8_0"], mode="dense")
    with pytest.raises(InputError, match="disagree"):
        ggml.expert_rows(_x(3, 128), ids, gate, up, down, EXPERT_CASES["Q8_0"])
