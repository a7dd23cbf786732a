"""The tensors a model of a given ModelConfig has: names and numpy-order shapes (llama.cpp's names for these architectures).

One table serves three jobs: validating a GGUF against its own metadata, telling the weight loader
what to read, and telling the synthetic writer what to write. Shapes are numpy order (the reverse of
ggml's `ne`), so a GGUF `{D, F, E}` tensor is `(E, F, D)` here.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from sharpi_jax.config import ModelConfig
from sharpi_jax.errors import GGUFError

if TYPE_CHECKING:
    from sharpi_jax.gguf.reader import GGUFFile

EXPERT_MATRICES = ("gate", "up", "down")  # routed-expert matrices of a MoE block, in table order


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # numpy order
    required: bool = True
    float_only: bool = False  # llama.cpp keeps these F32 (norms, router, conv, ssm_a, dt bias)

    @property
    def is_expert(self) -> bool:
        return "_exps." in self.name


def _attention_block(c: ModelConfig, p: str) -> list[TensorSpec]:
    D, hd = c.d_model, c.head_dim
    return [
        TensorSpec(f"{p}.attn_q.weight", (2 * c.n_head * hd, D)),
        TensorSpec(f"{p}.attn_k.weight", (c.n_head_kv * hd, D)),
        TensorSpec(f"{p}.attn_v.weight", (c.n_head_kv * hd, D)),
        TensorSpec(f"{p}.attn_output.weight", (D, c.n_head * hd)),
        TensorSpec(f"{p}.attn_q_norm.weight", (hd,), float_only=True),
        TensorSpec(f"{p}.attn_k_norm.weight", (hd,), float_only=True),
    ]


def _gdn_block(c: ModelConfig, p: str) -> list[TensorSpec]:
    D, Hv = c.d_model, c.ssm_dt_rank
    specs = [
        TensorSpec(f"{p}.attn_qkv.weight", (c.conv_dim, D)),
        TensorSpec(f"{p}.attn_gate.weight", (c.ssm_d_inner, D)),
        TensorSpec(f"{p}.ssm_conv1d.weight", (c.conv_dim, c.ssm_conv_kernel), float_only=True),
        TensorSpec(f"{p}.ssm_dt.bias", (Hv,), float_only=True),
        TensorSpec(f"{p}.ssm_a", (Hv,), float_only=True),
        TensorSpec(f"{p}.ssm_norm.weight", (c.ssm_d_state,), float_only=True),
        TensorSpec(f"{p}.ssm_out.weight", (D, c.ssm_d_inner)),
    ]
    if c.arch == "qwen3next":
        specs.append(TensorSpec(f"{p}.ssm_ba.weight", (2 * Hv, D)))
    else:
        specs += [TensorSpec(f"{p}.ssm_beta.weight", (Hv, D)), TensorSpec(f"{p}.ssm_alpha.weight", (Hv, D))]
    return specs


def _ffn_block(c: ModelConfig, p: str) -> list[TensorSpec]:
    D = c.d_model
    if not c.is_moe:
        return [
            TensorSpec(f"{p}.ffn_gate.weight", (c.dense_ff, D)),
            TensorSpec(f"{p}.ffn_up.weight", (c.dense_ff, D)),
            TensorSpec(f"{p}.ffn_down.weight", (D, c.dense_ff)),
        ]
    E, F, Fs = c.n_expert, c.expert_ff, c.shared_expert_ff
    specs = [
        TensorSpec(f"{p}.ffn_gate_inp.weight", (E, D), float_only=True),
        TensorSpec(f"{p}.ffn_gate_exps.weight", (E, F, D)),
        TensorSpec(f"{p}.ffn_up_exps.weight", (E, F, D)),
        TensorSpec(f"{p}.ffn_down_exps.weight", (E, D, F)),
    ]
    if Fs:
        specs += [
            TensorSpec(f"{p}.ffn_gate_inp_shexp.weight", (1, D), float_only=True),  # converter: {D, 1}
            TensorSpec(f"{p}.ffn_gate_shexp.weight", (Fs, D)),
            TensorSpec(f"{p}.ffn_up_shexp.weight", (Fs, D)),
            TensorSpec(f"{p}.ffn_down_shexp.weight", (D, Fs)),
        ]
    return specs


def model_tensor_specs(c: ModelConfig) -> list[TensorSpec]:
    """Every tensor of the model, trunk then MTP blocks, in a stable order."""
    D = c.d_model
    specs = [
        TensorSpec("token_embd.weight", (c.n_vocab, D)),
        TensorSpec("output_norm.weight", (D,), float_only=True),
        TensorSpec("output.weight", (c.n_vocab, D), required=False),  # absent: tied to token_embd
    ]
    for i in range(c.n_layer_all):
        p = f"blk.{i}"
        specs += [
            TensorSpec(f"{p}.attn_norm.weight", (D,), float_only=True),
            TensorSpec(f"{p}.post_attention_norm.weight", (D,), float_only=True),
        ]
        specs += _gdn_block(c, p) if c.recurrent_layers[i] else _attention_block(c, p)
        specs += _ffn_block(c, p)
        if i >= c.n_layer:  # MTP block extras
            specs += [
                TensorSpec(f"{p}.nextn.eh_proj.weight", (D, 2 * D)),
                TensorSpec(f"{p}.nextn.enorm.weight", (D,), float_only=True),
                TensorSpec(f"{p}.nextn.hnorm.weight", (D,), float_only=True),
                TensorSpec(f"{p}.nextn.shared_head_norm.weight", (D,), required=False, float_only=True),
                TensorSpec(f"{p}.nextn.shared_head_head.weight", (c.n_vocab, D), required=False),
                TensorSpec(f"{p}.nextn.embed_tokens.weight", (c.n_vocab, D), required=False),
            ]
    return specs


def _same_shape(actual: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    # llama.cpp's check_tensor_dims accepts {n} stored as {n, 1}: ignore leading unit dims (numpy order).
    def squeeze(s: tuple[int, ...]) -> tuple[int, ...]:
        s = tuple(s)
        while len(s) > 1 and s[0] == 1:
            s = s[1:]
        return s

    return squeeze(actual) == squeeze(expected)


def validate_tensors(c: ModelConfig, shapes: dict[str, tuple[int, ...]], source: str) -> None:
    """Raise GGUFError naming the tensor if one is missing or its shape contradicts the metadata."""
    for spec in model_tensor_specs(c):
        if spec.name not in shapes:
            if spec.required:
                raise GGUFError(f"{source}: missing required tensor {spec.name!r} "
                                f"(expected shape {list(spec.shape)} for architecture {c.arch})")
            continue
        if not _same_shape(shapes[spec.name], spec.shape):
            raise GGUFError(f"{source}: tensor {spec.name!r} has shape {list(shapes[spec.name])}, but the "
                            f"metadata implies {list(spec.shape)} (numpy order)")


def expert_tensor_bytes(c: ModelConfig, nbytes: dict[str, int]) -> tuple[int, int]:
    """(routed-expert bytes, all other bytes) of a model whose tensor sizes are `nbytes`."""
    expert = sum(n for name, n in nbytes.items() if "_exps." in name)
    return expert, int(np.sum(list(nbytes.values()), dtype=np.int64)) - expert


def expert_raw(f: "GGUFFile", layer: int, which: str) -> np.ndarray:
    """Block `layer`'s routed `which` ("gate" | "up" | "down") experts: a zero-copy uint8 view
    [E, rows, row bytes], also from a `ffn_gate_up_exps` tensor (llama.cpp --fuse-gate-up-exps:
    [E, 2F, ...], gate rows first)."""
    p = f"blk.{layer}"
    name = f"{p}.ffn_{which}_exps.weight"
    if name in f.tensors:
        return f.raw(name)
    fused = f"{p}.ffn_gate_up_exps.weight"
    if which in ("gate", "up") and fused in f.tensors:
        raw = f.raw(fused)
        F = raw.shape[1] // 2
        return raw[:, :F] if which == "gate" else raw[:, F:]
    raise GGUFError(f"{f.source}: missing expert tensor {name!r}")


def expert_qtypes(f: "GGUFFile", layer: int) -> tuple[int, int, int]:
    """ggml type ids of block `layer`'s routed gate, up and down experts."""
    p = f"blk.{layer}"
    out = []
    for which in EXPERT_MATRICES:
        name = f"{p}.ffn_{which}_exps.weight"
        src = name if name in f.tensors or which == "down" else f"{p}.ffn_gate_up_exps.weight"
        out.append(int(f.tensor(src).qtype))
    return tuple(out)  # type: ignore[return-value]
