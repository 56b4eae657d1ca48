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
    tables: tuple[str | None, ...]  # the dtypes the attention receives cos/sin in; (None,): each point's dtype
    rotations: tuple[str | None, ...]  # (None,): no rotation narrower than the table
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
            tables=(None,) if table is None else params.dtypes(table, "table", fp8=False),
            rotations=(None,) if rotation is None else params.dtypes(rotation, "rotation", fp8=False),
            contexts=params.integers(context, "context", 2),
        )
        config._check_size()
        return config

    def _check_size(self) -> None:
        """Refuse a grid of more than MAX_TABLE_ENTRIES entries, naming the option to change: --head-dim or
        --context where one point alone is too large (whichever of d/2 and the context is the larger), else the
        option with the most values."""
        points = len(self.thetas) * len(self.dtypes) * len(self.tables) * len(self.rotations)
        entries = points * sum(self.head_dims) // 2 * sum(self.contexts)
        if entries <= MAX_TABLE_ENTRIES:
            return
        said = f"the grid computes {entries:.3g} table entries (positions x d/2), more than {MAX_TABLE_ENTRIES:.3g}"
        if max(self.head_dims) // 2 * max(self.contexts) > MAX_TABLE_ENTRIES:
            if max(self.head_dims) // 2 > max(self.contexts):
                param, ask = "head_dim", "a smaller head dim"
            else:
                param, ask = (
                    "context",
                    "a shorter context (the first repeated position has a closed form, printed beside every result)",
                )
        else:
            counts = {
                "theta": len(self.thetas),
                "head_dim": len(self.head_dims),
                "dtype": len(self.dtypes),
                "table": len(self.tables),
                "rotation": len(self.rotations),
                "context": len(self.contexts),
            }
            param, ask = max(counts, key=counts.get), "fewer values"
        raise AttncheckError(f"{said}: ask for {ask}", param=param)


ROPE_WHAT_IF_PREFIX = "rope:"


def _is_rope(word: Any) -> bool:
    return isinstance(word, str) and word.strip().lower().startswith(ROPE_WHAT_IF_PREFIX)


def split_rope_what_if(value: Any) -> tuple[tuple[str, ...], Any]:
    """'fp16,rope:bf16' -> (('bf16',), 'fp16'); ['fp16', 'rope:bf16'] -> (('bf16',), ('fp16',)): the dtypes to
    recompute a capture's rotary tables in, and the rest of the what-if (None, or () for a sequence, where nothing
    is left; the value as given where it names no rope:DTYPE). A dtype not known is an input error naming
    --what-if."""
    if isinstance(value, str):
        words: list = [w.strip() for w in value.split(",") if w.strip()]
    elif isinstance(value, (list, tuple)):
        words = list(value)
    else:  # None, or what params.what_if says is wrong
        return (), value
    rope = [w.strip()[len(ROPE_WHAT_IF_PREFIX) :] for w in words if _is_rope(w)]
    if not rope:  # the rest as given: params.what_if says what is wrong with it
        return (), value
    if not all(rope):  # 'rope:bf16,rope:' was taken as 'rope:bf16': an empty word is a mistake, said as for 'rope:'
        text = value if isinstance(value, str) else ",".join(map(str, words))
        raise AttncheckError(f"{text!r} has 'rope:' without a dtype: give rope:DTYPE, e.g. rope:bf16", param="what_if")
    rest = [w for w in words if not _is_rope(w)]
    dtypes = params.dtypes(rope, "what_if", fp8=False)
    if isinstance(value, str):
        return dtypes, (",".join(rest) if rest else None)
    return dtypes, tuple(rest)
