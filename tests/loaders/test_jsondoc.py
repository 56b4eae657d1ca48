"""loaders/jsondoc.py: the one reader of JSON from files bounds size, depth and numbers before
anything is trusted, and names the field a typed document gets wrong."""

from __future__ import annotations

from typing import Annotated

import msgspec
import pytest

from attncheck.loaders import jsondoc
from attncheck.loaders.capture_schema import CallMeta, meta_fields


def refused(data: bytes, type=object, **kw) -> str:
    with pytest.raises(jsondoc.JSONError) as info:
        jsondoc.decode(data, type, **kw)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("depth", [65, 1000, 5000, 100_000])
def test_nesting_deeper_than_the_limit_is_one_error_not_a_recursion(depth):
    assert refused(b"[" * depth + b"]" * depth) == "nested deeper than 64 levels"
    assert refused(b'{"a":' * depth + b"1" + b"}" * depth) == "nested deeper than 64 levels"


def test_nesting_up_to_the_limit_reads():
    assert jsondoc.decode(b"[" * 64 + b"]" * 64) is not None
    assert refused(b"[" * 9 + b"]" * 9, max_depth=8) == "nested deeper than 8 levels"


def test_size_is_bounded_before_parsing():
    assert refused(b"[" + b"1," * 100 + b"1]", max_bytes=100).startswith("203 bytes of JSON, over the limit of 100")


@pytest.mark.parametrize(
    "text,why",
    [
        (b"1" + b"0" * 5000, "an integer beyond 64 bits"),  # Python's int-string limit never comes into play
        (b"[1" + b"0" * 400 + b"]", "an integer beyond 64 bits"),
        (b"1e400", "a number beyond float64's range"),
        (b"NaN", "not JSON"),
        (b"[Infinity]", "not JSON"),
        (b"\xff{}", "not JSON"),
        (b"{", "not JSON"),
        (b"", "not JSON"),
    ],
)
def test_numbers_and_text_beyond_what_json_holds(text, why):
    assert refused(text).startswith(why)


class Entry(msgspec.Struct):
    index: Annotated[int, msgspec.Meta(ge=0)]


class Doc(msgspec.Struct):
    calls: list[Entry]


def test_typed_errors_name_the_field():
    assert refused(b'{"calls": [{"index": 1}, {"index": -1}]}', Doc) == "calls[1].index: expected int >= 0"
    assert refused(b'{"calls": [{"index": "1"}]}', Doc) == "calls[0].index: expected int, got str"
    assert refused(b'{"calls": [{}]}', Doc) == "calls[0]: object missing required field index"
    assert jsondoc.decode(b'{"calls": [{"index": 3, "later": [[[[{"field": 1}]]]]}], "new": 1}', Doc) == Doc(
        [Entry(3)]
    )  # unknown fields: ignored


@pytest.mark.parametrize(
    "field,value",
    [
        ("scale", "nan"),
        ("scale", "inf"),
        ("scale", "-1"),
        ("scale", "0"),
        ("scale", "1e400"),
        ("scale", "abc"),
        ("scale", "1" + "0" * 5000),
        ("dtype", "float8_e4m3fn"),
        ("dtype", "int32"),
        ("forward", "\u00b2"),
        ("forward", "-1"),
        ("call", "1" + "0" * 5000),
        ("dropout_p", "nan"),
        ("dropout_p", "2"),
        ("kind", "scores"),
        ("is_causal", "yes"),
        ("num_heads", "0"),
    ],
)
def test_call_metadata_out_of_range(field, value):
    meta = {"format": "attncheck.capture/1", "kind": "sdpa", "call": "0", field: value}
    with pytest.raises(jsondoc.JSONError, match=f"^{field}: "):
        jsondoc.convert(meta_fields(meta), CallMeta, lax=True)


def test_call_metadata_as_the_recorder_writes_it():
    meta = {
        "format": "attncheck.capture/1",
        "kind": "sdpa",
        "module": "none",
        "call": "7",
        "forward": "2",
        "dtype": "bfloat16",
        "softmax_dtype": "none",
        "is_causal": "true",
        "scale": "0.125",
        "dropout_p": "0.0",
        "sdpa_backend": "math",
        "grads": "true",
        "mask_kind": "causal",
    }  # fields of a newer writer: ignored
    m = jsondoc.convert(meta_fields(meta), CallMeta, lax=True)
    assert (m.kind, m.module, m.call, m.forward, m.dtype, m.softmax_dtype, m.is_causal, m.scale) == (
        "sdpa",
        "none",
        7,
        2,
        "bfloat16",
        None,
        True,
        0.125,
    )
