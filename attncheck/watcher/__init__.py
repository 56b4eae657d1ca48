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
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from attncheck import __version__, params
from attncheck.errors import AttncheckError

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
    """The log of one rank: '{rank}' in the name replaced, else '.rankN' before the suffix when the
    world has several ranks."""
    p = Path(path)
    if "{rank}" in p.name:
        return p.with_name(p.name.replace("{rank}", str(rank)))
    if world > 1:
        return p.with_name(f"{p.stem}.rank{rank}{p.suffix}")
    return p


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

    def __init__(self, model=None, log=None, every: int = 1, *, modules=(), grads: bool = True, tensorboard=None) -> None:
        self.every = params.integer(every, "every", 1, from_text=isinstance(every, str))
        if not isinstance(grads, bool):
            raise AttncheckError(f"must be True or False, got {params.show(grads)}", param="grads")
        if not (tensorboard is None or isinstance(tensorboard, (str, os.PathLike)) or callable(getattr(tensorboard, "add_scalar", None))):
            raise AttncheckError(f"must be a folder or a SummaryWriter, got {params.show(tensorboard)}", param="tensorboard")
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

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> "Watch":
        from torch.nn.modules.module import register_module_forward_pre_hook

        from attncheck.record.mode import Recorder

        self.rank, self.world = rank_and_world()
        if self.log is not None:
            self.path = rank_log_path(self.log, self.rank, self.world)
            if not self.path.parent.is_dir():
                raise AttncheckError(f"cannot write the watch log {self.path}: folder {self.path.parent} does not exist", param="log")
            try:
                self._file = open(self.path, "w", encoding="utf-8")
            except OSError as e:
                raise AttncheckError(f"cannot write the watch log {self.path}: {e.strerror or e}", param="log") from None
        if self.tensorboard is not None:
            try:
                self._tensorboard = _summary_writer(self.tensorboard, self.rank, self.world)
            except AttncheckError:
                if self._file is not None:
                    self._file.close()
                raise
        # registered before the recorder's own hooks: at a top-level forward its module stack is still empty
        self._hook = register_module_forward_pre_hook(self._forward_starts)
        self._recorder = Recorder(self, modules=self.modules, grads=self.with_grads, outputs=True, in_modules=True, flex_reference=False)
        self._recorder.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            self._recorder.__exit__(exc_type, exc, tb)
        finally:
            self._hook.remove()
            self._flush()
            if self._file is not None:
                self._file.close()
            if self._tensorboard is not None:
                self._tensorboard.flush()
                if not hasattr(self.tensorboard, "add_scalar"):  # a writer of its own; the user's stays open
                    self._tensorboard.close()
        return False

    # ------------------------------------------------------------------ steps

    def step(self, loss=None) -> None:
        """End the step under way (with its loss, if given): its record is written; the next begins."""
        self._manual = True
        if self.step_number == 0:
            self.step_number = 1
        self._loss = _number(loss) if self.sampling else None  # a loss on the device is read back on recorded steps only
        self._flush()
        self.step_number += 1
        self._set_sampling()

    def _forward_starts(self, module, args) -> None:
        """A step is one training forward of the top module, where the loop does not call step(); the
        calls of a forward in eval mode (a validation pass) are left out."""
        from attncheck.record.mode import _compiled_module, _compiling

        if _compiling():  # dynamo traces the hooks of a compiled module: nothing of the watch goes in its graph
            return
        rec = self._recorder
        if rec is None or rec.tracker.stack:
            return
        if _compiled_module(module) and not self._compiled_said:
            self._compiled_said = True
            warnings.warn("attncheck.watch: the model runs torch.compile'd code, whose attention calls the watch does not see "
                          "(it records the calls of eager code only); watch the uncompiled model, or capture a step with "
                          "attncheck.capture, which runs compiled code as its eager code", stacklevel=2)
        self._skip = not module.training or (self.model is not None and module is not self.model)
        if self._manual or self._skip:
            return
        self._flush()
        self.step_number += 1
        self._set_sampling()

    @property
    def sampling(self) -> bool:
        """This step is recorded (every ``every`` steps, from the first)."""
        return (max(self.step_number, 1) - 1) % self.every == 0

    def _set_sampling(self) -> None:
        if self._recorder is not None:
            self._recorder.grads = self.with_grads and self.sampling  # no hooks on the steps left out

    # ------------------------------------------------------------------ the recorder's sink

    def __call__(self, call) -> None:
        if self.step_number == 0:
            self.step_number = 1
        if self._skip or not self.sampling:
            return
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
            stats.nonfinite_rows = (~torch.isfinite(out.sum(dim=-1, dtype=torch.float32))).sum() if out is not None else stats.nonfinite_rows * 0
            scale, path = _number(meta.get("scale")) or 1.0, "flex-math" if meta.get("flex_impl") == "math" else "flex"
            limit_logit, what = _limit("float32", 1.0, f"the logits after {meta.get('score_mod', 'score_mod')} in fp32")
        elif call.kind in ("sdpa", "flex"):
            scale = _number(meta.get("scale"))
            # computed with the step's other SDPA calls at its end (one set of ops for all layers); the tensors
            # are those autograd holds for the backward anyway
            stats = (t["q"], t["k"], t.get("out"), t.get("attn_mask"), scale, meta.get("is_causal") == "true")
            scale = scale if scale is not None else 1.0 / math.sqrt(t["q"].shape[-1])
            path = {"math": "sdpa-math"}.get(meta.get("sdpa_backend", ""), "flash") if call.kind == "sdpa" else \
                ("flex-math" if meta.get("flex_impl") == "math" else "flex")
            limit_logit, what = _limit("float32", 1.0, "S = Q@K^T in fp32 (SDPA's kernels)")
        else:
            scores, q, k = t["scores"], t.get("q"), t.get("k")
            heads = meta.get("num_heads", "")
            if scores.dim() == 3 and heads.isdigit() and int(heads) > 0 and scores.shape[0] % int(heads) == 0:  # nn.MultiheadAttention: (B*H, T, T)
                h = int(heads)
                scores = scores.reshape(-1, h, *scores.shape[1:])
                q = None if q is None or q.dim() != 3 else q.reshape(-1, h, *q.shape[1:])
                k = None if k is None or k.dim() != 3 else k.reshape(-1, h, *k.shape[1:])
            stats = scores_stats(scores, q, k)
            traced = _number(meta.get("scale")) if meta.get("scale_source") == "traced" and meta.get("q_prescaled") != "true" else None
            scale, path = traced or 1.0, "eager"
            limit_logit, what = _limit(dtype, scale, "S = Q@K^T" + (" (before the scale)" if traced else "") + f" in {_label(dtype)}")
        self._calls.append(_CallEntry(call.module, call.kind, _label(dtype), path, scale, limit_logit, what, stats))

    def grads(self, call, tensors) -> None:
        if self.sampling:
            self._grads.append((call.module, tensors))  # counted with the step's others at its end

    # ------------------------------------------------------------------ records

    def _flush(self) -> None:
        """Write the record of the step under way, if it saw any call: one read-back of every number."""
        import torch

        from attncheck.watcher.stats import CallStats, grad_counts_many, sdpa_stats_many

        calls, grads, loss = self._calls, self._grads, self._loss
        self._calls, self._grads, self._loss = [], [], None
        if not calls and not grads:
            return
        pending = [c for c in calls if not isinstance(c.stats, CallStats)]
        for c, st in zip(pending, sdpa_stats_many([c.stats for c in pending])):
            c.stats = st
        grads = list(zip((m for m, _ in grads), grad_counts_many([gs for _, gs in grads])))
        parts, shapes = [], []
        for c in calls:
            s = c.stats
            for t in (s.max_logit, s.exact, s.entropy_min, s.entropy_mean, s.collapsed, s.q_max, s.k_max, s.nonfinite_rows):
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
            out_calls.append({"module": c.module, "kind": c.kind, "dtype": c.dtype, "path": c.path, "heads": len(ml),
                              "max_logit": ml, "exact": [bool(x) for x in ex], "entropy_min": emin, "entropy_mean": emean,
                              "collapsed": col, "q_max": qm, "k_max": km, "nonfinite_rows": int(bad[0] or 0), "scale": c.scale,
                              "limit": {"logit": c.limit_logit, "what": c.limit_what}})
        out_grads = []
        for module, g in grads:
            nonfinite, zeros, peak = (take()[0] for _ in range(3))
            out_grads.append({"module": module, "nonfinite": int(nonfinite or 0), "zero_frac": (zeros or 0) / g.total if g.total else None,
                              "max_abs": peak if not (nonfinite or 0) else None})
        record = {"schema": WATCH_SCHEMA, "attncheck_version": __version__, "step": max(self.step_number, 1), "rank": self.rank,
                  "world": self.world, "time": round(time.time(), 3), "loss": loss, "calls": out_calls, "grads": out_grads}
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
        raise AttncheckError("TensorBoard scalars need the tensorboard package: pip install tensorboard", param="tensorboard") from None
    folder = Path(where) / f"rank{rank}" if world > 1 else Path(where)
    try:
        return SummaryWriter(log_dir=os.fspath(folder))
    except OSError as e:
        raise AttncheckError(f"cannot write TensorBoard scalars to {folder}: {e.strerror or e}", param="tensorboard") from None


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
        ml, emin, emean, col = finite(c["max_logit"]), finite(c["entropy_min"]), finite(c["entropy_mean"]), finite(c["collapsed"])
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


def watch(model=None, log: str | os.PathLike[str] | None = None, every: int = 1, *, modules=(), grads: bool = True, tensorboard=None) -> Watch:
    """Watch the attention of a training run: a context manager (and an object whose ``step(loss)``
    marks steps, where the loop wants to; else a step is one training forward of ``model``, or of any
    top module when ``model`` is None).

    ``log``: the JSON-lines file to write (one record per recorded step; under torchrun one per rank,
    see ``rank_log_path``); None keeps the records in ``records``. ``every``: record every N-th step
    (1: all). ``modules``: globs of module paths to watch. ``grads``: with a backward, count the NaN,
    inf and zero entries of each call's gradients. ``tensorboard``: a folder (or a ``SummaryWriter``)
    that gets each record's numbers as TensorBoard scalars (needs the tensorboard package). Read the
    log with ``attncheck watch LOG``.
    """
    return Watch(model, log, every, modules=modules, grads=grads, tensorboard=tensorboard)


__all__ = ["WATCH_SCHEMA", "Watch", "rank_and_world", "rank_log_path", "watch"]
