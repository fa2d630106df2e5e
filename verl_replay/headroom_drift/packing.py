"""Compact byte encodings for stored replay groups (torch/numpy/stdlib only).

A buffer at paper scale holds ~1e5 groups for the whole run, so what a group costs beyond its
token payload matters: every torch tensor carries a few hundred bytes of bookkeeping and a
Python dict of per-row metadata (verl's dataset and reward fields) costs kilobytes. A
:class:`~verl_replay.headroom_drift.buffer.ReplayGroup` therefore keeps everything in one
``bytearray`` built from the helpers below:

* :func:`encode_meta` / :func:`decode_meta`: a small tagged binary format for the plain values a
  group's metadata may hold (None, bool, int, float, str, list, tuple, dict with str keys, dense
  tensors), deflate-compressed with a preset dictionary of verl's field names when that is
  smaller. Decoding builds only those types, so a stored file can
  never run code (unlike pickle), and a round trip is exact (tuples stay tuples, float bits and
  tensor dtypes are kept).
* :func:`id_width` / :func:`pack_ids` / :func:`unpack_ids`: token ids in 2, 3 or 4 bytes each,
  the narrowest width that holds the group's ids (3 bytes cover every vocabulary below 2^24).
* :func:`pack_bits` / :func:`unpack_bits`: boolean vectors at one bit per entry.

All multi-byte values are little-endian, so stored bytes are portable across machines.
"""

from __future__ import annotations

import math
import struct
import sys
import zlib
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "MetaDecodeError",
    "decode_meta",
    "encode_meta",
    "id_width",
    "pack_bits",
    "pack_ids",
    "unpack_bits",
    "unpack_ids",
]

LITTLE_ENDIAN = sys.byteorder == "little"


class MetaDecodeError(ValueError):
    """Stored metadata bytes that are not a valid encoding (corruption or a foreign blob)."""


# ============================================================================ token ids

_ID_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<i4")}


def id_width(ids: Tensor) -> int:
    """Bytes per id needed to store ``ids`` exactly: 2 (< 2^16), 3 (< 2^24) or 4 (any int32)."""
    if ids.numel() == 0:
        return 2
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= 1 << 24:
        return 4
    return 2 if hi < 1 << 16 else 3


def pack_ids(ids: Tensor, width: int) -> bytes:
    """``ids`` (1-D integer tensor whose values fit ``width``) as little-endian bytes."""
    a = ids.numpy().astype(np.int64, copy=False)
    if width == 3:
        return a.astype("<u4").view(np.uint8).reshape(-1, 4)[:, :3].tobytes()
    return a.astype(_ID_DTYPES[width]).tobytes()


def unpack_ids(buf: Any, offset: int, count: int, width: int) -> Tensor:
    """``count`` ids of ``width`` bytes at ``buf[offset:]`` as a new int32 tensor."""
    if width == 3:
        b = np.frombuffer(buf, np.uint8, 3 * count, offset).reshape(count, 3).astype(np.int32)
        out = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
    else:
        out = np.frombuffer(buf, _ID_DTYPES[width], count, offset).astype(np.int32)
    return torch.from_numpy(out)


# ============================================================================ bits


def pack_bits(bits: Tensor) -> bytes:
    """Boolean vector -> ``ceil(len / 8)`` bytes (numpy bit order: first entry = high bit)."""
    return np.packbits(bits.numpy().astype(np.bool_, copy=False)).tobytes()


def unpack_bits(buf: Any, offset: int, count: int) -> Tensor:
    """``count`` booleans packed by :func:`pack_bits` at ``buf[offset:]`` as a new bool tensor."""
    raw = np.frombuffer(buf, np.uint8, (count + 7) // 8, offset)
    return torch.from_numpy(np.unpackbits(raw, count=count).astype(np.bool_))


# ============================================================================ metadata

# Tags of the metadata format, one byte each.
_NONE, _TRUE, _FALSE, _INT, _FLOAT, _STR, _LIST, _TUPLE, _DICT, _TENSOR = b"NTFidsltmx"
_DOUBLE = struct.Struct("<d")

# Stable codes of the tensor dtypes metadata may hold (append only: codes are stored).
_DTYPES: tuple[torch.dtype, ...] = (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
    torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
    torch.uint16, torch.uint32, torch.uint64,
)
_DTYPE_CODE = {dt: i for i, dt in enumerate(_DTYPES)}

# Blob prefix: one byte saying how the encoding is stored. Codes are stored: append only.
_RAW, _ZLIB, _DEFLATE_DICT_V1 = 0, 1, 2
# Compress only when it pays: below this size the deflate block overhead eats the gain.
_MIN_COMPRESS = 32


def _key(name: str) -> bytes:
    return bytes([len(name)]) + name.encode()


def _text(value: str) -> bytes:
    return _STR.to_bytes(1, "little") + bytes([len(value)]) + value.encode()


# Preset deflate dictionary (stored format: never edit; a new dictionary needs a new storage
# code). Deflate back-references into it make the first occurrence of each name nearly free:
# verl's row fields (agent loop output, RLHFDataset, reward extra info), the project's RL
# parquet schema and prompt wording, written exactly as the encoding spells them (dict keys
# length-prefixed, strings tagged). Later entries are the most frequent (shorter distances).
_ZDICT_V1 = b"".join(
    [_key(k) for k in (
        "db_id", "db_path", "gold_sqls", "semantics", "difficulty", "evidence", "category",
        "need_tools_kwargs", "teacher_ids", "teacher_logprobs", "routed_experts",
        "min_global_steps", "max_global_steps", "mm_processor_kwargs", "agent_name", "uid",
        "session_id", "global_steps", "dummy_tensor", "ability", "num_turns",
        "multi_modal_inputs", "tools_kwargs", "interaction_kwargs", "index", "question_id",
        "benchmark", "question", "split", "extra_info", "style", "ground_truth", "reward_model",
        "data_source", "role", "content", "prompt", "raw_prompt", "source_uid", "shared",
        "per_row", "generate_sequences", "tool_calls", "compute_score", "num_preempted",
        "metrics", "turn_scores", "tool_rewards", "score", "acc", "reason",
        "reward_extra_info", "extra_fields",
    )]
    + [_text(v) for v in (
        "spider", "bird", "tiny_sql", "tiny_math", "sql", "math", "test", "train", "rule",
        "system", "assistant", "user", "gold_error", "mismatch", "match",
        "Answer with one SQLite query in a ```sql code block.",
        "Put the final answer in \\boxed{}.",
        "Please reason step by step, and put your final answer within \\boxed{}.",
    )]
)


def _varint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _encode(out: bytearray, value: Any, where: str) -> None:
    # bool before int: True is an int
    if value is None:
        out.append(_NONE)
    elif value is True:
        out.append(_TRUE)
    elif value is False:
        out.append(_FALSE)
    elif isinstance(value, int):
        out.append(_INT)
        _varint(out, (value << 1) if value >= 0 else ((-value) << 1) - 1)  # zigzag
    elif isinstance(value, float):
        out.append(_FLOAT)
        out += _DOUBLE.pack(value)
    elif isinstance(value, str):
        raw = value.encode("utf-8", "surrogatepass")
        out.append(_STR)
        _varint(out, len(raw))
        out += raw
    elif isinstance(value, (list, tuple)):
        out.append(_LIST if isinstance(value, list) else _TUPLE)
        _varint(out, len(value))
        for i, v in enumerate(value):
            _encode(out, v, f"{where}[{i}]")
    elif isinstance(value, dict):
        out.append(_DICT)
        _varint(out, len(value))
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"meta keys must be str, got {k!r} at {where}")
            raw = k.encode("utf-8", "surrogatepass")
            _varint(out, len(raw))
            out += raw
            _encode(out, v, f"{where}[{k!r}]")
    elif isinstance(value, Tensor):
        _encode_tensor(out, value, where)
    else:
        raise ValueError(
            f"meta values must be None/bool/int/float/str/list/tuple/dict/Tensor, got "
            f"{type(value).__name__} at {where} (convert numpy scalars with .item())"
        )


def _encode_tensor(out: bytearray, t: Tensor, where: str) -> None:
    if t.layout != torch.strided or t.is_nested or t.is_quantized:
        raise ValueError(f"meta tensors must be dense (strided), got layout {t.layout} at {where}")
    code = _DTYPE_CODE.get(t.dtype)
    if code is None:
        raise ValueError(f"meta tensor dtype {t.dtype} is not supported at {where}")
    t = t.detach().to("cpu").contiguous()
    out.append(_TENSOR)
    out.append(code)
    _varint(out, t.dim())
    for s in t.shape:
        _varint(out, s)
    if t.numel():
        raw = t.reshape(-1).view(torch.uint8).numpy()
        if not LITTLE_ENDIAN and t.element_size() > 1:
            raw = raw.reshape(-1, t.element_size())[:, ::-1]
        out += raw.tobytes()


def encode_meta(meta: dict[str, Any]) -> bytes:
    """``meta`` as compact bytes (tagged binary, zlib-compressed when that makes it smaller).

    Raises ValueError naming the offending path for values outside the supported types.
    """
    if not isinstance(meta, dict):
        raise ValueError(f"meta must be a dict, got {type(meta).__name__}")
    body = bytearray()
    _encode(body, meta, "meta")
    if len(body) >= _MIN_COMPRESS:
        c = zlib.compressobj(9, zlib.DEFLATED, -15, 9, zlib.Z_DEFAULT_STRATEGY, _ZDICT_V1)
        packed = c.compress(body) + c.flush()
        if len(packed) < len(body):
            return bytes([_DEFLATE_DICT_V1]) + packed
    return bytes([_RAW]) + bytes(body)


class _Reader:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, count: int) -> memoryview:
        end = self.pos + count
        if end > len(self.buf):
            raise MetaDecodeError("stored metadata is truncated")
        part = self.buf[self.pos:end]
        self.pos = end
        return part

    def byte(self) -> int:
        if self.pos >= len(self.buf):
            raise MetaDecodeError("stored metadata is truncated")
        b = self.buf[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        value = shift = 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            if b < 0x80:
                return value
            shift += 7

    def text(self) -> str:
        try:
            return str(self.take(self.varint()), "utf-8", "surrogatepass")
        except UnicodeDecodeError:
            raise MetaDecodeError("stored metadata holds invalid UTF-8") from None


def _decode(r: _Reader) -> Any:
    tag = r.byte()
    if tag == _NONE:
        return None
    if tag == _TRUE:
        return True
    if tag == _FALSE:
        return False
    if tag == _INT:
        z = r.varint()
        return -((z + 1) >> 1) if z & 1 else z >> 1
    if tag == _FLOAT:
        return _DOUBLE.unpack(r.take(8))[0]
    if tag == _STR:
        return r.text()
    if tag in (_LIST, _TUPLE):
        items = [_decode(r) for _ in range(r.varint())]
        return items if tag == _LIST else tuple(items)
    if tag == _DICT:
        out = {}
        for _ in range(r.varint()):
            key = r.text()
            out[key] = _decode(r)
        return out
    if tag == _TENSOR:
        return _decode_tensor(r)
    raise MetaDecodeError(f"stored metadata has an unknown tag {tag!r}")


def _decode_tensor(r: _Reader) -> Tensor:
    code = r.byte()
    if code >= len(_DTYPES):
        raise MetaDecodeError(f"stored metadata has an unknown tensor dtype code {code}")
    dtype = _DTYPES[code]
    shape = [r.varint() for _ in range(r.varint())]
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    size = torch.empty((), dtype=dtype).element_size()
    raw = np.frombuffer(r.take(numel * size), np.uint8)
    if not LITTLE_ENDIAN and size > 1:
        raw = raw.reshape(-1, size)[:, ::-1].reshape(-1)
    return torch.from_numpy(raw.copy()).view(dtype).reshape(shape)


def decode_meta(blob: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Inverse of :func:`encode_meta` (new objects every call)."""
    view = memoryview(blob)
    if len(view) == 0:
        raise MetaDecodeError("stored metadata is empty")
    kind = view[0]
    if kind in (_ZLIB, _DEFLATE_DICT_V1):
        d = (zlib.decompressobj() if kind == _ZLIB
             else zlib.decompressobj(-15, zdict=_ZDICT_V1))
        try:
            raw = d.decompress(view[1:]) + d.flush()
        except zlib.error as exc:
            raise MetaDecodeError(f"stored metadata does not decompress: {exc}") from None
        if not d.eof or d.unused_data:
            raise MetaDecodeError("stored metadata is truncated or has trailing bytes")
        view = memoryview(raw)
    elif kind == _RAW:
        view = view[1:]
    else:
        raise MetaDecodeError(f"stored metadata has an unknown storage kind {kind}")
    r = _Reader(view)
    value = _decode(r)
    if r.pos != len(view):
        raise MetaDecodeError(f"stored metadata has {len(view) - r.pos} trailing bytes")
    if not isinstance(value, dict):
        raise MetaDecodeError("stored metadata is not a dict")
    return value
