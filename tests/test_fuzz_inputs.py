"""Fuzz of the input surfaces beyond the GGUF header bytes (`tests/gguf/test_fuzz.py`): tensor tables
(planted extreme dims, types and offsets), split parts (missing, reordered, foreign, truncated,
duplicated), chat templates (random ones built from Jinja fragments, under tight limits), and the
options of `load` and `generate`. Every case must succeed or raise one SharpiError with a one-line
message: never another exception, never a hang. Fast: a few dozen cases; slow (-m slow): hundreds."""

from __future__ import annotations

import shutil
import signal
import struct

import numpy as np
import pytest

import sharpi_jax as sj
from sharpi_jax.errors import SharpiError
from sharpi_jax.gguf import GGUFFile, chat
from tests.conftest import fixture_path
from tests.gguf.test_fuzz import _Hang, _alarm, _exercise
from tests.gguf.test_split import write_split

SEED_FILE = ("tiny-qwen35moe", "tiny-qwen35moe-Q8_0.gguf")
CASE_TIMEOUT_S = 20


def _run(label: str, fn) -> str:
    """fn() under a timeout: "ok", or "ours" for a one-line SharpiError; anything else fails the test."""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(CASE_TIMEOUT_S)
    try:
        fn()
        return "ok"
    except SharpiError as e:
        assert str(e) and "\n" not in str(e), f"{label}: {e!r}"
        return "ours"
    except _Hang:
        pytest.fail(f"{label}: took more than {CASE_TIMEOUT_S}s")
    except Exception as e:  # noqa: BLE001 - the point of the test
        pytest.fail(f"{label}: raised {type(e).__name__}: {e}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# ----- tensor tables -----
def _tensor_entries(data: bytes, names) -> list[tuple[int, int]]:
    """(offset of n_dims, n_dims) of each tensor info: found after its length-prefixed name."""
    out = []
    for name in names:
        key = struct.pack("<Q", len(name)) + name.encode()
        at = data.find(key)
        assert at > 0
        pos = at + len(key)
        out.append((pos, struct.unpack_from("<I", data, pos)[0]))
    return out


def _tensor_table_cases(tmp_path, n: int, seed: int):
    src = fixture_path(*SEED_FILE)
    data = src.read_bytes()
    with GGUFFile(src) as f:
        entries = _tensor_entries(data, list(f.tensors))
    rng = np.random.default_rng(seed)
    extremes = [0, 1, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1, len(data), 3, 255]
    outcomes = []
    for i in range(n):
        d = bytearray(data)
        for _ in range(int(rng.integers(1, 3))):
            pos, n_dims = entries[int(rng.integers(0, len(entries)))]
            field = int(rng.integers(0, 4))
            value = extremes[int(rng.integers(0, len(extremes)))]
            if field == 0:  # n_dims
                struct.pack_into("<I", d, pos, value & 0xFFFFFFFF)
            elif field == 1:  # one dim
                struct.pack_into("<Q", d, pos + 4 + 8 * int(rng.integers(0, n_dims)), value)
            elif field == 2:  # the ggml type
                struct.pack_into("<I", d, pos + 4 + 8 * n_dims, int(rng.integers(0, 64)))
            else:  # the data offset
                struct.pack_into("<Q", d, pos + 8 + 8 * n_dims, value)
        p = tmp_path / f"table{i % 3}.gguf"
        p.write_bytes(bytes(d))
        outcomes.append(_run(f"tensor table case {i} (seed {seed})", lambda p=p: _exercise(p)))
    return outcomes


def test_fuzz_tensor_table(tmp_path):
    assert "ours" in _tensor_table_cases(tmp_path, 16, seed=7)


@pytest.mark.slow
def test_fuzz_tensor_table_slow(tmp_path):
    assert _tensor_table_cases(tmp_path, 300, seed=70).count("ours") > 50


# ----- split parts -----
@pytest.fixture(scope="module")
def split_sets(tmp_path_factory):
    base = tmp_path_factory.mktemp("split")
    src = fixture_path(*SEED_FILE)
    return write_split(src, base / "a" / "m.gguf", 3), write_split(src, base / "b" / "m.gguf", 2)


def _split_cases(tmp_path, split_sets, n: int, seed: int):
    three, two = split_sets
    rng = np.random.default_rng(seed)
    outcomes = []
    for i in range(n):
        case = tmp_path / f"case{i}"
        case.mkdir()
        parts = [case / p.name for p in three]
        for s, p in zip(three, parts):
            shutil.copyfile(s, p)
        ops = rng.choice(["missing", "reorder", "foreign", "truncate", "duplicate", "flip"], int(rng.integers(1, 3)))
        for op in ops:
            j = int(rng.integers(0, 3))
            if op == "missing" and parts[j].exists():
                parts[j].unlink()
            elif op == "reorder":
                a, b = rng.choice(3, 2, replace=False)
                if parts[a].exists() and parts[b].exists():
                    tmp = case / "swap"
                    parts[a].rename(tmp), parts[b].rename(parts[a]), tmp.rename(parts[b])
            elif op == "foreign":
                shutil.copyfile(two[int(rng.integers(0, 2))], parts[j])
            elif op == "truncate" and parts[j].exists():
                data = parts[j].read_bytes()
                parts[j].write_bytes(data[: int(rng.integers(0, len(data)))])
            elif op == "duplicate":
                shutil.copyfile(three[int(rng.integers(0, 3))], parts[j])
            elif op == "flip" and parts[j].exists():
                d = bytearray(parts[j].read_bytes())
                for _ in range(4):
                    d[int(rng.integers(0, min(len(d), 4096)))] = int(rng.integers(0, 256))
                parts[j].write_bytes(bytes(d))
        first = next((p for p in parts if p.exists()), parts[0])

        def load(first=first):
            _exercise(first)
            with GGUFFile(first) as f:  # every tensor's bytes, wherever its part is
                for name in list(f.tensors)[::7]:
                    f.dequantize(name)

        outcomes.append(_run(f"split case {i} {list(ops)} (seed {seed})", load))
        shutil.rmtree(case)
    return outcomes


def test_fuzz_split_parts(tmp_path, split_sets):
    assert "ours" in _split_cases(tmp_path, split_sets, 12, seed=3)


@pytest.mark.slow
def test_fuzz_split_parts_slow(tmp_path, split_sets):
    assert _split_cases(tmp_path, split_sets, 200, seed=30).count("ours") > 50


# ----- chat templates -----
_EXPR = ["messages", "messages[0].content", "'ab'", "range(N)", "[1, 2, 3]", "{'a': 'é'}", "N", "'x' * N",
         "messages|length", "(N ** N)", "'%Ns'|format('a')", "'{:N}'.format(1)", "[messages] * N", "lipsum(N)",
         "messages|map(attribute='role')|list", "range(N)|slice(N)|list", "'ab'|center(N)", "(1 / 0)",
         "messages[N]", "x", "''.__class__", "ns.s", "cycler(1, 2).next()"]
_FILTERS = ["|tojson", "|length", "|string", "|upper", "|join(',')", "|replace('a', 'bb')", "|indent(N)",
            "|trim", "|list", "|sum", "|batch(N)|list", "|reverse|list", "|first", "|unique|list", ""]


def _random_template(rng: np.random.Generator, depth: int = 0) -> str:
    def expr():
        e = str(rng.choice(_EXPR)) + str(rng.choice(_FILTERS))
        if rng.random() < 0.3:
            e = f"({e}) {rng.choice(['~', '+', '*', '%'])} ({rng.choice(_EXPR)})"
        return e.replace("N", str(rng.choice([0, 1, 3, 99, 10**5, 10**7, 10**12])))

    parts = []
    for _ in range(int(rng.integers(1, 5))):
        kind = rng.random()
        if kind < 0.4:
            parts.append("{{ " + expr() + " }}")
        elif kind < 0.6 and depth < 3:
            parts.append("{% for x in " + expr() + " %}" + _random_template(rng, depth + 1) + "{% endfor %}")
        elif kind < 0.7:
            parts.append("{% set ns = namespace(s=" + expr() + ") %}{% set ns.s = ns.s ~ ns.s %}")
        elif kind < 0.8 and depth < 3:
            parts.append("{% macro m(a) %}" + _random_template(rng, depth + 1) + "{% endmacro %}{{ m(1) }}{{ m(2) }}")
        elif kind < 0.9 and depth < 3:
            parts.append("{% set c %}" + _random_template(rng, depth + 1) + "{% endset %}{{ c|length }}")
        else:
            parts.append(str(rng.choice(["text ", "{% if x %}y{% endif %}", "{{", "{% for %}", "{% raw %}r{% endraw %}"])))
    return "".join(parts)


def _template_cases(n: int, seed: int):
    rng = np.random.default_rng(seed)
    lim = chat.TemplateLimits(time_s=0.5, max_iterations=200_000)
    msgs = [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "<think>a</think>b"}]
    return [_run(f"template case {i} (seed {seed})", lambda t=_random_template(rng): chat.render(
        t, msgs, add_generation_prompt=True, template_limits=lim)) for i in range(n)]


def test_fuzz_templates():
    outcomes = _template_cases(40, seed=11)
    assert "ours" in outcomes and "ok" in outcomes


@pytest.mark.slow
def test_fuzz_templates_slow():
    outcomes = _template_cases(500, seed=110)
    assert outcomes.count("ours") > 50 and outcomes.count("ok") > 50


# ----- options of load and generate -----
_WEIRD = [None, True, -1, 0, 1, 2, 3, 7, 2**40, -2**40, 0.5, float("nan"), float("inf"), "", "x", "auto", "25%",
          "1GiB", [1], {"a": 1}, (16,), b"x", object()]
_LOAD_OPTS = {
    "max_context": [16, 64, 0, -3, 2.5, "64", None, True, 2**40],
    "dtype": ["float32", "bfloat16", "int8", 3, None],
    "prefill_buckets": [(16,), (0,), (-4,), ("a",), [], (16, 16), 5],
    "expert_mode": ["grouped", "per_token", "bogus", 1],
    "row_kernel": ["gemm", "gemv", "fast", None],
    "gdn_chunk": [8, 0, -1, 3.5, "64"],
    "kernels": ["xla", "reference", "bogus", 7],
    "repack": [None, "auto", "int8", "int4", 1],
    "expert_budget": ["50%", "0%", "150%", "1KiB", "lots", -5, 10**15, 3.5],
    "expert_policy": ["lru", "slru", "static", "frequency", "fifo", None],
    "expert_lookahead": ["none", "next_layer", "pass", "both", "sometimes"],
    "expert_ring": [0.25, 0.0, 1.5, -0.1, "half"],
    "kv_policy": [None, "snapkv", "h2o"],
    "kv_budget": [40, 8, 0, -1, "40"],
    "kv_window": [8, 0, 100, "x"],
    "expert_parallel": [1, 0, 3, 64, "2"],
    "no_such_option": [1],
}
_GEN_OPTS = {
    "max_new_tokens": [0, 1, 3, -1, 2.0, "3", 10**9, None],
    "temperature": [0.0, 0.7, -1.0, float("nan"), "hot", True],
    "top_k": [0, 5, -1, 2.5, 10**12],
    "top_p": [1.0, 0.9, 0.0, 1.5, float("inf")],
    "min_p": [0.0, 0.1, 1.0, -0.1, 2.0],
    "seed": [0, 7, -1, 2**33, 1.5],
    "stop_on_eos": [True, False],
    "speculative": [None, "mtp", "mtp_tree", "eagle", 1],
    "draft_tokens": [1, 2, 3, 0, -2, 100, 2.0],
    "verify": ["batched", "sequential", "parallel"],
    "tree_nodes": [None, 2, 4, 0, -1, 10**6],
    "max_snapshot_bytes": [None, 1, 10**9, -5],
    "kv_policy": ["default", None, "snapkv", "bogus"],
    "kv_budget": [None, 40, 2, -1],
    "loop": ["device", "host", "gpu"],
    "draft_vocab": [None, 16, 0, 10**9, "16"],
    "enable_thinking": [None, True],
    "chat_template_kwargs": [None, {"a": 1}],
}


def _pick(rng, table: dict, n_keys: int) -> dict:
    keys = rng.choice(sorted(table), min(n_keys, len(table)), replace=False)
    out = {}
    for k in keys:
        pool = table[k] + ([_WEIRD[int(rng.integers(0, len(_WEIRD)))]] if rng.random() < 0.3 else [])
        out[str(k)] = pool[int(rng.integers(0, len(pool)))]
    return out


@pytest.fixture(scope="module")
def engine():
    return sj.load(max_context=64, prefill_buckets=(16,))


def _generate_cases(engine, n: int, seed: int, must_fail: bool):
    rng = np.random.default_rng(seed)
    outcomes = []
    for i in range(n):
        opts = _pick(rng, _GEN_OPTS, int(rng.integers(1, 5)))
        if must_fail:  # a known-bad value: only validation runs (no compile), fast
            bad = {"max_new_tokens": -1, "top_p": 1.5, "speculative": "eagle", "loop": "gpu", "draft_tokens": 0}
            k = sorted(bad)[i % len(bad)]
            opts[k] = bad[k]
        else:
            opts["max_new_tokens"] = min(opts["max_new_tokens"], 3) if isinstance(opts.get("max_new_tokens"), int) \
                and not isinstance(opts.get("max_new_tokens"), bool) else 3
        prompts = ["def f(x):", "", [1, 2, 3], [-1], [10**9], [[1]], None, "x" * 100]
        prompt = prompts[int(rng.integers(0, len(prompts)))]
        outcome = _run(f"generate case {i} {opts} prompt={prompt!r:.30} (seed {seed})",
                       lambda: engine.generate(prompt, **opts))
        if must_fail:
            assert outcome == "ours", opts
        outcomes.append(outcome)
    return outcomes


def test_fuzz_generate_options(engine):
    _generate_cases(engine, 30, seed=5, must_fail=True)


@pytest.mark.slow
def test_fuzz_generate_options_slow(engine):
    outcomes = _generate_cases(engine, 150, seed=50, must_fail=False)
    assert "ours" in outcomes and "ok" in outcomes


def _load_cases(n: int, seed: int, must_fail: bool):
    rng = np.random.default_rng(seed)
    outcomes = []
    for i in range(n):
        opts = _pick(rng, _LOAD_OPTS, int(rng.integers(1, 4)))
        if must_fail:
            bad = {"max_context": 0, "dtype": "int8", "expert_policy": "fifo", "kernels": "bogus",
                   "no_such_option": 1, "expert_budget": "lots"}
            k = sorted(bad)[i % len(bad)]
            opts[k] = bad[k]

        def load(opts=opts):
            with sj.load(**opts) as e:
                if not must_fail:
                    e.generate("def f(x):", max_new_tokens=2)

        outcome = _run(f"load case {i} {opts} (seed {seed})", load)
        if must_fail:
            assert outcome == "ours", opts
        outcomes.append(outcome)
    return outcomes


def test_fuzz_load_options():
    _load_cases(12, seed=9, must_fail=True)


@pytest.mark.slow
def test_fuzz_load_options_slow():
    outcomes = _load_cases(60, seed=90, must_fail=False)
    assert "ours" in outcomes and "ok" in outcomes


# ----- the typed options -----
def _typed_pools():
    from sharpi_jax.runtime.sampling import SamplingParams

    return {
        sj.Chain: {"k": [1, 3, 0, 2.0], "draft_vocab": [None, 16, 0], "p_min": [0.0, 0.3, 1.0, -0.1]},
        sj.Tree: {"depth": [1, 3, 0], "nodes": [None, 2, 8, 0], "max_snapshot_bytes": [None, 10**6, -5]},
        sj.GenerateOptions: {"max_new_tokens": [0, 3, -1], "sampling": [SamplingParams(), {"temperature": 1}],
                             "stop_on_eos": [True, False], "speculation": [None, sj.Chain(2), sj.Tree(2), "mtp"],
                             "verify": ["batched", "sequential", "parallel"], "loop": ["device", "host", "gpu"],
                             "kv": ["engine", None, sj.SnapKV(40, 8), "snapkv"]},
        sj.ExpertResidency: {"budget": [None, "50%", 2**20, 2.5], "policy": ["lru", "fifo"],
                             "device_budget": [None, 2**24, -1], "staging": [None, 8, 0], "ring": [None, 0.5, 1.5],
                             "cold": [None, "auto", "host", "warm"], "lookahead": [None, "both", "sometimes"],
                             "lookahead_buffer": [None, 4, -1], "prefetch": [None, 0, -2],
                             "stream_min_rows": [None, 2, -1], "counts": [None, {}, 3],
                             "store": [None, "pinned_host", "callback", "disk"]},
        sj.SnapKV: {"budget": [40, 0, "40"], "window": [8, 0, 100], "pool": [7, 0, 2.5]},
        sj.RunConfig: {"kernels": ["xla", "bogus", 7], "expert_mode": ["grouped", "bogus"],
                       "row_kernel": ["gemm", "fast"], "repack": [None, "int4"], "gdn_chunk": [8, 0, "64"],
                       "prefill_buckets": [(16,), (0,), 5]},
    }


def _typed_cases(n: int, seed: int):
    """Random field values (valid, invalid, and `_WEIRD` ones) for every option type: each builds, or
    raises one SharpiError whose line names a field that was given (or the required budget)."""
    rng = np.random.default_rng(seed)
    pools = _typed_pools()
    built = []
    for i in range(n):
        cls = list(pools)[i % len(pools)]
        kw = _pick(rng, pools[cls], int(rng.integers(1, 4)))
        out: list = []
        outcome = _run(f"{cls.__name__}({kw}) (seed {seed})", lambda: out.append(cls(**kw)))
        if outcome == "ours":
            try:
                cls(**kw)
            except SharpiError as e:
                # the field given, or the required one missing (the budget of ExpertResidency / SnapKV)
                assert any(k in str(e) for k in kw) or "budget" in str(e), (kw, e)
        else:
            built.append(out[0])
    return built


def test_fuzz_typed_options():
    built = _typed_cases(60, seed=11)
    assert len(built) >= 5


@pytest.mark.slow
def test_fuzz_typed_options_generate(engine):
    """Every GenerateOptions the fuzz builds runs or raises one line (e.g. kv eviction past the prompt)."""
    for o in [b for b in _typed_cases(300, seed=12) if isinstance(b, sj.GenerateOptions)][:40]:
        o = __import__("dataclasses").replace(o, max_new_tokens=min(o.max_new_tokens, 3))
        _run(f"generate with {o}", lambda o=o: engine.generate("def f(x):", o))
