"""The watch's steps (mixed into ``Watch``): a step is one training forward of the watched model (or what the loop
marks with ``step``), found through its wrappers (DDP, FSDP, torch.compile, accelerate), which steps are recorded
(``every``), and saying once when the watched module is never seen."""

from __future__ import annotations

import warnings

from attncheck.watcher.recording import _number
from attncheck.wrappers import wrapped_modules

BLIND_FORWARDS = 8  # top-level training forwards without the watched module before the watch says it sees nothing


class StepsMixin:
    """Step bookkeeping of a ``Watch`` (its forward hooks call ``_forward_starts`` and ``_forward_ends``)."""

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
        # inside: attncheck.watcher imports without torch ('attncheck watch LOG' reads a log through watcher.trends)
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
        # inside: attncheck.watcher imports without torch ('attncheck watch LOG' reads a log through watcher.trends)
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
