"""GGUF tensors -> Transformer params: one table from param path to GGUF name(s) and a transform.

Every matrix keeps its GGUF encoding: a Linear holds the file's `[out, in]` rows as QTensors in the
layout the `MatrixFormat` chooses (kernel backend + explicit repacking, `sharpi_jax.quant`); fused
projections stack their parts' rows: attention [q+gate | k | v], GDN [qkv | z | beta | alpha], router
[E experts | shared-expert gate], SwiGLU [gate | up] (parts of different ggml types stay separate
QTensors). `token_embd` is a QTensor too (a lookup dequantizes the rows it gathers); the routed
experts' modules and params come from an `ExpertLoader` (`sharpi_jax.experts`). Norms, conv, ssm_a
and dt bias are float32 vectors. The skeleton comes from `nnx.eval_shape`, so nothing is allocated
twice.
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
from sharpi_jax.quant import MatrixFormat, QTensor, abstract, pack_rows, resolve_kernels

PROGRESS_MIN_BYTES = 256 << 20  # show a progress bar for files at least this large
Source = Callable[[], Any]  # loads one param's value


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


def _source(f: GGUFFile, name: str) -> tuple[int, np.ndarray, int]:
    """(ggml type, uint8 rows [rows, row_bytes] (a zero-copy view), cols) of a matrix or vector."""
    t = f.tensor(name)
    raw = f.raw(name)
    return int(t.qtype), raw.reshape(-1, raw.shape[-1]), t.shape[-1]


def _matrix(fmt: MatrixFormat, *sources: tuple[int, np.ndarray, int]) -> tuple[QTensor, ...]:
    """Matrices stacked along their rows (outputs), as QTensors: consecutive sources of one ggml type
    share one QTensor (their GGUF rows concatenated), so a fused projection of one type is one matmul."""
    runs: list[list] = []
    for qtype, raw, cols in sources:
        if runs and runs[-1][0] == qtype:
            runs[-1][1].append(raw)
        else:
            runs.append([qtype, [raw], cols])
    out = []
    for qtype, raws, cols in runs:
        raw = raws[0] if len(raws) == 1 else np.concatenate(raws, axis=0)
        out.append(pack_rows(raw, qtype, cols, fmt.layout(qtype, (raw.shape[0], cols))))
    return tuple(out)


def _rows(f: GGUFFile, fmt: MatrixFormat, *names: str) -> tuple[QTensor, ...]:
    """GGUF matrices `names`, rows stacked (fusion), as a Linear weight."""
    return _matrix(fmt, *(_source(f, n) for n in names))


def _vector(f: GGUFFile, name: str) -> np.ndarray:
    return np.ascontiguousarray(_float(f, name).reshape(-1))


def _split_ba(f: GGUFFile, name: str, c: ModelConfig) -> list[tuple[int, np.ndarray, int]]:
    """qwen3next ssm_ba [2Hv, D]: per k-group g the rows are [b (r) | a (r)] (beta first, then alpha).
    Returns the (beta, alpha) row sources [Hv, D] in grouped v-head order (GGUF rows regrouped)."""
    qtype, raw, cols = _source(f, name)
    Hk, r = c.ssm_n_group, c.gdn_head_ratio
    raw = raw.reshape(Hk, 2 * r, -1)
    return [(qtype, np.ascontiguousarray(raw[:, :r]).reshape(Hk * r, -1), cols),
            (qtype, np.ascontiguousarray(raw[:, r:]).reshape(Hk * r, -1), cols)]


def non_expert_bytes(f: GGUFFile, c: ModelConfig, fmt: MatrixFormat = MatrixFormat()) -> int:
    """Device bytes of every trunk and MTP tensor but the routed experts, as `load_model` / `load_mtp`
    hold them in `fmt` (from the tensor table and layouts: nothing is read or allocated)."""
    total = 0
    for name, t in f.tensors.items():
        if "_exps." in name:
            continue
        if len(t.shape) == 2 and name != "token_embd.weight" and not name.endswith("embed_tokens.weight"):
            total += abstract(int(t.qtype), t.shape, fmt.layout(int(t.qtype), t.shape)).nbytes
        elif len(t.shape) == 2:  # embedding tables keep their GGUF bytes (float types: as floats)
            total += t.nbytes
        else:  # vectors, ssm_conv1d: float32
            total += 4 * t.n_elements
    if "output.weight" not in f.tensors:  # a tied LM head is its own matrix in the chosen layout
        t = f.tensor("token_embd.weight")
        total += abstract(int(t.qtype), t.shape, fmt.layout(int(t.qtype), t.shape)).nbytes
    return total


def _embedding(f: GGUFFile, name: str) -> QTensor:
    """An embedding table [n_vocab, D] in its GGUF encoding (float types as float arrays)."""
    qtype, raw, cols = _source(f, name)
    layout = "float" if qtype in (0, 1, 30) else "blocks"  # F32, F16, BF16
    return pack_rows(raw, qtype, cols, layout)


def _param_source(f: GGUFFile, c: ModelConfig, fmt: MatrixFormat, path: tuple,
                  experts: ExpertLoader | None) -> Source:
    """The loader of one param, by its nnx path."""
    if path == ("embed", "table"):
        return lambda: _embedding(f, "token_embd.weight")
    if path == ("output_norm", "weight"):
        return lambda: _vector(f, "output_norm.weight")
    if path == ("lm_head", "w"):
        head = "output.weight" if "output.weight" in f.tensors else "token_embd.weight"  # tied
        return lambda: _rows(f, fmt, head)
    if path[0] != "layers":
        raise KeyError(path)
    return _block_source(f, c, fmt, path[1], tuple(path[2:]), experts)


def _block_source(f: GGUFFile, c: ModelConfig, fmt: MatrixFormat, i: int, rest: tuple,
                  experts: ExpertLoader | None) -> Source:
    """The loader of one param of block `i` (trunk or MTP), by its path inside the Block."""
    p = f"blk.{i}"
    rows = lambda *names: _rows(f, fmt, *names)  # noqa: E731
    if rest[:2] == ("ffn", "experts") and experts is not None:
        return experts.source(i, tuple(rest[2:]))
    simple = {
        ("attn_norm", "weight"): lambda: _vector(f, f"{p}.attn_norm.weight"),
        ("post_norm", "weight"): lambda: _vector(f, f"{p}.post_attention_norm.weight"),
        # gated attention
        ("mixer", "w_qkv", "w"): lambda: (rows(f"{p}.attn_qkv.weight") if f"{p}.attn_qkv.weight" in f.tensors
                                          else rows(f"{p}.attn_q.weight", f"{p}.attn_k.weight",
                                                     f"{p}.attn_v.weight")),
        ("mixer", "w_o", "w"): lambda: rows(f"{p}.attn_output.weight"),
        ("mixer", "q_norm", "weight"): lambda: _vector(f, f"{p}.attn_q_norm.weight"),
        ("mixer", "k_norm", "weight"): lambda: _vector(f, f"{p}.attn_k_norm.weight"),
        # gated delta net
        ("mixer", "w_in", "w"): lambda: _gdn_in(f, c, fmt, p),
        ("mixer", "conv_w"): lambda: np.ascontiguousarray(_float(f, f"{p}.ssm_conv1d.weight").T),
        ("mixer", "dt_bias"): lambda: _vector(f, f"{p}.ssm_dt.bias"),
        ("mixer", "a"): lambda: _vector(f, f"{p}.ssm_a"),
        ("mixer", "norm"): lambda: _vector(f, f"{p}.ssm_norm.weight"),
        ("mixer", "w_out", "w"): lambda: rows(f"{p}.ssm_out.weight"),
        # MoE
        ("ffn", "router", "w"): lambda: rows(f"{p}.ffn_gate_inp.weight",
                                              *([f"{p}.ffn_gate_inp_shexp.weight"] if c.shared_expert_ff else [])),
        ("ffn", "shared", "gate_up", "w"): lambda: rows(f"{p}.ffn_gate_shexp.weight", f"{p}.ffn_up_shexp.weight"),
        ("ffn", "shared", "down", "w"): lambda: rows(f"{p}.ffn_down_shexp.weight"),
        # dense FFN (qwen35)
        ("ffn", "gate_up", "w"): lambda: rows(f"{p}.ffn_gate.weight", f"{p}.ffn_up.weight"),
        ("ffn", "down", "w"): lambda: rows(f"{p}.ffn_down.weight"),
    }
    return simple[rest]


def _gdn_in(f: GGUFFile, c: ModelConfig, fmt: MatrixFormat, p: str) -> tuple[QTensor, ...]:
    sources = [_source(f, f"{p}.attn_qkv.weight"), _source(f, f"{p}.attn_gate.weight")]
    if f"{p}.ssm_ba.weight" in f.tensors:
        sources += _split_ba(f, f"{p}.ssm_ba.weight", c)
    else:
        sources += [_source(f, f"{p}.ssm_beta.weight"), _source(f, f"{p}.ssm_alpha.weight")]
    return _matrix(fmt, *sources)


def _check_supported(f: GGUFFile) -> None:
    scales = [n for n in f.tensors if n.endswith(".scale")]
    if scales:
        raise GGUFError(f"{f.source}: per-tensor '.scale' companions ({scales[0]!r}, ...) are not supported")
    legacy = [n for n in f.tensors if n.endswith(".ssm_in.weight")]
    if legacy:
        raise GGUFError(f"{f.source}: legacy fused 'ssm_in' GDN tensors ({legacy[0]!r}) are not supported; "
                        "reconvert with a current llama.cpp")


def _logical(value) -> str:
    """What a param value is, for shape checks: a Linear's QTensor parts as [rows, cols], a QTensor
    by its logical shape, an array by dtype and shape."""
    if isinstance(value, tuple) and value and all(isinstance(p, QTensor) for p in value):
        return f"matrix{[sum(p.rows for p in value), value[0].cols]}"
    if isinstance(value, QTensor):
        return f"tensor{list(value.shape)}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_logical(v)}" for k, v in sorted(value.items())) + "}"
    return f"{np.dtype(value.dtype)}{list(value.shape)}"


def _fill(f: GGUFFile, make: Callable[[], nnx.Module], source: Callable[[tuple], Callable[[], Any]],
          progress: bool):
    """eval_shape skeleton of `make()`, every param loaded through `source(path)`, merged. A value's
    storage (QTensor parts and layouts) may differ from the skeleton's; its logical shape may not."""
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
        value = load()
        if not isinstance(value, (tuple, QTensor)):
            value = jnp.asarray(value)
        got, want = _logical(value), _logical(var.get_value())
        if got != want:
            raise GGUFError(f"{f.source}: parameter {where} loaded as {got}, expected {want}")
        filled.append((path, var.replace(value)))
    return nnx.merge(graphdef, nnx.from_flat_state(filled))


def matrix_format(run: RunConfig) -> MatrixFormat:
    """How a run holds the model's matrices: its resolved kernel backend and repacking."""
    return MatrixFormat(resolve_kernels(run.kernels), run.repack)


def _experts_for(f: GGUFFile, config: ModelConfig, experts: ExpertLoader | None) -> ExpertLoader | None:
    if config.is_moe and experts is None:
        raise GGUFError(f"{f.source}: a MoE model needs an expert loader (sharpi_jax.experts.GGUFExperts)")
    return experts


def load_model(f: GGUFFile, config: ModelConfig, experts: ExpertLoader | None = None,
               progress: bool | None = None, run: RunConfig = RunConfig()) -> Transformer:
    """Build the Transformer (trunk) of an open GGUF; `experts` provides the routed experts of MoE
    models (`sharpi_jax.experts.GGUFExperts`: whole stacks, or device slots under an expert budget).
    progress=None shows a tqdm bar for large files; run: how the blocks run and how matrices are held
    (its kernels and repack, `matrix_format`)."""
    _check_supported(f)
    experts = _experts_for(f, config, experts)
    if progress is None:
        progress = f.file_size >= PROGRESS_MIN_BYTES
    fmt = matrix_format(run)
    return _fill(f, lambda: Transformer(config, experts.modules() if experts is not None else None, run),
                 lambda path: _param_source(f, config, fmt, path, experts), progress)


def load_block(f: GGUFFile, config: ModelConfig, layer: int, experts: ExpertLoader | None = None,
               run: RunConfig = RunConfig()) -> Block:
    """One decoder block `blk.{layer}` with the trunk's layout and conventions, e.g. the MTP block's
    attention + FFN (`layer = config.mtp_layer`; its `nextn.*` extras are not part of a Block)."""
    _check_supported(f)
    experts = _experts_for(f, config, experts)
    return _fill(f, lambda: Block(config, layer, experts.modules()(layer) if experts is not None else None, run),
                 lambda path: _block_source(f, config, matrix_format(run), layer, path, experts), False)


def _mtp_source(f: GGUFFile, c: ModelConfig, fmt: MatrixFormat, trunk: Transformer | None, path: tuple,
                experts: ExpertLoader | None) -> Source:
    """The loader of one MTPHead param (nextn.* extras with their trunk fallbacks: embedding and LM
    head are the trunk's unless the file has nextn.embed_tokens / nextn.shared_head_head)."""
    p = f"blk.{c.mtp_layer}"
    own_embed, own_head = f"{p}.nextn.embed_tokens.weight", f"{p}.nextn.shared_head_head.weight"
    if path == ("embed", "table"):
        if own_embed in f.tensors:
            return lambda: _embedding(f, own_embed)
        if trunk is not None:
            return lambda: trunk.embed.table.get_value()  # the same arrays: no second copy
        return lambda: _embedding(f, "token_embd.weight")
    if path == ("lm_head", "w"):
        if own_head in f.tensors:
            return lambda: _rows(f, fmt, own_head)
        if trunk is not None:
            return lambda: trunk.lm_head.w.get_value()  # the same arrays: no second copy of the LM head
        return lambda: _rows(f, fmt, "output.weight" if "output.weight" in f.tensors else "token_embd.weight")
    norm = f"{p}.nextn.shared_head_norm.weight"
    simple = {
        ("enorm", "weight"): lambda: _vector(f, f"{p}.nextn.enorm.weight"),
        ("hnorm", "weight"): lambda: _vector(f, f"{p}.nextn.hnorm.weight"),
        ("eh_proj", "w"): lambda: _rows(f, fmt, f"{p}.nextn.eh_proj.weight"),
        ("shared_head_norm", "weight"): lambda: _vector(f, norm if norm in f.tensors else "output_norm.weight"),
    }
    if path in simple:
        return simple[path]
    if path[0] != "block":
        raise KeyError(path)
    return _block_source(f, c, fmt, c.mtp_layer, tuple(path[1:]), experts)


def load_mtp(f: GGUFFile, config: ModelConfig, trunk: Transformer | None = None,
             experts: ExpertLoader | None = None, run: RunConfig = RunConfig()) -> MTPHead:
    """The MTP head of an open GGUF (`config.has_mtp`). With `trunk`, the shared embedding and LM head
    are the trunk's arrays (no copies); without, they are loaded from the file. `experts`: as for
    `load_model` (the MTP block's experts are always whole stacks)."""
    _check_supported(f)
    if not config.has_mtp:
        raise GGUFError(f"{f.source}: the model has no MTP block (nextn_predict_layers = 0)")
    experts = _experts_for(f, config, experts)
    def make() -> MTPHead:
        return MTPHead(config, experts.modules()(config.mtp_layer) if experts is not None else None, run)

    return _fill(f, make, lambda path: _mtp_source(f, config, matrix_format(run), trunk, path, experts), False)
