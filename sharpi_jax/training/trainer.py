"""The training recipe: a JSON preset (model shapes, data, optimiser), the jitted AdamW step, the loop
with its loss curve, and the GGUF export.

Preset layout (see configs/train/tiny.json):
    {"model": {ModelConfig fields, with n_layer + n_nextn + full_attention_interval instead of
               n_layer_all / recurrent_layers},
     "data":  {"byte_budget", "vocab_size", "val_fraction"},
     "train": {"batch_size", "seq_len", "steps", "lr", ...; see TrainConfig}}
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sharpi_jax.config import ModelConfig
from sharpi_jax.training import data as data_lib
from sharpi_jax.training import model as tm


def model_config_from_dict(d: Mapping[str, Any]) -> ModelConfig:
    """A qwen35moe ModelConfig from a preset's "model" dict: layers i with (i + 1) % interval == 0 are
    full attention, the n_nextn MTP blocks come last (never recurrent), d_inner = Hv * dv."""
    d = {k: v for k, v in d.items() if not k.startswith("_")}
    n_layer, n_nextn = int(d.pop("n_layer")), int(d.setdefault("n_nextn", 1))
    interval = int(d.pop("full_attention_interval", 4))
    d.pop("ssm_d_inner", None)
    recurrent = tuple(i < n_layer and (i + 1) % interval != 0 for i in range(n_layer + n_nextn))
    d["rope_sections"] = tuple(int(s) for s in d["rope_sections"])
    d.setdefault("rope_freq_scale", 1.0)
    d.setdefault("gdn_head_pairing", "tiled")
    d.setdefault("dense_ff", 0)
    return ModelConfig(n_layer_all=n_layer + n_nextn, recurrent_layers=recurrent,
                       ssm_d_inner=int(d["ssm_dt_rank"]) * int(d["ssm_d_state"]), **d)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings. The learning rate follows warmup + cosine over `steps`; when a time
    budget is set, progress is max(step / steps, elapsed / budget), so a slow machine still finishes the
    schedule (and the run) within the budget, just with fewer steps."""

    batch_size: int = 16
    seq_len: int = 256
    steps: int = 600
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    mtp_weight: float = 0.3
    aux_weight: float = 0.01
    capacity_factor: float | None = 1.25  # None: dense experts (exact, slower)
    gdn_chunk: int = 16
    eval_every: int = 100
    eval_batches: int = 4
    log_every: int = 10
    time_budget_s: float | None = 480.0


def load_preset(path: str | os.PathLike[str]) -> tuple[ModelConfig, dict[str, Any], TrainConfig]:
    """(model config, data kwargs, train config) of a JSON preset."""
    raw = json.loads(Path(path).read_text())
    model = model_config_from_dict(raw["model"])
    data_kw = {k: v for k, v in raw.get("data", {}).items() if not k.startswith("_")}
    train = TrainConfig(**{k: v for k, v in raw.get("train", {}).items() if not k.startswith("_")})
    return model, data_kw, train


def _decay_mask(params: Mapping[str, Any]) -> dict[str, bool]:
    """Weight decay on matrices only (not norms, ssm_a, dt bias)."""
    return {k: np.ndim(v) >= 2 for k, v in params.items()}


def make_optimizer(params: Mapping[str, Any], tc: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW whose learning rate is a hyper-parameter set every step."""
    return optax.chain(
        optax.clip_by_global_norm(tc.grad_clip),
        optax.inject_hyperparams(optax.adamw)(learning_rate=tc.lr, b1=tc.b1, b2=tc.b2,
                                              weight_decay=tc.weight_decay, mask=_decay_mask(params)))


def lr_schedule(tc: TrainConfig) -> Callable[[float], float]:
    """Linear warmup to tc.lr, cosine decay to tc.lr * min_lr_ratio at tc.steps: optax's
    warmup_cosine_decay_schedule, tabulated once (the loop reads it on the host every step)."""
    steps = max(tc.steps, 2)
    warmup = min(max(1, tc.warmup_steps), steps - 1)
    sched = optax.warmup_cosine_decay_schedule(0.0, tc.lr, warmup, steps, end_value=tc.lr * tc.min_lr_ratio)
    table = np.asarray(jax.vmap(sched)(jnp.arange(steps + 1)), np.float64)
    return lambda step: float(table[min(max(int(step), 0), steps)])


def make_train_step(config: ModelConfig, tc: TrainConfig, tx: optax.GradientTransformation):
    """jit((params, opt_state, ids, lr) -> (params, opt_state, metrics)), params and state donated."""

    def loss(p, ids):
        return tm.loss_fn(p, config, ids, mtp_weight=tc.mtp_weight, aux_weight=tc.aux_weight,
                          capacity_factor=tc.capacity_factor, gdn_chunk=tc.gdn_chunk)

    def step(params, opt_state, ids, lr):
        (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params, ids)
        opt_state[1].hyperparams["learning_rate"] = lr
        updates, opt_state = tx.update(grads, opt_state, params)
        metrics["grad_norm"] = optax.global_norm(grads)
        return optax.apply_updates(params, updates), opt_state, metrics

    return jax.jit(step, donate_argnums=(0, 1))


def make_eval_step(config: ModelConfig, tc: TrainConfig):
    """jit((params, ids) -> metrics) with the exact (dense-expert) forward: next-token CE and accuracy,
    MTP CE and accuracy, and mtp_agree: how often the MTP top-1 at position p (fed ids[p], h[p-1])
    equals the trunk's top-1 at p, i.e. the teacher-forced greedy acceptance rate of a first draft."""

    def ev(params, ids):
        logits, hidden = tm.forward(params, config, ids, gdn_chunk=tc.gdn_chunk)
        mask = jnp.ones(ids.shape, jnp.float32)
        out = {"ce": tm.cross_entropy(logits[:, :-1], ids[:, 1:], mask[:, 1:]),
               "acc": jnp.mean(jnp.argmax(logits[:, :-1], -1) == ids[:, 1:])}
        if config.has_mtp:
            ml = tm.mtp_forward(params, config, ids, hidden)  # row j: position j + 1, predicts ids[j + 2]
            out["mtp_ce"] = tm.cross_entropy(ml[:, :-1], ids[:, 2:], mask[:, 2:])
            out["mtp_acc"] = jnp.mean(jnp.argmax(ml[:, :-1], -1) == ids[:, 2:])
            out["mtp_agree"] = jnp.mean(jnp.argmax(ml[:, :-1], -1) == jnp.argmax(logits[:, 1:-1], -1))
        return out

    return jax.jit(ev)


@dataclasses.dataclass
class TrainResult:
    params: dict[str, np.ndarray]
    history: list[dict[str, float]]
    steps: int
    wall_s: float
    tokens: int


def train(config: ModelConfig, corpus: data_lib.Corpus, tc: TrainConfig, seed: int = 0,
          log: Callable[[str], None] = print, params: Mapping[str, Any] | None = None) -> TrainResult:
    """Train from `init_params(config, seed)` (or `params`) on random windows of corpus.train; log the
    curve (train loss, val loss every eval_every steps, tokens/s)."""
    params = {k: jnp.asarray(v) for k, v in (params or tm.init_params(config, seed)).items()}
    tx = make_optimizer(params, tc)
    opt_state = tx.init(params)
    step_fn = make_train_step(config, tc, tx)
    eval_fn = make_eval_step(config, tc)
    sched = lr_schedule(tc)
    batches = data_lib.random_batches(corpus.train, tc.batch_size, tc.seq_len, seed=seed)
    val = data_lib.eval_batches(corpus.val, tc.batch_size, tc.seq_len, tc.eval_batches)
    history: list[dict[str, float]] = []

    def evaluate() -> dict[str, float]:
        ms = [jax.device_get(eval_fn(params, jnp.asarray(b))) for b in val]
        return {f"val_{k}": float(np.mean([m[k] for m in ms])) for k in ms[0]}

    t0 = time.perf_counter()
    t_last, tok_last = t0, 0
    tokens = step = 0
    compile_s = None
    pending: list[dict[str, Any]] = []
    while step < tc.steps:
        elapsed = time.perf_counter() - t0
        progress = step
        if tc.time_budget_s:
            if elapsed >= tc.time_budget_s:
                log(f"time budget {tc.time_budget_s:.0f}s reached at step {step}")
                break
            progress = max(step, elapsed / tc.time_budget_s * tc.steps)
        lr = sched(progress)
        ids = jnp.asarray(next(batches))
        params, opt_state, metrics = step_fn(params, opt_state, ids, jnp.float32(lr))
        step += 1
        tokens += ids.size
        pending.append({"step": step, "lr": lr, **{k: v for k, v in metrics.items()}})
        if compile_s is None:
            jax.block_until_ready(metrics["loss"])
            compile_s = time.perf_counter() - t0
            t_last, tok_last = time.perf_counter(), tokens
            log(f"step 1 (compile + run) {compile_s:.1f}s")
        if step % tc.log_every == 0 or step == tc.steps:
            rows = jax.device_get(pending)
            pending = []
            now = time.perf_counter()
            tps = (tokens - tok_last) / max(now - t_last, 1e-9)
            t_last, tok_last = now, tokens
            history.extend(_float_rows(rows))
            history[-1].update(tok_s=tps, elapsed_s=now - t0)
            _log_row(history[-1], step, lr, log, evaluate if step % tc.eval_every == 0 and val else None)
    if pending:
        history.extend(_float_rows(jax.device_get(pending)))
    if val and history and "val_ce" not in history[-1]:
        history[-1].update(evaluate())
    wall = time.perf_counter() - t0
    return TrainResult(params={k: np.asarray(v) for k, v in params.items()}, history=history, steps=step,
                       wall_s=wall, tokens=tokens)


def _float_rows(rows: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Fetched metric rows as curve rows of Python floats."""
    return [{k: float(v) for k, v in r.items()} for r in rows]


def _log_row(r: dict[str, float], step: int, lr: float, log: Callable[[str], None],
             evaluate: Callable[[], dict[str, float]] | None = None) -> None:
    """Log the curve row `r` of a log step (its tok_s and elapsed_s set); with `evaluate` (an eval step),
    first add the val metrics to r and to the line."""
    msg = (f"step {step:5d}  loss {r['loss']:.4f}  ce {r['ce']:.4f}  mtp {r.get('mtp_ce', float('nan')):.4f}"
           f"  aux {r['aux']:.3f}  kept {r['kept']:.3f}  |g| {r['grad_norm']:.2f}  lr {lr:.2e}"
           f"  {r['tok_s']:,.0f} tok/s  {r['elapsed_s']:.0f}s")
    if evaluate is not None:
        r.update(evaluate())
        msg += (f"  | val ce {r['val_ce']:.4f}  mtp {r.get('val_mtp_ce', float('nan')):.4f}"
                f"  acc {r['val_acc']:.3f}  mtp_agree {r.get('val_mtp_agree', float('nan')):.3f}")
    log(msg)


def export(out_dir: str | os.PathLike[str], config: ModelConfig, vocab, params: Mapping[str, np.ndarray],
           qtypes=("F32", "Q8_0"), name: str = "sharpi-tiny-trained", stem: str = "tiny-trained") -> list[Path]:
    """Write `<out_dir>/<stem>-<QTYPE>.gguf` for each qtype (routers, norms, conv etc. stay F32)."""
    from sharpi_jax.gguf.writer import export_model_gguf

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {k: np.asarray(v, np.float32) for k, v in params.items()}
    return [export_model_gguf(out_dir / f"{stem}-{q}.gguf", config, vocab, weights, q, name=name) for q in qtypes]


__all__ = ["TrainConfig", "TrainResult", "export", "load_preset", "lr_schedule", "make_eval_step",
           "make_optimizer", "make_train_step", "model_config_from_dict", "train"]
