"""Sessions (`Engine.session`, `sharpi_jax.runtime.session`): a prefill continued from a kept state gives
the bits of one prefill over the whole conversation (logits, every state leaf, the MTP head's KV and
hidden), at split points inside one bucket and across buckets; so a session's turns (MTP off, chain,
tree, seeded, chat messages) are bitwise a fresh generate over the whole conversation while prefilling
only the new tokens; fork branches without touching the original."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import sharpi_jax as sj
from sharpi_jax.errors import InputError
from sharpi_jax.runtime.session import Prefix, Resume
from tests.bitwise import assert_bitwise_equal

TEXT = ("import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Print every file under the given directories.\"\"\"\n"
        "    for root in argv[1:]:\n        for dirpath, dirnames, filenames in os.walk(root):\n"
        "            for name in sorted(filenames):\n                print(os.path.join(dirpath, name))\n"
        "    return 0\n\n\nif __name__ == \"__main__\":\n    sys.exit(main(sys.argv))\n")


@pytest.fixture(scope="module")
def engine():
    return sj.load(max_context=1024)


@pytest.mark.parametrize("first,total", [(200, 300), (257, 258), (300, 520), (513, 514), (600, 1000)],
                         ids=lambda n: str(n))
def test_continued_prefill_is_bitwise_one_prefill(engine, first, total):
    """A conversation of `first` ids prefilled (kept state at the last multiple of 256 below it), then
    one of `total` ids continued from it == the `total` ids prefilled at once: the last row's logits, the
    trunk state, the MTP KV and hidden, bit for bit, and the new kept state == a fresh one's."""
    e = engine
    ids = e.tokenizer.encode(TEXT * 12)[:total]
    assert len(ids) == total
    whole = Resume(None, e.mtp)
    logits, state = whole.prefill(e.runtime, ids)[1:]
    head = Resume(None, e.mtp)
    head.prefill(e.runtime, ids[:first])
    kept = 256 * ((first - 1) // 256)  # the last bucket boundary below `first`
    assert (0 if head.saved is None else len(head.saved.ids)) == kept
    r = Resume(head.saved, e.mtp)
    logits2, state2 = r.prefill(e.runtime, ids)[1:]
    assert r.reused == kept
    assert_bitwise_equal(logits2, logits)
    assert_bitwise_equal(state2, state)
    assert_bitwise_equal(r.mtp_prefill(False), whole.mtp_prefill(False))
    assert r.saved.ids == whole.saved.ids == tuple(ids[:256 * ((total - 1) // 256)])
    assert_bitwise_equal(r.saved[1:], whole.saved[1:])


def test_prefix_reused_only_when_extended(engine):
    ids = engine.tokenizer.encode(TEXT)[:20]
    p = Prefix(tuple(ids[:10]), None, None, None)
    assert Resume(p).reusable(ids) == 10
    assert Resume(p).reusable(ids[:10]) == 0  # nothing new to prefill
    assert Resume(p).reusable([ids[0] + 1] + ids[1:]) == 0  # a different history
    assert Resume(None).reusable(ids) == 0


@pytest.mark.parametrize("spec,kw", [(None, {}), ("mtp", {}), ("mtp_tree", {}), (None, dict(temperature=0.8, seed=4)),
                                     ("mtp", dict(temperature=0.8, top_k=20, seed=9))],
                         ids=["plain", "chain", "tree", "plain-seeded", "chain-seeded"])
def test_turns_equal_fresh_generate(engine, spec, kw):
    """Turns of a conversation that crosses bucket boundaries (~300, ~330, ~560 tokens): each turn's tokens
    == a fresh generate over the whole conversation; a turn prefills only what follows the kept state
    (the last multiple of 256 below the previous prefill)."""
    e = engine
    s = e.session()
    turns = [TEXT * 3, "\n\nclass Stack:\n    def push(self", TEXT * 2 + "\n# tests\nimport unittest\n"]
    prev = None
    for i, t in enumerate(turns):
        before = list(s.ids)
        out = s.generate(t, max_new_tokens=12, speculative=spec, **kw)
        conv = before + e.tokenizer.encode(t)
        ref = e.generate(conv, max_new_tokens=12, speculative=spec, **kw)
        assert out.tokens == ref.tokens and out.text == ref.text, i
        assert s.ids == conv + out.tokens
        reused = 0 if prev is None else 256 * ((prev - 1) // 256)
        assert out.stats.session.reused_tokens == reused and (i == 0 or reused > 0)
        assert out.stats.session.prefilled_tokens == len(conv) - reused
        assert s.prefilled == 256 * ((len(conv) - 1) // 256)
        prev = len(conv)


def test_fork_branches_without_touching_the_original(engine):
    e = engine
    s = e.session()
    s.generate("def add(a, b):\n", max_new_tokens=8)
    f = s.fork()
    a = f.generate("\nprint(add(1, 2))", max_new_tokens=8, speculative="mtp")
    b = f.generate("\nprint(add(3, 4))", max_new_tokens=8)
    c = s.generate("\nprint(add(1, 2))", max_new_tokens=8, speculative="mtp")  # the original, as before the fork
    assert c.tokens == a.tokens and c.stats.session.reused_tokens == a.stats.session.reused_tokens
    assert f.ids != s.ids and len(f.ids) > len(s.ids)
    assert b.tokens == e.generate(f.ids[:len(f.ids) - len(b.tokens)], max_new_tokens=8).tokens


def test_chat_messages(engine):
    """messages= turns: the chat re-rendered by the template each turn; the rendered prefix that the
    kept state holds is reused, and the tokens equal a fresh generate over the rendered chat."""
    e = engine
    template = (Path(__file__).parents[1] / "gguf" / "chat" / "qwen35_style.jinja").read_text()
    saved, e.tokenizer.chat_template = e.tokenizer.chat_template, template
    try:
        s = e.session()
        chat = []
        for turn in ("explain this code:\n" + TEXT * 3, "now in reverse"):
            msg = [{"role": "user", "content": turn}]
            out = s.generate(messages=msg, max_new_tokens=8, enable_thinking=False)
            chat = chat + msg
            ref = e.generate(messages=chat, max_new_tokens=8, enable_thinking=False)
            assert out.tokens == ref.tokens
            chat = chat + [{"role": "assistant", "content": out.text}]
            assert s.messages == chat
        assert out.stats.session.reused_tokens > 0
    finally:
        e.tokenizer.chat_template = saved


def test_bad_session_use_one_line(engine):
    s = engine.session()
    with pytest.raises(InputError, match="not with a KV eviction policy") as ei:
        s.generate("x", kv_policy="snapkv", kv_budget=64)
    assert "\n" not in str(ei.value)
    with sj.load(max_context=64) as other:
        with pytest.raises(InputError, match="a Session of this engine"):
            other.generate("x", session=s)
    with pytest.raises(InputError, match="more than max_context"):
        s.generate(list(range(5, 1100)))
