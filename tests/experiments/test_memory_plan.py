"""`info --plan`: the figures it prints equal the bytes `sj.load` actually holds with those options
(within 1%): all-resident, with the expert budget it says fits in --device_memory, and per device with
expert parallelism over --devices. Fast tier: a 4-layer slice of the tiny shapes; `slow`: 4-layer
slices of the real Qwen3.5-122B-A10B and 397B-A17B shapes (6.9 and 18 GB files)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from experiments.memory_plan import TensorTable, plan
from sharpi_jax.config import shape_preset
from sharpi_jax.gguf import GGUFFile, read_model_config
from sharpi_jax.testing import write_synthetic_gguf
from tests.experiments.entry_point import REPO_ROOT, ok, run_entry_point

DEVICES = 4


def _measured(path, budget: int, devices: int) -> dict:
    cmd = [sys.executable, str(REPO_ROOT / "tests" / "experiments" / "plan_checks.py"), str(path), str(budget),
           str(devices)]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))  # the script's own folder is sys.path[0], not the repo
    res = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=3000)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def check_plan_against_load(path, tmp_path, devices: int = DEVICES):
    with GGUFFile(path) as f:
        c = read_model_config(f)
        base = plan(f, c)
    # A device that holds the dense weights, the decode state and a third of the experts.
    memory = base["dense_bytes"] + base["state_bytes"] + base["expert_bytes"] // 3
    res = ok(run_entry_point("info", f"--gguf={path}", "--plan", "--json", f"--device_memory={memory}",
                             f"--devices={devices}", cache=tmp_path))
    printed = json.loads(res.stdout.strip().splitlines()[-1])
    assert printed["expert_budget"] is not None and 0 < printed["host_stream_bytes"] < printed["expert_bytes"]
    assert printed["budget_device_bytes"] <= memory
    held = _measured(path, printed["expert_budget"], devices)
    for key in ("resident_bytes", "budget_device_bytes", "host_stream_bytes"):
        assert abs(printed[key] - held[key]) <= 0.01 * held[key], (key, printed[key], held[key])
    for dev in held["expert_parallel_device_bytes"]:  # every device holds the same share
        want = printed["expert_parallel_device_bytes"]
        assert abs(want - dev) <= 0.01 * dev, (want, dev)
    return printed, held


def test_plan_equals_what_load_holds(tmp_path):
    path = write_synthetic_gguf(tmp_path / "tiny.gguf", shape_preset("tiny", 4), qtype="Q4_K")
    printed, held = check_plan_against_load(path, tmp_path)
    assert printed["resident_bytes"] == held["resident_bytes"]  # exact here: the same layouts, counted


def test_fused_projections_are_counted_as_loaded(tmp_path, monkeypatch):
    """kernels="xla" with repack="auto" picks int8 by a matrix's size, and the loader fuses same-type
    projections (shared gate+up, attention q/k/v, GDN qkv+gate+beta+alpha) before choosing: with the
    threshold between a tiny matrix and a fused pair, the plan must count the fused layouts (as on the
    real shapes)."""
    import importlib

    import sharpi_jax as sj
    from sharpi_jax.config import RunConfig
    from sharpi_jax.model.footprint import held_bytes

    xla = importlib.import_module("sharpi_jax.quant.backends.xla")
    run = RunConfig(kernels="xla")
    path = write_synthetic_gguf(tmp_path / "tiny.gguf", shape_preset("tiny", 4), qtype="Q4_K")
    with GGUFFile(path) as f:
        c = read_model_config(f)
        unfused_threshold = plan(f, c, run=run)["resident_bytes"]
        monkeypatch.setattr(xla, "INT8_AUTO_MIN_WEIGHTS", 12000)  # one [64, 128] matrix below, a pair above
        want = plan(f, c, run=run)["resident_bytes"]
    assert want != unfused_threshold  # the threshold now changes layouts
    assert want == sum(held_bytes(sj.load(path, max_context=64, kernels="xla").model).values())


def test_preset_plan_equals_the_written_file(tmp_path):
    """A shape preset is planned from the tensor table a converter would write: the same figures as the file."""
    config = shape_preset("tiny", 4)
    path = write_synthetic_gguf(tmp_path / "tiny.gguf", config, qtype="Q4_K")
    with GGUFFile(path) as f:
        want = plan(f, read_model_config(f), device_memory=4 * 2**20, devices=2)
    assert plan(TensorTable(config, "Q4_K"), config, device_memory=4 * 2**20, devices=2) == want


@pytest.mark.parametrize("preset", ["qwen35-122b-a10b", "qwen35-397b-a17b"])
def test_new_presets_match_the_published_shapes(preset):
    """Weights in all (trunk, MTP block excluded) against the name's B; a few % of them used per token."""
    c = shape_preset(preset)
    t = TensorTable(c, "F32")
    mtp = f"blk.{c.n_layer}."
    total = sum(i.n_elements for n, i in t.tensors.items() if not n.startswith(mtp))
    experts = sum(i.n_elements for n, i in t.tensors.items() if "_exps." in n)
    want_total = {"qwen35-122b-a10b": 122e9, "qwen35-397b-a17b": 397e9}[preset]
    assert abs(total - want_total) <= 0.02 * want_total
    assert c.n_layer == {"qwen35-122b-a10b": 48, "qwen35-397b-a17b": 60}[preset]
    assert experts / c.n_expert * c.n_expert_used < 0.05 * total  # sparse: a few % of weights per token


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["qwen35-122b-a10b", "qwen35-397b-a17b"])
def test_plan_equals_what_load_holds_real_shapes(tmp_path, preset):
    """4-layer slices of the real shapes, Q4_K matrices and Q2_K routed experts (the accounting does not
    depend on the block type; Q2_K keeps the 397B slice's trunk experts at 7.9 GiB). Loads each engine
    in turn, expert parallelism over 2 forced host devices (the dense weights held twice): the 397B
    slice needs about 16 GiB of free memory, more than a shared 23 GiB machine had (WORKSPACE.md)."""
    path = write_synthetic_gguf(tmp_path / f"{preset}.gguf", shape_preset(preset, 4), qtype="Q4_K",
                                expert_qtype="Q2_K")
    printed, held = check_plan_against_load(path, tmp_path, devices=2)
    print(preset, json.dumps({"printed": printed, "held": held}))
