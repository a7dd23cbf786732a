"""Make a twin: a GGUF that computes a trained source model's function at the per-layer shapes of a larger
model preset, so that a step reads the larger model's bytes while its tokens are the source's.

    python -m experiments.twin --source=research --shape=qwen36-35b-a3b --qtype=Q8_0 --out=/work/twin/twin-Q8_0.gguf
    llama-quantize --allow-requantize /work/twin/twin-Q8_0.gguf /work/twin/twin-Q4_K_M.gguf Q4_K_M
    python -m experiments.twin --source=default --shape=tiny --n_layer=6 --out=/tmp/t.gguf   # small, F32

--source: a model preset name (`research`, `default`, ...) or a GGUF path of a qwen35moe model.
--shape: a MoE shape preset (sharpi_jax.config.SHAPE_PRESETS); the twin keeps the source's expert count
and top-k, its rope (dims, base, sections) and its context length, and takes every matrix shape from the
preset. Depth: the source's trained layers, then no-op layers up to --n_layer (default: the preset's),
then the source's MTP block.

Construction. Every source coordinate keeps its index (residual, head, channel, expert row) in the
twin; every other weight is zero, so the extra coordinates stay exactly zero and extra heads and expert
rows contribute exactly zero. What changes:
- RMSNorm means over more coordinates: with d_s of d_t coordinates non-zero, an input scaled by `a`
  has mean(x^2) = (d_s/d_t) a^2 mean_s. The twin's epsilon is eps_s (ds_s/ds_t)^2 (ds: GDN state
  size), and each norm's input is scaled so that (d_s/d_t) a^2 = eps_t/eps_s; its weight is then
  w_s sqrt(d_s/d_t). Residual-stream norms: the whole residual stream is scaled by a_D (embedding and
  every residual write); q/k norms: the q and k rows by a_hd. The GDN output norm needs no input
  scale: its input is already scaled by sqrt(dk_s/dk_t) through the query scale (below), which is
  what the epsilon above absorbs. So every RMSNorm is exact in real arithmetic.
- Query scales: attention divides by sqrt(hd_t): the q-norm weight also carries sqrt(hd_t/hd_s) (which
  cancels the norm's sqrt(hd_s/hd_t), so it is copied as is). The GDN query scale 1/sqrt(dk_t) scales
  the GDN output before its norm (above).
- Grouped-query heads: source q head i of KV group g goes to slot i of the twin's KV head g (copies of
  a KV head where the source's groups are wider). GDN value heads keep the tiled order (value head n
  uses key head n mod Hk): source value head j + Hk_s r goes to twin value head j + Hk_t r.
- L2 norms (GDN q, k) sum, so zero coordinates leave them alone; their epsilon is the twin's, which
  changes them by a relative |eps_s - eps_t| / (2 sum x^2) at most (inexact, like the MTP hnorm below).
- Extra vocabulary: embedding rows zero (but for the constant below); LM-head rows copies of one source
  row (`pad_row`, by default the source token least likely over probe prompts). Where the twin has a free
  residual coordinate, the trunk's residual also carries a constant c there (every embedding row; no layer
  writes it, only the output norm passes it on) and the extra rows weigh it -PAD_WEIGHT: their logits sit
  PAD_WEIGHT c / rms(residual) below the copied row's, so they take no probability under sampling. c^2 /
  D_t in every trunk norm's mean is extra epsilon, absorbed exactly by a larger trunk residual scale a_D;
  the MTP block's residual has no constant (its scale a_M), so in the MTP head the extra rows tie with
  `pad_row` (ties resolve to the lower id: greedy drafts never pick them). The constant reaches the MTP
  head's hnorm through the trunk's normed hidden, whose mean it perturbs by ~(c / rms)^2 / D_t: the MTP
  head's first step is exact to ~1e-6 relative, not to rounding. Without a free coordinate the extra rows
  are plain copies (greedy-safe only).
- Tokenizer: the source's tokens, then unused tokens `<|twin_unused_N|>` up to the twin's vocabulary.
- No-op layers: a trained layer of the same kind (routers, norms, mixer), its output projections
  (attention / GDN out, routed and shared expert down) zero: routing stays trained-skewed, the
  residual is unchanged.
The twin computes the source's function, not Qwen3.6's: quality and MTP acceptance are the source's.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from pathlib import Path
from typing import Sequence

import numpy as np
from absl import app, flags

from experiments.cli import fail, reports_bad_input
from sharpi_jax.config import SHAPE_PRESETS, ModelConfig, shape_preset
from sharpi_jax.errors import InputError
from sharpi_jax.gguf import read_model_config
from sharpi_jax.gguf.reader import GGUFFile
from sharpi_jax.gguf.tensor_specs import TensorSpec
from sharpi_jax.gguf.writer import FILE_TYPE, Q, as_qtype, model_tensor_plan, write_model_gguf

UNUSED = 5  # llama.cpp token type of an unused token
PAD_WEIGHT = 1e5  # |LM-head weight| of the extra rows on the constant coordinate
RESIDUAL_WRITES = ("attn_output.weight", "ssm_out.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight")


def attention_interval_pattern(n_layer: int, n_nextn: int) -> tuple[bool, ...]:
    """Recurrent layers of a full_attention_interval 4 model (what llama.cpp derives for qwen35moe)."""
    return tuple(i < n_layer and (i + 1) % 4 != 0 for i in range(n_layer + n_nextn))


def twin_config(src: ModelConfig, shape: ModelConfig, n_layer: int | None = None) -> ModelConfig:
    """The twin's config: `shape`'s matrix shapes, the source's experts, rope, context and MTP blocks."""
    n_layer = shape.n_layer if n_layer is None else int(n_layer)
    if src.arch != "qwen35moe" or shape.arch != "qwen35moe":
        raise InputError(f"twin: source and shape must be qwen35moe (MoE, tiled GDN heads), got {src.arch} "
                         f"and {shape.arch}")
    if src.recurrent_layers != attention_interval_pattern(src.n_layer, src.n_nextn):
        raise InputError("twin: the source's layer pattern is not full_attention_interval 4")
    if n_layer < src.n_layer:
        raise InputError(f"twin: n_layer {n_layer} is below the source's {src.n_layer} trained layers")
    ds_s, ds_t = src.ssm_d_state, shape.ssm_d_state
    checks = [("d_model", src.d_model, shape.d_model), ("head_dim", src.head_dim, shape.head_dim),
              ("ssm_d_state", ds_s, ds_t), ("expert_ff", src.expert_ff, shape.expert_ff),
              ("shared_expert_ff", src.shared_expert_ff, shape.shared_expert_ff),
              ("n_vocab", src.n_vocab, shape.n_vocab)]
    for name, a, b in checks:
        if a > b:
            raise InputError(f"twin: the source's {name} {a} exceeds the shape's {b}")
    if src.ssm_conv_kernel != shape.ssm_conv_kernel:
        raise InputError(f"twin: conv kernel {src.ssm_conv_kernel} != the shape's {shape.ssm_conv_kernel}")
    dst = shape.replace(
        n_vocab=shape.n_vocab, n_layer_all=n_layer + src.n_nextn, n_nextn=src.n_nextn,
        context_length=src.context_length, rms_eps=float(np.float32(src.rms_eps) * np.float32((ds_s / ds_t) ** 2)),
        n_rot=src.n_rot, rope_base=src.rope_base, rope_freq_scale=src.rope_freq_scale,
        rope_sections=src.rope_sections, recurrent_layers=attention_interval_pattern(n_layer, src.n_nextn),
        n_expert=src.n_expert, n_expert_used=src.n_expert_used, tied_embeddings=False)
    head_slots(src, dst)  # fail early where heads do not fit
    gdn_heads(src, dst)
    return dst


def head_slots(src: ModelConfig, dst: ModelConfig) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """(twin q slot of each source q head, [(twin KV head, source KV head)]): source q head i of group g
    sits in a twin group that copies source KV head g."""
    Gs, Gt = src.n_head // src.n_head_kv, dst.n_head // dst.n_head_kv
    copies = -(-Gs // Gt)
    if src.n_head_kv * copies > dst.n_head_kv:
        raise InputError(f"twin: {src.n_head} q heads on {src.n_head_kv} KV heads do not fit "
                         f"{dst.n_head} q heads on {dst.n_head_kv} KV heads")
    slot = np.empty(src.n_head, np.int64)
    kv = []
    for g in range(src.n_head_kv):
        for c in range(copies):
            kv.append((g * copies + c, g))
        for i in range(Gs):
            slot[g * Gs + i] = (g * copies + i // Gt) * Gt + i % Gt
    return slot, kv


def gdn_heads(src: ModelConfig, dst: ModelConfig) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """(twin value head of each source value head, [(twin key head, source key head)]) in tiled order:
    value head n uses key head n mod Hk, in the source and in the twin."""
    Hks, Hkt = src.ssm_n_group, dst.ssm_n_group
    Rs, Rt = src.ssm_dt_rank // Hks, dst.ssm_dt_rank // Hkt
    copies = -(-Rs // Rt)
    if Hks * copies > Hkt:
        raise InputError(f"twin: GDN {Hks} key / {src.ssm_dt_rank} value heads do not fit {Hkt} key / "
                         f"{dst.ssm_dt_rank} value heads")
    vmap = np.empty(src.ssm_dt_rank, np.int64)
    kmap = [(j + Hks * c, j) for c in range(copies) for j in range(Hks)]
    for n in range(src.ssm_dt_rank):
        j, r = n % Hks, n // Hks
        vmap[n] = (j + Hks * (r // Rt)) + Hkt * (r % Rt)
    return vmap, kmap


def _blocks(index: np.ndarray, size_s: int, size_t: int) -> tuple[np.ndarray, np.ndarray]:
    """(twin indices, source indices) of whole blocks: source block b -> twin block index[b]."""
    src = np.arange(len(index) * size_s)
    dst = (index[:, None] * size_t + np.arange(size_s)[None, :]).reshape(-1)
    return dst, src


@dataclasses.dataclass
class Twin:
    """The twin of an open source GGUF at config `dst`: `tensor(spec)` builds each twin tensor (float32)."""

    f: GGUFFile
    src: ModelConfig
    dst: ModelConfig
    pad_row: int

    def __post_init__(self) -> None:
        s, d = self.src, self.dst
        for extra in ("embed_tokens", "shared_head_head"):
            if any(n.endswith(f"nextn.{extra}.weight") for n in self.f.tensors):
                raise InputError(f"twin: sources with their own nextn.{extra} are not supported")
        if not 0 <= self.pad_row < s.n_vocab:
            raise InputError(f"twin: pad_row {self.pad_row} is not a source token id (< {s.n_vocab})")
        rho = d.rms_eps / s.rms_eps  # eps_t / eps_s (float32 values)
        self.r_D = s.d_model / d.d_model
        self.r_hd = s.head_dim / d.head_dim
        self.r_v = s.ssm_d_state / d.ssm_d_state
        self.a_M = math.sqrt(rho / self.r_D)  # MTP residual stream and normed hidden scale
        self.a_hd = math.sqrt(rho / self.r_hd)  # q and k rows (q/k norm inputs)
        # The trunk's residual carries a constant coordinate c (last index) when there is a free one and
        # extra vocabulary: the LM head's extra rows read it with weight -PAD_WEIGHT. Its c^2/D_t in
        # every trunk norm's mean acts as extra epsilon, absorbed by a larger residual scale a_D.
        self.const = s.d_model < d.d_model and d.n_vocab > s.n_vocab
        self.c = float(np.float32(math.sqrt(3 * d.rms_eps * d.d_model))) if self.const else 0.0
        self.a_D = math.sqrt((d.rms_eps + self.c ** 2 / d.d_model) / (s.rms_eps * self.r_D))
        self._cache: dict[str, np.ndarray] = {}
        self.q_slot, self.kv_pairs = head_slots(s, d)
        self.v_head, self.k_pairs = gdn_heads(s, d)

    # ----- source access -----
    def get(self, name: str) -> np.ndarray:
        """A source tensor as float32 numpy (cached: no-op layers reuse trained ones)."""
        if name not in self._cache:
            t = self.f.tensor(name)
            x = self.f.array(name) if t.qtype == Q.F32 else np.asarray(self.f.dequantize(name))
            self._cache[name] = np.asarray(x, np.float32).reshape(t.shape)
        return self._cache[name]

    def source_layer(self, i: int) -> tuple[int, bool]:
        """(source block, no-op) of twin block i: trained layers, then no-op copies of trained layers of the
        same kind (cycling), then the MTP blocks."""
        s, d = self.src, self.dst
        if i < s.n_layer:
            return i, False
        if i >= d.n_layer:
            return s.n_layer + (i - d.n_layer), False
        same = [j for j in range(s.n_layer) if s.recurrent_layers[j] == d.recurrent_layers[i]]
        if not same:
            raise InputError(f"twin: the source has no {'GDN' if d.recurrent_layers[i] else 'attention'} "
                             f"layer to copy into no-op layer {i}")
        return same[(i - s.n_layer) % len(same)], True

    # ----- tensors -----
    def tensor(self, spec: TensorSpec) -> np.ndarray:
        """Twin tensor `spec` as float32 of spec.shape."""
        s, d = self.src, self.dst
        name = spec.name
        out = np.zeros(spec.shape, np.float32)
        Ds = s.d_model
        if name == "token_embd.weight":
            out[: s.n_vocab, :Ds] = self.get(name) * np.float32(self.a_D)
            if self.const:
                out[:, -1] = self.c
            return out
        if name == "output.weight":
            w = self.get(name if "output.weight" in self.f.tensors else "token_embd.weight")
            out[: s.n_vocab, :Ds] = w / np.float32(self.a_M)
            out[s.n_vocab:, :Ds] = out[self.pad_row, :Ds]
            if self.const:
                out[s.n_vocab:, -1] = -PAD_WEIGHT
            return out
        if name == "output_norm.weight":
            out[:Ds] = self.get(name) * np.float32(math.sqrt(self.r_D) * self.a_M)
            if self.const:
                out[-1] = 1.0
            return out
        block, rest = name.split(".", 2)[1], name.split(".", 2)[2]
        j, noop = self.source_layer(int(block))
        p = f"blk.{j}"
        if noop and rest in RESIDUAL_WRITES:
            return out
        if rest == "nextn.shared_head_norm.weight":
            src = f"{p}.{rest}" if f"{p}.{rest}" in self.f.tensors else "output_norm.weight"
            out[:Ds] = self.get(src) * np.float32(math.sqrt(self.r_D) * self.a_M)
            return out
        x = self.get(f"{p}.{rest}")
        norm_D = np.float32(math.sqrt(self.r_D))
        self._write = self.a_M if int(block) >= d.n_layer else self.a_D  # residual writes of this block
        aD = np.float32(self._write)
        if rest in ("attn_norm.weight", "post_attention_norm.weight", "nextn.enorm.weight", "nextn.hnorm.weight"):
            out[:Ds] = x * norm_D
        elif rest == "nextn.eh_proj.weight":  # writes the MTP block's residual
            out[:Ds, :Ds] = x[:, :Ds] * aD
            out[:Ds, d.d_model: d.d_model + Ds] = x[:, Ds:] * aD
        elif rest in ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight"):
            out[:, :Ds] = x
        elif rest in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
            out[:, : s.expert_ff, :Ds] = x
        elif rest == "ffn_down_exps.weight":
            out[:, :Ds, : s.expert_ff] = x * aD
        elif rest in ("ffn_gate_shexp.weight", "ffn_up_shexp.weight"):
            out[: s.shared_expert_ff, :Ds] = x
        elif rest == "ffn_down_shexp.weight":
            out[:Ds, : s.shared_expert_ff] = x * aD
        elif rest.startswith(("attn_q", "attn_k", "attn_v", "attn_output")) and not rest.startswith("attn_qkv"):
            self._attention(rest, x, out)
        else:
            self._gdn(rest, x, out)
        return out

    def _attention(self, rest: str, x: np.ndarray, out: np.ndarray) -> None:
        s, d = self.src, self.dst
        hs, ht, Ds = s.head_dim, d.head_dim, s.d_model
        if rest == "attn_q.weight":  # rows per head: [q_h | gate_h]
            for h, slot in enumerate(self.q_slot):
                out[slot * 2 * ht: slot * 2 * ht + hs, :Ds] = x[h * 2 * hs: h * 2 * hs + hs] * np.float32(self.a_hd)
                out[slot * 2 * ht + ht: slot * 2 * ht + ht + hs, :Ds] = x[h * 2 * hs + hs: (h + 1) * 2 * hs]
        elif rest in ("attn_k.weight", "attn_v.weight"):
            scale = np.float32(self.a_hd if rest == "attn_k.weight" else 1.0)
            for t, g in self.kv_pairs:
                out[t * ht: t * ht + hs, :Ds] = x[g * hs: (g + 1) * hs] * scale
        elif rest == "attn_output.weight":
            cols_t, cols_s = _blocks(self.q_slot, hs, ht)
            out[:Ds, cols_t] = x[:, cols_s] * np.float32(self._write)
        elif rest == "attn_q_norm.weight":  # sqrt(r_hd) from the norm, sqrt(hd_t/hd_s) for the score scale
            out[:hs] = x
        elif rest == "attn_k_norm.weight":
            out[:hs] = x * np.float32(math.sqrt(self.r_hd))
        else:
            raise InputError(f"twin: unexpected attention tensor {rest!r}")

    def _gdn(self, rest: str, x: np.ndarray, out: np.ndarray) -> None:
        s, d = self.src, self.dst
        dk_s, dk_t, Ds = s.ssm_d_state, d.ssm_d_state, s.d_model
        k_t = np.array([t for t, _ in self.k_pairs])
        k_s = np.array([j for _, j in self.k_pairs])
        # conv channels [q (Hk dk) | k (Hk dk) | v (Hv dv)]
        q_rows_t = (k_t[:, None] * dk_t + np.arange(dk_s)).reshape(-1)
        q_rows_s = (k_s[:, None] * dk_s + np.arange(dk_s)).reshape(-1)
        v_rows_t, v_rows_s = _blocks(self.v_head, dk_s, dk_t)
        conv_t = np.concatenate([q_rows_t, q_rows_t + d.ssm_n_group * dk_t,
                                 v_rows_t + 2 * d.ssm_n_group * dk_t])
        conv_s = np.concatenate([q_rows_s, q_rows_s + s.ssm_n_group * dk_s, v_rows_s + 2 * s.ssm_n_group * dk_s])
        if rest == "attn_qkv.weight":
            out[conv_t, :Ds] = x[conv_s]
        elif rest == "ssm_conv1d.weight":
            out[conv_t] = x[conv_s]
        elif rest == "attn_gate.weight":
            out[v_rows_t, :Ds] = x[v_rows_s]
        elif rest in ("ssm_beta.weight", "ssm_alpha.weight"):
            out[self.v_head, :Ds] = x
        elif rest in ("ssm_dt.bias", "ssm_a"):
            out[self.v_head] = x
        elif rest == "ssm_norm.weight":
            out[:dk_s] = x * np.float32(math.sqrt(self.r_v))
        elif rest == "ssm_out.weight":
            out[:Ds, v_rows_t] = x[:, v_rows_s] * np.float32(self._write)
        else:
            raise InputError(f"twin: unexpected GDN tensor {rest!r}")


def twin_vocab(f: GGUFFile, n_vocab: int) -> tuple[list[str], list[str], list[int]]:
    """The source's tokens, merges and token types, padded with unused tokens to n_vocab."""
    tokens = list(f.metadata["tokenizer.ggml.tokens"])
    types = list(f.metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = list(f.metadata.get("tokenizer.ggml.merges") or [])
    have = set(tokens)
    i = 0
    while len(tokens) < n_vocab:
        t = f"<|twin_unused_{i}|>"
        i += 1
        if t not in have:
            tokens.append(t)
            types.append(UNUSED)
    return tokens, merges, types


PROBE_PROMPTS = ("def fibonacci(n):\n", "import os\nimport sys\n\n\nclass ",
                 "    def __init__(self, name, value=None):\n        self.name = name\n",
                 "def read_config(path):\n    with open(path) as f:\n")


def quietest_token(engine, prompts: Sequence[str] = PROBE_PROMPTS) -> int:
    """The token whose largest teacher-forced logit over `prompts` is the lowest (an `Engine`)."""
    top = np.full(engine.config.n_vocab, -np.inf, np.float32)
    for p in prompts:
        top = np.maximum(top, engine.logits(engine.tokenizer.encode(p)).max(axis=0))
    return int(np.argmin(top))


def pad_row_mass(logits: np.ndarray, n_vocab_src: int) -> np.ndarray:
    """Per row of twin logits [T, V_t]: the probability the extra vocabulary rows take under sampling."""
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z.astype(np.float64))
    return e[:, n_vocab_src:].sum(-1) / e.sum(-1)


def write_twin(source: str | os.PathLike[str], out: str | os.PathLike[str], shape: ModelConfig,
               n_layer: int | None = None, qtype: str = "F32", pad_row: int | None = None,
               progress: bool = False) -> Path:
    """Write the twin of GGUF `source` at `shape` (a ModelConfig) to `out`, tensor by tensor; F32 is exact
    up to the GDN L2-norm epsilon and the MTP hnorm (module doc), Q8_0 / F16 quantize the twin's values
    (gguf.quants). Returns the path."""
    qt = as_qtype(qtype)
    if qt not in (Q.F32, Q.F16, Q.Q8_0):
        raise InputError(f"twin: write F32, F16 or Q8_0 (got {qt.name}); llama-quantize makes the other types")
    f = GGUFFile(source)
    try:
        src = read_model_config(f)
        dst = twin_config(src, shape, n_layer)
        if pad_row is None:
            import sharpi_jax as sj

            pad_row = quietest_token(sj.load(source, max_context=512))
        twin = Twin(f, src, dst, pad_row)
        plan = model_tensor_plan(dst, qt)

        def data(spec: TensorSpec, t: Q) -> np.ndarray:
            x = twin.tensor(spec)
            if t == Q.F32:
                return x
            if t == Q.F16:
                return x.astype(np.float16)
            from gguf import quants as gq

            rows = x.reshape(-1, x.shape[-1])  # row by row (chunked): bounded temporaries on 2 GB heads
            step = max(1, (1 << 24) // rows.shape[1])
            q = np.concatenate([gq.quantize(rows[i: i + step], t) for i in range(0, rows.shape[0], step)])
            return q.reshape(*x.shape[:-1], q.shape[-1])

        name = f"twin-{f.get('general.name', Path(source).stem)}"
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".partial")
        write_model_gguf(tmp, dst, twin_vocab(f, dst.n_vocab), plan, data, name=name,
                         file_type=FILE_TYPE.get(qt), progress=progress)
        tmp.replace(path)
        return path
    finally:
        f.close()


FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags, defined only when it runs as a command: the module's functions are imported by
    tests beside other entry points whose flags share these names (absl keeps one global registry)."""
    flags.DEFINE_string("source", "research", "Source model: a preset name (research, default, ...) or a GGUF path.")
    flags.DEFINE_enum("shape", "qwen36-35b-a3b", list(SHAPE_PRESETS), "Shape preset of the twin's matrices.")
    flags.DEFINE_integer("n_layer", None, "Trunk layers (default: the preset's); the source's, then no-op layers.")
    flags.DEFINE_integer("n_vocab", None, "Vocabulary size (default: the preset's; at least the source's).")
    flags.DEFINE_string("qtype", "F32", "ggml type of the matrices: F32 (exact), F16, Q8_0 (then llama-quantize).")
    flags.DEFINE_integer("pad_row", None, "Source token whose LM-head row the extra rows copy (default: the "
                         "token least likely over probe prompts).")
    flags.DEFINE_string("out", None, "Output GGUF path.", required=True)


@reports_bad_input
def main(argv) -> int:
    del argv
    from experiments.presets import resolve_model

    try:
        source = resolve_model(None if FLAGS.source == "default" else FLAGS.source)
        shape = shape_preset(FLAGS.shape)
        if FLAGS.n_vocab is not None:
            shape = shape.replace(n_vocab=FLAGS.n_vocab)
        path = write_twin(source, FLAGS.out, shape, FLAGS.n_layer, FLAGS.qtype, FLAGS.pad_row,
                          progress=sys.stderr.isatty())
    except FileNotFoundError as e:
        return fail(e)
    with GGUFFile(path) as f:
        c = read_model_config(f)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB): twin of {source} at {FLAGS.shape} shapes, "
          f"{c.n_layer} layers + {c.n_nextn} MTP, vocab {c.n_vocab}, {c.n_expert} experts top-{c.n_expert_used}")
    return 0


if __name__ == "__main__":
    define_flags()
    app.run(main)
