"""Gradient clipping on still-scaled gradients: ``clip_grad_norm_``/``clip_grad_value_`` under a
``GradScaler`` without ``scaler.unscale_(optimizer)`` before it.

``scaler.scale(loss).backward()`` leaves every gradient multiplied by the loss
scale (65536 at the start). Clipping those to ``max_norm=1.0`` clips to
``1/65536`` of the intended norm (every step is clipped, training crawls), and
``clip_grad_value_`` cuts at the wrong value; the documented order is
``scaler.unscale_(optimizer)``, clip, ``scaler.step(optimizer)``, ``scaler.update()``.

Observed through declared patches: ``GradScaler.scale`` (an enabled scaler has
scaled a loss since its last ``update()``), ``GradScaler.unscale_`` (these
optimizers' gradients are unscaled now), ``GradScaler.update`` (a new iteration),
and ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_``. When clipping is
called while a scaled loss is pending, the clipped parameters (when given as a
tensor, list or tuple; a generator is never consumed) must all belong to an
unscaled optimizer; with a generator, some ``unscale_`` since the scale must have
happened. Host-only bookkeeping; the scale is read (one sync) only when reporting.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from .base import Check


class ClipBeforeUnscale(Check):
    name = "clip-before-unscale"
    kinds = {"clip-before-unscale": ("error", "gradient clipping on still-scaled gradients (no scaler.unscale_ "
                                              "before it)")}
    description = "clip_grad_norm_/clip_grad_value_ on GradScaler-scaled gradients (no scaler.unscale_ before it)"
    # the event names of amp.py's patches, so both checks share one patch of each target
    patches = {"scaler_scale": "torch.amp.GradScaler.scale", "scaler_unscale": "torch.amp.GradScaler.unscale_",
               "scaler_update": "torch.amp.GradScaler.update",
               "clip_grad_norm": "torch.nn.utils.clip_grad_norm_",
               "clip_grad_value": "torch.nn.utils.clip_grad_value_"}

    def __init__(self, guard):
        super().__init__(guard)
        self._scaler: Optional[weakref.ref] = None  # an enabled scaler with a scaled loss since its update()
        self._unscaled: set = set()  # ids of parameters of optimizers unscale_()d since then
        self._any_unscale = False

    def on_scaler_scale_done(self, args, kwargs, result):
        if args and getattr(args[0], "_enabled", False):
            self._scaler = weakref.ref(args[0])

    def on_scaler_unscale_done(self, args, kwargs, result):
        opt = args[1] if len(args) > 1 else kwargs.get("optimizer")
        if isinstance(opt, torch.optim.Optimizer):
            self._any_unscale = True
            self._unscaled.update(id(p) for grp in opt.param_groups for p in grp["params"])

    def on_scaler_update_done(self, args, kwargs, result):
        self._scaler, self._unscaled, self._any_unscale = None, set(), False

    def on_clip_grad_norm(self, args, kwargs):
        self._clip("clip_grad_norm_", args, kwargs, "max_norm")

    def on_clip_grad_value(self, args, kwargs):
        self._clip("clip_grad_value_", args, kwargs, "clip_value")

    def _clip(self, fn: str, args: tuple, kwargs: dict, arg: str) -> None:
        scaler = self._scaler() if self._scaler is not None else None
        if scaler is None:
            return
        params = args[0] if args else kwargs.get("parameters")
        if isinstance(params, torch.Tensor):
            params = [params]
        if isinstance(params, (list, tuple)):
            scaled = [p for p in params if isinstance(p, torch.Tensor) and p.grad is not None
                      and id(p) not in self._unscaled]
            if not scaled:
                return
            names = [self.g.param_name(p) for p in scaled]
        elif self._any_unscale:
            return  # a generator: not consumed; some optimizer was unscaled, trust it
        else:
            names = []
        threshold = args[1] if len(args) > 1 else kwargs.get(arg)
        try:
            scale = float(scaler.get_scale())  # one sync, only when reporting
        except Exception:
            scale = None
        at = f"{threshold:g}" if isinstance(threshold, (int, float)) else str(threshold)
        by = f"{scale:g}x" if scale else "the loss scale times"
        self.emit("clip-before-unscale", fn,
                  f"{fn}({arg}={at}) at step {self.g.step} clips gradients still multiplied by the GradScaler's "
                  f"loss scale ({scale:g}): scaler.scale(loss).backward() with no scaler.unscale_(optimizer) before "
                  f"the clip, so the threshold acts on gradients {by} too large and the real clip is {arg}/scale"
                  if scale else
                  f"{fn}({arg}={at}) at step {self.g.step} clips gradients still multiplied by the GradScaler's "
                  f"loss scale: no scaler.unscale_(optimizer) before the clip",
                  "Unscale first: scaler.scale(loss).backward(); scaler.unscale_(optimizer); "
                  f"torch.nn.utils.{fn}(model.parameters(), {at}); scaler.step(optimizer); scaler.update().",
                  source=self.g.source(),
                  details={"function": fn, arg: threshold if isinstance(threshold, (int, float)) else str(threshold),
                           "scale": scale, "parameters": names[:20]})
