"""The kernel-backend registry: a backend registered from outside the package is picked by name or by
"auto" on its platform, lays out the matrices it serves (its fallback the others), computes their
matmuls, and supplies the routed experts' computation: its own grouped op, or hooks composed by the
dispatch (default: its matmul)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import sharpi_jax as sj
from sharpi_jax import quant
from sharpi_jax.errors import InputError
from sharpi_jax.experts import dispatch as dp
from sharpi_jax.quant import MatrixFormat
from sharpi_jax.testing.experts import expert_stacks, random_expert_bytes
from sharpi_jax.testing.experts import quantize as quantize_rows
from tests.bitwise import assert_bitwise_equal

CPU_DEFAULT = "ggml" if quant.ggml.available() else "xla"  # kernels="auto" on CPU: ggml where it is built


class FakeBackend(quant.Backend):
    """Q8_0 and F32 in the "blocks" layout (the file's bytes), products by the exact reference; counts
    its calls (at trace time). Everything else falls back to "xla"."""

    name = "fake"
    platforms = ("fakeplat",)
    auto = 99
    fallback = "xla"

    def __init__(self, grouped: bool = False):
        self.calls = {"matmul": 0, "expert_rows": 0}
        if grouped:
            self.expert_rows = self._expert_rows

    def serves(self, qtype, shape):
        return Q(qtype) in (Q.Q8_0, Q.F32)

    def layout(self, qtype, shape, repack):
        return "blocks"

    def matmul(self, x, w, **options):
        self.calls["matmul"] += 1
        return quant.reference_matmul(x, w)

    def _expert_rows(self, u, sel, experts, opts, valid=None):
        """Y[i, j] = expert_{sel[i, j]}(u[i]) from the whole dequantized stacks (one read per pair)."""
        self.calls["expert_rows"] += 1
        g, up, d = (m.dequantize() for m in experts)
        x = u[:, None, :]
        h = jax.nn.silu(jnp.einsum("nkd,nkfd->nkf", x.repeat(sel.shape[1], 1), g[sel])) * \
            jnp.einsum("nkd,nkfd->nkf", x.repeat(sel.shape[1], 1), up[sel])
        return jnp.einsum("nkf,nkdf->nkd", h, d[sel]), jnp.int32(sel.size)


@pytest.fixture
def fake():
    b = quant.register(FakeBackend())
    yield b
    quant.unregister("fake")


def test_registration_and_resolution(fake):
    assert "fake" in quant.names() and "fake" in quant.kernel_names()
    assert quant.resolve_kernels("fake") == "fake" and quant.resolve_kernels("auto", "fakeplat") == "fake"
    assert quant.resolve_kernels("auto", "cpu") == CPU_DEFAULT  # ranked only on its own platform
    with pytest.raises(ValueError, match="already registered"):
        quant.register(FakeBackend())
    fmt = MatrixFormat("fake", None)
    assert (fmt.backend_for(int(Q.Q8_0), (64, 256)), fmt.layout(int(Q.Q8_0), (64, 256))) == ("fake", "blocks")
    assert (fmt.backend_for(int(Q.Q4_K), (64, 256)), fmt.layout(int(Q.Q4_K), (64, 256))) == ("xla", "soa")
    with pytest.raises(InputError, match="does not combine"):
        MatrixFormat("fake", "int8")


def test_an_unavailable_backend_names_why_and_auto_skips_it(fake, monkeypatch):
    monkeypatch.setattr(fake, "platforms", ("cpu",))
    assert quant.resolve_kernels("auto", "cpu") == "fake"  # ranked above xla on cpu
    monkeypatch.setattr(fake, "unavailable", lambda: "the native library did not load; reinstall with pip")
    assert quant.resolve_kernels("auto", "cpu") == CPU_DEFAULT
    with pytest.raises(InputError, match="kernels='fake' cannot run here: the native library did not load"):
        quant.resolve_kernels("fake")


def test_matmul_goes_through_the_registered_backend(fake):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 256), dtype=np.float32))
    raw = quantize_rows(rng.standard_normal((64, 256), dtype=np.float32), int(Q.Q8_0))
    w = MatrixFormat("fake", None).pack(raw, int(Q.Q8_0), (64, 256))
    assert (w.backend, w.layout) == ("fake", "blocks")
    got = quant.matmul(x, w)
    assert fake.calls["matmul"] == 1
    assert_bitwise_equal(got, quant.reference_matmul(x, w))


def test_experts_compose_from_the_backend_matmul(fake):
    """Without a grouped op, the dispatch composes the backend's hooks (default: its matmul, expert by
    expert): grouped == per-token bitwise, and equal to the exact reference within float32 rounding."""
    rng = np.random.default_rng(1)
    q8 = int(Q.Q8_0)
    raws = random_expert_bytes(rng, 8, 256, 256, q8)
    experts = expert_stacks(raws, q8, MatrixFormat("fake", None))
    assert {m.kernels for m in experts} == {"fake"}
    u = jnp.asarray(rng.standard_normal((5, 256), dtype=np.float32))
    sel = jnp.asarray(np.stack([rng.permutation(8)[:3] for _ in range(5)]), jnp.int32)
    w = jnp.full((5, 3), 1 / 3, jnp.float32)
    a = dp.routed_experts(u, sel, w, experts, "grouped")
    b = dp.routed_experts(u, sel, w, experts, "per_token")
    assert fake.calls["matmul"] > 0 and fake.calls["expert_rows"] == 0
    assert_bitwise_equal(a, b)
    ref = dp.routed_experts(u, sel, w, expert_stacks(raws, q8, MatrixFormat("reference", None)), "grouped")
    np.testing.assert_allclose(np.asarray(a), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))


def test_a_grouped_op_replaces_the_per_expert_matmuls():
    b = quant.register(FakeBackend(grouped=True))
    try:
        rng = np.random.default_rng(2)
        q8 = int(Q.Q8_0)
        raws = random_expert_bytes(rng, 8, 256, 256, q8)
        experts = expert_stacks(raws, q8, MatrixFormat("fake", None))
        u = jnp.asarray(rng.standard_normal((4, 256), dtype=np.float32))
        sel = jnp.asarray(np.stack([rng.permutation(8)[:2] for _ in range(4)]), jnp.int32)
        w = jnp.full((4, 2), 0.5, jnp.float32)
        got, stats = dp.routed_experts(u, sel, w, experts, "grouped", with_stats=True)
        assert b.calls == {"matmul": 0, "expert_rows": 1}
        assert int(stats["expert_loads"]) == 8  # what the op reported
        assert dp.read_bytes(stats) == 8 * sum(m.gguf_nbytes for m in experts) // 8
        ref = dp.routed_experts(u, sel, w, expert_stacks(raws, q8, MatrixFormat("reference", None)), "grouped")
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))
    finally:
        quant.unregister("fake")


def test_load_with_a_registered_backend(fake):
    """sj.load(kernels=<a registered name>) lays out every matrix and expert stack of the default model
    (Q8_0 and F32) for it, and its logits are the reference's."""
    e = sj.load(max_context=32, prefill_buckets=(32,), kernels="fake")
    held = [q for path, q in _qtensors(e.model) if path[0] != "embed"]
    assert held and {(q.backend, q.layout) for q in held} == {("fake", "blocks")}
    assert any(q.shape[0] == e.config.n_expert and len(q.shape) == 3 for q in held)  # the expert stacks
    ids = e.tokenizer.encode("def fib(n):")
    a = e.logits(ids)
    assert fake.calls["matmul"] > 0
    r = sj.load(max_context=32, prefill_buckets=(32,), kernels="reference").logits(ids)
    assert float(np.linalg.norm(a - r) / np.linalg.norm(r)) <= 1e-6


def _qtensors(model):
    from flax import nnx

    for path, var in nnx.to_flat_state(nnx.state(model)):
        value = var.get_value() if hasattr(var, "get_value") else var
        for q in value if isinstance(value, tuple) else (value,):
            if isinstance(q, quant.QTensor):
                yield tuple(path), q
