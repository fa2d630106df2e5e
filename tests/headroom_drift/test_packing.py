"""Compact encodings of stored groups: exact round trips, refused inputs, frozen format."""

from __future__ import annotations

import hashlib
import math
import pickle
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_replay.headroom_drift import packing
from verl_replay.headroom_drift.packing import (
    MetaDecodeError,
    decode_meta,
    encode_meta,
    id_width,
    pack_bits,
    pack_ids,
    unpack_bits,
    unpack_ids,
)


def same(a, b) -> bool:
    """Exact equality: types (tuple vs list, bool vs int), float bits, tensor dtype/shape/bytes."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):

        def raw(t):
            return t.reshape(-1).view(torch.uint8).tolist()

        return a.dtype == b.dtype and a.shape == b.shape and raw(a) == raw(b)
    return a == b


# ----------------------------------------------------------------------------- metadata


def test_meta_round_trip_is_exact_for_every_supported_type():
    meta = {
        "none": None,
        "flags": [True, False],
        "ints": [0, 1, -1, 127, 128, -129, 2**63, -(2**70)],
        "floats": [0.0, -0.0, 1.5, -2.25e-300, math.inf, -math.inf, math.nan, 1e308],
        "text": ["", "plain", "ünïcødé ✓ 数学", "\ud800 lone surrogate", "x" * 1000],
        "tuple": (1, ("nested", [2.0, {"k": None}])),
        "empty": {"l": [], "t": (), "d": {}},
        "bool_is_not_int": {"t": True, "one": 1},
        "tensors": [
            torch.arange(6, dtype=torch.int64).reshape(2, 3),
            torch.tensor(3.5),
            torch.zeros(0, 4, dtype=torch.float16),
            torch.tensor([True, False]),
            torch.randn(3, dtype=torch.bfloat16),
            torch.arange(12.0).reshape(3, 4).t(),
            torch.tensor([1 + 2j], dtype=torch.complex64),
        ],
    }
    meta["tensors"] += [
        torch.arange(4).to(dt) for dt in packing._DTYPES if dt not in (torch.complex64, torch.complex128)
    ]
    back = decode_meta(encode_meta(meta))
    assert same(back, meta)
    assert back["tensors"][5].is_contiguous()  # a transposed view comes back as plain data
    assert math.isnan(back["floats"][6])


plain_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.tuples(inner, inner) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=30,
)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.text(max_size=12), plain_values, max_size=6))
def test_meta_round_trip_property(meta):
    assert same(decode_meta(encode_meta(meta)), meta)


def test_meta_subclasses_are_stored_as_their_base_type():
    import collections
    import enum

    class Color(enum.IntEnum):
        RED = 3

    class Liar(str):  # the stored value is the string's content, not what __str__ says
        def __str__(self):
            return "lie"

    pair = collections.namedtuple("pair", "a b")
    back = decode_meta(
        encode_meta(
            {"e": Color.RED, "f": np.float64(0.5), "s": Liar("x"), "d": collections.OrderedDict(a=1), "p": pair(1, [2])}
        )
    )
    assert same(back, {"e": 3, "f": 0.5, "s": "x", "d": {"a": 1}, "p": (1, [2])})


def test_meta_refuses_what_it_cannot_store_and_names_the_path():
    with pytest.raises(ValueError, match=r"got object at meta\['a'\]\[1\]"):
        encode_meta({"a": [1, object()]})
    with pytest.raises(ValueError, match="numpy"):
        encode_meta({"x": np.float32(1.0)})
    with pytest.raises(ValueError, match="keys must be str"):
        encode_meta({"d": {1: 2}})
    with pytest.raises(ValueError, match="dense"):
        encode_meta({"s": torch.eye(2).to_sparse()})
    with pytest.raises(ValueError, match="must be a dict"):
        encode_meta([1, 2])
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(ValueError, match="nested too deeply"):
        encode_meta({"deep": deep})


def test_meta_corruption_is_detected(synth):
    blob = encode_meta(synth.verl_like_meta(3))
    for bad in (
        b"",
        bytes([9]) + blob[1:],
        blob[:-5],
        blob + b"\0",
        bytes([packing._RAW]) + b"q",
        bytes([packing._RAW]) + b"s\x05ab",
    ):
        with pytest.raises(MetaDecodeError):
            decode_meta(bad)
    with pytest.raises(MetaDecodeError, match="not a dict"):
        decode_meta(bytes([packing._RAW]) + b"N")


def test_meta_is_compact_for_verl_rows(synth):
    metas = [synth.verl_like_meta(k) for k in range(20)]
    encoded = [encode_meta(m) for m in metas]
    assert all(e[0] == packing._DEFLATE_DICT_V1 for e in encoded)
    mean = sum(map(len, encoded)) / len(encoded)
    pickled = sum(len(pickle.dumps(m)) for m in metas) / len(metas)
    # measured: ~360 B encoded vs ~1.9 KB pickled
    assert mean < 0.3 * pickled and mean < 450
    assert encode_meta({"uid": "u1"})[0] == packing._RAW  # tiny metadata is not compressed


def test_preset_dictionary_is_frozen():
    # Stored blobs decode only with this exact dictionary: edit it and old files are garbage.
    # A new dictionary needs a new storage code next to _DEFLATE_DICT_V1.
    digest = hashlib.sha256(packing._ZDICT_V1).hexdigest()
    assert digest == "649eb15f23d50c41e6faef7cd806154fecc75d071389d7bb74afef6375c62997", digest


# ----------------------------------------------------------------------------- token ids and bits


@pytest.mark.parametrize(
    "values, width",
    [
        ([], 2),
        ([0, 65535], 2),
        ([65536], 3),
        ([0, 2**24 - 1], 3),
        ([2**24], 4),
        ([-1, 5], 4),
        ([2**31 - 1, -(2**31)], 4),
    ],
)
def test_id_width_and_round_trip(values, width):
    ids = torch.tensor(values, dtype=torch.int32)
    assert id_width(ids) == width
    raw = pack_ids(ids, width)
    assert len(raw) == width * len(values)
    back = unpack_ids(b"xyz" + raw, 3, len(values), width)  # at an offset, like inside a group
    assert back.dtype == torch.int32 and back.tolist() == values


def test_ids_round_trip_random_vocabularies():
    gen = torch.Generator().manual_seed(0)
    for vocab in (32_000, 151_936, 2**24, 2**31 - 1):
        ids = torch.randint(0, vocab, (1000,), generator=gen, dtype=torch.int32)
        w = id_width(ids)
        assert unpack_ids(pack_ids(ids, w), 0, 1000, w).tolist() == ids.tolist()


@pytest.mark.parametrize("count", [0, 1, 7, 8, 9, 17, 64, 1001])
def test_bits_round_trip(count):
    bits = torch.rand(count, generator=torch.Generator().manual_seed(count)) > 0.5
    raw = pack_bits(bits)
    assert len(raw) == (count + 7) // 8
    back = unpack_bits(b"\xff" + raw, 1, count)
    assert back.dtype == torch.bool and back.tolist() == bits.tolist()
