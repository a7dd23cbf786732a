"""Every `python -m experiments.<name>` entry point, run as a user would with tiny flags, on the embedded
default model (no fixtures needed): it parses its flags, finishes, and prints / writes what it says.
Timings are never asserted; only that the figures and their spread are there and consistent.

The README's main command (the generation part, with --compare) runs here exactly as written.

The runs are subprocesses dominated by single-threaded XLA compilation. They start when collection ends
(`start_background`, `tests.background`), longest first, beside the rest of the suite on the core the
main process leaves idle; this module's tests run last and each checks its own run.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from sharpi_jax.gguf import GGUFFile, read_model_config
from tests import background
from tests.conftest import FIXTURES
from tests.experiments.entry_point import REPO_ROOT, jsonl, ok, own_lines, run_entry_point


def readme_main_command() -> list[str]:
    """The arguments of `python -m experiments.generate ...` in the README's first command."""
    text = (REPO_ROOT / "README.md").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("python3 -m pip install"))
    gen = next(part for part in line.split("&&") if "experiments.generate" in part)
    argv = shlex.split(gen)
    assert argv[:3] == ["python", "-m", "experiments.generate"], argv
    return argv[3:]


def _train_preset(tmp):
    """The shipped training preset with a 1-layer (attention) + MTP model: a third of the compile time
    of the 4-layer one (the training graph itself is tested in tests/training)."""
    preset = json.loads((REPO_ROOT / "configs" / "train" / "tiny.json").read_text())
    preset["model"].update(n_layer=1, full_attention_interval=1)
    (tmp / "tiny1.json").write_text(json.dumps(preset))
    return tmp / "tiny1.json"


def _research_preset(tmp):
    """The research preset (64 experts top-8) with a 1-layer (attention) trunk, as `_train_preset`."""
    preset = json.loads((REPO_ROOT / "configs" / "train" / "research.json").read_text())
    preset["model"].update(n_layer=1, full_attention_interval=1)
    (tmp / "research1.json").write_text(json.dumps(preset))
    return tmp / "research1.json"


# test name -> (entry point, tmp dir -> argv), longest first (they start in this order).
COMMANDS = {
    "test_train_tiny": ("train_tiny", lambda t: [
        f"--config={_train_preset(t)}", "--steps=2", "--batch_size=2", "--seq_len=32", "--byte_budget=150000",
        "--sample_tokens=4", f"--out_dir={t / 'train'}"]),
    "test_readme_main_command_compares_mtp_off_and_on": ("generate", lambda t: readme_main_command()),
    "test_bench_verify": ("bench_verify", lambda t: [
        "--model=default", "--ks=1", "--repeats=2", "--new_tokens=8", "--max_context=64", "--tree_nodes=2",
        "--pass_widths=1,2", "--p_mins=0.5", "--verify_heads=full", "--draft_vocab=512",
        f"--json_out={t / 'verify.jsonl'}"]),
    "test_generate_tree": ("generate", lambda t: [
        "--speculative=mtp_tree", "--draft_tokens=2", "--tree_nodes=4", "--max_new_tokens=8", "--max_context=64",
        "--json"]),
    "test_bench_residency": ("bench_residency", lambda t: [
        "--model=default", "--budgets=0.5", "--policies=static", "--repeats=2", "--nobaseline", "--prompt_tokens=8",
        "--decode_tokens=3", "--max_context=32", "--prefill_buckets=8", "--threshold", "--threshold_rows=2",
        "--threshold_repeats=2", f"--out={t / 'res.jsonl'}", f"--plot_dir={t / 'plots'}"]),
    "test_bench_residency_lookahead": ("bench_residency", lambda t: [
        "--lookahead", "--model=default", "--budgets=0.5", "--policies=lru", "--lookahead_modes=none,next_layer",
        "--verdict_budget=0.5", "--repeats=2", "--prompt_tokens=8", "--new_tokens=6", "--max_context=64",
        f"--out={t / 'la.jsonl'}",
        f"--plot_dir={t / 'plots'}"]),
    "test_sweep_command_on_the_shipped_smoke_config": ("sweep", lambda t: [
        "--config=configs/sweeps/smoke.json", f"--out={t / 'smoke.jsonl'}", "--repeats=2"]),
    "test_bench_decode": ("bench_decode", lambda t: [
        "--models=default", "--prompt_tokens=12", "--decode_tokens=4", "--repeats=2", "--max_context=64",
        "--widths=2,3", "--width_threads=1", f"--jsonl={t / 'decode.jsonl'}"]),
    "test_bench_decode_isa_of_another_backend": ("bench_decode", lambda t: [
        "--models=default", "--kernels=xla:avx2", "--repeats=1"]),
    "test_bench_expert_parallel": ("bench_expert_parallel", lambda t: [
        "--devices=1,2", "--repeats=2", "--prompt_tokens=8", "--decode_tokens=3", "--max_context=32",
        f"--json_out={t / 'ep.jsonl'}"]),
    "test_generate_expert_parallel": ("generate", lambda t: [
        "--expert_parallel=2", "--max_new_tokens=4", "--max_context=32", "--json"]),
    "test_bench_moe": ("bench_moe", lambda t: [
        "--sizes=1,8", "--qtype=q8_0", "--n_expert=16", "--top_k=4", "--d_ff=32", "--d_model=64", "--repeats=2",
        f"--json_out={t / 'moe.jsonl'}"]),
    "test_snapkv_quality": ("snapkv_quality", lambda t: [
        "--models=default", "--budgets=40,400", "--kv_window=8", "--kv_pool=3", "--new_tokens=6",
        "--prompt_tokens=64", "--mtp_k=0", "--max_context=96", f"--out={t / 'snap.jsonl'}",
        f"--plot_dir={t / 'plots'}"]),
    "test_draft_vocab_quality": ("draft_vocab_quality", lambda t: [
        "--models=default", "--sizes=64", "--eval_files=2", "--eval_windows=1", "--eval_tokens=12",
        "--calibration_files=2", "--calibration_windows=2", "--calibration_tokens=16", "--generate_tokens=4",
        "--new_tokens=6", "--max_context=96", "--oracle", "--batch=3", f"--out={t / 'dv.json'}"]),
    "test_generate_draft_vocab_compare": ("generate", lambda t: [
        "--speculative=mtp", "--draft_vocab=256", "--compare", "--nocompare_tree", "--repeats=1",
        "--max_new_tokens=8", "--max_context=64", "--json"]),
    "test_generate_snapkv_flags": ("generate", lambda t: [
        "--kv_policy=snapkv", "--kv_budget=8", "--kv_window=4", "--kv_pool=3", "--max_new_tokens=4",
        "--max_context=64", "--speculative=mtp", "--draft_tokens=2", "--json",
        "--prompt=def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)"]),
    "test_generate_snapkv_bad_budget": ("generate", lambda t: ["--kv_policy=snapkv", "--kv_budget=4", "--kv_window=8"]),
    "test_research_model": ("research_model", lambda t: [
        f"--config={_research_preset(t)}",
        "--train_flags=--steps=2,--batch_size=2,--seq_len=32,--byte_budget=150000,--sample_tokens=0"]),
    "test_routing_stats": ("routing_stats", lambda t: [
        "--model=default", "--tokens=40", "--sequences=2", "--drafts=2", f"--out_dir={t / 'routing'}"]),
    "test_residency_sim": ("residency_sim", lambda t: [
        "--model=default", "--tokens=40", "--budgets=0.25,0.5", "--key_budget=0.25", "--drafts=2",
        f"--out_dir={t / 'sim'}"]),
    "test_gpu_check_without_a_gpu_says_so_in_one_line": ("gpu_check", lambda t: []),
    "test_bench_ggml": ("bench_ggml", lambda t: [
        "--parts=matmul,experts", "--sizes=1,2", "--copies=2", "--n_expert=8", "--repeats=2",
        f"--json_out={t / 'ggml.jsonl'}"]),
    "test_info": ("info", lambda t: ["--json"]),
    "test_info_text": ("info", lambda t: []),
    "test_write_synthetic": ("write_synthetic", lambda t: ["--preset=tiny", "--n_layer=2", f"--out={t / 's.gguf'}"]),
    "test_twin": ("twin", lambda t: ["--source=default", "--shape=tiny", "--n_layer=6", "--n_vocab=2100",
                                     f"--out={t / 'twin.gguf'}"]),
    "test_generate_compare_needs_mtp": ("generate", lambda t: ["--compare"]),
    "test_perplexity": ("perplexity", lambda t: [
        "--gguf=default", "--reference=sharpi_jax/assets/default-F32.gguf", "--ctx=32", "--chunks=4", "--batch=4",
        "--buckets=3", f"--out={t / 'ppl.json'}"]),
    "test_perplexity_bad_corpus": ("perplexity", lambda t: ["--corpus=nope"]),
    "test_bench_batch": ("bench_batch", lambda t: [
        "--batches=1,2", "--prompt_tokens=8", "--decode_tokens=3", "--repeats=1", f"--json_out={t / 'batch.json'}"]),
    "test_bench_session": ("bench_session", lambda t: [
        "--first=300", "--turn=10", "--turns=1", "--reply=3", "--repeats=1", f"--json_out={t / 'session.json'}"]),
    "test_profile_step": ("profile_step", lambda t: [
        "--rows=3", "--steps=2", "--prompt_tokens=8", "--max_context=64", f"--json_out={t / 'prof.json'}"]),
    "test_profile_step_past_the_context": ("profile_step", lambda t: ["--rows=300"]),
    "test_profile_step_prefill": ("profile_step", lambda t: [
        "--prefill=32", "--steps=2", "--prompt_tokens=8", "--max_context=64", f"--json_out={t / 'prof.json'}"]),
    "test_profile_step_prefill_of_two_chunks": ("profile_step", lambda t: ["--prefill=40"]),
    "test_profile_step_generation": ("profile_step", lambda t: [
        "--generate=10", "--speculative=mtp", "--draft_tokens=2", "--steps=2", "--prompt_tokens=8",
        "--max_context=64", f"--json_out={t / 'prof.json'}"]),
    "test_profile_step_generation_past_the_context": ("profile_step", lambda t: ["--generate=250"]),
    "test_profile_step_generation_of_one_token": ("profile_step", lambda t: ["--generate=1"]),
    "test_behaviour_hashes_flags_a_changed_hash": ("behaviour_hashes", lambda t: [
        "--only=logits", "--files=tiny-qwen35moe-F32", f"--out={t / 'after.json'}", f"--compare={_before(t)}"]),
}


def _before(tmp):
    """A 'before' file whose logits hash is wrong and whose mtp_logits hash is absent."""
    (tmp / "before.json").write_text(json.dumps({"logits/tiny-qwen35moe-F32": "0" * 64}))
    return tmp / "before.json"


_TMP: dict[str, Path] = {}  # test name -> the tmp dir of its run (`start_background`)


def start_background(session, items) -> None:
    """Start the selected tests' runs (`tests.background`, longest first); called by conftest.py once
    collection ends, so the runs go on beside the rest of the suite."""
    selected = {item.originalname for item in items}
    factory = session.config._tmp_path_factory  # what the tmp_path_factory fixture returns
    for test, (name, argv) in COMMANDS.items():
        if test in selected:
            tmp = _TMP[test] = factory.mktemp(test[5:35])
            background.submit(("entry_point", test), run_entry_point, name, *argv(tmp), cache=tmp / "cache",
                              timeout=900)


@pytest.fixture(scope="module")
def runs():
    """{test name: its run's tmp dir} for the selected tests of this module (started by conftest.py)."""
    return _TMP


def result(runs, request):
    """(tmp dir, CompletedProcess) of the calling test's command."""
    test = request.node.originalname
    return runs[test], background.result(("entry_point", test))


def _check_spread(rec: dict, key: str, rounds: int | None = None) -> None:
    assert rec[f"{key}_min"] <= rec[key] <= rec[f"{key}_max"], (key, rec)
    if rounds is not None:
        runs = rec[f"{key}_runs"]
        assert len(runs) == rounds and min(runs) == rec[f"{key}_min"] and max(runs) == rec[f"{key}_max"]


def test_readme_main_command_compares_mtp_off_and_on(runs, request):
    args = readme_main_command()
    assert "--speculative=mtp" in args and "--compare" in args
    _, res = result(runs, request)
    ok(res)
    assert res.stdout.startswith("def fibonacci(n):\n") and len(res.stdout) > len("def fibonacci(n):\n") + 20
    err = "\n".join(own_lines(res.stderr))
    n = int(re.search(r"--max_new_tokens=(\d+)", " ".join(args))[1])
    assert f"{n} generated" in err and "timings include jit compilation" not in err
    assert re.search(r"\[MTP k=3 \(batched verify\): \d+/\d+ drafts accepted", err)
    m = re.search(r"\[compare \(warm, median \[min-max\] of (\d+) interleaved rounds.*MTP off ([\d.]+) "
                  r"\[([\d.]+)-([\d.]+)\] decode tok/s; MTP k=3 \(batched verify\) ([\d.]+) \[([\d.]+)-([\d.]+)\] "
                  r"decode tok/s; MTP / off = ([\d.]+)x: MTP is (faster|SLOWER) than MTP off", err)
    assert m, err
    off, off_lo, off_hi, mtp, mtp_lo, mtp_hi, ratio = (float(m[i]) for i in range(2, 9))
    assert int(m[1]) >= 1 and off_lo <= off <= off_hi and mtp_lo <= mtp <= mtp_hi and off > 0 and mtp > 0
    assert ratio == pytest.approx(mtp / off, rel=0.02, abs=0.01)
    if abs(ratio - 1) > 0.005:  # the verdict follows the (unrounded) ratio
        assert (m[9] == "faster") == (ratio > 1)
    assert "same tokens: yes" in err


def test_generate_compare_needs_mtp(runs, request):
    _, res = result(runs, request)
    assert res.returncode == 2 and res.stdout == ""
    assert own_lines(res.stderr) == ["error: --compare times MTP off against MTP: add --speculative=mtp"]


def test_snapkv_quality(runs, request):
    """The SnapKV quality sweep: one record per budget below the prompt (400 is skipped) and the figure.
    (--mtp_k=0 keeps it short: MTP on evicted caches is tested in tests/runtime/test_snapkv.py.)"""
    tmp, res = result(runs, request)
    assert "wrote 1 records" in ok(res).stdout
    (r,) = jsonl(tmp / "snap.jsonl")
    assert r["kv_budget"] == 40 and r["prompt_tokens"] == 64 and r["kv_evicted"] == 24
    assert 0 <= r["agreement"] <= 1 and r["rel_l2"] >= 0 and 0 <= r["first_divergence"] <= 6
    assert (tmp / "plots" / "snapkv_quality_vs_budget.png").stat().st_size > 5000


def test_draft_vocab_quality(runs, request):
    """Both evaluation sets, each with the full head and draft_vocab=64 under the fallback, calibrated and
    oracle rankings; lossless everywhere; the gap is relative to the full head's rate; the calibration
    ran on a private copy (nothing written beside the embedded model)."""
    from sharpi_jax.assets import DEFAULT_MODEL
    from sharpi_jax.runtime.draft_vocab import vocab_paths

    shipped = vocab_paths(DEFAULT_MODEL)[0]
    before = shipped.stat().st_mtime_ns if shipped.exists() else None
    tmp, res = result(runs, request)
    assert "installed" not in ok(res).stdout and "rel. gap" in res.stdout
    (rec,) = json.loads((tmp / "dv.json").read_text())["records"]
    assert rec["sets"] == {"repo": 4 + 6, "stdlib": 2} and rec["calibration"]["windows"] == 4 and rec["batch"] == 3
    assert rec["calibration"]["drafts_counted"] > 0
    for rows in rec["results"].values():
        assert set(rows) == {"full", "64 fallback", "64 calibrated", "64 oracle"}
        full = rows["full"]["acceptance_rate"]
        for r in rows.values():
            assert r["same_tokens"] and r["drafted"] > 0 and r["acceptance_rate"] == r["accepted"] / r["drafted"]
            assert r["relative_gap"] == pytest.approx((full - r["acceptance_rate"]) / full)
    assert (shipped.stat().st_mtime_ns if shipped.exists() else None) == before


def test_generate_draft_vocab_compare(runs, request):
    """--draft_vocab=N: the chain drafts over the shipped ranking's N ids, MTP off beside it without one,
    the tokens identical."""
    from sharpi_jax.assets import DEFAULT_MODEL
    from sharpi_jax.runtime.draft_vocab import vocab_paths

    _, res = result(runs, request)
    out = json.loads(ok(res).stdout.strip().splitlines()[-1])
    s, c = out["stats"], out["compare"]
    assert s["draft_vocab"] == 256 and s["draft_vocab_ranking"] == str(vocab_paths(DEFAULT_MODEL)[0])
    assert c["same_tokens"] and s["drafted"] > 0 and "tree" not in c


def test_generate_snapkv_flags(runs, request):
    """--kv_policy=snapkv with MTP: the prompt is evicted down to the budget; stats say so."""
    _, res = result(runs, request)
    s = json.loads(ok(res).stdout.strip().splitlines()[-1])["stats"]
    assert s["kv_evicted"] == s["prompt_tokens"] - 8 > 0 and s["kv_capacity"] == 8 + 4
    assert s["kv_slots"] <= s["kv_capacity"] and s["generated_tokens"] == 4


def test_generate_snapkv_bad_budget(runs, request):
    """A budget below the window is a clear error, not a traceback."""
    _, res = result(runs, request)
    assert res.returncode == 2 and "kv_budget (4) must be at least kv_window (8)" in res.stderr


def test_info(runs, request):
    _, res = result(runs, request)
    d = json.loads(ok(res).stdout)
    assert d["config"]["arch"] == "qwen35moe" and d["n_layer_trunk"] == 4 and d["tensor_count"] > 0
    assert d["expert_bytes"] > 0 and d["non_expert_bytes"] > 0 and d["file_bytes"] > d["expert_bytes"]


def test_info_text(runs, request):
    _, res = result(runs, request)
    for section in ("== config ==", "== tensors by type ==", "== weight bytes ==", "routed experts"):
        assert section in ok(res).stdout


def test_write_synthetic(runs, request):
    tmp, res = result(runs, request)
    out = tmp / "s.gguf"
    assert f"wrote {out}" in ok(res).stdout
    with GGUFFile(out) as f:
        c = read_model_config(f)
        assert c.n_layer == 2 and c.arch == "qwen35moe" and len(f.tensors) > 10


def test_twin(runs, request):
    tmp, res = result(runs, request)
    out = tmp / "twin.gguf"
    assert f"wrote {out}" in ok(res).stdout
    with GGUFFile(out) as f:
        c = read_model_config(f)
        assert (c.n_layer, c.n_vocab, c.n_expert) == (6, 2100, 16)
        assert len(f.metadata["tokenizer.ggml.tokens"]) == 2100


def test_bench_batch(runs, request):
    tmp, res = result(runs, request)
    assert "speculative=off: aggregate decode tok/s" in ok(res).stdout
    recs = json.loads((tmp / "batch.json").read_text())["records"]
    assert [r["B"] for r in recs] == [1, 2] and all(r["ours_median"] > 0 for r in recs)


def test_bench_session(runs, request):
    """Turn 1 prefills only what follows the kept state (the bucket boundary at 256) and gives the fresh
    generate's tokens."""
    tmp, res = result(runs, request)
    ok(res)
    recs = json.loads((tmp / "session.json").read_text())
    assert [(r["tokens"], r["prefilled"]) for r in recs] == [(300, 300), (313, 313 - 256)]
    assert all(r["same_tokens"] for r in recs)


def _profiled(runs, request, heading: str, rows: int) -> dict:
    """profile_step's record: the heading printed, 2 profiled steps, the ggml products of `rows` rows named
    by their shapes."""
    tmp, res = result(runs, request)
    assert heading in ok(res).stdout
    rec = json.loads((tmp / "prof.json").read_text())
    assert rec["rows"] == rows and len(rec["wall_ms"]) == 2 and 0 < rec["ops_ms"]
    ops = [r["op"] for r in rec["table"]]
    assert any(op.startswith(f"ggml matmul [{rows} x ") for op in ops), ops
    assert any(op.startswith(f"ggml experts [{rows} x ") for op in ops), ops
    return rec


def test_bench_decode_isa_of_another_backend(runs, request):
    """An instruction set names the ggml backend's kernels only: --kernels=xla:avx2 is one line, exit 2."""
    _, res = result(runs, request)
    assert res.returncode == 2 and res.stdout == ""
    assert own_lines(res.stderr) == [
        "error: --kernels=xla:avx2: an instruction set applies to the ggml backend only (ggml:avx2)"]


def test_profile_step(runs, request):
    """A verify pass of 3 rows: its ops' self times, the ggml products named by their shapes (3 rows)."""
    assert not _profiled(runs, request, "verify pass of 3 rows", 3)["prefill"]


def test_profile_step_past_the_context(runs, request):
    _, res = result(runs, request)
    assert res.returncode == 2 and res.stdout == ""
    assert own_lines(res.stderr) == ["error: --prompt_tokens + --rows (332) exceed --max_context (256)"]


def test_profile_step_prefill(runs, request):
    """A prefill chunk of 32 rows: the ggml products of its 32 rows, named by their shapes."""
    assert _profiled(runs, request, "prefill of 32 rows", 32)["prefill"]


def test_profile_step_prefill_of_two_chunks(runs, request):
    _, res = result(runs, request)
    assert res.returncode == 2 and res.stdout == ""
    assert own_lines(res.stderr) == ["error: --prefill=40 is 2 chunks (buckets (32, 128, 256)); pick a bucket size"]


def test_profile_step_generation(runs, request):
    """Whole device-loop generations of the chain (k = 2): per verify pass, its 3-row trunk products,
    expert op and native GDN rows named by their shapes, and the passes' count."""
    tmp, res = result(runs, request)
    assert "device-loop generations of 10 tokens, MTP chain k=2" in ok(res).stdout
    rec = json.loads((tmp / "prof.json").read_text())
    assert rec["unit"] == "verify pass" and len(rec["wall_ms"]) == 2 and 0 < rec["ops_ms"]
    assert 9 / 3 <= rec["passes"] <= 9  # the loop's 9 tokens (the prefill gives the first), 1..3 a pass
    ops = [r["op"] for r in rec["table"]]
    assert any(op.startswith("ggml matmul [3 x ") for op in ops), ops
    assert any(op.startswith("ggml experts [3 x ") for op in ops), ops
    assert any(op.startswith("gdn rows [3 x ") for op in ops), ops


def test_profile_step_generation_past_the_context(runs, request):
    _, res = result(runs, request)
    assert res.returncode == 2 and res.stdout == ""
    assert own_lines(res.stderr) == ["error: --prompt_tokens + --generate (282) exceed --max_context (256)"]


def test_profile_step_generation_of_one_token(runs, request):
    """One token is the prefill's alone (no loop step to profile): a one-line error, exit 2."""
    _, res = result(runs, request)
    assert res.returncode == 2 and res.stdout == ""
    assert own_lines(res.stderr) == ["error: --generate must be 0 (single steps) or at least 2 tokens"]


def test_gpu_check_without_a_gpu_says_so_in_one_line(runs, request):
    """Here (no GPU): one line saying so, exit 0, and nothing written (no slice without a GPU)."""
    tmp, res = result(runs, request)
    lines = [ln for ln in ok(res).stdout.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no GPU here (JAX backend 'cpu')")
    assert not (tmp / "cache").exists()


def test_bench_decode(runs, request):
    tmp, res = result(runs, request)
    assert "median [min-max] of 2 warm interleaved rounds" in ok(res).stdout
    recs = jsonl(tmp / "decode.jsonl")
    widths, recs = [r for r in recs if r.get("widths")], [r for r in recs if not r.get("widths")]
    # --widths: w = 1 (the decode step) is always timed; one record per kernels x w, 1 core for ours.
    assert [(r["kernels"], r["rows"], r["threads"]) for r in widths] == [
        (k, w, 1) for k in ("ggml", "xla") for w in (1, 2, 3)]
    for r in widths:
        _check_spread(r, "pass_ms", rounds=2)
        _check_spread(r, "pass_head1_ms", rounds=2)
        assert 1 <= r["experts_per_pass"] <= r["rows"] * 4  # the default model routes top-4 of 16
        assert "llama_error" in r  # no --llama_bin here
    assert widths[0]["pass_over_decode"] == 1.0 and widths[2]["experts_per_pass"] >= widths[0]["experts_per_pass"]
    assert widths[0]["pass_head1_over_decode"] == 1.0  # w = 1: the decode step itself
    assert "one trunk pass of w rows (different tokens per row)" in res.stdout
    assert [r["kernels"] for r in recs] == ["ggml", "xla"]  # the default --kernels, side by side
    assert "copy bandwidth" in res.stdout and all(r["copy_gb_s"] > 0 for r in recs)
    for rec in recs:
        assert rec["model"] == "default" and rec["prompt_tokens"] == 12 and rec["decode_tokens"] == 4
        assert re.search(rf"^default\s+{rec['kernels']}\s+[\d.]+ \[[\d.]+-[\d.]+\]\s+[\d.]+ \[[\d.]+-[\d.]+\]",
                         res.stdout, re.M)
        for key in ("prefill_tok_s", "decode_tok_s", "cpu_s_per_call"):
            _check_spread(rec, key, rounds=2)
    assert recs[0]["rss_anon_gib"] > 0  # RssAnon after each load + warm-up; the second adds to the first's
    assert abs(recs[1]["rss_anon_gib"] - recs[0]["rss_anon_gib"] - recs[1]["rss_anon_added_gib"]) < 1e-9


def test_bench_verify(runs, request):
    tmp, res = result(runs, request)
    assert "round 2/2" in ok(res).stdout and "MTP off:" in res.stdout
    recs = jsonl(tmp / "verify.jsonl")
    best = recs.pop()["best"]  # the last record: the fastest lossless device-loop setting
    passes, steps, recs = recs[:2], recs[2:4], recs[4:]
    assert [r["rows"] for r in passes] == [1, 2] and "one trunk pass of w rows" in res.stdout
    assert [r["draft_vocab"] for r in steps] == [None, 512] and steps[1]["vs_full"] > 0  # one draft step each
    spec = [r for r in recs if r.get("loop") == "device" and r.get("speculative")]
    top = max(spec, key=lambda r: r["decode_tok_s"])
    off = next(r for r in recs if r.get("loop") == "device" and not r.get("speculative"))
    assert best["decode_tok_s"] == top["decode_tok_s"]
    assert best["speedup"] == top["decode_tok_s"] / off["decode_tok_s"]
    assert best["setting"].startswith("chain k=1" if top["speculative"] == "mtp" else "tree k=1 nodes=2")
    assert f"best lossless setting: {best['setting']}, " in res.stdout
    for r in passes:
        for key in ("decode_ms", "chain_ms", "chain_head1_ms", "tree_ms"):
            _check_spread(r, key, rounds=2)
        assert 1 <= r["experts_per_pass"] <= 4 * r["rows"]  # distinct experts the rows read, per layer
    # after the chain and tree rows: the chain and the tree with --draft_vocab, the --p_mins rows (full head, then
    # the draft vocabulary), then --verify_heads
    dv, tdv, pm, vh, recs = recs[7:8], recs[8:9], recs[9:11], recs[11:], recs[:7]
    assert [(r["draft_tokens"], r["verify"], r.get("loop")) for r in recs] == [
        (0, None, "host"), (0, None, "device"), (1, "sequential", "host"), (1, "batched", "host"),
        (1, "batched", "device"), (1, "batched", "host"), (1, "batched", "device")]
    for r in recs:
        _check_spread(r, "decode_tok_s", rounds=2)
        assert r.get("same_tokens_as_off", True) is True
    assert all(0 <= r["acceptance_rate"] <= 1 and len(r["accept_per_position"]) == 1 for r in recs[2:5])
    assert recs[2]["accepted"] == recs[3]["accepted"] == recs[4]["accepted"]  # same passes on both loops
    assert "dev/host" in res.stdout
    for tree in recs[5:7]:
        assert tree["speculative"] == "mtp_tree" and tree["tree_nodes"] == 2 and len(tree["accept_per_depth"]) == 1
    assert recs[5]["accepted"] == recs[6]["accepted"] and "draft_s" in recs[5]  # same passes on both loops
    for r in recs[2:] + pm + dv + tdv:  # distinct experts a pass's rows read per layer (top-4 routing, <= k + 1 rows)
        assert 4 <= r["experts_per_pass"] <= 4 * (r["draft_tokens"] + 1 if r["speculative"] == "mtp" else 3)
    assert "experts/pass" in res.stdout and "accept by position" in res.stdout
    assert [(r["draft_tokens"], r["draft_p_min"], r.get("draft_vocab")) for r in pm] == [(1, 0.5, None), (1, 0.5, 512)]
    assert all(r["same_tokens_as_off"] and 0 <= r["drafts_per_pass"] <= 1 for r in pm) and "p_min rows" in res.stdout
    assert [(r["speculative"], r["draft_tokens"], r["draft_vocab"]) for r in dv] == [("mtp", 1, 512)]
    assert [(r["speculative"], r["draft_tokens"], r["tree_nodes"], r["draft_vocab"]) for r in tdv] == [
        ("mtp_tree", 1, 2, 512)]
    assert dv[0]["same_tokens_as_off"] and tdv[0]["same_tokens_as_off"] and len(tdv[0]["accept_per_depth"]) == 1
    assert "draft_vocab rows" in res.stdout and "tree draft_vocab rows" in res.stdout
    assert "tree/chain" in res.stdout
    own = "full up to 4 rows, lazy above"  # the default's own mode
    assert f"verify head {own};" in res.stdout and "verify-head rows" in res.stdout  # then full
    assert [(r["speculative"], r["verify_head"]) for r in vh] == [("mtp", "full"), ("mtp_tree", "full")]
    assert all(r["same_tokens_as_off"] and r["vs_own_head"] > 0 for r in vh)
    assert vh[0]["accepted"] == recs[4]["accepted"] and vh[1]["accepted"] == recs[6]["accepted"]  # same passes


def test_generate_tree(runs, request):
    _, res = result(runs, request)
    d = json.loads(ok(res).stdout)
    s = d["stats"]
    assert len(d["tokens"]) == s["generated_tokens"] <= 8
    assert s["speculative"] == "mtp_tree" and s["draft_tokens"] == 2 and s["tree_nodes"] == 4
    assert s["verify_passes"] >= 1 and len(s["accept_per_depth"]) == 2 and s["snapshot_bytes_per_node"] > 0


def test_bench_expert_parallel(runs, request):
    """N = 1, 2 forced host devices: each holds 1/N of the routed-expert bytes, all the dense bytes."""
    tmp, res = result(runs, request)
    assert "same tokens for every N: yes" in ok(res).stdout and "2 cpu devices" in res.stdout
    one, two = jsonl(tmp / "ep.jsonl")
    assert (one["expert_parallel"], two["expert_parallel"]) == (1, 2) and two["devices"] == ["cpu:0", "cpu:1"]
    assert two["expert_bytes_per_device"] == [one["expert_bytes_per_device"][0] // 2] * 2
    assert two["dense_bytes_per_device"] == one["dense_bytes_per_device"] * 2
    for rec in (one, two):
        assert re.search(rf"^\s+{rec['expert_parallel']}\s+[\d.]+\s+[\d.]+\s+[\d.]+ \[[\d.]+-[\d.]+\]", res.stdout, re.M)
        for key in ("prefill_tok_s", "decode_tok_s"):
            _check_spread(rec, key, rounds=2)


def test_generate_expert_parallel(runs, request):
    """--expert_parallel=2 on a 1-device CPU machine asks XLA for 2 host devices and runs."""
    _, res = result(runs, request)
    out = json.loads(ok(res).stdout)
    assert len(out["tokens"]) == 4 and out["expert_parallel"] == 2 and out["devices"] == ["cpu:0", "cpu:1"]


def test_bench_moe(runs, request):
    tmp, res = result(runs, request)
    assert "True" in ok(res).stdout  # the bitwise column
    recs = jsonl(tmp / "moe.jsonl")
    assert [(r["N"], r["kernels"]) for r in recs] == [(1, "ggml"), (1, "xla"), (8, "ggml"), (8, "xla")]
    assert "copy bandwidth" in res.stdout and "N = 1, grouped expert bytes streamed" in res.stdout
    for name in ("ggml", "xla"):  # the verdict is the records' medians, recomputed here
        wins = all(r["ms_grouped"] < r["ms_per_token"] for r in recs if r["kernels"] == name)
        assert re.search(rf"^{name}: grouped beats per-token \(median wall\) at every N: {'yes' if wins else 'no'}",
                         res.stdout, re.M)
    for r in recs:
        assert r["bitwise_equal"] is True and r["bytes_grouped"] == r["bytes_floor"] <= r["bytes_per_token"]
        assert r["grouped_gb_s"] > 0 and r["copy_gb_s"] > 0
        assert r["grouped_bytes_per_token"] == r["bytes_grouped"] / r["N"]
        for key in ("ms_per_token", "ms_grouped", "cpu_ms_per_token", "cpu_ms_grouped"):
            _check_spread(r, key, rounds=2)


def test_bench_ggml(runs, request):
    """ggml's kernels through the FFI, on the host and in ggml's own graph, on 35B-A3B expert shapes."""
    tmp, res = result(runs, request)
    ok(res)
    recs = jsonl(tmp / "ggml.jsonl")
    assert {r["engine"] for r in recs} >= {"ffi", "host", "graph", "grouped", "per_token"}
    assert {r["m"] for r in recs if "m" in r} == {1, 2}
    for r in recs:
        _check_spread(r, "ms", rounds=2)


@pytest.mark.slow  # ~150 s of engines; the lookahead itself is tested in tests/experts/test_lookahead.py
def test_bench_residency_lookahead(runs, request):
    """The lookahead grid on the default model: one budget, lru with and without next_layer (and with a
    lookahead buffer), MTP off / on."""
    tmp, res = result(runs, request)
    out = ok(res).stdout
    assert "next-layer recall@4 per layer: L1 " in out and ("verdict PASS" in out or "verdict FAIL" in out)
    recs = jsonl(tmp / "la.jsonl")
    (recall,) = [r for r in recs if r.get("bench") == "residency_lookahead_recall"]
    assert set(recall["recall_at_k"]) == {"1", "2", "3"} and all(0 <= v <= 1 for v in recall["recall_at_k"].values())
    grid = [r for r in recs if r.get("bench") == "residency_lookahead"]
    assert {(r["expert_lookahead"], r["mtp"]) for r in grid} == {(m, t) for m in ("none", "next_layer")
                                                                  for t in (False, True)}
    # --lookahead_buffers defaults to 0,24: next_layer also with a shared buffer; every cell holds the same bytes
    assert {(r["expert_lookahead"], r["expert_lookahead_buffer"]) for r in grid} == {
        ("none", 0), ("next_layer", 0), ("next_layer", 24)}
    assert len({r["expert_device_bytes"] for r in grid}) == 1
    for r in grid:
        assert 0 <= r["hit_rate"] <= 1 and r["repeats"] == 2
        _check_spread(r, "decode_tok_s", rounds=2)
        assert r["moved_mib_per_token"] == pytest.approx(r["demand_mib_per_token"] + r["prefetch_mib_per_token"])
        if r["expert_lookahead"] == "none":
            assert r["prefetch_mib_per_token"] == 0 and r["prefetch_useful"] == 0
        elif not r["mtp"]:
            assert r["prefetch_mib_per_token"] > 0 and r["prefetch_useful"] > 0
    assert (tmp / "plots" / "residency_lookahead.png").stat().st_size > 5000


def test_bench_residency(runs, request):
    """One budget cell (static: no calibration engine needed) and one threshold row, on the default model."""
    tmp, res = result(runs, request)
    assert "streaming is faster from N =" in ok(res).stdout and "budget 0.5 done" in res.stdout
    recs = jsonl(tmp / "res.jsonl")
    (thr,) = [r for r in recs if r.get("bench") == "residency_threshold"]
    assert thr["bitwise_equal"] is True and thr["N"] == 2 and thr["faster"] in ("stream", "host")
    for mode in ("stream", "host"):
        assert thr[f"{mode}_cpu_ms_min"] <= thr[f"{mode}_cpu_ms"] <= thr[f"{mode}_cpu_ms_max"]
    (r,) = [r for r in recs if "expert_policy" in r]
    assert r["expert_policy"] == "static" and r["expert_budget_frac"] == 0.5 and r["repeats"] == 2
    assert 0 <= r["hit_rate"] <= 1 and r["resident_bytes"] + r["staging_bytes"] <= r["expert_budget"]
    _check_spread(r, "decode_tok_s", rounds=2)
    _check_spread(r, "prefill_tok_s", rounds=2)
    assert (tmp / "plots" / "hit_rate_vs_budget.png").stat().st_size > 5000
    assert not list(tmp.glob("*.expert-counts.json"))  # static needs no calibration


def test_sweep_command_on_the_shipped_smoke_config(runs, request):
    tmp, res = result(runs, request)
    out = tmp / "smoke.jsonl"
    assert f"wrote 2 records to {out}" in ok(res).stdout and "round 2/2" in res.stdout
    recs = jsonl(out)
    assert sorted(r["temperature"] for r in recs) == [0.0, 0.8]
    for r in recs:
        assert r["sweep"] == "smoke" and r["repeats"] == 2 and r["generated_tokens"] <= 8
        _check_spread(r, "decode_tok_s", rounds=2)
        _check_spread(r, "prefill_tok_s", rounds=2)


def test_train_tiny(runs, request):
    """Two steps of the preset's recipe on a 1-layer + MTP variant of its model, exported and sampled."""
    tmp, res = result(runs, request)
    assert "trained 2 steps" in ok(res).stdout and "--- greedy sample" in res.stdout and "quick run" not in res.stdout
    out = tmp / "train"
    assert {p.name for p in out.iterdir()} >= {"tiny-trained-F32.gguf", "tiny-trained-Q8_0.gguf", "train_log.jsonl",
                                               "summary.json"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["train"]["steps"] == 2
    with GGUFFile(out / "tiny-trained-Q8_0.gguf") as f:
        c = read_model_config(f)
        assert c.has_mtp and c.n_layer == 1


def test_behaviour_hashes_flags_a_changed_hash(runs, request):
    """The refactor guard exits 1 and names the behaviour whose bytes changed (fixtures needed)."""
    fixture = FIXTURES / "tiny-qwen35moe" / "tiny-qwen35moe-F32.gguf"
    if not fixture.is_file():
        pytest.skip(f"fixture absent: {fixture}")
    tmp, res = result(runs, request)
    assert res.returncode == 1, res.stderr[-2000:]
    assert "1 equal" not in res.stdout and "0 equal, 1 different" in res.stdout
    assert "DIFFERENT logits/tiny-qwen35moe-F32" in res.stdout
    after = json.loads((tmp / "after.json").read_text())
    assert set(after) == {"logits/tiny-qwen35moe-F32", "mtp_logits/tiny-qwen35moe-F32"}
    assert all(re.fullmatch(r"[0-9a-f]{64}", v) for v in after.values())


def test_research_model(runs, request):
    tmp, res = result(runs, request)
    ok(res)
    path = own_lines(res.stdout)[-1]
    assert path.startswith(str(tmp / "cache" / "research")) and path.endswith("-Q8_0.gguf")
    with GGUFFile(path) as f:
        c = read_model_config(f)
    assert (c.n_expert, c.n_expert_used, c.has_mtp) == (64, 8, True) and c.shared_expert_ff > 0
    # The default recipe trains the steps asked for, with no wall-clock budget: the same model on any machine.
    summary = json.loads((Path(path).parent / "summary.json").read_text())
    assert summary["train"]["time_budget_s"] is None and summary["steps"] == summary["train"]["steps"] == 2


def test_routing_stats(runs, request):
    tmp, res = result(runs, request)
    ok(res)
    data = json.loads((tmp / "routing" / "routing_stats.json").read_text())
    assert set(data["layers"]) == {"trained", "random"} and data["top_k"] == 4
    for rows in data["layers"].values():
        assert [r["layer"] for r in rows] == [0, 1, 2, 3]
        assert "recall@4" not in rows[0] and all(0 <= r["recall@4"] <= 1 for r in rows[1:])
        assert all(4 <= r["pass_union"] <= 12 and 0 < r["entropy"] <= 1 for r in rows)
    assert (tmp / "routing" / "routing_stats.png").stat().st_size > 0
    assert re.search(r"^trained\s+1\s", res.stdout, re.M) and re.search(r"^random\s+3\s", res.stdout, re.M)


def test_residency_sim(runs, request):
    tmp, res = result(runs, request)
    ok(res)
    recs = jsonl(tmp / "sim" / "residency_sim.jsonl")
    # 2 budgets x (MTP off + 3 advances with MTP) x 3 policies x 2 prefetch sources
    assert len(recs) == 2 * 4 * 3 * 2
    for r in recs:
        assert 0 <= r["demand_mib_per_token"] <= r["total_mib_per_token"] and 0 <= r["hit_rate"] <= 1
        if r["prefetch"] == "none":
            assert r["demand_mib_per_token"] == r["total_mib_per_token"]
    assert len(re.findall(r"^  mtp (off|on) .* -> [\d.]+x", res.stdout, re.M)) == 4
    assert (tmp / "sim" / "residency_sim.png").stat().st_size > 0


def test_perplexity(runs, request):
    """The embedded model against its F32 file on 4 chunks of the stdlib corpus: the figures, 3 position
    buckets, the JSON and the figure."""
    tmp, res = result(runs, request)
    ok(res)
    (rec,) = json.loads((tmp / "ppl.json").read_text())["records"]
    assert rec["chunks"] == 4 and rec["ctx"] == 32 and rec["count"] == 4 * 15 and rec["text"] == "corpus:stdlib"
    assert rec["ppl"] > 1 and rec["ref_ppl"] > 1 and rec["ppl_ratio"] == pytest.approx(rec["ppl"] / rec["ref_ppl"])
    assert 0 <= rec["kl_min"] <= rec["kl_percentiles"]["50.0"] <= rec["kl_max"] and 0 <= rec["top1_agreement"] <= 1
    assert [b["positions"] for b in rec["by_position"]] == [[16, 21], [21, 26], [26, 31]]
    assert re.search(r"^default: PPL = [\d.]+ \+/- [\d.]+ over 4 chunks of 32 .*KL mean [\d.]+", res.stdout, re.M)
    assert (tmp / "ppl.png").stat().st_size > 5000


def test_perplexity_bad_corpus(runs, request):
    _, res = result(runs, request)
    assert res.returncode == 2
    assert own_lines(res.stderr) == ["error: unknown --corpus 'nope': one of stdlib, repo"]


def test_every_entry_point_has_a_smoke_test():
    """Each experiments/*.py with an absl main is run by a test above."""
    mains = {p.stem for p in (REPO_ROOT / "experiments").glob("*.py") if "app.run(main)" in p.read_text()}
    tested = {name for name, _ in COMMANDS.values()} | {"plot"}  # plot: tests/experiments/test_sweep_plot.py
    assert mains == tested, mains ^ tested


def test_shipped_sweep_configs_parse():
    """Every config in configs/sweeps loads and expands to a non-empty grid (running them is `slow`)."""
    from experiments import sweep

    paths = sorted((REPO_ROOT / "configs" / "sweeps").glob("*.json"))
    assert paths
    for p in paths:
        cfg = sweep.load_config(p)
        assert list(sweep.grid_points(cfg["grid"])), p


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mtp_draft_tokens", "mtp_expert_budget"])
def test_shipped_sweep_runs(tmp_path, name):
    out = tmp_path / f"{name}.jsonl"
    ok(run_entry_point("sweep", f"--config=configs/sweeps/{name}.json", f"--out={out}", "--quiet", cache=tmp_path,
                       timeout=1800))
    recs = jsonl(out)
    assert recs and all("decode_tok_s_min" in r and "decode_tok_s_max" in r for r in recs)
