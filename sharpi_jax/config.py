"""ModelConfig: the one source of shapes and layer types, built from GGUF metadata; RunConfig: how a
loaded model runs.

ModelConfig: trunk layers = block_count - nextn_predict_layers, layer types from
`attention.recurrent_layers` (or the `full_attention_interval` fallback), rope sections, GDN head
pairing (tiled for qwen35/qwen35moe GGUFs, grouped for qwen3next).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from sharpi_jax.errors import GGUFError, InputError, UnsupportedArchitectureError

SUPPORTED_ARCHITECTURES = ("qwen35moe", "qwen35", "qwen3next")
EXPERT_MODES = ("grouped", "per_token")  # bitwise equal per row; grouped reads each expert once per batch
ROW_KERNELS = ("gemm", "gemv")
# Kernel backends ("auto" or a name registered in sharpi_jax.quant.registry) are checked at load.
REPACKS = (None, "int8", "auto")  # explicit matrix repackings (a backend's `layout`, sharpi_jax.quant)
# Prefill chunk sizes: a 128-token prompt runs as one 128-row chunk, not as a half-padding 256-row one.
DEFAULT_PREFILL_BUCKETS = (32, 128, 256)
DEFAULT_GDN_CHUNK = 64
GDN_SOLVES = ("substitution", "inverse")  # how the chunked GDN form solves its triangular system
GDN_STEPS = ("auto", "native", "xla")  # the recurrent GDN form's delta rule step
ATTENTION_CHUNKS = ("used", "all")  # which KV-cache chunks attention visits (same bits)
VERIFY_HEADS = ("auto", "lazy", "full")  # which LM-head rows a device-loop verify pass computes (same tokens)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """How a loaded model runs, as opposed to what it computes (ModelConfig): frozen and hashable, so it
    can sit in a compiled graph. `sj.load` builds one from its options (or takes `run_config=`) and hands
    it to the modules, the expert providers and the runtime.

    expert_mode: routed-expert dispatch, "grouped" (each selected expert read once per batch) or
        "per_token" (the reference loop); bitwise equal.
    row_kernel: the row-stable product of the XLA expert paths: "gemm" (every product has >= 2 rows)
        or "gemv" (exactly 1 row; faster for a single decode token on CPU). The two differ in the last
        bits from each other; within one kernel, batched verify equals sequential decode bit for bit.
    prefill_buckets: prefill chunk sizes (sorted, distinct, positive), each compiled once.
    gdn_chunk: chunk length of the chunked Gated DeltaNet form (prefill); changes prefill's last bits.
    gdn_solve: how that form solves its unit lower-triangular system per chunk: "substitution" (row by
        row in a loop; inference) or "inverse" (the inverse as a product of matrix powers: all
        matmuls, much cheaper to differentiate; training). Equal up to float rounding.
    gdn_step: the recurrent GDN form's delta rule step (decode, verify rows): "native" (csrc/gdn.h: one
        pass over the state a row, a verify row's new state written straight into its snapshot slot;
        CPU with AVX2 / FMA), "xla" (XLA ops; differentiable) or "auto" (native wherever it runs). The two
        differ in the last bits; within one, batched verify equals sequential decode bit for bit.
    attention_chunks: which chunks of the KV cache attention visits: "used" (up to the last one a row
        can see: a loop with a data-dependent trip count; inference) or "all" (a static loop over every
        chunk, those past the rows' reach left untouched: reverse-mode differentiable; training).
        Bitwise equal.
    kernels: the kernel backend of every matrix and routed-expert stack: "auto" (the best-ranked for
        the platform: Pallas on a GPU, ggml's CPU kernels on a CPU, XLA where neither can run) or a
        registered name, "ggml", "xla", "pallas" or "reference" (exact dequantization + f32 dot); see
        `sharpi_jax.quant.registry` (checked at load).
    repack: explicit repacking of quantized matrices on XLA: "auto" (int8 rows for matrices of >= 4M
        weights), None (every matrix in its GGUF encoding) or "int8" (all); see sharpi_jax.quant.
    verify_head: which LM-head rows a speculative pass of the device loop computes (one sequence; a
        batch computes every row): "full" (every verify row, one product), "lazy" (one row at a time,
        only the rows the acceptance walk reaches: the certain row, each accepted draft's row; a tree's
        walked path) or "auto": off ggml (e.g. a GPU, where extra rows are nearly free) full; on ggml's
        CPU kernels full for passes of up to 4 rows (2-4 head rows stream at 1.06-1.5x one row's time; a
        chain of k <= 3 ran 1.03-1.10x faster full on the research twin, AVX-512 and AVX2), lazy for wider
        passes (a tree's 9 rows), where each head row costs its arithmetic even inside a product
        (docs/speculation.md; `Runtime.full_head_rows`).
        Same tokens and stats: each head row has the same bits alone or in a product.
    """

    expert_mode: str = "grouped"
    row_kernel: str = "gemm"
    prefill_buckets: tuple[int, ...] = DEFAULT_PREFILL_BUCKETS
    gdn_chunk: int = DEFAULT_GDN_CHUNK
    gdn_solve: str = "substitution"
    gdn_step: str = "auto"
    attention_chunks: str = "used"
    kernels: str = "auto"
    repack: str | None = "auto"
    verify_head: str = "auto"

    def __post_init__(self) -> None:
        if self.expert_mode not in EXPERT_MODES:
            raise InputError(f"expert_mode must be one of {EXPERT_MODES}, got {self.expert_mode!r}")
        if not isinstance(self.kernels, str) or not self.kernels:
            raise InputError(f"kernels must be a backend name or 'auto', got {self.kernels!r}")
        if self.repack not in REPACKS:
            raise InputError(f"repack must be one of {REPACKS}, got {self.repack!r}")
        if self.row_kernel not in ROW_KERNELS:
            raise InputError(f"row_kernel must be one of {ROW_KERNELS}, got {self.row_kernel!r}")
        try:
            buckets = tuple(sorted({int(b) for b in self.prefill_buckets}))
            ok = bool(buckets) and buckets[0] >= 1 and not any(isinstance(b, bool) for b in self.prefill_buckets)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise InputError(f"prefill_buckets must be positive sizes, got {self.prefill_buckets!r}")
        object.__setattr__(self, "prefill_buckets", buckets)
        if isinstance(self.gdn_chunk, bool) or not isinstance(self.gdn_chunk, (int, np.integer)) or self.gdn_chunk < 1:
            raise InputError(f"gdn_chunk must be a positive integer, got {self.gdn_chunk!r}")
        object.__setattr__(self, "gdn_chunk", int(self.gdn_chunk))
        if self.gdn_solve not in GDN_SOLVES:
            raise InputError(f"gdn_solve must be one of {GDN_SOLVES}, got {self.gdn_solve!r}")
        if self.gdn_step not in GDN_STEPS:
            raise InputError(f"gdn_step must be one of {GDN_STEPS}, got {self.gdn_step!r}")
        if self.attention_chunks not in ATTENTION_CHUNKS:
            raise InputError(f"attention_chunks must be one of {ATTENTION_CHUNKS}, got {self.attention_chunks!r}")
        if self.verify_head not in VERIFY_HEADS:
            raise InputError(f"verify_head must be one of {VERIFY_HEADS}, got {self.verify_head!r}")

    def replace(self, **changes: Any) -> "RunConfig":
        """A copy with some fields changed (validated again); None values leave a field as it is."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a hybrid GDN / gated-attention / MoE (or dense) model with MTP blocks."""

    arch: str
    n_vocab: int
    d_model: int  # D
    n_layer_all: int  # block_count: trunk + MTP blocks
    n_nextn: int  # MTP blocks, the last n_nextn blocks
    context_length: int
    rms_eps: float
    # Gated full attention.
    n_head: int  # Hq
    n_head_kv: int  # Hkv
    head_dim: int  # hd
    n_rot: int  # rotary dims per head (partial NEOX rope)
    rope_base: float
    rope_freq_scale: float
    rope_sections: tuple[int, int, int, int]  # IMROPE sections (text-only IMROPE == NEOX)
    # Gated DeltaNet.
    recurrent_layers: tuple[bool, ...]  # per block (length n_layer_all): True = GDN layer
    ssm_conv_kernel: int  # Kc
    ssm_d_state: int  # dk == dv
    ssm_n_group: int  # Hk
    ssm_dt_rank: int  # Hv
    ssm_d_inner: int  # Hv * dv
    gdn_head_pairing: str  # "tiled": v-head n uses k-head n % Hk; "grouped": n // (Hv/Hk)
    # FFN.
    n_expert: int  # E (0 for dense)
    n_expert_used: int  # k
    expert_ff: int  # F
    shared_expert_ff: int  # Fs
    dense_ff: int  # dense qwen35 SwiGLU width
    tied_embeddings: bool = False

    def __post_init__(self) -> None:
        # GGUF stores these as float32: keep the float32 value so configs round-trip through files.
        for name in ("rms_eps", "rope_base", "rope_freq_scale"):
            object.__setattr__(self, name, float(np.float32(getattr(self, name))))

    # ----- derived shapes -----
    @property
    def n_layer(self) -> int:
        """Trunk layers (MTP blocks excluded)."""
        return self.n_layer_all - self.n_nextn

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    @property
    def has_mtp(self) -> bool:
        return self.n_nextn > 0

    @property
    def mtp_layer(self) -> int:
        """Block index of the (first) MTP block."""
        return self.n_layer

    @property
    def conv_dim(self) -> int:
        """GDN conv channels C = 2*Hk*dk + Hv*dv."""
        return 2 * self.ssm_n_group * self.ssm_d_state + self.ssm_d_inner

    @property
    def gdn_head_ratio(self) -> int:
        return self.ssm_dt_rank // self.ssm_n_group

    @property
    def rope_type(self) -> str:
        return "neox" if self.arch == "qwen3next" else "imrope"

    def is_recurrent(self, layer: int) -> bool:
        return self.recurrent_layers[layer]

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.n_layer) if not self.recurrent_layers[i])

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.n_layer) if self.recurrent_layers[i])

    def summary(self) -> str:
        """Multi-line human-readable description."""
        lines = [f"{f.name:18s} {getattr(self, f.name)}" for f in dataclasses.fields(self)]
        lines.append(f"{'n_layer (trunk)':18s} {self.n_layer}")
        lines.append(f"{'layer types':18s} " + "".join(
            "G" if r else "A" for r in self.recurrent_layers[: self.n_layer]) + "+MTP" * self.n_nextn)
        return "\n".join(lines)

    # ----- construction -----
    @classmethod
    def from_metadata(cls, md: Mapping[str, Any], source: str = "<metadata>") -> "ModelConfig":
        """Build from GGUF metadata (key -> python value), validating every required key."""
        arch = md.get("general.architecture")
        if arch is None:
            raise GGUFError(f"{source}: missing required key 'general.architecture'")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"{source}: architecture {arch!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        r = _MetadataReader(md, arch, source)
        # Checked in this order, so the first error a bad file hits stays the same.
        block_count, n_nextn = _read_block_counts(r)
        attention = _read_attention(r)
        recurrent = _read_layer_types(r, block_count, block_count - n_nextn)
        ssm = _read_ssm(r)
        ffn = _read_ffn(r)
        n_vocab = _read_vocab_size(r)
        return cls(
            arch=arch, n_vocab=n_vocab, n_layer_all=block_count, n_nextn=n_nextn,
            context_length=r.read_int("context_length", required=True, allow_zero=False),
            rope_base=r.read_float("rope.freq_base", 10000.0), recurrent_layers=recurrent,
            gdn_head_pairing="grouped" if arch == "qwen3next" else "tiled", **attention, **ssm, **ffn,
        )

    def to_metadata(self) -> dict[str, Any]:
        """The arch-specific GGUF keys that reproduce this config (for writers); tokenizer excluded."""
        a = self.arch
        md: dict[str, Any] = {
            "general.architecture": a,
            f"{a}.block_count": self.n_layer_all,
            f"{a}.nextn_predict_layers": self.n_nextn,
            f"{a}.context_length": self.context_length,
            f"{a}.embedding_length": self.d_model,
            f"{a}.attention.head_count": self.n_head,
            f"{a}.attention.head_count_kv": self.n_head_kv,
            f"{a}.attention.key_length": self.head_dim,
            f"{a}.attention.value_length": self.head_dim,
            f"{a}.attention.layer_norm_rms_epsilon": self.rms_eps,
            f"{a}.rope.dimension_count": self.n_rot,
            f"{a}.rope.freq_base": self.rope_base,
            f"{a}.attention.recurrent_layers": list(self.recurrent_layers),
            f"{a}.ssm.conv_kernel": self.ssm_conv_kernel,
            f"{a}.ssm.state_size": self.ssm_d_state,
            f"{a}.ssm.group_count": self.ssm_n_group,
            f"{a}.ssm.time_step_rank": self.ssm_dt_rank,
            f"{a}.ssm.inner_size": self.ssm_d_inner,
        }
        if a != "qwen3next":
            md[f"{a}.rope.dimension_sections"] = list(self.rope_sections)
        if self.is_moe:
            md[f"{a}.expert_count"] = self.n_expert
            md[f"{a}.expert_used_count"] = self.n_expert_used
            md[f"{a}.expert_feed_forward_length"] = self.expert_ff
            md[f"{a}.expert_shared_feed_forward_length"] = self.shared_expert_ff
        else:
            md[f"{a}.feed_forward_length"] = self.dense_ff
        return md

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


class _MetadataReader:
    """Typed, validated access to the `{arch}.*` keys of GGUF metadata; every error names `source`."""

    def __init__(self, md: Mapping[str, Any], arch: str, source: str):
        self.md, self.arch, self.source = md, arch, source

    def key(self, name: str) -> str:
        return f"{self.arch}.{name}"

    def error(self, message: str) -> GGUFError:
        return GGUFError(f"{self.source}: {message}")

    def get(self, name: str, default: Any = None, required: bool = False) -> Any:
        k = self.key(name)
        if k in self.md:
            return self.md[k]
        if required:
            raise self.error(f"missing required key {k!r}")
        return default

    def as_int(self, name: str, value: Any, *, per_layer_ok: bool = False, allow_zero: bool = True) -> int:
        """Scalars pass; per-layer arrays must be uniform over their non-zero entries."""
        if isinstance(value, (list, tuple)):
            if not per_layer_ok:
                raise self.error(f"key {self.key(name)!r} must be a scalar, got an array")
            nz = sorted({int(v) for v in value if int(v) != 0})
            if len(nz) > 1:
                raise self.error(f"key {self.key(name)!r} varies per layer ({nz}); "
                                 "non-uniform layers are not supported")
            value = nz[0] if nz else 0
        if isinstance(value, bool) or not isinstance(value, (int,)) and not hasattr(value, "__index__"):
            raise self.error(f"key {self.key(name)!r} must be an integer, got {value!r}")
        value = int(value)
        if value < 0 or (value == 0 and not allow_zero):
            raise self.error(f"key {self.key(name)!r} has invalid value {value}")
        return value

    def as_float(self, name: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(f"key {self.key(name)!r} must be a number, got {value!r}")
        return float(value)

    def read_int(self, name: str, default: Any = None, *, required: bool = False, per_layer_ok: bool = False,
                 allow_zero: bool = True) -> int:
        """`as_int` of key `name` (or of `default` where it is absent and not required)."""
        return self.as_int(name, self.get(name, default, required), per_layer_ok=per_layer_ok,
                           allow_zero=allow_zero)

    def read_float(self, name: str, default: Any = None, *, required: bool = False) -> float:
        return self.as_float(name, self.get(name, default, required))


def _read_block_counts(r: _MetadataReader) -> tuple[int, int]:
    """(block_count, nextn_predict_layers): the trunk keeps at least one layer; at most one MTP block."""
    block_count = r.read_int("block_count", required=True, allow_zero=False)
    n_nextn = r.read_int("nextn_predict_layers", 0)
    if n_nextn >= block_count:
        raise r.error(f"{r.key('nextn_predict_layers')} = {n_nextn} leaves no trunk layers "
                      f"(block_count = {block_count})")
    if n_nextn > 1:
        raise r.error(f"{r.key('nextn_predict_layers')} = {n_nextn}; only 0 or 1 MTP block "
                      "is supported (llama.cpp asserts 1 as well)")
    return block_count, n_nextn


def _read_attention(r: _MetadataReader) -> dict[str, Any]:
    """The ModelConfig fields of the embedding width, the attention heads, rope and the RMS norm."""
    d_model = r.read_int("embedding_length", required=True, allow_zero=False)
    n_head = r.read_int("attention.head_count", required=True, per_layer_ok=True, allow_zero=False)
    n_head_kv = r.read_int("attention.head_count_kv", n_head, per_layer_ok=True, allow_zero=False)
    head_dim = r.read_int("attention.key_length", d_model // n_head, allow_zero=False)
    v_len = r.read_int("attention.value_length", head_dim, allow_zero=False)
    if v_len != head_dim:
        raise r.error(f"{r.key('attention.value_length')} = {v_len} differs from "
                      f"key_length = {head_dim}; not supported")
    if n_head % n_head_kv:
        raise r.error(f"head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
    n_rot = r.read_int("rope.dimension_count", head_dim)
    if n_rot > head_dim or n_rot % 2:
        raise r.error(f"{r.key('rope.dimension_count')} = {n_rot} must be even and <= "
                      f"key_length {head_dim}")
    sections = (0, 0, 0, 0) if r.arch == "qwen3next" else _read_rope_sections(r)
    scaling = r.get("rope.scaling.factor", None)
    freq_scale = 1.0 if not scaling else 1.0 / r.as_float("rope.scaling.factor", scaling)
    rms_eps = r.read_float("attention.layer_norm_rms_epsilon", required=True)
    return dict(d_model=d_model, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim, n_rot=n_rot,
                rope_sections=sections, rope_freq_scale=freq_scale, rms_eps=rms_eps)


def _read_rope_sections(r: _MetadataReader) -> tuple[int, ...]:
    """The IMROPE sections (required for qwen35 / qwen35moe)."""
    raw_sections = r.get("rope.dimension_sections", required=True)
    if not isinstance(raw_sections, (list, tuple)) or len(raw_sections) != 4:
        raise r.error(f"{r.key('rope.dimension_sections')} must be an int[4], got {raw_sections!r}")
    return tuple(int(s) for s in raw_sections)


def _read_layer_types(r: _MetadataReader, block_count: int, n_layer: int) -> tuple[bool, ...]:
    """Per block, True for a GDN layer: `attention.recurrent_layers`, else every `full_attention_interval`-th
    trunk layer is full attention; the MTP blocks must be full attention."""
    recurrent = r.get("attention.recurrent_layers", None)
    if recurrent is not None:
        if not isinstance(recurrent, (list, tuple)) or len(recurrent) != block_count:
            raise r.error(f"{r.key('attention.recurrent_layers')} must be a bool array of "
                          f"length block_count = {block_count}")
        recurrent = tuple(bool(x) for x in recurrent)
    else:
        interval = r.read_int("full_attention_interval", 4, allow_zero=False)
        recurrent = tuple(i < n_layer and (i + 1) % interval != 0 for i in range(block_count))
    if any(recurrent[n_layer:]):
        raise r.error(f"MTP blocks must be full-attention, but "
                      f"{r.key('attention.recurrent_layers')} marks one recurrent")
    return recurrent


def _read_ssm(r: _MetadataReader) -> dict[str, Any]:
    """The Gated DeltaNet fields: inner size = Hv x dv, and Hv a multiple of Hk."""
    ssm_conv = r.read_int("ssm.conv_kernel", required=True, allow_zero=False)
    ssm_state = r.read_int("ssm.state_size", required=True, allow_zero=False)
    ssm_group = r.read_int("ssm.group_count", required=True, allow_zero=False)
    ssm_rank = r.read_int("ssm.time_step_rank", required=True, allow_zero=False)
    ssm_inner = r.read_int("ssm.inner_size", required=True, allow_zero=False)
    if ssm_inner != ssm_rank * ssm_state:
        raise r.error(f"{r.key('ssm.inner_size')} = {ssm_inner} != time_step_rank "
                      f"{ssm_rank} x state_size {ssm_state}")
    if ssm_rank % ssm_group:
        raise r.error(f"{r.key('ssm.time_step_rank')} = {ssm_rank} is not a multiple of "
                      f"{r.key('ssm.group_count')} = {ssm_group}")
    return dict(ssm_conv_kernel=ssm_conv, ssm_d_state=ssm_state, ssm_n_group=ssm_group, ssm_dt_rank=ssm_rank,
                ssm_d_inner=ssm_inner)


def _read_ffn(r: _MetadataReader) -> dict[str, Any]:
    """The FFN fields: a dense SwiGLU width for qwen35, else the experts (widths fall back on
    `feed_forward_length`)."""
    n_ff = r.read_int("feed_forward_length", 0, per_layer_ok=True)
    if r.arch == "qwen35":
        if n_ff == 0:
            raise r.error(f"missing required key {r.key('feed_forward_length')} (dense FFN)")
        return dict(n_expert=0, n_expert_used=0, expert_ff=0, shared_expert_ff=0, dense_ff=n_ff)
    n_expert = r.read_int("expert_count", required=True, allow_zero=False)
    n_used = r.read_int("expert_used_count", required=True, per_layer_ok=True, allow_zero=False)
    if n_used > n_expert:
        raise r.error(f"expert_used_count {n_used} > expert_count {n_expert}")
    fallback_ff = n_ff // n_used if n_ff else 0
    expert_ff = r.read_int("expert_feed_forward_length", fallback_ff, per_layer_ok=True)
    shared_ff = r.read_int("expert_shared_feed_forward_length", n_ff, per_layer_ok=True)
    if expert_ff == 0:
        raise r.error(f"missing required key {r.key('expert_feed_forward_length')}")
    return dict(n_expert=n_expert, n_expert_used=n_used, expert_ff=expert_ff, shared_expert_ff=shared_ff,
                dense_ff=0)


def _read_vocab_size(r: _MetadataReader) -> int:
    """The vocabulary size: the token list's length, else `{arch}.vocab_size`."""
    tokens = r.md.get("tokenizer.ggml.tokens")
    n_vocab = len(tokens) if tokens is not None else int(r.get("vocab_size", 0) or 0)
    if n_vocab <= 0:
        raise r.error("missing required key 'tokenizer.ggml.tokens' (vocabulary)")
    return n_vocab


def qwen36_35b_a3b(n_layer: int = 40, n_nextn: int = 1) -> ModelConfig:
    """The Qwen3.6-35B-A3B shapes (published config: 40 layers, hidden 2048, 256 experts top-8 of FFN 512
    plus a shared expert, vocab 248320), optionally with fewer trunk layers."""
    recurrent = tuple(i < n_layer and (i + 1) % 4 != 0 for i in range(n_layer + n_nextn))
    return ModelConfig(
        arch="qwen35moe", n_vocab=248320, d_model=2048, n_layer_all=n_layer + n_nextn, n_nextn=n_nextn,
        context_length=262144, rms_eps=1e-6, n_head=16, n_head_kv=2, head_dim=256, n_rot=64,
        rope_base=1e7, rope_freq_scale=1.0, rope_sections=(11, 11, 10, 0), recurrent_layers=recurrent,
        ssm_conv_kernel=4, ssm_d_state=128, ssm_n_group=16, ssm_dt_rank=32, ssm_d_inner=4096,
        gdn_head_pairing="tiled", n_expert=256, n_expert_used=8, expert_ff=512, shared_expert_ff=512,
        dense_ff=0)


def qwen35_122b_a10b(n_layer: int = 48, n_nextn: int = 1) -> ModelConfig:
    """The Qwen3.5-122B-A10B shapes (published config: 48 layers, hidden 3072, 256 experts top-8;
    the rest as `_qwen35_large`), optionally with fewer trunk layers."""
    return _qwen35_large(n_layer, n_nextn, d_model=3072, n_expert=256, n_expert_used=8)


def qwen35_397b_a17b(n_layer: int = 60, n_nextn: int = 1) -> ModelConfig:
    """The Qwen3.5-397B-A17B shapes (published config: 60 layers, hidden 4096, 512 experts top-10;
    the rest as `_qwen35_large`), optionally with fewer trunk layers."""
    return _qwen35_large(n_layer, n_nextn, d_model=4096, n_expert=512, n_expert_used=10)


def _qwen35_large(n_layer: int, n_nextn: int, d_model: int, n_expert: int, n_expert_used: int) -> ModelConfig:
    """The larger Qwen3.5 MoE shapes: 32/2 attention heads of 256, GDN 16 key / 64 value heads of 128,
    experts of FFN 1024 plus a shared expert of 1024, vocab 248320 (sources in configs/models.json)."""
    return qwen36_35b_a3b(n_layer=n_layer, n_nextn=n_nextn).replace(
        d_model=d_model, n_head=32, n_head_kv=2, ssm_dt_rank=64, ssm_d_inner=8192, n_expert=n_expert,
        n_expert_used=n_expert_used, expert_ff=1024, shared_expert_ff=1024)


def qwen35_27b(n_layer: int = 64, n_nextn: int = 1) -> ModelConfig:
    """The dense Qwen3.5/3.6-27B shapes (published config: 64 layers, hidden 5120, FFN 17408, 24/4 heads
    of 256, GDN 16 key / 48 value heads of 128), optionally with fewer trunk layers."""
    return qwen36_35b_a3b(n_layer=n_layer, n_nextn=n_nextn).replace(
        arch="qwen35", d_model=5120, n_head=24, n_head_kv=4, ssm_dt_rank=48, ssm_d_inner=6144, n_expert=0,
        n_expert_used=0, expert_ff=0, shared_expert_ff=0, dense_ff=17408)


def tiny_qwen35moe(n_layer: int = 4, n_nextn: int = 1) -> ModelConfig:
    """The reference fixtures' shapes (hidden 128, 16 experts top-4 of ff 64, GDN 2 key x 4 value heads
    of 32, 4/2 attention heads of 32 with 8 rotary dims, vocab 2048)."""
    return qwen36_35b_a3b(n_layer=n_layer, n_nextn=n_nextn).replace(
        n_vocab=2048, d_model=128, context_length=4096, n_head=4, n_head_kv=2, head_dim=32, n_rot=8,
        rope_sections=(2, 1, 1, 0), ssm_d_state=32, ssm_n_group=2, ssm_dt_rank=4, ssm_d_inner=128,
        n_expert=16, n_expert_used=4, expert_ff=64, shared_expert_ff=64)


SHAPE_PRESETS = {"tiny": tiny_qwen35moe, "qwen36-35b-a3b": qwen36_35b_a3b, "qwen35-27b": qwen35_27b,
                 "qwen35-122b-a10b": qwen35_122b_a10b, "qwen35-397b-a17b": qwen35_397b_a17b}


def shape_preset(name: str, n_layer: int | None = None) -> ModelConfig:
    """A named model shape (see SHAPE_PRESETS), optionally with n_layer trunk layers (+1 MTP block)."""
    if name not in SHAPE_PRESETS:
        raise InputError(f"unknown shape preset {name!r} (known: {', '.join(SHAPE_PRESETS)})")
    return SHAPE_PRESETS[name]() if n_layer is None else SHAPE_PRESETS[name](n_layer=n_layer)
