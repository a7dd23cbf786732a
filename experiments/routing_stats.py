"""Routing statistics of a MoE model against a random-weight model of the same shape, and a figure.

    python -m experiments.routing_stats                       # the research model (built on first use)
    python -m experiments.routing_stats --model=PATH_OR_PRESET [--tokens=512] [--out_dir=results/routing]

Routes held-out Python text (`experiments.presets.HELD_OUT_SOURCES`: frozen copies of this repository's sources, not in
the stdlib training corpus) through the trunk (`sharpi_jax.runtime.routing.trace_routing`, teacher-forced) and prints per MoE layer
(`sharpi_jax.experts.routing_stats`): expert load skew (CV, max/mean, normalised entropy), reuse
between consecutive tokens, the overlap of a token's experts with the next --drafts tokens' (the rows
its MTP drafts fill when accepted), the distinct experts of a verify pass of 1 + drafts rows, and the
next-layer prediction (layer L's router applied to the hidden state entering layer L, i.e. layer L-1's
output) as precision / recall at top-k and top-2k. The same for a random-weight model of the same shape
(`sharpi_jax.testing.write_synthetic_gguf`, cached), whose routing is the uniform baseline.
Writes <out_dir>/routing_stats.json and routing_stats.png.
"""

from __future__ import annotations

import json
from pathlib import Path

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "research", "GGUF path or configs/models.json preset.")
flags.DEFINE_integer("tokens", 512, "Tokens per sequence.")
flags.DEFINE_integer("sequences", 4, "Sequences (source files) routed.")
flags.DEFINE_integer("drafts", 3, "MTP draft tokens k: draft overlap over k tokens, pass union over k + 1 rows.")
flags.DEFINE_string("out_dir", "results/routing", "Where the JSON and the figure go.")

def random_twin(path: Path) -> Path:
    """A random-weight GGUF of the same config as `path` (cached beside the synthetic presets)."""
    from sharpi_jax.gguf import GGUFFile, read_model_config
    from sharpi_jax.testing import write_synthetic_gguf

    from experiments.presets import cache_dir

    out = cache_dir() / "synthetic" / f"random-twin-{path.stem}-{path.stat().st_size}.gguf"
    if not out.exists():
        with GGUFFile(path) as f:
            c = read_model_config(f)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".partial")
        write_synthetic_gguf(tmp, c, qtype="Q8_0", seed=0, name="random-twin")
        tmp.rename(out)
    return out


def layer_stats(trace, n_expert: int, drafts: int) -> list[dict]:
    """Per MoE layer: the `routing_stats` figures of one trace (or several concatenated)."""
    from sharpi_jax.experts import routing_stats as rs

    k = trace.top_k
    out = []
    for L, sel in enumerate(trace.selected):
        row = {"layer": L, **rs.load_skew(sel, n_expert), "reuse": rs.reuse(sel, n_expert),
               "draft_overlap": rs.draft_overlap(sel, n_expert, drafts),
               "pass_union": rs.pass_union(sel, n_expert, drafts + 1)}
        if L > 0:
            for n in (k, 2 * k):
                p = rs.prediction(trace.early[L], sel, n)
                row[f"precision@{n}"], row[f"recall@{n}"] = p["precision"], p["recall"]
        out.append(row)
    return out


def trace_model(path: Path, ids_list) -> tuple[list, object]:
    import numpy as np

    import sharpi_jax as sj
    from sharpi_jax.runtime.routing import RoutingTrace, trace_routing

    e = sj.load(path, max_context=64)
    traces = [trace_routing(e.model, ids) for ids in ids_list]
    # Statistics over sequences: concatenated along tokens, each sequence's boundary costs one pair.
    cat = RoutingTrace(np.concatenate([t.probs for t in traces], axis=1),
                       np.concatenate([t.early for t in traces], axis=1), traces[0].top_k)
    return cat, e.config


def main(argv) -> None:
    del argv
    import numpy as np

    import sharpi_jax as sj

    from experiments.presets import HELD_OUT_SOURCES, REPO_ROOT, resolve_model
    from experiments.timing import line_buffered

    line_buffered()
    path = resolve_model(FLAGS.model)
    tok = sj.load(path, max_context=64).tokenizer
    ids_list = [tok.encode((REPO_ROOT / s).read_text())[: FLAGS.tokens] for s in HELD_OUT_SOURCES[: FLAGS.sequences]]
    results = {}
    for name, p in (("trained", path), ("random", random_twin(path))):
        trace, c = trace_model(p, ids_list)
        results[name] = layer_stats(trace, c.n_expert, FLAGS.drafts)
    k, E = c.n_expert_used, c.n_expert
    print(f"model {path} ({E} experts, top-{k}); {len(ids_list)} sequences x {FLAGS.tokens} tokens, "
          f"drafts {FLAGS.drafts}; random: same shape, random weights")
    cols = ["cv", "max_over_mean", "entropy", "reuse", "draft_overlap", "pass_union", f"recall@{k}",
            f"recall@{2 * k}", f"precision@{2 * k}"]
    print(f"{'model':8s} {'layer':>5s} " + " ".join(f"{c_:>13s}" for c_ in cols))
    for name, rows in results.items():
        for r in rows:
            print(f"{name:8s} {r['layer']:5d} " + " ".join(f"{r.get(c_, np.nan):13.3f}" for c_ in cols))
    print(f"uniform iid routing would give reuse {k / E:.3f}, draft overlap {1 - (1 - k / E) ** FLAGS.drafts:.3f}, "
          f"pass union {E * (1 - (1 - k / E) ** (FLAGS.drafts + 1)):.1f}, recall@{k} {k / E:.3f}")
    out = Path(FLAGS.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "routing_stats.json").write_text(json.dumps(
        {"model": str(path), "n_expert": E, "top_k": k, "tokens": FLAGS.tokens, "sequences": len(ids_list),
         "drafts": FLAGS.drafts, "layers": results}, indent=2))
    plot(results, k, out / "routing_stats.png")
    print(f"wrote {out / 'routing_stats.json'} and {out / 'routing_stats.png'}")


def plot(results: dict, k: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("cv", "load CV"), ("reuse", "reuse t -> t+1"), ("draft_overlap", "overlap with next drafts"),
              (f"recall@{k}", f"next-layer recall@{k}")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (key, title) in zip(axes, panels):
        for name, rows in results.items():
            pts = [(r["layer"], r[key]) for r in rows if key in r]
            ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_title(title)
        ax.set_xlabel("MoE layer")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    app.run(main)
