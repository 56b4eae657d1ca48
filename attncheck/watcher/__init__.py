"""``attncheck.watch``: per-step attention health of a training run, one JSON line per step.

::

    import attncheck

    with attncheck.watch(model, log="watch.jsonl", every=10) as w:
        for batch in loader:
            loss = model(**batch).loss
            loss.backward(); opt.step(); opt.zero_grad()
            w.step(loss=loss.item())          # or leave it out: a step is one training forward of ``model``
    # then: attncheck watch watch.jsonl

Every ``every`` steps, each attention call the model makes (SDPA and eager softmax, found as
``attncheck.capture`` finds them, without hooks of your own) gives per head its largest unmasked
logit, the entropy of its rows (minimum, mean, share of collapsed rows), max |q| and |k|, the rows
of its output holding NaN or inf, and the largest logit it can have before the first failure of
the dtype it runs in; with a backward, the NaN/inf and zero counts of the gradients its kernel
produced. Statistics only (``attncheck.watcher.stats``): nothing is kept, nothing is copied to the
host but one batch of numbers per step. Under ``torchrun`` each rank writes its own log
(``watch.rank1.jsonl``; ``{rank}`` in the name is replaced instead where it is there).

Wrappers: the model may be watched before it is wrapped (``DistributedDataParallel(model)``, FSDP,
``torch.compile(model)``, accelerate's ``prepare``, which wraps in DDP): a forward of the model
through its wrapper is a forward of the model, its calls named as the model names them. A step
that ends with no forward of the watched module seen is said once (a ``UserWarning``) and written
to the log as a record with ``forwards: 0``; ``attncheck watch`` reports a log without any call
as ``no_attention``.
"""

from __future__ import annotations

import gc
import os
import warnings
import weakref
from pathlib import Path

from attncheck import params
from attncheck.errors import AttncheckError
from attncheck.watcher.log import WATCH_SCHEMA, LogMixin, _summary_writer
from attncheck.watcher.recording import RecordingMixin, _CallEntry
from attncheck.watcher.steps import BLIND_FORWARDS, StepsMixin


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size: torch.distributed's where it is initialised, else
    torchrun's environment (RANK, WORLD_SIZE), else (0, 1)."""
    # inside: attncheck.watcher imports without torch ('attncheck watch LOG' reads a log through watcher.trends)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 0, 1


def rank_log_path(path: str | os.PathLike[str], rank: int, world: int) -> Path:
    """The log of one rank, named as capture names a rank's files (``record.ranks.rank_file``): '{rank}' in the
    name replaced, else '.rankN' before the suffix when the world has several ranks."""
    # inside: attncheck.watcher imports without torch ('attncheck watch LOG' reads a log through watcher.trends)
    from attncheck.record.ranks import rank_file

    p = Path(path)
    return Path(rank_file(str(p), rank)) if "{rank}" in p.name or world > 1 else p


class Watch(StepsMixin, RecordingMixin, LogMixin):
    """The context manager ``watch`` returns; ``step(loss=None)`` ends a step; ``records`` holds
    the records written (or kept, without a log), one per recorded step."""

    def __init__(
        self,
        model=None,
        log=None,
        every: int = 1,
        *,
        modules=(),
        grads: bool = True,
        tensorboard=None,
        compile: str = "keep",
    ) -> None:
        if compile not in ("keep", "eager"):
            raise AttncheckError(f"must be 'keep' or 'eager', got {params.show(compile)}", param="compile")
        self.compile = compile
        self.every = params.integer(every, "every", 1, from_text=isinstance(every, str))
        if not isinstance(grads, bool):
            raise AttncheckError(f"must be True or False, got {params.show(grads)}", param="grads")
        if not (
            tensorboard is None
            or isinstance(tensorboard, (str, os.PathLike))
            or callable(getattr(tensorboard, "add_scalar", None))
        ):
            raise AttncheckError(
                f"must be a folder or a SummaryWriter, got {params.show(tensorboard)}", param="tensorboard"
            )
        self.tensorboard = tensorboard
        self.model, self.with_grads = model, grads
        self.modules = (modules,) if isinstance(modules, str) else tuple(modules or ())
        self.log = None if log is None else os.fspath(log)
        self.records: list[dict] = []
        self.step_number = 0  # the step under way (1-based; 0 before the first)
        self.path: Path | None = None
        self.rank, self.world = 0, 1
        self._manual = False
        self._skip = False  # the top module's forward under way is not a training one of the model watched
        self._calls: list[_CallEntry] = []
        self._grads: list[tuple[str, object]] = []
        self._loss = None
        self._file = None
        self._last_at: int | None = None  # where the last record starts in the log
        self._recorder = None
        self._hook = None
        self._tensorboard = None
        self._compiled_said = False
        self._post = None
        self._top = None  # the top module whose forward is under way
        self._seen_in_top = False  # a forward of the watched model began inside it
        self._nested = False  # the model runs inside another top module: the calls after its forward are not its
        self._prefix: str | None = None  # the model's path under that top module ('module' under DDP)
        self._name = ""  # the model's class name: how the model itself is named
        self._prefix_of: tuple | None = None  # (the last top module holding the model, the model's path in it)
        self._forwards = 0  # training forwards of the watched model in the step under way
        self._ever_seen = False
        self._blind_tops = 0  # top-level training forwards that did not run the watched model
        self._unseen_said = False
        # id of a call taken in the step under way -> (a weak reference to it, its module as the model names it):
        # the gradients of those calls only are the watched module's (the recorder hooks every call it records)
        self._taken: dict[int, tuple[weakref.ref, str]] = {}
        self._flushing = False  # the watch's own statistics run (inside a wrapper's forward the recorder is on)

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> "Watch":
        # inside: attncheck.watcher imports without torch ('attncheck watch LOG' reads a log through watcher.trends)
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        from attncheck.record.mode import Recorder

        self.rank, self.world = rank_and_world()
        if self.log is not None:
            self.path = rank_log_path(self.log, self.rank, self.world)
            if not self.path.parent.is_dir():
                raise AttncheckError(
                    f"cannot write the watch log {self.path}: folder {self.path.parent} does not exist", param="log"
                )
            try:
                self._file = open(self.path, "w", encoding="utf-8")
            except OSError as e:
                raise AttncheckError(
                    f"cannot write the watch log {self.path}: {e.strerror or e}", param="log"
                ) from None
        if self.tensorboard is not None:
            try:
                self._tensorboard = _summary_writer(self.tensorboard, self.rank, self.world)
            except AttncheckError:
                if self._file is not None:
                    self._file.close()
                raise
        # registered before the recorder's own hooks: at a top-level forward its module stack is still empty
        self._hook = register_module_forward_pre_hook(self._forward_starts)
        self._post = register_module_forward_hook(self._forward_ends, always_call=True)
        self._recorder = Recorder(
            self,
            modules=self.modules,
            grads=self.with_grads,
            outputs=True,
            in_modules=True,
            flex_reference=False,
            compile="eager" if self.compile == "eager" else None,
        )
        self._recorder.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            self._recorder.__exit__(exc_type, exc, tb)
        finally:
            self._hook.remove()
            self._post.remove()
            forwards = self._forwards
            self._flush()
            if not self.records and exc_type is None:  # nothing recorded: the log says so, not an empty file
                if not self._ever_seen:
                    self._unseen("the watch ended")
                elif not self._unseen_said and not self._compiled_said:  # compiled code: said already
                    self._unseen_said = True
                    warnings.warn(
                        "attncheck.watch: the watched module ran in training mode, but no attention call was "
                        "recorded in its forwards (compiled code runs unseen: pass compile='eager'; or its "
                        "attention is not SDPA, FlexAttention or an eager softmax)",
                        stacklevel=2,
                    )
                self._forwards = forwards
                self._flush(unseen=True)
            if self._file is not None:
                self._file.close()
            if self._tensorboard is not None:
                self._tensorboard.flush()
                if not hasattr(self.tensorboard, "add_scalar"):  # a writer of its own; the user's stays open
                    self._tensorboard.close()
            self._release()
        return False

    def _release(self) -> None:
        """Drop what the watch held of the run once it ends (the top module it saw, the recorder, the calls and
        gradients of the last step): a DDP wrapper or an autograd graph kept past the program's
        destroy_process_group is destroyed at interpreter exit, where gloo aborts ("terminate called without an
        active exception")."""
        self._top, self._prefix_of, self._recorder = None, None, None
        self._calls, self._grads, self._loss = [], [], None
        self._taken.clear()
        # The recorded calls and their gradient hooks form reference cycles with the steps' autograd graphs, whose
        # nodes hold DDP's hooks and so its process group: collected now, while the group lives, not at exit
        gc.collect()


def watch(
    model=None,
    log: str | os.PathLike[str] | None = None,
    every: int = 1,
    *,
    modules=(),
    grads: bool = True,
    tensorboard=None,
    compile: str = "keep",
) -> Watch:
    """Watch the attention of a training run: a context manager (and an object whose ``step(loss)``
    marks steps, where the loop wants to; else a step is one training forward of ``model``, or of any
    top module when ``model`` is None).

    ``log``: the JSON-lines file to write (one record per recorded step; under torchrun one per rank,
    see ``rank_log_path``); None keeps the records in ``records``. ``every``: record every N-th step
    (1: all). ``modules``: globs of module paths to watch. ``grads``: with a backward, count the NaN,
    inf and zero entries of each call's gradients. ``tensorboard``: a folder (or a ``SummaryWriter``)
    that gets each record's numbers as TensorBoard scalars (needs the tensorboard package). Read the
    log with ``attncheck watch LOG``. ``compile``: 'keep' runs torch.compile'd code compiled (its
    calls are not seen: the watch warns); 'eager' runs it as its eager code while watched, whose calls
    are recorded (slower: the compiler's speed is lost while watching).

    ``model`` may be watched before it is wrapped: its forwards through DistributedDataParallel, FSDP,
    torch.compile's wrapper or accelerate's are its own. A step that ends with no training forward
    of the watched module is said once (a warning) and written to the log (``forwards: 0``).
    """
    return Watch(model, log, every, modules=modules, grads=grads, tensorboard=tensorboard, compile=compile)


__all__ = ["BLIND_FORWARDS", "WATCH_SCHEMA", "Watch", "rank_and_world", "rank_log_path", "watch"]
