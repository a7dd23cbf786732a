"""Runtime steps: verify-vs-decode bit parity (the MTP verify design), rollback, determinism."""

from __future__ import annotations


import jax
import numpy as np
import pytest

from sharpi_jax.model.cache import AttnCache, GDNCache
from sharpi_jax.runtime.state import attention_caches, gdn_caches, state_bytes
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
