"""Weights on huge pages (sharpi_jax/quant/hostmem.py): the same bytes, held in place, advised as promised.

The reference for the bytes is the host array itself; that XLA holds the aligned copy in place (no second
copy: memory equal to the file) shows in the buffer's address (2 MiB-aligned, as no XLA allocation of its
own is); the advice is checked on the calls made, since whether the kernel grants huge pages depends on the
machine (THP off, or no 2 MiB of free memory, leaves the same bytes on 4 KiB pages).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from sharpi_jax.quant import hostmem, qtensor
from tests.bitwise import assert_bitwise_equal

pytestmark = pytest.mark.skipif(hostmem._madvise() is None, reason="no madvise on this OS: an ordinary copy")


def _raw(nbytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


@pytest.mark.parametrize("nbytes", [hostmem.MIN_BYTES, 5 * hostmem.HUGE_PAGE + 12345, 3 * hostmem.HUGE_PAGE])
def test_large_weights_are_the_same_bytes_in_place_and_advised(monkeypatch, nbytes):
    calls = []
    real = hostmem._advise
    monkeypatch.setattr(hostmem, "_advise", lambda a, n, adv: (calls.append((a, n, adv)), real(a, n, adv)))
    raw = _raw(nbytes).reshape(-1, 1)
    out = hostmem.device_bytes(raw)
    assert_bitwise_equal(np.asarray(out), raw)
    ptr = out.unsafe_buffer_pointer()
    assert ptr % hostmem.HUGE_PAGE == 0, "XLA copied the weight instead of using the aligned host copy"
    whole = nbytes // hostmem.HUGE_PAGE * hostmem.HUGE_PAGE
    tail = -(-nbytes // 4096) * 4096 - whole
    assert calls[0] == (ptr, whole, hostmem._MADV_HUGEPAGE)
    # No page past the weight may be a huge page: the last partial 2 MiB stays on 4 KiB pages.
    assert calls[1] == (ptr + whole, tail, hostmem._MADV_NOHUGEPAGE)


def test_small_weights_and_the_off_switch_are_plain_copies(monkeypatch):
    monkeypatch.setattr(hostmem, "_advise", lambda *a: pytest.fail("advised a small weight"))
    small = _raw(hostmem.MIN_BYTES - 4096).reshape(-1, 4096)
    assert_bitwise_equal(np.asarray(hostmem.device_bytes(small)), small)
    monkeypatch.setattr(hostmem, "ENABLED", False)
    big = _raw(hostmem.MIN_BYTES * 2, seed=1)
    assert_bitwise_equal(np.asarray(hostmem.device_bytes(big)), big)


def test_blocks_layout_of_host_bytes_goes_through_hostmem():
    # A Q4_K expert stack as the loader packs it: [E, rows, row_bytes] host bytes, "blocks" layout.
    e, rows, cols = 8, 512, 2048  # 4.5 MiB
    row_bytes = cols // 256 * 144
    raw = _raw(e * rows * row_bytes, seed=2).reshape(e, rows, row_bytes)
    t = qtensor.pack(raw, int(Q.Q4_K), (e, rows, cols), "blocks")
    assert_bitwise_equal(np.asarray(t.data["raw"]), raw)
    assert t.data["raw"].unsafe_buffer_pointer() % hostmem.HUGE_PAGE == 0
    m = qtensor.pack_rows(raw.reshape(e * rows, row_bytes), int(Q.Q4_K), cols, "blocks")
    assert_bitwise_equal(np.asarray(m.data["raw"]), raw.reshape(e * rows, row_bytes))
    assert m.data["raw"].unsafe_buffer_pointer() % hostmem.HUGE_PAGE == 0
    assert jax.tree.leaves(t)[0].dtype == np.uint8
