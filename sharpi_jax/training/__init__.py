"""Training a small qwen35moe model with an MTP head (the embedded default model).

`model`: a differentiable batched graph over GGUF-named float32 params (the engine's function);
`data`: the stdlib-sources corpus, its BPE vocab and [B, T] batches; `trainer`: the JSON preset, the
AdamW step, the loop and the GGUF export. Entry point: `python -m experiments.train_tiny`.
"""
