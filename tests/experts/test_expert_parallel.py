"""Expert parallelism (`sj.load(path, expert_parallel=N)`, `sharpi_jax.experts.parallel`) on 4 forced
host devices against one device.

Forced devices need XLA_FLAGS=--xla_force_host_platform_device_count=4 before jax starts, so the
checks run in subprocesses (`tests/experts/expert_parallel_checks.py`, and the 2-process job),
started once collection ends (`start_background`, `tests.background`) beside the rest of the suite
(~145 s of CPU in all, measured on a loaded machine: ~75 s on 2 idle cores). Claims, on every fixture
MoE file (tiny-qwen35moe F32/BF16/Q8_0/Q4_K_M, tiny-qwen3next F32/Q8_0):

- logits BITWISE equal to one device's (`tests.bitwise`): every row runs the same row-stable kernels
  and the psum of bit patterns adds only integer zeros to each owner's result, so nothing is rounded
  differently; a tolerance would hide a real reordering;
- each device holds exactly 1/4 of the routed-expert bytes (E/4 experts of every matrix, in their
  storage encoding) and the dense params in full;
- greedy tokens (32, EOS ignored) equal one device's and MTP (batched verify, 3 drafts; chain and
  tree of 8 nodes) tokens equal them, the chain over a SnapKV-evicted cache equals one device's
  SnapKV run, teacher-forced MTP logits bitwise: on tiny-qwen35moe-Q4_K_M here, on every file in the slow
  tier (each file compiles its own generation graphs, ~25 s of CPU each; the sharded dispatch does not
  depend on the arch);
- a 2-process `jax.distributed` run of `experiments.generate --expert_parallel=2` (one CPU device per
  process) prints the one-device greedy tokens.
- the compiled HLO: one all-reduce of int32 [rows, k, D] per MoE layer, no other collective.
- kernels="pallas" (interpret mode) over the 4 devices: logits bitwise one device's, MTP tokens equal, and
  the sharded decode step lowers for CUDA with Triton kernels and one all-reduce per MoE layer.
Plus the dispatch itself for both XLA modes and row kernels, and the InputErrors (in-process, 1 device).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

import sharpi_jax as sj
from sharpi_jax.errors import InputError
from sharpi_jax.experts import parallel
from sharpi_jax.gguf import GGUFFile, read_model_config
from tests import background
from tests.conftest import REPO_ROOT, fixture_path

DEVICES = 4
MOE_FILES = [("tiny-qwen35moe", v) for v in ("F32", "BF16", "Q8_0", "Q4_K_M")] + \
            [("tiny-qwen3next", v) for v in ("F32", "Q8_0")]
GENERATE_FAST = [("tiny-qwen35moe", "Q4_K_M")]
GENERATE_SLOW = [f for f in MOE_FILES if f not in GENERATE_FAST]
PROMPT = "def add(a, b):\n    return"


def _path(name_variant) -> str:
    name, variant = name_variant
    return str(fixture_path(name, f"{name}-{variant}.gguf"))


def _run_checks(args: list[str]) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "tests.experts.expert_parallel_checks", f"--devices={DEVICES}", f"--prompt={PROMPT}"]
    res = subprocess.run(cmd + args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


def _jobs(generate: list, budget: list[str] = ()) -> list[list[str]]:
    """Two subprocess argument lists of about equal cost (a file with generation checks costs ~4 logits-only
    files; the dispatch check ~1; a budget config ~2)."""
    options, files, costs = [["--dispatch", f"--hlo={_path(HLO_FILE)}"], [f"--pallas={_path(PALLAS_FILE)}"]], \
        [[], []], [2, 3]
    if budget:
        i = costs.index(min(costs))
        options[i] += [f"--budget={_path(BUDGET_FILE)}", f"--budget_configs={','.join(budget)}"]
        costs[i] += 2 * len(budget)
    for f in sorted(MOE_FILES, key=lambda f: f not in generate):
        i = costs.index(min(costs))
        options[i] += [f"--generate={_path(f)}"] if f in generate else []
        files[i].append(_path(f))
        costs[i] += 4 if f in generate else 1
    return [o + f for o, f in zip(options, files)]


MULTIHOST = ("tiny-qwen35moe", "Q4_K_M")
HLO_FILE = ("tiny-qwen35moe", "Q4_K_M")  # a GENERATE_FAST file: its one-device greedy tokens are the reference
PALLAS_FILE = ("tiny-qwen35moe", "Q8_0")  # every matrix has a Pallas kernel (Q4_K_M's MTP block has Q5_0)
BUDGET_FILE = ("tiny-qwen35moe", "Q8_0")
# expert_parallel=2 with a per-device budget: "policy/lookahead[/kernels]". Fast: the ring with prefetch
# and host compute, and the Pallas kernels; slow: every policy with every lookahead, the buffer's too.
BUDGET_FAST = ["frequency/both", "lru/none/pallas"]
BUDGET_SLOW = [f"{p}/{look}" for p in ("static", "frequency", "lru", "slru")
               for look in ("none", "next_layer", "pass", "both")] + ["slru/both/pallas", "static/next_layer/pallas"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run_two_processes() -> list[subprocess.CompletedProcess]:
    """`experiments.generate --expert_parallel=2` as a 2-process jax.distributed job on this host (one
    CPU device each, gloo collectives): the documented multi-host launch."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "experiments.generate", f"--gguf={_path(MULTIHOST)}", f"--prompt={PROMPT}",
         "--max_new_tokens=8", "--max_context=64", "--expert_parallel=2", "--json",
         f"--coordinator_address=localhost:{port}", "--num_processes=2", f"--process_id={i}"],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=900)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def _collect(lines: list[dict], two: list | None) -> dict:
    by_file = {ln["file"]: ln for ln in lines if "file" in ln}
    by_file["dispatch"] = next(ln["dispatch"] for ln in lines if "dispatch" in ln)
    by_file["hlo"] = next(ln["hlo"] for ln in lines if "hlo" in ln)
    by_file["pallas"] = next(ln["pallas"] for ln in lines if "pallas" in ln)
    by_file["budget"] = next((ln["budget"] for ln in lines if "budget" in ln), {})
    by_file["multihost"] = two
    return by_file


def _results(generate: list, budget: list[str] = ()) -> dict:
    with ThreadPoolExecutor(2) as pool:
        return _collect([ln for out in pool.map(_run_checks, _jobs(generate, budget)) for ln in out], None)


def _start() -> None:
    """Start the runs of the `results` fixture (`tests.background`: the two check processes, then the
    2-process job), once."""
    if background.started(("expert_parallel", "two_processes")):
        return
    for i, args in enumerate(_jobs(GENERATE_FAST, BUDGET_FAST)):
        background.submit(("expert_parallel", "checks", i), _run_checks, args)
    background.submit(("expert_parallel", "two_processes"), _run_two_processes)


def start_background(session, items) -> None:
    """`_start` when a selected test uses the `results` fixture; called by conftest.py once collection
    ends. A missing fixture file leaves the runs to the fixture, which fails or skips its tests."""
    if any("results" in item.fixturenames for item in items):
        try:
            _start()
        except (pytest.skip.Exception, pytest.fail.Exception):
            pass


@pytest.fixture(scope="module")
def results():
    _start()
    lines = [ln for i in range(2) for ln in background.result(("expert_parallel", "checks", i))]
    return _collect(lines, background.result(("expert_parallel", "two_processes")))


def _name(f) -> str:
    return f"{f[0]}-{f[1]}.gguf"


def test_sharded_dispatch_is_bitwise_the_single_device_dispatch(results):
    assert results["dispatch"] == {f"{m}/{k}": True for m in ("grouped", "per_token") for k in ("gemm", "gemv")}


@pytest.mark.parametrize("f", MOE_FILES, ids=_name)
def test_logits_bitwise_equal_one_device(results, f):
    r = results[_name(f)]
    assert r["devices"] == [f"cpu:{i}" for i in range(DEVICES)]
    assert r["logits_bitwise"]


@pytest.mark.parametrize("f", MOE_FILES, ids=_name)
def test_each_device_holds_only_its_experts(results, f):
    r = results[_name(f)]
    assert r["expert_bytes"] == [r["expert_bytes_one"] // DEVICES] * DEVICES
    assert r["expert_bytes_one"] % DEVICES == 0
    assert r["expert_leads"] == [[r["n_expert"], r["n_expert"] // DEVICES]]
    assert r["dense_bytes"] == [r["dense_bytes_one"]] * DEVICES


def _check_generation(r: dict) -> None:
    """>= 32 greedy tokens (EOS ignored); MTP with 3 drafts (some accepted, so verify rows and rollback
    run sharded), chain and tree (8 nodes), gives the same tokens; the chain and the tree over a
    SnapKV-evicted cache give one device's SnapKV tokens."""
    assert len(r["greedy_one"]) >= 32
    assert r["greedy_parallel"] == r["greedy_one"]
    assert r["mtp_parallel"] == r["greedy_one"]
    assert r["mtp_draft_tokens"] == 3 and r["mtp_accepted"] > 0
    assert r["mtp_logits_bitwise"]
    assert r["tree_parallel"] == r["greedy_one"] and r["tree_accepted"] > 0
    assert r["snapkv_parallel"] == r["snapkv_one"] and len(r["snapkv_one"]) >= 16 and r["snapkv_evicted"] > 0
    assert r["snapkv_tree_parallel"] == r["snapkv_one"]


def test_compiled_collectives_are_one_psum_of_4kd_bytes_per_token_per_moe_layer(results):
    """The compiled HLO (XLA:CPU, 4 devices) of the expert-parallel MoE layer holds exactly one collective,
    an all-reduce of int32 [rows, k, D] (4*k*D bytes per row); a whole trunk pass holds one such
    all-reduce per MoE layer and no other collective (dense weights are replicated)."""
    h = results["hlo"]
    rows, k, d = h["rows"], h["k"], h["d_model"]
    one = ("all-reduce", f"s32[{rows},{k},{d}]")
    strip = lambda ops: [(op, t.split("{")[0]) for op, t in ops]  # noqa: E731 (drop the layout suffix)
    assert strip(h["layer"]) == [one]
    assert strip(h["trunk"]) == [one] * h["moe_layers"] and h["moe_layers"] > 0
    print(f"per MoE layer: one all-reduce of {4 * k * d} bytes per row ({rows} rows), {h['moe_layers']} MoE layers")


@pytest.mark.parametrize("f", GENERATE_FAST, ids=_name)
def test_greedy_and_mtp_tokens_equal_one_device(results, f):
    _check_generation(results[_name(f)])


@pytest.mark.slow
def test_greedy_and_mtp_tokens_equal_one_device_on_every_file():
    results = _results(GENERATE_SLOW)
    for f in GENERATE_SLOW:
        _check_generation(results[_name(f)])


def test_two_local_processes_with_jax_distributed(results):
    """The multi-host launch (`jax.distributed.initialize`, same command on every process) with 2
    processes of one CPU device each: process 0 prints the one-device greedy tokens, process 1 nothing."""
    zero, one = results["multihost"]
    assert zero.returncode == 0 and one.returncode == 0, (zero.stderr[-3000:], one.stderr[-3000:])
    json_lines = lambda res: [ln for ln in res.stdout.splitlines() if ln.startswith("{")]  # noqa: E731 (gloo logs too)
    (line,) = json_lines(zero)
    out = json.loads(line)
    assert out["process_id"] == 0 and out["expert_parallel"] == 2 and len(set(out["devices"])) == 2
    assert out["tokens"] == results[_name(MULTIHOST)]["greedy_one"][:8]  # --max_new_tokens=8
    assert json_lines(one) == []


# ----------------------------------------------------------------------------- bad input (1 device)


def _config(name: str, variant: str):
    return read_model_config(GGUFFile(fixture_path(name, f"{name}-{variant}.gguf")))


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "4"])
def test_expert_parallel_must_be_a_positive_integer(bad):
    with pytest.raises(InputError, match="expert_parallel must be a positive integer"):
        parallel.check_expert_parallel(bad, _config("tiny-qwen35moe", "Q8_0"))


def test_expert_parallel_errors_name_the_problem():
    moe = _config("tiny-qwen35moe", "Q8_0")
    with pytest.raises(InputError, match="no routed experts"):
        parallel.check_expert_parallel(2, _config("tiny-qwen35", "Q8_0"))
    with pytest.raises(InputError, match="does not divide the 16 experts"):
        parallel.check_expert_parallel(3, moe)
    with pytest.raises(InputError, match="xla_force_host_platform_device_count"):
        parallel.check_expert_parallel(16, moe)


def test_expert_parallel_with_a_budget_on_one_device_is_the_budget_run():
    """expert_parallel=1 with a budget (in-process: one device) streams as the budget alone does: same
    tokens as every expert resident, same hit rate and bytes streamed as without expert_parallel."""
    path = fixture_path("tiny-qwen35moe", "tiny-qwen35moe-Q8_0.gguf")
    load = dict(max_context=32, expert_budget="30%", expert_policy="lru")
    par, alone, full = sj.load(path, **load, expert_parallel=1), sj.load(path, **load), sj.load(path, max_context=32)
    gen = dict(max_new_tokens=8, stop_on_eos=False)
    a, b = par.generate(PROMPT, **gen), alone.generate(PROMPT, **gen)
    assert a.tokens == b.tokens == full.generate(PROMPT, **gen).tokens
    assert a.stats.experts["hit_rate"] == b.stats.experts["hit_rate"] < 1.0
    assert a.stats.experts["bytes_streamed"] == b.stats.experts["bytes_streamed"] > 0


def test_pallas_logits_bitwise_equal_one_device(results):
    """kernels="pallas" (interpret mode here) over 4 devices: each device runs the grouped Pallas kernel on
    its own experts; logits bitwise one device's, the MTP chain's tokens equal."""
    r = results["pallas"]
    assert r["expert_backends"] == ["pallas"]
    assert r["logits_bitwise"]
    assert r["mtp_parallel"] == r["mtp_one"] and len(r["mtp_one"]) == 6


def test_pallas_sharded_decode_step_lowers_for_cuda(results):
    """The sharded decode step and MTP verify pass (k + 1 rows) lowered for CUDA: Triton kernels, and one
    all-reduce per MoE layer."""
    r = results["pallas"]
    assert r["cuda_triton_calls"] >= 2 * r["moe_layers"]  # at least the grouped matmul and the reduce
    assert r["cuda_all_reduces"] == r["moe_layers"]
    assert r["cuda_verify_triton_calls"] >= 2 * r["moe_layers"]
    assert r["cuda_verify_all_reduces"] == r["moe_layers"]


def _check_budget(r: dict) -> None:
    """Logits bitwise, greedy and MTP tokens those of one device with every expert resident, while some
    pairs missed (hit rate < 1) and both devices filled host buffers with their own cold experts; each
    device holds the routed-expert bytes its plan says, within its budget."""
    assert r["logits_bitwise"] and r["greedy_equal"] and r["mtp_equal"] and r["mtp_accepted"] > 0
    assert r["hit_rate"] < 1.0 and r["buffer_devices"] == [0, 1]
    assert r["expert_bytes"] == [r["plan_bytes"]] * 2 and r["plan_bytes"] <= r["budget"]


@pytest.mark.parametrize("config", BUDGET_FAST)
def test_per_device_budget_gives_one_devices_tokens(results, config):
    _check_budget(results["budget"][config])
    assert results["budget"][config]["backends"] == (["pallas"] if config.endswith("/pallas") else ["ggml"])


@pytest.mark.slow
def test_per_device_budget_every_policy_and_lookahead():
    """Every cell of BUDGET_SLOW, 4 per subprocess (each cell loads and compiles its own engine, ~1 min)."""
    chunks = [BUDGET_SLOW[i:i + 4] for i in range(0, len(BUDGET_SLOW), 4)]
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda c: _run_checks([f"--budget={_path(BUDGET_FILE)}",
                                                     f"--budget_configs={','.join(c)}"]), chunks))
    lines = {k: v for out in outs for ln in out if "budget" in ln for k, v in ln["budget"].items()}
    assert sorted(lines) == sorted(BUDGET_SLOW)
    for config in BUDGET_SLOW:
        _check_budget(lines[config])
