"""MTP speculative decoding throughput: MTP off vs sequential verify vs batched verify, k = 1..7.

    python -m experiments.bench_verify [--model=PRESET_OR_GGUF] [--new_tokens=128] [--repeats=3]
                                       [--ks=1,2,3,4,5,6,7] [--json_out=results/bench_verify.jsonl]

Default model: the tiny-qwen35moe-F32 fixture when present, else the embedded default model. Prompt:
the fixture's prompt 0 (llama.cpp token ids) when the model has a references.json beside it, else
--prompt. Every configuration is warmed up first (jit compilation excluded), then --repeats rounds run
every configuration once each (interleaved); figures are each configuration's best round, in decode
tokens/s. Each speculative run's tokens are checked against MTP off (they must be identical).
Timings only; nothing here is a test.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Preset name (configs/models.json) or GGUF path; default: "
                    "tiny-qwen35moe-F32 when the fixtures are present, else the embedded model.")
flags.DEFINE_string("gguf", None, "Alias of --model.")
flags.DEFINE_string("prompt", "def fibonacci(n):\n", "Prompt text when the model has no fixture prompts.")
flags.DEFINE_integer("new_tokens", 128, "Tokens generated per run.")
flags.DEFINE_integer("repeats", 7, "Timed rounds (best round per configuration reported).")
flags.DEFINE_list("ks", ["1", "2", "3", "4", "5", "6", "7"], "Draft lengths k.")
flags.DEFINE_integer("max_context", 1024, "KV cache positions.")
flags.DEFINE_string("json_out", None, "Append one JSON record per configuration here (JSONL).")


def _resolve(name):
    from experiments.presets import FIXTURES_DIR, resolve_model

    if name is None:
        fixture = FIXTURES_DIR / "tiny-qwen35moe" / "tiny-qwen35moe-F32.gguf"
        return fixture if fixture.exists() else resolve_model(None)
    return resolve_model(name)


def _prompt(engine, path: Path):
    refs = path.parent / "references.json"
    if refs.exists():
        ref = json.loads(refs.read_text())
        variant = ref["variants"].get(path.stem)
        if variant:
            return variant["tokens"][0], "fixture prompt 0"
    return engine.tokenizer.encode(FLAGS.prompt), repr(FLAGS.prompt)


def main(argv) -> int:
    del argv
    logging.set_verbosity(logging.WARNING)
    import sharpi_jax as sj
    from sharpi_jax.errors import SharpiError

    try:
        path = Path(_resolve(FLAGS.model or FLAGS.gguf))
        engine = sj.load(path, max_context=FLAGS.max_context)
        if not engine.config.has_mtp:
            raise sj.InputError(f"{path} has no MTP head")
        ks = [int(k) for k in FLAGS.ks]
    except (SharpiError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ids, prompt_desc = _prompt(engine, path)
    n = FLAGS.new_tokens
    print(f"model {path.name} ({engine.config.arch}), prompt: {prompt_desc} ({len(ids)} tokens), "
          f"{n} new tokens, greedy, best of {FLAGS.repeats} interleaved rounds", flush=True)

    configs = [{}] + [dict(speculative="mtp", draft_tokens=k, verify=v) for k in ks for v in ("sequential", "batched")]
    for kw in configs:  # warm-up: compiles every configuration first
        engine.generate(ids, max_new_tokens=min(n, 2 * (kw.get("draft_tokens", 1) + 1) + 2), stop_on_eos=False, **kw)
    # Interleaved rounds (each round runs every configuration once), best round per configuration: on a
    # shared machine this keeps load changes from favouring whichever configuration ran in a quiet spell.
    best: list = [None] * len(configs)
    for r in range(FLAGS.repeats):
        for i, kw in enumerate(configs):
            out = engine.generate(ids, max_new_tokens=n, stop_on_eos=False, **kw)
            if best[i] is None or out.stats["decode_tok_s"] > best[i].stats["decode_tok_s"]:
                best[i] = out
        print(f"  round {r + 1}/{FLAGS.repeats} done", flush=True)
    base, off = best[0], best[0].stats["decode_tok_s"]
    records = [{"model": path.stem, "speculative": None, "draft_tokens": 0, "verify": None, "decode_tok_s": off,
                "generated_tokens": len(base.tokens)}]
    rows = []
    for j, k in enumerate(ks):
        res = {}
        for m, verify in enumerate(("sequential", "batched")):
            out = best[1 + 2 * j + m]
            s = out.stats
            same = out.tokens == base.tokens
            res[verify] = (s["decode_tok_s"], s, same)
            records.append({"model": path.stem, "speculative": "mtp", "draft_tokens": k, "verify": verify,
                            "decode_tok_s": s["decode_tok_s"], "same_tokens_as_off": same,
                            **{key: s[key] for key in ("accept_per_position", "acceptance_rate", "mean_accept_len",
                                                       "drafted", "accepted", "verify_passes", "draft_s", "verify_s",
                                                       "generated_tokens")}})
        rows.append((k, res))

    print(f"\nMTP off: {off:.1f} decode tok/s")
    hdr = (f"{'k':>2} {'seq tok/s':>10} {'batch tok/s':>11} {'batch/seq':>9} {'batch/off':>9} {'accept':>7} "
           f"{'tok/pass':>8} {'draft_s':>8} {'verify_s':>8}  same tokens")
    print(hdr)
    print("-" * len(hdr))
    for k, res in rows:
        (seq, _, seq_same), (bat, s, bat_same) = res["sequential"], res["batched"]
        print(f"{k:>2} {seq:>10.1f} {bat:>11.1f} {bat / seq:>9.2f} {bat / off:>9.2f} {s['acceptance_rate']:>7.1%} "
              f"{s['mean_accept_len']:>8.2f} {s['draft_s']:>8.3f} {s['verify_s']:>8.3f}  "
              f"{'yes' if seq_same and bat_same else 'NO'}")
    print("accept: accepted / drafted; tok/pass: mean accepted drafts + 1 per trunk pass; "
          "draft_s / verify_s: MTP vs trunk seconds of the batched run.")
    if FLAGS.json_out:
        out_path = Path(FLAGS.json_out)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        with out_path.open("a") as f:
            for r in records:
                f.write(json.dumps({"bench": "verify", "new_tokens": n, **r}) + "\n")
        print(f"wrote {len(records)} records to {out_path}")
    return 0 if all(r.get("same_tokens_as_off", True) for r in records) else 1


if __name__ == "__main__":
    app.run(main)
