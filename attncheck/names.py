"""Names users type on the command line, kept free of torch so that argument
checking stays fast. ``precision`` maps dtype names to torch dtypes."""

import math

from attncheck.errors import AttncheckError

DTYPE_NAMES = ("fp16", "bf16", "fp32")
METHOD_NAMES = ("naive", "stable", "tiled", "torch")
METHOD_ALIASES = {"online": "tiled"}
DTYPE_ALIASES = {
    "float16": "fp16", "half": "fp16",
    "bfloat16": "bf16",
    "float32": "fp32", "float": "fp32",
}
ORDERS = ("forward", "reverse")
DEVICES = ("auto", "cpu", "cuda")
SCALE_ORDERS = ("scores", "q")
MASK_CONVENTIONS = ("attend", "ignore")


def parse_scale_text(text: str) -> str:
    """Check a --scale value: auto, sqrt, none, dk or a positive number; returns it normalised."""
    s = text.strip().lower()
    if s in ("auto", "sqrt", "none", "dk"):
        return s
    try:
        v = float(s)
    except ValueError:
        raise AttncheckError(f"--scale: unknown value {text!r} (use auto, sqrt, none, dk or a positive number)") from None
    if not math.isfinite(v) or v <= 0:
        raise AttncheckError(f"--scale must be a positive finite number, got {text!r}")
    return s


def parse_mask_value(text: str) -> str:
    """Check a --mask-value: -inf, min (finfo(dtype).min) or a negative number."""
    t = text.strip().lower()
    if t in ("-inf", "min"):
        return t
    try:
        v = float(t)
    except ValueError:
        raise AttncheckError(f"--mask-value: unknown value {text!r} (use -inf, min or a negative number)") from None
    if math.isnan(v) or v >= 0:
        raise AttncheckError(f"--mask-value must be negative (a mask lowers the masked scores), got {text!r}")
    return "-inf" if v == -math.inf else repr(v)


def parse_lengths(text: str, option: str) -> list[int]:
    """'3,0,5' -> [3, 0, 5]: one padding length per batch element."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if not item.isdigit():
            raise AttncheckError(f"{option}: {item!r} is not a non-negative integer (give one length per batch element, e.g. 3,0)")
        out.append(int(item))
    return out


_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
               "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def parse_size(text: str, option: str) -> int:
    """'1GiB', '512MiB', '2G', '300000000' -> bytes."""
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = math.nan
    if unit not in _SIZE_UNITS or not math.isfinite(value) or value <= 0:
        raise AttncheckError(f"{option}: {text!r} is not a size (e.g. 1GiB, 512MiB, 2G)")
    return int(value * _SIZE_UNITS[unit])
