"""Perplexity of a GGUF on a text, chunked as llama.cpp's `llama-perplexity`, and against a reference
model's logits: KL divergence (mean, error, percentiles), top-1 agreement, and the same per position
bucket. Writes JSON and a figure.

    python -m experiments.perplexity --gguf=F [--gguf=G,...] [--reference=F32.gguf]
        [--text=FILE | --corpus=stdlib|repo] [--ctx=512] [--batch=4] [--chunks=N] [--buckets=4]
        [--llama_bin=../shared/llama.cpp/bin] [--out=results/perplexity.json]

Chunking (`sharpi_jax.runtime.perplexity`): floor(tokens / ctx) non-overlapping chunks, each from an
empty state, the second half of each chunk's positions scored. --batch chunks run as one batch of
sequences. --reference: KL(reference || model) per scored token over the full vocabulary.

Corpora shipped with the project (no download):
- stdlib: experiments/data/perplexity/stdlib.txt, a frozen copy of standard-library files that the
  embedded model's training corpus did not reach (`training.data.corpus_selection` past
  configs/train/tiny.json's byte budget, hash order, files of at most 16 KB, ~96 KB in all; written
  by --write_corpus, from the stdlib of the interpreter that runs it: Python 3.11.7 for the shipped one).
- repo: the six frozen held-out sources of this repository (`presets.HELD_OUT_SOURCES`), concatenated.

--llama_bin: also runs llama-perplexity on the same text and context (with a reference: its
--kl-divergence-base, then --kl-divergence per file) and prints its figures beside ours.
--record=FILE merges llama-perplexity's figures into FILE (JSON), the reference the tests check against;
tests/runtime/llama_perplexity.json was made by

    L=../shared/llama.cpp/bin R=tests/runtime/llama_perplexity.json
    python -m experiments.perplexity --gguf=tiny-qwen35moe-F32,tiny-qwen35moe-Q4_K_M \
        --reference=tiny-qwen35moe-F32 --chunks=4 --llama_bin=$L --record=$R
    python -m experiments.perplexity --gguf=tiny-qwen35moe-F32,tiny-qwen35moe-BF16,tiny-qwen35moe-Q8_0,\
tiny-qwen35moe-Q4_K_M --reference=tiny-qwen35moe-F32 --llama_bin=$L --record=$R
    python -m experiments.perplexity --gguf=tiny-qwen35-F32,tiny-qwen35-Q8_0,tiny-qwen35-Q4_K_M \
        --reference=tiny-qwen35-F32 --llama_bin=$L --record=$R
    python -m experiments.perplexity --gguf=tiny-qwen3next-F32,tiny-qwen3next-Q8_0 \
        --reference=tiny-qwen3next-F32 --llama_bin=$L --record=$R
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from absl import app, flags

from experiments.cli import reports_bad_input
from experiments.presets import HELD_OUT_SOURCES, REPO_ROOT, resolve_model

FLAGS = flags.FLAGS
flags.DEFINE_list("gguf", ["default"], "GGUF file(s) or preset names to score.")
flags.DEFINE_string("reference", None, "Reference GGUF (or preset) for KL divergence and top-1 agreement.")
flags.DEFINE_string("text", None, "A UTF-8 text file to score (as llama-perplexity -f).")
flags.DEFINE_string("corpus", None, "A shipped corpus: stdlib or repo (default stdlib when no --text).")
flags.DEFINE_integer("ctx", 512, "Chunk length (llama-perplexity -c).")
flags.DEFINE_integer("batch", 4, "Chunks per batched pass.")
flags.DEFINE_integer("chunks", -1, "At most this many chunks (-1: all; llama-perplexity --chunks).")
flags.DEFINE_integer("buckets", 4, "Position buckets over the scored half of each chunk.")
flags.DEFINE_string("kernels", "auto", "Kernel backend (sj.load kernels=).")
flags.DEFINE_string("llama_bin", None, "llama.cpp bin directory: run llama-perplexity beside ours.")
flags.DEFINE_integer("llama_threads", 2, "llama-perplexity -t.")
flags.DEFINE_string("record", None, "With --llama_bin: merge llama-perplexity's figures into this JSON file.")
flags.DEFINE_string("out", "results/perplexity.json", "JSON output (overwritten); the figure beside it (.png).")
flags.DEFINE_bool("write_corpus", False, "Write the stdlib corpus file from this interpreter's stdlib and exit.")

CORPUS_DIR = REPO_ROOT / "experiments" / "data" / "perplexity"
CORPORA = ("stdlib", "repo")
TRAIN_PRESET = REPO_ROOT / "configs" / "train" / "tiny.json"


def write_stdlib_corpus(path: Path = CORPUS_DIR / "stdlib.txt", max_bytes: int = 96_000,
                        max_file_bytes: int = 16_000) -> list[str]:
    """Write the held-out stdlib files (hash order, each <= max_file_bytes, until max_bytes) joined by
    newlines; returns their paths relative to the stdlib."""
    from sharpi_jax.training.data import corpus_selection, stdlib_dir

    budget = json.loads(TRAIN_PRESET.read_text())["data"]["byte_budget"]
    trained = {p for p, _ in corpus_selection(budget)}
    texts, names, total = [], [], 0
    for p, t in corpus_selection(1 << 62):
        n = len(t.encode())
        if p in trained or n > max_file_bytes or "<|" in t:  # "<|": no special-token text
            continue
        texts.append(t)
        names.append(p.relative_to(stdlib_dir()).as_posix())
        total += n
        if total >= max_bytes:
            break
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes("\n".join(texts).encode())
    return names


def read_text(text_file: str | None, corpus: str | None) -> tuple[str, str]:
    """(text, its name) from --text or --corpus, with one trailing newline dropped (as llama.cpp's -f)."""
    from sharpi_jax.errors import InputError

    if text_file and corpus:
        raise InputError("give --text or --corpus, not both")
    if text_file:
        try:
            raw = Path(text_file).read_bytes()
        except OSError as e:
            raise InputError(f"--text {text_file}: {e.strerror}") from None
        name = Path(text_file).name
    else:
        corpus = corpus or "stdlib"
        if corpus == "stdlib":
            raw = (CORPUS_DIR / "stdlib.txt").read_bytes()
        elif corpus == "repo":
            raw = "".join((REPO_ROOT / rel).read_text() for rel in HELD_OUT_SOURCES).encode()
        else:
            raise InputError(f"unknown --corpus {corpus!r}: one of {', '.join(CORPORA)}")
        name = f"corpus:{corpus}"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{name} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    return (text[:-1] if text.endswith("\n") else text), name


# ----- llama-perplexity -----
_FINAL = re.compile(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)")
_CHUNKS = re.compile(r"(?:calculating perplexity|computing) over (\d+) chunks, n_ctx=(\d+)")
_KL_LINES = {
    "ppl": r"Mean PPL\(Q\)\s*:\s*([\d.]+)\s*±\s*([\d.]+)",
    "ref_ppl": r"Mean PPL\(base\)\s*:\s*([\d.]+)\s*±\s*([\d.]+)",
    "kl_mean": r"Mean\s+KLD:\s*([-\d.]+)\s*±\s*([\d.]+)",
    "kl_max": r"Maximum KLD:\s*([-\d.]+)",
    "kl_median": r"Median\s+KLD:\s*([-\d.]+)",
    "kl_99.0": r"99\.0%\s+KLD:\s*([-\d.]+)",
    "top1_agreement": r"Same top p:\s*([\d.]+)\s*±\s*([\d.]+)",
}


def parse_llama_perplexity(log: str) -> dict:
    """The figures llama-perplexity prints: plain (ppl, ppl_err) or --kl-divergence's summary."""
    out: dict = {}
    if m := _CHUNKS.search(log):
        out.update(chunks=int(m[1]), ctx=int(m[2]))
    if m := _FINAL.search(log):
        out.update(ppl=float(m[1]), ppl_err=float(m[2]))
    for key, pat in _KL_LINES.items():
        if m := re.search(pat, log):
            out[key] = float(m[1])
            if m.lastindex and m.lastindex > 1:
                out[f"{key}_err" if key != "ppl" else "ppl_err"] = float(m[2])
    for k in ("top1_agreement", "top1_agreement_err"):
        if k in out:
            out[k] /= 100.0  # printed in percent
    return out


def run_llama(tool: Path, gguf: Path, text_path: Path, ctx: int, chunks: int, threads: int,
              kl_base: Path | None = None, kl: bool = False) -> dict:
    """llama-perplexity on one file; kl_base without kl: save the base logits there; with kl: compare."""
    cmd = [str(tool), "-m", str(gguf), "-c", str(ctx), "-t", str(threads), "--chunks", str(chunks)]
    if not kl:
        cmd += ["-f", str(text_path)]
    if kl_base is not None:
        cmd += ["--kl-divergence-base", str(kl_base)] + (["--kl-divergence"] if kl else [])
    # llama.cpp logs from a background thread and now and then exits before its last lines are written:
    # a run that exits 0 without its summary is run again (three tries).
    for _ in range(3):
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        except (OSError, subprocess.SubprocessError) as e:
            return {"error": f"llama-perplexity failed: {e}"}
        got = parse_llama_perplexity(res.stdout + res.stderr)
        if res.returncode != 0 or ("ppl" in got and (not kl or "kl_mean" in got)):
            break
    if res.returncode != 0 or "ppl" not in got:
        return {"error": f"llama-perplexity exit {res.returncode}: {(res.stderr or res.stdout)[-300:]}"}
    return {"command": " ".join(["llama-perplexity"] + cmd[1:]), **got}


def llama_side(paths: list[Path], ref_path: Path | None, text: str, ctx: int, chunks: int) -> dict:
    """{file name: llama-perplexity's figures} for every scored file (and the reference)."""
    from experiments.llama_cpp_side import find_tool

    tool = find_tool(FLAGS.llama_bin, "llama-perplexity")
    if tool is None:
        raise SystemExit(f"--llama_bin={FLAGS.llama_bin}: no llama-perplexity there")
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        text_path = Path(tmp) / "text.txt"
        text_path.write_bytes(text.encode())
        base = Path(tmp) / "base.kld" if ref_path is not None else None
        if ref_path is not None:
            out[ref_path.name] = run_llama(tool, ref_path, text_path, ctx, chunks, FLAGS.llama_threads, base)
        for p in paths:
            if p.name not in out:
                out[p.name] = run_llama(tool, p, text_path, ctx, chunks, FLAGS.llama_threads, base, kl=base is not None)
    return out


def record_key(name: str, text_name: str, ctx: int, chunks: int) -> str:
    return f"{name}|{text_name}|ctx={ctx}|chunks={chunks}"


# ----- output -----
def figure(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_ref = any("kl_mean" in r for r in records)
    panels = [("ppl", "perplexity")] + ([("kl_mean", "mean KL(reference || model), nats"),
                                        ("top1_agreement", "top-1 agreement with reference")] if has_ref else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        for r in records:
            rows = r["by_position"]
            if key not in rows[0]:
                continue
            xs = [(b["positions"][0] + b["positions"][1] - 1) / 2 for b in rows]
            ax.plot(xs, [b[key] for b in rows], marker="o", label=r["model"])
        ax.set_xlabel("position in chunk (scored half)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    r0 = records[0]
    fig.suptitle(f"{r0['text']}: {r0['chunks']} chunks of {r0['ctx']} tokens"
                 + (f", reference {Path(r0['reference']).name}" if has_ref else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@reports_bad_input
def main(argv):
    del argv
    import sharpi_jax as sj
    from sharpi_jax.errors import InputError
    from sharpi_jax.runtime import perplexity as P

    if FLAGS.write_corpus:
        names = write_stdlib_corpus()
        print(f"wrote {CORPUS_DIR / 'stdlib.txt'}: {len(names)} files: {', '.join(names)}")
        return
    if FLAGS.batch < 1:
        raise InputError(f"--batch must be >= 1, got {FLAGS.batch}")
    if FLAGS.buckets < 1:
        raise InputError(f"--buckets must be >= 1, got {FLAGS.buckets}")
    if FLAGS.record and not FLAGS.llama_bin:
        raise InputError("--record writes llama-perplexity's figures: add --llama_bin")
    text, text_name = read_text(FLAGS.text, FLAGS.corpus)
    paths = [resolve_model(g) for g in FLAGS.gguf]
    ref_path = resolve_model(FLAGS.reference) if FLAGS.reference else None
    ctx, first = FLAGS.ctx, FLAGS.ctx // 2
    load = lambda p: sj.load(p, max_context=max(ctx, 4), kernels=FLAGS.kernels)  # noqa: E731
    ref = load(ref_path) if ref_path is not None else None
    records = []
    for name, path in zip(FLAGS.gguf, paths):
        engine = load(path)
        if ref is not None and ref.config.n_vocab != engine.config.n_vocab:
            raise InputError(f"{path} has a vocabulary of {engine.config.n_vocab}, the reference "
                             f"{ref_path} {ref.config.n_vocab}: KL needs the same vocabulary")
        tok = engine.tokenizer
        ids = tok.encode(text)
        if ref is not None and ref.tokenizer.encode(text) != ids:
            raise InputError(f"{path} and the reference {ref_path} tokenize the text differently")
        chunk_ids = P.chunks(ids, ctx, None if FLAGS.chunks < 0 else FLAGS.chunks,
                             tok.bos_id if tok.add_bos else None)
        t0 = time.perf_counter()
        scores = P.score_chunks(engine.runtime, chunk_ids, first, FLAGS.batch,
                                ref.runtime if ref is not None else None)
        seconds = time.perf_counter() - t0
        rec = {"model": name, "file": str(path), "reference": str(ref_path) if ref_path else None,
               "text": text_name, "tokens": len(ids), "ctx": ctx, "chunks": len(chunk_ids),
               "batch": FLAGS.batch, "kernels": engine.matrix_format.backend, "seconds": round(seconds, 2),
               **P.summary(scores), "by_position": P.by_position(scores, first, ctx, FLAGS.buckets)}
        records.append(rec)
        line = (f"{name}: PPL = {rec['ppl']:.4f} +/- {rec['ppl_err']:.5f} over {rec['chunks']} chunks of "
                f"{ctx} ({rec['count']} scored tokens, {seconds:.1f} s incl. compile)")
        if "kl_mean" in rec:
            line += (f"; vs reference: KL mean {rec['kl_mean']:.6f} +/- {rec['kl_err']:.6f}, median "
                     f"{rec['kl_percentiles']['50.0']:.6f}, 99% {rec['kl_percentiles']['99.0']:.6f}, max "
                     f"{rec['kl_max']:.6f}; top-1 agreement {rec['top1_agreement']:.3%}; PPL ratio "
                     f"{rec['ppl_ratio']:.6f}")
        print(line, flush=True)
        del engine
    if FLAGS.llama_bin:
        llama = llama_side(paths, ref_path, text, ctx, FLAGS.chunks)
        print(f"\n{'file':<28} {'ours PPL':>10} {'llama PPL':>10} {'rel. diff':>10} {'ours KL':>10} "
              f"{'llama KL':>10} {'ours top1':>10} {'llama top1':>10}")
        for rec in records:
            got = llama.get(Path(rec["file"]).name, {})
            rec["llama_perplexity"] = got
            if "error" in got:
                print(f"{Path(rec['file']).name:<28} llama-perplexity: {got['error']}")
                continue
            if got.get("chunks") != rec["chunks"]:
                print(f"  note: llama-perplexity scored {got.get('chunks')} chunks, ours {rec['chunks']}")
            rel = rec["ppl"] / got["ppl"] - 1
            rec["llama_ppl_rel_diff"] = rel
            fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
            print(f"{Path(rec['file']).name:<28} {rec['ppl']:>10.4f} {got['ppl']:>10.4f} {rel:>+10.3%} "
                  f"{fmt(rec.get('kl_mean'), '10.6f'):>10} {fmt(got.get('kl_mean'), '10.6f'):>10} "
                  f"{fmt(rec.get('top1_agreement'), '10.3%'):>10} {fmt(got.get('top1_agreement'), '10.3%'):>10}")
        if FLAGS.record:
            path = Path(FLAGS.record)
            data = json.loads(path.read_text()) if path.exists() else {}
            data.setdefault("_made_by", "python -m experiments.perplexity ... --llama_bin=DIR --record=FILE "
                            "(the commands in experiments/perplexity.py's docstring)")
            for name, got in llama.items():
                if "error" not in got:
                    data[record_key(name, text_name, ctx, got.get("chunks"))] = got
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
            print(f"recorded llama-perplexity's figures in {path}")
    out = Path(FLAGS.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"argv": sys.argv, "records": records}, indent=1))
    png = out.with_suffix(".png")
    figure(records, png)
    print(f"wrote {out} and {png}")


if __name__ == "__main__":
    app.run(main)
