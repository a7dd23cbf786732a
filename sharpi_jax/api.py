"""The research API: `load(path) -> Engine`; `engine.logits(ids)`, `engine.generate(...)`.

    import sharpi_jax as sj
    engine = sj.load("model.gguf", max_context=4096)
    engine.logits(engine.tokenizer.encode("def f(x):"))       # [T, vocab] float32, teacher-forced
    out = engine.generate("def f(x):", max_new_tokens=32)     # out.tokens, out.text, out.stats
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
import os
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sharpi_jax.config import ModelConfig, RunConfig
from sharpi_jax.errors import InputError
from sharpi_jax.experts import parallel as expert_parallelism
from sharpi_jax.experts import residency as expert_residency
from sharpi_jax.experts.provider import GGUFExperts
from sharpi_jax.gguf import GGUFFile, read_model_config
from sharpi_jax.gguf.tokenizer import Tokenizer
from sharpi_jax.model import snapkv
from sharpi_jax.model.footprint import backend_summary, fallback_message, matrix_backends
from sharpi_jax.model.snapkv import SnapKV
from sharpi_jax.model.weights import load_model, load_mtp
from sharpi_jax.quant import MatrixFormat
from sharpi_jax.runtime import batch, draft_vocab, loops
from sharpi_jax.runtime import session as session_state
from sharpi_jax.runtime.generate import GenerateOutput
from sharpi_jax.runtime.options import GenerateOptions
from sharpi_jax.runtime.sampling import SamplingParams
from sharpi_jax.runtime.mtp import MTPRuntime, teacher_forced_mtp_logits
from sharpi_jax.runtime.steps import Runtime



def _check_dtype(dtype: Any) -> None:
    if dtype is None:
        return
    try:
        ok = np.dtype(dtype) == np.float32
    except TypeError:
        ok = False
    if not ok:
        raise InputError(f"dtype {dtype!r} is not supported: activations, weights and caches are float32 "
                         "(bf16 cache updates are slow on XLA CPU)")


def _kv_policy(kv_policy: Any, kv_budget: Any, kv_window: Any, kv_pool: Any, base: SnapKV | None) -> SnapKV | None:
    """The KV eviction setting from options; kv_policy "default" and sizes None take `base`'s."""
    if kv_policy == "default":
        kv_policy = None if base is None else "snapkv"
    if kv_policy is None and (kv_budget, kv_window, kv_pool) != (None, None, None):
        raise InputError('kv_budget / kv_window / kv_pool need kv_policy="snapkv"')
    if base is not None:
        kv_budget = base.budget if kv_budget is None else kv_budget
        kv_window = base.window if kv_window is None else kv_window
        kv_pool = base.pool if kv_pool is None else kv_pool
    return snapkv.policy(kv_policy, kv_budget, kv_window, kv_pool)



def _say_if_ggml_missing(asked: str, resolved: str) -> None:
    """kernels="auto" on CPU without ggml's native extension runs "xla", and says why once, with the
    fix ("ggml" asked by name raises that line instead: `registry.resolve_kernels`); ggml without its
    multi-row kernels (no AVX2) says so too."""
    from sharpi_jax.quant import ggml  # pylint: disable=import-outside-toplevel

    if asked == "auto" and resolved != "ggml" and jax.default_backend() == "cpu" and not ggml.available():
        warnings.warn(f"ggml CPU kernels unavailable, running kernels={resolved!r} (slower): "
                      f"{ggml.unavailable_reason()}", stacklevel=3)
    elif resolved == "ggml" and ggml.available() and (why := ggml.multirow_unavailable_reason()):
        warnings.warn(why, stacklevel=3)  # Python shows a warning once per call site


def _warn_fallbacks(backends: dict[str, dict], selected: str, path: str) -> None:
    """One `warnings.warn` naming every matrix that is not on the selected backend, with type and why."""
    msg = fallback_message(backends, selected)
    if msg is not None:
        warnings.warn(f"{path}: {msg}", stacklevel=3)


class Engine:
    """A loaded model: config, tokenizer, params and its jitted runtime."""

    def __init__(self, path: str | os.PathLike[str], max_context: int = 4096, dtype: Any = jnp.float32, *,
                 run_config: RunConfig | None = None, prefill_buckets: Sequence[int] | None = None,
                 expert_mode: str | None = None, row_kernel: str | None = None, gdn_chunk: int | None = None,
                 kernels: str | None = None, repack: str | None = "default", progress: bool | None = None,
                 expert_budget: int | None = None, expert_policy: str = "frequency", expert_parallel: int | None = None,
                 kv_policy: str | None = None, kv_budget: int | None = None, kv_window: int | None = None,
                 kv_pool: int | None = None,
                 **residency_options: Any):
        _check_dtype(dtype)
        self.kv_policy: SnapKV | None = _kv_policy(kv_policy, kv_budget, kv_window, kv_pool, None)
        if isinstance(max_context, bool) or not isinstance(max_context, (int, np.integer)) or max_context < 1:
            raise InputError(f"max_context must be a positive integer, got {max_context!r}")
        if run_config is not None and not isinstance(run_config, RunConfig):
            raise InputError(f"run_config must be a sharpi_jax.RunConfig, got {type(run_config).__name__}")
        self.run_config: RunConfig = (run_config or RunConfig()).replace(
            prefill_buckets=prefill_buckets, expert_mode=expert_mode, row_kernel=row_kernel, gdn_chunk=gdn_chunk,
            kernels=kernels)
        if repack != "default":  # None is a value here (no repacking), so "default" means "not given"
            self.run_config = dataclasses.replace(self.run_config, repack=repack)
        self.path = os.fspath(path)
        self.gguf = GGUFFile(path)  # kept open: raw expert views may alias the mmap
        self.config: ModelConfig = read_model_config(self.gguf)
        self.tokenizer = Tokenizer.from_gguf_fields(self.gguf.metadata, source=self.gguf.source)
        self.residency = expert_residency.configure(self.gguf, self.config, expert_budget, expert_policy,
                                                    **residency_options)
        run = self.run_config
        self.matrix_format = MatrixFormat.for_run(run)
        _say_if_ggml_missing(run.kernels, self.matrix_format.backend)
        if self.matrix_format.backend == "pallas" and expert_budget is not None:
            raise InputError("kernels='pallas' with an expert_budget is not supported yet: the Pallas "
                             "grouped kernel reads whole expert stacks (use kernels='xla')")
        self.mesh = None  # the expert-parallel Mesh (expert_parallel=N), else one device
        if expert_parallel is not None:
            n = expert_parallelism.check_expert_parallel(expert_parallel, self.config, expert_budget=expert_budget)
            if self.matrix_format.backend == "pallas":
                raise InputError("expert_parallel with kernels='pallas' is not supported yet: use kernels='xla'")
            self.mesh = expert_parallelism.expert_mesh(n)
            self.experts = expert_parallelism.ShardedGGUFExperts(self.gguf, self.config, self.mesh, run)
        else:
            self.experts = GGUFExperts(self.gguf, self.config, run, self.residency) if self.config.is_moe else None
        self.model = load_model(self.gguf, self.config, self.experts, progress=progress, run=run)
        # The backend each matrix runs on; one warning names every matrix off the selected backend.
        self.matrix_backends: dict[str, dict] = matrix_backends(self.model, self.matrix_format.backend)
        _warn_fallbacks(self.matrix_backends, self.matrix_format.backend, self.path)
        if self.mesh is not None:
            self.model = expert_parallelism.replicate_dense(self.model, self.mesh)
        self.runtime = Runtime(self.model, int(max_context), run)
        self._mtp: MTPRuntime | None = None

    @property
    def max_context(self) -> int:
        return self._live().runtime.max_context

    # ----- lifetime -----
    def _live(self) -> "Engine":
        if getattr(self, "runtime", None) is None:
            raise InputError(f"engine of {getattr(self, 'path', '?')} is closed (or failed to load)")
        return self

    @property
    def closed(self) -> bool:
        return getattr(self, "runtime", None) is None

    def close(self) -> None:
        """Release the engine: its compiled programs (those no other live engine shares), device arrays,
        expert staging buffers and the file's mmap. Idempotent; any later use raises an InputError.
        `with sj.load(...) as engine:` closes on exit, and a collected engine closes itself."""
        mtp, runtime, residency = getattr(self, "_mtp", None), getattr(self, "runtime", None), \
            getattr(self, "residency", None)
        self._mtp = self.runtime = None
        self.model = self.experts = self.residency = None
        if mtp is not None:
            mtp.close()
        if runtime is not None:
            runtime.close()
        if residency is not None:
            residency.streamer.close()
        gguf = getattr(self, "gguf", None)
        if gguf is not None:
            import gc  # pylint: disable=import-outside-toplevel

            gc.collect()  # views of the mmap held in reference cycles go before the mapping closes
            gguf.close()

    def __enter__(self) -> "Engine":
        return self._live()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: modules may already be gone
            pass

    def __repr__(self) -> str:
        c = self.config
        if self.closed:
            return f"Engine({self.path!r}, arch={c.arch}, closed)"
        return (f"Engine({self.path!r}, arch={c.arch}, layers={c.n_layer}+{c.n_nextn} MTP, d_model={c.d_model}, "
                f"max_context={self.max_context})")

    # ----- input checks -----
    def check_ids(self, ids: Any, *, what: str = "prompt") -> list[int]:
        """Validate token ids (non-empty, in the vocabulary, fits max_context) -> list[int]."""
        if isinstance(ids, (str, bytes)):
            raise InputError(f"{what} must be a sequence of token ids here, got {type(ids).__name__}")
        try:
            arr = np.asarray(ids)
        except Exception:
            raise InputError(f"{what} is not a sequence of token ids") from None
        if arr.ndim != 1:
            raise InputError(f"{what} must be a 1-D sequence of token ids, got shape {arr.shape}")
        if arr.size == 0:
            raise InputError(f"{what} is empty: at least one token is needed")
        if arr.dtype == bool or not (np.issubdtype(arr.dtype, np.integer) or
                                     (arr.dtype == object and all(isinstance(i, (int, np.integer)) and
                                                                  not isinstance(i, bool) for i in arr))):
            raise InputError(f"{what} must contain integer token ids, got dtype {arr.dtype}")
        V = self.config.n_vocab
        bad = np.nonzero((arr.astype(np.int64) < 0) | (arr.astype(np.int64) >= V))[0]
        if bad.size:
            i = int(bad[0])
            raise InputError(f"{what} token id {int(arr[i])} at position {i} is outside the vocabulary "
                             f"[0, {V})")
        if arr.size > self.max_context:
            raise InputError(f"{what} has {arr.size} tokens, more than max_context = {self.max_context}; "
                             "load with a larger max_context or shorten it")
        return [int(i) for i in arr]

    def _prompt_ids(self, ids_or_text: Any) -> list[int]:
        if isinstance(ids_or_text, str):
            if not ids_or_text:
                raise InputError("prompt is empty: at least one token is needed")
            ids = self.tokenizer.encode(ids_or_text)
            return self.check_ids(ids)
        return self.check_ids(ids_or_text)

    def _chat_ids(self, ids_or_text: Any, messages: Any, enable_thinking: bool | None,
                  chat_template_kwargs: Mapping[str, Any] | None) -> Any:
        """The prompt: `ids_or_text`, or the token ids of `messages` rendered by the chat template."""
        if messages is None:
            if enable_thinking is not None or chat_template_kwargs is not None:
                raise InputError("enable_thinking and chat_template_kwargs apply to messages=[...] only")
            if ids_or_text is None:
                raise InputError("generate needs a prompt (text or token ids) or messages=[...]")
            return ids_or_text
        if ids_or_text is not None:
            raise InputError("give either a prompt or messages=[...], not both")
        options = dict(chat_template_kwargs or {})
        if enable_thinking is not None:
            options["enable_thinking"] = bool(enable_thinking)
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **options)

    # ----- forward -----
    def forward(self, ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Teacher-forced (logits [T, vocab], final-normed hidden [T, D]), float32, chunked prefill."""
        ids = self.check_ids(ids)
        rt = self._live().runtime
        chunks, _, _ = rt.prefill(rt.new_state(), ids)
        logits = rt.chunk_logits(chunks)
        hidden = np.concatenate([np.asarray(h)[:n] for h, n in chunks])
        return logits, hidden

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits [len(ids), vocab] float32."""
        return self.forward(ids)[0]

    @property
    def mtp(self) -> MTPRuntime:
        """The MTP head's runtime, loaded on first use (it shares the trunk's embedding and LM head)."""
        if self._live()._mtp is None:
            if not self.config.has_mtp:
                raise InputError(f"{self.path}: the model has no MTP head (nextn_predict_layers = 0)")
            head = load_mtp(self.gguf, self.config, self.model, self.experts, run=self.run_config)
            mtp_backends = {f"mtp.{k}": v for k, v in matrix_backends(head, self.matrix_format.backend).items()}
            _warn_fallbacks(mtp_backends, self.matrix_format.backend, self.path)
            self.matrix_backends.update(mtp_backends)
            if self.mesh is not None:
                head = expert_parallelism.replicate_dense(head, self.mesh)
            self._mtp = MTPRuntime(head, self.max_context)
            self._mtp.path = self.path
        return self._mtp

    def mtp_logits(self, ids: Sequence[int], zero_h_first: bool = False) -> np.ndarray:
        """Teacher-forced MTP logits [len(ids) - 1, vocab] at positions 1..T-1 from pairs (ids[p],
        final-normed trunk hidden h[p-1]). zero_h_first: also feed (ids[0], h = 0) first (llama.cpp)."""
        ids = self.check_ids(ids)
        if len(ids) < 2:
            raise InputError("mtp_logits needs at least 2 tokens")
        return teacher_forced_mtp_logits(self.runtime, self.mtp, ids, zero_h_first)

    # ----- expert residency -----
    def expert_stats(self, since: dict | None = None) -> dict:
        """Expert residency stats (hit rate per layer, bytes streamed per token, callback time,
        evictions) since `since` (a `expert_counters()` snapshot) or since load. {} without a budget."""
        if self._live().residency is None:
            return {}
        res = self.residency
        now = res.counters(self.runtime)
        return res.stats(since if since is not None else res.zero_counters(now), now)

    def expert_counters(self) -> dict | None:
        """A snapshot of the cumulative residency counters (pass it to `expert_stats`)."""
        return None if self._live().residency is None else self.residency.counters(self.runtime)

    def calibrate_experts(self, prompts: Sequence[Any], save: bool | str = True) -> dict[int, list[int]]:
        """Routing counts {layer: [E]} over teacher-forced prompts (text or ids), saved for
        expert_policy="frequency": save=True beside the model (or in $SHARPI_CACHE), a path there.
        Needs an engine loaded with an expert budget (any: routing does not depend on residency)."""
        res = self._live().residency
        if res is None:
            raise InputError("calibrate_experts needs an engine loaded with expert_budget= (any budget; the "
                             "full one keeps every expert resident)")
        before = res.counters(self.runtime)["counts"]
        tokens = 0
        for p in prompts:
            ids = self._prompt_ids(p)
            self.logits(ids)
            tokens += len(ids)
        counts = expert_residency.routing_delta(before, res.counters(self.runtime)["counts"])
        if save:
            expert_residency.save_counts(counts, self.path, self.config, tokens, None if save is True else save)
        return counts

    def calibrate_draft_vocab(self, prompts: Sequence[Any], save: bool | str = True,
                              generate_tokens: int = 64) -> dict[int, int]:
        """The ranking of generate(draft_vocab=N): over each prompt (text or ids) and its greedy
        continuation (up to generate_tokens, to an EOS), how often the MTP head's full-vocabulary draft
        equals the target's greedy token, per token (`runtime.draft_vocab.count_accepted`). Saved beside
        the file (or in $SHARPI_CACHE) with save=True, at a path with a path."""
        rt = self._live().runtime
        counts: dict[int, int] = {}
        tokens = 0
        for p in prompts:
            ids = self._prompt_ids(p)
            out = self.generate(ids, max_new_tokens=generate_tokens).tokens if generate_tokens > 0 else []
            seq = [*ids, *out]
            tokens += len(seq)
            if len(seq) < 2:
                continue
            # One trunk prefill serves both: the target's teacher-forced logits (as `logits`) and the MTP
            # head's (as `mtp_logits`), which would otherwise run the prefill again.
            chunks = rt.prefill(rt.new_state(), seq).chunks
            target = np.argmax(rt.chunk_logits(chunks), axis=-1)[1:]
            draft_vocab.count_accepted(counts, target, np.argmax(self.mtp.teacher_forced_logits(seq, chunks), axis=-1))
        if not tokens:
            raise InputError("calibrate_draft_vocab needs at least one prompt")
        if save:
            draft_vocab.save(counts, self.path, tokens, None if save is True else save)
        if self._mtp is not None:
            self._mtp.forget_draft_vocabs()
        return counts

    def generate(self, ids_or_text: Any = None, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, min_p: float = 0.0, seed: int = 0, stop_on_eos: bool = True,
                 speculative: str | None = None, draft_tokens: int = 3, verify: str = "batched",
                 tree_nodes: int | None = None, max_snapshot_bytes: int | None = None,
                 kv_policy: str | None = "default", kv_budget: int | None = None, kv_window: int | None = None,
                 kv_pool: int | None = None, loop: str = "device", draft_vocab: int | None = None,
                 draft_p_min: float = 0.0, *,
                 messages: Sequence[Mapping[str, Any]] | None = None, enable_thinking: bool | None = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None, session: "Session | None" = None) -> GenerateOutput:
        """Continue a prompt (text or token ids). Greedy when temperature == 0, else seeded sampling.

        session (`Engine.session()`; `session.generate(...)` says the same): the prompt (or messages=, the
        session's new chat messages) continues the session's conversation, and only the tokens its kept
        state has not seen are prefilled (the previous reply and the new prompt); the tokens are those of
        a fresh generate over the whole conversation, bit for bit (`sharpi_jax.runtime.session`).
        out.stats adds session_reused_tokens and session_prefilled_tokens. Not with a KV eviction policy.

        messages=[{"role": ..., "content": ...}, ...] instead of a prompt: the chat rendered by the file's
        chat template with the generation prompt (`tokenizer.apply_chat_template`, special tokens parsed),
        then generated from as token ids. enable_thinking (Qwen3.5's switch) and chat_template_kwargs
        are passed to the template as variables.

        speculative="mtp": MTP speculative decoding with `draft_tokens` drafts per trunk pass, verified
        in one pass ("batched") or token by token ("sequential", the reference). The tokens are exactly
        those of speculative=None (greedy or seeded sampling alike); out.stats adds drafted, accepted,
        acceptance_rate, mean_accept_len, accept_per_position, verify_passes, draft_s, verify_s.
        With an expert budget, out.stats["experts"] is this run's residency cost (`expert_stats`).
        Always: out.stats["backends"] (matrices per backend they actually run on, e.g. {"pallas": 61})
        and out.stats["matrix_backends"] ({matrix: backend}; `Engine.matrix_backends` adds type, shape
        and why a matrix is not on the selected backend).

        speculative="mtp_tree": a draft TREE of up to `tree_nodes` nodes (default max(8, draft_tokens))
        and depth `draft_tokens` per trunk pass, always holding the greedy chain, verified in one pass
        (`sharpi_jax.runtime.tree`); same tokens as speculative=None. max_snapshot_bytes caps the GDN
        snapshots a pass keeps (one per node, stats["snapshot_bytes_per_node"]) by lowering tree_nodes.
        out.stats adds tree_nodes, accept_per_depth and snapshot_bytes_per_node.

        kv_policy="snapkv": SnapKV eviction at prefill on the attention layers (trunk and MTP head): a
        prompt longer than kv_budget keeps, per KV head, its last kv_window positions and the
        kv_budget - kv_window prefix positions they attend to most (attention pooled over kv_pool
        neighbours); decoding and speculative verify then run on the compacted cache of kv_budget +
        max_new_tokens slots, and speculative output equals plain output with the same eviction.
        "default": the engine's setting (`sj.load(kv_policy=...)`); None: no eviction; sizes left None
        take the engine's, else kv_window 32 and kv_pool 7. out.stats adds kv_slots (KV slots in use at
        the end), kv_evicted (prompt positions dropped per attention layer and KV head), kv_capacity.

        loop="device": after the prefill, the whole decode loop (MTP off, or the MTP chain or tree with
        batched verify: draft, verify, accept, rollback, stop) runs as one jitted program on the device
        (`sharpi_jax.runtime.device_loop`); "host": one jitted call per step or pass driven from Python,
        the sequential reference (same tokens and pass stats bit for bit). verify="sequential" runs the
        host loop either way. out.stats["loop"] names the loop that ran; the device loop reports no
        draft_s / verify_s split.

        draft_vocab=N (speculative="mtp"): the MTP head drafts over the N best-ranked token ids only (the
        ranking of `calibrate_draft_vocab`, saved beside the file, else token id order); verification
        uses the full head, so the tokens are unchanged. out.stats["draft_vocab"] = N and
        out.stats["draft_vocab_ranking"] = the ranking's file (or the fallback's name).

        draft_p_min=p (speculative="mtp", 0 <= p < 1): an adaptive chain length, as llama.cpp's
        --draft-p-min: a pass stops drafting before the first draft whose probability under the MTP head
        (its softmax over the vocabulary it drafts from) is below p, and verifies only the drafts made
        (fewer rows: the rows left out read no expert). Verification is unchanged, so the tokens are too.
        """
        opts = GenerateOptions(
            max_new_tokens=max_new_tokens, stop_on_eos=stop_on_eos, speculative=speculative,
            draft_tokens=draft_tokens, verify=verify, tree_nodes=tree_nodes, max_snapshot_bytes=max_snapshot_bytes,
            loop=loop, draft_vocab=draft_vocab, draft_p_min=draft_p_min,
            sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed))
        kv = _kv_policy(kv_policy, kv_budget, kv_window, kv_pool, self.kv_policy)
        if session is None:
            return self.generate_with(self._chat_ids(ids_or_text, messages, enable_thinking, chat_template_kwargs),
                                      opts, kv)
        if not isinstance(session, Session) or session.engine is not self:
            raise InputError("session must be a Session of this engine (engine.session())")
        if kv is not None:
            raise InputError("a session keeps every KV position: not with a KV eviction policy (kv_policy=None)")
        if messages is not None:
            chat = session.messages + list(messages)
            ids = self._chat_ids(ids_or_text, chat, enable_thinking, chat_template_kwargs)
        else:
            ids = session.ids + self._prompt_ids(self._chat_ids(ids_or_text, None, enable_thinking,
                                                                chat_template_kwargs))
        resume = session_state.Resume(session.prefix, self.mtp if self.config.has_mtp else None)
        out = self.generate_with(ids, opts, None, resume)
        session.prefix, session.ids = resume.saved, list(ids) + out.tokens
        if messages is not None:
            session.messages = chat + [{"role": "assistant", "content": out.text}]
        out.stats["session_reused_tokens"] = resume.reused
        out.stats["session_prefilled_tokens"] = len(ids) - resume.reused
        return out

    def session(self) -> "Session":
        """A new conversation whose state is kept between turns (`Session`)."""
        self._live()
        return Session(self)

    def generate_batch(self, prompts: Sequence[Any] | None = None, max_new_tokens: int = 64, temperature: float = 0.0,
                       top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int = 0, stop_on_eos: bool = True,
                       speculative: str | None = None, draft_tokens: int = 3, tree_nodes: int | None = None,
                       max_snapshot_bytes: int | None = None, draft_vocab: int | None = None,
                       draft_p_min: float = 0.0, *, seeds: Sequence[int] | None = None,
                       messages: Sequence[Sequence[Mapping[str, Any]]] | None = None, enable_thinking: bool | None = None,
                       chat_template_kwargs: Mapping[str, Any] | None = None) -> list[GenerateOutput]:
        """Generate after each of `prompts` (texts or token id lists, any lengths) together: one jitted
        device loop for the batch, each step's (or pass's) products over every sequence's rows at once,
        so the weights and each used expert are read once per step for the batch
        (`sharpi_jax.runtime.batch`). Options as `generate` (greedy when temperature == 0; speculative
        None, "mtp" or "mtp_tree", each sequence drafting and accepting on its own); seeds: one sampling
        seed per prompt (default `seed` for all); messages=[chat, ...] instead of prompts: each chat
        rendered by the chat template.

        Returns one `GenerateOutput` per prompt, in order. With kernels="ggml" (the CPU default) each
        sequence's tokens are bitwise those of `generate` on its prompt alone with its seed. stats: the
        sequence's prompt_tokens, generated_tokens, stop_reason, prefill_s and pass stats, and the batch's
        batch, batch_decode_s and batch_decode_tok_s (all sequences' tokens per second of decode).
        Not with an expert budget, expert parallelism or a KV eviction policy (one line says so)."""
        self._live()
        if self.residency is not None:
            raise InputError("generate_batch: not with an expert_budget (one residency cache serves one "
                             "sequence's steps); load without expert_budget, or generate prompts one at a time")
        if self.mesh is not None:
            raise InputError("generate_batch: not with expert_parallel yet; generate prompts one at a time")
        if self.kv_policy is not None:
            raise InputError("generate_batch: not with a KV eviction policy (kv_policy); load without it")
        if messages is not None:
            if prompts is not None:
                raise InputError("give either prompts or messages=[chat, ...], not both")
            if isinstance(messages, Mapping) or not all(isinstance(m, Sequence) and not isinstance(m, str)
                                                        for m in messages):
                raise InputError("messages must be a list of chats, each a list of {'role', 'content'} dicts")
            prompts = [self._chat_ids(None, m, enable_thinking, chat_template_kwargs) for m in messages]
        elif enable_thinking is not None or chat_template_kwargs is not None:
            raise InputError("enable_thinking and chat_template_kwargs apply to messages=[...] only")
        if prompts is None or isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
            raise InputError("generate_batch needs a non-empty list of prompts (texts or token id lists)")
        ids = [self._prompt_ids(p) for p in prompts]
        opts = GenerateOptions(
            max_new_tokens=max_new_tokens, stop_on_eos=stop_on_eos, speculative=speculative,
            draft_tokens=draft_tokens, tree_nodes=tree_nodes, max_snapshot_bytes=max_snapshot_bytes,
            draft_vocab=draft_vocab, draft_p_min=draft_p_min,
            sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed))
        mtp = self.mtp if opts.speculative is not None else None
        vocab = mtp.draft_vocab(opts.draft_vocab) if opts.draft_vocab is not None else None
        stop_ids = self.tokenizer.eog_ids if opts.stop_on_eos else ()
        outs = []
        for g in batch.generate_batch(self.runtime, mtp, ids, opts, stop_ids, vocab, seeds):
            g.stats["backends"] = backend_summary(self.matrix_backends)
            shown = g.tokens[:-1] if g.tokens and g.tokens[-1] in stop_ids else g.tokens
            outs.append(GenerateOutput(tokens=g.tokens, text=self.tokenizer.decode(shown), stats=g.stats))
        return outs

    def generate_with(self, ids_or_text: Any, opts: GenerateOptions, kv: SnapKV | None = None,
                      resume: session_state.Resume | None = None) -> GenerateOutput:
        """`generate` with its options as one validated `GenerateOptions` (the CLI builds one) and the KV
        eviction policy resolved (None: none); resume: a session's continued prefill."""
        if not isinstance(opts, GenerateOptions):
            raise InputError(f"options must be a GenerateOptions, got {type(opts).__name__}")
        self._live()
        mtp = self.mtp if opts.speculative is not None else None
        vocab = mtp.draft_vocab(opts.draft_vocab) if opts.draft_vocab is not None else None
        ids = self._prompt_ids(ids_or_text)
        before = self.residency.counters(self.runtime) if self.residency is not None else None
        stop_ids = self.tokenizer.eog_ids if opts.stop_on_eos else ()
        tokens, stats = loops.run(self.runtime, mtp, ids, opts, stop_ids, kv, vocab, resume)
        stats.setdefault("loop", "host")
        if vocab is not None:
            stats["draft_vocab_ranking"] = mtp.draft_ranking
        if self.residency is not None:
            stats["experts"] = self.residency.stats(before, self.residency.counters(self.runtime))
        stats["backends"] = backend_summary(self.matrix_backends)  # matrices per backend actually used
        stats["matrix_backends"] = {k: v["backend"] for k, v in self.matrix_backends.items()}
        shown = tokens[:-1] if tokens and tokens[-1] in stop_ids else tokens
        return GenerateOutput(tokens=tokens, text=self.tokenizer.decode(shown), stats=stats)


class Session:
    """A conversation with its prefilled state kept between turns (`Engine.session()`).

    `session.generate(prompt | messages=[...], **generate options)` continues the conversation: the new
    prompt's token ids (or the chat with the new messages, rendered by the chat template) after
    everything so far, the replies included; only the tokens the kept state has not seen are prefilled,
    and the tokens are bitwise those of `engine.generate` over the whole conversation. `fork()` branches
    it cheaply (the kept state is shared, never modified). ids: the conversation's token ids so far;
    messages: its chat (messages= turns, with the assistant replies as text); prefix: the kept state
    (`sharpi_jax.runtime.session.Prefix`); prefilled: how many of the ids it holds.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.ids: list[int] = []
        self.messages: list[dict] = []
        self.prefix: session_state.Prefix | None = None

    @property
    def prefilled(self) -> int:
        return 0 if self.prefix is None else len(self.prefix.ids)

    def generate(self, ids_or_text: Any = None, **options: Any) -> GenerateOutput:
        """`Engine.generate(ids_or_text, session=self, **options)`."""
        return self.engine.generate(ids_or_text, session=self, **options)

    def fork(self) -> "Session":
        """A copy to branch from: the same conversation and kept state (shared arrays, never donated)."""
        s = Session(self.engine)
        s.ids, s.messages, s.prefix = list(self.ids), copy.deepcopy(self.messages), self.prefix
        return s

    def __repr__(self) -> str:
        return f"Session({len(self.ids)} tokens, {self.prefilled} prefilled)"


def load(path: str | os.PathLike[str] | None = None, max_context: int = 4096, dtype: Any = jnp.float32,
         **kw: Any) -> Engine:
    """Load a GGUF (qwen35moe / qwen35 / qwen3next). path=None: the embedded default model.

    Options: max_context (KV cache positions), dtype (float32 only), run_config (a `RunConfig`: how the
    model runs) and its fields as single options, which override it: prefill_buckets (prefill chunk
    sizes, each compiled once), expert_mode ("grouped" | "per_token" routed-expert dispatch; bitwise
    equal), row_kernel ("gemm" | "gemv"), gdn_chunk, kernels ("auto" | "xla" |
    "pallas" | "reference" | any name registered in `sharpi_jax.quant.registry`: the kernel backend of
    every matrix and routed-expert stack, "auto" = the best-ranked for the platform: Pallas on a GPU,
    ggml on a CPU, XLA where neither can run), repack
    ("auto": on XLA:CPU quantized matrices of >= 4M weights are repacked to int8 rows, lossy, 1 B/weight:
    the fast CPU path for an LM head; None: every matrix in its GGUF encoding, exact; "int8": all
    quantized matrices repacked); progress (tqdm bar; default: files >= 256 MiB),
    expert_budget (routed-expert bytes kept on the device: an int, "6GiB", or a share like "25%";
    None: all) and expert_policy ("static" | "frequency" | "lru" | "slru"), plus the residency options
    of `sharpi_jax.experts.residency.configure` (device_budget, expert_counts, ...).
    expert_parallel=N: shard the routed experts by expert id over a Mesh of the first N devices (all
    hosts' after `jax.distributed.initialize()`), dense weights replicated; logits bitwise those of one
    device (`sharpi_jax.experts.parallel`). Not with an expert_budget or kernels="pallas" yet.
    kv_policy (None | "snapkv"), kv_budget, kv_window, kv_pool: the default KV eviction of
    `Engine.generate`.

    `engine.close()` (or `with sj.load(...) as engine:`, or dropping the last reference) releases the
    engine's compiled programs, device arrays and mmap.
    """
    if path is None:
        from sharpi_jax.assets import default_model_path

        path = default_model_path()
    return Engine(path, max_context=max_context, dtype=dtype, **kw)
