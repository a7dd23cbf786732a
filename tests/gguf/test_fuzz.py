"""Fuzz the GGUF header: mutated files must raise only our exceptions, never crash or hang.

50 cases run in CI; the `slow` variant runs 600 (pytest -m slow).
"""

from __future__ import annotations

import signal
import struct

import numpy as np
import pytest

from sharpi_jax.errors import SharpiError
from sharpi_jax.gguf import GGUFFile, read_model_config
from sharpi_jax.gguf.tokenizer import Tokenizer
from tests.conftest import fixture_path

SEED_FILE = ("tiny-qwen35moe", "tiny-qwen35moe-Q4_K_M.gguf")
CASE_TIMEOUT_S = 10


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang()


def _mutate(rng: np.random.Generator, data: bytes, header_len: int) -> bytes:
    """One header mutation: byte flips, a planted extreme integer, or a truncation."""
    d = bytearray(data)
    kind = rng.integers(0, 4)
    if kind == 0:  # flip a few random header bytes
        for _ in range(int(rng.integers(1, 8))):
            d[int(rng.integers(0, header_len))] = int(rng.integers(0, 256))
    elif kind == 1:  # plant an extreme u64/u32 where a length, count or offset may be
        pos = int(rng.integers(4, header_len - 8))
        extremes = [0, 1, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1, len(data), len(data) * 2]
        value = extremes[int(rng.integers(0, len(extremes)))]
        if rng.integers(0, 2):
            struct.pack_into("<Q", d, pos, value)
        else:
            struct.pack_into("<I", d, pos, value & 0xFFFFFFFF)
    elif kind == 2:  # truncate inside the header or the data
        d = d[: int(rng.integers(0, len(d)))]
    else:  # change a value type or array element type byte to something out of range
        pos = int(rng.integers(24, header_len - 4))
        struct.pack_into("<I", d, pos, int(rng.integers(0, 20)))
    return bytes(d)


def _exercise(path) -> None:
    """Everything a load does with the header: parse, config, tokenizer, one dequantized tensor."""
    with GGUFFile(path) as f:
        config = read_model_config(f)
        Tokenizer.from_gguf_fields(f.metadata, source=f.source)
        f.dequantize("output_norm.weight")
        assert config.n_layer >= 1


def _run_cases(tmp_path, n_cases: int, seed: int) -> dict[str, int]:
    src = fixture_path(*SEED_FILE)
    data = src.read_bytes()
    with GGUFFile(src) as f:
        header_len = f.data_offset
    rng = np.random.default_rng(seed)
    outcomes = {"ok": 0, "ours": 0}
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        for i in range(n_cases):
            p = tmp_path / f"fuzz{i % 4}.gguf"
            p.write_bytes(_mutate(rng, data, header_len))
            signal.alarm(CASE_TIMEOUT_S)
            try:
                _exercise(p)
                outcomes["ok"] += 1
            except SharpiError as e:
                assert str(e), "our exceptions always carry a message"
                outcomes["ours"] += 1
            except _Hang:
                pytest.fail(f"case {i} (seed {seed}) took more than {CASE_TIMEOUT_S}s: a hang")
            except Exception as e:  # noqa: BLE001 - the point of the test
                pytest.fail(f"case {i} (seed {seed}) raised {type(e).__name__}: {e}")
            finally:
                signal.alarm(0)
    finally:
        signal.signal(signal.SIGALRM, old)
    return outcomes


def test_fuzz_header_ci(tmp_path):
    outcomes = _run_cases(tmp_path, 50, seed=1234)
    assert outcomes["ours"] > 0  # the mutations do hit the validators


@pytest.mark.slow
def test_fuzz_header_slow(tmp_path):
    outcomes = _run_cases(tmp_path, 600, seed=98765)
    assert outcomes["ours"] > 100
