"""Training a small qwen35moe model with an MTP head (the embedded default model).

`model`: the loss, computed by the inference modules (float storage, a [B, T] batch axis) on
GGUF-named float32 params; `experts`: float routed experts (dense or capacity dispatch);
`data`: the stdlib-sources corpus, its BPE vocab and [B, T] batches; `trainer`: the JSON preset, the
AdamW step, the loop and the GGUF export. Entry point: `python -m experiments.train_tiny`.
"""
