"""Describe a GGUF: model config, tensor count by quant type, expert vs non-expert bytes.

    python -m experiments.info --gguf=PATH [--json] [--tensors]
    python -m experiments.info --gguf=PATH --plan [--device_memory=80GiB] [--devices=8]
    python -m experiments.info --preset=qwen35-397b-a17b --qtype=Q4_K --plan --device_memory=80GiB --devices=8

With no --gguf it describes the embedded default model. --plan: what it takes to run the file (or a
shape preset at --qtype, no file needed) here (`experiments.memory_plan`): device bytes all-resident,
the expert budget that fits in --device_memory and the host bytes then left to stream, and the bytes
per device with expert parallelism over --devices.
"""

from __future__ import annotations

import collections
import json

from absl import app, flags

from experiments.cli import reports_bad_input
from sharpi_jax.assets import default_model_path
from sharpi_jax.errors import InputError
from sharpi_jax.gguf import GGUFFile, read_model_config

FLAGS = flags.FLAGS
flags.DEFINE_string("gguf", None, "GGUF file to describe (default: the embedded default model).")
flags.DEFINE_bool("json", False, "Print one JSON object instead of text.")
flags.DEFINE_bool("tensors", False, "Also list every tensor (name, type, shape, bytes).")
flags.DEFINE_bool("plan", False, "Print the memory plan: all-resident, with an expert budget, expert-parallel.")
flags.DEFINE_string("device_memory", None, "--plan: memory of one device ('80GiB', '24GB', bytes).")
flags.DEFINE_integer("devices", 1, "--plan: devices for expert parallelism (routed experts sharded by id).")
flags.DEFINE_integer("max_context", 4096, "--plan: context of the decode state reported beside the weights.")
flags.DEFINE_string("preset", None, "--plan without a file: a shape preset (sharpi_jax.config.SHAPE_PRESETS).")
flags.DEFINE_integer("n_layer", None, "--preset: trunk layers (default: the model's).")
flags.DEFINE_string("qtype", "Q4_K", "--preset: ggml type of the matrices.")
flags.DEFINE_string("expert_qtype", None, "--preset: ggml type of the routed experts (default --qtype).")


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


def memory_plan_of(path=None, preset=None) -> dict:
    """The --plan figures for a file or a shape preset (see experiments.memory_plan.plan)."""
    from experiments import memory_plan
    from sharpi_jax.config import shape_preset

    device_memory = None if FLAGS.device_memory is None else memory_plan.parse_bytes(FLAGS.device_memory)
    options = dict(device_memory=device_memory, devices=FLAGS.devices, max_context=FLAGS.max_context)
    if preset is not None:
        config = shape_preset(preset, FLAGS.n_layer)
        table = memory_plan.TensorTable(config, FLAGS.qtype, FLAGS.expert_qtype)
        return {"source": table.source, "preset": preset, **memory_plan.plan(table, config, **options)}
    with GGUFFile(path) as f:
        return {"source": str(path), **memory_plan.plan(f, read_model_config(f), **options)}


def _print_plan(p: dict) -> None:
    gib = lambda n: f"{n / 2**30:10.3f} GiB"  # noqa: E731
    print(f"memory plan of {p['source']} (weights as sj.load holds them; MTP block loaded on first MTP use)")
    print(f"all-resident            {gib(p['resident_bytes'])}  (dense {gib(p['dense_bytes']).strip()}, "
          f"routed experts {gib(p['expert_bytes']).strip()})")
    print(f"MTP block               {gib(p['mtp_bytes'])}")
    print(f"decode state            {gib(p['state_bytes'])}  (one sequence, max_context {p['max_context']})")
    if p.get("device_memory") is not None:
        budget = p["expert_budget"]
        print(f"device memory           {gib(p['device_memory'])}")
        print(f"expert budget that fits {'all experts' if budget is None else gib(budget)}")
        print(f"device bytes held       {gib(p['budget_device_bytes'])}  (sj.load(expert_budget=...))")
        print(f"host bytes to stream    {gib(p['host_stream_bytes'])}  (cold experts, from the mmap)")
    if p["devices"] > 1:
        print(f"expert-parallel / device{gib(p['expert_parallel_device_bytes'])}  (expert_parallel={p['devices']}: "
              f"dense replicated, experts / {p['devices']})")


def _mib(n: int) -> str:
    return f"{n / 2**20:10.2f} MiB"


@reports_bad_input
def main(argv) -> int:
    del argv
    if FLAGS.plan:
        if FLAGS.preset is not None and FLAGS.gguf is not None:
            raise InputError("--plan takes --gguf or --preset, not both")
        p = memory_plan_of(FLAGS.gguf or (None if FLAGS.preset else default_model_path()), FLAGS.preset)
        print(json.dumps(p)) if FLAGS.json else _print_plan(p)
        return 0
    d = describe(FLAGS.gguf or default_model_path())
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
