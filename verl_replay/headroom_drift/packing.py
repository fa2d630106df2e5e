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
from collections.abc import Callable
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
    if width == 3:  # pad each id to 4 little-endian bytes (top byte 0) and reinterpret
        wide = np.zeros((count, 4), np.uint8)
        wide[:, :3] = np.frombuffer(buf, np.uint8, 3 * count, offset).reshape(count, 3)
        out = wide.view("<i4").reshape(count).astype(np.int32, copy=False)
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
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.uint16,
    torch.uint32,
    torch.uint64,
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
    [
        _key(k)
        for k in (
            "db_id",
            "db_path",
            "gold_sqls",
            "semantics",
            "difficulty",
            "evidence",
            "category",
            "need_tools_kwargs",
            "teacher_ids",
            "teacher_logprobs",
            "routed_experts",
            "min_global_steps",
            "max_global_steps",
            "mm_processor_kwargs",
            "agent_name",
            "uid",
            "session_id",
            "global_steps",
            "dummy_tensor",
            "ability",
            "num_turns",
            "multi_modal_inputs",
            "tools_kwargs",
            "interaction_kwargs",
            "index",
            "question_id",
            "benchmark",
            "question",
            "split",
            "extra_info",
            "style",
            "ground_truth",
            "reward_model",
            "data_source",
            "role",
            "content",
            "prompt",
            "raw_prompt",
            "source_uid",
            "shared",
            "per_row",
            "generate_sequences",
            "tool_calls",
            "compute_score",
            "num_preempted",
            "metrics",
            "turn_scores",
            "tool_rewards",
            "score",
            "acc",
            "reason",
            "reward_extra_info",
            "extra_fields",
        )
    ]
    + [
        _text(v)
        for v in (
            "spider",
            "bird",
            "tiny_sql",
            "tiny_math",
            "sql",
            "math",
            "test",
            "train",
            "rule",
            "system",
            "assistant",
            "user",
            "gold_error",
            "mismatch",
            "match",
            "Answer with one SQLite query in a ```sql code block.",
            "Put the final answer in \\boxed{}.",
            "Please reason step by step, and put your final answer within \\boxed{}.",
        )
    ]
)


class _Unsupported(Exception):
    """A value the format cannot hold; carries the path to it, innermost last."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.path: list[str] = []


def _varint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


# Encoded dict keys (length-prefixed UTF-8): the same few field names recur in every group.
_KEYS: dict[str, bytes] = {}
_MAX_KEYS = 4096


def _encoded_key(key: Any) -> bytes:
    raw = _KEYS.get(key) if type(key) is str else None
    if raw is None:
        if not isinstance(key, str):
            raise _Unsupported(f"meta keys must be str, got {key!r}")
        text = key.encode("utf-8", "surrogatepass")
        head = bytearray()
        _varint(head, len(text))
        raw = bytes(head) + text
        if len(_KEYS) < _MAX_KEYS:
            _KEYS[key] = raw
    return raw


_BASE_COPIES: tuple[tuple[type, Callable[[Any], Any]], ...] = (
    (str, str.__str__),
    (int, int.__int__),
    (float, float.__float__),
    (list, list.copy),
    (tuple, lambda v: tuple.__getitem__(v, slice(None))),
    (dict, dict.copy),
)


def _encode(out: bytearray, value: Any) -> None:
    t = type(value)  # exact types first (the common case), subclasses below
    if t is str:
        raw = value.encode("utf-8", "surrogatepass")
        out.append(_STR)
        _varint(out, len(raw))
        out += raw
    elif t is dict:
        out.append(_DICT)
        _varint(out, len(value))
        for k, v in value.items():
            out += _encoded_key(k)
            try:
                _encode(out, v)
            except _Unsupported as exc:
                exc.path.append(f"[{k!r}]")
                raise
    elif t is float:
        out.append(_FLOAT)
        out += _DOUBLE.pack(value)
    elif t is bool:
        out.append(_TRUE if value else _FALSE)
    elif t is int:
        out.append(_INT)
        _varint(out, (value << 1) if value >= 0 else ((-value) << 1) - 1)  # zigzag
    elif t is list or t is tuple:
        out.append(_LIST if t is list else _TUPLE)
        _varint(out, len(value))
        for i, v in enumerate(value):
            try:
                _encode(out, v)
            except _Unsupported as exc:
                exc.path.append(f"[{i}]")
                raise
    elif value is None:
        out.append(_NONE)
    elif isinstance(value, Tensor):
        _encode_tensor(out, value)
    elif isinstance(value, (str, int, float, list, tuple, dict)):
        # subclasses (IntEnum, numpy.float64, namedtuple, OrderedDict, ...) as their base type,
        # through the base type's own copy (a subclass may override __str__, __int__, ...)
        for base, copy in _BASE_COPIES:
            if isinstance(value, base):
                _encode(out, copy(value))
                break
    else:
        raise _Unsupported(
            f"meta values must be None/bool/int/float/str/list/tuple/dict/Tensor, got {type(value).__name__}",
            hint=" (convert numpy scalars with .item())",
        )


def _encode_tensor(out: bytearray, t: Tensor) -> None:
    if t.layout != torch.strided or t.is_nested or t.is_quantized:
        raise _Unsupported(f"meta tensors must be dense (strided), got layout {t.layout}")
    code = _DTYPE_CODE.get(t.dtype)
    if code is None:
        raise _Unsupported(f"meta tensor dtype {t.dtype} is not supported")
    t = t.detach().to("cpu").contiguous()
    out.append(_TENSOR)
    out.append(code)
    _varint(out, t.dim())
    for size in t.shape:
        _varint(out, size)
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
    try:
        _encode(body, meta)
    except _Unsupported as exc:
        where = "meta" + "".join(reversed(exc.path))
        raise ValueError(f"{exc.message} at {where}{exc.hint}") from None
    except RecursionError:
        raise ValueError("meta is nested too deeply to store") from None
    if len(body) >= _MIN_COMPRESS:
        c = zlib.compressobj(6, zlib.DEFLATED, -15, 9, zlib.Z_DEFAULT_STRATEGY, _ZDICT_V1)
        packed = c.compress(body) + c.flush()
        if len(packed) < len(body):
            return bytes([_DEFLATE_DICT_V1]) + packed
    return bytes([_RAW]) + bytes(body)


def _truncated() -> MetaDecodeError:
    return MetaDecodeError("stored metadata is truncated")


def _decode(b: bytes, pos: int) -> tuple[Any, int]:
    """(value, next position); ``b`` is the decompressed encoding. IndexError = truncated."""
    tag = b[pos]
    pos += 1
    if tag == _STR:
        size = b[pos]
        pos += 1
        if size >= 0x80:
            size, pos = _varint_rest(b, pos, size)
        end = pos + size
        if end > len(b):
            raise _truncated()
        return _text_at(b, pos, end), end
    if tag == _DICT:
        count = b[pos]
        pos += 1
        if count >= 0x80:
            count, pos = _varint_rest(b, pos, count)
        out = {}
        for _ in range(count):
            size = b[pos]
            pos += 1
            if size >= 0x80:
                size, pos = _varint_rest(b, pos, size)
            end = pos + size
            if end > len(b):
                raise _truncated()
            key = _text_at(b, pos, end)
            out[key], pos = _decode(b, end)
        return out, pos
    if tag == _FLOAT:
        if pos + 8 > len(b):
            raise _truncated()
        return _DOUBLE.unpack_from(b, pos)[0], pos + 8
    if tag == _INT:
        z = b[pos]
        pos += 1
        if z >= 0x80:
            z, pos = _varint_rest(b, pos, z)
        return (-((z + 1) >> 1) if z & 1 else z >> 1), pos
    if tag == _LIST or tag == _TUPLE:
        count = b[pos]
        pos += 1
        if count >= 0x80:
            count, pos = _varint_rest(b, pos, count)
        items = []
        for _ in range(count):
            item, pos = _decode(b, pos)
            items.append(item)
        return (items if tag == _LIST else tuple(items)), pos
    if tag == _NONE:
        return None, pos
    if tag == _TRUE:
        return True, pos
    if tag == _FALSE:
        return False, pos
    if tag == _TENSOR:
        return _decode_tensor(b, pos)
    raise MetaDecodeError(f"stored metadata has an unknown tag {tag!r}")


def _varint_rest(b: bytes, pos: int, first: int) -> tuple[int, int]:
    value, shift = first & 0x7F, 7
    while True:
        byte = b[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _varint_at(b: bytes, pos: int) -> tuple[int, int]:
    first = b[pos]
    return (first, pos + 1) if first < 0x80 else _varint_rest(b, pos + 1, first)


def _text_at(b: bytes, start: int, end: int) -> str:
    try:
        return b[start:end].decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        raise MetaDecodeError("stored metadata holds invalid UTF-8") from None


def _decode_tensor(b: bytes, pos: int) -> tuple[Tensor, int]:
    code = b[pos]
    if code >= len(_DTYPES):
        raise MetaDecodeError(f"stored metadata has an unknown tensor dtype code {code}")
    dtype = _DTYPES[code]
    ndim, pos = _varint_at(b, pos + 1)
    shape = []
    for _ in range(ndim):
        size, pos = _varint_at(b, pos)
        shape.append(size)
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype), pos
    size = torch.empty((), dtype=dtype).element_size()
    end = pos + numel * size
    if end > len(b):
        raise _truncated()
    raw = np.frombuffer(b, np.uint8, numel * size, pos)
    if not LITTLE_ENDIAN and size > 1:
        raw = raw.reshape(-1, size)[:, ::-1].reshape(-1)
    return torch.from_numpy(raw.copy()).view(dtype).reshape(shape), end


def decode_meta(blob: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Inverse of :func:`encode_meta` (new objects every call)."""
    view = memoryview(blob)
    if len(view) == 0:
        raise MetaDecodeError("stored metadata is empty")
    kind = view[0]
    if kind in (_ZLIB, _DEFLATE_DICT_V1):
        d = zlib.decompressobj() if kind == _ZLIB else zlib.decompressobj(-15, zdict=_ZDICT_V1)
        try:
            raw = d.decompress(view[1:]) + d.flush()
        except zlib.error as exc:
            raise MetaDecodeError(f"stored metadata does not decompress: {exc}") from None
        if not d.eof or d.unused_data:
            raise MetaDecodeError("stored metadata is truncated or has trailing bytes")
    elif kind == _RAW:
        raw = bytes(view[1:])
    else:
        raise MetaDecodeError(f"stored metadata has an unknown storage kind {kind}")
    try:
        value, pos = _decode(raw, 0)
    except IndexError:
        raise _truncated() from None
    except RecursionError:
        raise MetaDecodeError("stored metadata is nested too deeply") from None
    if pos != len(raw):
        raise MetaDecodeError(f"stored metadata has {len(raw) - pos} trailing bytes")
    if not isinstance(value, dict):
        raise MetaDecodeError("stored metadata is not a dict")
    return value
