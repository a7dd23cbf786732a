"""llama.cpp (llama-cpp-python, optional) loads our synthetic files and tokenizes like us.

Skipped where llama-cpp-python is not installed (it is an optional benchmark extra, never a CI need).
"""

from __future__ import annotations

import numpy as np
import pytest

from sharpi_jax.gguf import GGUFFile
from sharpi_jax.gguf.tokenizer import Tokenizer
from sharpi_jax.testing import write_synthetic_gguf
from tests.testing.test_synthetic import _fixture_config

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (optional extra)")


@pytest.mark.parametrize("name,qtype", [("tiny-qwen35moe", "Q8_0"), ("tiny-qwen35moe", "Q4_K"),
                                        ("tiny-qwen35", "Q5_0"), ("tiny-qwen3next", "BF16")])
def test_llamacpp_loads_synthetic(tmp_path, name, qtype):
    config, _ = _fixture_config(name)
    p = write_synthetic_gguf(tmp_path / "s.gguf", config, qtype=qtype, seed=5)
    model = llama_cpp.Llama(model_path=str(p), n_ctx=64, n_threads=2, verbose=False, logits_all=True)
    with GGUFFile(p) as f:
        ours = Tokenizer.from_gguf_fields(f.metadata)
    text = "def main(argv):\n    return 0\n"
    ids = model.tokenize(text.encode(), add_bos=False, special=False)
    assert ids == ours.encode(text)
    model.eval(ids)
    logits = np.asarray(model.scores[: len(ids)])
    assert logits.shape == (len(ids), config.n_vocab) and np.isfinite(logits).all()
