"""What it takes to run a GGUF here: device bytes all-resident, with an expert budget, and with expert
parallelism, computed from the tensor table and the loader's layouts (nothing is read or allocated).

`plan(f, ...)` counts what `sj.load(path, ...)` holds after loading (before any generation): every
trunk param but the routed experts, built from the loader's own recipes (`sharpi_jax.model.weights`:
fused projections, each in the layout the loader picks for its size with RunConfig's defaults, on
XLA:CPU int8 rows from 4M weights), the routed experts of the trunk's MoE
layers in their GGUF bytes, and with an expert budget the resident slot stacks and the staging
buffer as `plan_residency` places them (`sharpi_jax.experts.residency.plan`). The MTP block is loaded
when speculative="mtp" is first used: its own tensors' file bytes are reported apart (`mtp_bytes`, an
estimate: not checked against a load), as is one sequence's decode state at `max_context`.
"""

from __future__ import annotations

from typing import Any

from sharpi_jax.config import ModelConfig, RunConfig
from sharpi_jax.errors import InputError
from sharpi_jax.experts.residency.plan import minimum_budget, plan_residency
from sharpi_jax.gguf.reader import GGUFFile, TensorInfo
from sharpi_jax.gguf.writer import as_qtype, model_tensor_plan
from sharpi_jax.model import weights
from sharpi_jax.quant import MatrixFormat, resolve_kernels
from sharpi_jax.quant.qtensor import abstract, gguf_nbytes
from sharpi_jax.runtime.state import state_bytes


class TensorTable:
    """The tensor table a converter would write for a config (`model_tensor_plan`), without a file:
    what `plan` needs of a GGUFFile, so a shape preset can be planned at any size."""

    def __init__(self, config: ModelConfig, qtype: str | int, expert_qtype: str | int | None = None):
        q = as_qtype(qtype)
        eq = None if expert_qtype is None else as_qtype(expert_qtype)
        self.source = f"<{config.arch} shapes, {q.name}>"
        self.tensors = {}
        for spec, t in model_tensor_plan(config, q, eq):
            shape = tuple(int(d) for d in spec.shape)
            self.tensors[spec.name] = TensorInfo(spec.name, t, shape, 0, gguf_nbytes(int(t), shape))

    def tensor(self, name: str) -> TensorInfo:
        return self.tensors[name]


def _block(name: str) -> int | None:
    return int(name.split(".")[1]) if name.startswith("blk.") else None


_ATTENTION_PARAMS = ("w_qkv", "w_o", "q_norm", "k_norm")
_GDN_PARAMS = ("w_in", "conv_w", "dt_bias", "a", "norm", "w_out")


def _recipe_bytes(f, c: ModelConfig, fmt: MatrixFormat, recipe: weights.Recipe) -> int:
    """Device bytes of one param as the loader builds it from its recipe (`weights._load`): a fused
    projection holds each run of consecutive same-type matrices as ONE QTensor, whose layout depends
    on the run's total size (repack="auto": int8 from 4M weights), vectors and conv weights float32."""
    kind, names = recipe
    if kind in (weights.ROWS, weights.ROWS_BA):
        infos = [f.tensor(n) for n in names]
        rows = [(int(t.qtype), t.shape[0], t.shape[-1]) for t in infos]
        if kind == weights.ROWS_BA:  # qwen3next's ssm_ba: beta and alpha row blocks, each [Hv, D]
            q, r, cols = rows.pop()
            rows += [(q, r // 2, cols), (q, r // 2, cols)]
        total, run = 0, None
        for q, r, cols in rows + [(None, 0, 0)]:
            if run is not None and run[0] == q:
                run[1] += r
                continue
            if run is not None:
                shape = (run[1], run[2])
                total += abstract(run[0], shape, fmt.layout(run[0], shape)).nbytes
            run = [q, r, cols]
        return total
    t = f.tensor(names[0])
    if kind == weights.EMBEDDING:  # the GGUF bytes (float types as float arrays: the same bytes)
        return t.nbytes
    return 4 * t.n_elements  # VECTOR, CONV


def tensor_bytes(f, c: ModelConfig, fmt: MatrixFormat) -> dict[str, int]:
    """Device bytes as loaded, by part: "dense" (the trunk's params, routed experts excluded),
    "experts" (the trunk's routed experts, their GGUF bytes), "mtp" (the MTP block's own tensors and
    experts, loaded on first MTP use)."""
    has = f.tensors.__contains__
    recipes = list(weights.trunk_recipes(c, has).values())
    for i in range(c.n_layer):
        mixer = _GDN_PARAMS if c.recurrent_layers[i] else _ATTENTION_PARAMS  # the block's own mixer
        recipes += [r for k, r in weights.block_recipes(c, i, has).items()
                    if (k[0] != "mixer" or k[1] in mixer) and all(has(n) for n in r[1])]
    out = {"dense": sum(_recipe_bytes(f, c, fmt, r) for r in recipes), "experts": 0, "mtp": 0}
    for name, t in f.tensors.items():
        b = _block(name)
        if "_exps." in name:
            out["experts" if b < c.n_layer else "mtp"] += t.nbytes
        elif b is not None and b >= c.n_layer:
            out["mtp"] += t.nbytes if len(t.shape) == 2 else 4 * t.n_elements
    return out


def plan(f: GGUFFile, c: ModelConfig, *, device_memory: int | None = None, devices: int = 1,
         max_context: int = 4096, run: RunConfig | None = None, policy: str = "static") -> dict[str, Any]:
    """The memory plan (all figures in bytes; see the module doc):

    resident_bytes: what sj.load holds all-resident (dense + experts); expert_bytes / dense_bytes its parts;
    with device_memory: expert_budget (the largest budget that fits beside the dense weights and one
      sequence's decode state at max_context, or None if all experts fit), budget_device_bytes (what sj.load(expert_budget=...) then holds: dense + resident
      slots + staging), host_stream_bytes (routed-expert bytes left in the mmap, streamed on use);
    with devices > 1: expert_parallel_device_bytes (one device under expert_parallel=devices: the dense
      weights replicated + 1/devices of the experts).
    """
    run = run or RunConfig()
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise InputError(f"devices must be a positive integer, got {devices!r}")
    fmt = MatrixFormat(resolve_kernels(run.kernels), run.repack)
    parts = tensor_bytes(f, c, fmt)
    out: dict[str, Any] = {
        "dense_bytes": parts["dense"], "expert_bytes": parts["experts"], "mtp_bytes": parts["mtp"],
        "resident_bytes": parts["dense"] + parts["experts"], "state_bytes": state_bytes(c, max_context),
        "max_context": max_context, "devices": devices, "device_memory": device_memory,
    }
    if devices > 1:
        if not c.is_moe or c.n_expert % devices:
            raise InputError(f"expert parallelism over {devices} devices needs an MoE model whose expert count "
                             f"({c.n_expert}) is a multiple of {devices}")
        out["expert_parallel_device_bytes"] = parts["dense"] + parts["experts"] // devices
    if device_memory is not None:
        if isinstance(device_memory, bool) or not isinstance(device_memory, int) or device_memory <= 0:
            raise InputError(f"device_memory must be a positive number of bytes, got {device_memory!r}")
        room = device_memory - parts["dense"] - out["state_bytes"]
        if c.is_moe and room < parts["experts"]:
            least = minimum_budget(f, c)
            if room < least:
                raise InputError(f"device_memory = {device_memory} bytes does not hold the dense weights "
                                 f"({parts['dense']} bytes), the decode state ({out['state_bytes']} bytes) and "
                                 f"the least expert budget ({least} bytes)")
            p = plan_residency(f, c, room, policy)
            out.update(expert_budget=room, budget_device_bytes=parts["dense"] + p.device_bytes,
                       host_stream_bytes=parts["experts"] - p.slot_bytes)
        else:
            if room < parts["experts"]:
                raise InputError(f"device_memory = {device_memory} bytes does not hold the weights and decode "
                                 f"state ({out['resident_bytes'] + out['state_bytes']} bytes; a dense model has "
                                 f"no experts to stream)")
            out.update(expert_budget=None, budget_device_bytes=out["resident_bytes"], host_stream_bytes=0)
    return out


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: str | int, what: str = "device_memory") -> int:
    """"80GiB", "512 MiB", "1.5GB" or a plain number of bytes -> int bytes (InputError otherwise)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    text = str(value).strip().lower().replace(" ", "")
    num = text.rstrip("kmgtib")
    unit = text[len(num):]
    try:
        n = int(float(num) * _UNITS[unit])
        if n > 0:
            return n
    except (KeyError, ValueError, OverflowError):
        pass
    raise InputError(f"{what} must be a positive size like '80GiB', '512MiB' or bytes, got {value!r}")
