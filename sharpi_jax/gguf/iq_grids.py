"""Lookup tables of ggml's i-quants (IQ1_S/IQ1_M, IQ2_XXS/XS/S, IQ3_XXS/S) as numpy arrays.

The codebooks are ggml's `iq*_grid` tables (ggml-common.h). They are taken from gguf-py, which ships
them packed (each grid byte stored as a small index into a value map, written as hex text); `grid`
unpacks them here. `KSIGNS` (ggml's `ksigns_iq2xs`: 7 sign bits plus an eighth that makes the
parity even) is computed, not copied.
"""

from __future__ import annotations

import functools
from math import ceil, log2

import numpy as np
from gguf import GGMLQuantizationType, quants as gguf_quants

Q = GGMLQuantizationType

# Which gguf-py class holds the packed table of each type (IQ1_M shares IQ1_S's codebook).
_GRID_OWNER = {
    Q.IQ1_S: "IQ1_S", Q.IQ1_M: "IQ1_S", Q.IQ2_XXS: "IQ2_XXS", Q.IQ2_XS: "IQ2_XS", Q.IQ2_S: "IQ2_S",
    Q.IQ3_XXS: "IQ3_XXS", Q.IQ3_S: "IQ3_S",
}

KSIGNS = np.array([i | (0x80 if bin(i).count("1") % 2 else 0) for i in range(128)], np.uint8)


@functools.lru_cache(maxsize=None)
def grid(qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 [entries, width] codebook of an i-quant type (ggml's grid values: 8/25/43, -1/0/1, ...)."""
    cls = getattr(gguf_quants, _GRID_OWNER[Q(qtype)])
    entries, width = cls.grid_shape
    values = np.asarray(cls.grid_map, np.float32)
    bits = ceil(log2(len(values)))
    packed = bytes.fromhex(cls.grid_hex.decode("ascii"))  # little-endian order of the packed bytes
    per_byte = 8 // bits  # fields per byte, spaced 8 // per_byte bits apart (3-bit codes: 2 per byte)
    codes = np.frombuffer(packed, np.uint8)[:, None] >> np.arange(0, 8, 8 // per_byte, dtype=np.uint8)
    codes = (codes & ((1 << bits) - 1)).reshape(entries, width)
    return values[codes]
