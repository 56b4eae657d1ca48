"""``attncheck.capture``: record every attention call of a model while it runs, unchanged.

::

    import attncheck

    with attncheck.capture("capdir") as cap:      # one .safetensors per call + manifest.json
        model(**batch)
    # then: attncheck run capdir

    with attncheck.capture(diagnose=True) as cap:  # nothing written: each call diagnosed as it comes
        model(**batch)
    cap.result.model.lines                         # one line per call; cap.result.model.first_bad

See ``attncheck.record.mode`` for what is recorded and how.
"""

from __future__ import annotations

import os
import traceback
from typing import Callable, Sequence

from attncheck import params
from attncheck.config.capture import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_CALLS,
    Forwards,
    max_bytes_bound,
    max_calls_bound,
    parse_forwards,
)
from attncheck.config.rope import split_rope_what_if
from attncheck.config.run import Options, ignore_codes
from attncheck.errors import AttncheckError
from attncheck.findings.rope import ROPE_ANGLE_TOLERANCE
from attncheck.results import RunResult


class Capture:
    """The context manager ``capture`` returns; after the block: ``calls`` (manifest entries,
    or the recorded calls with their tensors when kept in memory), ``result`` (diagnose=True:
    a ``RunResult`` with the model report), ``stopped`` (why recording stopped early, or None),
    ``error`` (the exception that left the block, as one line)."""

    def __init__(
        self,
        path,
        *,
        diagnose: bool,
        max_calls,
        max_bytes,
        modules,
        forwards,
        options,
        ignore,
        notice,
        script,
        what_if=(),
        asked=None,
        grads: bool = True,
        compile: str = "eager",
        dedup_kv: bool = True,
    ) -> None:
        if path is not None and diagnose:
            raise AttncheckError(
                "diagnose=True diagnoses each call as it comes and writes nothing: give no path with it",
                param="diagnose",
            )
        self.path = None if path is None else os.fspath(path)
        self.diagnose = diagnose
        self.max_calls = max_calls_bound(max_calls)
        self.max_bytes = max_bytes_bound(max_bytes)
        self.modules = (modules,) if isinstance(modules, str) else tuple(modules or ())
        self.forwards = None if forwards is None else parse_forwards(forwards)
        self.options, self.ignore, self.notice = options, ignore_codes(ignore or ()), notice
        self.rope_what_if, what_if = split_rope_what_if(what_if)  # rope:DTYPE asks about the rotary tables alone
        self.what_if, self.asked = (params.what_if(what_if) if what_if else ()), asked
        self.script = script
        if not isinstance(grads, bool):
            raise AttncheckError(f"must be True or False, got {params.show(grads)}", param="grads")
        self.grads = grads
        self.compile = params.choice(compile, ("eager", "keep"), "compile")
        if not isinstance(dedup_kv, bool):
            raise AttncheckError(f"must be True or False, got {params.show(dedup_kv)}", param="dedup_kv")
        self.dedup_kv = dedup_kv
        self.calls: list = []
        self.compiled_runs = 0  # torch.compile'd modules and functions that ran (see ``compile``)
        self.result = None
        self.stopped: str | None = None
        self.error: str | None = None
        self._recorder = None
        self._sink = None
        self.rank: int | None = None  # under torchrun (several processes): this process's rank, and the world size
        self.world: int | None = None
        self.given_path = self.path  # the parent of the ranks' directories under torchrun
        self.forwards_seen = 0  # forward passes of a top module the block ran
        self.outside_forwards = 0  # attention calls left out by ``forwards`` alone
        self.replaced = False  # the directory held a previous capture, replaced by this one

    def __enter__(self) -> "Capture":
        # imports torch: cli capture imports attncheck.record (through pipelines.capture) at --help
        from attncheck.record.mode import Recorder
        from attncheck.record.ranks import capture_rank, rank_directory
        from attncheck.record.store import DiagnoseSink, DirectorySink, MemorySink

        ranked = capture_rank()
        if ranked is not None:
            self.rank, self.world = ranked
            if self.path is not None:  # each rank its own directory: PATH/rankN
                self.path = os.fspath(rank_directory(self.given_path, self.rank, self.world))
        if self.diagnose:
            self._sink = DiagnoseSink(self.options or Options(), self.ignore, self.notice, self.what_if, self.asked)
            self._sink.rank = self.rank
        elif self.path is not None:
            self._sink = DirectorySink(self.path, self.rank)
        else:
            self._sink = MemorySink()
        self._recorder = Recorder(
            self._sink,
            modules=self.modules,
            forwards=self.forwards,
            max_calls=self.max_calls,
            max_bytes=self.max_bytes,
            notice=self.notice,
            grads=self.grads,
            compile=self.compile,
            flash=True,
            dedup_kv=self.dedup_kv and isinstance(self._sink, DirectorySink),
        )
        self._recorder.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        rec, sink = self._recorder, self._sink
        try:
            rec.__exit__(exc_type, exc, tb)
        finally:
            if exc is not None:
                self.note_error(exc)
            self.stopped = rec.stopped or getattr(sink, "error", None)
            self.compiled_runs = rec.compiled_runs
            self.forwards_seen = rec.tracker.forward
            self.outside_forwards = rec.outside_forwards
            self.replaced = bool(getattr(sink, "replaced", False))
            facts = {
                "complete": self.error is None and self.stopped is None,
                "stopped": self.stopped,
                "calls_seen": rec.seen,
                "calls_recorded": rec.recorded,
                "max_calls": self.max_calls,
                "max_bytes": self.max_bytes,
                "modules": list(self.modules),
                "forwards": None if self.forwards is None else str(self.forwards),
                "error": self.error,
                "first_unrecorded": rec.first_missed,
                "grads": self.grads,
                "grad_calls": rec.grad_calls,
                "compile": {
                    "mode": self.compile,
                    "compiled_runs": rec.compiled_runs,
                    "compiled_calls": rec.compiled_calls,
                },
            }
            if self.script is not None:
                facts["script"] = {**self.script, "error": self.error}
            facts.update(self.rank_facts())
            sink.close(facts)
            self._finish(sink)
        return False

    def rank_facts(self) -> dict:
        """{'rank', 'world', 'run_id'} under torchrun; {} for a single process (its manifest as it always was)."""
        if self.rank is None:
            return {}
        # imports torch: cli capture imports attncheck.record (through pipelines.capture) at --help
        from attncheck.record.ranks import run_id

        return {"rank": self.rank, "world": self.world, "run_id": run_id()}

    def note_error(self, exc: BaseException) -> None:
        """Record that the block failed (a script runner that catches the exception itself calls
        this before leaving the block); SystemExit(0) is no failure."""
        if not (isinstance(exc, SystemExit) and exc.code in (None, 0)):
            self.error = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()[-1]

    def _finish(self, sink) -> None:
        # imports torch: cli capture imports attncheck.record (through pipelines.capture) at --help
        from attncheck.record.store import DiagnoseSink, DirectorySink

        if isinstance(sink, DirectorySink):
            self.calls = sink.entries
        elif isinstance(sink, DiagnoseSink):
            # attncheck.model (~27 ms): only once the capture has ended
            from attncheck.model import model_report

            self.calls = sink.reports
            # imports torch: cli capture imports attncheck.record (through pipelines.capture) at --help
            from attncheck.loaders.calls import compile_message

            facts = {
                "compile": {
                    "mode": self.compile,
                    "compiled_runs": self._recorder.compiled_runs,
                    "compiled_calls": self._recorder.compiled_calls,
                }
            }
            notes = [f"recording stopped: {self.stopped}" if self.stopped else None, compile_message(facts)]
            capture = {
                "note": "; ".join(n for n in notes if n) or None,
                "stopped": self.stopped,
                "compile": facts["compile"],
                "complete": self.error is None and self.stopped is None,
                "error": self.error,
                "first_unrecorded": self._recorder.first_missed,
                **self.rank_facts(),
            }
            if sink.rope_tables:  # the rotary tables the calls ran under, judged as ``attncheck run`` judges them
                # imports torch: cli capture imports attncheck.record (through pipelines.capture) at --help
                from attncheck.numerics.rope import table_checks

                # each table's rotated q and k judged at the finding's tolerance (what numerics.rope reads)
                tables = [
                    {**t, "qk": None if t.get("qk") is None else t["qk"].result(ROPE_ANGLE_TOLERANCE)}
                    for t in sink.rope_tables.values()
                ]
                capture["rope"] = table_checks(tables, ROPE_ANGLE_TOLERANCE, self.rope_what_if, rank=self.rank)
            device = sink.options.device
            skipped = [(r.call.name, r.error) for r in sink.reports if r.error]
            self.result = RunResult(
                [r.diagnosis for r in sink.reports if r.diagnosis is not None],
                device,
                sink.reports,
                model_report(sink.reports, self.ignore, skipped, capture),
            )
        else:
            self.calls = sink.calls


def capture(
    path: str | os.PathLike[str] | None = None,
    *,
    diagnose: bool = False,
    max_calls: int | None = DEFAULT_MAX_CALLS,
    max_bytes: int | str | None = DEFAULT_MAX_BYTES,
    modules: str | Sequence[str] = (),
    forwards=None,
    options=None,
    ignore: Sequence[str] = (),
    notice: Callable[[str], None] | None = None,
    script: dict | None = None,
    what_if=(),
    asked=None,
    grads: bool = True,
    compile: str = "eager",
    dedup_kv: bool = True,
) -> Capture:
    """Record every attention call made inside the ``with`` block.

    ``path``: the capture directory to write (created; or emptied of a previous capture);
    without it the calls stay in memory (``cap.calls``, tensors copied to the CPU).
    ``diagnose=True``: each call is diagnosed as it comes (``options``, ``ignore``) and
    nothing is written or kept; ``cap.result`` holds the model report.
    ``max_calls``, ``max_bytes`` (bytes, or '512MiB'): when the next call would pass either,
    recording stops (``cap.stopped`` says why, ``notice`` hears it) and the model runs on.
    ``modules``: globs of module paths to record ('*.self_attn'; a call outside any module
    is 'global'). ``forwards``: which forward passes of the top module to record (1-based:
    1, [1, 3], '2-4'); None records all, and calls outside any module.
    ``options`` (diagnose=True): how cells compute; each call computes the cell the model ran, and as
    what-ifs the dtypes ``what_if`` names ('fp16', ['bf16', 'fp8'] or 'all': every implementation too)
    and every cell of ``asked`` (an ``Options`` grid), reported apart from the model's own.
    ``grads``: when a recorded call's output takes part in a backward inside the block, record its
    output gradient and the gradients its kernel produced for q, k, v (they count for ``max_bytes``);
    each call's cells then get their backward (``Cell.backward``). False records the forward only.
    ``compile``: torch.compile'd modules and functions inside the block. 'eager' (default): they run
    their eager code (the compiler's ``force_eager`` stance), whose calls are recorded and judged as
    that code, and the report says so; 'keep': they run compiled, their calls are not recorded, and
    the report says how many compiled runs went unrecorded.
    ``dedup_kv`` (a capture directory): a call whose K and V extend its module's previous call's bit for bit
    (``generate()``'s decode steps with transformers' default cache) is written as its new rows and the index of
    the call it extends (``record.kvdedup``); the reader rebuilds the whole K and V. False writes every call whole.
    """
    return Capture(
        path,
        diagnose=diagnose,
        max_calls=max_calls,
        max_bytes=max_bytes,
        modules=modules,
        forwards=forwards,
        options=options,
        ignore=ignore,
        notice=notice,
        script=script,
        what_if=what_if,
        asked=asked,
        grads=grads,
        compile=compile,
        dedup_kv=dedup_kv,
    )


__all__ = ["Capture", "Forwards", "capture", "parse_forwards", "DEFAULT_MAX_BYTES", "DEFAULT_MAX_CALLS"]
