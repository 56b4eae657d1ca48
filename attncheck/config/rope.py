"""What ``attncheck rope`` is asked: the grid of theta x head dim x dtype x context, checked before any work."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from attncheck import params
from attncheck.errors import AttncheckError

# A grid computing more table entries than this (positions x d/2, summed over its points) is refused before any
# work: 2^28 entries take about a minute on two cores.
MAX_TABLE_ENTRIES = 1 << 28


@dataclass(frozen=True)
class RopeConfig:
    thetas: tuple[float, ...]
    head_dims: tuple[int, ...]
    dtypes: tuple[str, ...]  # the dtype holding positions, inverse frequencies, angles and cos/sin
    table: str | None  # the dtype the attention receives cos/sin in; None: each point's dtype
    rotation: str | None
    contexts: tuple[int, ...]

    @classmethod
    def from_text(cls, theta: Any, head_dim: Any, dtype: Any, table: Any, rotation: Any, context: Any) -> RopeConfig:
        thetas = params.numbers(theta, "theta", positive=True)
        head_dims = params.integers(head_dim, "head_dim", 2)
        odd = [d for d in head_dims if d % 2]
        if odd:
            raise AttncheckError(f"must be even (RoPE rotates pairs of entries), got {odd[0]}", param="head_dim")
        config = cls(
            thetas=thetas,
            head_dims=head_dims,
            dtypes=params.dtypes(dtype, "dtype", fp8=False),
            table=None if table is None else params.dtypes(table, "table", fp8=False)[0],
            rotation=None if rotation is None else params.dtypes(rotation, "rotation", fp8=False)[0],
            contexts=params.integers(context, "context", 2),
        )
        entries = len(thetas) * len(config.dtypes) * sum(head_dims) // 2 * sum(config.contexts)
        if entries > MAX_TABLE_ENTRIES:
            raise AttncheckError(
                f"the grid computes {entries:.3g} table entries (positions x d/2), more than {MAX_TABLE_ENTRIES:.3g}: "
                "ask for fewer points or a shorter context (the first repeated position has a closed form, printed "
                "beside every result)",
                param="context",
            )
        return config


ROPE_WHAT_IF_PREFIX = "rope:"


def split_rope_what_if(text: str | None) -> tuple[tuple[str, ...], str | None]:
    """'fp16,rope:bf16' -> (('bf16',), 'fp16'): the dtypes to recompute a capture's rotary tables in, and the
    rest of --what-if (None where nothing is left)."""
    if text is None:
        return (), None
    words = [w.strip() for w in text.split(",") if w.strip()]
    rope = [w[len(ROPE_WHAT_IF_PREFIX) :] for w in words if w.lower().startswith(ROPE_WHAT_IF_PREFIX)]
    if not rope:  # the rest as given: params.what_if says what is wrong with it
        return (), text
    if not all(rope):  # 'rope:bf16,rope:' was taken as 'rope:bf16': an empty word is a mistake, said as for 'rope:'
        raise AttncheckError(f"--what-if: {text!r} has 'rope:' without a dtype: give rope:DTYPE, e.g. rope:bf16")
    rest = [w for w in words if not w.lower().startswith(ROPE_WHAT_IF_PREFIX)]
    dtypes = params.dtypes(",".join(rope), "what_if", fp8=False) if rope else ()
    return dtypes, (",".join(rest) if rest else None)
