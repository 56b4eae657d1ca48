"""--what-if rope:DTYPE split from the other what-if words, as text (the CLI) or a list (attncheck.capture)."""

import pytest

from attncheck.config.capture import CaptureRequest
from attncheck.config.rope import split_rope_what_if
from attncheck.errors import AttncheckError


@pytest.mark.parametrize(
    "given, rope, rest",
    [
        ("fp16,rope:bf16", ("bf16",), "fp16"),
        ("rope:bf16, rope:float16", ("bf16", "fp16"), None),
        (["kernels", "rope:fp32"], ("fp32",), ("kernels",)),
        (("rope:bf16",), ("bf16",), ()),
        ("fp16,kv:fp8_e4m3", (), "fp16,kv:fp8_e4m3"),  # no rope word: the rest as given
        (None, (), None),
    ],
)
def test_split(given, rope, rest):
    assert split_rope_what_if(given) == (rope, rest)


@pytest.mark.parametrize("word", ["rope:fp8", "rope:fp7", "rope:"])
def test_a_dtype_not_known_names_what_if(word):
    with pytest.raises(AttncheckError) as e:
        split_rope_what_if(word)
    assert e.value.param == "what_if"


def test_the_capture_request_checks_its_rope_dtypes(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("")
    assert CaptureRequest(str(script), out=None, rope_what_if=("bfloat16",)).rope_what_if == ("bf16",)
    with pytest.raises(AttncheckError):
        CaptureRequest(str(script), out=None, rope_what_if=("e4m3",))
