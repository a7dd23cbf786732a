"""The twin (experiments.twin) computes its source's function: teacher-forced logits and MTP-head logits
of the F32 twin against the source on held-out prompts (relative L2 per prompt, argmax, greedy tokens).

Fast: the embedded default model's twin at a small shape where every dimension grows (hidden, head
dims, heads, GDN heads and state, expert widths, vocabulary) and two no-op layers follow the trained
four, so every rescaling and index map is exercised. Slow: the 35B-A3B shapes.
"""

from __future__ import annotations

import numpy as np
import pytest

import sharpi_jax as sj
from experiments.presets import HELD_OUT_SOURCES, REPO_ROOT
from experiments.twin import pad_row_mass, quietest_token, twin_config, write_twin
from sharpi_jax.assets import default_model_path
from sharpi_jax.config import shape_preset
from sharpi_jax.errors import InputError
from sharpi_jax.gguf import GGUFFile, read_model_config

REL_L2 = 1e-3


def small_shape():
    """Every source dimension grown: hidden 128 -> 256, heads 4/2 of 32 -> 8/2 of 64, GDN 2/4 heads of
    32 -> 4/8 of 64, expert ff 64 -> 128, vocab 2048 -> 2560."""
    return shape_preset("tiny").replace(
        n_vocab=2560, d_model=256, n_head=8, n_head_kv=2, head_dim=64, ssm_d_state=64, ssm_n_group=4,
        ssm_dt_rank=8, ssm_d_inner=512, expert_ff=128, shared_expert_ff=128)


def held_out_prompts(n=3, chars=160):
    return [(REPO_ROOT / p).read_text()[200: 200 + chars] for p in HELD_OUT_SOURCES[:n]]


def rel_l2(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def greedy(engine, ids, n):
    """n greedy tokens by teacher-forced argmax (the function's greedy continuation)."""
    out = []
    for _ in range(n):
        out.append(int(engine.logits(ids + out)[-1].argmax()))
    return out


def compare(src, twin, prompts, pad_row, greedy_tokens=8, decode=False):
    """Per prompt: (logits rel L2, MTP logits rel L2) over the prompt and its greedy continuation; asserts
    equal greedy continuations (decode: also the twin's own decode loop), equal argmax (trunk and MTP
    head) at every position, and the extra vocabulary rows: far below every source logit in the trunk
    (no probability under sampling), ties with `pad_row` in the MTP head."""
    V = src.config.n_vocab
    figures, masses = [], []
    for p in prompts:
        ids = src.tokenizer.encode(p)
        assert twin.tokenizer.encode(p) == ids
        cont = greedy(src, ids, greedy_tokens)
        assert greedy(twin, ids, greedy_tokens) == cont
        if decode:
            assert twin.generate(ids, max_new_tokens=greedy_tokens).tokens == src.generate(
                ids, max_new_tokens=greedy_tokens).tokens
        seq = ids + cont
        ls, lt = src.logits(seq), twin.logits(seq)
        assert lt.shape[1] == twin.config.n_vocab
        assert (lt.argmax(-1) == ls.argmax(-1)).all()
        ms, mt = src.mtp_logits(seq), twin.mtp_logits(seq)
        assert (mt.argmax(-1) == ms.argmax(-1)).all()
        figures.append((rel_l2(lt[:, :V], ls), rel_l2(mt[:, :V], ms)))
        assert (lt[:, V:] < lt[:, :V].min(-1, keepdims=True) - 100).all()
        assert (mt[:, V:] == mt[:, [pad_row]]).all()
        masses.append(float(pad_row_mass(lt, V).max()))
    print("twin vs source (logits rel L2, MTP logits rel L2) per prompt:", figures,
          "; largest probability of the extra rows:", max(masses))
    for lg, mtp in figures:
        assert lg <= REL_L2 and mtp <= REL_L2
    assert max(masses) < 1e-30
    return figures


def load_pair(src_path, twin_path):
    """The source with exact dequantization (the XLA path's quantized products are approximate) and the
    F32 twin (None: not loaded)."""
    return (src_path and sj.load(src_path, max_context=512, kernels="reference", repack=None),
            twin_path and sj.load(twin_path, max_context=512, repack=None))


def test_small_twin_computes_the_source_function(tmp_path):
    src = sj.load(default_model_path(), max_context=512, kernels="reference", repack=None, prefill_buckets=(128,))
    pad_row = quietest_token(src)
    out = write_twin(default_model_path(), tmp_path / "twin.gguf", small_shape(), n_layer=6, qtype="F32",
                     pad_row=pad_row)
    with GGUFFile(out) as f:
        c = read_model_config(f)
        assert (c.d_model, c.n_layer, c.n_vocab, c.n_expert, c.n_expert_used) == (256, 6, 2560, 16, 4)
        assert len(f.metadata["tokenizer.ggml.tokens"]) == 2560
        assert not f.array("blk.5.ffn_down_shexp.weight").any()  # a no-op layer
    compare(src, sj.load(out, max_context=512, repack=None, prefill_buckets=(128,)), held_out_prompts(), pad_row,
            greedy_tokens=6)


def test_twin_refuses_shapes_smaller_than_the_source():
    src = shape_preset("tiny")
    with pytest.raises(InputError, match="d_model"):
        twin_config(src, small_shape().replace(d_model=64))
    with pytest.raises(InputError, match="n_layer"):
        twin_config(src, small_shape(), n_layer=2)


@pytest.mark.slow
def test_full_shape_twin_computes_the_source_function(tmp_path):
    """The 35B-A3B shapes (vocab 248,320) at the source's depth: ~9 GB of F32; with the decode loop."""
    src, _ = load_pair(default_model_path(), None)
    pad_row = quietest_token(src)
    out = write_twin(default_model_path(), tmp_path / "twin.gguf", shape_preset("qwen36-35b-a3b"),
                     n_layer=4, qtype="F32", pad_row=pad_row)
    compare(src, load_pair(None, out)[1], held_out_prompts(2), pad_row, greedy_tokens=4, decode=True)
