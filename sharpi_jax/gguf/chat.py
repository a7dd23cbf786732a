"""Chat templates: render a GGUF's `tokenizer.chat_template` (Jinja) as Hugging Face transformers does.

The environment matches transformers' `apply_chat_template`: `jinja2.sandbox.ImmutableSandboxedEnvironment`
with `trim_blocks`, `lstrip_blocks` and the loop-controls extension, a `tojson` filter that keeps
non-ASCII text, and the `raise_exception` / `strftime_now` globals; the template sees `messages`,
`tools`, `documents`, `add_generation_prompt`, the BOS / EOS token strings and any extra keyword
(Qwen3.5's thinking switch: `enable_thinking=False`). The sandbox refuses attribute access outside
it (`''.__class__`) and mutation of the passed objects. Every template problem is an `InputError`.

A template is untrusted text, so its work is bounded (`TemplateLimits`): items of one `range`, loop
iterations of a render, the size of any string, list or dict it builds (measured before the operation
that would build it: `*`, `+`, `~`, `%`, `**`, every call and filter), the text it emits and a
wall-clock budget. A breach raises one `TemplateLimitError` naming the template and the limit.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import json
import re
import time
from datetime import datetime
from typing import Any, Iterable, Mapping, Sequence

from sharpi_jax.errors import InputError

CHAT_TEMPLATE_KEY = "tokenizer.chat_template"


class TemplateRaised(InputError):
    """The template called raise_exception (e.g. messages in an order it does not accept)."""


class TemplateLimitError(InputError):
    """A chat template went over one of its `TemplateLimits`."""


@dataclasses.dataclass(frozen=True)
class TemplateLimits:
    """Bounds on the work of one render (sizes: approximate characters as text; a container counts its
    items' sizes plus 8 per item)."""

    max_range: int = 100_000  # items of one range(...)
    max_iterations: int = 1_000_000  # loop iterations (for loops, filter generators) of one render
    max_size: int = 8_000_000  # any string, list or dict the template builds, and any integer argument
    max_output: int = 16_000_000  # text emitted in all (output, captured blocks, macro bodies)
    max_int_bits: int = 65_536  # integers the template computes
    time_s: float = 1.0  # wall-clock budget of one render


DEFAULT_LIMITS = TemplateLimits()


class _Render:
    """The counters of one render."""

    def __init__(self, name: str, limits: TemplateLimits):
        self.name, self.limits = name, limits
        self.deadline = time.perf_counter() + limits.time_s
        self.iterations = 0
        self.emitted = 0
        self.memo: dict[int, tuple[Any, int]] = {}  # id -> (an input container, its size)

    def remember(self, inputs: Any) -> None:
        """Measure the inputs once: later checks look their containers up."""
        _size(inputs, 1 << 62, self.memo, insert=True)


_ACTIVE: contextvars.ContextVar[_Render | None] = contextvars.ContextVar("sharpi_chat_render", default=None)


def _breach(what: str, limit: str, value: Any) -> TemplateLimitError:
    r = _ACTIVE.get()
    name = r.name if r is not None else "chat template"
    return TemplateLimitError(f"{name}: {what}, over the limit {limit}={value}")


def _limits() -> TemplateLimits:
    r = _ACTIVE.get()
    return r.limits if r is not None else DEFAULT_LIMITS


def _tick(iterations: int = 0) -> None:
    r = _ACTIVE.get()
    if r is None:
        return
    if iterations:
        r.iterations += iterations
        if r.iterations > r.limits.max_iterations:
            raise _breach(f"more than {r.limits.max_iterations} loop iterations", "max_iterations",
                          r.limits.max_iterations)
    if time.perf_counter() > r.deadline:
        raise _breach(f"rendering took more than {r.limits.time_s:g} s", "time_s", r.limits.time_s)


def _measure(x: Any, limit: int) -> int:
    """Approximate size of x as text (characters; containers: their items plus 8 per item), counted
    until it passes `limit` (then any value > limit). The render's inputs are measured once (`_Render`;
    the sandbox keeps them immutable)."""
    r = _ACTIVE.get()
    return _size(x, limit, r.memo if r is not None else None)


def _size(v: Any, limit: int, memo: dict | None, insert: bool = False) -> int:
    if isinstance(v, str):
        return len(v) + 2
    if isinstance(v, (bytes, bytearray)):
        return len(v) + 3
    if isinstance(v, bool) or v is None:
        return 5
    if isinstance(v, int):
        return v.bit_length() // 3 + 2
    if not isinstance(v, (list, tuple, set, frozenset, Mapping)):
        return 8
    hit = memo.get(id(v)) if memo is not None else None
    if hit is not None and hit[0] is v:
        return hit[1]
    total = 8 * len(v) + 2
    if total > limit or not v:
        return total
    items = list(v.keys()) + list(v.values()) if isinstance(v, Mapping) else v
    kinds = set(map(type, items))  # homogeneous lists of scalars are sized at C speed
    if kinds <= {str}:
        total += sum(map(len, items))
    elif kinds <= {int, bool}:
        total += max(map(abs, items)).bit_length() // 3 * len(items)
    elif not kinds <= {float, type(None)}:
        if len(items) > 4096:
            _tick()
        for item in items:
            total += _size(item, limit - total, memo, insert)
            if total > limit:
                return total
    if insert and len(v) >= 4:
        memo[id(v)] = (v, total)
    return total


def _check_size(x: Any, what: str) -> Any:
    lim = _limits().max_size
    if _measure(x, lim) > lim:
        raise _breach(f"{what} builds a value of more than {lim} characters", "max_size", lim)
    return x


def _check_int_args(args: Iterable[Any], what: str) -> None:
    lim = _limits()
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > lim.max_size:
            raise _breach(f"{what} got the integer {a:.3g}" if abs(a) < 1e300 else f"{what} got a huge integer",
                          "max_size", lim.max_size)


_DIGITS = re.compile(r"\d+")


def _check_format_string(s: str, what: str) -> None:
    """A width or precision in a format string builds that many characters."""
    lim = _limits().max_size
    for m in _DIGITS.finditer(s):
        if len(m.group()) > 7 and int(m.group()) > lim:
            raise _breach(f"{what}: format width {m.group()[:12]} builds more than {lim} characters", "max_size", lim)


def _call_args(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list:
    flat = list(args) + list(kwargs.values())
    for a in list(flat):
        if isinstance(a, (tuple, list)):
            flat.extend(a[:64])
        elif isinstance(a, Mapping):
            flat.extend(list(a.values())[:64])
    return flat


def _precheck(fn_name: str, obj: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """Refuse calls whose result would go over max_size before building it."""
    what = f"{fn_name}(...)"
    flat = _call_args(args, kwargs)
    _check_int_args(flat, what)
    lim = _limits().max_size
    size = _measure(list(args) + list(kwargs.values()), lim)
    if size > lim:
        raise _breach(f"{what} gets arguments of more than {lim} characters", "max_size", lim)
    s = obj if isinstance(obj, str) else (args[0] if args and isinstance(args[0], str) else None)
    if fn_name in ("replace", "expandtabs", "indent") and s is not None:
        rest = list(args[1:] if s is not obj else args) + list(kwargs.values())
        if fn_name == "replace" and len(rest) >= 2 and isinstance(rest[0], str) and isinstance(rest[1], str):
            n = s.count(rest[0]) if rest[0] else len(s) + 1
            grow = n * len(rest[1])
        elif fn_name == "expandtabs":
            tab = rest[0] if rest and isinstance(rest[0], int) else 8
            grow = s.count("\t") * max(int(tab), 0)
        else:  # indent: each line gets the indent
            width = rest[0] if rest else 4
            grow = (s.count("\n") + 1) * (len(width) if isinstance(width, str) else max(int(width), 0))
        if len(s) + grow > lim:
            raise _breach(f"{what} builds a string of more than {lim} characters", "max_size", lim)
    elif fn_name == "join":
        if isinstance(obj, str):  # sep.join(seq)
            seq, sep = (args[0] if args else ()), obj
        else:  # the join filter: value, d="", attribute=None
            seq, sep = (args[0] if args else ()), (args[1] if len(args) > 1 else kwargs.get("d", ""))
        if isinstance(seq, (list, tuple)) and isinstance(sep, str) and len(sep) * len(seq) + _measure(seq, lim) > lim:
            raise _breach(f"{what} builds a string of more than {lim} characters", "max_size", lim)
    elif fn_name in ("format", "format_map") and s is not None:
        _check_format_string(s, what)
    if fn_name == "generate_lorem_ipsum":
        given = list(args) + [5, True, 20, 100][len(args):]  # n, html, min, max
        n, hi = kwargs.get("n", given[0]), kwargs.get("max", given[3])
        if isinstance(n, int) and isinstance(hi, int) and n * hi * 12 > lim:
            raise _breach(f"{what} builds more than {lim} characters", "max_size", lim)


class _Counted:
    """An iterator that counts its items against max_iterations (and checks the time budget)."""

    __slots__ = ("_it",)

    def __init__(self, iterable: Iterable[Any]):
        self._it = iter(iterable)

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self._it)
        _tick(1)
        return item


def _counted_or_sized(out: Any, what: str) -> Any:
    """A call's or filter's result: an iterator counts its items as it goes; anything else is sized now."""
    if hasattr(out, "__next__") and not isinstance(out, _Counted):
        return _Counted(out)
    return _check_size(out, what)


def _guarded_filter(name: str, fn):
    """fn with the size checks; it takes the context (so it is never folded at compile time, outside
    the render's budget) and passes fn what it asks for."""
    from jinja2.utils import _PassArg

    kind = _PassArg.from_obj(fn)

    @functools.wraps(fn)
    def filt(context, *args, **kwargs):
        _tick()
        _precheck(name, None, args, kwargs)
        if kind is _PassArg.context:
            args = (context, *args)
        elif kind is _PassArg.eval_context:
            args = (context.eval_ctx, *args)
        elif kind is _PassArg.environment:
            args = (context.environment, *args)
        return _counted_or_sized(fn(*args, **kwargs), f"|{name}")

    filt.jinja_pass_arg = _PassArg.context
    return filt


def _int_power_bits(base: int, exp: int) -> float:
    if exp <= 0 or abs(base) <= 1:
        return 0
    return exp * abs(base).bit_length()


def _new_environment():
    """A fresh sandboxed environment configured as transformers', with every hook of `TemplateLimits`;
    returns it with the jinja2 module (for its error types)."""
    import jinja2
    from jinja2.ext import loopcontrols

    env = _environment_class()(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols],
                               finalize=_finalize)
    env.filters["tojson"] = _tojson
    env.filters = {name: _guarded_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["range"] = _safe_range
    return env, jinja2


def _environment_class():
    """`ImmutableSandboxedEnvironment` with the limits' hooks: loops and literal text counted, `~` sized
    before it joins, binary operators and calls checked before and after (defined on use: jinja2 is
    imported only when a template is compiled)."""
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generator(CodeGenerator):
        def visit_Concat(self, node, frame):  # `a ~ b`: sized before it is joined
            self.write("environment.sharpi_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class Environment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "+", "%", "**", "//", "/"])
        code_generator_class = Generator
        sharpi_concat = staticmethod(_sized_concat)

        def _parse(self, source, name, filename):
            return _count_loops_and_text(super()._parse(source, name, filename))

        @staticmethod
        def sharpi_loop(iterable):
            return _Counted(iterable)

        @staticmethod
        def sharpi_text(text):
            return text

        def call_binop(self, context, operator, left, right):
            _tick()
            lim = _limits()
            what = f"'{operator}'"
            _precheck_binop(operator, left, right, lim, what)
            out = super().call_binop(context, operator, left, right)
            if isinstance(out, int) and out.bit_length() > lim.max_int_bits:
                raise _int_bits_breach(what, lim)
            return out if operator == "+" else _check_size(out, what)  # '+': sized before

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
            _tick()
            if __obj is _safe_range:
                return super().call(__context, __obj, *args, **kwargs)
            name = getattr(__obj, "__name__", type(__obj).__name__)
            _precheck(name, getattr(__obj, "__self__", None), args, kwargs)
            return _counted_or_sized(super().call(__context, __obj, *args, **kwargs), f"{name}(...)")

        def wrap_str_format(self, value):
            wrapped = super().wrap_str_format(value)
            if wrapped is not None:
                _check_format_string(value.__self__, "str.format")
            return wrapped

    return Environment


def _count_loops_and_text(tree):
    """Rewrite a parsed template: every loop counts its iterations, and literal text too is counted as
    emitted (it goes through `finalize`)."""
    from jinja2 import nodes

    for loop in list(tree.find_all(nodes.For)):
        loop.iter = nodes.Call(nodes.EnvironmentAttribute("sharpi_loop"), [loop.iter], [], None, None,
                               lineno=loop.lineno)
    for out in list(tree.find_all(nodes.Output)):
        out.nodes = [nodes.Call(nodes.EnvironmentAttribute("sharpi_text"), [nodes.Const(n.data)], [],
                                None, None, lineno=n.lineno) if isinstance(n, nodes.TemplateData) else n
                     for n in out.nodes]
    return tree


def _sized_concat(parts):
    """`a ~ b ~ ...`, refused before joining when the result would go over max_size."""
    lim = _limits().max_size
    if _measure(list(parts), lim) > lim:
        raise _breach(f"'~' builds a string of more than {lim} characters", "max_size", lim)
    return "".join(str(p) for p in parts)


def _int_bits_breach(what: str, lim: TemplateLimits) -> TemplateLimitError:
    return _breach(f"{what} builds an integer of more than {lim.max_int_bits} bits", "max_int_bits",
                   lim.max_int_bits)


def _precheck_binop(operator: str, left: Any, right: Any, lim: TemplateLimits, what: str) -> None:
    """Refuse a binary operation whose result would go over max_int_bits or max_size before computing it."""
    if operator == "**" and isinstance(left, int) and isinstance(right, int):
        if _int_power_bits(left, right) > lim.max_int_bits:
            raise _int_bits_breach(what, lim)
    elif operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(n, int) and not isinstance(seq, (int, float)) and n > 0:
                if _measure(seq, lim.max_size) * n > lim.max_size:
                    raise _breach(f"{what} builds a value of more than {lim.max_size} characters",
                                  "max_size", lim.max_size)
        if isinstance(left, int) and isinstance(right, int) and \
                left.bit_length() + right.bit_length() > lim.max_int_bits:
            raise _int_bits_breach(what, lim)
    elif operator == "%" and isinstance(left, str):
        _check_format_string(left, what)
        _check_int_args(_call_args([right], {}), what)
    if operator in ("+", "%") and _measure([left, right], lim.max_size) > lim.max_size:
        raise _breach(f"{what} builds a value of more than {lim.max_size} characters", "max_size",
                      lim.max_size)


def _finalize(value):
    """Count every emitted value against max_output (and check the time budget)."""
    _tick()
    r = _ACTIVE.get()
    lim = _limits()
    size = _measure(value, lim.max_output)
    if r is not None:
        r.emitted += size
    if (r.emitted if r is not None else size) > lim.max_output:
        raise _breach(f"the template emits more than {lim.max_output} characters", "max_output", lim.max_output)
    return value


def _safe_range(*args: int) -> range:
    lim = _limits()
    rng = range(*args)
    try:
        n = len(rng)
    except OverflowError:
        n = lim.max_range + 1
    if n > lim.max_range:
        raise _breach(f"range(...) of {n if n > lim.max_range + 1 else 'too many'} items", "max_range", lim.max_range)
    return rng


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
    env, jinja2 = _new_environment()
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise InputError(f"chat template does not parse: {_one_line(e)}") from None
    except (RecursionError, MemoryError) as e:
        raise InputError(f"chat template does not parse: {type(e).__name__} (nested too deeply or too large)") \
            from None


def render(source: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
           tools: Sequence[Any] | None = None, documents: Sequence[Any] | None = None,
           special_tokens: Mapping[str, str] | None = None, template_name: str = CHAT_TEMPLATE_KEY,
           template_limits: TemplateLimits = DEFAULT_LIMITS, **kwargs: Any) -> str:
    """Render chat template `source` for `messages` ([{"role": ..., "content": ...}, ...]).

    `special_tokens` (bos_token, eos_token, ...) and `kwargs` (e.g. enable_thinking) become template
    variables, as in transformers. `template_name` names the template in errors; `template_limits`
    bounds the work.
    Returns the prompt text (special tokens as text)."""
    import jinja2

    _check_messages(messages)
    template = compile_template(source)
    limits, name = template_limits, template_name
    variables = dict(messages=messages, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
                     **(special_tokens or {}), **kwargs)
    state = _Render(f"chat template {name}", limits)
    token = _ACTIVE.set(state)
    try:
        state.remember(list(variables.values()))
        parts, size = [], 0
        for chunk in template.generate(**variables):
            size += len(chunk)
            if size > limits.max_output:
                raise _breach(f"the output has more than {limits.max_output} characters", "max_output",
                              limits.max_output)
            parts.append(chunk)
        _tick()
        return "".join(parts)
    except (TemplateRaised, TemplateLimitError):
        raise
    except jinja2.exceptions.SecurityError as e:
        raise InputError(f"chat template refused by the sandbox: {_one_line(e)}") from None
    except jinja2.TemplateError as e:
        raise InputError(f"chat template failed: {_one_line(e)}") from None
    except (RecursionError, MemoryError) as e:
        raise InputError(f"chat template {name} failed: {type(e).__name__} (recursion or size)") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError) as e:
        raise InputError(f"chat template failed on these messages: {type(e).__name__}: {_one_line(e)}") from None
    finally:
        _ACTIVE.reset(token)


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
