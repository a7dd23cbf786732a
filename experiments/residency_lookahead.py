r"""The lookahead grid of `experiments.bench_residency --lookahead`: expert residency with and
without fetching ahead, on a model whose routing is trained (default: the research model).

For each budget (`residency.budget_for_fraction`), policy, `expert_lookahead` mode and
`expert_lookahead_buffer` size (0: fetched-ahead experts go to each layer's ring; > 0: to one buffer
shared by the layers, its bytes taken out of their slots; only with a predicting mode) one engine is
loaded; every engine is warmed up (compilation excluded), then `repeats` interleaved rounds each run
every engine once: a greedy generation of `new_tokens` from a held-out source prompt with MTP off,
then with MTP chain drafts (k = `draft_tokens`). Figures are for the decode phase (the prefill's
residency cost is cut off by a counter snapshot after the prefill) per generated token:

- hit_rate: resident (row, expert) pairs / all pairs (fetched-ahead experts count as resident);
- demand_mib_per_token: cold experts' MiB the layers waited for (streamed on demand + read by host
  computations; under static / frequency a decode row's misses are computed on the host, cold="auto");
- prefetch_mib_per_token (fetched ahead), moved_mib_per_token (demand + prefetch);
- host_computations_per_token; prefetch_useful / prefetch_useless; decode_tok_s (median, min / max).

The verdict compares, at `verdict_budget` with MTP on, the best configuration that fetches ahead (mode
!= "none", any buffer) with the best one that does not, on demand MiB per generated token (and prints
the ratio of all bytes moved beside it). Every configuration of a budget holds the same expert bytes. `recall_at_k` per layer: next-layer prediction's recall at top-k on the
prompt (`routing_stats.prediction`, the research figure).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from experiments.timing import interleaved, put_spread

MIB = 2.0 ** 20


def _decode_cost(engine, prompt: list[int], kw: dict) -> tuple[Any, dict]:
    """One generation; returns (its `GenerateOutput`, the residency stats of its decode phase: a counter
    snapshot is taken after the (last) trunk prefill call)."""
    rt = engine.runtime
    snaps = []
    prefill = rt.prefill

    def snap_after(*a, **k):
        out = prefill(*a, **k)
        snaps.append(engine.expert_counters())
        return out

    rt.prefill = snap_after
    try:
        out = engine.generate(prompt, **kw)
    finally:
        del rt.prefill
    dec = engine.residency.stats(snaps[-1], engine.expert_counters())
    return out, dec


def _figures(out, dec: dict) -> dict:
    """The figures of one run (`GenerateOutput` out) and its decode phase's residency stats."""
    n = max(1, len(out.tokens) - 1)  # tokens after the first (which the prefill's logits give)
    spec = out.stats.speculation
    return {
        "hit_rate": dec["hit_rate"],
        "demand_mib_per_token": dec["bytes_demand"] / MIB / n,
        "streamed_mib_per_token": dec["bytes_streamed"] / MIB / n,
        "host_mib_per_token": dec["host_bytes_read"] / MIB / n,
        "prefetch_mib_per_token": dec["bytes_prefetched"] / MIB / n,
        "moved_mib_per_token": dec["bytes_moved"] / MIB / n,
        "host_computations_per_token": dec["experts_host_computed"] / n,
        "prefetch_useful": float(dec["prefetch_useful"]),
        "prefetch_useless": float(dec["prefetch_useless"]),
        "decode_tok_s": float(out.stats.speed.decode_tok_s or 0.0),
        "acceptance_rate": float(0.0 if spec is None else spec.acceptance_rate),
        "generated_tokens": float(len(out.tokens)),
    }


def recall_per_layer(model, ids: list[int]) -> dict[int, float]:
    """Next-layer prediction's recall at top-k per MoE layer L >= 1 on one sequence."""
    from sharpi_jax.experts.routing_stats import prediction
    from sharpi_jax.runtime.routing import trace_routing

    tr = trace_routing(model, ids)
    sel = tr.selected
    return {i: prediction(tr.early[i], sel[i], tr.top_k)["recall"] for i in range(1, sel.shape[0])}


PREDICTING = ("next_layer", "both")  # the modes a lookahead buffer serves


def configurations(policies, modes, buffers) -> list[tuple[str, str, int]]:
    """(policy, mode, buffer) cells of the grid: a buffer > 0 only with a predicting mode."""
    return [(p, m, b) for p in policies for m in modes for b in buffers if b == 0 or m in PREDICTING]


def label(r: dict) -> str:
    """policy/mode, with +buffer<P> when the cell has a lookahead buffer."""
    b = r.get("expert_lookahead_buffer", 0)
    return f"{r['expert_policy']}/{r['expert_lookahead']}" + (f"+buffer{b}" if b else "")


def run_grid(path: Path, budgets, policies, modes, *, prompt_tokens: int, new_tokens: int, draft_tokens: int,
             repeats: int, max_context: int, emit: Callable[[dict], None], counts_out: Path,
             buffers=(0,)) -> list[dict]:
    import sharpi_jax as sj
    from experiments.presets import HELD_OUT_SOURCES, REPO_ROOT, release_compiled_code
    from sharpi_jax.experts import residency

    full = sj.load(path, max_context=max_context)
    c = full.config
    tok = full.tokenizer
    prompt = tok.encode((REPO_ROOT / HELD_OUT_SOURCES[0]).read_text())[:prompt_tokens]
    calib = tok.encode((REPO_ROOT / HELD_OUT_SOURCES[1]).read_text())[: min(512, max_context)]
    print(f"model {path} ({c.n_expert} experts, top-{c.n_expert_used}); prompt {len(prompt)} tokens of "
          f"{HELD_OUT_SOURCES[0]}, {new_tokens} new tokens, MTP k={draft_tokens}", flush=True)
    recall = recall_per_layer(full.model, prompt + full.generate(prompt, max_new_tokens=new_tokens).tokens)
    print("next-layer recall@%d per layer: %s" % (c.n_expert_used, ", ".join(
        f"L{i} {r:.3f}" for i, r in recall.items())), flush=True)
    emit({"bench": "residency_lookahead_recall", "model": path.stem, "top_k": c.n_expert_used,
          "recall_at_k": {str(i): r for i, r in recall.items()}})
    f = full.gguf
    del full
    cal = sj.load(path, max_context=max_context, expert_budget=residency.budget_for_fraction(f, c, 1.0))
    counts = cal.calibrate_experts([calib], save=counts_out)  # frequency's counts (and lru's first fill)
    del cal
    release_compiled_code()
    runs = {"off": dict(max_new_tokens=new_tokens, stop_on_eos=False),
            "mtp": dict(max_new_tokens=new_tokens, stop_on_eos=False, speculative="mtp", draft_tokens=draft_tokens)}
    records, t0 = [], time.perf_counter()
    for frac in budgets:
        budget = residency.budget_for_fraction(f, c, frac)
        cells = []
        for policy, mode, buf in configurations(policies, modes, buffers):
            e = sj.load(path, max_context=max_context, expert_budget=budget, expert_policy=policy,
                        expert_counts=counts, expert_lookahead=mode, expert_lookahead_buffer=buf or None)
            cells.append((dict(expert_budget_frac=frac, expert_budget=budget, expert_policy=policy,
                               expert_lookahead=mode, expert_lookahead_buffer=buf,
                               expert_device_bytes=e.residency.plan.device_bytes), e))

        def one(cell):
            return {m: _figures(*_decode_cost(cell[1], prompt, kw)) for m, kw in runs.items()}

        results = interleaved(cells, one, repeats, warm=lambda cell: [cell[1].generate(prompt, **dict(
            kw, max_new_tokens=4)) for kw in runs.values()], log=lambda m: print(m, flush=True), what="engines")
        for (fields, _), rounds in zip(cells, results):
            for m in runs:
                r = dict(fields, bench="residency_lookahead", model=path.stem, mtp=m == "mtp",
                         draft_tokens=draft_tokens if m == "mtp" else 0, repeats=repeats)
                for key in rounds[0][m]:
                    put_spread(r, key, [x[m][key] for x in rounds], runs=key == "decode_tok_s")
                records.append(r)
                emit(r)
        del cells, e
        release_compiled_code()
        print(f"  budget {frac:g} done ({time.perf_counter() - t0:.0f}s)", flush=True)
    return records


def verdict(records: list[dict], budget: float, limit: float = 0.6, mtp: bool = True) -> str:
    """At `budget` with MTP on (the issue's check; mtp=False: the same comparison without MTP): the best
    fetching-ahead configuration vs the best without, on demand MiB per generated token (what layers
    wait for), and all bytes moved beside it."""
    cell = [r for r in records if r.get("bench") == "residency_lookahead" and r["mtp"] == mtp
            and abs(r["expert_budget_frac"] - budget) < 1e-9]
    ahead = [r for r in cell if r["expert_lookahead"] != "none"]
    plain = [r for r in cell if r["expert_lookahead"] == "none"]
    if not ahead or not plain:
        return f"verdict: no records at budget {budget:g} (mtp={mtp}) both with and without lookahead"
    best = min(ahead, key=lambda r: r["demand_mib_per_token"])
    base = min(plain, key=lambda r: r["demand_mib_per_token"])
    def over(key: str) -> float:
        return best[key] / base[key] if base[key] else float("inf")

    ratio, moved = over("demand_mib_per_token"), over("moved_mib_per_token")
    ok = ("PASS" if ratio <= limit else "FAIL") if mtp else "(MTP off, no bar)"
    what = f"k={best['draft_tokens']}" if mtp else "off"
    return (f"verdict {ok}: budget {budget:.0%}, MTP {what}: best with lookahead "
            f"{label(best)} {best['demand_mib_per_token']:.3f} demand MiB per "
            f"generated token vs best without {base['expert_policy']} {base['demand_mib_per_token']:.3f}: "
            f"{ratio:.2f}x{f' (bar <= {limit}x)' if mtp else ''}; all bytes moved (prefetch included) {moved:.2f}x")


def plot(records: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = [r for r in records if r.get("bench") == "residency_lookahead"]
    policies = sorted({r["expert_policy"] for r in grid})
    modes = ["none", "next_layer", "pass", "both"]
    styles = dict(zip(modes, ["-", "--", ":", "-."]))
    buffers = sorted({r.get("expert_lookahead_buffer", 0) for r in grid})
    colors = dict(zip(policies, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    for row, mtp in enumerate((False, True)):
        for col, key in enumerate(("demand_mib_per_token", "hit_rate")):
            ax = axes[row][col]
            for p in policies:
                for m in modes:
                    for b, marker in zip(buffers, "osD^v"):
                        pts = sorted((r["expert_budget_frac"], r[key]) for r in grid
                                     if r["mtp"] == mtp and r["expert_policy"] == p and r["expert_lookahead"] == m
                                     and r.get("expert_lookahead_buffer", 0) == b)
                        if pts:
                            ax.plot(*zip(*pts), styles[m], color=colors[p], marker=marker, ms=3,
                                    label=f"{p} / {m}" + (f" +buffer{b}" if b else ""))
            ax.set_title(f"{key} (MTP {'k=3' if mtp else 'off'})")
            ax.set_xlabel("expert budget (share of routed expert bytes)")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6, ncol=2)
    fig.suptitle(f"expert lookahead on {grid[0]['model'] if grid else '?'}: policy (colour) x mode (line) x "
                 "lookahead buffer (marker)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def summary(records: list[dict]) -> None:
    """One line per (budget, MTP, policy, mode): the figures the verdict and the figure use."""
    for r in records:
        if r.get("bench") != "residency_lookahead":
            continue
        print(json.dumps({k: (round(r[k], 4) if isinstance(r[k], float) else r[k]) for k in (
            "expert_budget_frac", "mtp", "expert_policy", "expert_lookahead", "expert_lookahead_buffer", "hit_rate",
            "demand_mib_per_token", "prefetch_mib_per_token", "moved_mib_per_token", "host_computations_per_token", "prefetch_useful", "prefetch_useless",
            "decode_tok_s", "decode_tok_s_min", "decode_tok_s_max")}), flush=True)

