"""Lightning integration: ``Trainer(callbacks=[GuardCallback(report="guard.json")])``.

Requires the ``lightning`` extra (``pip install 'torch-runtime-guard[lightning]'``); ``pytorch_lightning``
works as well. The callback starts a guard on the LightningModule and its optimizers when fitting
starts, runs each ``training_step`` as a call of the module (the batch is its input, so dirty data is
``nonfinite-input`` even when ``training_step`` calls ``self.net(x)``), numbers findings by
``trainer.global_step``, logs the finding counts with ``self.log`` (``guard/errors``,
``guard/warnings``, ``guard/infos``), writes the report when fitting ends, and closes on exceptions.
"""
from __future__ import annotations

from typing import Any, Optional

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # pragma: no cover - the older package name
    try:
        from pytorch_lightning.callbacks import Callback  # type: ignore[no-redef]
    except ImportError as exc:
        raise ImportError("guard.integrations.lightning needs Lightning: pip install 'torch-runtime-guard[lightning]'") from exc

from ..config import make_config
from ..checks import registry
from ..session import Guard
from . import _common

__all__ = ["GuardCallback"]


class GuardCallback(Callback):
    """A Lightning ``Callback`` that runs the fit under a guard; options are those of ``guard()``."""

    def __init__(self, report: Any = None, mode: Any = "warn", **options: Any):
        super().__init__()
        make_config(registry(), report=report, mode=mode, **options)  # a bad option fails here, at construction
        self.options = dict(options, report=report, mode=mode)
        self.guard: Optional[Guard] = None
        self._logged: Optional[dict] = None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        _common.close(self.guard)
        opts = [getattr(o, "optimizer", o) for o in (trainer.optimizers or [])]
        self.guard = Guard(pl_module, opts or None, **self.options)
        self.guard.start()
        self.guard.step = int(trainer.global_step)  # findings carry Lightning's own step number
        step_fn = pl_module.training_step
        g, module = self.guard, pl_module

        def training_step(*args: Any, **kwargs: Any) -> Any:
            return g.model_call(module, step_fn, *args, **kwargs)

        g.replace_attr(pl_module, "training_step", training_step)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        g = self.guard
        if g is not None and g.active and g.step != trainer.global_step:
            g.step = int(trainer.global_step)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        g = self.guard
        if g is None or not g.active:
            return
        values = _common.counts(g)
        if values != self._logged or trainer.global_step % max(1, trainer.log_every_n_steps) == 0:
            self._logged = values
            for name, value in values.items():
                pl_module.log(name, value, on_step=True, on_epoch=False, prog_bar=False, logger=bool(trainer.loggers),
                              batch_size=1)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        _common.close(self.guard)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        _common.close(self.guard, exception)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            _common.close(self.guard)
