"""Generate a continuation of a prompt.

    python -m experiments.generate --gguf=PATH --prompt="def fib(n):" --max_new_tokens=64 [--json]

With no --gguf it runs the embedded default model. --json prints one JSON object {tokens, text, stats};
otherwise the text, then a stats line on stderr.
"""

from __future__ import annotations

import json
import sys

from absl import app, flags, logging

from sharpi_jax.errors import SharpiError

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
flags.DEFINE_enum("speculative", None, ["mtp"], "Speculative decoding: mtp = the model's MTP head drafts.")
flags.DEFINE_integer("draft_tokens", 3, "MTP draft length k (tokens drafted per trunk pass).")
flags.DEFINE_enum("verify", "batched", ["batched", "sequential"],
                  "MTP verify: one trunk pass over the k+1 rows, or one single-token step per row.")
flags.DEFINE_string("expert_budget", None, "Device bytes for routed experts: '8GiB', '512MiB', bytes, or a share "
                    "of all routed-expert bytes like '25%' (default: every expert resident).")
flags.DEFINE_enum("expert_policy", "frequency", ["static", "frequency", "lru", "slru"],
                  "Expert placement policy under --expert_budget.")
flags.DEFINE_bool("json", False, "Print one JSON object {tokens, text, stats}.")
flags.DEFINE_bool("warmup", False, "Run a short generation first so the stats exclude jit compilation.")


def main(argv) -> int:
    del argv
    logging.set_verbosity(logging.WARNING)
    import sharpi_jax as sj

    try:
        budget = {} if FLAGS.expert_budget is None else dict(expert_budget=FLAGS.expert_budget,
                                                              expert_policy=FLAGS.expert_policy)
        engine = sj.load(FLAGS.gguf, max_context=FLAGS.max_context, **budget)
        if FLAGS.warmup:
            engine.generate(FLAGS.prompt, max_new_tokens=2, temperature=FLAGS.temperature,
                            speculative=FLAGS.speculative, draft_tokens=FLAGS.draft_tokens, verify=FLAGS.verify)
        out = engine.generate(FLAGS.prompt, max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature,
                              top_k=FLAGS.top_k, top_p=FLAGS.top_p, min_p=FLAGS.min_p, seed=FLAGS.seed,
                              stop_on_eos=FLAGS.stop_on_eos, speculative=FLAGS.speculative,
                              draft_tokens=FLAGS.draft_tokens, verify=FLAGS.verify)
    except SharpiError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if FLAGS.json:
        print(json.dumps({"tokens": out.tokens, "text": out.text, "stats": out.stats}))
    else:
        print(FLAGS.prompt + out.text)
        s = out.stats
        print(f"[{s['prompt_tokens']} prompt tokens, {s['prefill_tok_s']:.1f} tok/s prefill; "
              f"{s['generated_tokens']} generated, {s['decode_tok_s']:.1f} tok/s decode; "
              f"stop: {s['stop_reason']}" + ("" if FLAGS.warmup else "; timings include jit compilation") + "]",
              file=sys.stderr)
        if s.get("speculative") == "mtp":
            print(f"[MTP k={s['draft_tokens']} ({s['verify']} verify): {s['accepted']}/{s['drafted']} drafts accepted "
                  f"({s['acceptance_rate']:.1%}), {s['mean_accept_len']:.2f} tokens per trunk pass, "
                  f"per position {', '.join(f'{x:.2f}' for x in s['accept_per_position'])}]", file=sys.stderr)
        if "experts" in s:
            e = s["experts"]
            print(f"[experts ({e['policy']}, {e['resident_fraction']:.0%} resident, budget "
                  f"{e['budget_bytes'] / 2**20:.1f} MiB): hit rate {e['hit_rate']:.1%}, "
                  f"{e['bytes_streamed_per_token'] / 2**20:.2f} MiB streamed per token, "
                  f"{e['experts_host_computed']} expert uses computed on the host]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    app.run(main)
