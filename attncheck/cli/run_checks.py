"""``attncheck run``'s option values checked before any work (shared by ``attncheck capture``): the choices its
options offer, --fail-on, the cells of --dtype/--method/--path, the FP8 and FlashAttention-4 options (refused where
they would change nothing) and --summary against --full."""

from __future__ import annotations

from enum import Enum

from attncheck import params
from attncheck.cli.options import DEFAULT_DTYPES, DEFAULT_METHODS
from attncheck.codes import FAIL_ON_WORDS, valid_fail_on
from attncheck.config.run import Options
from attncheck.errors import AttncheckError, param
from attncheck.numerics.paths.fa4 import Fa4Setup  # torch-free: the path modules are read when the CLI starts
from attncheck.registry import PATHS, fp8_names

Order = Enum("Order", {name: name for name in params.ORDERS}, type=str)
Accum = Enum("Accum", {name: name for name in params.ACCUMULATIONS}, type=str)
ScaleOrder = Enum("ScaleOrder", {name: name for name in params.SCALE_ORDERS}, type=str)
MaskConvention = Enum("MaskConvention", {name: name for name in params.MASK_CONVENTIONS}, type=str)
MaskOp = Enum("MaskOp", {name: name for name in params.MASK_OPS}, type=str)


def parse_fail_on(value: str) -> list[str]:
    items = [v.strip().lower() for v in value.split(",") if v.strip()]
    for item in items:
        if not valid_fail_on(item):
            raise AttncheckError(
                f"unknown condition {item!r} (use {', '.join(FAIL_ON_WORDS)} or a finding code, or what-if:CONDITION)",
                param="fail_on",
            )
    return items


def cell_options(dtype: str | None, method: str | None, path: str | None, **how) -> tuple[Options, bool]:
    """The Options of --dtype/--method/--path (their defaults when not given) and whether any was
    given: on a capture, given ones are computed as what-ifs beside the model's cells."""
    options = Options(
        dtypes=params.dtypes(dtype if dtype is not None else DEFAULT_DTYPES),
        methods=params.methods(method if method is not None else DEFAULT_METHODS),
        paths=params.paths(path) if path is not None else (),
        **how,
    )
    return options, any(v is not None for v in (dtype, method, path))


def fp8_options(
    dtype: str,
    p_scale: str | None,
    fp8_scaling: str | None,
    incoherent: bool,
    qk_given: bool,
    fp8_accum: str | None = None,
    fp8_flush: str | None = None,
    path: str | None = None,
    what_if: tuple[str, ...] = (),
    files: bool = False,
) -> dict:
    """--p-scale, --fp8-scaling, --incoherent, --fp8-accum, --fp8-flush: checked, and refused where they would
    change nothing."""
    out: dict = {"incoherent": incoherent}
    if fp8_accum is not None:
        out["fp8_accum"] = params.fp8_accum(fp8_accum, "fp8_accum")
    if fp8_flush is not None:
        out["fp8_flush"] = params.integer(fp8_flush, "fp8_flush", 1)
    given = [
        name
        for name, value in (
            ("p_scale", p_scale),
            ("fp8_scaling", fp8_scaling),
            ("incoherent", incoherent or None),
            ("fp8_accum", fp8_accum),
            ("fp8_flush", fp8_flush),
        )
        if value is not None
    ]
    # FP8 cells: in --dtype, or (a capture's what-if) in --what-if
    asked_fp8 = set(params.dtypes(dtype)) | ({d for d in what_if if d in fp8_names()} if files else set())
    if files and params.WHAT_IF_ALL in what_if:
        asked_fp8.add(params.WHAT_IF_FP8)
    if given and not asked_fp8 & set(fp8_names()):
        flags = ", ".join(param(g) for g in given)
        raise AttncheckError(
            f"{flags} appl{'y' if len(given) > 1 else 'ies'} to FP8 cells: add an FP8 dtype "
            f"({', '.join(fp8_names())}) to {param('dtypes')}"
            + (f" (on a capture: to {param('what_if')})" if files else "")
        )
    if not qk_given and (fp8_scaling is not None or incoherent):
        raise AttncheckError(
            f"{param('fp8_scaling')} and {param('incoherent')} apply to attention computed from {param('q')} and "
            f"{param('k')}"
        )
    if not qk_given and not files and (fp8_accum is not None or fp8_flush is not None):
        raise AttncheckError(
            f"{param('fp8_accum')} and {param('fp8_flush')} apply to attention computed from {param('q')} and "
            f"{param('k')} or a capture (the FP8 kernels' tensor-core products)"
        )
    if (fp8_accum is not None or fp8_flush is not None) and path is not None:
        accumulating = PATHS.names(lambda spec: spec.fp8_accumulator)
        if not set(params.paths(path)) & set(accumulating):
            raise AttncheckError(
                f"{param('fp8_accum')} and {param('fp8_flush')} set the accumulator of the FP8 paths that model "
                f"Hopper's FP8 tensor cores ({', '.join(accumulating)}): none is in {param('paths')}"
            )
    if out.get("fp8_flush") is not None and out.get("fp8_accum") == "fp32":
        raise AttncheckError(
            f"{param('fp8_flush')} flushes the reduced FP8 accumulator into fp32; with {param('fp8_accum')} fp32 "
            "there is nothing to flush"
        )
    if p_scale is not None:
        out["p_scale"] = params.number(p_scale, "p_scale", positive=True)
    if fp8_scaling is not None:
        out["fp8_scaling"] = params.choice(fp8_scaling, params.FP8_SCALINGS, "fp8_scaling")
    return out


def fa4_options(
    threshold: str | None,
    offset: str | None,
    path: str | None,
    what_if: tuple[str, ...],
    files: bool,
    example: bool = False,
    dtype: str = "fp16,bf16,fp32",
) -> dict:
    """--rescale-threshold, --max-offset: checked (``params.fa4_settings``), and refused where no fa4 cell could
    take them: the fa4 path is not among --path, nor asked by --what-if (kernels, fa4), nor possibly a captured
    call's own kernel (``files``: inputs that may be a capture)."""
    given = [name for name, value in (("rescale_threshold", threshold), ("max_offset", offset)) if value is not None]
    if not given:
        return {}
    t, o = params.fa4_settings(threshold, offset)
    fa4 = params.setting_sweeps()
    asked = path is not None and any(p in fa4 for p in params.paths(path))
    flags = " and ".join(param(g) for g in given)
    if example:
        raise AttncheckError(
            f"{flags} {'set' if len(given) > 1 else 'sets'} FlashAttention-4's lazy rescale, which computes attention "
            f"from {param('q')}/{param('k')} or a capture, not the built-in example's scores"
        )
    if not (asked or files or any(w in (params.WHAT_IF_KERNELS, *fa4) for w in what_if)):
        raise AttncheckError(
            f"{flags} {'set' if len(given) > 1 else 'sets'} FlashAttention-4's lazy rescale: add fa4 to "
            f"{param('paths')} (or ask {param('what_if')} kernels)"
        )
    if offset is not None and not files and not (set(params.dtypes(dtype)) & set(fp8_names())):
        raise AttncheckError(
            f"{param('max_offset')} is FlashAttention-4's FP8 max offset (16-bit inputs run offset 0): add an FP8 "
            f"dtype ({', '.join(fp8_names())}) to {param('dtypes')}"
        )
    return {"fa4": Fa4Setup(rescale_threshold=t, max_offset=o)}


def check_summary(summary: bool, full: bool) -> None:
    """--summary and --full ask for two different reports."""
    if summary and full:
        raise AttncheckError(f"{param('summary')} and {param('full')} ask for two different reports; give one")
