"""GGUF tensors -> Transformer params: one table from param path to GGUF name(s) and a transform (the
recipes; training builds the same params from float arrays by them).

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
from sharpi_jax.quant import MatrixFormat, QTensor, abstract, pack_rows

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
        out.append(fmt.pack_rows(raw, qtype, cols))
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


# How a param is made of GGUF tensors, its `Recipe` (kind, tensor names): the loader reads recipes from a
# file; training builds the same params from float arrays keyed by GGUF names.
ROWS = "rows"  # a Linear weight: the matrices' [out, in] rows stacked in order (a fused projection)
ROWS_BA = "rows+ba"  # ROWS of names[:-1], then the (beta, alpha) rows of qwen3next's fused ssm_ba (names[-1])
VECTOR = "vector"  # a float32 vector (norms, dt bias, ssm_a)
CONV = "conv"  # ssm_conv1d [C, Kc], held transposed [Kc, C]
EMBEDDING = "embedding"  # a token table [n_vocab, D] (TokenEmbedding.table)
Recipe = tuple[str, tuple[str, ...]]


def trunk_recipes(c: ModelConfig, has: Callable[[str], bool]) -> dict[tuple, Recipe]:
    """Recipes of the trunk's own params (its blocks': `block_recipes`); has(name): whether the tensor
    exists (no `output.weight`: the LM head is tied to `token_embd`)."""
    return {
        ("embed", "table"): (EMBEDDING, ("token_embd.weight",)),
        ("output_norm", "weight"): (VECTOR, ("output_norm.weight",)),
        ("lm_head", "w"): (ROWS, ("output.weight" if has("output.weight") else "token_embd.weight",)),
    }


def block_recipes(c: ModelConfig, i: int, has: Callable[[str], bool]) -> dict[tuple, Recipe]:
    """Recipes of block `i`'s params (trunk or MTP) by their path inside the Block; the routed experts
    are their provider's (`ExpertLoader`)."""
    p = f"blk.{i}"
    qkv = ((f"{p}.attn_qkv.weight",) if has(f"{p}.attn_qkv.weight")
           else (f"{p}.attn_q.weight", f"{p}.attn_k.weight", f"{p}.attn_v.weight"))
    if has(f"{p}.ssm_ba.weight"):
        gdn_in: Recipe = (ROWS_BA, (f"{p}.attn_qkv.weight", f"{p}.attn_gate.weight", f"{p}.ssm_ba.weight"))
    else:
        gdn_in = (ROWS, (f"{p}.attn_qkv.weight", f"{p}.attn_gate.weight", f"{p}.ssm_beta.weight",
                         f"{p}.ssm_alpha.weight"))
    return {
        ("attn_norm", "weight"): (VECTOR, (f"{p}.attn_norm.weight",)),
        ("post_norm", "weight"): (VECTOR, (f"{p}.post_attention_norm.weight",)),
        # gated attention
        ("mixer", "w_qkv", "w"): (ROWS, qkv),
        ("mixer", "w_o", "w"): (ROWS, (f"{p}.attn_output.weight",)),
        ("mixer", "q_norm", "weight"): (VECTOR, (f"{p}.attn_q_norm.weight",)),
        ("mixer", "k_norm", "weight"): (VECTOR, (f"{p}.attn_k_norm.weight",)),
        # gated delta net
        ("mixer", "w_in", "w"): gdn_in,
        ("mixer", "conv_w"): (CONV, (f"{p}.ssm_conv1d.weight",)),
        ("mixer", "dt_bias"): (VECTOR, (f"{p}.ssm_dt.bias",)),
        ("mixer", "a"): (VECTOR, (f"{p}.ssm_a",)),
        ("mixer", "norm"): (VECTOR, (f"{p}.ssm_norm.weight",)),
        ("mixer", "w_out", "w"): (ROWS, (f"{p}.ssm_out.weight",)),
        # MoE: router [E experts | shared-expert gate]
        ("ffn", "router", "w"): (ROWS, (f"{p}.ffn_gate_inp.weight",
                                        *([f"{p}.ffn_gate_inp_shexp.weight"] if c.shared_expert_ff else []))),
        ("ffn", "shared", "gate_up", "w"): (ROWS, (f"{p}.ffn_gate_shexp.weight", f"{p}.ffn_up_shexp.weight")),
        ("ffn", "shared", "down", "w"): (ROWS, (f"{p}.ffn_down_shexp.weight",)),
        # dense FFN (qwen35)
        ("ffn", "gate_up", "w"): (ROWS, (f"{p}.ffn_gate.weight", f"{p}.ffn_up.weight")),
        ("ffn", "down", "w"): (ROWS, (f"{p}.ffn_down.weight",)),
    }


def mtp_recipes(c: ModelConfig, has: Callable[[str], bool]) -> dict[tuple, Recipe]:
    """Recipes of the MTP head's own params (its block's: `block_recipes(c, c.mtp_layer, has)`): the
    nextn.* extras; embedding, LM head and head norm are the trunk's token_embd, output (or tied) and
    output_norm unless the file has nextn.embed_tokens / shared_head_head / shared_head_norm."""
    p = f"blk.{c.mtp_layer}"
    embed, head, norm = (f"{p}.nextn.{n}.weight" for n in ("embed_tokens", "shared_head_head", "shared_head_norm"))
    trunk = trunk_recipes(c, has)
    return {
        ("embed", "table"): (EMBEDDING, (embed,)) if has(embed) else trunk[("embed", "table")],
        ("lm_head", "w"): (ROWS, (head,)) if has(head) else trunk[("lm_head", "w")],
        ("enorm", "weight"): (VECTOR, (f"{p}.nextn.enorm.weight",)),
        ("hnorm", "weight"): (VECTOR, (f"{p}.nextn.hnorm.weight",)),
        ("eh_proj", "w"): (ROWS, (f"{p}.nextn.eh_proj.weight",)),
        ("shared_head_norm", "weight"): (VECTOR, (norm if has(norm) else "output_norm.weight",)),
    }


def _load(f: GGUFFile, c: ModelConfig, fmt: MatrixFormat, recipe: Recipe) -> Any:
    """A param's value read from the file, by its recipe."""
    kind, names = recipe
    if kind == ROWS:
        return _rows(f, fmt, *names)
    if kind == ROWS_BA:
        return _matrix(fmt, *(_source(f, n) for n in names[:-1]), *_split_ba(f, names[-1], c))
    if kind == VECTOR:
        return _vector(f, names[0])
    if kind == CONV:
        return np.ascontiguousarray(_float(f, names[0]).T)
    if kind == EMBEDDING:
        return _embedding(f, names[0])
    raise ValueError(f"unknown recipe kind {kind!r}")


def _param_source(f: GGUFFile, c: ModelConfig, fmt: MatrixFormat, path: tuple,
                  experts: ExpertLoader | None) -> Source:
    """The loader of one param, by its nnx path."""
    if path[0] == "layers":
        return _block_source(f, c, fmt, path[1], tuple(path[2:]), experts)
    recipe = trunk_recipes(c, f.tensors.__contains__)[path]
    return lambda: _load(f, c, fmt, recipe)


def _block_source(f: GGUFFile, c: ModelConfig, fmt: MatrixFormat, i: int, rest: tuple,
                  experts: ExpertLoader | None) -> Source:
    """The loader of one param of block `i` (trunk or MTP), by its path inside the Block."""
    if rest[:2] == ("ffn", "experts") and experts is not None:
        return experts.source(i, tuple(rest[2:]))
    recipe = block_recipes(c, i, f.tensors.__contains__)[rest]
    return lambda: _load(f, c, fmt, recipe)


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
    fmt = MatrixFormat.for_run(run)
    return _fill(f, lambda: Transformer(config, experts.modules() if experts is not None else None, run),
                 lambda path: _param_source(f, config, fmt, path, experts), progress)


def load_block(f: GGUFFile, config: ModelConfig, layer: int, experts: ExpertLoader | None = None,
               run: RunConfig = RunConfig()) -> Block:
    """One decoder block `blk.{layer}` with the trunk's layout and conventions, e.g. the MTP block's
    attention + FFN (`layer = config.mtp_layer`; its `nextn.*` extras are not part of a Block)."""
    _check_supported(f)
    experts = _experts_for(f, config, experts)
    return _fill(f, lambda: Block(config, layer, experts.modules()(layer) if experts is not None else None, run),
                 lambda path: _block_source(f, config, MatrixFormat.for_run(run), layer, path, experts), False)


def _mtp_source(f: GGUFFile, c: ModelConfig, fmt: MatrixFormat, trunk: Transformer | None, path: tuple,
                experts: ExpertLoader | None) -> Source:
    """The loader of one MTPHead param (`mtp_recipes`); with `trunk`, an embedding or LM head that is
    the trunk's is the trunk's arrays (no second copy)."""
    if path[0] == "block":
        return _block_source(f, c, fmt, c.mtp_layer, tuple(path[1:]), experts)
    has = f.tensors.__contains__
    recipe = mtp_recipes(c, has)[path]
    if trunk is not None and path in (("embed", "table"), ("lm_head", "w")) and recipe == trunk_recipes(c, has)[path]:
        module = trunk.embed.table if path[0] == "embed" else trunk.lm_head.w
        return module.get_value
    return lambda: _load(f, c, fmt, recipe)


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

    return _fill(f, make, lambda path: _mtp_source(f, config, MatrixFormat.for_run(run), trunk, path, experts), False)
