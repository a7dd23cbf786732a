"""Expert parallelism: routed experts sharded by expert id over the "expert" axis of a jax Mesh.

`sj.load(path, expert_parallel=N)` builds `expert_mesh(N)` (the first N of `jax.devices()`, which spans
every host after `jax.distributed.initialize()`), loads every MoE layer's routed experts with
`ShardedGGUFExperts` (device d holds experts [d*E/N, (d+1)*E/N) of every matrix, in their storage
form: SoA Q8_0 / Q4_K fields, raw GGUF blocks, or F32/F16; never float copies of quantized blocks)
and replicates every other param over the mesh (`replicate_dense`).

Dispatch (`sharded_expert_rows`) runs in `jax.shard_map`: every device gets the whole batch (u, sel
are replicated: the router runs everywhere), keeps the (row, rank) pairs whose expert it owns, maps
the others to a local bucket that no expert visits, and computes its pairs' unreduced expert outputs
Y [N, k, D] with the single-device dispatch (`dispatch.expert_rows`, grouped or per-token). The
results are combined with ONE psum over the expert axis of Y's bit patterns (int32): each pair has
exactly one owner and the other devices contribute integer 0, so the sum is the owner's bits exactly
(-0.0 and NaN payloads included). The weighted top-k reduce then runs replicated, as on one device.
Every row is computed by the same row-stable kernels as on one device, so the logits are bitwise
those of one device (the tests check it).

Bytes moved per token and MoE layer: the psum all-reduces k*D int32 per row, a 4*k*D-byte buffer
(64 KiB for k = 8, D = 2048) over the N devices (a ring all-reduce sends and receives 2(N-1)/N of it
per device). A psum of the already-reduced [rows, D] output would move k times fewer bytes but
reorders the top-k sum (not bitwise); an all-to-all of the routed rows moves about as much as the
psum each way but needs capacity-padded buckets. Bit parity with one device was chosen; the psum is
the one collective.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sharpi_jax.config import ModelConfig, RunConfig
from sharpi_jax.errors import InputError
from sharpi_jax.experts.dispatch import expert_rows, weighted_reduce
from sharpi_jax.experts.provider import ExpertFormat, GGUFExperts, RoutedExperts
from sharpi_jax.quant import QTensor
from sharpi_jax.gguf.reader import GGUFFile
from sharpi_jax.gguf.tensor_specs import expert_qtypes, expert_raw

EXPERT_AXIS = "expert"
_FORCE_FLAG = "--xla_force_host_platform_device_count"

__all__ = ["EXPERT_AXIS", "ShardedExperts", "ShardedGGUFExperts", "assemble_on_mesh", "check_expert_parallel",
           "device_bytes", "expert_mesh", "force_host_devices", "is_routed_expert", "replicate_dense",
           "sharded_expert_rows"]


def check_expert_parallel(n: Any, config: ModelConfig) -> int:
    """Validates `expert_parallel=n` for a model -> n as an int (InputError naming the problem)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise InputError(f"expert_parallel must be a positive integer (devices on the expert axis), got {n!r}")
    n = int(n)
    if not config.is_moe:
        raise InputError(f"expert_parallel={n}: the {config.arch} model has no routed experts to shard")
    if config.n_expert % n:
        raise InputError(f"expert_parallel={n} does not divide the {config.n_expert} experts per layer")
    available = len(jax.devices())
    if n > available:
        raise InputError(f"expert_parallel={n} needs {n} devices, jax sees {available} ({jax.default_backend()}); "
                         "on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N before jax starts, "
                         "across hosts call jax.distributed.initialize() first")
    return n


def force_host_devices(n: int) -> bool:
    """Ask XLA for at least n CPU devices (XLA_FLAGS --xla_force_host_platform_device_count; it only
    shapes the host platform, GPUs are unaffected). Works only before jax starts its backends:
    returns False (nothing changed) when they already run."""
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return False
    flags = os.environ.get("XLA_FLAGS", "").split()
    given = [int(f.split("=", 1)[1]) for f in flags if f.startswith(_FORCE_FLAG + "=")]
    flags = [f for f in flags if not f.startswith(_FORCE_FLAG)] + [f"{_FORCE_FLAG}={max([int(n)] + given)}"]
    os.environ["XLA_FLAGS"] = " ".join(flags)
    return True


def expert_mesh(n: int) -> Mesh:
    """A 1-D Mesh with axis "expert" over the first n devices (all hosts' devices, in process order)."""
    return Mesh(np.asarray(jax.devices()[:n]), (EXPERT_AXIS,))


# ----------------------------------------------------------------------------- dispatch


def owners_sum(y: jax.Array, owned: jax.Array) -> jax.Array:
    """Inside the shard_map: Y [N, k, D] with each (row, rank) pair taken from the device that owns its
    expert (owned [N, k] on that device), by ONE psum of int32 bit patterns to which every other device
    adds integer 0: the owner's bits exactly (module doc)."""
    bits = jnp.where(owned[..., None], jax.lax.bitcast_convert_type(y, jnp.int32), 0)
    return jax.lax.bitcast_convert_type(jax.lax.psum(bits, EXPERT_AXIS), jnp.float32)


def sharded_expert_rows(u: jax.Array, sel: jax.Array, experts: tuple[QTensor, QTensor, QTensor], mesh: Mesh,
                        mode: str = "grouped", row_kernel: str = "gemm") -> jax.Array:
    """Y [N, k, D] (Y[i, j] = expert_{sel[i, j]}(u[i])) with the (gate, up, down) QTensor stacks sharded
    on axis 0 over `mesh`'s expert axis: bitwise `dispatch.expert_rows(u, sel, experts, mode,
    row_kernel)[0]` (module doc)."""
    n_dev = mesh.shape[EXPERT_AXIS]
    experts = tuple(experts)
    e_local = experts[0].shape[0] // n_dev

    def local(u, sel, mine_experts):
        mine_experts = tuple(m.with_lead(e_local) for m in mine_experts)  # this device's [E / n, ...] stacks
        first = jax.lax.axis_index(EXPERT_AXIS).astype(jnp.int32) * e_local
        mine = (sel >= first) & (sel < first + e_local)
        # Pairs of other devices go to bucket e_local: past every local expert, so none visits them.
        y, _ = expert_rows(u, jnp.where(mine, sel - first, e_local), mine_experts, mode, row_kernel)
        return owners_sum(y, mine)

    weight_spec = jax.tree.map(lambda _: P(EXPERT_AXIS), experts)
    # check_vma=False: the dispatch loops carry replicated values that become device-varying (the
    # grouped while_loop's output rows); the out_specs P() is true after the psum.
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), weight_spec), out_specs=P(), check_vma=False)
    return sharded(u.astype(jnp.float32), sel.astype(jnp.int32), experts)


class ShardedExperts(RoutedExperts):
    """One layer's routed experts sharded by expert id over a mesh's "expert" axis (`moe.ExpertProvider`)."""

    def __init__(self, n_expert: int, d_model: int, d_ff: int, qtypes: tuple[int, int, int], mesh: Mesh,
                 run: RunConfig = RunConfig()):
        super().__init__(n_expert, d_model, d_ff, qtypes, run)
        self.mesh = mesh  # static (part of the graph): Mesh is hashable

    def __call__(self, u: jax.Array, sel: jax.Array, w: jax.Array, valid: jax.Array | None = None) -> jax.Array:
        y = sharded_expert_rows(u, sel, self.weights(), self.mesh, self.mode, self.row_kernel)
        return weighted_reduce(y, w.astype(jnp.float32))


# ----------------------------------------------------------------------------- loading and placement


def _assemble(parts: dict[Any, jax.Array], global_lead: int, sharding: NamedSharding) -> jax.Array:
    """Per-device arrays (experts on axis 0) -> one global array sharded by expert."""
    first = next(iter(parts.values()))
    shape = (global_lead,) + tuple(first.shape[1:])
    return jax.make_array_from_single_device_arrays(shape, sharding, [parts[d] for d in sharding.mesh.devices.flat
                                                                      if d in parts])


def assemble_on_mesh(parts: dict[Any, Any], mesh: Mesh) -> Any:
    """{device: its value} over the expert axis -> one global value sharded on axis 0 over `mesh`.
    QTensor stacks of one layout (each addressable device's part) are concatenated on their expert
    axis; numpy arrays (every device's part: each device's own small state) are stacked on a new one."""
    sharding = NamedSharding(mesh, P(EXPERT_AXIS))
    n_dev = mesh.shape[EXPERT_AXIS]
    first = next(iter(parts.values()))
    if isinstance(first, QTensor):
        data = {k: _assemble({d: jax.device_put(p.data[k], d) for d, p in parts.items()
                              if d in sharding.addressable_devices},
                             n_dev * first.data[k].shape[0], sharding) for k in first.data}
        return QTensor(data, first.qtype, (n_dev * first.shape[0],) + tuple(first.shape[1:]), first.layout,
                       first.backend)
    host = np.stack([np.asarray(parts[d]) for d in mesh.devices.flat])
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_expert_stack(raw: np.ndarray, fmt: ExpertFormat, which: str, mesh: Mesh) -> QTensor:
    """GGUF bytes [E, rows, row bytes] of an expert matrix -> its QTensor stack (`ExpertFormat.pack`)
    sharded by expert over `mesh`: each addressable device lays out and holds only its experts."""
    sharding = NamedSharding(mesh, P(EXPERT_AXIS))
    parts = {}
    for device, index in sharding.addressable_devices_indices_map(raw.shape).items():
        rows = range(raw.shape[0])[index[0]]  # this device's experts (slice(None) on a 1-device mesh)
        with jax.default_device(device):
            parts[device] = fmt.pack(np.ascontiguousarray(raw[rows.start:rows.stop]), which)
    return assemble_on_mesh(parts, mesh)


class ShardedGGUFExperts(GGUFExperts):
    """The routed experts of an open GGUF sharded by expert id over `mesh` (`model.weights.ExpertLoader`)."""

    def __init__(self, f: GGUFFile, config: ModelConfig, mesh: Mesh, run: RunConfig = RunConfig(),
                 residency: Any = None):
        """residency: a `residency.Residency` planned per device on `mesh` (a per-device expert budget):
        the layers it manages get each device's slots of its own experts; the others whole shards."""
        super().__init__(f, config, run, residency=residency)
        self.mesh = mesh

    def _whole(self, layer: int) -> nnx.Module:
        c = self.config
        return ShardedExperts(c.n_expert, c.d_model, c.expert_ff, expert_qtypes(self.gguf, layer), self.mesh, self.run)

    def _stack(self, layer: int, which: str) -> QTensor:
        return shard_expert_stack(expert_raw(self.gguf, layer, which), self.format(layer), which, self.mesh)


def _replicated(x: Any, sharding: NamedSharding) -> Any:
    if not isinstance(x, (jax.Array, np.ndarray)):
        return x
    if isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding) and x.sharding.mesh == sharding.mesh:
        return x  # already on the mesh (the sharded experts, or params shared with the trunk)
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def replicate_dense(module: nnx.Module, mesh: Mesh) -> nnx.Module:
    """`module` with every param not yet on `mesh` replicated over it (the sharded experts stay)."""
    graphdef, state = nnx.split(module)
    sharding = NamedSharding(mesh, P())
    return nnx.merge(graphdef, jax.tree.map(lambda x: _replicated(x, sharding), state))


def device_bytes(module: nnx.Module, where: Callable[[tuple], bool] = lambda path: True) -> dict[Any, int]:
    """Bytes each device holds of the params of `module` whose nnx path satisfies `where` (shards of
    this process's devices; a replicated array counts in full on every device)."""
    out: dict[Any, int] = defaultdict(int)
    for path, var in nnx.to_flat_state(nnx.state(module)):
        value = var.get_value() if hasattr(var, "get_value") else var
        if not where(tuple(path)):
            continue
        for leaf in jax.tree.leaves(value):
            if isinstance(leaf, jax.Array):
                for shard in leaf.addressable_shards:
                    out[shard.device] += shard.data.nbytes
            else:
                out[None] += int(math.prod(np.shape(leaf))) * np.dtype(leaf.dtype).itemsize
    return dict(out)


def is_routed_expert(path: tuple) -> bool:
    """Whether an nnx param path is a routed-expert matrix (…/ffn/experts/…)."""
    return any(a == "ffn" and b == "experts" for a, b in zip(path, path[1:]))
