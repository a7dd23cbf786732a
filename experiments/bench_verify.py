"""MTP speculative decoding throughput: MTP off vs sequential verify vs batched verify, k = 1..7, each
batched one on the host loop and on the device loop (`sharpi_jax.runtime.device_loop`), and tree
speculation (batched, --tree_nodes per k, host and device loop) beside the chain.

    python -m experiments.bench_verify [--model=PRESET_OR_GGUF] [--new_tokens=128] [--repeats=3]
                                       [--ks=1,2,3,4,5,6,7] [--tree_nodes=8,16] [--json_out=results/bench_verify.jsonl]
    python -m experiments.bench_verify --model=/work/slice/s35-Q4_K_M.gguf --pass_widths=1,2,4,8,16 --pass_only

--pass_widths: also time one trunk pass of w rows (chain and tree) against one decode step
(experiments.pass_timing): where a w-row pass costs about one row, speculation pays. --pass_only skips
the generation runs (for big files).

Default model: the tiny-qwen35moe-F32 fixture when present, else the embedded default model. Prompt:
the fixture's prompt 0 (llama.cpp token ids) when the model has a references.json beside it, else
--prompt. Every configuration is warmed up first (jit compilation excluded), then --repeats rounds run
every configuration once each (interleaved, experiments.timing); figures are each configuration's
median round with min / max, in decode tokens/s (records: decode_tok_s, _min, _max, _runs). Each
speculative run's tokens are checked against MTP off (they must be identical). Beside each speculative
row: tokens per trunk pass, acceptance by draft position (a tree: by depth) and, for a MoE, the distinct
routed experts a pass reads per layer (--experts_per_pass; records: experts_per_pass).

llama.cpp side by side (optional): with --llama_bin=DIR (a llama.cpp bin directory), the same GGUF and
prompt text run through `llama-speculative-simple --spec-type draft-mtp` for every k (best of
--llama_repeats runs) and `llama-bench` for MTP off; with only llama-cpp-python installed, MTP off
only. The table then prints both MTP speedups (MTP tok/s / MTP-off tok/s) and ours / llama.cpp.
Timings only; nothing here is a test.
"""

from __future__ import annotations

import json
from pathlib import Path

from absl import app, flags, logging

from experiments.cli import fail, reports_bad_input
from experiments.timing import fmt_spread, interleaved, line_buffered, put_spread, spread

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Preset name (configs/models.json) or GGUF path; default: "
                    "tiny-qwen35moe-F32 when the fixtures are present, else the embedded model.")
flags.DEFINE_string("gguf", None, "Alias of --model.")
flags.DEFINE_string("prompt", "def fibonacci(n):\n", "Prompt text when the model has no fixture prompts.")
flags.DEFINE_integer("new_tokens", 128, "Tokens generated per run.")
flags.DEFINE_integer("repeats", 5, "Timed rounds, interleaved (median and min/max per configuration reported).",
                     lower_bound=1)
flags.DEFINE_list("ks", ["1", "2", "3", "4", "5", "6", "7"], "Draft lengths k.")
flags.DEFINE_integer("max_context", 1024, "KV cache positions.")
flags.DEFINE_list("tree_nodes", ["8"], "Tree speculation rows: draft nodes per pass, each with every k <= it "
                  "(batched verify; empty: no tree rows).")
flags.DEFINE_list("pass_widths", [], "Rows w of the single-pass timing (chain and tree pass vs one decode step).")
flags.DEFINE_bool("pass_only", False, "Only the single-pass timing (--pass_widths), no generation runs.")
flags.DEFINE_list("draft_vocab", [], "Draft vocabulary sizes N: time one MTP draft step over the N best-ranked ids "
                  "against the full head, and (unless --draft_step_only) run the chain k and the trees with "
                  "draft_vocab=N on the device loop, acceptance beside the full head's.")
flags.DEFINE_list("p_mins", [], "Adaptive chain length (draft_p_min) values: run the chain k with each on the "
                  "device loop, beside the always-k chain (drafts per pass, tokens per pass, tok/s); with "
                  "--draft_vocab also with each draft vocabulary.")
flags.DEFINE_list("verify_heads", [], "Also run the device-loop chain (every k) and trees with these LM-head "
                  "modes of the verify pass (RunConfig.verify_head: lazy, full), beside the engine's own, on the "
                  "same loaded weights.")
flags.DEFINE_enum("verify_head", "auto", ["auto", "lazy", "full"], "The engine's own verify head "
                  "(RunConfig.verify_head): every device-loop run but the --verify_heads rows uses it.")
flags.DEFINE_bool("experts_per_pass", True, "For a MoE: after the timed rounds, run each printed speculative "
                  "configuration once more on the host loop keeping its verify rows, route them teacher-forced "
                  "(experiments.pass_experts) and print the distinct routed experts a pass reads per layer beside "
                  "each row (MTP off: top-k a step).")
flags.DEFINE_bool("draft_step_only", False, "Only the draft-step timing of --draft_vocab (for big files).")
flags.DEFINE_string("json_out", None, "Append one JSON record per configuration here (JSONL).")
flags.DEFINE_string("llama_bin", None, "llama.cpp bin directory with llama-speculative-simple and llama-bench "
                    "(optional).")
flags.DEFINE_integer("llama_repeats", 3, "llama.cpp runs per configuration (best reported).")
flags.DEFINE_integer("threads", 2, "llama.cpp threads.")


def _resolve(name):
    from experiments.presets import FIXTURES_DIR, resolve_model

    if name is None:
        fixture = FIXTURES_DIR / "tiny-qwen35moe" / "tiny-qwen35moe-F32.gguf"
        return fixture if fixture.exists() else resolve_model(None)
    return resolve_model(name)


def _prompt(engine, path: Path):
    """(token ids, description, text): the fixture's prompt 0 (llama.cpp's ids) or --prompt."""
    refs = path.parent / "references.json"
    if refs.exists():
        ref = json.loads(refs.read_text())
        variant = ref["variants"].get(path.stem)
        if variant:
            return variant["tokens"][0], "fixture prompt 0", ref["prompts"][0]
    return engine.tokenizer.encode(FLAGS.prompt), repr(FLAGS.prompt), FLAGS.prompt


def _llama_cpp(path: Path, ids: list[int], text: str, ks: list[int], n: int) -> tuple[dict | None, dict]:
    """llama.cpp's MTP-off figures and {k: MTP figures} on the same file and prompt (see module doc)."""
    from experiments import llama_cpp_side

    off = llama_cpp_side.prefill_decode(path, ids, n, threads=FLAGS.threads, n_ctx=FLAGS.max_context,
                                        llama_bin=FLAGS.llama_bin)
    mtp = {}
    for k in ks:
        r = llama_cpp_side.mtp_speculative(path, text, n, k, llama_bin=FLAGS.llama_bin, threads=FLAGS.threads,
                                           n_ctx=FLAGS.max_context, repeats=FLAGS.llama_repeats)
        if r is not None:
            mtp[k] = r
    return off, mtp


@reports_bad_input
def main(argv) -> int:
    del argv
    line_buffered()
    logging.set_verbosity(logging.WARNING)
    import sharpi_jax as sj
    from sharpi_jax.runtime.steps import full_head_rows

    try:
        path = Path(_resolve(FLAGS.model or FLAGS.gguf))
        engine = sj.load(path, max_context=FLAGS.max_context, verify_head=FLAGS.verify_head)
        ks = [int(k) for k in FLAGS.ks]
        nodes = [int(x) for x in FLAGS.tree_nodes]
        widths = [int(w) for w in FLAGS.pass_widths]
        if FLAGS.pass_only and not widths:
            raise sj.InputError("--pass_only needs --pass_widths")
        if not engine.config.has_mtp and not FLAGS.pass_only:
            raise sj.InputError(f"{path} has no MTP head")
        heads = [h.strip() for h in FLAGS.verify_heads]
        if any(h not in ("lazy", "full") for h in heads):
            raise sj.InputError(f"--verify_heads takes lazy and full, got {FLAGS.verify_heads}")
    except ValueError as e:
        return fail(e)
    ids, prompt_desc, prompt_text = _prompt(engine, path)
    records = []
    if widths:
        from experiments.pass_timing import pass_timing, print_pass_timing

        timing = pass_timing(engine, ids, widths, FLAGS.repeats)
        print_pass_timing(timing, f"{path.name}, {len(ids)}-token context, {FLAGS.repeats} calls each")
        records += [{"model": path.stem, "pass_timing": True, **r} for r in timing]
    vocabs = [int(v) for v in FLAGS.draft_vocab]
    if vocabs:
        records += _draft_step_timing(engine, ids, vocabs, path)
    if FLAGS.pass_only or FLAGS.draft_step_only:
        _write(records, 0)
        return 0
    n = FLAGS.new_tokens
    own_head = engine.runtime.verify_head_desc()
    print(f"model {path.name} ({engine.config.arch}), prompt: {prompt_desc} ({len(ids)} tokens), "
          f"{n} new tokens, greedy, verify head {own_head}; warm-up, then median [min-max] of {FLAGS.repeats} "
          f"interleaved rounds", flush=True)

    # MTP off and the batched chain on both loops (device: one jitted program per run; host: one call per
    # step / pass, the sequential reference); sequential verify runs the host loop; trees both loops.
    configs = [dict(loop="host"), dict(loop="device")]
    for k in ks:
        configs += [dict(speculative="mtp", draft_tokens=k, verify="sequential", loop="host"),
                    dict(speculative="mtp", draft_tokens=k, verify="batched", loop="host"),
                    dict(speculative="mtp", draft_tokens=k, verify="batched", loop="device")]
    trees = [(k, m) for k in ks for m in nodes if m >= k]
    configs += [dict(speculative="mtp_tree", draft_tokens=k, tree_nodes=m, verify="batched", loop=loop)
                for k, m in trees for loop in ("host", "device")]
    dv_first = len(configs)
    configs += [dict(speculative="mtp", draft_tokens=k, verify="batched", loop="device", draft_vocab=v)
                for k in ks for v in vocabs]
    tdv_first = len(configs)  # the trees with each draft vocabulary
    configs += [dict(speculative="mtp_tree", draft_tokens=k, tree_nodes=m, verify="batched", loop="device",
                     draft_vocab=v) for k, m in trees for v in vocabs]
    pm_first = len(configs)
    # With --draft_vocab, each p_min runs with each draft vocabulary too (the levers combined).
    configs += [dict(speculative="mtp", draft_tokens=k, verify="batched", loop="device", draft_p_min=float(p),
                     **({} if v is None else {"draft_vocab": v}))
                for k in ks for p in FLAGS.p_mins for v in [None] + vocabs]
    vh_first = len(configs)
    configs += [dict(speculative="mtp", draft_tokens=k, verify="batched", loop="device", verify_head=h)
                for h in heads for k in ks]
    configs += [dict(speculative="mtp_tree", draft_tokens=k, tree_nodes=m, verify="batched", loop="device",
                     verify_head=h) for h in heads for k, m in trees]

    def generate(max_new_tokens, kw):
        # --verify_heads: the same engine with the device loop's head mode switched for this run (the
        # attribute `RunConfig.verify_head` resolves to at load), so both modes read the same weights.
        kw, rt = dict(kw), engine.runtime
        head, own = kw.pop("verify_head", None), rt.full_head_rows
        rt.full_head_rows = own if head is None else full_head_rows(head, on_ggml=True)
        try:
            return engine.generate(ids, max_new_tokens=max_new_tokens, stop_on_eos=False, **kw)
        finally:
            rt.full_head_rows = own

    def run(kw):
        return generate(n, kw)

    # Warm-up (compiles every configuration), then interleaved rounds, each running every configuration
    # once (experiments.timing): on a shared machine this keeps load changes from favouring whichever
    # configuration ran in a quiet spell. Figures: the median round, with min / max.
    def warm(kw):  # long enough to compile prefill, decode, draft and verify of every configuration
        generate(min(n, 2 * (kw.get("draft_tokens", 1) + 1) + 2), kw)

    results = interleaved(configs, run, FLAGS.repeats, warm=warm, log=lambda m: print(m, flush=True),
                          what="configurations")
    tok_s = [[o.stats.speed.decode_tok_s for o in outs] for outs in results]
    med = [spread(t)["median"] for t in tok_s]
    experts = _experts_per_pass(engine, ids, n, configs, results[0][0].tokens)
    base, off, off_dev = results[0][0], med[0], med[1]
    for i, loop in ((0, "host"), (1, "device")):
        records.append(put_spread({"model": path.stem, "speculative": None, "draft_tokens": 0, "verify": None,
                                   "loop": loop, "generated_tokens": len(results[i][0].tokens),
                                   "same_tokens_as_off": all(o.tokens == base.tokens for o in results[i]),
                                   "repeats": FLAGS.repeats}, "decode_tok_s", tok_s[i]))
    rows = []
    for j, k in enumerate(ks):
        res = {}
        for m, mode in enumerate(("sequential", "batched", "device")):
            i = 2 + 3 * j + m
            outs = results[i]
            s = outs[0].stats
            same = all(o.tokens == base.tokens for o in outs)
            res[mode] = (med[i], s, same, tok_s[i])
            rec = {"model": path.stem, "speculative": "mtp", "draft_tokens": k, "verify": configs[i]["verify"],
                   "loop": configs[i]["loop"], "same_tokens_as_off": same, "repeats": FLAGS.repeats,
                   **_picked(s, ("accept_per_position", "acceptance_rate", "mean_accept_len", "drafted", "accepted",
                                 "verify_passes", "generated_tokens")),
                   "experts_per_pass": experts.get(_key(configs[i]))}
            put_spread(rec, "decode_tok_s", tok_s[i])
            if mode != "device":  # one device program has no draft / verify split
                put_spread(rec, "draft_s", [o.stats.speculation.draft_s for o in outs], runs=False)
                put_spread(rec, "verify_s", [o.stats.speculation.verify_s for o in outs], runs=False)
            records.append(rec)
        rows.append((k, res))

    step_experts = (f", {engine.config.n_expert_used} routed experts a layer per step" if engine.config.is_moe
                    else "")
    print(f"\nMTP off: host loop {fmt_spread(tok_s[0])}, device loop {fmt_spread(tok_s[1])} decode tok/s "
          f"(median [min-max] of {FLAGS.repeats} rounds){step_experts}")
    hdr = (f"{'k':>2} {'seq tok/s':>10} {'host batch':>10} {'device tok/s [min-max]':>24} {'dev/host':>8} "
           f"{'dev/off':>7} {'accept':>7} {'tok/pass':>8} {'experts/pass':>12} {'draft_s':>8} {'verify_s':>8}  "
           f"same tokens  accept by position")
    print(hdr)
    print("-" * len(hdr))
    for k, res in rows:
        (seq, _, seq_same, _), (bat, s, bat_same, _) = res["sequential"], res["batched"]
        dev, _, dev_same, dev_runs = res["device"]
        rec = next(r for r in records if r.get("draft_tokens") == k and r.get("verify") == "batched"
                   and r.get("loop") == "host")
        print(f"{k:>2} {seq:>10.1f} {bat:>10.1f} {fmt_spread(dev_runs, 24)} {dev / bat:>8.2f} {dev / off_dev:>7.2f} "
              f"{s.speculation.acceptance_rate:>7.1%} {s.speculation.mean_accept_len:>8.2f} "
              f"{_fmt_experts(rec['experts_per_pass'])} {rec['draft_s']:>8.3f} {rec['verify_s']:>8.3f}  "
              f"{'yes' if seq_same and bat_same and dev_same else 'NO':>11}  "
              f"{_by_position(s.speculation.accept_per_position)}")
    print("tok/s: median of the rounds; ratios of medians; dev/off: device-loop MTP over device-loop MTP off; "
          "accept: accepted / drafted; tok/pass: mean accepted drafts + 1 per trunk pass; experts/pass: distinct "
          "routed experts a pass's rows select, mean over MoE layers and passes (teacher-forced replay of a "
          "host-loop run: experiments.pass_experts); draft_s / verify_s: MTP vs trunk seconds of the host-loop "
          "batched run (median); accept by position: draft i accepted, over the passes that drafted it.")
    if trees:
        _tree_rows(path, trees, ks, results, tok_s, med, records, experts)
    if vocabs:
        _draft_vocab_rows(path, ks, vocabs, configs, range(dv_first, tdv_first), results, tok_s, med, records,
                          experts)
    if vocabs and trees:
        _tree_draft_vocab_rows(path, ks, trees, vocabs, dv_first, configs, range(tdv_first, pm_first), results,
                               tok_s, med, records, experts)
    if FLAGS.p_mins:
        _p_min_rows(path, ks, vocabs, dv_first, configs, range(pm_first, vh_first), results, tok_s, med, records,
                    experts)
    if heads:
        _verify_head_rows(path, ks, trees, own_head, configs, range(vh_first, len(configs)), results, tok_s, med,
                          records)
    lc_off, lc_mtp = _llama_cpp(path, ids, prompt_text, ks, n)
    if lc_off is not None or lc_mtp:
        _print_llama_cpp(off_dev, rows, lc_off, lc_mtp)
        lc = {"off": lc_off, "mtp": {str(k): v for k, v in lc_mtp.items()}}
        records.append({"model": path.stem, "llama_cpp": lc})
    else:
        print("llama.cpp: not available (install llama-cpp-python, or pass --llama_bin=DIR for MTP)")
    best = _best(records, off_dev, lc_off, lc_mtp)
    records.append({"model": path.stem, "best": best})
    _write(records, n)
    return 0 if all(r.get("same_tokens_as_off", True) for r in records) else 1


def _key(kw: dict) -> tuple:
    """A speculative configuration's drafts: (speculative, k, tree nodes, draft vocab, p_min); the loop and
    the verify head do not change them."""
    return (kw["speculative"], kw["draft_tokens"], kw.get("tree_nodes"), kw.get("draft_vocab"),
            kw.get("draft_p_min"))


def _experts_per_pass(engine, ids: list[int], n: int, configs: list[dict], off_tokens: list[int]) -> dict:
    """{_key: distinct routed experts per pass and layer} of each speculative configuration (--experts_per_pass,
    a MoE only): one host-loop run keeping its verify rows, routed teacher-forced (experiments.pass_experts).
    A run whose tokens are not MTP off's gets no figure (its rows would not be the timed runs')."""
    if not FLAGS.experts_per_pass or not engine.config.is_moe:
        return {}
    import time

    from experiments.pass_experts import experts_per_pass, pass_rows

    keys = list(dict.fromkeys(_key(kw) for kw in configs if kw.get("speculative")))
    out, t0 = {}, time.perf_counter()
    for i, key in enumerate(keys):
        spec, k, nodes, vocab, p_min = key
        run = pass_rows(engine, ids, n, spec, k, nodes, vocab, p_min)
        out[key] = experts_per_pass(engine, ids, run) if run.tokens == off_tokens else None
        print(f"  experts per pass: {i + 1}/{len(keys)} configurations, {time.perf_counter() - t0:.0f}s elapsed",
              flush=True)
    return out


def _fmt_experts(x: float | None) -> str:
    return f"{x:>12.1f}" if x is not None else f"{'-':>12}"


def _by_position(fractions: list[float] | None) -> str:
    """Acceptance by draft position (or depth), e.g. "0.62 / 0.43"."""
    return " / ".join(f"{f:.2f}" for f in fractions) if fractions else "-"


def _write(records: list[dict], n: int) -> None:
    if FLAGS.json_out:
        out_path = Path(FLAGS.json_out)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        with out_path.open("a") as f:
            for r in records:
                f.write(json.dumps({"bench": "verify", "new_tokens": n, **r}) + "\n")
        print(f"wrote {len(records)} records to {out_path}")


def _tree_rows(path: Path, trees, ks, results, tok_s, med, records, experts: dict) -> None:
    """Tree rows (host and device loop) beside the chain's batched rows of the same k (records appended)."""
    off_dev, base = med[1], results[0][0]
    first = 2 + 3 * len(ks)
    print(f"\n{'k':>2} {'nodes':>5} {'host tok/s':>10} {'device tok/s [min-max]':>24} {'dev/host':>8} "
          f"{'tree/chain':>10} {'tree/off':>8} {'tok/pass':>8} {'chain tok/pass':>14} {'experts/pass':>12} "
          f"{'draft_s':>8} {'verify_s':>8}  same tokens  accept by depth")
    for j, (k, m) in enumerate(trees):
        ih, idev = first + 2 * j, first + 2 * j + 1
        chain_i = 2 + 3 * ks.index(k) + 2  # the device-loop batched chain
        chain = results[chain_i][0].stats
        same = all(o.tokens == base.tokens for o in results[ih] + results[idev])
        for i in (ih, idev):
            s = results[i][0].stats
            rec = {"model": path.stem, "speculative": "mtp_tree", "draft_tokens": k, "tree_nodes": m,
                   "verify": "batched", "loop": s.speed.loop, "same_tokens_as_off": same, "repeats": FLAGS.repeats,
                   "chain_mean_accept_len": chain.speculation.mean_accept_len,
                   **_picked(s, ("accept_per_depth", "acceptance_rate", "mean_accept_len", "drafted", "accepted",
                                 "verify_passes", "generated_tokens", "snapshot_bytes_per_node")),
                   "experts_per_pass": experts.get(_key(dict(speculative="mtp_tree", draft_tokens=k, tree_nodes=m)))}
            put_spread(rec, "decode_tok_s", tok_s[i])
            if i == ih:  # one device program has no draft / verify split
                put_spread(rec, "draft_s", [o.stats.speculation.draft_s for o in results[i]], runs=False)
                put_spread(rec, "verify_s", [o.stats.speculation.verify_s for o in results[i]], runs=False)
                host_rec = rec
            records.append(rec)
        s = results[idev][0].stats
        print(f"{k:>2} {m:>5} {med[ih]:>10.1f} {fmt_spread(tok_s[idev], 24)} {med[idev] / med[ih]:>8.2f} "
              f"{med[idev] / med[chain_i]:>10.2f} {med[idev] / off_dev:>8.2f} {s.speculation.mean_accept_len:>8.2f} "
              f"{chain.speculation.mean_accept_len:>14.2f} {_fmt_experts(host_rec['experts_per_pass'])} "
              f"{host_rec['draft_s']:>8.3f} {host_rec['verify_s']:>8.3f}  {'yes' if same else 'NO':>11}  "
              f"{_by_position(s.speculation.accept_per_depth)}")
    print("tree rows: batched tree verify with `nodes` draft nodes of depth <= k; tree/chain and tree/off: the "
          "device loop over the device-loop chain at the same k and MTP off; tok/pass: accepted + 1 per trunk "
          "pass; experts/pass: as the chain's, over every node's row; draft_s / verify_s: of the host-loop run; "
          "accept by depth: of the passes whose tree reached depth i, those that accepted >= i tokens.")


def _draft_step_timing(engine, ids, vocabs: list[int], path: Path) -> list[dict]:
    """One MTP draft step (the catch-up row of the certain token and one draft: the MTP block and the
    draft LM head) at the prompt's end, full head vs each draft vocabulary, interleaved calls."""
    import time

    import jax
    import numpy as np

    from sharpi_jax.runtime.speculative import MTPDecoder

    dec = MTPDecoder(engine.runtime, engine.mtp, 1)
    dec.prefill(ids)
    mtp, cache = engine.mtp, dec.cache
    toks = np.zeros(3, np.int32)
    toks[0] = ids[-1]
    hidden = jax.numpy.zeros((2, engine.config.d_model), jax.numpy.float32)
    heads = [None] + [mtp.draft_vocab(v) for v in vocabs]  # gathered once, before any timing
    times: list[list[float]] = [[] for _ in heads]
    for r in range(FLAGS.repeats + 1):
        for i, vocab in enumerate(heads):
            t0 = time.perf_counter()
            out, cache = mtp.draft(cache, toks, dec.h_prev, hidden, len(ids) - 1, 1, 1, vocab)[:2]
            out.block_until_ready()
            if r:  # round 0 compiles
                times[i].append(1e3 * (time.perf_counter() - t0))
    full = spread(times[0])["median"]
    print(f"\none MTP draft step ({path.name}, median [min-max] ms of {FLAGS.repeats} interleaved calls): "
          f"full head ({engine.config.n_vocab} ids) {fmt_spread(times[0], digits=3)}")
    recs = [put_spread({"model": path.stem, "draft_step": True, "draft_vocab": None}, "draft_step_ms", times[0])]
    for v, t in zip(vocabs, times[1:]):
        ratio = spread(t)["median"] / full
        print(f"  draft_vocab={v}: {fmt_spread(t, digits=3)} ms, {ratio:.2f}x the full head's step")
        recs.append(put_spread({"model": path.stem, "draft_step": True, "draft_vocab": v, "vs_full": ratio},
                               "draft_step_ms", t))
    return recs


def _setting(rec: dict) -> str:
    """A run's speculative setting in words (chain or tree, and any lever that differs from the defaults)."""
    if rec["speculative"] == "mtp_tree":
        name = f"tree k={rec['draft_tokens']} nodes={rec['tree_nodes']}"
    else:
        name = f"chain k={rec['draft_tokens']}"
    for key, label in (("draft_vocab", "draft_vocab"), ("draft_p_min", "p_min"), ("verify_head", "head")):
        if rec.get(key) is not None:
            name += f" {label}={rec[key]}"
    return name


def _best(records: list[dict], off: float, lc_off: dict | None, lc_mtp: dict) -> dict:
    """Prints and returns the fastest device-loop speculative run that kept MTP off's tokens in every round
    (its tok/s over device-loop MTP off), beside llama.cpp's best draft-mtp speedup over its own decode."""
    runs = [r for r in records if r.get("loop") == "device" and r.get("speculative") and r.get("same_tokens_as_off")]
    best: dict = {"setting": None, "decode_tok_s": None, "speedup": None, "tokens_per_pass": None,
                  "llama_cpp_k": None, "llama_cpp_speedup": None}
    if runs:
        top = max(runs, key=lambda r: r["decode_tok_s"])
        best.update(setting=_setting(top), decode_tok_s=top["decode_tok_s"], speedup=top["decode_tok_s"] / off,
                    tokens_per_pass=top.get("mean_accept_len"))
    lc_base = lc_off.get("decode_tok_s") if lc_off and "error" not in lc_off else None
    lc_ok = {k: v for k, v in lc_mtp.items() if v and "error" not in v}
    if lc_base and lc_ok:
        k = max(lc_ok, key=lambda k: lc_ok[k]["decode_tok_s"])
        best.update(llama_cpp_k=k, llama_cpp_speedup=lc_ok[k]["decode_tok_s"] / lc_base)
    ours = (f"{best['setting']}, {best['decode_tok_s']:.1f} tok/s = {best['speedup']:.2f}x MTP off (device loop)"
            if runs else "none kept MTP off's tokens")
    theirs = (f"draft-mtp k={best['llama_cpp_k']}, {best['llama_cpp_speedup']:.2f}x its own decode"
              if best["llama_cpp_k"] is not None else "n/a")
    print(f"\nbest lossless setting: {ours}; llama.cpp's best: {theirs}")
    return best


def _picked(stats, keys) -> dict:
    """The named keys of a run's flat stats (`GenerateStats.to_dict`), for a JSON record."""
    flat = stats.to_dict()
    return {key: flat[key] for key in keys}


def _chain_record(path: Path, k: int, outs, base, tok_s: list[float], records: list[dict], **extra) -> bool:
    """Appends the record of a device-loop chain configuration's runs `outs`; returns whether every run gave
    MTP off's tokens (`base`)."""
    s = outs[0].stats
    same = all(o.tokens == base.tokens for o in outs)
    rec = {"model": path.stem, "speculative": "mtp", "draft_tokens": k, "verify": "batched", "loop": "device",
           **extra, "same_tokens_as_off": same, "repeats": FLAGS.repeats,
           **_picked(s, ("accept_per_position", "acceptance_rate", "mean_accept_len", "drafted", "accepted",
                         "verify_passes", "generated_tokens"))}
    put_spread(rec, "decode_tok_s", tok_s)
    records.append(rec)
    return same


def _draft_vocab_rows(path: Path, ks, vocabs, configs, indices: range, results, tok_s, med, records,
                      experts: dict) -> None:
    """Chain k with each draft vocabulary on the device loop, beside the full head's device-loop row."""
    base = results[0][0]
    print(f"\n{'k':>2} {'draft_vocab':>11} {'tok/s [min-max]':>24} {'vs full':>7} {'accept':>7} {'full accept':>11} "
          f"{'tok/pass':>8} {'experts/pass':>12}  same tokens  accept by position")
    for j in indices:
        k, v = configs[j]["draft_tokens"], configs[j]["draft_vocab"]
        full_i = 2 + 3 * ks.index(k) + 2  # the full head's device-loop chain row
        s, fs = results[j][0].stats, results[full_i][0].stats
        epp = experts.get(_key(configs[j]))
        same = _chain_record(path, k, results[j], base, tok_s[j], records, draft_vocab=v,
                             full_acceptance_rate=fs.speculation.acceptance_rate, experts_per_pass=epp)
        spec = s.speculation
        print(f"{k:>2} {v:>11} {fmt_spread(tok_s[j], 24)} {med[j] / med[full_i]:>7.2f} {spec.acceptance_rate:>7.1%} "
              f"{fs.speculation.acceptance_rate:>11.1%} {spec.mean_accept_len:>8.2f} {_fmt_experts(epp)}  "
              f"{'yes' if same else 'NO':>11}  {_by_position(spec.accept_per_position)}")
    print("draft_vocab rows: device loop; vs full: tok/s over the full head's device-loop chain at the same k; "
          "accept: accepted / drafted with the draft vocabulary, full accept: with the full head.")


def _tree_draft_vocab_rows(path: Path, ks, trees, vocabs, dv_first, configs, indices: range, results, tok_s, med,
                           records, experts: dict) -> None:
    """Trees with each draft vocabulary on the device loop, beside the full head's device-loop tree and the
    device-loop chain of the same depth and draft vocabulary."""
    base, off_dev = results[0][0], med[1]
    print(f"\n{'k':>2} {'nodes':>5} {'draft_vocab':>11} {'tok/s [min-max]':>24} {'vs full':>7} {'tree/chain':>10} "
          f"{'tree/off':>8} {'tok/pass':>8} {'chain tok/pass':>14} {'experts/pass':>12}  same tokens  accept by depth")
    first = 2 + 3 * len(ks)
    for j in indices:
        k, m, v = configs[j]["draft_tokens"], configs[j]["tree_nodes"], configs[j]["draft_vocab"]
        full_i = first + 2 * trees.index((k, m)) + 1  # the full head's device-loop tree row
        chain_i = dv_first + ks.index(k) * len(vocabs) + vocabs.index(v)  # the chain with this draft vocabulary
        s, cs = results[j][0].stats.speculation, results[chain_i][0].stats.speculation
        same = all(o.tokens == base.tokens for o in results[j])
        epp = experts.get(_key(configs[j]))
        rec = {"model": path.stem, "speculative": "mtp_tree", "draft_tokens": k, "tree_nodes": m, "draft_vocab": v,
               "verify": "batched", "loop": "device", "same_tokens_as_off": same, "repeats": FLAGS.repeats,
               "chain_mean_accept_len": cs.mean_accept_len, "experts_per_pass": epp,
               **_picked(results[j][0].stats, ("accept_per_depth", "acceptance_rate", "mean_accept_len", "drafted",
                                               "accepted", "verify_passes", "generated_tokens"))}
        put_spread(rec, "decode_tok_s", tok_s[j])
        records.append(rec)
        print(f"{k:>2} {m:>5} {v:>11} {fmt_spread(tok_s[j], 24)} {med[j] / med[full_i]:>7.2f} "
              f"{med[j] / med[chain_i]:>10.2f} {med[j] / off_dev:>8.2f} {s.mean_accept_len:>8.2f} "
              f"{cs.mean_accept_len:>14.2f} {_fmt_experts(epp)}  {'yes' if same else 'NO':>11}  "
              f"{_by_position(s.accept_per_depth)}")
    print("tree draft_vocab rows: device loop; vs full: tok/s over the full head's device-loop tree; tree/chain: "
          "over the device-loop chain of the same k and draft vocabulary; tree/off: over device-loop MTP off.")


def _p_min_rows(path: Path, ks, vocabs, dv_first, configs, indices: range, results, tok_s, med, records,
                experts: dict) -> None:
    """Chain k with an adaptive length (draft_p_min) on the device loop, beside the always-k device chain with
    the same draft vocabulary (full head or --draft_vocab)."""
    base = results[0][0]
    print(f"\n{'k':>2} {'p_min':>6} {'draft_vocab':>11} {'tok/s [min-max]':>24} {'vs k':>6} {'drafts/pass':>11} "
          f"{'tok/pass':>8} {'accept':>7} {'experts/pass':>12}  same tokens  accept by position")
    for j in indices:
        k, p, v = configs[j]["draft_tokens"], configs[j]["draft_p_min"], configs[j].get("draft_vocab")
        # the always-k device-loop chain row with the same draft vocabulary
        own_i = 2 + 3 * ks.index(k) + 2 if v is None else dv_first + ks.index(k) * len(vocabs) + vocabs.index(v)
        s = results[j][0].stats.speculation
        per_pass = s.drafted / max(1, s.verify_passes)
        epp = experts.get(_key(configs[j]))
        same = _chain_record(path, k, results[j], base, tok_s[j], records, draft_p_min=p, drafts_per_pass=per_pass,
                             experts_per_pass=epp, **({} if v is None else {"draft_vocab": v}))
        print(f"{k:>2} {p:>6.2f} {v or 'full':>11} {fmt_spread(tok_s[j], 24)} {med[j] / med[own_i]:>6.2f} "
              f"{per_pass:>11.2f} {s.mean_accept_len:>8.2f} {s.acceptance_rate:>7.1%} {_fmt_experts(epp)}  "
              f"{'yes' if same else 'NO':>11}  {_by_position(s.accept_per_position)}")
    print("p_min rows: device loop; vs k: tok/s over the always-k chain at the same k and draft vocabulary; "
          "drafts/pass: drafts verified per trunk pass (k at most).")


def _verify_head_rows(path: Path, ks, trees, own_head, configs, indices: range, results, tok_s, med, records) -> None:
    """The device-loop chain and trees with another verify-head mode, beside the engine's own rows."""
    base = results[0][0]
    print(f"\n{'run':>12} {'head':>5} {'tok/s [min-max]':>24} {'vs own':>9} {'tok/pass':>8}  same tokens")
    for j in indices:
        kw = configs[j]
        k, head = kw["draft_tokens"], kw["verify_head"]
        if kw["speculative"] == "mtp":
            own_i, name = 2 + 3 * ks.index(k) + 2, f"chain k={k}"
        else:
            m = kw["tree_nodes"]
            own_i, name = 2 + 3 * len(ks) + 2 * trees.index((k, m)) + 1, f"tree {k}/{m}"
        same = all(o.tokens == base.tokens for o in results[j])
        s = results[j][0].stats
        rec = {"model": path.stem, "speculative": kw["speculative"], "draft_tokens": k, "verify": "batched",
               "loop": "device", "verify_head": head, "tree_nodes": kw.get("tree_nodes"), "same_tokens_as_off": same,
               "repeats": FLAGS.repeats, "vs_own_head": med[j] / med[own_i],
               **_picked(s, ("mean_accept_len", "drafted", "accepted", "verify_passes", "generated_tokens"))}
        records.append(put_spread(rec, "decode_tok_s", tok_s[j]))
        print(f"{name:>12} {head:>5} {fmt_spread(tok_s[j], 24)} {med[j] / med[own_i]:>9.2f} "
              f"{s.speculation.mean_accept_len:>8.2f}  {'yes' if same else 'NO'}")
    print(f"verify-head rows: device loop; vs own: tok/s over the same run with the engine's own head mode "
          f"({own_head}); full: every verify row's LM head in the pass, lazy: the walked rows' only, one at a time")


def _print_llama_cpp(off: float, rows, lc_off: dict | None, lc_mtp: dict) -> None:
    """Side-by-side table: our device-loop batched verify vs llama.cpp's draft-mtp, speedups over each one's MTP off."""
    lc_base = lc_off.get("decode_tok_s") if lc_off and "error" not in lc_off else None
    src = (lc_off or {}).get("source") or (lc_off or {}).get("error", "n/a")
    print(f"\nllama.cpp MTP off: {f'{lc_base:.1f} decode tok/s' if lc_base else 'n/a'} ({src}); "
          f"ours / llama.cpp MTP off: {f'{off / lc_base:.2f}' if lc_base else 'n/a'}")
    if not lc_mtp:
        print("llama.cpp MTP: needs --llama_bin=DIR with llama-speculative-simple (llama-cpp-python has no draft-mtp)")
        return
    hdr = (f"{'k':>2} {'ours tok/s':>10} {'ours speedup':>12} {'llama tok/s':>11} {'llama speedup':>13} "
           f"{'ours/llama':>10} {'ours accept':>11} {'llama accept':>12}")
    print(hdr)
    print("-" * len(hdr))
    for k, res in rows:
        bat, s, _, _ = res["device"]
        lc = lc_mtp.get(k)
        if lc is None or "error" in lc:
            print(f"{k:>2} {bat:>10.1f} {bat / off:>12.2f}   ({(lc or {}).get('error', 'n/a')[:70]})")
            continue
        lt = lc["decode_tok_s"]
        sp = f"{lt / lc_base:>13.2f}" if lc_base else f"{'n/a':>13}"
        print(f"{k:>2} {bat:>10.1f} {bat / off:>12.2f} {lt:>11.1f} {sp} {bat / lt:>10.2f} "
              f"{s.speculation.accepted:>5}/{s.speculation.drafted:<5} {lc['accepted']:>6}/{lc['drafted']:<5}")
    print("speedup: MTP decode tok/s / the same engine's MTP-off decode tok/s; accept: accepted / drafted.")


if __name__ == "__main__":
    app.run(main)
