"""Generate a continuation of a prompt.

    python -m experiments.generate --gguf=PATH --prompt="def fib(n):" --max_new_tokens=64 [--json]
    python -m experiments.generate --speculative=mtp --draft_tokens=3 --max_new_tokens=48 --compare
    python -m experiments.generate --speculative=mtp_tree --draft_tokens=4 --tree_nodes=12 --compare
    python -m experiments.generate --speculative=mtp --draft_vocab=512 --compare   # chain over 512 ranked ids
    python -m experiments.generate --kv_policy=snapkv --kv_budget=256 --speculative=mtp --prompt="$(cat f.py)"

With no --gguf it runs the embedded default model. --json prints one JSON object {tokens, text, stats};
otherwise the text, then a stats line on stderr.

--compare (with --speculative=mtp) answers "does MTP pay on this model?" in the same run: MTP off and
MTP are each warmed up (compilation excluded), then --repeats interleaved rounds (off, MTP, off, MTP,
...; experiments.timing) time both on the same prompt and length; it prints both decode tokens/s
(median [min-max]), the ratio MTP / off, and whether the tokens are identical (they must be). With the
chain, the tree of the same depth (--tree_nodes, default 8) is timed in the same rounds and printed
beside it (--nocompare_tree: not). --loop picks the device loop (default) or the host loop. The
text and stats shown are those of the first timed MTP run. With --json the object gets "compare".
--draft_vocab applies to the chain and the tree (the tree timed beside the chain drafts over it too).
"""

from __future__ import annotations

import dataclasses
import json
import sys

from absl import app, flags, logging

from experiments.cli import fail, reports_bad_input
from sharpi_jax.errors import InputError

FLAGS = flags.FLAGS
flags.DEFINE_string("gguf", None, "GGUF model file (default: the embedded default model).")
flags.DEFINE_string("prompt", "def fibonacci(n):\n", "Prompt text.")
flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate at most.")
flags.DEFINE_float("temperature", 0.0, "0 = greedy; > 0 samples.")
flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0 = off).")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (1 = off).")
flags.DEFINE_float("min_p", 0.0, "Drop tokens below min_p x the top probability (0 = off).")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_integer("max_context", 4096, "KV cache positions (prompt + generated).")
flags.DEFINE_bool("stop_on_eos", True, "Stop at an end-of-generation token.")
flags.DEFINE_enum("speculative", None, ["mtp", "mtp_tree"], "Speculative decoding: mtp = the model's MTP head "
                  "drafts a chain; mtp_tree = it drafts a tree (--tree_nodes nodes, depth --draft_tokens).")
flags.DEFINE_integer("draft_tokens", 3, "MTP draft length k (tokens drafted per trunk pass).")
flags.DEFINE_enum("verify", "batched", ["batched", "sequential"],
                  "MTP verify: one trunk pass over the k+1 rows, or one single-token step per row.")
flags.DEFINE_enum("loop", "device", ["device", "host"], "device: the decode loop runs as one jitted program on "
                  "the device; host: one jitted call per step / pass from Python (the sequential reference).")
flags.DEFINE_float("draft_p_min", 0.0, "mtp: stop a pass's chain before the first draft the MTP head gives a "
                   "probability below this (llama.cpp's --draft-p-min; 0: always --draft_tokens drafts).")
flags.DEFINE_integer("draft_vocab", None, "mtp / mtp_tree: the MTP head drafts over the N best-ranked token ids "
                     "only (the file's calibrated ranking, else id order); verification uses the full head, so the "
                     "tokens are unchanged.")
flags.DEFINE_integer("tree_nodes", None, "mtp_tree: draft nodes per trunk pass (default max(8, draft_tokens)).")
flags.DEFINE_integer("max_snapshot_bytes", None, "mtp_tree: cap on the GDN snapshot bytes a pass keeps (one "
                     "snapshot per node; lowers tree_nodes).")
flags.DEFINE_string("expert_budget", None, "Device bytes for routed experts: '8GiB', '512MiB', bytes, or a share "
                    "of all routed-expert bytes like '25%' (default: every expert resident).")
flags.DEFINE_enum("expert_policy", "frequency", ["static", "frequency", "lru", "slru"],
                  "Expert placement policy under --expert_budget.")
flags.DEFINE_enum("kv_policy", None, ["snapkv"], "KV eviction at prefill: snapkv keeps --kv_budget positions per "
                  "attention layer and KV head (the --kv_window last prompt tokens + the prefix positions they attend "
                  "to most); decoding and MTP verify run on the compacted cache.")
flags.DEFINE_integer("kv_budget", None, "SnapKV: KV positions kept per attention layer and KV head.")
flags.DEFINE_integer("kv_window", None, "SnapKV: observation window (last prompt tokens, always kept; default 32).")
flags.DEFINE_integer("kv_pool", None, "SnapKV: attention pooling width over neighbouring positions (default 7).")
flags.DEFINE_integer("expert_parallel", None, "Shard the routed experts over N devices (a Mesh 'expert' axis; on "
                     "CPU, N forced host devices). Across hosts: with --coordinator_address.", lower_bound=1)
flags.DEFINE_string("coordinator_address", None, "host:port of process 0: call jax.distributed.initialize() "
                    "first (multi-host expert parallelism; every process runs the same command).")
flags.DEFINE_integer("num_processes", None, "With --coordinator_address: the number of processes.")
flags.DEFINE_integer("process_id", None, "With --coordinator_address: this process's index (0 prints).")
flags.DEFINE_bool("chat", False, "Treat --prompt as a user message: render it (after --system) with the GGUF's chat "
                  "template and generate from the result's token ids.")
flags.DEFINE_string("system", None, "With --chat: a system message before the user message.")
flags.DEFINE_bool("enable_thinking", None, "With --chat: the template's thinking switch (Qwen3.5: "
                  "--noenable_thinking closes an empty <think> block); unset: the template's default.")
flags.DEFINE_bool("json", False, "Print one JSON object {tokens, text, stats}.")
flags.DEFINE_bool("warmup", False, "Run a short generation first so the stats exclude jit compilation.")
flags.DEFINE_bool("compare", False, "With --speculative=mtp: also time MTP off, both warm, interleaved --repeats "
                  "rounds in this run; print both decode tok/s and the ratio.")
flags.DEFINE_bool("compare_tree", True, "With --compare and --speculative=mtp: also time the tree of depth "
                  "--draft_tokens (--tree_nodes, default 8 nodes) in the same rounds.")
flags.DEFINE_integer("repeats", 5, "Timed rounds of each mode for --compare (median and min/max reported).",
                     lower_bound=1)


@reports_bad_input
def main(argv) -> int:
    del argv
    logging.set_verbosity(logging.WARNING)
    import sharpi_jax as sj

    if FLAGS.compare and FLAGS.speculative is None:
        return fail("--compare times MTP off against MTP: add --speculative=mtp")
    compare = None
    parallel_info = _start_devices()
    opts = _options()  # validated before the model loads
    budget = {} if FLAGS.expert_budget is None else dict(expert_budget=FLAGS.expert_budget,
                                                          expert_policy=FLAGS.expert_policy)
    if FLAGS.expert_parallel is not None:
        budget["expert_parallel"] = FLAGS.expert_parallel
    kv = dict(kv_policy=FLAGS.kv_policy, kv_budget=FLAGS.kv_budget, kv_window=FLAGS.kv_window,
              kv_pool=FLAGS.kv_pool)
    engine = sj.load(FLAGS.gguf, max_context=FLAGS.max_context, **budget, **kv)
    if engine.mesh is not None:
        parallel_info["devices"] = [str(d) for d in engine.mesh.devices.flat]
    if FLAGS.compare:
        out, compare = _compare(engine, opts)
    else:
        if FLAGS.warmup:
            engine.generate(_prompt(engine), dataclasses.replace(opts, max_new_tokens=2))
        out = engine.generate(_prompt(engine), opts)
    if parallel_info.get("process_id", 0) != 0:
        return 0  # every process computed the same tokens; process 0 prints them
    if FLAGS.json:
        print(json.dumps({"tokens": out.tokens, "text": out.text, "stats": out.stats.to_dict(),
                          **({"compare": compare} if compare else {}), **parallel_info}))
    else:
        print((engine.tokenizer.decode(_prompt(engine)) if FLAGS.chat else FLAGS.prompt) + out.text)
        _print_stats(out.stats)
        if compare:
            print(_compare_line(compare), file=sys.stderr)
        elif out.stats.speculation is not None:
            print("[whether MTP pays is not measured here: add --compare to time MTP off vs MTP, warm, in this run]",
                  file=sys.stderr)
    return 0


def _print_stats(stats) -> None:
    """The run's stats (a `GenerateStats`) as bracketed lines on stderr."""
    s, spec, kv = stats.speed, stats.speculation, stats.kv
    print(f"[{s.prompt_tokens} prompt tokens, {s.prefill_tok_s:.1f} tok/s prefill; "
          f"{s.generated_tokens} generated, {s.decode_tok_s:.1f} tok/s decode; "
          f"stop: {s.stop_reason}" + ("" if FLAGS.warmup or FLAGS.compare else
                                      "; timings include jit compilation") + "]",
          file=sys.stderr)
    if spec is not None and spec.mode == "mtp":
        print(f"[MTP k={spec.draft_tokens} ({spec.verify} verify): {spec.accepted}/{spec.drafted} drafts accepted "
              f"({spec.acceptance_rate:.1%}), {spec.mean_accept_len:.2f} tokens per trunk pass, "
              f"per position {', '.join(f'{x:.2f}' for x in spec.accept_per_position)}"
              + (f"; draft vocabulary {spec.draft_vocab} ids ranked by {spec.draft_vocab_ranking}"
                 if spec.draft_vocab else "") + "]", file=sys.stderr)
    if spec is not None and spec.mode == "mtp_tree":
        print(f"[MTP tree depth {spec.draft_tokens}, {spec.tree_nodes} nodes ({spec.verify} verify): "
              f"{spec.accepted}/{spec.drafted} nodes accepted, {spec.mean_accept_len:.2f} tokens per trunk pass, "
              f"per depth {', '.join(f'{x:.2f}' for x in spec.accept_per_depth)}; "
              f"{spec.snapshot_bytes_per_node} snapshot bytes per node"
              + (f"; draft vocabulary {spec.draft_vocab} ids ranked by {spec.draft_vocab_ranking}"
                 if spec.draft_vocab else "") + "]", file=sys.stderr)
    if kv is not None and kv.evicted:
        print(f"[SnapKV: {kv.evicted} prompt positions evicted per attention layer and KV head; "
              f"{kv.slots} of {kv.capacity} KV slots in use at the end]", file=sys.stderr)
    if stats.experts is not None:
        e = stats.experts
        print(f"[experts ({e['policy']}, {e['resident_fraction']:.0%} resident, budget "
              f"{e['budget_bytes'] / 2**20:.1f} MiB): hit rate {e['hit_rate']:.1%}, "
              f"{e['bytes_streamed_per_token'] / 2**20:.2f} MiB streamed per token, "
              f"{e['experts_host_computed']} expert uses computed on the host]", file=sys.stderr)


def _options():
    """The flags' `GenerateOptions` (one validated object, as `Engine.generate`'s keyword shortcuts build)."""
    import sharpi_jax as sj

    tree = FLAGS.speculative == "mtp_tree"
    if not tree and ((FLAGS.tree_nodes is not None and not FLAGS.compare) or FLAGS.max_snapshot_bytes is not None):
        raise sj.InputError("--tree_nodes / --max_snapshot_bytes need --speculative=mtp_tree (or --compare: "
                            "--tree_nodes of the tree timed beside the chain)")
    return sj.GenerateOptions.from_keywords(
        max_new_tokens=FLAGS.max_new_tokens, stop_on_eos=FLAGS.stop_on_eos, speculative=FLAGS.speculative,
        draft_tokens=FLAGS.draft_tokens, verify=FLAGS.verify, loop=FLAGS.loop, draft_vocab=FLAGS.draft_vocab,
        draft_p_min=FLAGS.draft_p_min,
        tree_nodes=FLAGS.tree_nodes if tree else None, max_snapshot_bytes=FLAGS.max_snapshot_bytes if tree else None,
        temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p, min_p=FLAGS.min_p, seed=FLAGS.seed)


def _prompt(engine):
    """--prompt, or with --chat its token ids through the chat template (--system, --enable_thinking)."""
    if not FLAGS.chat:
        if FLAGS.system is not None or FLAGS.enable_thinking is not None:
            raise InputError("--system / --enable_thinking need --chat")
        return FLAGS.prompt
    messages = ([{"role": "system", "content": FLAGS.system}] if FLAGS.system is not None else []) + \
        [{"role": "user", "content": FLAGS.prompt}]
    thinking = {} if FLAGS.enable_thinking is None else {"enable_thinking": FLAGS.enable_thinking}
    return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **thinking)


def _start_devices() -> dict:
    """Before jax starts: join the multi-host job (--coordinator_address) and, for --expert_parallel on
    CPU, ask XLA for that many host devices. Returns what --json reports about it."""
    from sharpi_jax.experts import parallel

    info: dict = {}
    if FLAGS.coordinator_address:
        import jax

        jax.distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
        info["process_id"] = jax.process_index()
    elif FLAGS.expert_parallel is not None:
        parallel.force_host_devices(FLAGS.expert_parallel)
    if FLAGS.expert_parallel is not None:
        info["expert_parallel"] = FLAGS.expert_parallel
    return info


def _compare(engine, opts):
    """(the first timed MTP output, the comparison dict): MTP off and MTP warm, interleaved rounds; with
    the chain (--speculative=mtp) and --compare_tree, the tree of depth draft_tokens (--tree_nodes, else
    8 nodes) as a third mode."""
    from experiments.timing import interleaved, put_spread
    from sharpi_jax.runtime.options import Chain, Tree

    modes = [dataclasses.replace(opts, speculation=None), opts]
    tree = isinstance(opts.speculation, Chain) and FLAGS.compare_tree
    if tree:
        modes.append(dataclasses.replace(opts, speculation=Tree(opts.draft_tokens, FLAGS.tree_nodes,
                                                                draft_vocab=opts.speculation.draft_vocab)))
    quiet = FLAGS.json

    def run(o):
        return engine.generate(_prompt(engine), o)

    names = "MTP off, MTP" + (", MTP tree" if tree else "")
    results = interleaved(modes, run, FLAGS.repeats, what=f"modes ({names})",
                          log=(lambda m: None) if quiet else (lambda m: print(m, file=sys.stderr, flush=True)))
    off, mtp = results[:2]
    cmp = {"repeats": FLAGS.repeats, "draft_tokens": opts.draft_tokens, "verify": opts.verify,
           "loop": mtp[0].stats.speed.loop, "off_loop": off[0].stats.speed.loop,
           "generated_tokens": len(mtp[0].tokens),
           "same_tokens": all(o.tokens == off[0].tokens for o in off + mtp)}
    put_spread(cmp, "off_decode_tok_s", [o.stats.speed.decode_tok_s for o in off])
    put_spread(cmp, "mtp_decode_tok_s", [o.stats.speed.decode_tok_s for o in mtp])
    cmp["speedup"] = cmp["mtp_decode_tok_s"] / cmp["off_decode_tok_s"]
    if tree:
        t = results[2]
        cmp["tree"] = {"tree_nodes": t[0].stats.speculation.tree_nodes, "loop": t[0].stats.speed.loop,
                       "mean_accept_len": t[0].stats.speculation.mean_accept_len,
                       "same_tokens": all(o.tokens == off[0].tokens for o in t)}
        put_spread(cmp["tree"], "decode_tok_s", [o.stats.speed.decode_tok_s for o in t])
        cmp["tree"]["vs_chain"] = cmp["tree"]["decode_tok_s"] / cmp["mtp_decode_tok_s"]
        cmp["tree"]["vs_off"] = cmp["tree"]["decode_tok_s"] / cmp["off_decode_tok_s"]
    return mtp[0], cmp


def _compare_line(c: dict) -> str:
    from experiments.timing import fmt_spread

    faster = c["speedup"] > 1.0
    verdict = (f"MTP is {'faster' if faster else 'SLOWER'} than MTP off on this model and machine"
               + ("" if faster else (" (speculation pays only where a pass of k + 1 rows costs much less than k + 1 decode steps:"
                                   " weight-bandwidth-bound models; a tiny model on a CPU is compute-bound)")))
    if not (c["mtp_decode_tok_s_min"] > c["off_decode_tok_s_max"] or c["mtp_decode_tok_s_max"] < c["off_decode_tok_s_min"]):
        verdict += ", though the two ranges overlap: within this run's noise"
    loops = c["loop"] if c["loop"] == c["off_loop"] else f"MTP off: {c['off_loop']}, MTP: {c['loop']}"
    line = (f"[compare (warm, median [min-max] of {c['repeats']} interleaved rounds, {c['generated_tokens']} tokens, "
            f"{loops} loop): MTP off {fmt_spread(c['off_decode_tok_s_runs'])} decode tok/s; MTP k={c['draft_tokens']} "
            f"({c['verify']} verify) {fmt_spread(c['mtp_decode_tok_s_runs'])} decode tok/s; "
            f"MTP / off = {c['speedup']:.2f}x: {verdict}; same tokens: {'yes' if c['same_tokens'] else 'NO'}]")
    t = c.get("tree")
    if t:
        best = "the tree" if t["vs_chain"] > 1.0 else "the chain"
        line += (f"\n[compare tree (depth {c['draft_tokens']}, {t['tree_nodes']} nodes, {t['loop']} loop): "
                 f"{fmt_spread(t['decode_tok_s_runs'])} decode tok/s, {t['mean_accept_len']:.2f} tokens per trunk "
                 f"pass; tree / chain = {t['vs_chain']:.2f}x, tree / off = {t['vs_off']:.2f}x: {best} is faster "
                 f"here; same tokens: {'yes' if t['same_tokens'] else 'NO'}]")
    return line


if __name__ == "__main__":
    app.run(main)
