"""Training on the inference modules: a qwen35moe model with its MTP head, float storage, a batch axis.

Parameters are a flat dict of float32 arrays keyed by GGUF tensor names, numpy-order shapes from
`model_tensor_plan` (a GGUF `{in, out}` matrix is `[out, in]` here), so `export_model_gguf` writes them
as they are and the inference engine reads back the same function. Values are stored as used: norm
weights include the converter's +1 (initialised at 1.0), `ssm_a` is -exp(A_log), GDN v-head n pairs with
k-head n % Hk (tiled), `attn_q` interleaves [q_h | gate_h] per head.

There is no second forward pass: inside the traced step the dict is laid out as the inference modules'
params by the loader's own recipes (`model.weights.trunk_recipes` / `block_recipes` / `mtp_recipes`:
row concatenations and transposes, so gradients flow back to the GGUF-named arrays), as float QTensors
(`float_t` Linear weights, a `float` embedding table), and `model.Transformer` / `model.mtp.MTPHead`
run a [B, T] batch from zero state: the mixers per sequence, the FFNs on all B*T rows at once. The
routed experts are `training.experts.FloatExperts` (dense, or capacity-limited dispatch), every MoE
layer sows its router probabilities for the balance loss, and the chunked Gated DeltaNet form uses
`RunConfig(gdn_solve="inverse")` (matrix powers: cheap to differentiate) with short chunks; attention
visits every KV chunk in a static loop (`attention_chunks="all"`, the inference bits, differentiable).
"""

from __future__ import annotations

import functools
import math
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from gguf import GGMLQuantizationType

from sharpi_jax.config import ModelConfig, RunConfig
from sharpi_jax.gguf.writer import model_tensor_plan
from sharpi_jax.model.cache import cache_shapes
from sharpi_jax.model.layers import float_weight
from sharpi_jax.model.mtp import MTPHead
from sharpi_jax.model.transformer import Transformer
from sharpi_jax.model.weights import (CONV, EMBEDDING, ROWS, VECTOR, Recipe, block_recipes, mtp_recipes,
                                     trunk_recipes)
from sharpi_jax.quant import QTensor
from sharpi_jax.training.experts import FloatExperts

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
# The inference modules on GGUF-named float params
# ----------------------------------------------------------------------------------------------------

class TrainingModel(nnx.Module):
    """The trunk and the MTP head with float experts; every MoE layer sows its router probabilities and
    every expert provider its kept fraction (`nnx.Intermediate`, see `routing`)."""

    def __init__(self, c: ModelConfig, run: RunConfig, capacity_factor: float | None):
        def experts(layer: int) -> FloatExperts:
            return FloatExperts(c, capacity_factor)

        self.trunk = Transformer(c, experts, run)
        self.mtp = MTPHead(c, experts(c.mtp_layer), run) if c.has_mtp else None
        self.set_attributes(record_router=True)


def _value(params: Params, recipe: Recipe):
    """A module param built from GGUF-named float arrays by its loader recipe (differentiable)."""
    kind, names = recipe
    if kind == ROWS:
        w = jnp.concatenate([params[n] for n in names], axis=0) if len(names) > 1 else params[names[0]]
        return float_weight(w.T)
    if kind == VECTOR:
        return params[names[0]].reshape(-1)
    if kind == CONV:
        return params[names[0]].T
    if kind == EMBEDDING:
        table = params[names[0]]
        return QTensor({"w": table}, int(GGMLQuantizationType.F32), tuple(table.shape), "float")
    raise ValueError(f"recipe kind {kind!r} has no float training form")


def _block_value(params: Params, c: ModelConfig, layer: int, path: tuple):
    if path[:2] == ("ffn", "experts"):  # FloatExperts.gate / up / down
        return params[f"blk.{layer}.ffn_{path[2]}_exps.weight"]
    return _value(params, block_recipes(c, layer, params.__contains__)[path])


def _param_value(params: Params, c: ModelConfig, path: tuple):
    """The value of the TrainingModel param at `path`."""
    part, rest = path[0], path[1:]
    has = params.__contains__
    if part == "trunk":
        if rest[0] == "layers":
            return _block_value(params, c, rest[1], rest[2:])
        return _value(params, trunk_recipes(c, has)[rest])
    if rest[0] == "block":
        return _block_value(params, c, c.mtp_layer, rest[1:])
    return _value(params, mtp_recipes(c, has)[rest])


@functools.lru_cache(maxsize=16)
def _skeleton(c: ModelConfig, capacity_factor: float | None, gdn_chunk: int):
    """(graphdef, flat abstract state) of a TrainingModel (built once per configuration, no arrays)."""
    run = RunConfig(gdn_chunk=gdn_chunk, gdn_solve="inverse", attention_chunks="all", gdn_step="xla")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: TrainingModel(c, run, capacity_factor)))
    return graphdef, [(tuple(p), v) for p, v in nnx.to_flat_state(state)]


def build(params: Params, config: ModelConfig, *, capacity_factor: float | None = None,
          gdn_chunk: int = GDN_TRAIN_CHUNK) -> TrainingModel:
    """A TrainingModel whose every param is taken from the GGUF-named `params` (jittable: call it
    inside the traced function, so gradients reach `params`)."""
    if config.arch != "qwen35moe" or not config.is_moe:
        raise ValueError(f"training supports arch qwen35moe with experts, got {config.arch}")
    graphdef, flat = _skeleton(config, capacity_factor, int(gdn_chunk))
    state = nnx.from_flat_state([(p, v.replace(_param_value(params, config, p))) for p, v in flat])
    return nnx.merge(graphdef, state)


def routing(moe: nnx.Module) -> tuple[jax.Array, jax.Array]:
    """(router probs [N, E], kept fraction) sown by a MoE layer's last call."""
    return moe.router_probs.get_value()[-1], moe.experts.kept.get_value()[-1]


def _zero_caches(shapes, batch: int):
    """Per-sequence zero caches: the pytree of ShapeDtypeStructs with a leading batch axis."""
    return jax.tree.map(lambda s: jnp.zeros((batch, *s.shape), s.dtype), shapes)


def _trunk(model: TrainingModel, c: ModelConfig, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    B, T = ids.shape
    state = _zero_caches(tuple(cache_shapes(c, i, T) for i in range(c.n_layer)), B)
    hidden, _ = model.trunk.prefill(state, ids, jnp.int32(0), jnp.int32(T))
    return model.trunk.lm_head(hidden), hidden


def _mtp(model: TrainingModel, c: ModelConfig, ids: jax.Array, hidden: jax.Array, zero_h_first: bool) -> jax.Array:
    B, T = ids.shape
    if zero_h_first:
        x, h = ids, jnp.concatenate([jnp.zeros_like(hidden[:, :1]), hidden[:, :-1]], axis=1)
    else:  # the head's own positions start at 0, as the engine's (rope sees only differences)
        x, h = ids[:, 1:], hidden[:, :-1]
    cache = _zero_caches(cache_shapes(c, c.mtp_layer, T), B)
    hm, _ = model.mtp(x, h, jnp.int32(0), jnp.int32(x.shape[1]), cache)
    logits = model.mtp.logits(hm)
    return logits[:, 1:] if zero_h_first else logits


def forward(params: Params, config: ModelConfig, ids: jax.Array, *, capacity_factor: float | None = None,
            gdn_chunk: int = GDN_TRAIN_CHUNK, return_routing: bool = False):
    """Trunk forward of ids [B, T] from position 0 -> (logits [B, T, V], final-normed hidden [B, T, D]);
    with return_routing also a list of per-layer (router probs, kept fraction). capacity_factor None is
    the inference function (see `training.experts`)."""
    model = build(params, config, capacity_factor=capacity_factor, gdn_chunk=gdn_chunk)
    logits, hidden = _trunk(model, config, ids)
    if return_routing:
        return logits, hidden, [routing(blk.ffn) for blk in model.trunk.layers]
    return logits, hidden


def mtp_forward(params: Params, config: ModelConfig, ids: jax.Array, hidden: jax.Array, *,
                capacity_factor: float | None = None, zero_h_first: bool = False, return_routing: bool = False):
    """MTP head, teacher-forced: the row at position p (p = 1..T-1) consumes (ids[p], hidden[p-1]) and
    predicts ids[p+1]; its attention sees rows 1..p (at the head's positions 0..p-1, as the engine's).
    ids [B, T], hidden [B, T, D] (final-normed trunk
    output). Returns MTP logits [B, T-1, V] for positions 1..T-1 (the convention of the fixtures'
    transformers MTP logits and of `engine.mtp_logits`). zero_h_first: also run the row (ids[0], h = 0)
    at position 0 first, which later rows attend to (llama.cpp's MTP KV catch-up); its logits are
    dropped."""
    model = build(params, config, capacity_factor=capacity_factor)
    logits = _mtp(model, config, ids, hidden, zero_h_first)
    return (logits, routing(model.mtp.block.ffn)) if return_routing else logits


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
    model = build(params, config, capacity_factor=capacity_factor, gdn_chunk=gdn_chunk)
    logits, hidden = _trunk(model, config, ids)
    ce = cross_entropy(logits[:, :-1], ids[:, 1:], mask[:, 1:])
    total = ce
    metrics = {"ce": ce}
    moes = [blk.ffn for blk in model.trunk.layers]
    if config.has_mtp:
        mtp_ce = cross_entropy(_mtp(model, config, ids, hidden, False)[:, :-1], ids[:, 2:], mask[:, 2:])
        total = total + mtp_weight * mtp_ce
        metrics["mtp_ce"] = mtp_ce
        moes.append(model.mtp.block.ffn)
    routes = [routing(m) for m in moes]
    aux = jnp.mean(jnp.stack([load_balance_loss(probs, config.n_expert_used) for probs, _ in routes]))
    metrics["aux"] = aux
    metrics["kept"] = jnp.mean(jnp.stack([kept for _, kept in routes]))
    total = total + aux_weight * aux
    metrics["loss"] = total
    return total, metrics


__all__ = ["TrainingModel", "build", "cross_entropy", "forward", "init_params", "load_balance_loss", "loss_fn",
           "mtp_forward", "param_names", "param_shapes", "params_from_gguf", "routing"]
