"""Chat templates: render a GGUF's `tokenizer.chat_template` (Jinja) as Hugging Face transformers does.

The environment matches transformers' `apply_chat_template`: `jinja2.sandbox.ImmutableSandboxedEnvironment`
with `trim_blocks`, `lstrip_blocks` and the loop-controls extension, a `tojson` filter that keeps
non-ASCII text, and the `raise_exception` / `strftime_now` globals; the template sees `messages`,
`tools`, `documents`, `add_generation_prompt`, the BOS / EOS token strings and any extra keyword
(Qwen3.5's thinking switch: `enable_thinking=False`). The sandbox refuses attribute access outside
it (`''.__class__`) and mutation of the passed objects. Every template problem is an `InputError`.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any, Mapping, Sequence

from sharpi_jax.errors import InputError

CHAT_TEMPLATE_KEY = "tokenizer.chat_template"


class TemplateRaised(InputError):
    """The template called raise_exception (e.g. messages in an order it does not accept)."""


def _raise_exception(message: str):
    raise TemplateRaised(f"chat template: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_template(source: str):
    """The compiled template (cached per text); a syntax error is an InputError."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise InputError(f"chat template does not parse: {_one_line(e)}") from None


def render(source: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
           tools: Sequence[Any] | None = None, documents: Sequence[Any] | None = None,
           special_tokens: Mapping[str, str] | None = None, **kwargs: Any) -> str:
    """Render chat template `source` for `messages` ([{"role": ..., "content": ...}, ...]).

    `special_tokens` (bos_token, eos_token, ...) and `kwargs` (e.g. enable_thinking) become template
    variables, as in transformers. Returns the prompt text (special tokens as text)."""
    import jinja2

    _check_messages(messages)
    template = compile_template(source)
    try:
        return template.render(messages=messages, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **(special_tokens or {}), **kwargs)
    except TemplateRaised:
        raise
    except jinja2.exceptions.SecurityError as e:
        raise InputError(f"chat template refused by the sandbox: {_one_line(e)}") from None
    except jinja2.TemplateError as e:
        raise InputError(f"chat template failed: {_one_line(e)}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise InputError(f"chat template failed on these messages: {type(e).__name__}: {_one_line(e)}") from None


def _check_messages(messages: Any) -> None:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise InputError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got "
                         f"{type(messages).__name__}")
    if not messages:
        raise InputError("messages is empty: at least one message is needed")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m:
            raise InputError(f"message {i} must be a dict with a 'role', got {m!r:.80}")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
