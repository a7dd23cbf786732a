"""Draw the standard figures from sweep / benchmark JSONL records.

    python -m experiments.plot --results=results/mtp_draft_tokens.jsonl [--results=more.jsonl] [--out_dir=results/plots]

Figures (each drawn when its records are present):
- tok_s_vs_k.png: decode tokens/s vs draft tokens k, one line per verify mode; MTP-off as a dashed line.
  Error bars (and a grey band around MTP off): min-max over the sweep's warm interleaved rounds.
- acceptance_per_position.png: fraction of drafts accepted at each draft position, one group per k.
- tree_vs_nodes.png: tree speculation (speculative = "mtp_tree"): mean accepted length (tokens per trunk
  pass) and decode tokens/s vs tree_nodes, one line per depth; the chain at the same depth as a cross
  at tree_nodes = depth, MTP off as a dashed line.
- expert_reads_vs_batch.png: expert weight bytes read per token vs batch width N, per-token vs grouped.
- hit_rate_vs_budget.png: expert residency hit rate vs expert budget, one line per placement policy
  (error bars where the hit rate varied between rounds: lru / slru).
- snapkv_quality_vs_budget.png: SnapKV greedy agreement and logit relative L2 vs kv_budget, per model
  (experiments.snapkv_quality).
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path
from typing import Any

from absl import app, flags

from experiments.cli import reports_bad_input
from experiments.timing import spread

FLAGS = flags.FLAGS
flags.DEFINE_multi_string("results", None, "JSONL file(s) of records.", required=True)
flags.DEFINE_string("out_dir", None, "Where PNGs go (default: <first results dir>/plots).")


def read_records(paths: list[str | Path]) -> list[dict[str, Any]]:
    from sharpi_jax.errors import InputError

    records = []
    for p in paths:
        try:
            lines = Path(p).read_text().splitlines()
        except OSError as e:
            raise InputError(f"results file {p}: {e.strerror}") from None
        for i, line in enumerate(lines):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise InputError(f"{p}:{i + 1}: not JSON ({e})") from None
    return records


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def _series(records, x_key, y_key, group_keys):
    """{group: sorted [(x, mean y)]} over records having x_key and y_key."""
    acc: dict[tuple, dict[Any, list]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in records:
        if x_key in r and y_key in r:
            acc[tuple(r.get(k) for k in group_keys)][r[x_key]].append(r[y_key])
    return {g: sorted((x, _mean(ys)) for x, ys in d.items()) for g, d in acc.items()}


def _point_spread(recs: list[dict[str, Any]], y_key: str) -> tuple[float, float, float]:
    """(y, low, high) of one plotted point made of several records (one per prompt).

    With per-round values (`<y>_runs`, experiments.timing) of equal length in every record: the mean over
    the records in each round, then the median / min / max over the rounds (the spread is timing noise
    alone, not the prompts' differences). Else the mean of `<y>`, `<y>_min` and `<y>_max` (`<y>` where a
    record has no spread: one measurement)."""
    runs = [r.get(f"{y_key}_runs") for r in recs]
    if all(isinstance(x, list) and x for x in runs) and len({len(x) for x in runs}) == 1:
        per_round = [_mean(vals) for vals in zip(*runs)]
        s = spread(per_round)
        return s["median"], s["min"], s["max"]
    y = _mean([r[y_key] for r in recs])
    lo = _mean([r.get(f"{y_key}_min", r[y_key]) for r in recs])
    hi = _mean([r.get(f"{y_key}_max", r[y_key]) for r in recs])
    return y, lo, hi


def spread_series(records, x_key, y_key, group_keys):
    """{group: sorted [(x, y, low, high)]} over records having x_key and y_key (`_point_spread`)."""
    acc: dict[tuple, dict[Any, list]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in records:
        if x_key in r and y_key in r and r[y_key] is not None:
            acc[tuple(r.get(k) for k in group_keys)][r[x_key]].append(r)
    return {g: sorted((x, *_point_spread(rs, y_key)) for x, rs in d.items()) for g, d in acc.items()}


def _errorbar(ax, pts, scale=1.0, **kw):
    """A line through the points' y with error bars from low to high (the spread of the repeats)."""
    xs = [p[0] * scale for p in pts]
    ys = [p[1] for p in pts]
    yerr = [[max(0.0, p[1] - p[2]) for p in pts], [max(0.0, p[3] - p[1]) for p in pts]]
    return ax.errorbar(xs, ys, yerr=yerr, capsize=3, marker="o", **kw)


def _spread_note(ax, records) -> None:
    reps = sorted({r["repeats"] for r in records if isinstance(r.get("repeats"), int)})
    if reps:
        ax.text(0.99, 0.01, f"median of {'/'.join(map(str, reps))} warm interleaved rounds; bars: min-max",
                transform=ax.transAxes, ha="right", va="bottom", fontsize=6, color="dimgray")


def figures(records: list[dict[str, Any]]) -> dict[str, Any]:
    """{png name: matplotlib Figure} for every figure whose data is present (not saved, not closed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figs: dict[str, Any] = {}

    def save(fig, name):
        fig.tight_layout()
        figs[name] = fig

    spec = [r for r in records if r.get("speculative") == "mtp"]
    if spec:
        fig, ax = plt.subplots(figsize=(6, 4))
        for (model, verify), pts in sorted(spread_series(spec, "draft_tokens", "decode_tok_s",
                                                         ["model", "verify"]).items(), key=str):
            _errorbar(ax, pts, label=f"{model} {verify} verify")
        off = [r for r in records if "speculative" in r and r["speculative"] is None]
        for (model,), pts in spread_series(off, "model", "decode_tok_s", ["model"]).items():
            _, y, lo, hi = pts[0]
            ax.axhline(y, linestyle="--", color="gray",
                       label=f"{model} MTP off" + (" (band: min-max)" if hi > lo else ""))
            if hi > lo:
                ax.axhspan(lo, hi, color="gray", alpha=0.15, linewidth=0)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("draft tokens k")
        ax.set_ylabel("decode tokens/s")
        ax.set_title("MTP speculative decoding: throughput vs k")
        ax.legend(fontsize=7)
        _spread_note(ax, records)
        save(fig, "tok_s_vs_k.png")

    with_pos = [r for r in spec if r.get("accept_per_position")]
    if with_pos:
        by_k: dict[int, list[list[float]]] = collections.defaultdict(list)
        for r in with_pos:
            by_k[int(r["draft_tokens"])].append(r["accept_per_position"])
        fig, ax = plt.subplots(figsize=(6, 4))
        ks = sorted(by_k)
        width = 0.8 / len(ks)
        for j, k in enumerate(ks):
            rates = [_mean([row[i] for row in by_k[k] if i < len(row)]) for i in range(k)]
            ax.bar([i + 1 + (j - len(ks) / 2 + 0.5) * width for i in range(k)], rates, width=width, label=f"k={k}")
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance rate")
        ax.set_ylim(0, 1)
        ax.set_title("MTP acceptance per draft position")
        ax.legend(fontsize=7)
        save(fig, "acceptance_per_position.png")

    tree = [r for r in records if r.get("speculative") == "mtp_tree"]
    if tree:
        save(_tree_figure(plt, records, tree), "tree_vs_nodes.png")

    moe = [r for r in records if "per_token_bytes_per_token" in r and "N" in r]
    if moe:
        fig, ax = plt.subplots(figsize=(6, 4))
        for key, label in (("per_token_bytes_per_token", "per-token"), ("grouped_bytes_per_token", "grouped")):
            pts = sorted(_series(moe, "N", key, []).get((), []))
            ax.plot([p[0] for p in pts], [p[1] / 2**20 for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch width N (rows)")
        ax.set_ylabel("expert weight MiB read per token")
        ax.set_title("Routed-expert reads per token vs batch width")
        ax.legend()
        save(fig, "expert_reads_vs_batch.png")

    res = [r for r in records if "hit_rate" in r and "expert_budget_frac" in r]
    if res:
        fig, ax = plt.subplots(figsize=(6, 4))
        for (policy,), pts in sorted(spread_series(res, "expert_budget_frac", "hit_rate", ["expert_policy"]).items(),
                                     key=str):
            _errorbar(ax, pts, scale=100, label=str(policy))
        ax.set_xlabel("expert budget (% of routed expert bytes)")
        ax.set_ylabel("hit rate")
        ax.set_ylim(0, 1.02)
        ax.set_title("Expert residency hit rate vs budget")
        ax.legend()
        _spread_note(ax, res)
        save(fig, "hit_rate_vs_budget.png")

    snap = [r for r in records if "kv_budget" in r and "agreement" in r]
    if snap:
        save(_snapkv_figure(snap, plt), "snapkv_quality_vs_budget.png")
    return figs


def _tree_figure(plt, records, tree):
    """Accepted length and tok/s vs tree_nodes per depth, chain crosses, MTP off line (see the module doc)."""
    fig, (ax_len, ax_tok) = plt.subplots(1, 2, figsize=(10, 4))
    chain = [r for r in records if r.get("speculative") == "mtp" and r.get("verify", "batched") == "batched"]
    for ax, key in ((ax_len, "mean_accept_len"), (ax_tok, "decode_tok_s")):
        for (model, k), pts in sorted(spread_series(tree, "tree_nodes", key, ["model", "draft_tokens"]).items(),
                                      key=str):
            line = _errorbar(ax, pts, label=f"{model} tree depth {k}")
            for (cm, ck), cpts in spread_series(chain, "draft_tokens", key, ["model", "draft_tokens"]).items():
                if (cm, ck) == (model, k):
                    ax.plot([k], [cpts[0][1]], marker="x", markersize=9, color=line.lines[0].get_color(),
                            linestyle="none", label=f"{model} chain k={k}")
        ax.set_xlabel("tree nodes (drafts per trunk pass)")
    off = [r for r in records if "speculative" in r and r["speculative"] is None]
    for (model,), pts in spread_series(off, "model", "decode_tok_s", ["model"]).items():
        ax_tok.axhline(pts[0][1], linestyle="--", color="gray", label=f"{model} MTP off")
    ax_len.set_ylabel("mean accepted length (tokens per trunk pass)")
    ax_tok.set_ylabel("decode tokens/s")
    ax_len.set_title("Tree speculation: accepted length")
    ax_tok.set_title("Tree speculation: throughput")
    ax_len.legend(fontsize=6)
    ax_tok.legend(fontsize=6)
    _spread_note(ax_tok, tree)
    return fig


def _snapkv_figure(records: list[dict[str, Any]], plt):
    """SnapKV quality vs kv_budget (experiments.snapkv_quality): greedy agreement and logit relative L2
    of the continuation against the full cache, one line per model."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for (model,), pts in sorted(_series(records, "kv_budget", "agreement", ["model"]).items(), key=str):
        a1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=str(model))
    for (model,), pts in sorted(_series(records, "kv_budget", "rel_l2", ["model"]).items(), key=str):
        a2.plot([p[0] for p in pts], [max(p[1], 1e-9) for p in pts], marker="o", label=str(model))
    a1.set_ylim(0, 1.02)
    a1.set_ylabel("greedy agreement (teacher-forced)")
    a2.set_yscale("log")
    a2.set_ylabel("logit rel. L2, mean over steps")
    for ax in (a1, a2):
        ax.set_xlabel("kv_budget (positions kept per layer and KV head)")
        ax.legend(fontsize=7)
    fig.suptitle("SnapKV eviction: continuation vs the full cache")
    return fig


def plot_all(records: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Write every figure whose data is present; return the PNG paths."""
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fig in figures(records).items():
        p = out_dir / name
        fig.savefig(p, dpi=120)
        plt.close(fig)
        written.append(p)
    return written


@reports_bad_input
def main(argv) -> int:
    del argv
    records = read_records(FLAGS.results)
    out_dir = Path(FLAGS.out_dir or Path(FLAGS.results[0]).parent / "plots")
    written = plot_all(records, out_dir)
    if not written:
        print("no figure: the records carry none of the plotted fields", file=sys.stderr)
        return 1
    for p in written:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    app.run(main)
