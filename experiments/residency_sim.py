"""Expert residency with and without next-layer prefetch, replayed on a model's routing traces.

    python -m experiments.residency_sim                  # the research model (built on first use)
    python -m experiments.residency_sim --model=PATH_OR_PRESET --budgets=0.1,0.25,0.5,0.75 --drafts=3

Traces held-out sequences (`experiments.presets.HELD_OUT_SOURCES`; the first --calibration of them give
the "frequency" policy's counts, the rest are replayed) and runs `sharpi_jax.experts.residency.simulate`
for each budget (the share of each layer's experts in slots), policy (static / frequency / lru) and
prefetch source (none / next_layer), MTP off (passes of 1 row) and on (passes of drafts + 1 rows that
advance by 1 .. drafts + 1 generated tokens: no draft to every draft accepted). Prints MiB streamed per
generated token on the critical path (demand) and in all (demand + prefetch), the hit rate, and for
each MTP setting at --key_budget the ratio of the best prefetching configuration's demand MiB/token to
the best non-prefetching one's; writes <out_dir>/residency_sim.jsonl and residency_sim.png. A model of
the bytes moved (see `simulate`), not a timing of the engine.
"""

from __future__ import annotations

import json
from pathlib import Path

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "research", "GGUF path or configs/models.json preset.")
flags.DEFINE_list("budgets", ["0.1", "0.25", "0.5", "0.75"], "Shares of each layer's experts held in slots.")
flags.DEFINE_integer("drafts", 3, "MTP draft tokens k (verify passes of k + 1 rows).")
flags.DEFINE_integer("tokens", 512, "Tokens per sequence.")
flags.DEFINE_integer("calibration", 2, "Sequences used for the frequency policy's counts (not replayed).")
flags.DEFINE_float("key_budget", 0.25, "The budget of the printed prefetch / no-prefetch ratio.")
flags.DEFINE_string("out_dir", "results/residency_sim", "Where the JSONL and the figure go.")


def main(argv) -> None:
    del argv
    import numpy as np

    import sharpi_jax as sj
    from sharpi_jax.experts.residency import layer_geometry
    from sharpi_jax.experts.residency.simulate import SIM_POLICIES, SIM_PREFETCH, simulate
    from sharpi_jax.gguf import GGUFFile, read_model_config
    from sharpi_jax.runtime.routing import trace_routing

    from experiments.presets import HELD_OUT_SOURCES, REPO_ROOT, resolve_model
    from experiments.timing import line_buffered

    line_buffered()
    path = resolve_model(FLAGS.model)
    with GGUFFile(path) as f:
        c = read_model_config(f)
        bpe = max(b for _, b in layer_geometry(f, c).values())
    e = sj.load(path, max_context=64)
    traces = [trace_routing(e.model, e.tokenizer.encode((REPO_ROOT / s).read_text())[: FLAGS.tokens])
              for s in HELD_OUT_SOURCES]
    cal, rest = traces[: FLAGS.calibration], traces[FLAGS.calibration:]
    E, k = c.n_expert, c.n_expert_used
    counts = sum(np.stack([np.bincount(s.ravel(), minlength=E) for s in t.selected]) for t in cal)
    orders = {"static": [list(range(E))] * c.n_layer,
              "frequency": [list(np.argsort(-counts[i], kind="stable")) for i in range(c.n_layer)]}
    orders["lru"] = orders["frequency"]
    mib = bpe / 2**20
    settings = [("off", 1, 1)] + [("on", FLAGS.drafts + 1, a) for a in range(1, FLAGS.drafts + 2)]
    records = []
    for frac in (float(b) for b in FLAGS.budgets):
        n_slots = int(round(frac * E))
        for mtp, rows, adv in settings:
            for policy in SIM_POLICIES:
                for prefetch in SIM_PREFETCH:
                    runs = [simulate(t.selected, t.early, n_slots, policy, orders[policy], prefetch, rows, adv)
                            for t in rest]
                    r = {k_: float(np.mean([x[k_] for x in runs])) for k_ in runs[0]}
                    records.append({"model": str(path), "budget_frac": frac, "n_slots": n_slots, "mtp": mtp,
                                    "rows": rows, "tokens_per_pass": adv, "policy": policy, "prefetch": prefetch,
                                    "demand_mib_per_token": r["demand_per_token"] * mib,
                                    "total_mib_per_token": r["total_per_token"] * mib, "hit_rate": r["hit_rate"]})
    print(f"model {path}: {E} experts top-{k}, {c.n_layer} MoE layers, {bpe / 2**20:.3f} MiB per expert; "
          f"{len(rest)} sequences x {FLAGS.tokens} tokens replayed, {len(cal)} for counts")
    print(f"{'budget':>6s} {'mtp':>3s} {'tok/pass':>8s} {'policy':>9s} {'prefetch':>10s} {'demand MiB/t':>12s} "
          f"{'total MiB/t':>11s} {'hit':>6s}")
    for r in records:
        print(f"{r['budget_frac']:6.2f} {r['mtp']:>3s} {r['tokens_per_pass']:8d} {r['policy']:>9s} "
              f"{r['prefetch']:>10s} {r['demand_mib_per_token']:12.4f} {r['total_mib_per_token']:11.4f} {r['hit_rate']:6.3f}")
    print(f"key check at budget {FLAGS.key_budget}: best next_layer config vs best no-prefetch policy "
          "(demand MiB per generated token)")
    for mtp, rows, adv in settings:
        cell = [r for r in records if r["budget_frac"] == FLAGS.key_budget and r["mtp"] == mtp
                and r["tokens_per_pass"] == adv]
        if not cell:
            continue
        best = {p: min((x for x in cell if x["prefetch"] == p), key=lambda x: x["demand_mib_per_token"])
                for p in SIM_PREFETCH}
        a, b = best["next_layer"], best["none"]
        ratio = a["demand_mib_per_token"] / b["demand_mib_per_token"]
        print(f"  mtp {mtp} ({adv} tokens/pass): {a['policy']}+next_layer {a['demand_mib_per_token']:.4f} vs "
              f"{b['policy']} {b['demand_mib_per_token']:.4f} MiB/token -> {ratio:.2f}x "
              f"(total incl. prefetch {a['total_mib_per_token'] / b['total_mib_per_token']:.2f}x)")
    out = Path(FLAGS.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "residency_sim.jsonl", "w") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
    plot(records, FLAGS.drafts + 1, out / "residency_sim.png")
    print(f"wrote {out / 'residency_sim.jsonl'} and {out / 'residency_sim.png'}")


def plot(records: list[dict], all_accepted: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("off", 1, "MTP off"), ("on", 1, "MTP k+1 rows, 1 token/pass"),
              ("on", all_accepted, f"MTP k+1 rows, {all_accepted} tokens/pass")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.5), sharey=True)
    for ax, (mtp, adv, title) in zip(axes, panels):
        for policy in sorted({r["policy"] for r in records}):
            for prefetch, style in (("none", "-"), ("next_layer", "--")):
                pts = sorted((r["budget_frac"], r["demand_mib_per_token"]) for r in records
                             if r["mtp"] == mtp and r["tokens_per_pass"] == adv and r["policy"] == policy
                             and r["prefetch"] == prefetch)
                ax.plot(*zip(*pts), style, marker="o", label=f"{policy} {prefetch}")
        ax.set_title(title)
        ax.set_xlabel("budget (share of experts in slots)")
    axes[0].set_ylabel("demand MiB streamed / generated token")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    app.run(main)
