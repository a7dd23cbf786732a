"""Write a synthetic GGUF (random weights, valid format) for benchmarks and memory work.

    python -m experiments.write_synthetic --preset=qwen36-35b-a3b --n_layer=4 --qtype=Q4_K --out=/tmp/x.gguf
    python -m experiments.write_synthetic --preset=tiny --qtype=Q8_0 --out=/tmp/tiny.gguf

Presets: `tiny` (the fixtures' shapes: hidden 128, 16 experts top-4, GDN 2x4 heads), `qwen36-35b-a3b`
(the real 35B-A3B shapes with --n_layer trunk layers). Synthetic models are never used for correctness.
"""

from __future__ import annotations

import sys

from absl import app, flags

from sharpi_jax.config import ModelConfig, qwen36_35b_a3b
from sharpi_jax.errors import SharpiError
from sharpi_jax.testing import write_synthetic_gguf

FLAGS = flags.FLAGS
flags.DEFINE_enum("preset", "tiny", ["tiny", "qwen36-35b-a3b"], "Model shape preset.")
flags.DEFINE_integer("n_layer", 4, "Trunk layers (every 4th is full attention), plus one MTP block.")
flags.DEFINE_string("qtype", "Q8_0", "ggml type of the weight matrices (F32, BF16, Q8_0, Q4_K, ...).")
flags.DEFINE_string("expert_qtype", None, "ggml type of the routed experts (default: --qtype).")
flags.DEFINE_integer("seed", 0, "Random seed.")
flags.DEFINE_string("out", None, "Output path.", required=True)


def tiny_config(n_layer: int = 4) -> ModelConfig:
    """The fixtures' shapes (see ../shared/fixtures/README.md) with n_layer trunk layers + 1 MTP block."""
    return qwen36_35b_a3b(n_layer=n_layer).replace(
        n_vocab=2048, d_model=128, context_length=4096, n_head=4, n_head_kv=2, head_dim=32, n_rot=8,
        rope_sections=(2, 1, 1, 0), ssm_d_state=32, ssm_n_group=2, ssm_dt_rank=4, ssm_d_inner=128,
        n_expert=16, n_expert_used=4, expert_ff=64, shared_expert_ff=64)


def main(argv) -> int:
    del argv
    config = tiny_config(FLAGS.n_layer) if FLAGS.preset == "tiny" else qwen36_35b_a3b(n_layer=FLAGS.n_layer)
    try:
        path = write_synthetic_gguf(FLAGS.out, config, qtype=FLAGS.qtype, expert_qtype=FLAGS.expert_qtype,
                                    seed=FLAGS.seed, progress=True, name=f"synthetic-{FLAGS.preset}")
    except SharpiError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    app.run(main)
