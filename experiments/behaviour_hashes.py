"""Fingerprints of the framework's numerical behaviour, for refactors that must not change a bit.

    python -m experiments.behaviour_hashes [--out=FILE.json] [--compare=BEFORE.json] [--only=logits,mtp,...]
        [--files=tiny-qwen35moe-F32,...]

Prints one sha256 per behaviour (over the exact bytes, shapes and dtypes of the arrays it produces):

- logits/<file>: `engine.logits` and `engine.mtp_logits` on every reference prompt of the fixture
  files (all three architectures, F32 and a quantized file each);
- mtp/<file>/k3-<verify>: MTP speculative generation (k = 3, batched and sequential verify): the
  tokens and every verify pass's trunk rows (logits, final-normed hidden, GDN state after each row);
- train/<experts>: a few AdamW steps of the tiny training preset (capacity and dense experts): the
  loss values and the trained params;
- residency/<policy>: a 50% expert budget on tiny-qwen35moe (lru, frequency): prefill and decode
  logits, greedy tokens and the residency counters.

With --compare, each hash is checked against an earlier run's file and the differences are listed
(exit status 1 if any differs). Needs ../shared/fixtures beside the repository.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Write the hashes (JSON) here.")
flags.DEFINE_string("compare", None, "A JSON file of an earlier run to compare with.")
flags.DEFINE_list("only", ["logits", "mtp", "train", "residency"], "Which groups to run.")
flags.DEFINE_list("files", None, "logits group: only these fixture files (e.g. tiny-qwen35moe-F32; default all).")

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("SHARPI_FIXTURES") or REPO_ROOT.parent / "shared" / "fixtures")
FILES = [("tiny-qwen35moe", "F32"), ("tiny-qwen35moe", "Q4_K_M"), ("tiny-qwen35", "F32"),
         ("tiny-qwen35", "Q4_K_M"), ("tiny-qwen3next", "F32"), ("tiny-qwen3next", "Q8_0")]
MAX_CONTEXT = 512


def digest(*arrays) -> str:
    """sha256 over the dtype, shape and bytes of every array (nested lists / tuples / dicts flattened)."""
    h = hashlib.sha256()

    def add(x):
        if isinstance(x, dict):
            for k in sorted(x):
                h.update(str(k).encode())
                add(x[k])
        elif isinstance(x, (list, tuple)):
            h.update(f"seq{len(x)}".encode())
            for y in x:
                add(y)
        elif x is None:
            h.update(b"none")
        else:
            a = np.ascontiguousarray(np.asarray(x))
            h.update(f"{a.dtype.str}{a.shape}".encode())
            h.update(a.tobytes())

    add(list(arrays))
    return h.hexdigest()


def _refs(name: str) -> dict:
    return json.loads((FIXTURES / name / "references.json").read_text())


def _engine(name: str, variant: str, **kw):
    import sharpi_jax as sj

    return sj.load(FIXTURES / name / f"{name}-{variant}.gguf", max_context=MAX_CONTEXT, **kw)


def logits_hashes() -> dict[str, str]:
    out = {}
    files = FILES if not FLAGS.files else [(n, v) for n, v in FILES if f"{n}-{v}" in FLAGS.files]
    unknown = set(FLAGS.files or ()) - {f"{n}-{v}" for n, v in FILES}
    if unknown:
        raise app.UsageError(f"--files: unknown {sorted(unknown)}; choose from {[f'{n}-{v}' for n, v in FILES]}")
    for name, variant in files:
        e = _engine(name, variant)
        prompts = _refs(name)["variants"][f"{name}-{variant}"]["tokens"]
        out[f"logits/{name}-{variant}"] = digest([e.logits(p) for p in prompts])
        out[f"mtp_logits/{name}-{variant}"] = digest([e.mtp_logits(p) for p in prompts])
    return out


def mtp_hashes() -> dict[str, str]:
    from sharpi_jax.runtime.sampling import SamplingParams
    from sharpi_jax.runtime.strategies.chain import generate_mtp
    from sharpi_jax.runtime.strategies.plain import generate_ids

    out = {}
    greedy = SamplingParams()
    for name, variant in (("tiny-qwen35moe", "Q4_K_M"), ("tiny-qwen35", "F32"), ("tiny-qwen3next", "F32")):
        e = _engine(name, variant, prefill_buckets=(32,))
        prompt = _refs(name)["variants"][f"{name}-{variant}"]["tokens"][0]
        plain, _ = generate_ids(e.runtime, prompt, 32, greedy)
        out[f"plain/{name}-{variant}"] = digest(np.asarray(plain))
        for verify in ("batched", "sequential"):
            trace: list = []
            tokens, stats = generate_mtp(e.runtime, e.mtp, prompt, 32, greedy, (), 3, verify,
                                         full_rows=verify == "sequential", trace=trace)
            rows = [(t["tokens"], t["logits"], t["hidden"], t["conv"], t["ssm"], t["accepted"]) for t in trace]
            out[f"mtp/{name}-{variant}/k3-{verify}"] = digest(np.asarray(tokens), rows,
                                                              np.asarray([stats["accepted"], stats["drafted"]]))
        seeded = SamplingParams(temperature=0.8, top_k=40, seed=3)
        tokens, _ = generate_mtp(e.runtime, e.mtp, prompt, 24, seeded, (), 3, "batched")
        out[f"mtp/{name}-{variant}/k3-sampled"] = digest(np.asarray(tokens))
    return out


def train_hashes() -> dict[str, str]:
    import jax
    import jax.numpy as jnp

    from sharpi_jax.training import model as tm
    from sharpi_jax.training import trainer

    config = trainer.load_preset(REPO_ROOT / "configs" / "train" / "tiny.json")[0]
    out = {}
    for label, cf in (("capacity", 1.5), ("dense", None)):
        tc = trainer.TrainConfig(batch_size=2, seq_len=32, steps=4, lr=4e-3, warmup_steps=1, time_budget_s=None,
                                 capacity_factor=cf, gdn_chunk=16)
        params = {k: jnp.asarray(v) for k, v in tm.init_params(config, seed=0).items()}
        tx = trainer.make_optimizer(params, tc)
        opt_state = tx.init(params)
        step = trainer.make_train_step(config, tc, tx)
        rng = np.random.default_rng(0)
        losses = []
        for _ in range(tc.steps):
            ids = jnp.asarray(rng.integers(0, config.n_vocab, size=(2, 32)), jnp.int32)
            params, opt_state, m = step(params, opt_state, ids, jnp.float32(tc.lr))
            losses.append({k: np.asarray(v) for k, v in jax.device_get(m).items()})
        print(f"train/{label}: " + "; ".join(
            f"loss {float(m['loss']):.9g} ce {float(m['ce']):.9g} mtp {float(m['mtp_ce']):.9g}" for m in losses))
        out[f"train/{label}/losses"] = digest(losses)
        out[f"train/{label}/params"] = digest({k: np.asarray(v) for k, v in params.items()})
    return out


def residency_hashes() -> dict[str, str]:
    out = {}
    name = "tiny-qwen35moe"
    prompt = _refs(name)["variants"][f"{name}-Q4_K_M"]["tokens"][2]
    for policy in ("lru", "frequency"):
        counts = {i: [(7 * e + i) % 16 for e in range(16)] for i in range(4)} if policy == "frequency" else None
        kw = {"expert_counts": counts} if counts else {}
        e = _engine(name, "Q4_K_M", prefill_buckets=(16,), expert_budget="50%", expert_policy=policy, **kw)
        rt = e.runtime
        _, logits, state = rt.prefill(rt.new_state(), prompt)
        steps, pos = [np.asarray(logits)], len(prompt)
        for _ in range(6):
            logits, _, state = rt.decode_step(state, int(np.argmax(steps[-1])), pos)
            steps.append(np.asarray(logits))
            pos += 1
        gen = e.generate(prompt, max_new_tokens=8, speculative="mtp", draft_tokens=3)
        stats = e.expert_stats()
        counters = {k: v for k, v in stats.items() if k in ("tokens", "hit_rate", "experts_streamed",
                                                              "experts_host_computed", "experts_evicted",
                                                              "ring_inserts", "bytes_streamed")}
        print(f"residency/{policy}: {counters}")
        out[f"residency/{policy}"] = digest(steps, np.asarray(gen.tokens),
                                            np.asarray([float(v) for _, v in sorted(counters.items())]))
    return out


GROUPS = {"logits": logits_hashes, "mtp": mtp_hashes, "train": train_hashes, "residency": residency_hashes}


def main(argv) -> None:
    del argv
    hashes: dict[str, str] = {}
    for group in FLAGS.only:
        t = time.perf_counter()
        got = GROUPS[group]()
        for k, v in got.items():
            print(f"{k:44s} {v}")
        hashes.update(got)
        print(f"# {group}: {time.perf_counter() - t:.0f}s", flush=True)
    if FLAGS.out:
        Path(FLAGS.out).write_text(json.dumps(hashes, indent=1, sort_keys=True))
    if FLAGS.compare:
        before = json.loads(Path(FLAGS.compare).read_text())
        diff = sorted(k for k in hashes if k in before and before[k] != hashes[k])
        same = sorted(k for k in hashes if k in before and before[k] == hashes[k])
        print(f"compare with {FLAGS.compare}: {len(same)} equal, {len(diff)} different"
              + "".join(f"\n  DIFFERENT {k}" for k in diff))
        if diff:
            sys.exit(1)


if __name__ == "__main__":
    app.run(main)
