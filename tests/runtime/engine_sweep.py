"""Load, use and drop engines one after another in this process; print the maximum RSS after each.

    python -m tests.runtime.engine_sweep N [--how=close|with|del] [--path=GGUF] [--max_new=K]

The engines cycle through CONFIGS (load options, generate options) on the embedded default model (or
--path); the last line is JSON: {"rss_mib": [max RSS after engine 1, 2, ...], "tokens": [...]}.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import sys

CONFIGS = (  # (load options, generate options)
    (dict(expert_budget="50%", expert_policy="lru", expert_lookahead="next_layer"),
     dict(speculative="mtp_tree", draft_tokens=2)),
    (dict(), dict(speculative="mtp", draft_tokens=2)),
    (dict(expert_budget="25%", expert_policy="static"), dict()),
    (dict(expert_budget="50%", expert_policy="slru", expert_lookahead="both"), dict(speculative="mtp", loop="host")),
    (dict(kv_policy="snapkv", kv_budget=40, kv_window=8), dict(temperature=0.8, top_p=0.9, seed=1)),
)


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("n", type=int)
    ap.add_argument("--how", default="close", choices=("close", "with", "del"))
    ap.add_argument("--path", default=None)
    ap.add_argument("--max_new", type=int, default=6)
    args = ap.parse_args(argv)
    import sharpi_jax as sj

    rss, tokens = [], []
    prompt = "def add(a, b):\n    return a + b\n\ndef mul(a, b):"
    for i in range(args.n):
        load_opts, gen_opts = CONFIGS[i % len(CONFIGS)]
        opts = dict(max_context=64, prefill_buckets=(32,), **load_opts)
        if args.how == "with":
            with sj.load(args.path, **opts) as engine:
                tokens.append(engine.generate(prompt, max_new_tokens=args.max_new, **gen_opts).tokens)
        else:
            engine = sj.load(args.path, **opts)
            tokens.append(engine.generate(prompt, max_new_tokens=args.max_new, **gen_opts).tokens)
            if args.how == "close":
                engine.close()
            del engine
        gc.collect()
        rss.append(round(max_rss_mib(), 1))
        print(f"engine {i + 1}: max RSS {rss[-1]} MiB", file=sys.stderr, flush=True)
    print(json.dumps({"rss_mib": rss, "tokens": tokens}))


if __name__ == "__main__":
    main()
