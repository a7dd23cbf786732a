"""Runtime steps: verify-vs-decode bit parity (the MTP verify design), rollback, determinism."""

from __future__ import annotations


import jax
import numpy as np
import pytest

from sharpi_jax.model.cache import AttnCache, GDNCache
from sharpi_jax.runtime.state import attention_caches, gdn_caches, state_bytes, with_gdn
from tests.bitwise import assert_bitwise_equal
from tests.conftest import fixture_engine, load_references

MAX_CONTEXT = 512


def engine(name: str, variant: str):
    return fixture_engine(name, variant, MAX_CONTEXT)


references = load_references


def _prefilled(e, prompt):
    rt = e.runtime
    _, logits, state = rt.prefill(rt.new_state(), prompt)
    return logits, state


def _sequential(e, state, tokens, pos):
    """len(tokens) single-token decode steps; per-row logits, hidden and GDN state after each row."""
    rows = []
    for j, t in enumerate(tokens):
        logits, hidden, state = e.runtime.decode_step(state, t, pos + j)
        # Copy to host: the next step donates (deletes) this state's buffers.
        rows.append(jax.tree.map(np.asarray, (logits, hidden, gdn_caches(state))))
    return rows, state


def _check_verify_parity(e, prompt, tokens):
    T = len(tokens)
    pos = len(prompt)
    _, state = _prefilled(e, prompt)
    rows, seq_state = _sequential(e, state, tokens, pos)
    _, state = _prefilled(e, prompt)
    logits, hidden, ver_state, snaps = e.runtime.verify_step(state, tokens, pos)
    assert_bitwise_equal(logits, np.stack([r[0] for r in rows]))
    assert_bitwise_equal(hidden, np.stack([r[1] for r in rows]))
    for j in range(T):  # GDN snapshot j == the state after j+1 single steps
        assert_bitwise_equal([GDNCache(s.conv[j], s.ssm[j]) for s in gdn_caches(snaps)], rows[j][2])
    assert_bitwise_equal(attention_caches(ver_state), attention_caches(seq_state))
    committed = e.runtime.commit(ver_state, snaps, T - 1)
    assert_bitwise_equal(committed, seq_state)


@pytest.mark.parametrize("T", range(2, 9))
def test_verify_is_bitwise_sequential_decode(T):
    """A T-row verify step == T single-token decode steps, bit for bit: logits, final-normed hidden,
    per-row GDN conv/SSM snapshots and the KV cache."""
    name = "tiny-qwen35moe"
    ref = references(name)
    prompt = ref["variants"][f"{name}-F32"]["tokens"][0]
    tokens = ref["transformers"]["greedy"][0][:T]
    _check_verify_parity(engine(name, "F32"), prompt, tokens)


def test_verify_parity_across_attention_chunks():
    """Rows straddling an attention chunk boundary (positions 254..259 with 256-slot chunks): the verify
    pass visits two chunks for every row, the single steps one or two; still bit for bit."""
    from sharpi_jax.model.attention import chunk_size
    name = "tiny-qwen35moe"
    assert chunk_size(MAX_CONTEXT) == 256
    ref = references(name)
    base = ref["variants"][f"{name}-F32"]["tokens"][0]
    prompt = (list(base) * (254 // len(base) + 1))[:254]
    _check_verify_parity(engine(name, "F32"), prompt, ref["transformers"]["greedy"][0][:6])


@pytest.mark.parametrize("T", [3])
def test_verify_is_bitwise_sequential_decode_xla(T):
    """The same parity with kernels="xla", whose M = 1 products differ from M >= 2: decode must run its
    single row through the row-stable 2-row bucket (ggml, the CPU default, is row-stable at any M)."""
    name = "tiny-qwen35moe"
    ref = references(name)
    prompt = ref["variants"][f"{name}-F32"]["tokens"][0]
    tokens = ref["transformers"]["greedy"][0][:T]
    _check_verify_parity(fixture_engine(name, "F32", MAX_CONTEXT, kernels="xla"), prompt, tokens)


@pytest.mark.parametrize("name,variant,T", [("tiny-qwen35moe", "Q4_K_M", 3), ("tiny-qwen3next", "F32", 4)])
def test_verify_parity_other_models(name, variant, T):
    """Same parity with mixed quant types dequantized in the step, and the grouped GDN layout."""
    ref = references(name)
    prompt = ref["variants"][f"{name}-{variant}"]["tokens"][1]
    rng = np.random.default_rng(T)
    tokens = [int(t) for t in rng.integers(0, engine(name, variant).config.n_vocab, T)]
    _check_verify_parity(engine(name, variant), prompt, tokens)


def test_rollback_by_snapshot():
    """Verify 4 drafts, accept 1 (commit snapshot 1, length P+2), continue: the same bits as decoding
    the 2 accepted tokens and the next one sequentially. Stale KV rows past the length stay masked."""
    name = "tiny-qwen35moe"
    e = engine(name, "F32")
    ref = references(name)
    prompt = ref["variants"][f"{name}-F32"]["tokens"][2]
    pos = len(prompt)
    drafts = [11, 22, 33, 44]
    nxt = 55
    _, state = _prefilled(e, prompt)
    _, _, state, snaps = e.runtime.verify_step(state, drafts, pos)
    state = e.runtime.commit(state, snaps, 1)
    got = e.runtime.decode_step(state, nxt, pos + 2)
    _, state = _prefilled(e, prompt)
    _, state = _sequential(e, state, drafts[:2], pos)
    want = e.runtime.decode_step(state, nxt, pos + 2)
    assert_bitwise_equal(got[:2], want[:2])
    assert_bitwise_equal(gdn_caches(got[2]), gdn_caches(want[2]))


def test_decode_continues_prefill():
    """Prefill T-1 tokens then decode the last one ~= teacher-forced logits at T-1 (chunked vs recurrent)."""
    name = "tiny-qwen35"
    e = engine(name, "F32")
    prompt = references(name)["variants"][f"{name}-F32"]["tokens"][2]
    full = e.logits(prompt)
    _, state = _prefilled(e, prompt[:-1])
    logits, hidden, _ = e.runtime.decode_step(state, prompt[-1], len(prompt) - 1)
    logits = np.asarray(logits)
    assert np.linalg.norm(logits - full[-1]) / np.linalg.norm(full[-1]) <= 1e-5
    assert hidden.shape == (e.config.d_model,)


def test_determinism():
    """Two runs give bitwise-identical logits and tokens (greedy and seeded sampling)."""
    name = "tiny-qwen35moe"
    e = engine(name, "F32")
    prompt = references(name)["variants"][f"{name}-F32"]["tokens"][2]
    assert_bitwise_equal(e.logits(prompt), e.logits(prompt))
    for kw in ({}, {"temperature": 0.9, "top_k": 50, "top_p": 0.95, "min_p": 0.02, "seed": 7}):
        a = e.generate(prompt, max_new_tokens=16, stop_on_eos=False, **kw)
        b = e.generate(prompt, max_new_tokens=16, stop_on_eos=False, **kw)
        assert a.tokens == b.tokens and len(a.tokens) == 16
    c = e.generate(prompt, max_new_tokens=16, stop_on_eos=False, temperature=0.9, seed=8)
    d = e.generate(prompt, max_new_tokens=16, stop_on_eos=False, temperature=0.9, seed=9)
    assert c.tokens != d.tokens  # different seeds draw differently (overwhelmingly likely at T=0.9)


def test_state_layout():
    name = "tiny-qwen35moe"
    e = engine(name, "F32")
    c = e.config
    s = e.runtime.new_state()
    assert len(s) == c.n_layer  # one cache per trunk layer, in trunk order
    assert all(isinstance(s[i], GDNCache if c.is_recurrent(i) else AttnCache) for i in range(c.n_layer))
    a, g = attention_caches(s)[0], gdn_caches(s)[0]
    assert a.k.shape == a.v.shape == (c.n_head_kv, MAX_CONTEXT, c.head_dim)
    assert g.conv.shape == (c.ssm_conv_kernel - 1, c.conv_dim)
    assert g.ssm.shape == (c.ssm_dt_rank, c.ssm_d_inner // c.ssm_dt_rank, c.ssm_d_state)
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(s))
    assert state_bytes(c, MAX_CONTEXT) == sum(x.nbytes for x in jax.tree.leaves(s))


def _nan_snaps_but(snaps, index):
    """Snapshots of the same shapes, all NaN except row `index` (the one a commit reads)."""
    def fill(a):
        out = np.full(a.shape, np.nan, a.dtype)
        out[index] = np.asarray(a)[index]
        return jax.numpy.asarray(out)
    return tuple(None if s is None else GDNCache(fill(s.conv), fill(s.ssm)) for s in snaps)


@pytest.mark.parametrize("tree", [False, True])
def test_commit_verify_writes_into_the_donated_snapshots(tree):
    """The MTP loop's pass (commit + rows in one dispatch) writes its snapshots into the previous pass's
    donated buffers and starts row 0 from the committed snapshot in place: the same buffers come back
    (no fresh per-pass allocation), and what they held is never read: snapshot buffers of NaN (but the
    committed row) and a state whose GDN entries are NaN give the bits of a commit followed by a pass
    from zeroed buffers (with a padding row): rows, snapshots and KV rows."""
    name = "tiny-qwen35moe"
    e = engine(name, "F32")
    rt = e.runtime
    ref = references(name)
    prompt = ref["variants"][f"{name}-F32"]["tokens"][1]
    P, T, n_valid, index = len(prompt), 5, 4, 2
    first = np.array([5, 6, 7, 8, 9], np.int32)
    tokens = jax.numpy.asarray(np.array([11, 22, 33, 44, 55], np.int32))
    parent = np.array([-1, 0, 0, 1, 2], np.int32)

    def run(fused):
        _, state = _prefilled(e, prompt)
        _, _, state, snaps = rt.verify_step(state, first, P)
        P2 = P + index + 1
        if fused:
            snaps = _nan_snaps_but(snaps, index)
            nan = lambda a: jax.numpy.full(a.shape, np.nan, a.dtype)  # noqa: E731
            state = with_gdn(state, [GDNCache(nan(g.conv), nan(g.ssm)) for g in gdn_caches(state)])
            ptrs = [a.unsafe_buffer_pointer() for a in jax.tree.leaves((gdn_caches(state), snaps))]
            if tree:
                v = rt.tree_commit_verify(state, snaps, index, P, None, 0, tokens, P2, n_valid, parent)
            else:
                v = rt.commit_verify(state, snaps, index, tokens, P2, n_valid)
            out = [a.unsafe_buffer_pointer() for a in jax.tree.leaves((gdn_caches(v.state), v.snaps))]
            assert out == ptrs  # written in place: the state's and the snapshots' own buffers
            logits, hidden, state, snaps = v.logits, v.hidden, v.state, v.snaps
        else:
            state = rt.commit(state, snaps, index)
            if tree:
                v = rt.tree_commit_verify(state, None, 0, 0, None, 0, tokens, P2, n_valid, parent)
                logits, hidden, state, snaps = v.logits, v.hidden, v.state, v.snaps
            else:
                logits, hidden, state, snaps = rt.verify_step(state, tokens, P2, n_valid)
        rows = slice(0, n_valid)
        return jax.tree.map(lambda a: np.asarray(a)[rows], (logits, hidden, gdn_caches(snaps))), \
            jax.tree.map(np.asarray, attention_caches(state))

    (got_rows, got_kv), (want_rows, want_kv) = run(True), run(False)
    assert_bitwise_equal(got_rows, want_rows)
    assert_bitwise_equal(got_kv, want_kv)


@pytest.mark.parametrize("gdn_step", ["auto", "xla"])
@pytest.mark.parametrize("tree", [False, True])
def test_verify_pass_copies_no_gdn_state(tree, gdn_step):
    """The compiled MTP-loop pass makes no copy and no zero fill of a GDN state or snapshot array: the
    snapshots are written into the donated buffers, the loop carries no copy of the state (on the
    twin, such copies were a 69-133 MB temp buffer faulted in afresh on every pass), and the commit
    copies no snapshot into the state (its first row reads it in place: 20 ms a pass on the twin). Both
    GDN steps: the native one (all rows in one call) and XLA's (a loop over the rows). One exception, by
    design: a chain's conv loop on the native step carries the conv state ([Kc-1, C], 96 KB a layer on the
    35B shapes), read once from the committed snapshot (a dynamic index per row cost ~45 us a row and layer):
    exactly one such read per GDN layer, nothing else."""
    import re
    from sharpi_jax.runtime.state import repeat_as_snapshots
    from sharpi_jax.model.tree import tree_arrays

    rt = fixture_engine("tiny-qwen35moe", "F32", MAX_CONTEXT, gdn_step=gdn_step).runtime
    state, T = rt.new_state(), 5
    snaps = repeat_as_snapshots(state, T)
    tokens, i32 = jax.numpy.zeros(T, jax.numpy.int32), np.int32
    if tree:
        depth, parent, anc = tree_arrays(np.array([-1, 0, 0, 1, 2], np.int32), T, T)
        lowered = rt._fns.tree_commit_verify.lower(rt.params, rt.cache, state, snaps, i32(0), i32(3),
                                                   np.zeros(T, np.int32), i32(0), tokens, i32(3), i32(T),
                                                   depth, parent, anc)
    else:
        lowered = rt._fns.commit_verify.lower(rt.params, rt.cache, state, snaps, i32(0), tokens, i32(3), i32(T))
    text = lowered.compile().as_text()
    entry = text[text.index("\nENTRY"):]
    g = gdn_caches(snaps)[0]
    shapes = {"f32[" + ",".join(map(str, a.shape)) + "]" for a in (g.conv, g.ssm, g.conv[0], g.ssm[0])}
    made = [line.strip()[:120] for line in entry.splitlines()
            if (m := re.match(r"\s*(?:ROOT )?%\S+ = (f32\[[\d,]*\])\S* (copy|broadcast|fusion|dynamic-slice)\(", line))
            and m.group(1) in shapes]
    carried = [line for line in made if line.startswith("%dynamic-slice") and "__conv" in line
               and line.split(" = ")[1].startswith(f"f32[{','.join(map(str, g.conv[0].shape))}]")]
    if not tree and "sharpi_gdn_rows" in text:  # a chain on the native step
        assert len(carried) == len(gdn_caches(snaps)), carried
        made = [line for line in made if line not in carried]
    assert not made, made
