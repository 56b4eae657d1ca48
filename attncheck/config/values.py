"""The typed values of the ``[tool.attncheck]`` table: counts, numbers, strings, sizes, dtypes and paths, each
refused with the key as the file spells it (TOML values are typed: a string where a number belongs is an error)."""

from __future__ import annotations

from typing import Any

from attncheck import params
from attncheck.errors import AttncheckError
from attncheck.params import Scale, show
from attncheck.registry import DTYPES, PATHS, dtype_names


# TOML values are typed: a string where a number belongs is an error, not parsed.
def _count(value: Any, key: str) -> int:
    return params.integer(value, key, 0, from_text=False)


def _int(value: Any, key: str, minimum: int) -> int:
    return params.integer(value, key, minimum, from_text=False)


def _number(value: Any, key: str, *, positive: bool = False) -> float:
    return params.number(value, key, positive=positive, from_text=False)


def _string(value: Any, key: str, what: str = "a string") -> str:
    if not isinstance(value, str):
        raise AttncheckError(f"{key} must be {what}, got {show(value)}")
    return value


def _strings(value: Any, key: str, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise AttncheckError(f"{key} must be a list of strings ({what}), got {show(value)}")
    return tuple(value)


def _choice(value: Any, key: str, allowed: tuple[str, ...]) -> str:
    return params.choice(value, allowed, key)


def _scale(value: Any, key: str) -> Scale:
    return params.scale(value, key)


def _size(value: Any, key: str) -> int:
    """'1GiB', '512MiB' or a number of bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return params.integer(value, key, 1, from_text=False)
    if not isinstance(value, str):
        raise AttncheckError(f'{key} must be a size such as "1GiB" or a number of bytes, got {show(value)}')
    return params.size(value, key)


# check judges whole softmaxes and the fp16/bf16/fp32 attention paths. An FP8 cell also depends on
# the P scale and on how Q, K and V are quantised, which `run` takes as options and a budget
# table has no key for: such a name is refused with the reason, not left to fail mid-run.
FP8_REFUSED = "FP8 cells need run's --p-scale and --fp8-scaling: judge them with 'attncheck run --dtype e4m3'"


def _dtypes(value: Any, key: str) -> tuple[str, ...]:
    """Dtypes a check computes in: fp16, bf16, fp32; an FP8 format is refused with the reason."""
    fp8 = [v for v in _listed(value) if v in DTYPES and DTYPES.get(v).p_format]
    if fp8:
        computed = ", ".join(dtype_names())
        raise AttncheckError(f"{key}: {fp8[0]!r} is an FP8 format; check computes in {computed} ({FP8_REFUSED})")
    return params.dtypes(value, key, fp8=False)


def _paths(value: Any, key: str) -> tuple[str, ...]:
    """Attention paths a check computes: every path but the FP8 ones (flash-fp8, sage)."""
    fp8 = [v for v in _listed(value) if v in PATHS and PATHS.get(v).fp8_only]
    if fp8:
        allowed = ", ".join(PATHS.names(lambda spec: not spec.fp8_only))
        raise AttncheckError(f"{key}: {fp8[0]!r} computes in FP8; check computes the paths {allowed} ({FP8_REFUSED})")
    return params.names(value, PATHS, key, lambda spec: not spec.fp8_only)


def _listed(value: Any) -> list[str]:
    """The names in a TOML value of one name or a list of them (anything else is params' to refuse)."""
    return [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, str)]


def _table(value: Any, key: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise AttncheckError(f"{key} must be a table, got {show(value)}")
    return value


def _reject_unknown(table: dict[str, Any], known: tuple[str, ...], prefix: str, display: str) -> None:
    for name in table:
        if name not in known:
            dotted = f"{prefix}.{name}" if prefix else name
            raise AttncheckError(f"unknown key '{dotted}' in {display} (known: {', '.join(known)})")
