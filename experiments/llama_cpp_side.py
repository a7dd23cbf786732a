"""Run the same GGUF through llama.cpp, for the side-by-side columns of the benchmarks.

Two ways in, both optional (never a test requirement):

- `--llama_bin=DIR` (a llama.cpp build's bin directory, or any binary inside it): `llama-bench` for
  prefill / decode tokens/s and `llama-speculative-simple --spec-type draft-mtp` for MTP speculative
  decoding (the tool the fixtures' MTP references were recorded with).
- llama-cpp-python importable: prefill / decode tokens/s from a greedy eval loop in a separate process
  (llama.cpp's spinning worker threads and XLA's thread pool must not share cores). It exposes no
  draft-mtp, so MTP figures need --llama_bin.

Every runner returns a dict of figures, `{"error": ...}` when the tool ran and failed, or None when
the tool is not available. Building the tools: docs/benchmarks.md ("llama.cpp side by side").
"""

from __future__ import annotations

import json
import re
import resource
import subprocess
import sys
from pathlib import Path

MTP_TOOL = "llama-speculative-simple"
BENCH_TOOL = "llama-bench"


def find_tool(llama_bin: str | None, name: str) -> Path | None:
    """`name` in the directory `llama_bin` (or beside the binary `llama_bin`), or None. A directory whose
    shared-library symlinks were flattened into small text files naming their target (as copies that
    do not keep links make them) is mirrored once into a temporary directory with real links."""
    if not llama_bin:
        return None
    base = Path(llama_bin).expanduser()
    for d in (base, base.parent) if base.is_file() else (base,):
        p = d / name
        if p.is_file():
            return _with_real_links(d) / name
    return None


def cpu_variant_bin(llama_bin: str | None, variant: str) -> str | None:
    """A llama.cpp bin directory that loads only the CPU backend variant `variant` (e.g. "haswell", the
    AVX2 one), for llama.cpp's figures beside its own pick ("auto": `llama_bin` as it is). A build with
    dynamically loaded CPU variants holds one `libggml-cpu-<variant>.so` each and picks the best this CPU
    runs; the mirror (made once, temporary) leaves the others out. None when `llama_bin` has no such
    library."""
    if not llama_bin or variant == "auto":
        return llama_bin
    tool = find_tool(llama_bin, BENCH_TOOL)
    if tool is None or not (tool.parent / f"libggml-cpu-{variant}.so").exists():
        return None
    key = (tool.parent, variant)
    if key not in _VARIANTS:
        import os  # pylint: disable=import-outside-toplevel
        import shutil  # pylint: disable=import-outside-toplevel
        import tempfile  # pylint: disable=import-outside-toplevel
        m = Path(tempfile.mkdtemp(prefix=f"llama-bin-{variant}-"))
        for p in tool.parent.iterdir():
            if p.name.startswith("libggml-cpu-") and p.name != f"libggml-cpu-{variant}.so":
                continue
            if p.is_symlink():
                os.symlink(os.readlink(p), m / p.name)
            elif ".so" in p.name:
                os.symlink(p.resolve(), m / p.name)
            else:
                shutil.copy2(p, m / p.name)
        _VARIANTS[key] = m
    return str(_VARIANTS[key])


_VARIANTS: dict[tuple[Path, str], Path] = {}


def _link_stub(p: Path) -> str | None:
    """The target a flattened symlink names (a tiny text file holding a sibling's file name), else None."""
    if p.is_symlink() or not p.is_file() or p.stat().st_size > 255 or ".so" not in p.name:
        return None
    text = p.read_bytes().strip()
    try:
        target = text.decode("ascii")
    except UnicodeDecodeError:
        return None
    return target if "/" not in target and (p.parent / target).exists() else None


_MIRRORS: dict[Path, Path] = {}


def _with_real_links(d: Path) -> Path:
    """`d` itself, or a mirror of it with real symlinks where `d` holds flattened ones (see find_tool).
    Executables are copied (the loader resolves $ORIGIN through symlinks); libraries are linked."""
    d = d.resolve()
    if not any(_link_stub(p) for p in d.iterdir()):
        return d
    if d not in _MIRRORS:
        import os  # pylint: disable=import-outside-toplevel
        import shutil  # pylint: disable=import-outside-toplevel
        import tempfile  # pylint: disable=import-outside-toplevel
        m = Path(tempfile.mkdtemp(prefix="llama-bin-"))
        for p in d.iterdir():
            stub = _link_stub(p)
            if stub:
                os.symlink(stub, m / p.name)
            elif ".so" in p.name:
                os.symlink(p, m / p.name)
            else:
                shutil.copy2(p, m / p.name)
        _MIRRORS[d] = m
    return _MIRRORS[d]


def have_llama_cpp_python() -> bool:
    try:
        import llama_cpp  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    except ImportError:
        return False
    return True


def prefill_decode(path: Path, ids: list[int], n_decode: int, *, threads: int = 2, n_ctx: int = 1024,
                   llama_bin: str | None = None, repetitions: int | None = None) -> dict | None:
    """llama.cpp prefill and decode tokens/s on `path`: llama-bench from --llama_bin if present (its
    `-r repetitions`, default llama-bench's own; the record adds `cpu_s`, the process CPU seconds of the
    whole llama-bench run, model load and warm-up included), else llama-cpp-python on the same prompt
    ids, else None."""
    bench = find_tool(llama_bin, BENCH_TOOL)
    if bench is not None:
        return _llama_bench(bench, path, len(ids), n_decode, threads, repetitions)
    if have_llama_cpp_python():
        return _llama_cpp_python(path, ids, n_decode, threads, n_ctx)
    return None


def _llama_bench(tool: Path, path: Path, n_prompt: int, n_decode: int, threads: int,
                 repetitions: int | None = None) -> dict:
    cmd = [str(tool), "-m", str(path), "-p", str(n_prompt), "-n", str(n_decode), "-t", str(threads), "-o", "json"]
    if repetitions is not None:
        cmd += ["-r", str(repetitions)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800).stdout)
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError) as e:
        return {"error": f"llama-bench failed: {e}"}
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    out = {"source": "llama-bench", "cpu_s": cpu_s, "repetitions": repetitions}
    for r in res:  # one record for the prompt test (n_prompt > 0), one for the generation test
        out["prefill_tok_s" if r.get("n_prompt", 0) else "decode_tok_s"] = r.get("avg_ts")
    return out


def batch_pass_ms(path: Path, widths: list[int], *, threads: int = 2, llama_bin: str | None = None,
                  repetitions: int = 3) -> dict[int, list[float]] | dict:
    """llama.cpp's time for one batch of w tokens (ms per run, `llama-bench -p w -n 0`, different tokens
    per row) for each w in `widths`: {w: [ms of each repetition]}, or {"error": why}."""
    tool = find_tool(llama_bin, BENCH_TOOL)
    if tool is None:
        return {"error": "no llama-bench (--llama_bin)"}
    cmd = [str(tool), "-m", str(path), "-p", ",".join(str(w) for w in widths), "-n", "0", "-t", str(threads),
           "-r", str(repetitions), "-o", "json"]
    try:
        res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800).stdout)
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError) as e:
        return {"error": f"llama-bench failed: {e}"}
    return {int(r["n_prompt"]): [ns / 1e6 for r_ns in [r.get("samples_ns") or [r["avg_ns"]]] for ns in r_ns]
            for r in res if r.get("n_prompt")}


def batched_decode_tok_s(path: Path, batches: list[int], *, n_prompt: int, n_decode: int, threads: int = 2,
                         llama_bin: str | None = None) -> dict[int, float] | dict:
    """llama.cpp's aggregate decode tokens/s with B parallel sequences (`llama-batched-bench -npl B`: B
    prompts of n_prompt tokens, then n_decode tokens each, S_TG = B * n_decode / the decode time) for each
    B in `batches`: {B: tok/s}, or {"error": why}."""
    tool = find_tool(llama_bin, "llama-batched-bench")
    if tool is None:
        return {"error": "no llama-batched-bench (--llama_bin)"}
    ctx = max(batches) * (n_prompt + n_decode) + 64
    cmd = [str(tool), "-m", str(path), "-c", str(ctx), "-npp", str(n_prompt), "-ntg", str(n_decode),
           "-npl", ",".join(str(b) for b in batches), "-t", str(threads), "-tb", str(threads), "--output-format", "jsonl"]
    try:
        text = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=3600).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return {"error": f"llama-batched-bench failed: {e}"}
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "speed_tg" in r:
                out[int(r["pl"])] = float(r["speed_tg"])
    return out or {"error": "llama-batched-bench printed no results"}


def _llama_cpp_python(path: Path, ids: list[int], n_decode: int, threads: int, n_ctx: int) -> dict:
    args = json.dumps({"path": str(path), "ids": ids, "n_decode": n_decode, "threads": threads, "n_ctx": n_ctx})
    try:
        res = subprocess.run([sys.executable, "-c", _LLAMA_CPP_PYTHON_WORKER, args], check=True,
                             capture_output=True, text=True, timeout=1800)
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError, IndexError) as e:
        err = getattr(e, "stderr", "") or ""
        return {"error": f"llama-cpp-python failed: {e} {err[-200:]}"}


_LLAMA_CPP_PYTHON_WORKER = r"""
import json, sys, time
import numpy as np
import llama_cpp
a = json.loads(sys.argv[1])
llm = llama_cpp.Llama(model_path=a["path"], n_ctx=a["n_ctx"], n_batch=512, n_threads=a["threads"],
                      verbose=False)
ids = a["ids"]
llm.eval(ids[:8])  # warm-up
llm.reset()
t = time.perf_counter()
llm.eval(ids)
prefill_s = time.perf_counter() - t
tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
t = time.perf_counter()
for _ in range(a["n_decode"]):
    llm.eval([tok])
    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
decode_s = time.perf_counter() - t
print(json.dumps({"source": "llama-cpp-python " + llama_cpp.__version__, "prefill_tok_s": len(ids) / prefill_s,
                  "decode_tok_s": a["n_decode"] / decode_s}))
"""

_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s")
_ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s")
_STAT = re.compile(r"\b(n_drafted|n_accept|n_predict)\s*=\s*(\d+)")


def parse_speculative_log(text: str) -> dict:
    """The figures llama-speculative-simple logs at the end of a run (see its source)."""
    out: dict = {}
    if m := _DECODED.search(text):
        out.update(generated_tokens=int(m[1]), decode_s=float(m[2]), decode_tok_s=float(m[3]))
    if m := _ENCODED.search(text):
        out.update(prompt_tokens=int(m[1]), prefill_tok_s=float(m[3]))
    for key, val in _STAT.findall(text):
        out[{"n_drafted": "drafted", "n_accept": "accepted", "n_predict": "n_predict"}[key]] = int(val)
    if out.get("drafted"):
        out["acceptance_rate"] = out["accepted"] / out["drafted"]
    return out


def mtp_speculative(path: Path, prompt: str, n_new: int, draft_tokens: int, *, llama_bin: str | None,
                    threads: int = 2, n_ctx: int = 1024, repeats: int = 1) -> dict | None:
    """Greedy MTP speculative decoding by llama.cpp (draft-mtp, `draft_tokens` drafts per pass) on the
    text `prompt`; the best decode tok/s of `repeats` runs. None without llama-speculative-simple."""
    tool = find_tool(llama_bin, MTP_TOOL)
    if tool is None:
        return None
    cmd = [str(tool), "-m", str(path), "-p", prompt, "-n", str(n_new), "--temp", "0", "-t", str(threads),
           "-c", str(n_ctx), "--spec-type", "draft-mtp", "--spec-draft-n-max", str(draft_tokens)]
    best, good, tries = None, 0, 0
    # llama.cpp logs from a background thread; a run now and then exits before its last lines are
    # written, so a run without its summary is retried (up to twice the runs asked for).
    while good < max(1, repeats) and tries < 2 * max(1, repeats) + 1:
        tries += 1
        try:
            res = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.SubprocessError) as e:
            return {"error": f"{MTP_TOOL} failed: {e} {(getattr(e, 'stderr', '') or '')[-300:]}"}
        got = parse_speculative_log(res.stdout + res.stderr)
        if "decode_tok_s" not in got or "accepted" not in got:
            continue
        good += 1
        if best is None or got["decode_tok_s"] > best["decode_tok_s"]:
            best = got
    if best is None:
        return {"error": f"{MTP_TOOL}: no summary ('decoded ... t/s', n_accept) in {tries} runs' logs"}
    return {"source": MTP_TOOL, "runs": good, **best}
