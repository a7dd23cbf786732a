"""A differentiable, batched training graph of a qwen35moe model with its MTP head (spec qwen35moe.md 3, 4.1).

Parameters are a flat dict of float32 arrays keyed by GGUF tensor names, numpy-order shapes from
`model_tensor_specs` (a GGUF `{in, out}` matrix is `[out, in]` here), so `export_model_gguf` writes them
as they are and the inference engine reads back the same function. Values are stored as used: norm
weights include the converter's +1 (initialised at 1.0), `ssm_a` is -exp(A_log), GDN v-head n pairs with
k-head n % Hk (tiled), `attn_q` interleaves [q_h | gate_h] per head.

The inference modules keep weights in GGUF block form and pad rows for bitwise parity; this graph is
for training instead: every token of a [B, T] batch at once from zero recurrent state, routed experts
either computed densely and masked to the renormalised top-k weights (exactly the inference forward) or
dispatched into capacity-limited per-expert buffers (the training default: several times faster on CPU),
and a chunked gated delta rule whose (I + A)^-1 is a product of matrix powers (all matmuls, cheap to
differentiate). tests/training checks it against the engine and the fixtures' transformers logits.
"""

from __future__ import annotations

import math
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType

from sharpi_jax.config import ModelConfig
from sharpi_jax.gguf.writer import model_tensor_plan
from sharpi_jax.model.gated_delta_net import l2_norm, softplus
from sharpi_jax.model.layers import rms_norm, rope_neox
from sharpi_jax.model.moe import WEIGHT_SUM_CLAMP

Params = Mapping[str, jax.Array]
GDN_TRAIN_CHUNK = 16  # fastest measured on CPU (8-32 are close; 64 is ~3x slower)


# ----------------------------------------------------------------------------------------------------
# Parameters
# ----------------------------------------------------------------------------------------------------

def param_names(config: ModelConfig) -> list[str]:
    """The tensors the training graph owns: the export plan of an untied model with an MTP head norm."""
    return [s.name for s, _ in model_tensor_plan(config, GGMLQuantizationType.F32, tied_embeddings=False)]


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """name -> numpy-order shape, for every trained tensor."""
    return {s.name: tuple(s.shape) for s, _ in model_tensor_plan(config, GGMLQuantizationType.F32,
                                                                tied_embeddings=False)}


def init_params(config: ModelConfig, seed: int = 0, std: float = 0.02) -> dict[str, np.ndarray]:
    """Random float32 params (numpy), HF-style: N(0, std) matrices, residual outputs scaled by
    1/sqrt(2 * blocks), norms 1.0 (the stored 1+w), A ~ U(1, 16) so ssm_a = -A, dt bias 1.0,
    conv weights U(+-1/sqrt(Kc)) as torch's Conv1d default."""
    if not config.is_moe or config.arch != "qwen35moe":
        raise ValueError(f"training supports arch qwen35moe with experts, got {config.arch}")
    rng = np.random.default_rng(seed)
    out_std = std / math.sqrt(2 * config.n_layer_all)
    params: dict[str, np.ndarray] = {}
    for name, shape in param_shapes(config).items():
        if name.endswith("norm.weight"):  # every RMSNorm incl. ssm_norm
            v = np.ones(shape, np.float32)
        elif name.endswith(".ssm_a"):
            v = -rng.uniform(1.0, 16.0, size=shape)
        elif name.endswith(".ssm_dt.bias"):
            v = np.ones(shape, np.float32)
        elif name.endswith(".ssm_conv1d.weight"):
            b = 1.0 / math.sqrt(config.ssm_conv_kernel)
            v = rng.uniform(-b, b, size=shape)
        elif any(name.endswith(s) for s in ("attn_output.weight", "ssm_out.weight", "ffn_down_exps.weight",
                                            "ffn_down_shexp.weight")):
            v = rng.normal(0.0, out_std, size=shape)
        else:
            v = rng.normal(0.0, std, size=shape)
        params[name] = np.asarray(v, np.float32)
    return params


def params_from_gguf(path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(config, float32 params) of a qwen35moe GGUF (dequantized); a tied file gets output = token_embd."""
    from sharpi_jax.gguf import GGUFFile, read_model_config

    with GGUFFile(path) as f:
        config = read_model_config(f)
        params = {}
        for name, shape in param_shapes(config).items():
            src = name
            if name == "output.weight" and name not in f.tensors:
                src = "token_embd.weight"
            if name.endswith("shared_head_norm.weight") and name not in f.tensors:
                src = "output_norm.weight"
            params[name] = np.array(f.dequantize(src), np.float32).reshape(shape)
    return config, params


# ----------------------------------------------------------------------------------------------------
# Layers (batched: leading [B, T])
# ----------------------------------------------------------------------------------------------------

def _mm(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] times a numpy-order [out, in] matrix -> [..., out]."""
    return jnp.einsum("...i,oi->...o", x, w)


def gated_attention(p: Params, pre: str, c: ModelConfig, a: jax.Array, positions: jax.Array) -> jax.Array:
    """Causal gated full attention (spec 3.2) of normed rows a [B, T, D] at `positions` [T]."""
    B, T, _ = a.shape
    Hq, Hkv, hd = c.n_head, c.n_head_kv, c.head_dim
    G = Hq // Hkv
    qg = _mm(a, p[f"{pre}.attn_q.weight"]).reshape(B, T, Hq, 2, hd)
    q, gate = qg[..., 0, :], qg[..., 1, :]
    k = _mm(a, p[f"{pre}.attn_k.weight"]).reshape(B, T, Hkv, hd)
    v = _mm(a, p[f"{pre}.attn_v.weight"]).reshape(B, T, Hkv, hd)
    q = rope_neox(rms_norm(q, p[f"{pre}.attn_q_norm.weight"], c.rms_eps), positions, c.n_rot, c.rope_base,
                  c.rope_freq_scale)
    k = rope_neox(rms_norm(k, p[f"{pre}.attn_k_norm.weight"], c.rms_eps), positions, c.n_rot, c.rope_base,
                  c.rope_freq_scale)
    qh = q.reshape(B, T, Hkv, G, hd)  # q-head h reads kv-head h // G
    s = jnp.einsum("btkgd,bskd->bkgts", qh, k) * jnp.float32(1.0 / math.sqrt(hd))
    causal = jnp.tril(jnp.ones((T, T), bool))
    s = jnp.where(causal, s, -jnp.inf)
    o = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(s, axis=-1), v).reshape(B, T, Hq, hd)
    o = o * jax.nn.sigmoid(gate)
    return _mm(o.reshape(B, T, Hq * hd), p[f"{pre}.attn_output.weight"])


def unit_lower_inverse(A: jax.Array) -> jax.Array:
    """(I + A)^-1 for strictly lower-triangular A [..., C, C]: sum_k (-A)^k = (I - A)(I + A^2)(I + A^4)...
    (A is nilpotent, so the product is exact after ceil(log2 C) factors)."""
    C = A.shape[-1]
    eye = jnp.eye(C, dtype=A.dtype)
    X = eye - A
    P = A
    for _ in range(max(0, math.ceil(math.log2(C)) - 1)):
        P = P @ P
        X = X + X @ P
    return X


def delta_rule_chunked(q, k, v, beta, g, scale: float, chunk: int = GDN_TRAIN_CHUNK):
    """Gated delta rule from a zero state (spec 3.3 step 7, chunked WY form of spec 5), batched.

    q, k [B, T, H, dk] (L2-normed, tiled to the v-heads); v [B, T, H, dv]; beta, g [B, T, H].
    Returns o [B, T, H, dv]. Padding tokens have beta = g = 0 and k = v = 0, so they are inert.
    """
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    C = min(chunk, T)
    pad = -T % C
    if pad:
        z = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        q, k, v, beta, g = map(z, (q, k, v, beta, g))
    N = (T + pad) // C
    to_chunks = lambda x: x.reshape(B, N, C, H, *x.shape[3:]).swapaxes(2, 3)  # [B, N, H, C, ...]
    q, k, v, beta, g = map(to_chunks, (q * jnp.float32(scale), k, v, beta, g))
    gam = jnp.cumsum(g, axis=-1)  # [B, N, H, C]
    incl = jnp.tril(jnp.ones((C, C), bool))
    strict = jnp.tril(jnp.ones((C, C), bool), -1)
    diff = gam[..., :, None] - gam[..., None, :]
    decay = jnp.where(incl, jnp.exp(jnp.where(incl, diff, 0.0)), 0.0)  # zero the upper part before exp
    kb = k * beta[..., None]
    A = jnp.where(strict, jnp.einsum("...id,...jd->...ij", kb, k) * decay, 0.0)
    Tinv = unit_lower_inverse(A)
    U = Tinv @ (v * beta[..., None])
    W = Tinv @ (kb * jnp.exp(gam)[..., None])
    qk = jnp.where(incl, jnp.einsum("...id,...jd->...ij", q, k) * decay, 0.0)
    qg = q * jnp.exp(gam)[..., None]
    kdec = k * jnp.exp(gam[..., -1:] - gam)[..., None]
    glast = jnp.exp(gam[..., -1])  # [B, N, H]

    def body(S, xs):  # S [B, H, dk, dv] (HF orientation)
        U, W, qk, qg, kdec, glast = xs
        v_new = U - W @ S
        o = qg @ S + qk @ v_new
        S = glast[..., None, None] * S + kdec.swapaxes(-1, -2) @ v_new
        return S, o

    xs = tuple(x.swapaxes(0, 1) for x in (U, W, qk, qg, kdec, glast))  # scan over chunks
    S0 = jnp.zeros((B, H, dk, dv), jnp.float32)
    _, o = jax.lax.scan(body, S0, xs)  # [N, B, H, C, dv]
    o = o.transpose(1, 0, 3, 2, 4).reshape(B, N * C, H, dv)
    return o[:, :T]


def gated_delta_net(p: Params, pre: str, c: ModelConfig, a: jax.Array, chunk: int = GDN_TRAIN_CHUNK) -> jax.Array:
    """Gated DeltaNet mixer (spec 3.3) of normed rows a [B, T, D], from zero conv and SSM states."""
    B, T, _ = a.shape
    Hk, Hv, dk = c.ssm_n_group, c.ssm_dt_rank, c.ssm_d_state
    dv = c.ssm_d_inner // Hv
    Kc = c.ssm_conv_kernel
    qkv = _mm(a, p[f"{pre}.attn_qkv.weight"])  # [B, T, C]
    z = _mm(a, p[f"{pre}.attn_gate.weight"]).reshape(B, T, Hv, dv)
    beta = jax.nn.sigmoid(_mm(a, p[f"{pre}.ssm_beta.weight"]))
    alpha = _mm(a, p[f"{pre}.ssm_alpha.weight"])
    g = p[f"{pre}.ssm_a"] * softplus(alpha + p[f"{pre}.ssm_dt.bias"])
    # Causal depthwise conv: w [C, Kc], tap Kc-1 multiplies the current token.
    w = p[f"{pre}.ssm_conv1d.weight"]
    X = jnp.pad(qkv, [(0, 0), (Kc - 1, 0), (0, 0)])
    y = w[:, 0] * X[:, 0:T]
    for i in range(1, Kc):
        y = y + w[:, i] * X[:, i:i + T]
    y = jax.nn.silu(y)
    q = l2_norm(y[..., : Hk * dk].reshape(B, T, Hk, dk), c.rms_eps)
    k = l2_norm(y[..., Hk * dk: 2 * Hk * dk].reshape(B, T, Hk, dk), c.rms_eps)
    v = y[..., 2 * Hk * dk:].reshape(B, T, Hv, dv)
    r = Hv // Hk
    q = jnp.concatenate([q] * r, axis=-2)  # tiled: v-head n uses k-head n % Hk
    k = jnp.concatenate([k] * r, axis=-2)
    o = delta_rule_chunked(q, k, v, beta, g, 1.0 / math.sqrt(dk), chunk)
    o = rms_norm(o, p[f"{pre}.ssm_norm.weight"], c.rms_eps) * jax.nn.silu(z)
    return _mm(o.reshape(B, T, Hv * dv), p[f"{pre}.ssm_out.weight"])


def _routed_dense(p: Params, pre: str, c: ModelConfig, u: jax.Array, w: jax.Array, sel: jax.Array) -> jax.Array:
    """Every expert on every row, weighted by the top-k weights (zero elsewhere): exact, E/k x the work."""
    E, F, D = c.n_expert, c.expert_ff, c.d_model
    dense_w = jnp.sum(jax.nn.one_hot(sel, E, dtype=u.dtype) * w[..., None], axis=-2)  # [N, E]
    gate = _mm(u, p[f"{pre}.ffn_gate_exps.weight"].reshape(E * F, D))
    up = _mm(u, p[f"{pre}.ffn_up_exps.weight"].reshape(E * F, D))
    hid = (jax.nn.silu(gate) * up).reshape(-1, E, F) * dense_w[..., None]
    down = p[f"{pre}.ffn_down_exps.weight"].transpose(1, 0, 2).reshape(D, E * F)  # [E, D, F] -> [D, E*F]
    return _mm(hid.reshape(-1, E * F), down)


def _routed_capacity(p: Params, pre: str, c: ModelConfig, u: jax.Array, w: jax.Array, sel: jax.Array,
                     capacity_factor: float) -> tuple[jax.Array, jax.Array]:
    """Top-k dispatch into per-expert buffers of capacity ceil(N k / E * capacity_factor) rows (gather,
    batched expert matmuls, weighted combine). Assignments past an expert's capacity (in row order) are
    dropped. Returns (out [N, D], fraction of assignments kept)."""
    E, D, k = c.n_expert, c.d_model, c.n_expert_used
    N = u.shape[0]
    cap = max(1, int(math.ceil(N * k / E * capacity_factor)))
    flat_e = sel.reshape(-1)  # [N*k], row-major: assignment j belongs to row j // k
    onehot = jax.nn.one_hot(flat_e, E, dtype=jnp.int32)
    rank = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)  # index within its expert
    keep = rank < cap
    slot = jnp.where(keep, flat_e * cap + rank, E * cap)  # dropped -> a dummy slot
    row = jnp.repeat(jnp.arange(N, dtype=jnp.int32), k)
    slot_row = jnp.zeros(E * cap + 1, jnp.int32).at[slot].set(row)[:-1]
    slot_used = jnp.zeros(E * cap + 1, u.dtype).at[slot].set(1.0)[:-1]
    xin = (u[slot_row] * slot_used[:, None]).reshape(E, cap, D)
    gate = jnp.einsum("ecd,efd->ecf", xin, p[f"{pre}.ffn_gate_exps.weight"])
    up = jnp.einsum("ecd,efd->ecf", xin, p[f"{pre}.ffn_up_exps.weight"])
    y = jnp.einsum("ecf,edf->ecd", jax.nn.silu(gate) * up, p[f"{pre}.ffn_down_exps.weight"])
    y = jnp.concatenate([y.reshape(E * cap, D), jnp.zeros((1, D), y.dtype)])
    out = jnp.sum((y[slot] * (w.reshape(-1) * keep)[:, None]).reshape(N, k, D), axis=1)
    return out, jnp.mean(keep.astype(jnp.float32))


def moe(p: Params, pre: str, c: ModelConfig, u: jax.Array, capacity_factor: float | None = None
        ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Routed + shared MoE (spec 3.4) of normed rows u [..., D].

    capacity_factor None: every expert is computed and masked to the renormalised top-k weights (the
    inference forward exactly). A number: capacity-limited top-k dispatch (the same forward unless an
    expert overflows; several times faster to train). Returns (out, router probs [..., E], kept fraction).
    """
    lead, D = u.shape[:-1], u.shape[-1]
    uf = u.reshape(-1, D)
    probs = jax.nn.softmax(_mm(uf, p[f"{pre}.ffn_gate_inp.weight"]), axis=-1)
    w, sel = jax.lax.top_k(probs, c.n_expert_used)
    w = w / jnp.maximum(jnp.sum(w, axis=-1, keepdims=True), jnp.float32(WEIGHT_SUM_CLAMP))
    if capacity_factor is None:
        out, kept = _routed_dense(p, pre, c, uf, w, sel), jnp.float32(1.0)
    else:
        out, kept = _routed_capacity(p, pre, c, uf, w, sel, capacity_factor)
    if c.shared_expert_ff:
        sg = jax.nn.sigmoid(_mm(uf, p[f"{pre}.ffn_gate_inp_shexp.weight"]))  # [N, 1]
        sh = jax.nn.silu(_mm(uf, p[f"{pre}.ffn_gate_shexp.weight"])) * _mm(uf, p[f"{pre}.ffn_up_shexp.weight"])
        out = out + sg * _mm(sh, p[f"{pre}.ffn_down_shexp.weight"])
    return out.reshape(*lead, D), probs.reshape(*lead, -1), kept


def _block(p: Params, c: ModelConfig, layer: int, x: jax.Array, positions: jax.Array, gdn_chunk: int,
           capacity_factor: float | None):
    pre = f"blk.{layer}"
    a = rms_norm(x, p[f"{pre}.attn_norm.weight"], c.rms_eps)
    if c.is_recurrent(layer):
        m = gated_delta_net(p, pre, c, a, gdn_chunk)
    else:
        m = gated_attention(p, pre, c, a, positions)
    h = x + m
    f, probs, kept = moe(p, pre, c, rms_norm(h, p[f"{pre}.post_attention_norm.weight"], c.rms_eps),
                         capacity_factor)
    return h + f, (probs, kept)


# ----------------------------------------------------------------------------------------------------
# Trunk, MTP head, loss
# ----------------------------------------------------------------------------------------------------

def forward(params: Params, config: ModelConfig, ids: jax.Array, *, capacity_factor: float | None = None,
            gdn_chunk: int = GDN_TRAIN_CHUNK, return_routing: bool = False):
    """Trunk forward (spec 3.1) of ids [B, T] from position 0 -> (logits [B, T, V], final-normed hidden
    [B, T, D]); with return_routing also a list of per-layer (router probs, kept fraction).
    capacity_factor None is the exact inference forward (see `moe`)."""
    c = config
    T = ids.shape[1]
    positions = jnp.arange(T, dtype=jnp.int32)
    x = jnp.take(params["token_embd.weight"], ids, axis=0)
    routing = []
    for i in range(c.n_layer):
        x, r = _block(params, c, i, x, positions, gdn_chunk, capacity_factor)
        routing.append(r)
    hidden = rms_norm(x, params["output_norm.weight"], c.rms_eps)
    logits = _mm(hidden, params["output.weight"])
    return (logits, hidden, routing) if return_routing else (logits, hidden)


def mtp_forward(params: Params, config: ModelConfig, ids: jax.Array, hidden: jax.Array, *,
                capacity_factor: float | None = None, zero_h_first: bool = False, return_routing: bool = False):
    """MTP head (spec 4.1), teacher-forced: the row at position p (p = 1..T-1) consumes (ids[p],
    hidden[p-1]) and predicts ids[p+1]; its attention sees rows 1..p. ids [B, T], hidden [B, T, D]
    (final-normed trunk output). Returns MTP logits [B, T-1, V] for positions 1..T-1 (the convention
    of the fixtures' transformers MTP logits and of `engine.mtp_logits`). zero_h_first: also run the
    row (ids[0], h = 0) at position 0 first, which later rows attend to (llama.cpp's MTP KV catch-up);
    its logits are dropped."""
    c = config
    pre = f"blk.{c.mtp_layer}"
    if zero_h_first:
        x, h = ids, jnp.concatenate([jnp.zeros_like(hidden[:, :1]), hidden[:, :-1]], axis=1)
        positions = jnp.arange(ids.shape[1], dtype=jnp.int32)
    else:
        x, h = ids[:, 1:], hidden[:, :-1]
        positions = jnp.arange(1, ids.shape[1], dtype=jnp.int32)
    e = jnp.take(params["token_embd.weight"], x, axis=0)
    cat = jnp.concatenate([rms_norm(e, params[f"{pre}.nextn.enorm.weight"], c.rms_eps),
                           rms_norm(h, params[f"{pre}.nextn.hnorm.weight"], c.rms_eps)], axis=-1)
    u = _mm(cat, params[f"{pre}.nextn.eh_proj.weight"])
    y, r = _block(params, c, c.mtp_layer, u, positions, GDN_TRAIN_CHUNK, capacity_factor)
    if zero_h_first:
        y = y[:, 1:]
    hm = rms_norm(y, params[f"{pre}.nextn.shared_head_norm.weight"], c.rms_eps)
    logits = _mm(hm, params["output.weight"])
    return (logits, r) if return_routing else logits


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean token cross-entropy (nats) over mask == 1."""
    logz = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.sum((logz - tgt) * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def load_balance_loss(probs: jax.Array, k: int) -> jax.Array:
    """Switch-style auxiliary loss E * sum_e f_e * P_e (1.0 when balanced): f_e = fraction of top-k
    slots routed to e, P_e = mean router probability of e."""
    E = probs.shape[-1]
    flat = probs.reshape(-1, E)
    _, sel = jax.lax.top_k(flat, k)
    f = jnp.mean(jnp.sum(jax.nn.one_hot(sel, E, dtype=flat.dtype), axis=-2), axis=0) / k
    return E * jnp.sum(f * jnp.mean(flat, axis=0))


def loss_fn(params: Params, config: ModelConfig, ids: jax.Array, mask: jax.Array | None = None, *,
            mtp_weight: float = 0.3, aux_weight: float = 0.01, capacity_factor: float | None = None,
            gdn_chunk: int = GDN_TRAIN_CHUNK):
    """Next-token CE + mtp_weight * MTP CE + aux_weight * router load balance, on ids [B, T].

    The MTP row at position p predicts ids[p+1] from (ids[p], h[p-1]), i.e. two tokens past the
    trunk's h[p-1]. mask [B, T] (1 = real token) masks targets. Returns (total, metrics: loss, ce,
    mtp_ce, aux, kept)."""
    if mask is None:
        mask = jnp.ones(ids.shape, jnp.float32)
    logits, hidden, routing = forward(params, config, ids, capacity_factor=capacity_factor,
                                      gdn_chunk=gdn_chunk, return_routing=True)
    ce = cross_entropy(logits[:, :-1], ids[:, 1:], mask[:, 1:])
    total = ce
    metrics = {"ce": ce}
    if config.has_mtp:
        mlogits, r = mtp_forward(params, config, ids, hidden, capacity_factor=capacity_factor,
                                 return_routing=True)
        mtp_ce = cross_entropy(mlogits[:, :-1], ids[:, 2:], mask[:, 2:])
        total = total + mtp_weight * mtp_ce
        metrics["mtp_ce"] = mtp_ce
        routing = [*routing, r]
    aux = jnp.mean(jnp.stack([load_balance_loss(pr, config.n_expert_used) for pr, _ in routing]))
    metrics["aux"] = aux
    metrics["kept"] = jnp.mean(jnp.stack([kept for _, kept in routing]))
    total = total + aux_weight * aux
    metrics["loss"] = total
    return total, metrics


__all__ = ["cross_entropy", "delta_rule_chunked", "forward", "gated_attention", "gated_delta_net",
           "init_params", "load_balance_loss", "loss_fn", "moe", "mtp_forward", "param_names", "param_shapes",
           "params_from_gguf", "unit_lower_inverse"]
