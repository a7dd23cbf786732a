"""The device loops' shared skeleton: generation as ONE jitted program per run, a `lax.while_loop` on the
device after the prefill (`drive`), whose pass body each strategy supplies (`strategies.plain`: the
decode loop; `strategies.chain`: the MTP chain loop, draft, verify, accept, rollback, emit, stop;
`strategies.tree`: the MTP tree loop, over the traced tree logic of `tree_device`). Here: the output
buffer's size (`out_slots`), the stop codes (`STOP_REASONS`, `stop_code`, `first_token`, `pass_stop`),
the EOS array, the sampling rule (`picker`, `row_targets`, and `lazy_walk`, which computes a pass's LM-head
rows one at a time, only those its acceptance reaches) and the jit of a loop (`jit_loop`; the
strategies keep their programs with `compiled.derived_cache`).

Each strategy's host loop is the sequential reference; its device loop runs the same jitted step
functions (nested in the loop body), the same sampling rule (`sampling.draw` with the key of each
generated-token index) and the same stop order (an EOS set, max_new_tokens, then the context end), so
they give the same tokens bit for bit (`tests/runtime/test_device_loop.py`). The host receives the
tokens once, at the end.

Shapes are static per compile: the output buffer holds `out_slots(max_new_tokens, width)` tokens
(rounded up to a power of two, so nearby lengths share a compile); what a pass drafts, accepts and
emits are device scalars.
"""

from __future__ import annotations

from typing import Callable, Collection

import jax
import jax.numpy as jnp
import numpy as np

from sharpi_jax.runtime.sampling import argmax, draw

STOP_REASONS = (None, "eos", "max_new_tokens", "max_context")  # index = the loop's stop code


def out_slots(max_new_tokens: int, width: int = 0) -> int:
    """Output buffer length: max_new_tokens + width + 1 (a pass may emit width + 1 tokens), rounded up
    to a power of two (>= 64, so short runs share one compile)."""
    need = int(max_new_tokens) + int(width) + 1
    return max(64, 1 << (need - 1).bit_length())


def eos_array(stop_ids: Collection[int]) -> np.ndarray:
    """The stop token ids as an int32 array (at least one entry)."""
    ids = sorted(int(i) for i in stop_ids)
    return np.array(ids or [-1], np.int32)  # -1: no token id matches


def picker(greedy: bool, sampling):
    """token(logits [V], generated index) with the host loop's rule."""
    if greedy:
        return lambda logits, i: argmax(logits)
    seed, temperature, top_k, top_p, min_p = sampling
    return lambda logits, i: draw(logits, seed, i, temperature, top_k, top_p, min_p)


def stop_code(tok, eos, n_out, max_new):
    """After emitting tok as the n_out-th token: 1 (EOS), 2 (max_new_tokens) or 0."""
    return jnp.where(jnp.any(tok == eos), 1, jnp.where(n_out == max_new, 2, 0)).astype(jnp.int32)


def first_token(greedy: bool, sampling, logits, pos, eos, max_new, max_context):
    """(the token after the prefill, its stop code: EOS, max_new_tokens, then the context end at pos)."""
    tok = picker(greedy, sampling)(logits, jnp.int32(0))
    stop = stop_code(tok, eos, 1, max_new)
    return tok, jnp.where((stop == 0) & (pos >= max_context), 3, stop)


# Carry fields a stopped sequence of a batch may let go stale: the big state, never read after it stops.
_STALE_OK = frozenset({"cache", "state", "mtp_cache", "snaps"})


def drive(init, body, fin, per_seq: tuple, batch: bool):
    """The generation loop: carry = init(*per_seq), then body while carry["stop"] == 0, then fin(carry).

    batch (a batch of sequences, `runtime.batch`; per_seq arrays with a leading sequence axis): init, body
    and fin run under jax.vmap, and the loop runs while any sequence is live. A stopped sequence's body
    runs with `live` False (its rows are padding rows) and only its small fields are held (a select per
    field); the big state (_STALE_OK) is left as the padding step leaves it, as nothing reads it after
    the stop. (vmap of a while_loop would instead select the whole carry, KV caches and GDN snapshots
    included, every step.)"""
    if not batch:
        return fin(jax.lax.while_loop(lambda c: c["stop"] == 0, body, init(*per_seq)))

    def step(c):
        new, live = jax.vmap(body)(c), c["stop"] == 0
        hold = lambda a, b: jnp.where(live.reshape(live.shape + (1,) * (a.ndim - 1)), a, b)  # noqa: E731
        return {k: v if k in _STALE_OK else jax.tree.map(hold, v, c[k]) for k, v in new.items()}

    c = jax.lax.while_loop(lambda c: jnp.any(c["stop"] == 0), step, jax.vmap(init)(*per_seq))
    return jax.vmap(fin)(c)


def row_targets(greedy: bool, sampling, logits, greedy_rows, n_out, depth: Callable, n_rows: int):
    """The target's token of each of a pass's n_rows verify rows: the trunk's argmax rows (greedy), else
    the host loop's draw at the generated index of the row's next token (n_out - 1 + depth(r) + 1; n_out:
    the tokens emitted before the pass, its certain token included)."""
    if greedy:
        return greedy_rows
    pick = picker(greedy, sampling)
    index = n_out - 1  # generated index of the certain token
    return jnp.stack([pick(logits[r], index + depth(r) + 1) for r in range(n_rows)])


def lazy_walk(head_row: Callable, target_of: Callable, child_of: Callable, n_rows: int, max_steps: int):
    """A pass's acceptance with the LM head computed row by row (`RunConfig.verify_head` "lazy"): from row
    0, the row's logits (`head_row(r)` -> [V]) give its target token (`target_of(logits, r)`); the walk
    moves to the row whose draft holds that token (`child_of(r, token)` -> (found, row); a chain: r + 1,
    a tree: the child of r), at most max_steps times. Only the walked rows' head is computed; each has the
    bits it has in a full head product, so the walk accepts what `row_targets` and the full acceptance
    would. Returns (path [n_rows]: the walked rows, root first, zero-padded; a, the accepted drafts;
    the last row; target [n_rows]: the walked rows' tokens, 0 elsewhere)."""

    def body(s):
        cur, a, path, target, _ = s
        tok = target_of(head_row(cur), cur)
        target = target.at[cur].set(tok)
        found, nxt = child_of(cur, tok)
        found = found & (a < max_steps)
        path = jnp.where(found, path.at[jnp.minimum(a + 1, n_rows - 1)].set(nxt), path)
        return jnp.where(found, nxt, cur), a + found.astype(jnp.int32), path, target, found

    zi, zeros = jnp.int32(0), jnp.zeros((n_rows,), jnp.int32)
    cur, a, path, target, _ = jax.lax.while_loop(lambda s: s[4], body, (zi, zi, zeros, zeros, jnp.bool_(True)))
    return path, a, cur, target


def pass_stop(emit, a, n_out, P, rows, eos, max_new, max_context):
    """A pass that emits emit[0..a] after n_out tokens, from the certain token at P: (its stop code, the
    first of EOS then max_new_tokens among the emitted rows, else the context end at P + a + 1; whether a
    row stops; the first stopping row j; P + a + 1)."""
    emitted = rows <= a
    is_eos = jnp.any(emit[:, None] == eos[None, :], axis=1) & emitted
    is_max = (n_out + rows + 1 == max_new) & emitted
    hit_stop = is_eos | is_max
    j = jnp.argmax(hit_stop)  # the first stopping token (when any)
    any_stop = jnp.any(hit_stop)
    P_new = P + a + 1
    stop = jnp.where(any_stop, jnp.where(is_eos[j], 1, 2), jnp.where(P_new >= max_context, 3, 0))
    return stop, any_stop, j, P_new


def jit_loop(run: Callable, batch: bool, static_argnames: tuple[str, ...], donate: tuple[str, ...] = ()):
    """A strategy's loop function `run(params, cache, ...)` jitted: unless batch, the trunk's `cache` and
    the arguments named in `donate` donated (the sequence's state, which the loop carries and returns:
    not donated, XLA copies every KV cache into the loop's buffers on every generation); static_argnames
    static."""
    return jax.jit(run, donate_argnames=() if batch else ("cache",) + tuple(donate),
                   static_argnames=static_argnames)
