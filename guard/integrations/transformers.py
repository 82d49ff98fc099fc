"""Hugging Face integration: ``Trainer(..., callbacks=[GuardCallback(report="guard.json")])``.

Requires the ``transformers`` extra (``pip install 'torch-runtime-guard[transformers]'``). The callback
starts a guard on the Trainer's model and its real optimizer (unwrapped from accelerate's
``AcceleratedOptimizer``) when training begins, numbers findings by ``state.global_step``, adds the
finding counts to every log (``guard/errors``, ``guard/warnings``, ``guard/infos``; the Trainer's
``on_log``), and writes the report when training ends. The Trainer has no exception event: the
callback finds the Trainer that calls it and, while the guard runs, wraps its ``training_step``
(forward, loss and backward), so that a crash there gets guard's explanation (a note on the exception)
and closes the guard as a ``with`` block would. A crash elsewhere (the optimizer step, a callback)
leaves the guard open until the next ``train()``, ``callback.close()`` or interpreter exit.
"""
from __future__ import annotations

import sys
from typing import Any, Optional

try:
    from transformers import Trainer, TrainerCallback
except ImportError as exc:  # pragma: no cover
    raise ImportError("guard.integrations.transformers needs transformers: "
                      "pip install 'torch-runtime-guard[transformers]'") from exc

from ..checks import registry
from ..config import make_config
from ..session import Guard
from . import _common

__all__ = ["GuardCallback"]


class GuardCallback(TrainerCallback):
    """A Hugging Face ``TrainerCallback`` that runs training under a guard; options are those of ``guard()``."""

    def __init__(self, report: Any = None, mode: Any = "warn", **options: Any):
        make_config(registry(), report=report, mode=mode, **options)  # a bad option fails here, at construction
        self.options = dict(options, report=report, mode=mode)
        self.guard: Optional[Guard] = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        self.close()
        opt = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the real one
        self.guard = Guard(model, opt, **self.options)
        self.guard.start()
        self.guard.step = int(state.global_step)
        trainer = _calling_trainer()
        if trainer is not None:
            self.guard.close_on_error(trainer, "training_step")

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        g = self.guard
        if g is not None and g.active and g.step != state.global_step:
            g.step = int(state.global_step)  # findings carry the Trainer's own step number

    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[dict] = None, **kwargs: Any) -> None:
        g = self.guard
        if g is None or logs is None:
            return
        values = {k: int(v) for k, v in _common.counts(g).items()}
        logs.update(values)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(values)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close the guard now (writes the report); idempotent."""
        _common.close(self.guard)


def _calling_trainer(depth: int = 12) -> Optional[Any]:
    """The ``Trainer`` whose loop runs this callback: ``self`` of a frame a few calls up."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        if isinstance(obj, Trainer):
            return obj
        frame = frame.f_back
    return None
