"""``attncheck rope`` as a library call: every point of the grid audited against float64."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from attncheck.config.rope import RopeConfig
from attncheck.errors import AttncheckError
from attncheck.findings.rope import ROPE_ANGLE_TOLERANCE
from attncheck.results.rope import RopeAudit, RopeTableCheck


def run_rope(config: RopeConfig, tick: Callable[[], None] | None = None) -> list[RopeAudit]:
    # imports torch: pipelines.rope is torch-free, so 'attncheck rope' checks its arguments first
    from attncheck.dtypes import dtype_from_name  # torch: only once the options are known to be good
    from attncheck.numerics.rope import audit_table

    out = []
    grid = itertools.product(config.thetas, config.head_dims, config.dtypes, config.tables, config.rotations)
    for theta, head_dim, dtype, table, rotation in grid:
        for context in config.contexts:
            compute = dtype_from_name(dtype)
            cast = compute if table is None else dtype_from_name(table)
            rotated = None if rotation is None else dtype_from_name(rotation)
            out.append(audit_table(theta, head_dim, compute, cast, context, rotated))
            if tick is not None:
                tick()
    return out


def capture_rope_checks(paths, what_if=()) -> list[RopeTableCheck]:
    """The rotary tables of each capture directory among ``paths`` (a torchrun capture's ``rankN`` directories, named
    by their parent or one by one: each rank's tables, named by its rank), each against float64
    (``numerics.rope.check_table``) at the tolerance ``rope_precision`` uses, with the rotated q and k of the calls
    under it (``numerics.rope_qk``); ``what_if``: dtypes to recompute each
    table in (--what-if rope:DTYPE)."""
    # imports torch: pipelines.rope is torch-free, so 'attncheck rope' checks its arguments first
    from attncheck.loaders.capture_ranks import rank_dirs
    from attncheck.loaders.manifest import is_capture_dir, load_manifest
    from attncheck.loaders.rope import read_rope_tables
    from attncheck.numerics.rope import table_checks

    out: list[RopeTableCheck] = []
    for path in paths or ():
        dirs = [path] if is_capture_dir(path) else [sub for _, sub in rank_dirs(path) if is_capture_dir(sub)]
        for directory in dirs:
            manifest = load_manifest(directory)
            rank = manifest.rank if (manifest.world or 1) > 1 else None
            tables = read_rope_tables(directory, manifest)
            for table in tables:
                table["qk"] = rotated_qk(directory, manifest, table).result(ROPE_ANGLE_TOLERANCE)
            out.extend(table_checks(tables, ROPE_ANGLE_TOLERANCE, what_if, rank=rank))
    return out


def rotated_qk(path, manifest, table: dict):
    """The rotated q and k of each call under ``table`` (read one call at a time), judged against float64; a call
    whose file cannot be read is left out with its reason (the diagnosis reports the file itself)."""
    # imports torch (safetensors.torch, the rotation): pipelines.rope stays torch-free for 'attncheck rope'
    from attncheck.loaders.rope import read_call_qk
    from attncheck.numerics.rope_qk import RotatedQK

    qk = RotatedQK(table["cos"], table["sin"], table["positions"], table["theta"], table["rope_type"])
    if qk.recipe is None:
        return qk
    entries = {c.index: c for c in manifest.calls}
    for index in table["calls"]:
        try:
            q, k = read_call_qk(path, entries[index])
        except AttncheckError:
            qk.skip("its file not read", index)
            continue
        qk.add(index, q, k)
    return qk
