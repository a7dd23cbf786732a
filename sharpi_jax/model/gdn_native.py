"""The native gated delta rule step (csrc/gdn.h) behind GatedDeltaNet's recurrent rows on a CPU.

XLA runs a token's delta rule as a decay, two mat-vecs and an outer-product update with the decayed and
the new state materialized in between, and a verify row then copies its new state into its snapshot
slot: about six state-sized passes over memory a row (2 MB a GDN layer on the 35B shapes), most of a
verify pass's GDN time. The native step reads each state row once and writes the new one where it
belongs: in place for a decode step; for a verify pass, all rows in one call that reads the starting
state once and streams each row's state into its snapshot slot.

Its bits are its own, not XLA's: a model uses one step for every recurrent path (decode, chain and tree
verify, the device and the host loop), so batched verify still equals sequential decode bit for bit.
`RunConfig.gdn_step` picks it ("auto": wherever it runs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sharpi_jax.errors import InputError
from sharpi_jax.quant import ggml


def supported(dk: int) -> bool:
    """Whether the native step runs here for heads of dk values: the extension loaded, JAX computes on the
    CPU, and the CPU has AVX2 / FMA (dk a multiple of 8)."""
    return jax.default_backend() == "cpu" and ggml.gdn_supported(dk)


def uses_native(gdn_step: str, dk: int) -> bool:
    """RunConfig.gdn_step resolved for a layer with heads of dk values ("native" where it cannot run: an
    error naming why)."""
    if gdn_step == "xla":
        return False
    ok = supported(dk)
    if gdn_step == "native" and not ok:
        why = ggml.unavailable_reason() or (
            f"JAX computes on {jax.default_backend()!r}" if jax.default_backend() != "cpu"
            else f"this CPU lacks AVX2 / FMA or dk={dk} is not a multiple of 8")
        raise InputError(f"gdn_step='native' cannot run here: {why}; use gdn_step='auto' or 'xla'")
    return ok


def step(S: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array, g: jax.Array,
         scale: float) -> tuple[jax.Array, jax.Array]:
    """One token in place: S [H, dv, dk] (its buffer is reused for the result), q, k [H, dk], v [H, dv],
    beta, g [H] -> (new S, o [H, dv])."""
    H, dv, _ = S.shape
    out = (jax.ShapeDtypeStruct(S.shape, S.dtype), jax.ShapeDtypeStruct((H, dv), S.dtype))
    return jax.ffi.ffi_call("sharpi_gdn_step", out, input_output_aliases={0: 0}, vmap_method="sequential")(
        S, q, k, v, beta, g, scale=np.float32(scale))


def rows(state: jax.Array, snaps: jax.Array, parent: jax.Array, init_slot: jax.Array, n: jax.Array, q: jax.Array,
         k: jax.Array, v: jax.Array, beta: jax.Array, g: jax.Array, scale: float) -> tuple[jax.Array, jax.Array]:
    """Rows [0, n) of a verify pass in one call: slot t of snaps [T, H, dv, dk] (its buffer is reused for the
    result) gets the state after row t, which starts from row parent[t]'s (-1: from slot init_slot of snaps,
    or from state [H, dv, dk] when init_slot is -1). q, k [T, H, dk], v [T, H, dv], beta, g [T, H] ->
    (snaps, o [T, H, dv], rows >= n zero). Each row is `step`'s arithmetic (the same bits), but the starting
    state is read once for all rows, and the slots are streamed to memory without first being read."""
    T, H, dv = snaps.shape[0], snaps.shape[1], snaps.shape[2]
    out = (jax.ShapeDtypeStruct(snaps.shape, snaps.dtype), jax.ShapeDtypeStruct((T, H, dv), snaps.dtype))
    return jax.ffi.ffi_call("sharpi_gdn_rows", out, input_output_aliases={1: 0}, vmap_method="sequential")(
        state, snaps, jnp.asarray(parent, jnp.int32), jnp.asarray(init_slot, jnp.int32), jnp.asarray(n, jnp.int32),
        q, k, v, beta, g, scale=np.float32(scale))
