"""``[[tool.attncheck.synthetic]]``: inputs drawn from the sweep generator, their entries parsed, and what they
would compute and hold, refused before anything is drawn."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from attncheck.config.sweep import DIST_NAMES, head_layout, qk_bytes, work_text
from attncheck.config.values import _choice, _dtypes, _int, _number, _paths, _reject_unknown, _scale
from attncheck.errors import AttncheckError
from attncheck.params import Scale, show

if TYPE_CHECKING:
    from attncheck.config.check import CheckConfig

DEFAULT_SYNTHETIC_SEQ = 256
DEFAULT_SYNTHETIC_ROWS = 1024
SYNTHETIC_KEYS = ("d_k", "scale", "seq", "rows", "dist", "std", "seed", "dtype", "paths")


@dataclass(frozen=True)
class SyntheticInput:
    """One ``[[tool.attncheck.synthetic]]`` entry: scores = scale * q.k from the sweep generator."""

    index: int
    d_k: int
    scale: Scale = Scale("sqrt")
    seq: int = DEFAULT_SYNTHETIC_SEQ
    rows: int = DEFAULT_SYNTHETIC_ROWS
    dist: str = "normal"
    std: float = 1.0
    seed: int = 0
    dtypes: tuple[str, ...] | None = None  # None: the config's dtypes
    paths: tuple[str, ...] = ()  # attention paths: Q, K and V are drawn and every path computes P and O = P@V

    @property
    def name(self) -> str:
        """'synthetic[0]:dk=128,scale=sqrt,seq=256,dist=normal,seed=0' (rows, std and paths when not default)."""
        extra = f",rows={self.rows}" if self.rows != DEFAULT_SYNTHETIC_ROWS else ""
        extra += f",std={self.std:g}" if self.std != 1.0 else ""
        extra += f",paths={'+'.join(self.paths)}" if self.paths else ""
        return (
            f"synthetic[{self.index}]:dk={self.d_k},scale={self.scale.name},seq={self.seq}{extra},"
            f"dist={self.dist},seed={self.seed}"
        )


def _parse_synthetic(value: Any, prefix: str, display: str) -> tuple[SyntheticInput, ...]:
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise AttncheckError(f"{prefix} must be an array of tables ([[{prefix}]]), got {show(value)}")
    out = []
    for i, entry in enumerate(value):
        at = f"{prefix}[{i}]"
        _reject_unknown(entry, SYNTHETIC_KEYS, at, display)
        if "d_k" not in entry:
            raise AttncheckError(f"{at}.d_k is missing (the head dimension, e.g. d_k = 128)")
        spec = SyntheticInput(index=i, d_k=_int(entry["d_k"], f"{at}.d_k", 1))
        changes: dict[str, Any] = {}
        if "scale" in entry:
            changes["scale"] = _scale(entry["scale"], f"{at}.scale")
        if "seq" in entry:
            changes["seq"] = _int(entry["seq"], f"{at}.seq", 2)
        if "rows" in entry:
            changes["rows"] = _int(entry["rows"], f"{at}.rows", 1)
        if "dist" in entry:
            changes["dist"] = _choice(entry["dist"], f"{at}.dist", DIST_NAMES)
        if "std" in entry:
            changes["std"] = _number(entry["std"], f"{at}.std", positive=True)
        if "seed" in entry:
            changes["seed"] = _int(entry["seed"], f"{at}.seed", 0)
        if "dtype" in entry:
            changes["dtypes"] = _dtypes(entry["dtype"], f"{at}.dtype")
        if "paths" in entry:
            changes["paths"] = _paths(entry["paths"], f"{at}.paths")
        out.append(replace(spec, **changes))
    return tuple(out)


def synthetic_work(spec: SyntheticInput, config: CheckConfig) -> int:
    """Score elements a synthetic input computes: its rows (whole heads) x keys, once per cell
    (every method x dtype on the scores; with paths, every path x dtype besides)."""
    heads, queries = head_layout(spec.rows, spec.seq)
    return heads * queries * spec.seq * len(spec.dtypes or config.dtypes) * (len(config.methods) + len(spec.paths))


def _check_work(config: CheckConfig) -> None:
    """Refuse, before anything is drawn, synthetic inputs that compute more than max_work score elements
    together: a few numbers in a config can ask for hours of work."""
    if not config.synthetic:
        return
    works = [synthetic_work(spec, config) for spec in config.synthetic]
    total = sum(works)
    if total > config.max_work:
        big = config.synthetic[works.index(max(works))]
        heads, queries = head_layout(big.rows, big.seq)  # rows rounded up to whole heads
        raise AttncheckError(
            f"{config.key('synthetic')} would compute {work_text(total)} score elements "
            f"({config.key('synthetic')}[{big.index}]: "
            f"{big.rows:,} rows x {big.seq} keys x {max(works) // (heads * queries * big.seq)} cells), over "
            f"{config.key('max_work')} {work_text(config.max_work)}: lower rows or seq, "
            f"or raise {config.key('max_work')}"
        )


def synthetic_bytes(spec: SyntheticInput) -> int:
    """What a synthetic input holds at once: drawing float64 q and k (and v for paths), then
    two heads' float64 scores (the one being cut into row blocks and the next) and a block copied from them."""
    heads, queries = head_layout(spec.rows, spec.seq)
    v = 8 * heads * spec.seq * spec.d_k if spec.paths else 0
    return qk_bytes(heads, queries, spec.seq, spec.d_k, spec.dist) + v + 3 * 8 * queries * spec.seq
