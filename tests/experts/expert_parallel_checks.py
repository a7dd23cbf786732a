"""Run by tests/experts/test_expert_parallel.py in a subprocess that forces N host devices
(XLA_FLAGS must be set before jax starts): for each GGUF, one engine on one device and one with
`expert_parallel=N`, and the checks of the issue, printed as one JSON line per file.

    python -m tests.experts.expert_parallel_checks --devices=4 [--generate=FILE ...] FILE [FILE ...]

Every file: logits bitwise and the bytes each device holds; the files in --generate also: greedy and
MTP (batched verify, MTP_DRAFTS drafts; chain and tree, and the chain and the tree over a SnapKV-evicted
cache next to one device's chain) tokens over --new_tokens tokens (EOS ignored) and teacher-forced MTP logits (each file
compiles its own graphs: these checks cost ~4x the logits check). --hlo=FILE: the collectives of the
compiled expert-parallel MoE layer and trunk pass. --budget=FILE: expert parallelism over 2 devices
with a per-device expert budget (`check_budget`, the --budget_configs given, "policy/lookahead[/kernels]").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time


MTP_DRAFTS = 3
TREE_NODES = 8
KV_BUDGET = 12  # SnapKV positions kept (the long prompt has more)


def _force_devices(n: int) -> None:
    flag = f"--xla_force_host_platform_device_count={n}"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


def check_file(path: str, n: int, prompt: str, new_tokens: int, generate: bool) -> dict:
    import jax

    import sharpi_jax as sj
    from sharpi_jax.experts import parallel
    from tests.bitwise import bitwise_equal

    t0 = time.perf_counter()
    one = sj.load(path, max_context=64)
    par = sj.load(path, max_context=64, expert_parallel=n)
    ids = one.tokenizer.encode(prompt)
    out: dict = {"file": os.path.basename(path), "devices": [str(d) for d in par.mesh.devices.flat]}
    out["logits_bitwise"] = bool(bitwise_equal(par.logits(ids), one.logits(ids)))
    if generate:
        gen = dict(max_new_tokens=new_tokens, stop_on_eos=False)
        out["greedy_one"] = one.generate(ids, **gen).tokens
        out["greedy_parallel"] = par.generate(ids, **gen).tokens
        mtp = par.generate(ids, **gen, speculative="mtp", draft_tokens=MTP_DRAFTS)
        out["mtp_parallel"] = mtp.tokens
        out["mtp_draft_tokens"] = mtp.stats.speculation.draft_tokens
        out["mtp_accepted"] = mtp.stats.speculation.accepted
        out["mtp_logits_bitwise"] = bool(bitwise_equal(par.mtp_logits(ids), one.mtp_logits(ids)))
        tree = par.generate(ids, **gen, speculative="mtp_tree", draft_tokens=MTP_DRAFTS, tree_nodes=TREE_NODES)
        out["tree_parallel"], out["tree_accepted"] = tree.tokens, tree.stats.speculation.accepted
        # SnapKV: a prompt longer than the budget, evicted at prefill; the chain decodes the compacted cache.
        long_ids = one.tokenizer.encode(prompt * 3)
        kv = dict(kv_policy="snapkv", kv_budget=KV_BUDGET, kv_window=4, speculative="mtp", draft_tokens=MTP_DRAFTS)
        snap_one = one.generate(long_ids, **gen, **kv)
        snap_par = par.generate(long_ids, **gen, **kv)
        out["snapkv_one"], out["snapkv_parallel"] = snap_one.tokens, snap_par.tokens
        out["snapkv_evicted"] = snap_par.stats.kv.evicted
        snap_tree = par.generate(long_ids, **gen, **{**kv, "speculative": "mtp_tree", "tree_nodes": TREE_NODES})
        out["snapkv_tree_parallel"] = snap_tree.tokens
    # What each device holds: the routed experts split by expert id, every other param in full.
    out["expert_bytes_one"] = sum(parallel.device_bytes(one.model, parallel.is_routed_expert).values())
    out["expert_bytes"] = [parallel.device_bytes(par.model, parallel.is_routed_expert).get(d, 0)
                           for d in par.mesh.devices.flat]
    dense = lambda p: not parallel.is_routed_expert(p)  # noqa: E731
    out["dense_bytes_one"] = sum(parallel.device_bytes(one.model, dense).values())
    out["dense_bytes"] = [parallel.device_bytes(par.model, dense).get(d, 0) for d in par.mesh.devices.flat]
    leads = set()
    for path, var in parallel.nnx.to_flat_state(parallel.nnx.state(par.model)):
        if parallel.is_routed_expert(tuple(path)):
            for leaf in jax.tree.leaves(var.get_value()):
                leads |= {(leaf.shape[0], s.data.shape[0]) for s in leaf.addressable_shards}
    out["expert_leads"] = sorted(leads)  # (experts, experts per shard) of every routed-expert array
    out["n_expert"] = one.config.n_expert
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def check_dispatch(n: int) -> dict:
    """`sharded_expert_rows` vs `dispatch.expert_rows` on one device, bitwise, for every XLA mode and
    row kernel, on synthetic Q4_K experts and a routing that leaves one device idle."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sharpi_jax.experts import parallel
    from sharpi_jax.experts.dispatch import expert_rows
    from gguf import GGMLQuantizationType

    from sharpi_jax.testing.experts import expert_stacks, random_expert_bytes
    from tests.bitwise import bitwise_equal

    rng = np.random.default_rng(0)
    mesh = parallel.expert_mesh(n)
    q4_k = int(GGMLQuantizationType.Q4_K)
    experts = expert_stacks(random_expert_bytes(rng, 2 * n, 256, 256, q4_k), q4_k)
    sharded = jax.device_put(experts, jax.sharding.NamedSharding(mesh, parallel.P(parallel.EXPERT_AXIS)))
    u = jnp.asarray(rng.standard_normal((5, 256), dtype=np.float32))
    # top-3 of the first 2n - 2 experts: the last device owns no routed pair.
    sel = jnp.asarray(np.stack([rng.permutation(2 * n - 2)[:3] for _ in range(5)]), jnp.int32)
    out = {}
    for mode in ("grouped", "per_token"):
        for row_kernel in ("gemm", "gemv"):
            want = jax.jit(lambda u, s, e: expert_rows(u, s, e, mode, row_kernel)[0])(u, sel, experts)
            got = jax.jit(lambda u, s, e: parallel.sharded_expert_rows(u, s, e, mesh, mode, row_kernel))(
                u, sel, sharded)
            out[f"{mode}/{row_kernel}"] = bool(bitwise_equal(got, want))
    return out


COLLECTIVE = re.compile(r"= (\S+) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
                        r"(-start)?\(")


def collectives(hlo_text: str) -> list[tuple[str, str]]:
    """(op, result type) of every collective in compiled HLO text, e.g. ("all-reduce", "s32[5,8,128]{2,1,0}")."""
    return [(m.group(2), m.group(1)) for m in COLLECTIVE.finditer(hlo_text)]


def check_hlo(path: str, n: int, rows: int = 5) -> dict:
    """The collectives XLA compiles for an expert-parallel engine: one MoE layer on `rows` rows, and a
    whole trunk pass (`Transformer.rows`, the verify / decode graph) on `rows` rows."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import sharpi_jax as sj

    par = sj.load(path, max_context=64, expert_parallel=n)
    c = par.config
    moe = next(b.ffn for b in par.model.layers if b.is_moe)
    g, st = nnx.split(moe)
    u, valid = jnp.ones((rows, c.d_model), jnp.float32), jnp.ones((rows,), bool)
    layer = jax.jit(lambda st, u, v: nnx.merge(g, st)(u, v)).lower(st, u, valid).compile().as_text()
    gm, sm = nnx.split(par.model)
    trunk = jax.jit(lambda sm, state, toks: nnx.merge(gm, sm).rows(state, toks, jnp.int32(0), jnp.int32(rows))[0])
    text = trunk.lower(sm, par.runtime.new_state(), jnp.zeros((rows,), jnp.int32)).compile().as_text()
    return {"rows": rows, "k": c.n_expert_used, "d_model": c.d_model,
            "moe_layers": sum(b.is_moe for b in par.model.layers),
            "layer": collectives(layer), "trunk": collectives(text)}


def check_pallas(path: str, n: int, prompt: str) -> dict:
    """kernels="pallas" (interpret mode on CPU) sharded over n devices against one device: logits bitwise,
    MTP chain tokens, the routed-expert stacks' backend, and the sharded decode step lowered for CUDA
    (Triton calls and all-reduces in its text)."""
    import jax
    import numpy as np

    import sharpi_jax as sj
    from tests.bitwise import bitwise_equal

    load = dict(max_context=32, kernels="pallas", prefill_buckets=(8,))
    one, par = sj.load(path, **load), sj.load(path, **load, expert_parallel=n)
    ids = one.tokenizer.encode(prompt)[:8]
    out = {"logits_bitwise": bool(bitwise_equal(par.logits(ids), one.logits(ids)))}
    gen = dict(max_new_tokens=6, stop_on_eos=False, speculative="mtp", draft_tokens=MTP_DRAFTS)
    out["mtp_one"], out["mtp_parallel"] = one.generate(ids, **gen).tokens, par.generate(ids, **gen).tokens
    out["expert_backends"] = sorted({v["backend"] for k, v in par.matrix_backends.items() if ".experts." in k})
    rt = par.runtime
    state, rows = rt.new_state(), np.zeros((MTP_DRAFTS + 1,), np.int32)
    snaps = jax.eval_shape(lambda s: rt._fns.verify(rt.params, rt.cache, s, rows, np.int32(0),  # pylint: disable=protected-access
                                                    np.int32(len(rows)))[0].snaps, state)
    cpu_backend, jax.default_backend = jax.default_backend, lambda: "gpu"  # trace as on a GPU: the Pallas
    try:                                                                    # kernels leave interpret mode
        text = rt._fns.decode.trace(rt.params, rt.cache, state, np.int32(1), np.int32(0)).lower(
            lowering_platforms=("cuda",)).as_text()
        verify = rt._fns.commit_verify.trace(rt.params, rt.cache, state, snaps, np.int32(0), rows, np.int32(0),
                                             np.int32(len(rows))).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        jax.default_backend = cpu_backend  # the next checks run on the CPU again ("auto" = ggml)
    out["cuda_triton_calls"] = text.count("__gpu$xla.gpu.triton")
    out["cuda_all_reduces"] = text.count("all_reduce")
    out["cuda_verify_triton_calls"] = verify.count("__gpu$xla.gpu.triton")
    out["cuda_verify_all_reduces"] = verify.count("all_reduce")
    out["moe_layers"] = sum(b.is_moe for b in par.model.layers)
    return out


BUDGET_DEVICES = 2
BUDGET = "30%"  # of each device's expert bytes: some of every device's pairs miss


def check_budget(path: str, prompt: str, configs: list[str]) -> dict:
    """expert_parallel=2 with a per-device budget against one device with every expert resident, per
    config "policy/lookahead[/kernels]": prefill logits bitwise, greedy and MTP chain tokens equal, the
    hit rate (below 1: experts were streamed or host-computed), the devices whose host buffers were
    filled (each device streams its own misses), and each device's routed-expert bytes against the plan
    and the budget (its slots, staging and lookahead buffer; its small state arrays apart)."""
    import jax
    import numpy as np

    import sharpi_jax as sj
    from tests.bitwise import bitwise_equal

    out: dict = {}
    refs: dict = {}
    for config in configs:
        policy, lookahead, *kernels = config.split("/")
        load = dict(max_context=64, **({"kernels": kernels[0]} if kernels else {}))
        if tuple(kernels) not in refs:
            one = sj.load(path, **load)
            ids = one.tokenizer.encode(prompt)
            gen = dict(max_new_tokens=16, stop_on_eos=False)
            refs[tuple(kernels)] = (ids, np.asarray(one.logits(ids)), one.generate(ids, **gen).tokens)
        ids, logits, greedy = refs[tuple(kernels)]
        par = sj.load(path, **load, expert_parallel=BUDGET_DEVICES, expert_budget=BUDGET, expert_policy=policy,
                      expert_lookahead=lookahead)
        r = {"logits_bitwise": bool(bitwise_equal(par.logits(ids), logits))}
        g = par.generate(ids, max_new_tokens=16, stop_on_eos=False)
        r["greedy_equal"], r["hit_rate"] = g.tokens == greedy, g.stats.experts["hit_rate"]
        mtp = par.generate(ids, max_new_tokens=16, stop_on_eos=False, speculative="mtp", draft_tokens=MTP_DRAFTS)
        r["mtp_equal"], r["mtp_accepted"] = mtp.tokens == greedy, mtp.stats.speculation.accepted
        streamer = par.residency.streamer
        r["buffer_devices"] = sorted({key[2] for key in list(streamer._staging) + list(streamer._ahead)})  # pylint: disable=protected-access
        per_device: dict = {}
        for path_, arr in par.runtime.expert_cache_arrays().items():
            if path_[4] in ("gate", "up", "down", "staged", "ahead") and path_[-1] in ("gate", "up", "down"):
                for leaf in jax.tree.leaves(arr):
                    for shard in leaf.addressable_shards:
                        per_device[str(shard.device)] = per_device.get(str(shard.device), 0) + shard.data.nbytes
        r["expert_bytes"] = [per_device[k] for k in sorted(per_device)]
        r["plan_bytes"], r["budget"] = par.residency.plan.device_bytes, par.residency.plan.budget
        r["backends"] = sorted({v["backend"] for k, v in par.matrix_backends.items() if ".experts." in k})
        out[config] = r
        par.close()
    return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--prompt", default="def add(a, b):\n    return")
    parser.add_argument("--generate", action="append", default=[], help="a file that also runs generation")
    parser.add_argument("--dispatch", action="store_true", help="also run `check_dispatch`")
    parser.add_argument("--hlo", default=None, help="a file whose compiled collectives `check_hlo` reports")
    parser.add_argument("--pallas", default=None, help="a file `check_pallas` runs (kernels='pallas')")
    parser.add_argument("--budget", default=None, help="a file `check_budget` runs (expert_parallel=2 + budget)")
    parser.add_argument("--budget_configs", default="lru/none,frequency/both",
                        help="comma-separated policy/lookahead[/kernels] for --budget")
    parser.add_argument("files", nargs="*")
    args = parser.parse_args(argv)
    _force_devices(args.devices)
    if args.dispatch:
        print(json.dumps({"dispatch": check_dispatch(args.devices)}), flush=True)
    if args.hlo:
        print(json.dumps({"hlo": check_hlo(args.hlo, args.devices)}), flush=True)
    if args.pallas:
        print(json.dumps({"pallas": check_pallas(args.pallas, args.devices, args.prompt)}), flush=True)
    if args.budget:
        print(json.dumps({"budget": check_budget(args.budget, args.prompt, args.budget_configs.split(","))}),
              flush=True)
    generate = set(args.generate)
    for path in args.files:
        print(json.dumps(check_file(path, args.devices, args.prompt, args.new_tokens, path in generate)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
