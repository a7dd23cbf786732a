"""The products' spinning helper threads (csrc/spin_pool.h): a product hands its helpers' share to threads
that stay awake between products instead of to XLA's pool. The work split never changes a bit (row-stable
kernels), so every product equals ggml's own graph with the helpers on and off, from concurrent callers
too, and the helpers do take work."""

from __future__ import annotations

import os
import threading

import jax
import numpy as np
import pytest

from gguf import GGMLQuantizationType as Q
from sharpi_jax.quant import ggml
from tests.bitwise import assert_bitwise_equal
from tests.quant.test_ggml import _blocks, _experts, _ids, _reference, _x


@pytest.fixture
def spin():
    """Runs the body with the spin time it sets, then restores the default's."""
    before = ggml.spin_us()
    yield ggml.set_spin_us
    ggml.set_spin_us(before)


def _product():
    # 640 rows x 2048 (1.3 M multiply-adds a row): past the size from which a product spreads over threads.
    raw = _blocks(Q.Q4_K, rows=640, cols=2048, fixture=False, seed=11)
    x = _x(5, 2048, seed=3)
    return jax.jit(lambda x, raw: ggml.matmul(x, raw, Q.Q4_K)), x, raw, _reference().mul_mat(x, raw, Q.Q4_K)


def test_default_spin_time():
    """200 us unless SHARPI_GGML_SPIN_US says otherwise (the extension reads it once, at import)."""
    assert ggml.spin_us() == max(0, int(os.environ.get("SHARPI_GGML_SPIN_US", "200")))


@pytest.mark.parametrize("us", [0, 200])
def test_products_are_ggml_bitwise_with_helpers_on_and_off(spin, us):
    spin(us)
    f, x, raw, ref = _product()
    before = ggml.spin_tasks_run()
    for m in (1, 2, 5):
        assert_bitwise_equal(np.asarray(f(x[:m], raw)), ref[:m])
    qtypes = (Q.Q4_K, Q.Q4_K, Q.Q6_K)
    gate, up, down = _experts(qtypes, e=4, d=512, f=1024, seed=3)
    xe, ids = _x(6, 512, seed=4), _ids(6, 3, 4, seed=1)
    run = jax.jit(lambda x, ids: ggml.expert_rows(x, ids, gate, up, down, qtypes))
    y = np.asarray(run(xe, ids))
    assert_bitwise_equal(y, ggml.host_expert_rows(xe, ids, gate, up, down, qtypes, threads=1))
    ran = ggml.spin_tasks_run() - before
    assert ran > 0 if us else ran == 0  # on: the helpers took part of the work; off: XLA's pool did


def test_concurrent_callers_keep_their_bits(spin):
    """Four threads multiplying at once share the helpers; every result is still ggml's."""
    spin(200)
    f, x, raw, ref = _product()
    f(x, raw).block_until_ready()
    bad = []

    def caller(seed):
        rng = np.random.default_rng(seed)
        for _ in range(12):
            m = int(rng.integers(1, 6))
            y = np.asarray(f(x[:m], raw))
            if not np.array_equal(y.view(np.uint32), ref[:m].view(np.uint32)):
                bad.append(m)

    threads = [threading.Thread(target=caller, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad
