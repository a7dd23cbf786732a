"""GGUFFile: a read-only, bounds-checked, zero-copy view of a GGUF file.

GGUF files are untrusted input. The header is parsed by hand (not `gguf.GGUFReader`) so that every
length, count and offset is checked against the file size before it is used: a truncated or hostile
file raises `GGUFError` naming the file and what is wrong, never an IndexError, a MemoryError from a
giant allocation, or a hang. Tensor data is never read: `raw(name)` returns a numpy view into a
read-only mmap, so opening a 20 GB file costs only its header.

A split GGUF (`NAME-00001-of-0000N.gguf`, see `split.py`) opens from any of its parts: every part is
mapped read-only on its own and checked, and the file presents the first part's metadata and one
tensor table over all parts.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import stat
import struct
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from sharpi_jax.errors import GGUFError, UnsupportedQuantError
from sharpi_jax.gguf import split

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4
MAX_KEY_LENGTH = 1 << 16  # generous; real keys are < 100 bytes
MAX_TENSOR_NAME_LENGTH = 1 << 12

# GGUF value types -> (struct format, size). 8 = string, 9 = array.
_SCALAR_TYPES: dict[int, tuple[str, int]] = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_NUMPY_TYPES: dict[int, str] = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8",
    11: "<i8", 12: "<f8",
}
_STRING, _ARRAY = 8, 9


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives in the file and how it is encoded."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order (reverse of ggml ne)
    offset: int  # absolute byte offset in the file (in its part, for a split GGUF)
    nbytes: int
    part: int = 0  # which part of a split GGUF holds the data (0 for a single file)

    @property
    def ggml_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def byte_shape(self) -> tuple[int, ...]:
        """Shape of the raw uint8 view: rows of blocks along the last axis."""
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return (*self.shape[:-1], self.shape[-1] // block * type_size)


class _Cursor:
    """Little-endian reader over a buffer that checks every read against the end."""

    def __init__(self, buf: memoryview, source: str):
        self.buf, self.pos, self.source = buf, 0, source

    def _need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFError(f"{self.source}: truncated or corrupt header: {what} needs {n} bytes at offset "
                            f"{self.pos}, but the file has {len(self.buf)} bytes")

    def scalar(self, fmt: str, size: int, what: str) -> Any:
        self._need(size, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def u32(self, what: str) -> int:
        return self.scalar("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", 8, what)

    def string(self, what: str, max_len: int | None = None) -> str:
        n = self.u64(f"length of {what}")
        if max_len is not None and n > max_len:
            raise GGUFError(f"{self.source}: {what} has implausible length {n} (max {max_len})")
        self._need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.source}: {what} is not valid UTF-8 ({e})") from None

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype in _SCALAR_TYPES:
            fmt, size = _SCALAR_TYPES[vtype]
            v = self.scalar(fmt, size, what)
            return bool(v) if vtype == 7 else v
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            if depth > 0:
                raise GGUFError(f"{self.source}: {what} is a nested array; not supported")
            itype = self.u32(f"element type of {what}")
            count = self.u64(f"element count of {what}")
            if itype in _NUMPY_TYPES:
                size = _SCALAR_TYPES[itype][1]
                if count > (len(self.buf) - self.pos) // size:
                    raise GGUFError(f"{self.source}: array {what} claims {count} elements, more than the "
                                    "rest of the file holds")
                arr = np.frombuffer(self.buf, dtype=_NUMPY_TYPES[itype], count=count, offset=self.pos)
                self.pos += count * size
                if itype == 7:
                    return [bool(x) for x in arr]
                return arr.tolist()
            if itype == _STRING:
                # Each string takes at least its 8-byte length: bound the count before looping.
                if count > (len(self.buf) - self.pos) // 8:
                    raise GGUFError(f"{self.source}: array {what} claims {count} strings, more than the "
                                    "rest of the file holds")
                return [self.string(f"{what}[{i}]") for i in range(count)]
            raise GGUFError(f"{self.source}: {what} has unsupported array element type {itype}")
        raise GGUFError(f"{self.source}: {what} has unknown value type {vtype}")


class GGUFFile:
    """An open GGUF file: validated metadata, tensor table and zero-copy tensor views.

    Use as a context manager or call `close()`. Views returned by `raw()` keep the mapping alive.
    """

    def __init__(self, path: str | os.PathLike[str], *, single_part: bool = False):
        """Open `path`; a part of a split GGUF opens the whole set unless `single_part`."""
        self.path = Path(path)
        self.source = str(self.path)
        fd = self._open_regular_file()
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise GGUFError(f"{self.source}: empty file (0 bytes), not a GGUF file")
            if size < 24:
                raise GGUFError(f"{self.source}: file too small to be GGUF ({size} bytes)")
            try:
                self._mmap = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            except OSError as e:
                raise GGUFError(f"{self.source}: cannot map the file ({e.strerror})") from None
        finally:
            os.close(fd)
        self.file_size = size
        buf = memoryview(self._mmap)
        try:
            self._parse(buf)
        except BaseException:
            buf.release()
            self.close()
            raise
        buf.release()
        self._maps, self._sizes = [self._mmap], [size]  # one mapping per part
        self.parts = [self.source]
        try:
            if not single_part and split.split_count(self.metadata, self.source) > 1:
                self._join_parts()
        except BaseException:
            self.close()
            raise

    def _join_parts(self) -> None:
        """Open every part of the split set (each its own read-only mmap) and merge their tensor tables."""
        paths = split.part_paths(self.path, self.metadata)
        parts: list[GGUFFile] = []
        try:
            for i, p in enumerate(paths):
                part = GGUFFile(p, single_part=True)
                parts.append(part)
                split.check_part(part.metadata, i, len(paths), part.source)
            tensors: dict[str, TensorInfo] = {}
            for i, part in enumerate(parts):
                for name, t in part.tensors.items():
                    if name in tensors:
                        raise GGUFError(f"{part.source}: tensor {name!r} is also in part "
                                        f"{tensors[name].part + 1}")
                    tensors[name] = dataclasses.replace(t, part=i)
            split.check_tensor_count(parts[0].metadata, len(tensors), [q.source for q in parts])
        except BaseException:
            for part in parts:
                part.close()
            raise
        self._mmap.close()
        first = parts[0]
        self.metadata, self.version, self.tensors = first.metadata, first.version, tensors
        self.alignment, self.data_offset = first.alignment, first.data_offset
        self._maps = [q._mmap for q in parts]
        self._sizes = [q.file_size for q in parts]
        self._mmap = self._maps[0]
        for q in parts:
            q._mmap = None  # the maps now belong to this file
        self.parts = [q.source for q in parts]
        self.file_size = sum(self._sizes)

    def _open_regular_file(self) -> int:
        """A read-only descriptor of the path, or a one-line GGUFError: missing, a directory (Linux opens
        those read-only and mmap then fails with EINVAL), not a regular file (a FIFO would block), or
        unreadable."""
        try:
            st = os.stat(self.path)
        except OSError as e:
            raise GGUFError(f"{self.source}: cannot open ({e.strerror})") from None
        if stat.S_ISDIR(st.st_mode):
            raise GGUFError(f"{self.source}: is a directory, not a GGUF file")
        if not stat.S_ISREG(st.st_mode):
            raise GGUFError(f"{self.source}: not a regular file, so not a GGUF file")
        try:
            return os.open(self.path, os.O_RDONLY)
        except PermissionError:
            raise GGUFError(f"{self.source}: cannot read the file (permission denied)") from None
        except OSError as e:
            raise GGUFError(f"{self.source}: cannot open ({e.strerror})") from None

    # ----- parsing -----
    def _parse(self, buf: memoryview) -> None:
        """Read and check the header: metadata, alignment and the tensor table (no tensor data)."""
        cur = _Cursor(buf, self.source)
        n_tensors, n_kv = self._parse_counts(cur)
        self.metadata = self._parse_metadata(cur, n_kv)
        self.alignment = self._parse_alignment(self.metadata)
        infos = [self._parse_tensor_header(cur, i) for i in range(n_tensors)]
        data_start = -(-cur.pos // self.alignment) * self.alignment
        if data_start > self.file_size:
            raise GGUFError(f"{self.source}: truncated: tensor data would start at {data_start}, past the "
                            f"end of the file ({self.file_size} bytes)")
        self.data_offset = data_start
        tensors: dict[str, TensorInfo] = {}
        for name, ne, raw_type, rel_offset in infos:
            if name in tensors:
                raise GGUFError(f"{self.source}: duplicate tensor name {name!r}")
            tensors[name] = self._tensor_info(name, ne, raw_type, rel_offset)
        self._check_no_overlap(tensors)
        self.tensors = tensors

    def _parse_counts(self, cur: _Cursor) -> tuple[int, int]:
        """Check the magic and version; (tensor count, metadata count), bounded by the file size."""
        magic = bytes(cur.buf[:4])
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{self.source}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
        cur.pos = 4
        self.version = cur.u32("version")
        if self.version not in SUPPORTED_VERSIONS:
            raise GGUFError(f"{self.source}: unsupported GGUF version {self.version} "
                            f"(supported: {SUPPORTED_VERSIONS}; big-endian files are not supported)")
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        # Each kv needs >= 8+1+4+1 bytes and each tensor info >= 8+1+4+8+4+8: bound before looping.
        if n_kv > self.file_size // 14 or n_tensors > self.file_size // 33:
            raise GGUFError(f"{self.source}: header claims {n_kv} metadata entries and {n_tensors} tensors, "
                            "more than the file can hold")
        return n_tensors, n_kv

    def _parse_metadata(self, cur: _Cursor, n_kv: int) -> dict[str, Any]:
        """The n_kv key/value pairs (keys unique)."""
        md: dict[str, Any] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}", MAX_KEY_LENGTH)
            if key in md:
                raise GGUFError(f"{self.source}: duplicate metadata key {key!r}")
            vtype = cur.u32(f"type of metadata {key!r}")
            md[key] = cur.value(vtype, f"metadata {key!r}")
        return md

    def _parse_alignment(self, md: dict[str, Any]) -> int:
        """`general.alignment`: a power of two up to 1 MiB (default 32)."""
        alignment = md.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or \
                alignment & (alignment - 1) or alignment > 1 << 20:
            raise GGUFError(f"{self.source}: metadata 'general.alignment' = {alignment!r} is not a "
                            "power of two")
        return alignment

    def _parse_tensor_header(self, cur: _Cursor, i: int) -> tuple[str, list[int], int, int]:
        """Tensor info #i as read: (name, ggml dims, raw type id, offset relative to the data start)."""
        name = cur.string(f"name of tensor #{i}", MAX_TENSOR_NAME_LENGTH)
        n_dims = cur.u32(f"n_dims of tensor {name!r}")
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            raise GGUFError(f"{self.source}: tensor {name!r} has {n_dims} dims (1..{GGML_MAX_DIMS} allowed)")
        ne = [cur.u64(f"dim {d} of tensor {name!r}") for d in range(n_dims)]
        raw_type = cur.u32(f"type of tensor {name!r}")
        rel_offset = cur.u64(f"offset of tensor {name!r}")
        return name, ne, raw_type, rel_offset

    def _tensor_info(self, name: str, ne: list[int], raw_type: int, rel_offset: int) -> TensorInfo:
        """Check one tensor's type, dims and byte range against the file (needs `alignment`, `data_offset`)."""
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise UnsupportedQuantError(
                f"{self.source}: tensor {name!r} has unknown ggml type id {raw_type}") from None
        if qtype not in GGML_QUANT_SIZES:
            raise UnsupportedQuantError(f"{self.source}: tensor {name!r} uses ggml type {qtype.name}, "
                                        "which has no known block size")
        block, type_size = GGML_QUANT_SIZES[qtype]
        if any(d == 0 or d > 1 << 40 for d in ne):
            raise GGUFError(f"{self.source}: tensor {name!r} has invalid dims {ne}")
        n_el = 1
        for d in ne:
            n_el *= d
        if n_el > self.file_size * 64:  # no block type packs more than 64 values per byte
            raise GGUFError(f"{self.source}: tensor {name!r} with dims {ne} cannot fit in the file")
        if ne[0] % block:
            raise GGUFError(f"{self.source}: tensor {name!r} row length {ne[0]} is not a multiple of "
                            f"the {qtype.name} block size {block}")
        nbytes = n_el // block * type_size
        if rel_offset % self.alignment:
            raise GGUFError(f"{self.source}: tensor {name!r} offset {rel_offset} is not aligned to "
                            f"{self.alignment}")
        start = self.data_offset + rel_offset
        if start + nbytes > self.file_size:
            raise GGUFError(f"{self.source}: truncated: tensor {name!r} needs bytes [{start}, "
                            f"{start + nbytes}) but the file has {self.file_size}")
        return TensorInfo(name, qtype, tuple(int(d) for d in reversed(ne)), start, nbytes)

    def _check_no_overlap(self, tensors: dict[str, TensorInfo]) -> None:
        """Overlapping tensors are a sign of a forged file; reject them."""
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values())
        for (s0, e0, n0), (s1, _e1, n1) in zip(spans, spans[1:]):
            if s1 < e0:
                raise GGUFError(f"{self.source}: tensors {n0!r} and {n1!r} overlap in the file")

    # ----- metadata -----
    @property
    def architecture(self) -> str:
        return self.require("general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"{self.source}: missing required key {key!r}")
        return self.metadata[key]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors.values())

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.source}: no tensor named {name!r}") from None

    # ----- data -----
    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only zero-copy uint8 array of `TensorInfo.byte_shape`."""
        t = self.tensor(name)
        return np.frombuffer(self._maps[t.part], dtype=np.uint8, count=t.nbytes, offset=t.offset).reshape(t.byte_shape)

    def array(self, name: str) -> np.ndarray:
        """A float tensor (F32/F16/BF16-free of blocks) as a zero-copy typed view; others: see dequantize."""
        t = self.tensor(name)
        raw = self.raw(name)
        if t.qtype == GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(t.shape)
        if t.qtype == GGMLQuantizationType.F16:
            return raw.view(np.float16).reshape(t.shape)
        raise GGUFError(f"{self.source}: tensor {name!r} is {t.qtype.name}; use dequantize()")

    def dequantize(self, name: str):
        """The tensor as a float32 jax.Array (bitwise equal to gguf.quants.dequantize)."""
        from sharpi_jax.gguf import quants

        t = self.tensor(name)
        return quants.dequantize(self.raw(name), t.qtype, t.shape, name=f"{self.source}:{name}")

    def offset_of(self, view: np.ndarray) -> int:
        """The file offset of the first byte of a view returned by `raw()` (or a slice of one). For a
        split GGUF, offsets run over the parts end to end (part i's bytes start at the sizes before it)."""
        start = 0
        for m, size in zip(self._maps, self._sizes):
            off = view.ctypes.data - np.frombuffer(m, np.uint8).ctypes.data
            if 0 <= off < size:
                return int(start + off)
            start += size
        raise ValueError(f"{self.source}: the array is not a view of this file's mapping")

    def advise_willneed(self, offset: int, length: int) -> None:
        """Hint the kernel to prefetch a byte range (an `offset_of` offset; used when streaming cold
        experts)."""
        for m, size in zip(self._maps, self._sizes):
            if offset < size:
                if hasattr(m, "madvise") and hasattr(mmap, "MADV_WILLNEED"):
                    page = mmap.PAGESIZE
                    start = offset // page * page
                    m.madvise(mmap.MADV_WILLNEED, start, min(length + offset - start, size - start))
                return
            offset -= size

    def close(self) -> None:
        maps = getattr(self, "_maps", None) or [getattr(self, "_mmap", None)]
        for m in maps:
            if m is not None:
                try:
                    m.close()
                except BufferError:
                    pass  # numpy views still alive: the mapping closes when they go
        self._mmap = None  # type: ignore[assignment]
        self._maps = []

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({self.source!r}, arch={self.get('general.architecture')!r}, tensors={len(self.tensors)})"


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    return GGUFFile(path)
