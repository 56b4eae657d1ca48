"""Training-loop integrations of ``attncheck.watch``: a transformers ``TrainerCallback``.

::

    from attncheck.integrations import WatchCallback

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[WatchCallback("watch.jsonl", every=10)])
    trainer.train()
    # then: attncheck watch watch.jsonl

A step is the Trainer's optimizer step (``on_step_end``); the loss the Trainer logs for it (every
``logging_steps``) is added to its record. transformers is imported only when the callback is made.
"""

from __future__ import annotations

import os


def WatchCallback(log: str | os.PathLike[str], every: int = 1, *, modules=(), grads: bool = True):  # noqa: N802  (a class for the user)
    """A ``transformers.TrainerCallback`` that watches the model the Trainer trains (``attncheck.watch``)."""
    from transformers import TrainerCallback

    from attncheck.watcher import Watch

    class AttncheckWatchCallback(TrainerCallback):
        def __init__(self) -> None:
            self.watch: Watch | None = None
            self._settings = Watch(None, log, every, modules=modules, grads=grads)  # checks the arguments now

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.watch = Watch(model, log, every, modules=modules, grads=grads).__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            if self.watch is not None:
                self.watch.step()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.watch is not None and logs and "loss" in logs:  # logged after the step ended: given to its record
                self.watch.annotate(state.global_step, logs["loss"])

        def on_train_end(self, args, state, control, **kwargs):
            if self.watch is not None:
                watch, self.watch = self.watch, None
                watch.__exit__(None, None, None)

    return AttncheckWatchCallback()


__all__ = ["WatchCallback"]
