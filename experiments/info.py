"""Describe a GGUF: model config, tensor count by quant type, expert vs non-expert bytes.

    python -m experiments.info --gguf=PATH [--json] [--tensors]

With no --gguf it describes the embedded default model.
"""

from __future__ import annotations

import collections
import json
import sys

from absl import app, flags

from sharpi_jax.assets import default_model_path
from sharpi_jax.errors import SharpiError
from sharpi_jax.gguf import GGUFFile, read_model_config

FLAGS = flags.FLAGS
flags.DEFINE_string("gguf", None, "GGUF file to describe (default: the embedded default model).")
flags.DEFINE_bool("json", False, "Print one JSON object instead of text.")
flags.DEFINE_bool("tensors", False, "Also list every tensor (name, type, shape, bytes).")


def describe(path) -> dict:
    """Everything `info` prints, as a dict."""
    with GGUFFile(path) as f:
        config = read_model_config(f)
        by_type: dict[str, dict[str, int]] = collections.defaultdict(lambda: {"tensors": 0, "bytes": 0})
        expert_bytes = other_bytes = 0
        tensors = []
        for t in f:
            by_type[t.qtype.name]["tensors"] += 1
            by_type[t.qtype.name]["bytes"] += t.nbytes
            if "_exps." in t.name:
                expert_bytes += t.nbytes
            else:
                other_bytes += t.nbytes
            tensors.append({"name": t.name, "type": t.qtype.name, "shape": list(t.shape), "bytes": t.nbytes})
        return {
            "path": str(path), "file_bytes": f.file_size, "gguf_version": f.version,
            "name": f.get("general.name"), "config": {k: (list(v) if isinstance(v, tuple) else v)
                                                       for k, v in vars(config).items()},
            "config_summary": config.summary(), "n_layer_trunk": config.n_layer,
            "tensor_count": len(f.tensors), "by_type": dict(sorted(by_type.items())),
            "expert_bytes": expert_bytes, "non_expert_bytes": other_bytes, "tensors": tensors,
        }


def _mib(n: int) -> str:
    return f"{n / 2**20:10.2f} MiB"


def main(argv) -> int:
    del argv
    try:
        path = FLAGS.gguf or default_model_path()
        d = describe(path)
    except SharpiError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if FLAGS.json:
        if not FLAGS.tensors:
            d.pop("tensors")
        d.pop("config_summary")
        print(json.dumps(d))
        return 0
    print(f"{d['path']}  ({d['name']}, GGUF v{d['gguf_version']}, {_mib(d['file_bytes']).strip()})")
    print("\n== config ==")
    print(d["config_summary"])
    print("\n== tensors by type ==")
    for qt, v in d["by_type"].items():
        print(f"{qt:8s} {v['tensors']:5d} tensors {_mib(v['bytes'])}")
    print(f"{'total':8s} {d['tensor_count']:5d} tensors {_mib(d['expert_bytes'] + d['non_expert_bytes'])}")
    print("\n== weight bytes ==")
    total = d["expert_bytes"] + d["non_expert_bytes"]
    print(f"routed experts {_mib(d['expert_bytes'])}  ({100 * d['expert_bytes'] / max(total, 1):.1f}%)")
    print(f"non-expert     {_mib(d['non_expert_bytes'])}  ({100 * d['non_expert_bytes'] / max(total, 1):.1f}%)")
    if FLAGS.tensors:
        print("\n== tensors ==")
        for t in d["tensors"]:
            print(f"{t['name']:45s} {t['type']:8s} {str(t['shape']):22s} {t['bytes']:12d}")
    return 0


if __name__ == "__main__":
    app.run(main)
