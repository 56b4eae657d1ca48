"""``attncheck capture`` as a library call: run a Python script under ``attncheck.capture``,
unchanged (as ``python -m cProfile`` runs one), then diagnose what it recorded.

The script runs as ``__main__`` with ``sys.argv`` = [script, *args] and its folder first on
``sys.path``. Whatever it raises is returned, not raised: what it recorded is kept and the
manifest written either way.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
from dataclasses import dataclass
from typing import Callable

from attncheck.config.capture import CaptureRequest
from attncheck.config.rope import ROPE_WHAT_IF_PREFIX
from attncheck.config.run import RunRequest
from attncheck.errors import AttncheckError
from attncheck.record import capture
from attncheck.results import RunResult


@dataclass
class CaptureOutcome:
    """The capture (``attncheck.record.Capture``), the script's exception if it raised (SystemExit
    with a non-zero code included), and the diagnosis when the script ran through."""

    capture: object
    error: BaseException | None
    result: RunResult | None


def run_script(path: str, args: tuple[str, ...], stdout_to_stderr: bool = False) -> None:
    """Run a script as ``python SCRIPT ARGS`` would; ``stdout_to_stderr``: what it prints goes
    to stderr (stdout is kept for a JSON report)."""
    saved_argv, saved_path, saved_cwd = sys.argv, list(sys.path), os.getcwd()
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        with contextlib.redirect_stdout(sys.stderr) if stdout_to_stderr else contextlib.nullcontext():
            runpy.run_path(path, run_name="__main__")
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
        with contextlib.suppress(
            OSError
        ):  # the script may chdir: the paths attncheck was given stay relative to where it ran
            os.chdir(saved_cwd)


def capture_script(
    request: CaptureRequest, track=None, notice: Callable[[str], None] | None = None, stdout_to_stderr: bool = False
) -> CaptureOutcome:
    """Run the request's script under capture and diagnose what it recorded (its error, if it raised, instead)."""
    cap, error = _record(request, notice, stdout_to_stderr)
    if error is not None:
        return CaptureOutcome(cap, error, None)
    _check_recorded(request, cap)
    result = _diagnose(request, cap, track, notice)
    if cap.rank is not None and result is not None and result.model is not None:  # torchrun: say whose calls these are
        # short, so that the command to read every rank fits on the report's line (its own folder is said above)
        every = f"; all ranks: attncheck run {cap.given_path}" if cap.given_path is not None else ""
        label = f"rank {cap.rank} of {cap.world}: this rank's calls{every}"
        facts = dict(result.model.capture or {})
        facts["note"] = "; ".join(n for n in (label, facts.get("note")) if n)
        facts.setdefault("rank", cap.rank)
        facts["world"] = cap.world
        result.model.capture = facts
    return CaptureOutcome(cap, None, result)


def _record(request: CaptureRequest, notice, stdout_to_stderr: bool):
    """The script run under ``attncheck.capture``: (the capture, the script's error or None)."""
    script = {"path": request.script, "argv": [request.script, *request.args]}
    cap = capture(
        request.out,
        diagnose=request.out is None,
        max_calls=request.max_calls,
        max_bytes=request.max_bytes,
        modules=request.modules,
        forwards=request.forwards,
        options=request.options,
        ignore=request.ignore,
        notice=notice,
        script=script,
        what_if=(*request.what_if, *(ROPE_WHAT_IF_PREFIX + d for d in request.rope_what_if)),
        asked=request.options if request.grid_asked else None,
        grads=request.grads,
        compile=request.compile,
    )
    error: BaseException | None = None
    with cap:  # a directory that cannot be used is an input error, raised before the script runs
        try:
            run_script(request.script, request.args, stdout_to_stderr)
        except SystemExit as e:
            if e.code not in (None, 0):
                error = e
        except BaseException as e:  # the script's own error: reported by the caller, once
            error = e
        if error is not None:
            cap.note_error(error)
    return cap, error


def _check_recorded(request: CaptureRequest, cap) -> None:
    """Refuse a capture that recorded no call (no forward matched --forward, or nothing capture could see)."""
    replaced = (
        f"; {cap.path} now holds an empty capture (the one it held before was replaced)"
        if cap.path is not None and cap.replaced
        else ""
    )
    if not cap.calls and cap.forwards is not None and cap.outside_forwards:
        n = cap.forwards_seen
        raise AttncheckError(
            f"--forward {request.forwards} matched none of {request.script}'s {n} forward "
            f"pass{'es' if n != 1 else ''} (of its top module): give numbers from 1 to {n}" + replaced
        )
    if not cap.calls:
        raise AttncheckError(
            f"{request.script} made no attention call that capture could see (F.scaled_dot_product_attention, "
            "or a softmax over the last axis of a 3+-D tensor inside an nn.Module)"
            + (f"; recording stopped: {cap.stopped}" if cap.stopped else "")
            + (
                f"; torch.compile'd code ran {cap.compiled_runs} time(s) compiled and unrecorded (--compile keep): "
                "--compile eager records its calls"
                if cap.compile == "keep" and cap.compiled_runs
                else ""
            )
            + replaced
        )


def _diagnose(request: CaptureRequest, cap, track, notice):
    """The diagnosis: the capture's own (diagnosed as recorded, nothing saved), else ``run`` on its directory."""
    from attncheck.pipelines.run import run  # imports torch: not at the CLI's start (cli/capture imports this module)

    if request.out is None:
        result = cap.result
    else:
        result = run(
            RunRequest(
                (cap.path,),
                options=request.options,
                ignore=request.ignore,
                partial=request.partial,
                what_if=request.what_if,
                grid_asked=request.grid_asked,
                rope_what_if=request.rope_what_if,
                accumulate=request.accumulate,
                split_ranks=False,  # under torchrun each rank judges its own calls
            ),
            track,
            notice,
        )
    return result
