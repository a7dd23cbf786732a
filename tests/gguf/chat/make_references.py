"""Render tests/gguf/chat/cases.json with Hugging Face transformers' apply_chat_template, ONCE, into
tests/gguf/chat/transformers_rendered.json (the reference strings test_chat.py compares against).

transformers is not a test dependency; the file was made with:

    python -m venv --system-site-packages /tmp/venv23 && /tmp/venv23/bin/pip install transformers
    /tmp/venv23/bin/python tests/gguf/chat/make_references.py

(transformers version recorded in the output). The tokenizer is a bare `PreTrainedTokenizerFast`
with BOS / EOS strings: the rendering does not depend on the vocabulary.
"""

import json
from pathlib import Path

import transformers
from tokenizers import Tokenizer, models

HERE = Path(__file__).parent


def main():
    template = (HERE / "qwen35_style.jinja").read_text()
    cases = json.loads((HERE / "cases.json").read_text())
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()),
                                               bos_token="<|endoftext|>", eos_token="<|im_end|>")
    out = {"transformers": transformers.__version__, "rendered": {}}
    for name, case in cases.items():
        out["rendered"][name] = tok.apply_chat_template(
            case["messages"], chat_template=template, tokenize=False, tools=case.get("tools"),
            add_generation_prompt=case.get("add_generation_prompt", True), **case.get("kwargs", {}))
    (HERE / "transformers_rendered.json").write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
