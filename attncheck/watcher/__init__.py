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

import json
import math
import os
import time
import warnings
import weakref
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from attncheck import __version__, params
from attncheck.errors import AttncheckError
from attncheck.registry import eager_path
from attncheck.wrappers import model_path, wrapped_modules

WATCH_SCHEMA = "attncheck.watch/1"


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size: torch.distributed's where it is initialised, else
    torchrun's environment (RANK, WORLD_SIZE), else (0, 1)."""
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
    from attncheck.record.ranks import rank_file

    p = Path(path)
    return Path(rank_file(str(p), rank)) if "{rank}" in p.name or world > 1 else p


BLIND_FORWARDS = 8  # top-level training forwards without the watched module before the watch says it sees nothing


@dataclass
class _CallEntry:
    module: str
    kind: str
    dtype: str
    path: str
    scale: float
    limit_logit: float
    limit_what: str
    stats: object  # stats.CallStats


class Watch:
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
        import gc

        self._top, self._prefix_of, self._recorder = None, None, None
        self._calls, self._grads, self._loss = [], [], None
        self._taken.clear()
        # The recorded calls and their gradient hooks form reference cycles with the steps' autograd graphs, whose
        # nodes hold DDP's hooks and so its process group: collected now, while the group lives, not at exit
        gc.collect()

    # ------------------------------------------------------------------ steps

    def step(self, loss=None) -> None:
        """End the step under way (with its loss, if given): its record is written; the next begins."""
        self._manual = True
        if self.step_number == 0:
            self.step_number = 1
        self._loss = (
            _number(loss) if self.sampling else None
        )  # a loss on the device is read back on recorded steps only
        unseen = self._forwards == 0
        if unseen:
            self._unseen(f"step {self.step_number} ended")
        self._flush(unseen=unseen)
        self.step_number += 1
        self._set_sampling()

    def _forward_starts(self, module, args) -> None:
        """A step is one training forward of the top module, where the loop does not call step(); the
        calls of a forward in eval mode (a validation pass) are left out. The watched model may run
        inside another top module (a wrapper: DDP, FSDP, torch.compile, accelerate): its forward there
        is the model's."""
        from attncheck.record.compiled import compiled_module, compiling

        if compiling():  # dynamo traces the hooks of a compiled module: nothing of the watch goes in its graph
            return
        rec = self._recorder
        if rec is None:
            return
        if rec.tracker.stack:
            if module is self.model and self._top is not None and not self._seen_in_top:
                self._nested = True
                self._prefix, self._name = self._path_under(self._top, module), type(module).__name__
                self._model_forward(module.training)
            return
        if compiled_module(module) and not self._compiled_said and self.compile != "eager":
            self._compiled_said = True
            warnings.warn(
                "attncheck.watch: the model runs torch.compile'd code, whose attention calls the watch does "
                "not see (it records the calls of eager code only); pass compile='eager' to attncheck.watch "
                "(the compiled code then runs as its eager code while watched), or capture a step with "
                "attncheck.capture, which runs compiled code as its eager code",
                stacklevel=2,
            )
        self._top, self._seen_in_top, self._nested, self._prefix = module, False, False, None
        chain = wrapped_modules(module)
        if self.model is None or module is self.model:  # the model, or its wrapper: named as the innermost names
            if len(chain) > 1:
                self._prefix, self._name = chain[-1][0], type(chain[-1][1]).__name__
            self._model_forward(module.training)
            return
        inner = next((path for path, m in chain[1:] if m is self.model), None)
        if inner is not None:  # DDP(model), torch.compile(model), FSDP(model): a forward of the model
            self._prefix, self._name = inner, type(self.model).__name__
            self._model_forward(self.model.training)
            return
        self._skip = True  # not the model's forward, unless the model runs inside it

    def _forward_ends(self, module, args, output) -> None:
        from attncheck.record.compiled import compiling

        if compiling():
            return
        if module is self._top:
            if self.model is not None and not self._seen_in_top and module.training and not self._manual:
                self._blind_tops += 1
                # a loss module run on its own, a GAN's critic trained a few times first: not yet a sign
                if not self._ever_seen and self._blind_tops >= BLIND_FORWARDS:
                    self._unseen(f"{self._blind_tops} training forwards of other modules ran")
            self._top = None
        elif module is self.model and self._nested:
            self._skip = True  # the wrapper's own calls after the model's forward are not the model's

    def _path_under(self, top, module) -> str | None:
        """The path of ``module`` under ``top`` (None where it is not found), kept for the last top module."""
        if self._prefix_of is None or self._prefix_of[0] is not top:
            self._prefix_of = (top, next((name for name, m in top.named_modules() if m is module), None))
        return self._prefix_of[1]

    def _model_forward(self, training: bool) -> None:
        """A forward of the watched model begins (in training mode: a step, unless the loop marks steps)."""
        self._seen_in_top = True
        self._skip = not training
        if self._skip:
            return
        self._ever_seen = True
        if self._manual:
            self._forwards += 1
            return
        self._flush()
        self.step_number += 1
        self._set_sampling()
        self._forwards = 1

    def _unseen(self, when: str) -> None:
        """Say once that a step passed without any training forward of the watched module."""
        if self._unseen_said:
            return
        self._unseen_said = True
        what = "the watched module" if self.model is None else f"the watched module ({type(self.model).__name__})"
        warnings.warn(
            f"attncheck.watch: {when} with no training forward of {what} seen, so no attention call was recorded; "
            "watch the module the training loop calls, or the module it wraps (DDP, FSDP, torch.compile and "
            "accelerate's wrappers are followed), and train it in training mode",
            stacklevel=3,
        )

    @property
    def sampling(self) -> bool:
        """This step is recorded (every ``every`` steps, from the first)."""
        return (max(self.step_number, 1) - 1) % self.every == 0

    def _set_sampling(self) -> None:
        if self._recorder is not None:
            self._recorder.grads = self.with_grads and self.sampling  # no hooks on the steps left out

    # ------------------------------------------------------------------ the recorder's sink

    def __call__(self, call) -> None:
        if self._skip or self._flushing:
            return  # not the watched module's: it neither starts a step nor counts in one
        if self.step_number == 0:
            self.step_number = 1
        if not self.sampling:
            return
        inside = self._prefix and (call.module == self._prefix or call.module.startswith(self._prefix + "."))
        if self._nested and self._prefix and not inside:
            return  # inside the module holding the watched one, but not the watched one's
        import torch

        from attncheck.numerics.cells.diagnose import bookkeeping  # small ops on one torch thread

        device = next((t.device for t in call.tensors.values() if isinstance(t, torch.Tensor)), None)
        with bookkeeping(device) if device is not None else nullcontext():
            self._take(call)

    def _take(self, call) -> None:
        import torch

        from attncheck.watcher.stats import scores_stats

        t, meta = call.tensors, call.meta
        dtype = meta.get("dtype", "none")
        if call.kind == "flex" and "scores_mod" in t:  # its logits after the score_mod, as the kernel sees them (fp32)
            k = t["k"]
            if k.dim() == 4 and k.shape[1] != t["q"].shape[1]:  # GQA: the kv head each query head reads
                k = k.repeat_interleave(t["q"].shape[1] // k.shape[1], dim=1)
            stats = scores_stats(t["scores_mod"], t["q"], k)
            out = t.get("out")  # flex gives 0 on a row with no key: NaN or inf rows are the output's
            stats.nonfinite_rows = (
                (~torch.isfinite(out.sum(dim=-1, dtype=torch.float32))).sum()
                if out is not None
                else stats.nonfinite_rows * 0
            )
            scale, path = _number(meta.get("scale")) or 1.0, _kernel_path(call)
            limit_logit, what = _limit("float32", 1.0, f"the logits after {meta.get('score_mod', 'score_mod')} in fp32")
        elif call.kind in ("sdpa", "flex"):
            scale = _number(meta.get("scale"))
            # computed with the step's other SDPA calls at its end (one set of ops for all layers); the tensors
            # are those autograd holds for the backward anyway
            stats = (t["q"], t["k"], t.get("out"), t.get("attn_mask"), scale, meta.get("is_causal") == "true")
            scale = scale if scale is not None else 1.0 / math.sqrt(t["q"].shape[-1])
            path = _kernel_path(call)
            limit_logit, what = _limit("float32", 1.0, "S = Q@K^T in fp32 (SDPA's kernels)")
        else:
            scores, q, k = t["scores"], t.get("q"), t.get("k")
            heads = meta.get("num_heads", "")
            if (
                scores.dim() == 3 and heads.isdigit() and int(heads) > 0 and scores.shape[0] % int(heads) == 0
            ):  # nn.MultiheadAttention: (B*H, T, T)
                h = int(heads)
                scores = scores.reshape(-1, h, *scores.shape[1:])
                q = None if q is None or q.dim() != 3 else q.reshape(-1, h, *q.shape[1:])
                k = None if k is None or k.dim() != 3 else k.reshape(-1, h, *k.shape[1:])
            stats = scores_stats(scores, q, k)
            traced = (
                _number(meta.get("scale"))
                if meta.get("scale_source") == "traced" and meta.get("q_prescaled") != "true"
                else None
            )
            scale, path = traced or 1.0, eager_path()
            limit_logit, what = _limit(
                dtype, scale, "S = Q@K^T" + (" (before the scale)" if traced else "") + f" in {_label(dtype)}"
            )
        named = self._prefix is not None or self._nested
        module = model_path(call.module, self._prefix, self._name) if named else call.module
        self._taken[id(call)] = (weakref.ref(call), module)  # its gradients come later, named the same
        self._calls.append(_CallEntry(module, call.kind, _label(dtype), path, scale, limit_logit, what, stats))

    def grads(self, call, tensors) -> None:
        taken = self._taken.get(id(call))
        if taken is None or taken[0]() is not call:
            return  # a call of a module not watched (or of a step already written): not the watched module's
        # counted with the step's others at its end
        self._grads.append((taken[1], tensors))

    # ------------------------------------------------------------------ records

    def _flush(self, unseen: bool = False) -> None:
        """Write the record of the step under way, if it saw any call (or, ``unseen``, a record without
        any, where one was due): one read-back of every number."""
        self._flushing = True
        try:
            self._write(unseen)
        finally:
            self._flushing = False

    def _write(self, unseen: bool) -> None:
        import torch

        from attncheck.watcher.stats import CallStats, grad_counts_many, sdpa_stats_many

        calls, grads, loss, forwards = self._calls, self._grads, self._loss, self._forwards
        self._calls, self._grads, self._loss, self._forwards = [], [], None, 0
        self._taken.clear()
        if not calls and not grads and not (unseen and (self.sampling or not self.records)):
            return
        pending = [c for c in calls if not isinstance(c.stats, CallStats)]
        for c, st in zip(pending, sdpa_stats_many([c.stats for c in pending])):
            c.stats = st
        grads = list(zip((m for m, _ in grads), grad_counts_many([gs for _, gs in grads])))
        parts, shapes = [], []
        for c in calls:
            s = c.stats
            for t in (
                s.max_logit,
                s.exact,
                s.entropy_min,
                s.entropy_mean,
                s.collapsed,
                s.q_max,
                s.k_max,
                s.nonfinite_rows,
            ):
                if t is None:
                    shapes.append(None)
                    continue
                flat = t.reshape(-1).float().cpu()
                parts.append(flat)
                shapes.append(flat.numel())
        for _, g in grads:
            for t in (g.nonfinite, g.zeros, g.max_abs):
                flat = torch.as_tensor(t).reshape(-1).float().cpu()
                parts.append(flat)
                shapes.append(flat.numel())
        values = torch.cat(parts).tolist() if parts else []  # the one read-back of the step
        it = iter(shapes)
        pos = 0

        def take():
            nonlocal pos
            n = next(it)
            if n is None:
                return None
            out = values[pos : pos + n]
            pos += n
            return [None if not math.isfinite(x) else x for x in out]

        out_calls = []
        for c in calls:
            ml, ex, emin, emean, col, qm, km, bad = (take() for _ in range(8))
            out_calls.append(
                {
                    "module": c.module,
                    "kind": c.kind,
                    "dtype": c.dtype,
                    "path": c.path,
                    "heads": len(ml),
                    "max_logit": ml,
                    "exact": [bool(x) for x in ex],
                    "entropy_min": emin,
                    "entropy_mean": emean,
                    "collapsed": col,
                    "q_max": qm,
                    "k_max": km,
                    "nonfinite_rows": int(bad[0] or 0),
                    "scale": c.scale,
                    "limit": {"logit": c.limit_logit, "what": c.limit_what},
                }
            )
        out_grads = []
        for module, g in grads:
            nonfinite, zeros, peak = (take()[0] for _ in range(3))
            out_grads.append(
                {
                    "module": module,
                    "nonfinite": int(nonfinite or 0),
                    "zero_frac": (zeros or 0) / g.total if g.total else None,
                    "max_abs": peak if not (nonfinite or 0) else None,
                }
            )
        record = {
            "schema": WATCH_SCHEMA,
            "attncheck_version": __version__,
            "step": max(self.step_number, 1),
            "rank": self.rank,
            "world": self.world,
            "time": round(time.time(), 3),
            "loss": loss,
            "forwards": forwards,
            "calls": out_calls,
            "grads": out_grads,
        }
        self.records.append(record)
        if self._file is not None:
            self._last_at = self._file.tell()
            self._file.write(json.dumps(record, allow_nan=False) + "\n")
            self._file.flush()
        if self._tensorboard is not None:
            _scalars(self._tensorboard, record)

    def annotate(self, step: int, loss) -> None:
        """Give the record of ``step``, the last one written, its loss (a Trainer logs the loss after
        its step has ended)."""
        value = _number(loss)
        if value is None or not self.records or self.records[-1]["step"] != step:
            return
        self.records[-1]["loss"] = value
        if self._file is not None and self._last_at is not None:
            self._file.seek(self._last_at)
            self._file.truncate()
            self._file.write(json.dumps(self.records[-1], allow_nan=False) + "\n")
            self._file.flush()
        if self._tensorboard is not None:
            self._tensorboard.add_scalar("attncheck/loss", value, step)


def _summary_writer(where, rank: int, world: int):
    """``tensorboard=``: the user's SummaryWriter, or one writing to that folder (``rankN`` inside it
    under torchrun)."""
    if hasattr(where, "add_scalar"):
        return where
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise AttncheckError(
            "TensorBoard scalars need the tensorboard package: pip install tensorboard", param="tensorboard"
        ) from None
    folder = Path(where) / f"rank{rank}" if world > 1 else Path(where)
    try:
        return SummaryWriter(log_dir=os.fspath(folder))
    except OSError as e:
        raise AttncheckError(
            f"cannot write TensorBoard scalars to {folder}: {e.strerror or e}", param="tensorboard"
        ) from None


def _scalars(writer, record: dict) -> None:
    """A record as TensorBoard scalars, per call: ``attncheck/MODULE/max_logit`` (its largest head),
    ``headroom`` (the limit over that logit), ``entropy_min``, ``entropy_mean`` (over heads),
    ``collapsed`` (its worst head), ``nonfinite_rows``; per call's gradients ``grad_nonfinite``,
    ``grad_zero_frac``, ``grad_max_abs``; and the loss. A module called twice in a step: ``MODULE#2``."""
    step = record["step"]
    seen: dict[str, int] = {}

    def tag(module: str) -> str:
        seen[module] = seen.get(module, 0) + 1
        return f"attncheck/{module}" + (f"#{seen[module]}" if seen[module] > 1 else "")

    def finite(xs):
        return [x for x in xs if x is not None]

    for c in record["calls"]:
        t = tag(c["module"])
        ml, emin, emean, col = (
            finite(c["max_logit"]),
            finite(c["entropy_min"]),
            finite(c["entropy_mean"]),
            finite(c["collapsed"]),
        )
        if ml:
            writer.add_scalar(f"{t}/max_logit", max(ml), step)
            if max(ml) > 0:
                writer.add_scalar(f"{t}/headroom", c["limit"]["logit"] / max(ml), step)
        if emin:
            writer.add_scalar(f"{t}/entropy_min", min(emin), step)
        if emean:
            writer.add_scalar(f"{t}/entropy_mean", sum(emean) / len(emean), step)
        if col:
            writer.add_scalar(f"{t}/collapsed", max(col), step)
        writer.add_scalar(f"{t}/nonfinite_rows", c["nonfinite_rows"], step)
    seen.clear()
    for g in record["grads"]:
        t = tag(g["module"])
        writer.add_scalar(f"{t}/grad_nonfinite", g["nonfinite"], step)
        if g["zero_frac"] is not None:
            writer.add_scalar(f"{t}/grad_zero_frac", g["zero_frac"], step)
        if g["max_abs"] is not None:
            writer.add_scalar(f"{t}/grad_max_abs", g["max_abs"], step)
    if record["loss"] is not None:
        writer.add_scalar("attncheck/loss", record["loss"], step)


def _kernel_path(call) -> str:
    """The path of the kernel that ran a watched SDPA or flex call (as a capture's report judges it)."""
    from attncheck.numerics.cells.plan import model_path
    from attncheck.results import CallInfo

    meta = call.meta
    info = CallInfo(
        index=0,
        name="",
        kind=call.kind,
        meta=meta,
        dtype=meta.get("dtype"),
        is_causal=meta.get("is_causal") == "true",
        dropout_p=_number(meta.get("dropout_p")) or 0.0,
    )
    return model_path(info) or eager_path()


def _number(x) -> float | None:
    if x is None or isinstance(x, bool):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _label(torch_name: str) -> str:
    return {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}.get(torch_name, torch_name)


def _limit(dtype: str, scale: float, what: str) -> tuple[float, str]:
    """The largest logit a call can have before its first failure: S beyond the rounding limit of
    the dtype that holds it (for hand-written attention S = Q@K^T before the scale: the limit times
    the scale)."""
    import torch

    from attncheck.numerics.precision import rounding_limit

    dt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}.get(dtype, torch.float32)
    limit = rounding_limit(dt)
    return limit * abs(scale), f"{what} rounds to inf at |S| >= {limit:.6g}"


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
