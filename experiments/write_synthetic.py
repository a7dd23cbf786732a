"""Write a synthetic GGUF (random weights, valid format) for benchmarks and memory work.

    python -m experiments.write_synthetic --preset=qwen36-35b-a3b --n_layer=4 --qtype=Q4_K --out=/tmp/x.gguf
    python -m experiments.write_synthetic --preset=tiny --qtype=Q8_0 --out=/tmp/tiny.gguf

Presets (sharpi_jax.config.SHAPE_PRESETS): `tiny` (the fixtures' shapes), `qwen36-35b-a3b` (the real
35B-A3B MoE shapes), `qwen35-27b` (the dense 27B shapes), `qwen35-122b-a10b` and `qwen35-397b-a17b`
(the large MoE members' published shapes; sources in configs/models.json), each with --n_layer trunk
layers + MTP block. Synthetic models are never used for correctness.
"""

from __future__ import annotations

from absl import app, flags

from experiments.cli import reports_bad_input
from sharpi_jax.config import SHAPE_PRESETS, shape_preset
from sharpi_jax.testing import write_synthetic_gguf

FLAGS = flags.FLAGS
flags.DEFINE_enum("preset", "tiny", list(SHAPE_PRESETS), "Model shape preset.")
flags.DEFINE_integer("n_layer", 4, "Trunk layers (every 4th is full attention), plus one MTP block.")
flags.DEFINE_string("qtype", "Q8_0", "ggml type of the weight matrices (F32, BF16, Q8_0, Q4_K, ...).")
flags.DEFINE_string("expert_qtype", None, "ggml type of the routed experts (default: --qtype).")
flags.DEFINE_integer("seed", 0, "Random seed.")
flags.DEFINE_string("out", None, "Output path.", required=True)


@reports_bad_input
def main(argv) -> int:
    del argv
    config = shape_preset(FLAGS.preset, FLAGS.n_layer)
    path = write_synthetic_gguf(FLAGS.out, config, qtype=FLAGS.qtype, expert_qtype=FLAGS.expert_qtype,
                                seed=FLAGS.seed, progress=True, name=f"synthetic-{FLAGS.preset}")
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    app.run(main)
