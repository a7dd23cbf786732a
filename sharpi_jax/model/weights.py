"""GGUF tensors -> Transformer params: one table from param path to GGUF name(s) and a transform.

What is materialized (float32, dequantized once at load): every dense matrix (attention, GDN
projections, shared expert, dense FFN, router, LM head), norms, conv, ssm_a, dt bias. What stays in its
GGUF encoding (dequantized inside the jitted step, only the rows used): `token_embd` (raw block rows)
and the routed experts, whose modules and params come from an `ExpertLoader` (`sharpi_jax.experts`).
Matrices are transposed to [in, out] and fused: attention [q+gate | k | v], GDN [qkv | z | beta |
alpha], router [E experts | shared-expert gate], SwiGLU [gate | up]. The skeleton comes from
`nnx.eval_shape`, so nothing is allocated twice.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import jax.numpy as jnp
import numpy as np
from flax import nnx
from gguf import GGMLQuantizationType

from sharpi_jax.config import ModelConfig, RunConfig
from sharpi_jax.errors import GGUFError
from sharpi_jax.gguf import quants
from sharpi_jax.gguf.reader import GGUFFile
from sharpi_jax.model.mtp import MTPHead
from sharpi_jax.model.transformer import Block, Transformer

PROGRESS_MIN_BYTES = 256 << 20  # show a progress bar for files at least this large
CHUNK_VALUES = 1 << 24  # dequantize big tensors in fixed-size row chunks (bounded memory, one compile)
Source = Callable[[], Any]  # loads one param's array


class ExpertLoader(Protocol):
    """The routed experts of a MoE model: each block's provider module and the loader of its params."""

    def modules(self) -> Callable[[int], nnx.Module]:
        """A factory for one model build: layer -> that block's routed experts (a `moe.ExpertProvider`,
        zero-filled; `source` loads its params). The modules of one build may share variables."""

    def source(self, layer: int, path: tuple) -> Source:
        """The loader of one param of that module, by its path inside the module."""


def _float(f: GGUFFile, name: str) -> np.ndarray:
    """A small tensor as float32 numpy (dequantized bitwise as gguf.quants)."""
    t = f.tensor(name)
    if t.qtype == GGMLQuantizationType.F32:
        return f.array(name)
    return np.asarray(quants.dequantize(f.raw(name), t.qtype, t.shape, name=f"{f.source}:{name}"))


def _row_chunks(f: GGUFFile, name: str):
    """Yield (row0, float32 [rows, cols]) pieces of a 2-D (or {D,1}) tensor, in order."""
    t = f.tensor(name)
    cols = t.shape[-1]
    n_rows = t.n_elements // cols
    if t.qtype == GGMLQuantizationType.F32:
        yield 0, f.array(name).reshape(n_rows, cols)
        return
    raw = f.raw(name).reshape(n_rows, -1)
    step = max(1, CHUNK_VALUES // cols)
    if n_rows <= step:
        yield 0, np.asarray(quants.dequantize(raw, t.qtype, (n_rows, cols), name=f"{f.source}:{name}"))
        return
    buf = np.zeros((step, raw.shape[1]), np.uint8)  # fixed shape: the jitted dequantizer compiles once
    for r0 in range(0, n_rows, step):
        n = min(step, n_rows - r0)
        buf[:n] = raw[r0:r0 + n]
        out = np.asarray(quants.dequantize(buf, t.qtype, (step, cols), name=f"{f.source}:{name}"))
        yield r0, out[:n]


def _rows(f: GGUFFile, *names: str) -> np.ndarray:
    """Dequantize [out, in] matrices, stack their rows (fusion) and return the [in, out] transpose,
    written chunk by chunk (peak memory: the result plus one chunk)."""
    infos = [f.tensor(n) for n in names]
    cols = infos[0].shape[-1]
    sizes = [t.n_elements // cols for t in infos]
    out = np.empty((cols, sum(sizes)), np.float32)
    base = 0
    for name, size in zip(names, sizes):
        for r0, piece in _row_chunks(f, name):
            out[:, base + r0: base + r0 + piece.shape[0]] = piece.T
        base += size
    return out


def _vector(f: GGUFFile, name: str) -> np.ndarray:
    return np.ascontiguousarray(_float(f, name).reshape(-1))


def _split_ba(f: GGUFFile, name: str, c: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """qwen3next ssm_ba [2Hv, D]: per k-group g the rows are [b (r) | a (r)] (spec 3.3 step 1).
    Returns (W_beta, W_alpha) [Hv, D] in grouped v-head order."""
    w = _float(f, name)
    Hk, r = c.ssm_n_group, c.gdn_head_ratio
    w = w.reshape(Hk, 2 * r, -1)
    return w[:, :r].reshape(Hk * r, -1), w[:, r:].reshape(Hk * r, -1)


def _param_source(f: GGUFFile, c: ModelConfig, path: tuple, experts: ExpertLoader | None) -> Source:
    """The loader of one param, by its nnx path."""
    if path == ("embed", "raw"):
        return lambda: f.raw("token_embd.weight")
    if path == ("output_norm", "weight"):
        return lambda: _vector(f, "output_norm.weight")
    if path == ("lm_head", "w"):
        head = "output.weight" if "output.weight" in f.tensors else "token_embd.weight"  # tied
        return lambda: _rows(f, head)
    if path[0] != "layers":
        raise KeyError(path)
    return _block_source(f, c, path[1], tuple(path[2:]), experts)


def _block_source(f: GGUFFile, c: ModelConfig, i: int, rest: tuple, experts: ExpertLoader | None) -> Source:
    """The loader of one param of block `i` (trunk or MTP), by its path inside the Block."""
    p = f"blk.{i}"
    if rest[:2] == ("ffn", "experts") and experts is not None:
        return experts.source(i, tuple(rest[2:]))
    simple = {
        ("attn_norm", "weight"): lambda: _vector(f, f"{p}.attn_norm.weight"),
        ("post_norm", "weight"): lambda: _vector(f, f"{p}.post_attention_norm.weight"),
        # gated attention
        ("mixer", "w_qkv", "w"): lambda: (_rows(f, f"{p}.attn_qkv.weight") if f"{p}.attn_qkv.weight" in f.tensors
                                          else _rows(f, f"{p}.attn_q.weight", f"{p}.attn_k.weight",
                                                     f"{p}.attn_v.weight")),
        ("mixer", "w_o", "w"): lambda: _rows(f, f"{p}.attn_output.weight"),
        ("mixer", "q_norm", "weight"): lambda: _vector(f, f"{p}.attn_q_norm.weight"),
        ("mixer", "k_norm", "weight"): lambda: _vector(f, f"{p}.attn_k_norm.weight"),
        # gated delta net
        ("mixer", "w_in", "w"): lambda: _gdn_in(f, c, p),
        ("mixer", "conv_w"): lambda: np.ascontiguousarray(_float(f, f"{p}.ssm_conv1d.weight").T),
        ("mixer", "dt_bias"): lambda: _vector(f, f"{p}.ssm_dt.bias"),
        ("mixer", "a"): lambda: _vector(f, f"{p}.ssm_a"),
        ("mixer", "norm"): lambda: _vector(f, f"{p}.ssm_norm.weight"),
        ("mixer", "w_out", "w"): lambda: _rows(f, f"{p}.ssm_out.weight"),
        # MoE
        ("ffn", "router", "w"): lambda: _rows(f, f"{p}.ffn_gate_inp.weight",
                                              *([f"{p}.ffn_gate_inp_shexp.weight"] if c.shared_expert_ff else [])),
        ("ffn", "shared", "gate_up", "w"): lambda: _rows(f, f"{p}.ffn_gate_shexp.weight", f"{p}.ffn_up_shexp.weight"),
        ("ffn", "shared", "down", "w"): lambda: _rows(f, f"{p}.ffn_down_shexp.weight"),
        # dense FFN (qwen35)
        ("ffn", "gate_up", "w"): lambda: _rows(f, f"{p}.ffn_gate.weight", f"{p}.ffn_up.weight"),
        ("ffn", "down", "w"): lambda: _rows(f, f"{p}.ffn_down.weight"),
    }
    return simple[rest]


def _gdn_in(f: GGUFFile, c: ModelConfig, p: str) -> np.ndarray:
    qkv_z = _rows(f, f"{p}.attn_qkv.weight", f"{p}.attn_gate.weight")
    if f"{p}.ssm_ba.weight" in f.tensors:
        ba = list(_split_ba(f, f"{p}.ssm_ba.weight", c))
    else:
        ba = [_float(f, f"{p}.ssm_beta.weight"), _float(f, f"{p}.ssm_alpha.weight")]
    return np.concatenate([qkv_z, np.concatenate(ba, axis=0).T], axis=1)


def _check_supported(f: GGUFFile) -> None:
    scales = [n for n in f.tensors if n.endswith(".scale")]
    if scales:
        raise GGUFError(f"{f.source}: per-tensor '.scale' companions ({scales[0]!r}, ...) are not supported")
    legacy = [n for n in f.tensors if n.endswith(".ssm_in.weight")]
    if legacy:
        raise GGUFError(f"{f.source}: legacy fused 'ssm_in' GDN tensors ({legacy[0]!r}) are not supported; "
                        "reconvert with a current llama.cpp")


def _fill(f: GGUFFile, make: Callable[[], nnx.Module], source: Callable[[tuple], Callable[[], np.ndarray]],
          progress: bool):
    """eval_shape skeleton of `make()`, every param loaded through `source(path)`, merged."""
    graphdef, abstract_state = nnx.split(nnx.eval_shape(make))
    flat = list(nnx.to_flat_state(abstract_state))
    it = flat
    if progress:
        from tqdm import tqdm
        it = tqdm(flat, desc=f"loading {f.path.name}", unit="tensor", leave=False)
    filled = []
    for path, var in it:
        where = "/".join(map(str, path))
        try:
            load = source(tuple(path))
        except KeyError:
            raise GGUFError(f"{f.source}: no GGUF source for parameter {where}") from None
        arr = load()
        want = var.get_value()
        if tuple(arr.shape) != tuple(want.shape) or arr.dtype != want.dtype:
            raise GGUFError(f"{f.source}: parameter {where} loaded as {arr.dtype}{list(arr.shape)}, "
                            f"expected {want.dtype}{list(want.shape)}")
        filled.append((path, var.replace(jnp.asarray(arr))))
    return nnx.merge(graphdef, nnx.from_flat_state(filled))


def _experts_for(f: GGUFFile, config: ModelConfig, experts: ExpertLoader | None) -> ExpertLoader | None:
    if config.is_moe and experts is None:
        raise GGUFError(f"{f.source}: a MoE model needs an expert loader (sharpi_jax.experts.GGUFExperts)")
    return experts


def load_model(f: GGUFFile, config: ModelConfig, experts: ExpertLoader | None = None,
               progress: bool | None = None, run: RunConfig = RunConfig()) -> Transformer:
    """Build the Transformer (trunk) of an open GGUF; `experts` provides the routed experts of MoE
    models (`sharpi_jax.experts.GGUFExperts`: whole stacks, or device slots under an expert budget).
    progress=None shows a tqdm bar for large files; run: how the blocks run."""
    _check_supported(f)
    experts = _experts_for(f, config, experts)
    if progress is None:
        progress = f.file_size >= PROGRESS_MIN_BYTES
    embed_qtype = int(f.tensor("token_embd.weight").qtype)
    return _fill(f, lambda: Transformer(config, embed_qtype, experts.modules() if experts is not None else None, run),
                 lambda path: _param_source(f, config, path, experts), progress)


def load_block(f: GGUFFile, config: ModelConfig, layer: int, experts: ExpertLoader | None = None,
               run: RunConfig = RunConfig()) -> Block:
    """One decoder block `blk.{layer}` with the trunk's layout and conventions, e.g. the MTP block's
    attention + FFN (`layer = config.mtp_layer`; its `nextn.*` extras are not part of a Block)."""
    _check_supported(f)
    experts = _experts_for(f, config, experts)
    return _fill(f, lambda: Block(config, layer, experts.modules()(layer) if experts is not None else None, run),
                 lambda path: _block_source(f, config, layer, path, experts), False)


def _mtp_source(f: GGUFFile, c: ModelConfig, trunk: Transformer | None, path: tuple,
                experts: ExpertLoader | None) -> Source:
    """The loader of one MTPHead param (nextn.* extras with their trunk fallbacks)."""
    p = f"blk.{c.mtp_layer}"
    own_embed, own_head = f"{p}.nextn.embed_tokens.weight", f"{p}.nextn.shared_head_head.weight"
    if path == ("embed", "raw"):
        if own_embed in f.tensors:
            return lambda: f.raw(own_embed)
        return (lambda: trunk.embed.raw[...]) if trunk is not None else (lambda: f.raw("token_embd.weight"))
    if path == ("lm_head", "w"):
        if own_head in f.tensors:
            return lambda: _rows(f, own_head)
        if trunk is not None:
            return lambda: trunk.lm_head.w[...]  # the same array: no second copy of the LM head
        return lambda: _rows(f, "output.weight" if "output.weight" in f.tensors else "token_embd.weight")
    norm = f"{p}.nextn.shared_head_norm.weight"
    simple = {
        ("enorm", "weight"): lambda: _vector(f, f"{p}.nextn.enorm.weight"),
        ("hnorm", "weight"): lambda: _vector(f, f"{p}.nextn.hnorm.weight"),
        ("eh_proj", "w"): lambda: _rows(f, f"{p}.nextn.eh_proj.weight"),
        ("shared_head_norm", "weight"): lambda: _vector(f, norm if norm in f.tensors else "output_norm.weight"),
    }
    if path in simple:
        return simple[path]
    if path[0] != "block":
        raise KeyError(path)
    return _block_source(f, c, c.mtp_layer, tuple(path[1:]), experts)


def load_mtp(f: GGUFFile, config: ModelConfig, trunk: Transformer | None = None,
             experts: ExpertLoader | None = None, run: RunConfig = RunConfig()) -> MTPHead:
    """The MTP head of an open GGUF (`config.has_mtp`). With `trunk`, the shared embedding and LM head
    are the trunk's arrays (no copies); without, they are loaded from the file. `experts`: as for
    `load_model` (the MTP block's experts are always whole stacks)."""
    _check_supported(f)
    if not config.has_mtp:
        raise GGUFError(f"{f.source}: the model has no MTP block (nextn_predict_layers = 0)")
    experts = _experts_for(f, config, experts)
    p = f"blk.{config.mtp_layer}"
    embed_name = f"{p}.nextn.embed_tokens.weight"
    embed_qtype = int(f.tensor(embed_name if embed_name in f.tensors else "token_embd.weight").qtype)

    def make() -> MTPHead:
        return MTPHead(config, embed_qtype, experts.modules()(config.mtp_layer) if experts is not None else None, run)

    return _fill(f, make,
                 lambda path: _mtp_source(f, config, trunk, path, experts), False)
