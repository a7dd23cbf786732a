"""The native GDN step (csrc/gdn.h, `RunConfig.gdn_step`): against a float64 delta rule, its verify form (all
of a pass's rows in one call) bitwise equal to its decode form (chains, trees, a slot read in place), under
vmap, and the XLA step it replaces still bitwise batched == sequential where it runs (GPU, training, gdn_step="xla")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharpi_jax.errors import InputError
from sharpi_jax.model import gdn_native
from sharpi_jax.runtime.state import gdn_caches
from tests.bitwise import assert_bitwise_equal
from tests.conftest import fixture_engine, load_references

pytestmark = pytest.mark.skipif(not gdn_native.supported(8), reason="the native GDN step needs AVX2 / FMA")

MAX_CONTEXT = 512


def _inputs(rng, T, H, dv, dk):
    """T tokens' (q, k, v, beta, g) as the layer makes them: q, k L2-normed, beta in (0, 1), g < 0."""
    unit = lambda a: (a / np.linalg.norm(a, axis=-1, keepdims=True)).astype(np.float32)  # noqa: E731
    return (unit(rng.standard_normal((T, H, dk))), unit(rng.standard_normal((T, H, dk))),
            rng.standard_normal((T, H, dv)).astype(np.float32), rng.random((T, H)).astype(np.float32),
            (-2.0 * rng.random((T, H))).astype(np.float32))


def _reference(S, q, k, v, beta, g, scale):
    """The gated delta rule in float64 (decay first): per token, S' = e^g S, S += (beta (v - S' k)) k^T,
    o = scale S q; S [H, dv, dk]."""
    S = S.astype(np.float64)
    outs = []
    for t in range(q.shape[0]):
        S = S * np.exp(g[t].astype(np.float64))[:, None, None]
        d = beta[t][:, None] * (v[t] - np.einsum("hvk,hk->hv", S, k[t]))
        S = S + d[:, :, None] * k[t][:, None, :]
        outs.append(scale * np.einsum("hvk,hk->hv", S, q[t]))
    return S, np.stack(outs)


def _steps(S, xs, scale):
    """Sequential native decode steps: (states after each token, outputs)."""
    step = jax.jit(lambda S, q, k, v, b, g: gdn_native.step(S, q, k, v, b, g, scale))
    states, outs = [], []
    for t in range(xs[0].shape[0]):
        S, o = step(S, *(a[t] for a in xs))
        states.append(np.asarray(S))
        outs.append(np.asarray(o))
    return np.stack(states), np.stack(outs)


@pytest.mark.parametrize("H,dv,dk", [(4, 16, 8), (3, 128, 128)])
def test_native_step_matches_a_float64_delta_rule(H, dv, dk):
    """Six native steps from a random state: states and outputs within 2e-6 of the float64 rule, relative
    to the largest magnitude (float32 rounding of ~2 dk-term dot products a token)."""
    rng = np.random.default_rng(dk)
    S0 = (0.3 * rng.standard_normal((H, dv, dk))).astype(np.float32)
    xs = _inputs(rng, 6, H, dv, dk)
    scale = 1.0 / np.sqrt(dk)
    states, outs = _steps(jnp.asarray(S0), xs, scale)
    S_ref, o_ref = _reference(S0, *xs, scale)
    assert np.abs(states[-1] - S_ref).max() <= 2e-6 * np.abs(S_ref).max()
    assert np.abs(outs - o_ref).max() <= 2e-6 * np.abs(o_ref).max()
    assert not np.array_equal(states[0], S0)  # the step changed the state


def _path(parent, t):
    """Row t's root path: the rows whose tokens lead to it, first to last."""
    path = [t]
    while parent[path[-1]] >= 0:
        path.append(parent[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("H,dv,dk", [(4, 16, 32), (32, 128, 128)])
def test_verify_rows_equal_decode_steps_bitwise(H, dv, dk):
    """A verify pass's rows in one call (a chain and a tree: row t from row parent[t]'s state, -1 from the given
    state) == native decode steps along each row's root path, bit for bit, states and outputs; rows >= n
    leave their slots as they were and output zeros. At the 35B shapes (32 heads of 128 x 128) the heads are
    split between threads."""
    T = 5
    rng = np.random.default_rng(1)
    S0 = jnp.asarray((0.3 * rng.standard_normal((H, dv, dk))).astype(np.float32))
    xs = _inputs(rng, T, H, dv, dk)
    scale = 1.0 / np.sqrt(dk)
    rows = jax.jit(lambda st, sn, par, init, n, *a: gdn_native.rows(st, sn, par, init, n, *a, scale))
    for parent, n in (([-1, 0, 1, 2, 3], 5), ([-1, 0, 0, 1, 2], 5), ([-1, 0, 1, 2, 3], 3)):
        before = np.full((T, H, dv, dk), np.nan, np.float32)
        snaps, o = rows(S0, jnp.asarray(before), np.array(parent, np.int32), -1, n, *xs)
        snaps, o = np.asarray(snaps), np.asarray(o)
        for t in range(n):
            path = _path(parent, t)
            states, outs = _steps(S0, [a[path] for a in xs], scale)
            assert_bitwise_equal((snaps[t], o[t]), (states[-1], outs[-1]), f"parent {parent} row {t}")
        assert_bitwise_equal(snaps[n:], before[n:])
        assert not o[n:].any()


def test_verify_rows_read_their_starting_slot_in_place():
    """A pass that starts from one of its own slots (the previous pass's accepted row, read in place) reads
    each of its state rows before any row overwrites it: a 3-row chain from slot 2, whose row 2 writes slot
    2, equals decode steps from that slot's state."""
    H, dv, dk, T = 4, 16, 32, 3
    rng = np.random.default_rng(3)
    S0 = jnp.asarray((0.3 * rng.standard_normal((H, dv, dk))).astype(np.float32))
    xs = _inputs(rng, T, H, dv, dk)
    scale = 1.0 / np.sqrt(dk)
    before = (0.5 * rng.standard_normal((T, H, dv, dk))).astype(np.float32)
    snaps, o = jax.jit(lambda *a: gdn_native.rows(*a, scale))(S0, jnp.asarray(before), np.array([-1, 0, 1], np.int32),
                                                              2, T, *xs)
    states, outs = _steps(jnp.asarray(before[2]), list(xs), scale)
    assert_bitwise_equal((np.asarray(snaps), np.asarray(o)), (states, outs))


def test_native_step_under_vmap_is_each_alone():
    """A batch of sequences (jax.vmap, as batched generation runs the step): each row's state and output
    are its own step's bits."""
    B, H, dv, dk = 3, 2, 16, 16
    rng = np.random.default_rng(2)
    S = jnp.asarray((0.3 * rng.standard_normal((B, H, dv, dk))).astype(np.float32))
    xs = [a[0] for a in _inputs(rng, 1, B * H, dv, dk)]
    xs = [a.reshape(B, H, *a.shape[1:]) for a in xs]
    got_S, got_o = jax.jit(jax.vmap(lambda *a: gdn_native.step(*a, 0.25)))(S, *xs)
    for b in range(B):
        want_S, want_o = _steps(S[b], [a[b][None] for a in xs], 0.25)
        assert_bitwise_equal((np.asarray(got_S[b]), np.asarray(got_o[b])), (want_S[0], want_o[0]))


def test_gdn_step_option_is_checked():
    """gdn_step takes auto / native / xla; "native" where the step cannot run is a one-line error."""
    import sharpi_jax as sj

    with pytest.raises(InputError, match="gdn_step must be one of"):
        sj.RunConfig(gdn_step="fast")
    assert gdn_native.uses_native("auto", 32) and not gdn_native.uses_native("xla", 32)
    with pytest.raises(InputError, match="gdn_step='native' cannot run here"):
        gdn_native.uses_native("native", 12)  # dk not a multiple of 8


def _engine(gdn_step):
    return fixture_engine("tiny-qwen35moe", "F32", MAX_CONTEXT, gdn_step=gdn_step)


def test_native_and_xla_steps_compute_the_same_model():
    """The default engine runs the native step, gdn_step="xla" the XLA one: eight decode steps' logits agree
    within 1e-5 relative L2 (float rounding; the fixture bars are 3e-3), and differ in bits (two orders)."""
    from sharpi_jax.model.gated_delta_net import GatedDeltaNet
    from flax import nnx

    ref = load_references("tiny-qwen35moe")
    prompt = ref["variants"]["tiny-qwen35moe-F32"]["tokens"][0]
    logits = {}
    for step in ("auto", "xla"):
        e = _engine(step)
        mixers = [m for _, m in nnx.iter_graph(e.model) if isinstance(m, GatedDeltaNet)]
        assert mixers and all(m.native == (step == "auto") for m in mixers)
        rt = e.runtime
        _, lg, state = rt.prefill(rt.new_state(), prompt)
        rows = []
        for j, t in enumerate(ref["transformers"]["greedy"][0][:8]):
            lg, _, state = rt.decode_step(state, t, len(prompt) + j)
            rows.append(np.asarray(lg))
        logits[step] = np.stack(rows)
    a, b = logits["auto"], logits["xla"]
    assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b)
    assert not np.array_equal(a, b)


def test_xla_step_verify_is_bitwise_sequential_decode():
    """gdn_step="xla" (the GPU's and training's step) keeps the verify design: a 4-row chain pass == four
    decode steps bit for bit (logits, hidden, GDN snapshots, KV), as the native default does."""
    from tests.runtime.test_steps import _check_verify_parity

    ref = load_references("tiny-qwen35moe")
    prompt = ref["variants"]["tiny-qwen35moe-F32"]["tokens"][0]
    _check_verify_parity(_engine("xla"), prompt, ref["transformers"]["greedy"][0][:4])


def test_xla_step_tree_nodes_are_bitwise_decode_along_their_paths():
    """gdn_step="xla": a tree pass (parents -1, 0, 0, 1, 2) == decode steps along each node's root path:
    logits and GDN snapshots, bit for bit."""
    e = _engine("xla")
    rt = e.runtime
    ref = load_references("tiny-qwen35moe")
    prompt = ref["variants"]["tiny-qwen35moe-F32"]["tokens"][1]
    _, _, state = rt.prefill(rt.new_state(), prompt)
    parent = [-1, 0, 0, 1, 2]
    tokens = np.array([3, 17, 29, 41, 53], np.int32)
    out = rt.tree_commit_verify(jax.tree.map(jnp.copy, state), None, 0, 0, None, 0, jnp.asarray(tokens), len(prompt),
                                len(parent), np.array(parent, np.int32))
    logits, snaps = np.asarray(out.logits), gdn_caches(out.snaps)
    for node in range(len(parent)):
        s = jax.tree.map(jnp.copy, state)
        for d, j in enumerate(_path(parent, node)):
            lg, _, s = rt.decode_step(s, int(tokens[j]), len(prompt) + d)
        assert_bitwise_equal(np.asarray(lg), logits[node], f"node {node}")
        assert_bitwise_equal([np.asarray(g.ssm) for g in gdn_caches(s)], [np.asarray(g.ssm)[node] for g in snaps])
