"""Routed-expert dispatch: the grouped path equals the per-token reference bit for bit.

Every case checks grouped == per_token bit for bit (`tests.bitwise`) on the full [N, D] output, no NaN,
and the executed expert-read counters: reads (per-token N*k, grouped = unique experts) and the bytes
those reads took, against the GGUF block sizes of gguf-py (per-token N*k experts' bytes, grouped the
unique-expert floor). The fast tier
samples N in 1..64 (1, 2, 3, 4, 5, 8, 13, 31, 64) with every top-k in 1..8, plus skewed routing and
unused experts, for F32, Q8_0 and Q4_K weights; the full 64 x 8 grid per qtype is marked `slow`.
"""

from __future__ import annotations

import functools

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants as gq

from sharpi_jax.pallas_kernels import quant_blocks as qb
from sharpi_jax.errors import InputError, SharpiError, UnsupportedQuantError
from sharpi_jax.experts import dispatch as dp
from sharpi_jax.quant import MatrixFormat
from sharpi_jax.testing.experts import expert_stacks, random_expert_bytes
from tests.bitwise import assert_bitwise_equal

E, F, D = 16, 256, 256  # Q4_K needs rows of 256 in both directions (down's K is F)
QTYPES = ("f32", "q8_0", "q4_k")


@functools.cache
def _raw(qtype: str) -> tuple[np.ndarray, ...]:
    """GGUF bytes of (gate, up, down) for E random experts of one type."""
    return random_expert_bytes(np.random.default_rng(sum(map(ord, qtype))), E, F, D, int(Q[qtype.upper()]))


@functools.cache
def _experts(qtype: str, kernels: str = "xla"):
    """QTensor stacks laid out for a backend ("xla": Q8_0 / Q4_K as SoA fields; "reference": the GGUF
    blocks; "pallas": the kernel layout)."""
    return expert_stacks(_raw(qtype), int(Q[qtype.upper()]), MatrixFormat(kernels, None))


def _routing(rng, n, k, *, experts=None, same_for_all=False):
    pool = np.arange(E) if experts is None else np.asarray(experts)
    if same_for_all:
        sel = np.tile(rng.permutation(pool)[:k], (n, 1))
    else:
        sel = np.stack([rng.permutation(pool)[:k] for _ in range(n)])
    w = rng.random((n, k)).astype(np.float32) + 0.1
    w /= w.sum(axis=1, keepdims=True)
    u = rng.standard_normal((n, D)).astype(np.float32)
    return jnp.asarray(u), jnp.asarray(sel.astype(np.int32)), jnp.asarray(w)


def _gguf_bytes_per_expert(ew) -> int:
    """One expert's bytes in GGUF storage, from gguf-py's block table (independent of the QTensors' arrays)."""
    def matrix(qtype, rows, cols):
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
        return rows * cols // block * size
    return sum(matrix(m.qtype, m.shape[1], m.shape[2]) for m in ew)


def _assert_parity(ew, u, sel, w, row_kernel="gemm", row_tile=None):
    a, sa = dp.routed_experts(u, sel, w, ew, "per_token", row_kernel=row_kernel, with_stats=True)
    b, sb = dp.routed_experts(u, sel, w, ew, "grouped", row_kernel=row_kernel, row_tile=row_tile,
                              with_stats=True)
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == (u.shape[0], D)
    assert not np.isnan(b).any() and not np.isnan(a).any()
    assert_bitwise_equal(b, a)
    n_unique = len(np.unique(np.asarray(sel)))
    assert int(sa["expert_loads"]) == sel.size
    assert int(sb["expert_loads"]) == n_unique
    bpe = _gguf_bytes_per_expert(ew)
    assert dp.read_bytes(sa) == sel.size * bpe
    assert dp.read_bytes(sb) == n_unique * bpe
    return a


# Every N in {1, 2, 3, 4, 5, 8, 13, 31, 64} and every k in 1..8 appears at least once.
FAST_CASES = [(1, 1), (1, 8), (2, 3), (3, 8), (4, 2), (5, 5), (8, 6), (13, 4), (31, 7), (64, 8), (64, 1)]


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n,k", FAST_CASES)
def test_grouped_equals_per_token_gemm(qtype, n, k):
    rng = np.random.default_rng(1000 * n + k)
    _assert_parity(_experts(qtype), *_routing(rng, n, k))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n,k", [(1, 8), (5, 5), (31, 7)])
def test_ggml_fused_grouped_equals_composed_per_token(qtype, n, k):
    """kernels="ggml": "grouped" is ggml's fused expert op (one FFI call for the layer); "per_token" is the
    composed loop, which runs that op one expert at a time (`Backend.expert_ffn`): same bits (f32 experts
    included, where no activation quantization would hide a different SiLU)."""
    from sharpi_jax.quant import ggml

    if not ggml.available():
        pytest.skip(f"ggml extension unavailable: {ggml.unavailable_reason()}")
    ew = _experts(qtype, "ggml")
    assert all(m.kernels == "ggml" and m.layout == "blocks" for m in ew)
    rng = np.random.default_rng(5000 * n + k)
    _assert_parity(ew, *_routing(rng, n, k))


@pytest.mark.parametrize("qtype", ["f32", "q4_k"])
@pytest.mark.parametrize("n,k", [(1, 8), (3, 8), (13, 4), (64, 8)])
def test_grouped_equals_per_token_gemv(qtype, n, k):
    rng = np.random.default_rng(2000 * n + k)
    _assert_parity(_experts(qtype), *_routing(rng, n, k), row_kernel="gemv")


@pytest.mark.parametrize("qtype", QTYPES)
def test_skewed_routing_all_rows_to_the_same_experts(qtype):
    rng = np.random.default_rng(3)
    ew = _experts(qtype)
    _assert_parity(ew, *_routing(rng, 64, 1, experts=[5], same_for_all=True))  # 64 rows on one expert
    _assert_parity(ew, *_routing(rng, 21, 8, same_for_all=True))  # 8 experts x 21 rows: many tiles each
    _assert_parity(ew, *_routing(rng, 21, 8, same_for_all=True), row_kernel="gemv")


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_repeated_ids_within_a_row(qtype, n):
    """Residency routes host-computed pairs along a used expert, so one row may repeat an id and a
    bucket may hold more than N rows (up to N*k): it still needs every row computed (a regression:
    a one-tile shortcut for N <= largest tile dropped the rows past the tile)."""
    rng = np.random.default_rng(5 + n)
    u, sel, w = _routing(rng, n, 8)
    sel = np.asarray(sel).copy()
    sel[:, 3:] = sel[:, :1]  # ranks 3..7 repeat rank 0's expert: a bucket of 6n rows
    sel = jnp.asarray(sel)
    a = np.asarray(dp.routed_experts(u, sel, w, _experts(qtype), "per_token"))
    b = np.asarray(dp.routed_experts(u, sel, w, _experts(qtype), "grouped"))
    assert not np.isnan(b).any()
    assert_bitwise_equal(b, a)


@pytest.mark.parametrize("qtype", QTYPES)
def test_unused_experts(qtype):
    rng = np.random.default_rng(4)
    _assert_parity(_experts(qtype), *_routing(rng, 32, 5, experts=[0, 3, 6, 9, 15]))  # 11 experts unused
    _assert_parity(_experts(qtype), *_routing(rng, 7, 2, experts=[14, 15]))


@pytest.mark.parametrize("row_tile", [2, 3, 16])
def test_any_row_tile_gives_the_same_bits(row_tile):
    rng = np.random.default_rng(5)
    _assert_parity(_experts("f32"), *_routing(rng, 31, 7), row_tile=row_tile)


def test_rows_do_not_depend_on_the_batch():
    """Row i of a batch equals routing row i alone (what batched verify == sequential decode needs)."""
    rng = np.random.default_rng(6)
    ew = _experts("q4_k")
    u, sel, w = _routing(rng, 9, 8)
    for mode in ("per_token", "grouped"):
        full = np.asarray(dp.routed_experts(u, sel, w, ew, mode))
        for i in (0, 4, 8):
            alone = np.asarray(dp.routed_experts(u[i:i + 1], sel[i:i + 1], w[i:i + 1], ew, mode))
            assert_bitwise_equal(alone[0], full[i])


@pytest.mark.parametrize("qtype", ["q8_0", "q4_k"])
def test_gguf_and_soa_layouts_give_the_same_bits(qtype):
    """"reference" holds the experts as GGUF blocks, "xla" as SoA fields: same bytes, same bits."""
    rng = np.random.default_rng(7)
    u, sel, w = _routing(rng, 6, 4)
    soa_experts, raw_experts = _experts(qtype, "xla"), _experts(qtype, "reference")
    assert {m.layout for m in soa_experts} == {"soa"} and {m.layout for m in raw_experts} == {"blocks"}
    soa = _assert_parity(soa_experts, u, sel, w)
    raw = _assert_parity(raw_experts, u, sel, w)
    assert_bitwise_equal(raw, soa)
    assert_bitwise_equal(qb.soa_to_raw(soa_experts[0].data, qtype), raw_experts[0].data["raw"])
    assert_bitwise_equal(np.asarray(raw_experts[0].data["raw"]), _raw(qtype)[0])


def _silu(x):
    return x / (1.0 + np.exp(-x))


@pytest.mark.parametrize("qtype", QTYPES)
def test_matches_float64_numpy_oracle(qtype):
    """Independent truth: gguf.quants dequantization and float64 numpy, one token at a time."""
    rng = np.random.default_rng(8)
    u, sel, w = _routing(rng, 5, 8)

    def dq(a):
        return gq.dequantize(np.asarray(a), gguf.GGMLQuantizationType[qtype.upper()]).astype(np.float64)

    wg, wu, wd = (dq(a) for a in _raw(qtype))
    un, seln, wn = np.asarray(u, np.float64), np.asarray(sel), np.asarray(w, np.float64)
    want = np.zeros((5, D))
    for i in range(5):
        for j in range(8):
            e = seln[i, j]
            want[i] += wn[i, j] * (wd[e] @ (_silu(wg[e] @ un[i]) * (wu[e] @ un[i])))
    got = np.asarray(dp.routed_experts(u, sel, w, _experts(qtype), "grouped"))
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


def test_pallas_backend_interpret():
    """Experts laid out for "pallas" (the kernel layout, once) run its grouped op (interpret mode): it
    agrees numerically and is batch-invariant bit for bit."""
    rng = np.random.default_rng(9)
    ew = _experts("q4_k")
    packed = _experts("q4_k", "pallas")
    assert {(m.layout, m.backend) for m in packed} == {("kernel", "pallas")}
    u, sel, w = _routing(rng, 5, 2)
    run = functools.partial(dp.routed_experts, mode="grouped", interpret=True, block_m=8, block_n=128)
    got, stats = run(u, sel, w, packed, with_stats=True)
    got = np.asarray(got)
    assert not np.isnan(got).any()
    n_unique = len(np.unique(np.asarray(sel)))
    assert int(stats["expert_loads"]) == n_unique  # every bucket fits one tile
    # Bytes in the kernel layout: Q4_K with its 6-bit scales unpacked, 148 bytes per 256 weights (qs 128,
    # d 2, dmin 2, sc 8, mn 8) instead of the GGUF block's 144.
    assert dp.read_bytes(stats) == n_unique * 3 * (F * D // 256) * 148
    ref = np.asarray(dp.routed_experts(u, sel, w, ew, "per_token"))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    alone = np.asarray(run(u[3:4], sel[3:4], w[3:4], packed))
    assert_bitwise_equal(alone[0], got[3])


# ----------------------------------------------------------------------------- bucketing & counters


def test_bucket_matches_numpy():
    rng = np.random.default_rng(10)
    for n, k, skew in ((1, 1, False), (9, 4, False), (40, 8, False), (33, 3, True)):
        sel = _routing(rng, n, k, same_for_all=skew)[1]
        b = jax.jit(dp.bucket, static_argnums=1)(sel, E)
        flat = np.asarray(sel).reshape(-1)
        order = np.argsort(flat, kind="stable")
        counts = np.bincount(flat, minlength=E)
        np.testing.assert_array_equal(np.asarray(b.order), order)
        np.testing.assert_array_equal(np.asarray(b.token), order // k)
        np.testing.assert_array_equal(np.asarray(b.counts), counts)
        np.testing.assert_array_equal(np.asarray(b.starts), np.cumsum(counts) - counts)
        used = np.flatnonzero(counts)
        assert int(b.n_used) == used.size
        np.testing.assert_array_equal(np.asarray(b.used)[:used.size], used)
        np.testing.assert_array_equal(order[np.asarray(b.inv_order)], np.arange(n * k))


def test_dispatch_stats_and_counts():
    sel = np.array([[3, 1], [3, 2], [1, 3]], np.int32)
    s = dp.dispatch_stats(sel, 8, bytes_per_expert=1000)
    assert (s["tokens"], s["top_k"], s["pairs"], s["unique_experts"]) == (3, 2, 6, 3)
    np.testing.assert_array_equal(s["rows_per_expert"], [0, 2, 1, 3, 0, 0, 0, 0])
    assert s["max_rows_per_expert"] == 3
    assert s["bytes_per_token"] == 6000 and s["bytes_grouped"] == 3000 and s["read_ratio"] == 2.0
    unique, counts = jax.jit(dp.dispatch_counts, static_argnums=1)(jnp.asarray(sel), 8)
    assert int(unique) == 3
    np.testing.assert_array_equal(np.asarray(counts), s["rows_per_expert"])


def test_bytes_per_expert_is_the_storage_size():
    """GGUF blocks and SoA fields hold exactly the file's bytes (gguf-py's block table)."""
    for qtype in QTYPES:
        for kernels in ("reference", "xla"):
            ew = _experts(qtype, kernels)
            assert _gguf_bytes_per_expert(ew) * E == sum(m.nbytes for m in ew) == sum(m.gguf_nbytes for m in ew)


def test_bytes_counter_is_exact_past_2_gib():
    """2800 per-token reads of a 768 KiB f32 expert read 2.05 GiB: past what one int32 of bytes holds."""
    rng = np.random.default_rng(15)
    ew = _experts("f32")
    u, sel, w = _routing(rng, 350, 8)
    _, stats = dp.routed_experts(u, sel, w, ew, "per_token", with_stats=True)
    want = 350 * 8 * _gguf_bytes_per_expert(ew)
    assert want > 2**31 and int(stats["expert_loads"]) == 350 * 8
    assert dp.read_bytes(stats) == want


def test_bad_inputs_raise():
    """Every bad argument raises InputError (a SharpiError and a ValueError) naming the problem."""
    ew = _experts("f32")
    u, sel, w = _routing(np.random.default_rng(11), 2, 2)
    cases = [
        (dict(mode="dense"), "mode must be one of"),
        (dict(mode="grouped", row_kernel="fma"), "row_kernel must be one of"),
        (dict(mode="grouped", row_tile=1), "row_tile >= 2"),
        (dict(u=u[:1]), r"shapes: u \(1, 256\)"),
        (dict(w=w[:, :1]), r"shapes: .* w \(2, 1\)"),
        (dict(sel=sel.reshape(-1)), r"sel must be \[N, k\]"),
        (dict(u=u[:, :128]), "u has width 128, experts have d_model 256"),
        (dict(experts=(ew[0], ew[1], dataclasses.replace(ew[2], shape=(16, 256, 128)))), r"expert down: shape"),
        (dict(experts={"gate": ew[0]}), r"experts must be \(gate, up, down\) QTensor stacks, got dict"),
        (dict(experts=ew[:2]), r"experts must be \(gate, up, down\) QTensor stacks, got tuple"),
        (dict(experts=(ew[0], ew[1], _experts("f32", "pallas")[2])), "one kernel backend"),
        (dict(mode="pallas"), "mode must be one of"),
    ]
    for kw, msg in cases:
        args = dict(u=u, sel=sel, w=w, experts=ew) | kw
        with pytest.raises(InputError, match=msg):
            dp.routed_experts(args["u"], args["sel"], args["w"], args["experts"], kw.get("mode", "grouped"),
                              **{k: v for k, v in kw.items() if k in ("row_kernel", "row_tile")})
    pal = _experts("f32", "pallas")
    with pytest.raises(InputError, match="u has width 128"):  # checked before the kernel runs
        dp.routed_experts(u[:, :128], sel, w, pal, interpret=True)
    q5 = tuple(np.zeros(s, np.uint8) for s in ((E, F, D // 32 * 22), (E, F, D // 32 * 22), (E, D, F // 32 * 22)))
    with pytest.raises(UnsupportedQuantError, match="Q5_0 has no 'kernel' layout"):  # forced onto the kernel
        expert_stacks(q5, int(Q.Q5_0), MatrixFormat("pallas", None), backend="pallas")
    assert {m.kernels for m in expert_stacks(q5, int(Q.Q5_0), MatrixFormat("pallas", None))} == {"reference"}
    for kw in (dict(mode="nope"), dict(row_kernel="fma")):
        with pytest.raises(InputError, match="must be one of"):
            dp.DispatchConfig(**kw)
    assert issubclass(InputError, SharpiError) and issubclass(UnsupportedQuantError, SharpiError)


# ----------------------------------------------------------------------------- full grid (slow)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", QTYPES)
def test_full_grid_n_1_to_64_k_1_to_8(qtype):
    rng = np.random.default_rng(12)
    for n in range(1, 65):
        for k in range(1, 9):
            _assert_parity(_experts(qtype), *_routing(rng, n, k))
        jax.clear_caches()  # 1024 executables otherwise stay alive (~80 MB per N)


def test_dispatch_config_is_the_same_call():
    rng = np.random.default_rng(13)
    ew = _experts("q8_0")
    u, sel, w = _routing(rng, 6, 3)
    cfg = dp.DispatchConfig(mode="grouped", row_kernel="gemm", row_tile=4)
    assert_bitwise_equal(cfg(u, sel, w, ew), dp.routed_experts(u, sel, w, ew, "per_token"))
    assert hash(cfg) == hash(dp.DispatchConfig(mode="grouped", row_kernel="gemm", row_tile=4))
    assert dp.row_tiles(1) == (2,) and dp.row_tiles(5) == (2, 4, 8) and dp.row_tiles(64) == (2, 4, 8, 16)


def test_mixed_qtypes_with_a_q6_k_down():
    """A Q4_K_M-style layer: Q4_K gate/up, Q6_K down (dequantized by sharpi_jax.gguf.quants)."""
    rng = np.random.default_rng(14)
    gate, up, _ = _raw("q4_k")
    down = rng.integers(0, 256, size=(E, D, F // 256, 210), dtype=np.uint8)
    down[..., 208:210] = (rng.uniform(0.5, 1.5, (E, D, F // 256, 1)) * 2.0**-10).astype(np.float16).view(np.uint8)
    down = down.reshape(E, D, F // 256 * 210)
    qtypes = (int(Q.Q4_K), int(Q.Q4_K), int(Q.Q6_K))
    ew = expert_stacks((gate, up, down), qtypes, MatrixFormat("xla", None))
    assert [m.layout for m in ew] == ["soa", "soa", "blocks"]
    u, sel, w = _routing(rng, 9, 8)
    got = _assert_parity(ew, u, sel, w)
    dense = [gq.dequantize(a, Q(q)).astype(np.float32) for a, q in zip((gate, up, down), qtypes)]
    f32 = expert_stacks(tuple(d.view(np.uint8).reshape(*d.shape[:-1], -1) for d in dense), int(Q.F32))
    ref = np.asarray(dp.routed_experts(u, sel, w, f32, "grouped"))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    # The Pallas kernels take the same layer (Q6_K down in-kernel, interpret mode): their K order (32-column
    # steps) differs from XLA's, so the same bound.
    pal_ew = expert_stacks((gate, up, down), qtypes, MatrixFormat("pallas", None))
    assert {m.kernels for m in pal_ew} == {"pallas"} and [m.layout for m in pal_ew] == ["kernel"] * 3
    pal = np.asarray(dp.routed_experts(u, sel, w, pal_ew, interpret=True))
    np.testing.assert_allclose(pal, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
