"""Parameter values shared by every command and the config file: defaults, choices,
and one validator per kind of value.

Free of torch and numpy, so bad values fail in milliseconds. Validators take the
text a user typed (``from_text=True``, the CLI) or a typed value (the TOML config),
and raise ``AttncheckError(param=NAME)``: the CLI shows NAME as its flag, the config
layer as its key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from attncheck.errors import AttncheckError
from attncheck.registry import DTYPES, METHODS, PATHS, Registry, cell_dtype, float_cell_dtype

# Defaults, each defined once.
DEFAULT_BLOCK = 128  # key block of the tiled method (FlashAttention's kBlockN for d <= 128)
DEFAULT_P_SCALE = 256.0  # FP8 cells: P times 2^8 before the cast, FlashAttention-3's max offset of 8
FP8_SCALINGS = ("none", "tensor", "head", "block")  # how Q, K, V are quantised for the FP8 paths
# FP8 paths' tensor-core accumulator (numerics.methods.fp8_accum): 'kernel' (the kernel's own: 13 mantissa bits on
# Hopper, FlashAttention-3 without a flush, SageAttention 2 flushing every block), 'fp32', or a mantissa bit count
FP8_ACCUM_KERNEL = "kernel"
FP8_ACCUM_KERNEL_BITS = 13  # SageAttention 2's measurement of Hopper's and Ada's FP8 MMA accumulator (FP22)
COLLAPSE_THRESHOLD = 0.99  # a row whose max probability reaches this has collapsed onto one key
DEFAULT_MAX_MEMORY = "1GiB"
DEFAULT_CHUNK_ELEMENTS = 1 << 22  # float64 working set per chunk: 32 MiB a tensor
MAX_EXAMPLES = 8  # example rows kept per label
# Finite scores at or below this look like an additive mask sentinel (-1e4, -1e9,
# finfo.min): no real logit gets there, and every sentinel in use is at or below it.
MASK_SENTINEL_LIMIT = -1e4

ORDERS = ("forward", "reverse")
ACCUMULATIONS = ("fp32", "dtype")
DEVICES = ("auto", "cpu", "cuda")
KERNELS = ("auto", "fused", "torch")
SCALE_ORDERS = ("scores", "q")
MASK_CONVENTIONS = ("attend", "ignore")
MASK_OPS = (
    "add",
    "fill",
)  # how hand-written attention applies a mask: added to the scores, or masked_fill (the backward differs)


# transformers' RoPE types (5.24: ``ROPE_INIT_FUNCTIONS`` and the config's default and axial types); a capture naming
# another is refused, and numerics.rope_types says which of these are judged
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional", "axial")
MAX_SHOWN = 60  # characters of a value quoted in a message


def show(value: Any) -> str:
    """A value as messages show it: strings quoted, booleans as TOML spells them; a long value
    (a 5,001-digit number) cut short with its length."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list) and len(value) > 8:
        return f"a list of {len(value)} values"
    if isinstance(value, int):
        digits = len(str(abs(value))) if abs(value).bit_length() < 14_000 else None  # past Python's int-string limit
        if digits is None or digits > MAX_SHOWN:
            return f"an integer of {'over 4,300' if digits is None else f'{digits:,}'} digits"
    text = repr(value)
    return text if len(text) <= MAX_SHOWN else f"{text[: MAX_SHOWN - 3]}... ({len(text):,} characters)"


def items(value: Any, param: str) -> list[Any]:
    """'a, b' -> ['a', 'b']; a list stays a list; a lone value is a list of one."""
    if isinstance(value, str):
        out = [v.strip() for v in value.split(",") if v.strip()]
    elif isinstance(value, (list, tuple)):
        out = list(value)
    else:
        out = [value]
    if not out:
        raise AttncheckError("is empty", param=param)
    return out


def names(value: Any, registry: Registry, param: str, where: Callable = lambda spec: True) -> tuple[str, ...]:
    """'fp16, bfloat16' or ['fp16', 'bf16'] -> ('fp16', 'bf16'): canonical, duplicates and
    aliases of one name dropped, order kept; 'all' -> every name ``where`` allows."""
    values = (
        [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, str)
        else list(value)
        if isinstance(value, (list, tuple))
        else [value]
    )
    if not values:
        raise AttncheckError(f"is empty (choose from {', '.join(registry.names(where))})", param=param)
    if not all(isinstance(v, str) for v in values):
        raise AttncheckError(
            f"must be a list of {registry.kind} names ({', '.join(registry.names(where))}), got {show(value)}",
            param=param,
        )
    if [v.strip().lower() for v in values] == ["all"]:
        return registry.names(where)
    return tuple(dict.fromkeys(registry.canonical(v, where=where, param=param) for v in values))


def dtypes(value: Any, param: str = "dtypes", fp8: bool = True) -> tuple[str, ...]:
    """Dtypes cells compute in; ``fp8=False``: whole softmaxes only (no P format)."""
    return names(value, DTYPES, param, cell_dtype if fp8 else float_cell_dtype)


def methods(value: Any, param: str = "methods") -> tuple[str, ...]:
    return names(value, METHODS, param)


def paths(value: Any, param: str = "paths", fp8: bool = True) -> tuple[str, ...]:
    """Attention paths; ``fp8=False`` (the sweep): the default paths of the fp16/bf16/fp32 dtypes only
    (not flash-fp8, sage, nor flex and flex-math, which judge recorded flex calls)."""
    return names(
        value, PATHS, param, (lambda spec: True) if fp8 else (lambda spec: spec.computes_in(False) and spec.default)
    )


WHAT_IF_ALL = "all"
WHAT_IF_FP8 = "e4m3"  # the FP8 format of 'all' (FlashAttention-3's)
WHAT_IF_KERNELS = "kernels"  # replay each call under every kernel that could have run it, in the call's dtype
WHAT_IF_NOSINKS = "nosinks"  # a kernel that drops a call's learned sinks (as quantised-KV decode kernels did)


# --what-if kv:FORMAT[:SCALING]: K and V through a quantised KV cache (attncheck.numerics.kvcache)
KV_PREFIX = "kv:"
KV_FORMATS = ("fp8_e4m3", "fp8_e5m2", "int4")
KV_INT_FORMATS = ("int4",)  # per group, as transformers' quanto cache: kv:int4[:gGROUP][:rRESIDUAL], no SCALING
KV_SCALINGS = ("unit", "tensor", "head", "dynamic")
KV_FA3 = "fa3"  # the consumer: FlashAttention-3's FP8 path (Q quantised too, FP8 products), e4m3 only
KV_NOT_EMULATED = {
    "int8": "transformers' quanto cache takes nbits 2 or 4 only, and its HQQ backend's 8 bits run HQQ's iterative "
    "optimiser (docs/serving.md)",
}


def _kv_int(value: str, parts: list[str], param: str) -> str:
    """'kv:int4', 'kv:int4:g32', 'kv:int4:g64:r128' -> the same, normalised ('kv:int4:g64' for 'kv:int4')."""
    group, residual = None, None
    for part in parts[2:]:
        number = part[1:]
        if part[:1] == "g" and number.isdigit() and group is None and residual is None and int(number) > 0:
            group = int(number)
        elif part[:1] == "r" and number.isdigit() and residual is None:
            residual = int(number)
        elif part in KV_SCALINGS:
            raise AttncheckError(
                f"{show(value.strip())}: {parts[1]}'s scale and shift are per group, from the group's own min and max "
                f"(quanto's), so no SCALING applies; give kv:{parts[1]}[:gGROUP][:rRESIDUAL]",
                param=param,
            )
        else:
            raise AttncheckError(
                f"{show(value.strip())} is not kv:{parts[1]}[:gGROUP][:rRESIDUAL] (GROUP values per group, default 64; "
                "RESIDUAL most recent tokens kept in the model's dtype, default 0)",
                param=param,
            )
    return f"kv:{parts[1]}:g{group or 64}" + (f":r{residual}" if residual else "")


def kv_token(value: str, param: str = "what_if") -> str:
    """'kv:fp8_e4m3', 'KV:fp8_e4m3:head' -> 'kv:fp8_e4m3', 'kv:fp8_e4m3:head'; 'kv:int4' -> 'kv:int4:g64'; one
    clear error otherwise."""
    parts = value.strip().lower().split(":")
    usage = (
        f"kv:FORMAT[:SCALING][:fa3] (FORMAT {', '.join(KV_FORMATS)}; SCALING {', '.join(KV_SCALINGS)}) or "
        "kv:int4[:gGROUP][:rRESIDUAL]"
    )
    if len(parts) < 2 or not parts[1]:
        raise AttncheckError(f"{show(value.strip())} is not {usage}", param=param)
    if parts[1] in KV_NOT_EMULATED:
        raise AttncheckError(f"{show(value.strip())}: not emulated: {KV_NOT_EMULATED[parts[1]]}", param=param)
    if parts[1] not in KV_FORMATS:
        raise AttncheckError(
            f"{show(value.strip())}: the KV cache format must be one of {', '.join(KV_FORMATS)}", param=param
        )
    if parts[1] in KV_INT_FORMATS:
        return _kv_int(value, parts, param)
    if parts[-1] == KV_FA3 and len(parts) > 2:
        if parts[1] != "fp8_e4m3":
            raise AttncheckError(
                f"{show(value.strip())}: FlashAttention-3's FP8 path reads e4m3 only; give kv:fp8_e4m3[:SCALING]:fa3",
                param=param,
            )
        if len(parts) > 4 or (len(parts) == 4 and parts[2] not in KV_SCALINGS):
            raise AttncheckError(f"{show(value.strip())} is not kv:fp8_e4m3[:SCALING]:fa3 ({usage})", param=param)
        return ":".join(parts)
    if len(parts) > 3:
        raise AttncheckError(f"{show(value.strip())} is not {usage}", param=param)
    if len(parts) == 3 and parts[2] not in KV_SCALINGS:
        raise AttncheckError(
            f"{show(value.strip())}: the KV cache scaling must be one of {', '.join(KV_SCALINGS)}", param=param
        )
    return ":".join(parts)


def kv_what_ifs(what_if: Iterable[str]) -> tuple[str, ...]:
    """The KV-cache what-ifs among validated what-if words ('kv:fp8_e4m3:unit')."""
    return tuple(w for w in what_if if w.startswith(KV_PREFIX))


def cell_what_ifs(what_if: Iterable[str]) -> tuple[str, ...]:
    """The what-if words that ask for cells of the calls (dtypes, kernels, settings grids): all but the KV cache's."""
    return tuple(w for w in what_if if not w.startswith(KV_PREFIX))


def setting_sweeps() -> tuple[str, ...]:
    """The kernel paths with a settings grid (``PathSpec.settings``): ``--what-if NAME`` sweeps it ('fa4')."""
    return PATHS.names(lambda spec: spec.settings is not None)


def what_if(value: Any, param: str = "what_if") -> tuple[str, ...]:
    """'fp16', 'bf16,fp8', 'kernels', 'kernels,fp16', 'fa4' or 'all' -> what a what-if asks about: dtypes, and
    first where asked 'kernels' (every kernel path that could have run the call, in its dtype) and the names of
    kernels whose settings grid to sweep (``setting_sweeps``: 'fa4', its lazy rescale threshold and FP8 offset);
    ('all',) alone asks for every implementation in fp16, bf16, fp32 and e4m3 as well ('fp8' is e4m3)."""
    values = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value
    words: tuple[str, ...] = ()
    if isinstance(values, (list, tuple)):
        kv = [kv_token(v, param) for v in values if isinstance(v, str) and v.strip().lower().startswith("kv")]
        values = [v for v in values if not (isinstance(v, str) and v.strip().lower().startswith("kv"))]
        if kv:
            if not values:
                return tuple(dict.fromkeys(kv))
            return (*tuple(dict.fromkeys(kv)), *what_if(values, param))
        low = [str(v).strip().lower() for v in values]
        if low == [WHAT_IF_ALL]:
            return (WHAT_IF_ALL,)
        known = (WHAT_IF_KERNELS, WHAT_IF_NOSINKS, *setting_sweeps())
        words = tuple(w for w in known if w in low)
        if words:
            values = [v for v, name in zip(values, low) if name not in words]
            if not values:
                return words
        values = [WHAT_IF_FP8 if isinstance(v, str) and v.strip().lower() == "fp8" else v for v in values]
    try:
        return (*words, *dtypes(values, param))
    except AttncheckError as e:
        if e.message.endswith(")"):  # the dtypes to choose from: the words a what-if takes besides them
            others = ", ".join(
                (WHAT_IF_KERNELS, WHAT_IF_NOSINKS, *setting_sweeps(), WHAT_IF_ALL, "kv:FORMAT[:SCALING]")
            )
            raise AttncheckError(e.message[:-1] + f"; or {others})", param=param) from None
        raise


# log2 of fp32's largest value: FlashAttention-4's P = exp2(x - m + offset) is an fp32 product first, so a lazy
# rescale threshold plus max offset of 128 or more could make P inf before any cast.
FA4_LOG2_LIMIT = 128.0


def fa4_settings(threshold: Any, offset: Any, *, from_text: bool = True) -> tuple[float | None, float | None]:
    """--rescale-threshold and --max-offset (FlashAttention-4's lazy rescale threshold and FP8 max offset, in log2
    units; None: the kernel's default for the dtype): numbers >= 0 whose sum stays below 128."""
    t = None if threshold is None else number(threshold, "rescale_threshold", from_text=from_text)
    o = None if offset is None else number(offset, "max_offset", from_text=from_text)
    if (t or 0.0) + (o or 0.0) >= FA4_LOG2_LIMIT:
        raise AttncheckError(
            f"the rescale threshold plus the max offset must stay below {FA4_LOG2_LIMIT:g} (P = 2^(threshold + "
            f"offset) would overflow fp32 before any cast), got {(t or 0.0) + (o or 0.0):g}",
            param="rescale_threshold" if t is not None else "max_offset",
        )
    return t, o


def choice(value: Any, allowed: Iterable[str], param: str) -> str:
    allowed = tuple(allowed)
    if not isinstance(value, str) or value.strip().lower() not in allowed:
        raise AttncheckError(
            f"must be one of {', '.join(allowed)}, got {show(value.strip() if isinstance(value, str) else value)}",
            param=param,
        )
    return value.strip().lower()


def _typed(value: Any, kind: type, from_text: bool) -> tuple[Any, str]:
    """(the value, parsed from text when ``from_text``; how a message shows it: numbers as
    typed, anything else quoted)."""
    if from_text and isinstance(value, str):
        text = value.strip()
        try:
            return kind(text), (text if len(text) <= MAX_SHOWN else show(text))
        except ValueError:  # also a number past Python's int-string limit
            return text, show(text)
    return value, show(value)


MAX_INTEGER = 1 << 62  # no count, size or index attncheck takes comes near it


def integer(value: Any, param: str, minimum: int, *, from_text: bool = True) -> int:
    """An int >= ``minimum`` (and at most 2^62); text is parsed when ``from_text``."""
    v, shown = _typed(value, int, from_text)
    if isinstance(v, str) and v.lstrip("+").isascii() and v.lstrip("+").isdigit():  # past Python's int-string limit
        shown = f"an integer of {len(v.lstrip('+')):,} digits"
        v = MAX_INTEGER + 1
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise AttncheckError(f"must be an integer >= {minimum}, got {shown}", param=param)
    if v > MAX_INTEGER:
        raise AttncheckError(f"must be an integer from {minimum} to 2^62, got {shown}", param=param)
    return v


def fp8_accum(value: Any, param: str = "fp8_accum", *, from_text: bool = True) -> str:
    """'kernel', 'fp32' or a mantissa bit count 1..23 (as text: '13')."""
    if isinstance(value, str) and value.strip().lower() in (FP8_ACCUM_KERNEL, "fp32"):
        return value.strip().lower()
    # the checked value is text ('13'), so text of digits is read back even from a typed source
    v, shown = _typed(value, int, from_text or (isinstance(value, str) and value.strip().isdigit()))
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 23:
        raise AttncheckError(
            f"must be 'fp32', 'kernel' or a mantissa bit count from 1 to 23 (Hopper's FP8 MMA keeps 13), got {shown}",
            param=param,
        )
    return str(v)


def fp8_accum_bits(value: str) -> int | None:
    """The mantissa bits of a checked ``fp8_accum`` value: None for fp32."""
    if value == "fp32":
        return None
    return FP8_ACCUM_KERNEL_BITS if value == FP8_ACCUM_KERNEL else int(value)


def number(value: Any, param: str, *, positive: bool = False, from_text: bool = True) -> float:
    """A finite float > 0 (``positive``) or >= 0."""
    v, shown = _typed(value, float, from_text)
    ok = (
        not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and (v > 0 if positive else v >= 0)
    )
    if not ok:
        raise AttncheckError(f"must be a number {'> 0' if positive else '>= 0'}, got {shown}", param=param)
    return float(v)


def cosine(value: Any, param: str, *, from_text: bool = True) -> float:
    """A cosine similarity: a number in [-1, 1]."""
    v, shown = _typed(value, float, from_text)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not -1.0 <= v <= 1.0:
        raise AttncheckError(f"is a cosine similarity: a number between -1 and 1, got {shown}", param=param)
    return float(v)


def integers(value: Any, param: str, minimum: int, *, from_text: bool = True) -> tuple[int, ...]:
    """'16, 32,64' -> (16, 32, 64), duplicates dropped, order kept."""
    return tuple(dict.fromkeys(integer(v, param, minimum, from_text=from_text) for v in items(value, param)))


def numbers(value: Any, param: str, *, positive: bool = True, from_text: bool = True) -> tuple[float, ...]:
    return tuple(dict.fromkeys(number(v, param, positive=positive, from_text=from_text) for v in items(value, param)))


def lengths(text: str, param: str) -> list[int]:
    """'3,0,5' -> [3, 0, 5]: one padding length per batch element."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if not (item.isascii() and item.isdigit()):  # '²'.isdigit() holds, but int() refuses it
            raise AttncheckError(
                f"{item!r} is not a non-negative integer (give one length per batch element, e.g. 3,0)", param=param
            )
        out.append(int(item))
    return out


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
    "p": 1000**5,
    "pb": 1000**5,
    "pib": 1024**5,
}


def size(text: str, param: str) -> int:
    """'1GiB', '512MiB', '2G', '300000000' -> bytes."""
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num) :]
    try:
        value = float(num)
    except ValueError:
        value = math.nan
    if unit not in _SIZE_UNITS or not math.isfinite(value) or value * _SIZE_UNITS.get(unit, 0) < 1:
        raise AttncheckError(f"{show(text)} is not a size (e.g. 1GiB, 512MiB, 2G)", param=param)
    if value * _SIZE_UNITS[unit] > MAX_INTEGER:
        raise AttncheckError(f"{show(text)} is larger than any size attncheck takes (2^62 bytes)", param=param)
    return int(value * _SIZE_UNITS[unit])


# The least working memory a diagnosis is given: below it every chunk holds a few rows, and the
# work per chunk, not the rows, sets the time (200,000 rows at 1 byte never finished).
MIN_MEMORY = 1 << 20


def memory(value: Any, param: str = "max_memory") -> int:
    """A working-memory budget ('1GiB', or bytes): a size of at least 1 MiB."""
    n = size(value, param) if isinstance(value, str) else integer(value, param, 1, from_text=False)
    if n < MIN_MEMORY:
        raise AttncheckError(
            f"must be at least 1MiB (the diagnosis' working memory, on top of the interpreter's), got {show(value)}",
            param=param,
        )
    return n


def mask_value(text: str, param: str = "mask_value") -> str:
    """What a masked key becomes: '-inf', 'min' (finfo(dtype).min) or a negative number."""
    t = text.strip().lower()
    if t in ("-inf", "min"):
        return t
    try:
        v = float(t)
    except ValueError:
        raise AttncheckError(f"unknown value {text!r} (use -inf, min or a negative number)", param=param) from None
    if math.isnan(v) or v >= 0:
        raise AttncheckError(f"must be negative (a mask lowers the masked scores), got {text!r}", param=param)
    return "-inf" if v == -math.inf else repr(v)


def device(value: Any, param: str = "device") -> str:
    """'auto', 'cpu', 'cuda' or 'cuda:N' (whether CUDA is there is checked where it is used)."""
    name = value.strip().lower() if isinstance(value, str) else value
    if isinstance(name, str) and (
        name in DEVICES or (name.startswith("cuda:") and name[5:].isascii() and name[5:].isdigit())
    ):
        return name
    raise AttncheckError(f"must be one of {', '.join(DEVICES)} or cuda:N, got {show(value)}", param=param)


# --------------------------------------------------------------------------- scale

SCALE_NAMES = ("none", "sqrt", "dk", "dk2")
SCALE_MEANINGS = {"none": "1", "sqrt": "1/sqrt(d_k)", "auto": "1/sqrt(d_k)", "dk": "1/d_k", "dk2": "1/d_k^2"}
_SCALE_HELP = "none, sqrt = 1/sqrt(d_k) (or auto, the same), dk = 1/d_k, dk2 = 1/d_k^2 or a positive number"


@dataclass(frozen=True)
class Scale:
    """A scale policy for q.k: 'none', 'sqrt' (or 'auto', SDPA's default), 'dk', 'dk2' or a number."""

    name: str

    def value(self, dk: int) -> float:
        """The factor q.k is multiplied by at head dimension ``dk``."""
        if self.name == "none":
            return 1.0
        if self.name in ("sqrt", "auto"):
            return 1.0 / math.sqrt(dk)
        if self.name == "dk":
            return 1.0 / dk
        if self.name == "dk2":
            return 1.0 / (dk * dk)
        return float(self.name)

    @property
    def meaning(self) -> str:
        """'1/sqrt(d_k)' for 'sqrt'; a number stands for itself."""
        return SCALE_MEANINGS.get(self.name, self.name)


def scale(value: Any, param: str = "scale") -> Scale:
    """'sqrt' -> Scale('sqrt'); '0.125' or 0.125 -> Scale('0.125'); anything else is an input error."""
    if isinstance(value, str) and value.strip().lower() in (*SCALE_NAMES, "auto"):
        return Scale(value.strip().lower())
    v = value
    if isinstance(value, str):
        try:
            v = float(value)
        except ValueError:
            v = None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
        raise AttncheckError(
            f"must be one of {_SCALE_HELP}, got {show(value.strip() if isinstance(value, str) else value)}", param=param
        )
    return Scale(value.strip() if isinstance(value, str) else f"{v:g}")


def scales(value: Any, param: str = "scales") -> tuple[Scale, ...]:
    return tuple(dict.fromkeys(scale(v, param) for v in items(value, param)))


# Sums kept in 16 bits (numerics.methods.lowsum): --accumulate DTYPE-ORDER[:BLOCK], e.g. fp16-seq, bf16-pairwise,
# fp16-block:64, fp16-online. The dtype holds every partial sum (seq: one running total, as tract's generic f16
# softmax; pairwise: a balanced tree; block: each block of BLOCK keys summed in fp32, the total between blocks in the
# dtype; online: llama.cpp's CPU flash attention, its f16 P@V accumulator rescaled at each new running max).
LOWSUM_DTYPES = ("fp16", "bf16")
LOWSUM_ORDERS = ("seq", "pairwise", "block", "online")


@dataclass(frozen=True)
class SumSpec:
    """How a low-precision sum is kept: its dtype, its order and (order 'block') the keys per block."""

    dtype: str
    order: str
    block: int = 0

    @property
    def label(self) -> str:
        return f"{self.dtype}-{self.order}" + (f":{self.block}" if self.order == "block" else "")


def sum_specs(value: Any, param: str = "accumulate") -> tuple[SumSpec, ...]:
    """'fp16-seq,bf16-block:64' (or a list of such) -> SumSpecs, in the order given, without repeats."""
    out: list[SumSpec] = []
    forms = ", ".join(f"{d}-{o}" for d in LOWSUM_DTYPES[:1] for o in LOWSUM_ORDERS[:2]) + ", fp16-block:64, fp16-online"
    for item in items(value, param):
        text = str(item).strip().lower()
        dtype, dash, rest = text.partition("-")
        order, colon, size = rest.partition(":")
        if not dash or dtype not in LOWSUM_DTYPES or order not in LOWSUM_ORDERS:
            raise AttncheckError(
                f"{show(item)} is not a sum kept in 16 bits: give DTYPE-ORDER with DTYPE one of "
                f"{', '.join(LOWSUM_DTYPES)} and ORDER one of {', '.join(LOWSUM_ORDERS)}, e.g. {forms}",
                param=param,
            )
        if (order == "block") != bool(colon):
            raise AttncheckError(
                f"{show(item)} "
                + ("has order block, which needs its size, e.g. fp16-block:64" if order == "block" else
                   f"gives a size, which only order block takes (e.g. {dtype}-block:{size})"),
                param=param,
            )  # fmt: skip
        if order == "online" and dtype != "fp16":
            raise AttncheckError(
                f"{show(item)}: llama.cpp's online kernel keeps P@V in 16 bits only for an f16 V cache (with a bf16 "
                "V it accumulates in fp32); give fp16-online",
                param=param,
            )
        try:
            block = integer(size, param, 1) if colon else 0
        except AttncheckError:
            raise AttncheckError(
                f"{show(item)} has a block size that is no integer from 1 to 2^62", param=param
            ) from None  # the range said whole: a too large size is as wrong as 0
        spec = SumSpec(dtype, order, block)
        if spec not in out:
            out.append(spec)
    if not out:
        raise AttncheckError(f"give at least one sum, e.g. {forms}", param=param)
    return tuple(out)
