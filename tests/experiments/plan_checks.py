"""Run by tests/experiments/test_memory_plan.py in a subprocess (N forced host devices must be set
before jax starts): load a GGUF as `info --plan` describes and print the bytes actually held, as JSON.

    python tests/experiments/plan_checks.py PATH EXPERT_BUDGET DEVICES
"""

import gc
import json
import os
import sys

path, budget, devices = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import sharpi_jax as sj  # noqa: E402
from sharpi_jax.model.footprint import held_bytes  # noqa: E402


def per_device(model) -> list[int]:
    """Bytes of the model's arrays held on each device (shards of sharded arrays, replicas whole)."""
    out = {d: 0 for d in jax.devices()}
    for leaf in jax.tree.leaves(nnx.state(model)):
        if isinstance(leaf, jax.Array):
            for s in leaf.addressable_shards:
                out[s.device] += int(np.prod(s.data.shape, dtype=np.int64)) * s.data.dtype.itemsize
    return list(out.values())


out = {}
engine = sj.load(path, max_context=64)  # one engine alive at a time: the real-shape slices are large
out["resident_bytes"] = sum(held_bytes(engine.model).values())
del engine
gc.collect()
engine = sj.load(path, max_context=64, expert_budget=budget, expert_policy="static")
out["budget_device_bytes"] = sum(held_bytes(engine.model).values())
out["host_stream_bytes"] = engine.residency.plan.total_expert_bytes - engine.residency.plan.slot_bytes
del engine
gc.collect()
engine = sj.load(path, max_context=64, expert_parallel=devices)
out["expert_parallel_device_bytes"] = per_device(engine.model)
print(json.dumps(out))
