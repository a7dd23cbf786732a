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
import numpy as np

from sharpi_jax.config import ModelConfig, RunConfig
from sharpi_jax.errors import InputError
from sharpi_jax.experts import parallel as expert_parallelism
from sharpi_jax.experts import residency as expert_residency
from sharpi_jax.experts.provider import GGUFExperts
from sharpi_jax.experts.residency.options import ExpertResidency
from sharpi_jax.gguf import GGUFFile, read_model_config
from sharpi_jax.gguf.tokenizer import Tokenizer
from sharpi_jax.model import snapkv
from sharpi_jax.model.footprint import backend_summary, fallback_message, matrix_backends
from sharpi_jax.model.snapkv import SnapKV
from sharpi_jax.model.weights import load_model, load_mtp
from sharpi_jax.quant import MatrixFormat
from sharpi_jax.runtime import batch, draft_vocab
from sharpi_jax.runtime import session as session_state
from sharpi_jax.runtime.generate import GenerateOutput
from sharpi_jax.runtime.options import ENGINE_KV, Chain, GenerateOptions
from sharpi_jax.runtime.mtp import MTPRuntime, teacher_forced_mtp_logits
from sharpi_jax.runtime.stats import GenerateStats, SessionStats
from sharpi_jax.runtime.steps import Runtime
from sharpi_jax.runtime.strategies import strategy_for



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



def _template_kwargs(chat_template_kwargs: Any, enable_thinking: Any) -> dict[str, Any] | None:
    """The chat template's variables: chat_template_kwargs, plus enable_thinking when given (None: none)."""
    if chat_template_kwargs is None and enable_thinking is None:
        return None
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
        raise InputError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
    out = dict(chat_template_kwargs or {})
    if enable_thinking is not None:
        out["enable_thinking"] = bool(enable_thinking)
    return out


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

    def __init__(self, path: str | os.PathLike[str], max_context: int = 4096, *, run: RunConfig | None = None,
                 residency: ExpertResidency | None = None, parallel: int | None = None, kv: SnapKV | None = None,
                 progress: bool | None = None):
        """Use `sj.load`; the options as `load` describes them, already typed."""
        if isinstance(max_context, bool) or not isinstance(max_context, (int, np.integer)) or max_context < 1:
            raise InputError(f"max_context must be a positive integer, got {max_context!r}")
        if run is not None and not isinstance(run, RunConfig):
            raise InputError(f"run must be a sharpi_jax.RunConfig, got {type(run).__name__}")
        if kv is not None and not isinstance(kv, SnapKV):
            raise InputError(f"kv must be a sharpi_jax.SnapKV or None, got {type(kv).__name__}")
        if residency is not None and not isinstance(residency, ExpertResidency):
            raise InputError(f"residency must be a sharpi_jax.ExpertResidency, got {type(residency).__name__}")
        self.kv_policy: SnapKV | None = kv  # the default KV eviction of `generate` (options kv="engine")
        self.run_config: RunConfig = run or RunConfig()
        self.path = os.fspath(path)
        self.gguf = GGUFFile(path)  # kept open: raw expert views may alias the mmap
        self.config: ModelConfig = read_model_config(self.gguf)
        self.tokenizer = Tokenizer.from_gguf_fields(self.gguf.metadata, source=self.gguf.source)
        run = self.run_config
        self.matrix_format = MatrixFormat.for_run(run)
        _say_if_ggml_missing(run.kernels, self.matrix_format.backend)
        self.mesh = None  # the expert-parallel Mesh (expert_parallel=N), else one device
        if parallel is not None:
            self.mesh = expert_parallelism.expert_mesh(
                expert_parallelism.check_expert_parallel(parallel, self.config))
        self.residency = expert_residency.configure(self.gguf, self.config, residency, self.mesh)
        if self.mesh is not None:
            self.experts = expert_parallelism.ShardedGGUFExperts(self.gguf, self.config, self.mesh, run,
                                                                 self.residency)
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

    def _chat_ids(self, ids_or_text: Any, messages: Any, template: dict[str, Any] | None) -> Any:
        """The prompt: `ids_or_text`, or the token ids of `messages` rendered by the chat template with the
        variables `template`."""
        if messages is None:
            if template is not None:
                raise InputError("enable_thinking and chat_template_kwargs apply to messages=[...] only")
            if ids_or_text is None:
                raise InputError("generate needs a prompt (text or token ids) or messages=[...]")
            return ids_or_text
        if ids_or_text is not None:
            raise InputError("give either a prompt or messages=[...], not both")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  **(template or {}))

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

    def options(self, max_new_tokens: int = 64, *, kv_policy: str | None = "default", kv_budget: int | None = None,
                kv_window: int | None = None, kv_pool: int | None = None, **keywords: Any) -> GenerateOptions:
        """The `GenerateOptions` that `generate`'s keyword shortcuts stand for: `GenerateOptions.from_keywords`
        (temperature, top_k, top_p, min_p, seed, stop_on_eos, speculative, draft_tokens, verify, tree_nodes,
        max_snapshot_bytes, loop, draft_vocab, draft_p_min), with the KV keywords resolved against this
        engine's setting: kv_policy "default" (the engine's), None (no eviction) or "snapkv"; kv_budget,
        kv_window, kv_pool left None take the engine's, else kv_window 32 and kv_pool 7."""
        sizes = (kv_budget, kv_window, kv_pool)
        kv: Any = ENGINE_KV if kv_policy == "default" and sizes == (None, None, None) else \
            _kv_policy(kv_policy, *sizes, self.kv_policy)
        return GenerateOptions.from_keywords(max_new_tokens, kv=kv, **keywords)

    def _typed_options(self, options: GenerateOptions | None, shortcuts: dict[str, Any]) -> GenerateOptions:
        if options is None:
            return self.options(**shortcuts)
        if not isinstance(options, GenerateOptions):
            raise InputError(f"options must be a sharpi_jax.GenerateOptions, got {type(options).__name__}")
        if shortcuts:
            raise InputError(f"give options= or keyword shortcuts {sorted(shortcuts)}, not both")
        return options

    def generate(self, prompt: Any = None, options: GenerateOptions | None = None, *,
                 messages: Sequence[Mapping[str, Any]] | None = None, chat_template_kwargs: Mapping[str, Any] | None = None,
                 session: "Session | None" = None, **shortcuts: Any) -> GenerateOutput:
        """Continue a prompt (text or token ids) with `options` (a `GenerateOptions`; default: greedy, 64
        tokens, MTP off), or with keyword shortcuts that build the same object (`Engine.options`:
        `generate(prompt, speculative="mtp", draft_tokens=3, temperature=0.7, seed=1)`).

        messages=[{"role": ..., "content": ...}, ...] instead of a prompt: the chat rendered by the file's
        chat template with the generation prompt (special tokens parsed), then generated from as token
        ids; chat_template_kwargs are template variables (the shortcut enable_thinking=... is Qwen3.5's).
        session (`Engine.session()`): the prompt or messages continue the session's conversation, only the
        tokens its kept state has not seen are prefilled, and the tokens are those of a fresh generate over
        the whole conversation, bit for bit (`sharpi_jax.runtime.session`); not with KV eviction.

        Returns `GenerateOutput(tokens, text, stats)`: the generated part only; the speculative modes give
        the tokens of MTP off bit for bit (greedy or seeded). What stats holds: docs/api.md.
        """
        template = _template_kwargs(chat_template_kwargs, shortcuts.pop("enable_thinking", None))
        opts = self._typed_options(options, shortcuts)
        if session is None:
            return self.generate_with(self._chat_ids(prompt, messages, template), opts)
        if not isinstance(session, Session) or session.engine is not self:
            raise InputError("session must be a Session of this engine (engine.session())")
        if self._kv(opts) is not None:
            raise InputError("a session keeps every KV position: not with a KV eviction policy (kv_policy=None)")
        if messages is not None:
            chat = session.messages + list(messages)
            ids = self._chat_ids(prompt, chat, template)
        else:
            ids = session.ids + self._prompt_ids(self._chat_ids(prompt, None, template))
        resume = session_state.Resume(session.prefix, self.mtp if self.config.has_mtp else None)
        out = self.generate_with(ids, dataclasses.replace(opts, kv=None), resume)
        session.prefix, session.ids = resume.saved, list(ids) + out.tokens
        if messages is not None:
            session.messages = chat + [{"role": "assistant", "content": out.text}]
        out.stats = dataclasses.replace(out.stats, session=SessionStats(reused_tokens=resume.reused,
                                                                         prefilled_tokens=len(ids) - resume.reused))
        return out

    def session(self) -> "Session":
        """A new conversation whose state is kept between turns (`Session`)."""
        self._live()
        return Session(self)

    def generate_batch(self, prompts: Sequence[Any] | None = None, options: GenerateOptions | None = None, *,
                       seeds: Sequence[int] | None = None, messages: Sequence[Sequence[Mapping[str, Any]]] | None = None,
                       chat_template_kwargs: Mapping[str, Any] | None = None, **shortcuts: Any) -> list[GenerateOutput]:
        """Generate after each of `prompts` (texts or token id lists, any lengths) together: one jitted
        device loop for the batch, each step's (or pass's) products over every sequence's rows at once,
        so the weights and each used expert are read once per step for the batch
        (`sharpi_jax.runtime.batch`). options (or shortcuts) as `generate`, each sequence drafting and
        accepting on its own; seeds: one sampling seed per prompt (default the options' seed for all);
        messages=[chat, ...] instead of prompts: each chat rendered by the chat template.

        Returns one `GenerateOutput` per prompt, in order. With kernels="ggml" (the CPU default) each
        sequence's tokens are bitwise those of `generate` on its prompt alone with its seed. stats: the
        sequence's own, and `stats.batch` (the batch's size and decode time, all sequences' tokens per
        second of decode, the sequence's seed). Not with an expert budget, expert parallelism, KV eviction,
        loop="host" or verify="sequential" (the batch is one device loop of batched passes)."""
        template = _template_kwargs(chat_template_kwargs, shortcuts.pop("enable_thinking", None))
        opts = self._typed_options(options, shortcuts)
        self._live()
        if self.residency is not None:
            raise InputError("generate_batch: not with an expert_budget (one residency cache serves one "
                             "sequence's steps); load without expert_budget, or generate prompts one at a time")
        if self.mesh is not None:
            raise InputError("generate_batch: not with expert_parallel yet; generate prompts one at a time")
        if self._kv(opts) is not None:
            raise InputError("generate_batch: not with a KV eviction policy (kv); load without it")
        if not opts.device_loop:
            raise InputError(f"generate_batch runs the device loop with batched verify: not with loop={opts.loop!r}, "
                             f"verify={opts.verify!r}; generate prompts one at a time for those")
        if messages is not None:
            if prompts is not None:
                raise InputError("give either prompts or messages=[chat, ...], not both")
            if isinstance(messages, Mapping) or not all(isinstance(m, Sequence) and not isinstance(m, str)
                                                        for m in messages):
                raise InputError("messages must be a list of chats, each a list of {'role', 'content'} dicts")
            prompts = [self._chat_ids(None, m, template) for m in messages]
        elif template is not None:
            raise InputError("enable_thinking and chat_template_kwargs apply to messages=[...] only")
        if prompts is None or isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
            raise InputError("generate_batch needs a non-empty list of prompts (texts or token id lists)")
        ids = [self._prompt_ids(p) for p in prompts]
        mtp = self.mtp if opts.speculation is not None else None
        vocab = self._draft_vocab(opts, mtp)
        stop_ids = self.tokenizer.eog_ids if opts.stop_on_eos else ()
        outs = []
        for g in batch.generate_batch(self.runtime, mtp, ids, opts, stop_ids, vocab, seeds):
            g.stats["backends"] = backend_summary(self.matrix_backends)
            shown = g.tokens[:-1] if g.tokens and g.tokens[-1] in stop_ids else g.tokens
            outs.append(GenerateOutput(tokens=g.tokens, text=self.tokenizer.decode(shown),
                                       stats=GenerateStats.from_dict(g.stats)))
        return outs

    def _kv(self, opts: GenerateOptions) -> SnapKV | None:
        """The KV eviction a run takes: the options' kv, or the engine's for kv="engine"."""
        return self.kv_policy if opts.kv == ENGINE_KV else opts.kv

    @staticmethod
    def _draft_vocab(opts: GenerateOptions, mtp: MTPRuntime | None) -> draft_vocab.DraftVocab | None:
        spec = opts.speculation
        n = getattr(spec, "draft_vocab", None)  # a Chain's or a Tree's
        return mtp.draft_vocab(n) if n is not None else None

    def generate_with(self, ids_or_text: Any, opts: GenerateOptions,
                      resume: session_state.Resume | None = None) -> GenerateOutput:
        """`generate` of a prompt (text or ids) with validated `GenerateOptions`; resume: a session's
        continued prefill."""
        if not isinstance(opts, GenerateOptions):
            raise InputError(f"options must be a GenerateOptions, got {type(opts).__name__}")
        self._live()
        mtp = self.mtp if opts.speculation is not None else None
        vocab = self._draft_vocab(opts, mtp)
        ids = self._prompt_ids(ids_or_text)
        before = self.residency.counters(self.runtime) if self.residency is not None else None
        stop_ids = self.tokenizer.eog_ids if opts.stop_on_eos else ()
        tokens, stats = strategy_for(opts.speculation).run(self.runtime, mtp, ids, opts, stop_ids, self._kv(opts),
                                                           vocab, resume)
        stats.setdefault("loop", "host")
        if vocab is not None:
            stats["draft_vocab_ranking"] = mtp.draft_ranking
        if self.residency is not None:
            stats["experts"] = self.residency.stats(before, self.residency.counters(self.runtime))
        stats["backends"] = backend_summary(self.matrix_backends)  # matrices per backend actually used
        stats["matrix_backends"] = {k: v["backend"] for k, v in self.matrix_backends.items()}
        shown = tokens[:-1] if tokens and tokens[-1] in stop_ids else tokens
        return GenerateOutput(tokens=tokens, text=self.tokenizer.decode(shown), stats=GenerateStats.from_dict(stats))


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


_NOT_GIVEN: Any = object()  # repack=None is a value (no repacking), so "not given" needs its own marker


def load_shortcuts(run: RunConfig | None = None, residency: ExpertResidency | None = None, parallel: int | None = None,
                   kv: SnapKV | None = None, *, dtype: Any = None, run_config: RunConfig | None = None,
                   prefill_buckets: Sequence[int] | None = None, expert_mode: str | None = None,
                   row_kernel: str | None = None, gdn_chunk: int | None = None, gdn_step: str | None = None,
                   kernels: str | None = None, repack: Any = _NOT_GIVEN, verify_head: str | None = None,
                   expert_parallel: int | None = None,
                   kv_policy: str | None = None,
                   kv_budget: int | None = None, kv_window: int | None = None, kv_pool: int | None = None,
                   **residency_keywords: Any) -> tuple[RunConfig | None, ExpertResidency | None, int | None, SnapKV | None]:
    """`sj.load`'s keyword shortcuts folded into its typed options -> (run, residency, parallel, kv).

    RunConfig fields (prefill_buckets, expert_mode, row_kernel, gdn_chunk, gdn_step, kernels, repack, verify_head)
    override `run`'s (run_config= is `run`'s other name); expert_budget, expert_policy and the residency keywords
    (`ExpertResidency.keywords`) build an `ExpertResidency`; expert_parallel is `parallel`; kv_policy
    ("snapkv" | None), kv_budget, kv_window, kv_pool build a `SnapKV`. dtype: float32 only. A typed
    option and its own shortcuts together are an error."""
    _check_dtype(dtype)
    if run_config is not None:
        if run is not None:
            raise InputError("give run= or run_config=, not both")
        if not isinstance(run_config, RunConfig):
            raise InputError(f"run_config must be a sharpi_jax.RunConfig, got {type(run_config).__name__}")
        run = run_config
    if run is not None and not isinstance(run, RunConfig):
        raise InputError(f"run must be a sharpi_jax.RunConfig, got {type(run).__name__}")
    fields = dict(prefill_buckets=prefill_buckets, expert_mode=expert_mode, row_kernel=row_kernel,
                  gdn_chunk=gdn_chunk, gdn_step=gdn_step, kernels=kernels, verify_head=verify_head)
    if any(v is not None for v in fields.values()) or repack is not _NOT_GIVEN:
        run = (run or RunConfig()).replace(**fields)
        if repack is not _NOT_GIVEN:
            run = dataclasses.replace(run, repack=repack)
    if residency_keywords:
        if residency is not None:
            raise InputError(f"give residency= or its keywords {sorted(residency_keywords)}, not both")
        residency = ExpertResidency.from_keywords(**residency_keywords)
    if expert_parallel is not None:
        if parallel is not None:
            raise InputError("give parallel= or expert_parallel=, not both")
        parallel = expert_parallel
    if (kv_policy, kv_budget, kv_window, kv_pool) != (None, None, None, None):
        if kv is not None:
            raise InputError("give kv= or kv_policy / kv_budget / kv_window / kv_pool, not both")
        kv = _kv_policy(kv_policy, kv_budget, kv_window, kv_pool, None)
    return run, residency, parallel, kv


def load(path: str | os.PathLike[str] | None = None, *, max_context: int = 4096, run: RunConfig | None = None,
         residency: ExpertResidency | None = None, parallel: int | None = None, kv: SnapKV | None = None,
         progress: bool | None = None, **shortcuts: Any) -> Engine:
    """Load a GGUF (qwen35moe / qwen35 / qwen3next). path=None: the embedded default model.

    max_context: KV cache positions. run: a `RunConfig` (how the model runs: kernel backend, prefill
    buckets, expert dispatch, repacking; each documented on its field). residency: an `ExpertResidency`
    (routed experts kept on the device within a budget, cold ones streamed from the file; None: all
    resident). parallel=N: shard the routed experts by expert id over a Mesh of the first N devices (all
    hosts' after `jax.distributed.initialize()`), dense weights replicated; logits bitwise those of one
    device (`sharpi_jax.experts.parallel`; any kernel backend); with a residency, its budget is per device. kv: a
    `SnapKV`, the default KV eviction of `Engine.generate` (None: none). progress: a tqdm bar (default:
    files >= 256 MiB).

    Keyword shortcuts build the same objects (`load_shortcuts`): `sj.load(path, kernels="xla",
    expert_budget="25%", expert_policy="lru", expert_parallel=2, kv_policy="snapkv", kv_budget=256)`.

    `engine.close()` (or `with sj.load(...) as engine:`, or dropping the last reference) releases the
    engine's compiled programs, device arrays and mmap.
    """
    if path is None:
        from sharpi_jax.assets import default_model_path

        path = default_model_path()
    run, residency, parallel, kv = load_shortcuts(run, residency, parallel, kv, **shortcuts)
    return Engine(path, max_context, run=run, residency=residency, parallel=parallel, kv=kv, progress=progress)
