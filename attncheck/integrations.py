"""Training-loop integrations of ``attncheck.watch``: a transformers ``TrainerCallback`` and a
Lightning ``Callback``.

::

    from attncheck.integrations import WatchCallback

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[WatchCallback("watch.jsonl", every=10)])
    trainer.train()
    # then: attncheck watch watch.jsonl

A step is the Trainer's optimizer step (``on_step_end``); the loss the Trainer logs for it (every
``logging_steps``) is added to its record. transformers is imported only when the callback is made.

::

    from attncheck.integrations import LightningWatchCallback

    lightning.Trainer(max_steps=1000, callbacks=[LightningWatchCallback("watch.jsonl", every=10)]).fit(module, loader)

A step is one training batch (``on_train_batch_end``), with the loss ``training_step`` returned;
validation and sanity-check batches run in eval mode and are left out. Lightning (``lightning`` or
``pytorch_lightning``) is imported only when the callback is made. Both take ``tensorboard=``
as ``attncheck.watch`` does.
"""

from __future__ import annotations

import os

from attncheck.errors import AttncheckError
from attncheck.watcher import Watch


def WatchCallback(log: str | os.PathLike[str], every: int = 1, *, modules=(), grads: bool = True, tensorboard=None):  # noqa: N802  (a class for the user)
    """A ``transformers.TrainerCallback`` that watches the model the Trainer trains (``attncheck.watch``)."""
    # optional: transformers is needed only by the Trainer's callback
    from transformers import TrainerCallback

    class AttncheckWatchCallback(TrainerCallback):
        def __init__(self) -> None:
            self.watch: Watch | None = None
            self._settings = Watch(
                None, log, every, modules=modules, grads=grads, tensorboard=tensorboard
            )  # checks the arguments now

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.watch = Watch(model, log, every, modules=modules, grads=grads, tensorboard=tensorboard).__enter__()

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


def LightningWatchCallback(
    log: str | os.PathLike[str], every: int = 1, *, modules=(), grads: bool = True, tensorboard=None
):  # noqa: N802
    """A Lightning ``Callback`` that watches the LightningModule it trains (``attncheck.watch``)."""
    try:
        # optional: Lightning (or the older pytorch_lightning), only for its callback
        from lightning.pytorch import Callback
    except ImportError:
        try:
            # optional: Lightning under its older package name
            from pytorch_lightning import Callback
        except ImportError:
            raise AttncheckError("LightningWatchCallback needs Lightning: pip install lightning") from None

    class AttncheckLightningCallback(Callback):
        def __init__(self) -> None:
            self.watch: Watch | None = None
            self._settings = Watch(
                None, log, every, modules=modules, grads=grads, tensorboard=tensorboard
            )  # checks the arguments now

        def on_train_start(self, trainer, pl_module):
            # no model: training_step may call the module's children itself, each then a top module
            self.watch = Watch(None, log, every, modules=modules, grads=grads, tensorboard=tensorboard).__enter__()
            self.watch._manual = True  # a step is a batch, ended below

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.watch is not None:
                loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
                self.watch.step(loss=loss.detach() if hasattr(loss, "detach") else loss)

        def _close(self) -> None:
            if self.watch is not None:
                watch, self.watch = self.watch, None
                watch.__exit__(None, None, None)

        def on_train_end(self, trainer, pl_module):
            self._close()

        def on_exception(self, trainer, pl_module, exception):
            self._close()

    return AttncheckLightningCallback()


__all__ = ["LightningWatchCallback", "WatchCallback"]
