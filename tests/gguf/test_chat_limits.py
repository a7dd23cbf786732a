"""Chat templates are untrusted text: every runaway template gives ONE one-line SharpiError naming the
template and the limit, within 2 s and under 200 MB of extra memory; real templates render exactly as
an unbounded Jinja environment set up like transformers' renders them, and quickly; `tojson` follows
transformers' convention (non-ASCII kept, no HTML escaping, keys in order)."""

from __future__ import annotations

import json
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from sharpi_jax.errors import SharpiError
from sharpi_jax.gguf import chat

HERE = Path(__file__).parent / "chat"
TEMPLATES = {p.stem: p.read_text() for p in (HERE / "qwen35_style.jinja", HERE / "qwen3_official_style.jinja")}
CASES = json.loads((HERE / "cases.json").read_text())
HI = [{"role": "user", "content": "hi"}]

RUNAWAY = {  # name -> (template, the limit its error must name)
    "huge_range": ("{% for i in range(10**9) %}x{% endfor %}", "max_range"),
    "huge_range_literal": ("{% for i in range(1000000000000000000000) %}x{% endfor %}", "max_range"),
    "string_times_huge": ("{{ 'a' * (10**10) }}", "max_size"),
    "list_times_huge": ("{{ ([1, 2] * 100000000)|length }}", "max_size"),
    "nested_ranges": ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
                      "max_iterations"),
    "doubling_concat": ("{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                        "{% endfor %}{{ ns.s|length }}", "max_size"),
    "doubling_plus": ("{% set ns = namespace(s=['a']) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                      "{% endfor %}{{ ns.s|length }}", "max_size"),
    "center_width": ("{{ 'a'|center(10**9) }}", "max_size"),
    "method_width": ("{{ 'a'.ljust(999999999) }}", "max_size"),
    "percent_width": ("{{ '%999999999s' % 'a' }}", "max_size"),
    "format_width": ("{{ '{:>999999999}'.format('a') }}", "max_size"),
    "format_filter_width": ("{{ '%0999999999d'|format(1) }}", "max_size"),
    "big_power": ("{{ 2 ** 99999999 }}", "max_int_bits"),
    "squaring": ("{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}"
                 "{{ ns.x }}", "max_int_bits"),
    "replace_amplifies": ("{{ ('a' * 1000000).replace('a', 'b' * 100) }}", "max_size"),
    "join_amplifies": ("{% set l = ['x' * 4000000] * 3 %}{{ l|join }}", "max_size"),
    "join_separator": ("{{ ('-' * 1000000).join(['a'] * 100) }}", "max_size"),
    "indent_amplifies": ("{{ ('\\n' * 1000000)|indent(100) }}", "max_size"),
    "captured_block": ("{% set x %}{% for i in range(100000) %}" + "y" * 1000 + "{% endfor %}{% endset %}{{ x|length }}",
                       "max_output"),
    "macro_body": ("{% macro m() %}{% for i in range(20000) %}{{ 'z' * 5000 }}{% endfor %}{% endmacro %}"
                   "{{ m()|length }}", "max_output"),
    "slice_generator": ("{{ [1]|slice(8000000)|list|length }}", None),  # iterations or time, whichever first
    "lipsum": ("{{ lipsum(n=1000000) }}", "max_size"),
    "shared_reference_string": ("{% set s = 'x' * 4000000 %}{{ [s, s, s]|string }}", "max_size"),
    "spin": ("{% for i in range(100000) %}{% for j in messages * 9 %}{{ j.role|length }}{% endfor %}{% endfor %}",
             None),
}


def _breach(template: str):
    t0 = time.perf_counter()
    with pytest.raises(SharpiError) as e:
        chat.render(template, HI, add_generation_prompt=True, template_name="of runaway.gguf")
    return e.value, time.perf_counter() - t0


@pytest.mark.parametrize("name", sorted(RUNAWAY))
def test_runaway_template_is_one_bounded_error(name):
    template, limit = RUNAWAY[name]
    err, seconds = _breach(template)
    msg = str(err)
    assert "\n" not in msg and "of runaway.gguf" in msg, msg
    assert isinstance(err, chat.TemplateLimitError), msg
    if limit is not None:  # or the time budget, when the machine is slow enough to reach it first
        assert limit in msg or (limit in ("max_iterations", "max_output") and "time_s" in msg), msg
    assert seconds < 2.0, f"{name}: {seconds:.2f} s"
    tracemalloc.start()
    try:
        _breach(template)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 200 * 2**20, f"{name}: {peak / 2**20:.0f} MiB"


def test_tight_limits_apply_and_name_the_limit():
    lim = chat.TemplateLimits(max_range=10, max_iterations=50, max_size=100, max_output=200, time_s=5.0)
    ok = "{% for i in range(10) %}{{ i }}{% endfor %}"
    assert chat.render(ok, HI, template_limits=lim) == "0123456789"
    for template, name in (("{% for i in range(11) %}{% endfor %}", "max_range=10"),
                           ("{% for i in range(10) %}{% for j in range(10) %}{% endfor %}{% endfor %}",
                            "max_iterations=50"),
                           ("{{ 'a' * 101 }}", "max_size=100"),
                           ("{% for i in range(9) %}{{ 'a' * 30 }}{% endfor %}", "max_output=200"),
                           ("{% set c %}{% for i in range(9) %}{{ 'a' * 30 }}{% endfor %}{% endset %}{{ c|length }}",
                            "max_output=200")):  # emitted into a captured block, not the output
        with pytest.raises(chat.TemplateLimitError, match=name):
            chat.render(template, HI, template_limits=lim)
    with pytest.raises(chat.TemplateLimitError, match="time_s"):
        chat.render("{% for i in range(100000) %}{{ i }}{% endfor %}", HI,
                    template_limits=chat.TemplateLimits(time_s=0.0))


def _reference_render(template: str, messages, **kw) -> str:
    """An unbounded environment set up as transformers' apply_chat_template sets up its own."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, **kw)


@pytest.mark.parametrize("tname", sorted(TEMPLATES))
def test_real_templates_render_unchanged_and_fast(tname):
    template = TEMPLATES[tname]
    for name, case in sorted(CASES.items()):
        kw = dict(tools=case.get("tools"), documents=None, add_generation_prompt=case.get("add_generation_prompt", True),
                  **case.get("kwargs", {}))
        ref = _reference_render(template, case["messages"], **kw)
        chat.render(template, case["messages"], **kw)  # compiled once
        t0 = time.perf_counter()
        ours = chat.render(template, case["messages"], **kw)
        assert time.perf_counter() - t0 < 0.05, name
        assert ours == ref, name


def test_long_real_chat_within_limits():
    """A 400-turn chat of long, non-ASCII messages renders unchanged: the limits leave real prompts alone."""
    rng = np.random.default_rng(0)
    words = ["naïve", "café", "数据", "😀", "def", "return", "x", "<tool>", "{\"a\": 1}"]
    msgs = [{"role": "system", "content": "Be brief."}]
    for i in range(200):
        msgs.append({"role": "user", "content": " ".join(rng.choice(words, 500))})
        msgs.append({"role": "assistant", "content": "<think>\nok\n</think>\n\n" + " ".join(rng.choice(words, 300))})
    msgs.append({"role": "user", "content": "last"})
    for template in TEMPLATES.values():
        assert chat.render(template, msgs, add_generation_prompt=True) == \
            _reference_render(template, msgs, add_generation_prompt=True, tools=None, documents=None)


def test_tojson_follows_transformers_convention():
    """transformers' tojson is json.dumps(x, ensure_ascii=False, indent, separators, sort_keys): non-ASCII
    and HTML characters kept as they are, keys in insertion order (Jinja's own tojson escapes <>&' and
    sorts keys). Expected strings written by hand."""
    value = {"ville": "Zürich", "温度": "18°C", "emoji": "😀", "html": "<a href='x'>&</a>", "n": [1, 2.5, None]}
    cases = {
        "{{ v|tojson }}": '{"ville": "Zürich", "温度": "18°C", "emoji": "😀", "html": "<a href=\'x\'>&</a>", '
                          '"n": [1, 2.5, null]}',
        "{{ v.n|tojson(indent=2) }}": "[\n  1,\n  2.5,\n  null\n]",
        "{{ {'b': 'é', 'a': 1}|tojson(sort_keys=true) }}": '{"a": 1, "b": "é"}',
        "{{ {'b': 'é'}|tojson(separators=(',', ':')) }}": '{"b":"é"}',
        "{{ 'ß'|tojson(ensure_ascii=true) }}": '"\\u00df"',
    }
    for template, expected in cases.items():
        assert chat.render(template, HI, v=value) == expected, template
    tools = [{"type": "function", "function": {"name": "météo", "description": "Température d'une ville — °C",
                                               "parameters": {"type": "object", "properties": {}}}}]
    for template in TEMPLATES.values():
        out = chat.render(template, HI, tools=tools, add_generation_prompt=True)
        assert '{"type": "function", "function": {"name": "météo", "description": "Température d\'une ville — °C", ' \
               '"parameters": {"type": "object", "properties": {}}}}' in out


def test_trim_and_lstrip_blocks_as_transformers():
    template = "  {% for m in messages %}\n[{{ m.role }}]\n  {% endfor %}\nend"
    assert chat.render(template, [{"role": "a"}, {"role": "b"}]) == "[a]\n[b]\nend"
