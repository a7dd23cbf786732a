"""Multi-turn prefill with a session (`Engine.session`) against a fresh generate over the whole
conversation each turn: tokens prefilled, prefill seconds, and whether the tokens are the same.

    python -m experiments.bench_session [--gguf=F] [--first=600] [--turn=120] [--turns=4] [--repeats=3]

The conversation: a first prompt of --first tokens of the held-out corpus, then --turns turns, each the
previous reply (--reply tokens, greedy, MTP off or --speculative=mtp) and --turn new corpus tokens. Per
turn: the conversation length, the tokens the session prefilled (the new ones plus the kept state's
shortfall: < one prefill bucket), the session's and the fresh generate's prefill seconds (median [min-max]
of --repeats rounds, the two interleaved, warm), their ratio, and whether the session's tokens equal the
fresh generate's (they must, bit for bit). Timings only; nothing here is a test.
"""

from __future__ import annotations

import json
from pathlib import Path

from absl import app, flags

from experiments.bench_batch import CORPUS
from experiments.timing import fmt_spread, line_buffered, spread

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("gguf", None, "GGUF (default: the embedded default model).")
    flags.DEFINE_integer("first", 600, "Tokens of the first prompt.", lower_bound=1)
    flags.DEFINE_integer("turn", 120, "New tokens per later turn.", lower_bound=1)
    flags.DEFINE_integer("turns", 4, "Turns after the first.", lower_bound=1)
    flags.DEFINE_integer("reply", 16, "Tokens generated per turn.", lower_bound=1)
    flags.DEFINE_string("speculative", None, "None or mtp.")
    flags.DEFINE_integer("repeats", 3, "Rounds (median, min, max).", lower_bound=1)
    flags.DEFINE_string("json_out", None, "Write the records here.")


def main(argv) -> int:
    del argv
    line_buffered()
    import sharpi_jax as sj

    n_total = FLAGS.first + FLAGS.turns * (FLAGS.turn + FLAGS.reply) + FLAGS.reply + 8
    engine = sj.load(FLAGS.gguf, max_context=n_total)
    corpus = engine.tokenizer.encode(CORPUS.read_text(encoding="utf-8"))
    pieces = [corpus[:FLAGS.first]] + [corpus[FLAGS.first + i * FLAGS.turn:FLAGS.first + (i + 1) * FLAGS.turn]
                                       for i in range(FLAGS.turns)]
    gen = dict(max_new_tokens=FLAGS.reply, stop_on_eos=False, speculative=FLAGS.speculative)

    def conversation():
        """One conversation: per turn (length, prefilled, session prefill_s, fresh prefill_s, same tokens)."""
        s, rows = engine.session(), []
        for piece in pieces:
            out = s.generate(piece, **gen)
            conv = s.ids[:len(s.ids) - len(out.tokens)]
            ref = engine.generate(conv, **gen)
            rows.append((len(conv), out.stats.session.prefilled_tokens, out.stats.speed.prefill_s,
                         ref.stats.speed.prefill_s, out.tokens == ref.tokens))
        return rows

    conversation()  # warm-up: compiles every bucket and loop
    rounds = [conversation() for _ in range(FLAGS.repeats)]
    print(f"{Path(engine.path).name}: {FLAGS.turns + 1} turns, replies of {FLAGS.reply} tokens "
          f"(speculative={FLAGS.speculative}); prefill seconds median [min-max] of {FLAGS.repeats} rounds")
    print(f"{'turn':>4} | {'tokens':>6} | {'prefilled':>9} | {'session prefill s':>22} | {'fresh prefill s':>22} | "
          f"{'fresh/session':>13} | same tokens")
    records = []
    for t in range(len(pieces)):
        n, pre = rounds[0][t][0], rounds[0][t][1]
        ses, fre = [r[t][2] for r in rounds], [r[t][3] for r in rounds]
        same = all(r[t][4] for r in rounds)
        ratio = spread(fre)["median"] / spread(ses)["median"]
        records.append({"turn": t, "tokens": n, "prefilled": pre, "session_prefill_s": ses, "fresh_prefill_s": fre,
                        "same_tokens": same})
        print(f"{t:>4} | {n:>6} | {pre:>9} | {fmt_spread(ses, 22, 3)} | {fmt_spread(fre, 22, 3)} | {ratio:>13.2f} | "
              f"{same}")
    if FLAGS.json_out:
        Path(FLAGS.json_out).write_text(json.dumps(records, indent=1))
    engine.close()
    return 0 if all(r["same_tokens"] for r in records) else 1


if __name__ == "__main__":
    define_flags()
    app.run(main)
