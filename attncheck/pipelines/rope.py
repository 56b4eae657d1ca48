"""``attncheck rope`` as a library call: every point of the grid audited against float64."""

from __future__ import annotations

from collections.abc import Callable

from attncheck.config.rope import RopeConfig
from attncheck.findings.rope import ROPE_ANGLE_TOLERANCE
from attncheck.results.rope import RopeAudit, RopeTableCheck


def run_rope(config: RopeConfig, tick: Callable[[], None] | None = None) -> list[RopeAudit]:
    # imports torch: pipelines.rope is torch-free, so 'attncheck rope' checks its arguments first
    from attncheck.dtypes import dtype_from_name  # torch: only once the options are known to be good
    from attncheck.numerics.rope import audit_table

    out = []
    for theta in config.thetas:
        for head_dim in config.head_dims:
            for dtype in config.dtypes:
                for context in config.contexts:
                    compute = dtype_from_name(dtype)
                    table = compute if config.table is None else dtype_from_name(config.table)
                    rotation = None if config.rotation is None else dtype_from_name(config.rotation)
                    out.append(audit_table(theta, head_dim, compute, table, context, rotation))
                    if tick is not None:
                        tick()
    return out


def capture_rope_checks(paths, what_if=()) -> list[RopeTableCheck]:
    """The rotary tables of each capture directory among ``paths`` (a single process's; a torchrun capture's ranks
    are not read), each against float64 (``numerics.rope.check_table``) at the tolerance ``rope_precision`` uses;
    ``what_if``: dtypes to recompute each table in (--what-if rope:DTYPE)."""
    # imports torch: pipelines.rope is torch-free, so 'attncheck rope' checks its arguments first
    from attncheck.loaders.manifest import is_capture_dir, load_manifest
    from attncheck.loaders.rope import read_rope_tables
    from attncheck.numerics.rope import table_checks

    out: list[RopeTableCheck] = []
    for path in paths or ():
        if is_capture_dir(path):
            out.extend(table_checks(read_rope_tables(path, load_manifest(path)), ROPE_ANGLE_TOLERANCE, what_if))
    return out
