"""SnapKV quality sweep: how continuations on an evicted KV cache differ from the full cache as the budget varies.

    python -m experiments.snapkv_quality --models=default,tiny-qwen35moe-F32 --budgets=48,96,192 \
        [--kv_window=32 --kv_pool=7 --new_tokens=32 --out=results/snapkv_quality.jsonl --plot_dir=...]

Per model, on a long prompt (the fixtures' long Python prompt, tokenized by the model; without the
fixtures, this file's own source), the full-cache greedy continuation is the reference. Per budget:
- agreement: the share of the reference's steps where the evicted cache's greedy token equals the
  reference token, teacher-forced on the reference continuation (no compounding of divergences);
- rel_l2 (mean and max over steps): ||logits_evicted - logits_full|| / ||logits_full||, teacher-forced;
- first_divergence: free-running greedy on the evicted cache, the index of the first token that differs
  from the reference (new_tokens if none);
- acceptance of MTP speculative decoding (k = --mtp_k) with the MTP head's KV evicted by the same rule
  ("snapkv") and kept whole ("keep"), and whether both gave exactly the plain evicted output (they must).
One JSONL record per (model, budget); `python -m experiments.plot` (or --plot_dir here) draws
snapkv_quality_vs_budget.png.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from absl import app, flags

from experiments.cli import fail, reports_bad_input
from experiments.presets import FIXTURES_DIR, resolve_model

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["default", "tiny-qwen35moe-F32", "tiny-qwen35-F32", "tiny-qwen3next-F32"],
                  "Preset names or GGUF paths.")
flags.DEFINE_list("budgets", ["48", "96", "192"], "kv_budget values (positions kept per attention layer and KV "
                  "head); those >= the prompt length are skipped. Finer: --budgets=48,64,96,128,192,256 (~2x time).")
flags.DEFINE_integer("kv_window", 32, "SnapKV observation window.")
flags.DEFINE_integer("kv_pool", 7, "SnapKV pooling width.")
flags.DEFINE_integer("new_tokens", 32, "Continuation length.")
flags.DEFINE_integer("prompt_tokens", 0, "Cut the prompt to this many tokens (0: all of it).")
flags.DEFINE_integer("mtp_k", 3, "MTP draft tokens for the acceptance columns (0: skip MTP).")
flags.DEFINE_integer("max_context", 512, "KV positions of the full cache.")
flags.DEFINE_string("out", "results/snapkv_quality.jsonl", "JSONL output (overwritten).")
flags.DEFINE_string("plot_dir", None, "Where the figure goes (default: <out dir>/plots).")


def long_prompt_text() -> str:
    """The fixtures' long prompt (tiny-qwen35moe references, prompt 3), else this file's source."""
    ref = FIXTURES_DIR / "tiny-qwen35moe" / "references.json"
    if ref.exists():
        return json.loads(ref.read_text())["prompts"][3]
    return Path(__file__).read_text()


def continuation_logits(runtime, ids: list[int], cont: list[int], kv) -> np.ndarray:
    """Logits [len(cont), V] before each token of `cont` (teacher-forced) after prompt ids, on the cache
    left by `kv_eviction.prefill` with policy kv (None: full cache)."""
    from sharpi_jax.runtime import kv_eviction

    capacity = kv_eviction.kv_capacity(kv, len(cont), runtime.max_context)
    _, logits, state, _ = kv_eviction.prefill(runtime, ids, kv, capacity)
    rows = [np.asarray(logits)]
    for i, tok in enumerate(cont[:-1]):
        logits, _, state = runtime.decode_step(state, tok, len(ids) + i)
        rows.append(np.asarray(logits))
    return np.stack(rows)


def measure(engine, model: str, ids: list[int], budgets: list[int], emit) -> None:
    from sharpi_jax.model.snapkv import SnapKV
    from sharpi_jax.runtime.sampling import SamplingParams
    from sharpi_jax.runtime.strategies.chain import generate_mtp
    from sharpi_jax.runtime.strategies.plain import generate_ids

    rt, n, greedy = engine.runtime, FLAGS.new_tokens, SamplingParams()
    ref, _ = generate_ids(rt, ids, n, greedy)
    full = continuation_logits(rt, ids, ref, None)
    assert [int(t) for t in full.argmax(-1)] == ref
    for budget in budgets:
        if budget >= len(ids):
            continue
        kv = SnapKV(budget, FLAGS.kv_window, FLAGS.kv_pool)
        ev = continuation_logits(rt, ids, ref, kv)
        rel = np.linalg.norm(ev - full, axis=-1) / np.linalg.norm(full, axis=-1)
        out, stats = generate_ids(rt, ids, n, greedy, kv=kv)
        first = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), n)
        rec = {"model": model, "prompt_tokens": len(ids), "new_tokens": n, "kv_budget": budget,
               "kv_window": kv.window, "kv_pool": kv.pool, "kept_share": budget / len(ids),
               "kv_evicted": stats["kv_evicted"], "kv_capacity": stats["kv_capacity"],
               "agreement": float(np.mean(ev.argmax(-1) == np.asarray(ref))), "rel_l2": float(rel.mean()),
               "rel_l2_max": float(rel.max()), "first_divergence": first}
        if FLAGS.mtp_k and engine.config.has_mtp:
            same = True
            for mode in ("snapkv", "keep"):
                got, st = generate_mtp(rt, engine.mtp, ids, n, greedy, (), FLAGS.mtp_k, kv=kv, mtp_kv=mode)
                rec[f"acceptance_mtp_{mode}"] = st["acceptance_rate"]
                same &= got == out
            rec.update(mtp_k=FLAGS.mtp_k, mtp_same_tokens=same)
        emit(rec)


@reports_bad_input
def main(argv) -> int:
    del argv
    import sharpi_jax as sj
    from experiments.plot import plot_all

    out = Path(FLAGS.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    records = []
    try:
        budgets = sorted(int(b) for b in FLAGS.budgets)
        with out.open("w") as f:
            def emit(r):
                records.append(r)
                f.write(json.dumps(r) + "\n")
                f.flush()
                print(f"{r['model']} budget {r['kv_budget']}/{r['prompt_tokens']}: agreement {r['agreement']:.3f}, "
                      f"rel L2 {r['rel_l2']:.3g} (max {r['rel_l2_max']:.3g}), first divergence "
                      f"{r['first_divergence']}/{r['new_tokens']}" +
                      (f", MTP k={r['mtp_k']} acceptance {r['acceptance_mtp_snapkv']:.3f} (MTP KV evicted) / "
                       f"{r['acceptance_mtp_keep']:.3f} (kept), same tokens: {r['mtp_same_tokens']}"
                       if "mtp_k" in r else ""), flush=True)

            for model in FLAGS.models:
                engine = sj.load(resolve_model(model), max_context=FLAGS.max_context)
                ids = engine.tokenizer.encode(long_prompt_text())
                if FLAGS.prompt_tokens:
                    ids = ids[:FLAGS.prompt_tokens]
                ids = engine.check_ids(ids[: FLAGS.max_context - FLAGS.new_tokens])
                measure(engine, model, ids, budgets, emit)
    except ValueError as e:
        return fail(e)
    print(f"wrote {len(records)} records to {out}")
    for p in plot_all(records, Path(FLAGS.plot_dir or out.parent / "plots")):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    app.run(main)
