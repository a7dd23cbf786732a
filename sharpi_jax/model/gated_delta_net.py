"""Gated DeltaNet layer with a recurrent (scan) form and a chunked WY form of the same delta rule.

State per layer (float32): conv [Kc-1, C], the raw pre-conv qkv rows of the last Kc-1 tokens, oldest
first (time-major, the transpose of ggml's [C, Kc-1]); ssm [Hv, dv, dk], ggml's layout (the transpose
of HF's per-head [dk, dv]).

The recurrent form runs conv, SiLU, L2 norm and the delta rule for one token per scan step, so a token's
arithmetic is the same code whatever the number of rows in the call: T single-token steps and one
T-row step give bitwise-equal outputs and per-row state snapshots. The chunked form is for prefill.
The recurrent form's delta rule is XLA's `delta_rule_step` or, on a CPU by default, the native one-pass
step (`gdn_native`, `RunConfig.gdn_step`), which writes a verify row's new state straight into its
snapshot slot; a layer uses one of them for every path.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from sharpi_jax.config import DEFAULT_GDN_CHUNK, ModelConfig
from sharpi_jax.model import gdn_native
from sharpi_jax.model.layers import Linear, rms_norm

GDN_CHUNK = DEFAULT_GDN_CHUNK


def softplus(x: jax.Array) -> jax.Array:
    """ggml softplus: x if x > 20 else log(1 + e^x)."""
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def l2_norm(x: jax.Array, eps: float) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis (eps inside the sqrt, as ggml and HF)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def delta_rule_step(S: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array, g: jax.Array,
                    scale: float) -> tuple[jax.Array, jax.Array]:
    """One token, decay first (S <- e^g S, then the delta update). S [H, dv, dk]; q, k [H, dk]; v [H, dv]; beta, g [H]."""
    # The two contractions are batched mat-vec dots (2.5x faster on XLA CPU than multiply-and-reduce over
    # the [H, dv, dk] state); every recurrent path (decode, chain / tree verify) runs this same step.
    S = S * jnp.exp(g)[:, None, None]
    u = jnp.einsum("hvk,hk->hv", S, k)  # S'^T k
    d = beta[:, None] * (v - u)
    S = S + d[:, :, None] * k[:, None, :]  # + outer(k, delta), stored transposed
    o = jnp.einsum("hvk,hk->hv", S, q) * jnp.float32(scale)
    return S, o


def delta_rule_recurrent(q, k, v, beta, g, S, scale):
    """Reference sequential delta rule over T tokens: q, k [T, H, dk]; v [T, H, dv]; beta, g [T, H]."""
    def body(S, xs):
        S, o = delta_rule_step(S, *xs, scale)
        return S, o

    S, o = jax.lax.scan(body, S, (q, k, v, beta, g))
    return o, S


def unit_lower_solve(A: jax.Array, rhs: jax.Array) -> jax.Array:
    """Solve (I + A) X = rhs for strictly lower-triangular A [..., C, C] by row-wise forward substitution.

    (`lax.linalg.triangular_solve` on XLA CPU is erratically slow for these small batched shapes:
    10-100x slower than this loop for some batch sizes.)
    """
    def body(i, X):
        a = jax.lax.dynamic_index_in_dim(A, i, axis=-2, keepdims=False)
        r = jax.lax.dynamic_index_in_dim(rhs, i, axis=-2, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(X, r - jnp.einsum("...j,...jk->...k", a, X), i, axis=-2)

    return jax.lax.fori_loop(0, A.shape[-1], body, jnp.zeros_like(rhs))


def unit_lower_inverse(A: jax.Array) -> jax.Array:
    """(I + A)^-1 for strictly lower-triangular A [..., C, C] as sum_k (-A)^k = (I - A)(I + A^2)(I + A^4)...
    (A is nilpotent, so ceil(log2 C) factors are exact). All matmuls: cheap to differentiate."""
    X = jnp.eye(A.shape[-1], dtype=A.dtype) - A
    P = A
    for _ in range(max(0, math.ceil(math.log2(A.shape[-1])) - 1)):
        P = P @ P
        X = X + X @ P
    return X


def delta_rule_chunked(q, k, v, beta, g, S, scale, chunk: int = GDN_CHUNK, solve: str = "substitution"):
    """Chunked WY form of the same recurrence (Hugging Face's `chunk_gated_delta_rule`, no clamps).

    Shapes as `delta_rule_recurrent`; S [H, dv, dk]. Tokens with beta = g = 0 and k = v = 0 leave the
    state unchanged, which is how padding is made inert. solve: "substitution" (`unit_lower_solve`) or
    "inverse" (`unit_lower_inverse`; `RunConfig.gdn_solve`).
    """
    T, H, dk = k.shape
    dv = v.shape[-1]
    C = min(chunk, T)
    pad = -T % C
    if pad:
        z = lambda a: jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))
        q, k, v, beta, g = map(z, (q, k, v, beta, g))
    N = (T + pad) // C
    to_chunks = lambda a: a.reshape(N, C, H, *a.shape[2:]).swapaxes(1, 2)  # [N, H, C, ...]
    q, k, v, beta, g = map(to_chunks, (q * jnp.float32(scale), k, v, beta, g))

    gam = jnp.cumsum(g, axis=-1)  # [N, H, C]
    incl = jnp.tril(jnp.ones((C, C), bool))
    strict = jnp.tril(jnp.ones((C, C), bool), -1)
    diff = gam[..., :, None] - gam[..., None, :]  # gamma_i - gamma_j
    decay = jnp.where(incl, jnp.exp(jnp.where(incl, diff, 0.0)), 0.0)  # zero the upper part before exp
    kb = k * beta[..., None]
    vb = v * beta[..., None]
    A = jnp.where(strict, jnp.einsum("nhid,nhjd->nhij", kb, k) * decay, 0.0)
    rhs = jnp.concatenate([vb, kb * jnp.exp(gam)[..., None]], axis=-1)
    # (I + A)^{-1} [v_b, k_b e^gamma]
    X = unit_lower_inverse(A) @ rhs if solve == "inverse" else unit_lower_solve(A, rhs)
    U, W = X[..., :dv], X[..., dv:]
    qk = jnp.where(incl, jnp.einsum("nhid,nhjd->nhij", q, k) * decay, 0.0)
    qg = q * jnp.exp(gam)[..., None]
    kdec = k * jnp.exp(gam[..., -1:] - gam)[..., None]
    glast = jnp.exp(gam[..., -1])  # [N, H]

    def body(S_hf, xs):  # S_hf [H, dk, dv]
        U, W, qk, qg, kdec, glast = xs
        v_new = U - W @ S_hf
        o = qg @ S_hf + qk @ v_new
        S_hf = glast[:, None, None] * S_hf + kdec.swapaxes(-1, -2) @ v_new
        return S_hf, o

    S_hf, o = jax.lax.scan(body, S.swapaxes(-1, -2), (U, W, qk, qg, kdec, glast))
    o = o.swapaxes(1, 2).reshape(N * C, H, dv)[:T]
    return o, S_hf.swapaxes(-1, -2)


def _parent(parent: jax.Array | None, t: jax.Array) -> jax.Array:
    """Row t's parent row: parent[t] for draft-tree rows, t - 1 for a chain; -1 is the given state."""
    return t - 1 if parent is None else jax.lax.dynamic_index_in_dim(parent, t, keepdims=False)


def _row_start(p: jax.Array, given: jax.Array, snaps: jax.Array, from_snapshot) -> jax.Array:
    """The state a row with parent p starts from: snapshot p, or for a root row (p < 0) the given state,
    or with from_snapshot the previous pass's snapshot of that index, read in place (only row 0 is a
    root then, and it reads its slot before writing it)."""
    at = functools.partial(jax.lax.dynamic_index_in_dim, keepdims=False)
    if from_snapshot is None:
        return jnp.where(p < 0, given, at(snaps, jnp.maximum(p, 0)))
    return at(snaps, jnp.where(p < 0, from_snapshot, p))


class GatedDeltaNet(nnx.Module):
    """GDN mixer: fused input projection [qkv | z | beta | alpha], causal conv, delta rule, gated norm."""

    def __init__(self, c: ModelConfig, chunk: int = GDN_CHUNK, solve: str = "substitution", step: str = "xla"):
        """chunk, solve: the chunked form's chunk length and solver (`RunConfig.gdn_chunk`, `gdn_solve`);
        step: the recurrent form's delta rule step (`RunConfig.gdn_step`: "auto", "native" or "xla")."""
        self.chunk, self.solve = int(chunk), solve
        self.Hk, self.Hv, self.dk = c.ssm_n_group, c.ssm_dt_rank, c.ssm_d_state
        self.dv = c.ssm_d_inner // c.ssm_dt_rank
        self.conv_dim, self.kc, self.eps = c.conv_dim, c.ssm_conv_kernel, c.rms_eps
        self.pairing = c.gdn_head_pairing
        self.w_in = Linear(c.d_model, c.conv_dim + c.ssm_d_inner + 2 * c.ssm_dt_rank)
        self.conv_w = nnx.Param(jnp.zeros((c.ssm_conv_kernel, c.conv_dim), jnp.float32))  # [Kc, C]
        self.dt_bias = nnx.Param(jnp.zeros((c.ssm_dt_rank,), jnp.float32))
        self.a = nnx.Param(jnp.zeros((c.ssm_dt_rank,), jnp.float32))  # ssm_a = -exp(A_log), as stored
        self.norm = nnx.Param(jnp.ones((self.dv,), jnp.float32))  # ssm_norm, no +1
        self.w_out = Linear(c.ssm_d_inner, c.d_model)
        self.native = gdn_native.uses_native(step, self.dk)

    @property
    def scale(self) -> float:
        return 1.0 / self.dk ** 0.5

    def _project(self, x, rows=None):
        C, Hv = self.conv_dim, self.Hv
        y = self.w_in(x, rows)
        qkv = y[:, :C]
        z = y[:, C: C + Hv * self.dv].reshape(-1, Hv, self.dv)
        beta = jax.nn.sigmoid(y[:, C + Hv * self.dv: C + Hv * self.dv + Hv])
        alpha = y[:, C + Hv * self.dv + Hv:]
        g = self.a[...] * softplus(alpha + self.dt_bias[...])
        return qkv, z, beta, g

    def _split_heads(self, y):
        """Post-conv [..., C] -> L2-normed q, k expanded to [..., Hv, dk] and v [..., Hv, dv]."""
        Hk, Hv, dk, dv = self.Hk, self.Hv, self.dk, self.dv
        lead = y.shape[:-1]
        q = l2_norm(y[..., : Hk * dk].reshape(*lead, Hk, dk), self.eps)
        k = l2_norm(y[..., Hk * dk: 2 * Hk * dk].reshape(*lead, Hk, dk), self.eps)
        v = y[..., 2 * Hk * dk:].reshape(*lead, Hv, dv)
        r = Hv // Hk
        if self.pairing == "tiled":  # v-head n uses k-head n % Hk
            q = jnp.concatenate([q] * r, axis=-2)
            k = jnp.concatenate([k] * r, axis=-2)
        else:  # grouped (qwen3next): v-head n uses k-head n // r
            q = jnp.repeat(q, r, axis=-2)
            k = jnp.repeat(k, r, axis=-2)
        return q, k, v

    def _conv_row(self, window):
        """Depthwise causal conv of one token: window [Kc, C] (oldest first) -> [C], summed in tap order."""
        w = self.conv_w[...]
        acc = w[0] * window[0]
        for i in range(1, self.kc):
            acc = acc + w[i] * window[i]
        return acc

    def _finish(self, o, z, rows=None):
        """Gated RMSNorm per head, then the output projection. o, z [T, Hv, dv] -> [T, D]; rows: only
        rows [0, rows) are needed (`Linear`)."""
        o = rms_norm(o, self.norm[...], self.eps) * jax.nn.silu(z)
        return self.w_out(o.reshape(o.shape[0], -1), rows)

    def _conv_token(self, conv, qkv_t):
        """One token's conv: the conv state before it -> (conv state after it, q, k, v)."""
        window = jnp.concatenate([conv, qkv_t[None]], axis=0)
        q, k, v = self._split_heads(jax.nn.silu(self._conv_row(window)))
        return window[1:], q, k, v

    def _token(self, conv, S, qkv_t, beta_t, g_t):
        """One token of the recurrent form: (conv, ssm) state before it -> (conv, ssm, o [Hv, dv])."""
        conv, q, k, v = self._conv_token(conv, qkv_t)
        if self.native:
            S, o = gdn_native.step(S, q, k, v, beta_t, g_t, self.scale)
        else:
            S, o = delta_rule_step(S, q, k, v, beta_t, g_t, self.scale)
        return conv, S, o

    def recurrent(self, x: jax.Array, conv_state: jax.Array, ssm_state: jax.Array, parent: jax.Array | None = None,
                  rows: jax.Array | None = None, snapshots: bool = True, into=None, from_snapshot=None):
        """Token-by-token form. x [T, D] -> (out [T, D], conv snapshots [T, Kc-1, C], ssm snapshots
        [T, Hv, dv, dk]); snapshot t is the state right after token t. parent [T] (draft-tree rows,
        parent[t] < t): row t starts from snapshot parent[t] (-1: the given state) instead of row t-1's.
        rows: only rows [0, rows) are needed (bucket padding after them: their projections may be +0.0).
        snapshots False (a chain whose last row's state is all that is kept, e.g. a decode step): the
        loop carries the state only and returns (out, conv, ssm) after the last computed row; the same
        per-row operations, without writing T snapshots (2 MB a row on the 35B shapes).
        into: (conv [T, ...], ssm [T, ...]) buffers the snapshots are written into, their contents never
        read (e.g. the previous pass's snapshots, donated: written in place instead of T fresh zeroed
        buffers, whose pages a CPU process faults in on every pass); None, or buffers of another width:
        zeros. Rows >= rows keep whatever the buffers held.
        from_snapshot: the state row 0 starts from is snapshot `from_snapshot` of `into` (the previous
        pass's rollback), not conv_state / ssm_state: read in place before row 0 overwrites slot 0, so a
        pass does not first copy the snapshot into the state (2 MB a GDN layer on the 35B shapes). The
        per-row operations, and so the bits, are those of a pass from the state itself."""
        qkv, z, beta, g = self._project(x, rows)
        T = qkv.shape[0]
        # The loop runs rows [0, rows) only: a padding row's recurrence (~1 ms on the 35B shapes) is not
        # computed; its output row and snapshots stay +0.0. The trip count goes through an optimization
        # barrier so that it is never a compile-time constant: XLA would then simplify a one-trip loop
        # into straight-line code with other fusions (other bits) than the verify bucket's loop.
        n = jax.lax.optimization_barrier(jnp.asarray(T if rows is None else rows, jnp.int32))
        o = jnp.zeros((T,) + z.shape[1:], jnp.float32)
        at = functools.partial(jax.lax.dynamic_index_in_dim, keepdims=False)
        put = functools.partial(jax.lax.dynamic_update_index_in_dim, axis=0)

        def step(t, carry):  # row t, both loops
            conv, S, o = carry
            conv, S, o_t = self._token(conv, S, at(qkv, t), at(beta, t), at(g, t))
            return conv, S, put(o, o_t, t)

        if not snapshots:
            if parent is not None:
                raise ValueError("draft-tree rows need their snapshots")
            conv, S, o = jax.lax.fori_loop(0, n, step, (conv_state, ssm_state, o))
            return self._finish(o, z, rows), conv, S
        like = [((T,) + a.shape, a.dtype) for a in (conv_state, ssm_state)]
        if into is not None and [(a.shape, a.dtype) for a in into] == like:
            snaps = tuple(into)
        elif from_snapshot is not None:
            raise ValueError("from_snapshot needs `into` buffers of this pass's width")
        else:
            snaps = tuple(jnp.zeros(shape, dtype) for shape, dtype in like)

        if self.native:
            return self._native_rows(qkv, z, beta, g, n, rows, conv_state, ssm_state, parent, snaps, from_snapshot)

        # Row t starts from snapshot parent[t] (a chain's parent is t - 1), -1: the given state. The loop
        # carries the snapshots only, not the state: a carried state would be a copy of the given one,
        # and XLA makes every layer's copy at the start of the pass (a temp buffer of 2 MB a GDN layer,
        # which a CPU process faults in afresh on every pass).
        def body(t, carry):
            o, (conv_snaps, ssm_snaps) = carry
            p = _parent(parent, t)
            conv = _row_start(p, conv_state, conv_snaps, from_snapshot)
            S = _row_start(p, ssm_state, ssm_snaps, from_snapshot)
            conv, S, o = step(t, (conv, S, o))
            return o, (put(conv_snaps, conv, t), put(ssm_snaps, S, t))

        o, (conv_snaps, ssm_snaps) = jax.lax.fori_loop(0, n, body, (o, snaps))
        return self._finish(o, z, rows), conv_snaps, ssm_snaps

    def _native_rows(self, qkv, z, beta, g, n, rows, conv_state, ssm_state, parent, snaps, from_snapshot):
        """`recurrent`'s snapshot form with the native step: each row's conv first (from its parent row's conv
        snapshot), then the delta rule of rows [0, n) in one call (gdn_native.rows), which reads the starting
        state once for all rows and streams each row's state into its slot. A row's arithmetic is the decode
        step's, so its bits are too."""
        T = qkv.shape[0]
        at = functools.partial(jax.lax.dynamic_index_in_dim, keepdims=False)
        put = functools.partial(jax.lax.dynamic_update_index_in_dim, axis=0)
        conv_snaps, ssm_snaps = snaps
        _, q0, k0, v0 = jax.eval_shape(self._conv_token, conv_state, qkv[0])
        qkv_rows = tuple(jnp.zeros((T,) + a.shape, a.dtype) for a in (q0, k0, v0))

        if parent is None:
            # A chain: row t starts from row t - 1's conv state, carried as a decode step's loop carries it.
            # Read from its snapshot instead (a dynamic index fused into the conv), XLA:CPU ran each row's conv
            # and SiLU as scalar code: ~45 us a row and layer against ~5.
            def chain_body(t, carry):
                conv, conv_snaps, qkv_rows = carry
                conv, *row = self._conv_token(conv, at(qkv, t))
                return conv, put(conv_snaps, conv, t), tuple(put(a, r, t) for a, r in zip(qkv_rows, row))

            conv0 = conv_state if from_snapshot is None else at(conv_snaps, from_snapshot)
            _, conv_snaps, (q, k, v) = jax.lax.fori_loop(0, n, chain_body, (conv0, conv_snaps, qkv_rows))
        else:
            def body(t, carry):
                conv_snaps, qkv_rows = carry
                conv = _row_start(_parent(parent, t), conv_state, conv_snaps, from_snapshot)
                conv, *row = self._conv_token(conv, at(qkv, t))
                return put(conv_snaps, conv, t), tuple(put(a, r, t) for a, r in zip(qkv_rows, row))

            conv_snaps, (q, k, v) = jax.lax.fori_loop(0, n, body, (conv_snaps, qkv_rows))
        par = jnp.arange(T, dtype=jnp.int32) - 1 if parent is None else parent
        ssm_snaps, o = gdn_native.rows(ssm_state, ssm_snaps, par, -1 if from_snapshot is None else from_snapshot,
                                       n, q, k, v, beta, g, self.scale)
        return self._finish(o, z, rows), conv_snaps, ssm_snaps

    def chunked(self, x: jax.Array, valid: jax.Array, n_valid: jax.Array, conv_state: jax.Array,
                ssm_state: jax.Array, chunk: int | None = None):
        """Prefill form. x [T, D]; rows >= n_valid (valid False) are padding and leave the state as is.
        Returns (out [T, D], conv state, ssm state) after the last valid row."""
        T = x.shape[0]
        qkv, z, beta, g = self._project(x, n_valid)
        X = jnp.concatenate([conv_state, qkv], axis=0)  # [Kc-1+T, C]
        w = self.conv_w[...]
        acc = w[0] * X[0:T]
        for i in range(1, self.kc):
            acc = acc + w[i] * X[i:i + T]
        new_conv = jax.lax.dynamic_slice_in_dim(X, n_valid, self.kc - 1, axis=0)
        q, k, v = self._split_heads(jax.nn.silu(acc))
        m = valid[:, None]
        beta, g = jnp.where(m, beta, 0.0), jnp.where(m, g, 0.0)
        k, v = jnp.where(m[..., None], k, 0.0), jnp.where(m[..., None], v, 0.0)
        o, S = delta_rule_chunked(q, k, v, beta, g, ssm_state, self.scale, self.chunk if chunk is None else chunk,
                                  self.solve)
        return self._finish(o, z, n_valid), new_conv, S

    def sequential(self, x: jax.Array, valid: jax.Array, n_valid: jax.Array, conv_state: jax.Array,
                   ssm_state: jax.Array):
        """The recurrent form with the chunked form's signature: the state after the last valid row (a
        decode step; and the cross-check of the two forms)."""
        return self.recurrent(x, conv_state, ssm_state, rows=n_valid, snapshots=False)
