"""AMP awareness: steps a ``torch.amp.GradScaler`` skips, and a scale that collapses.

With a ``GradScaler`` an occasional inf/NaN gradient is expected: the scaler
skips that ``optimizer.step()`` and lowers its scale. When it skips, the
optimizer's step hooks do not fire, so no gradient check sees those gradients
(no ``nonfinite-grad`` error); this check tells the guard the step ended
(``Guard.skipped_step``: the step counts and is marked ``skipped`` in the
timeline; unskipped scaler steps get ``skipped: False``).

Skipping every step is not AMP at work but NaN/Inf gradients that no scale
fixes (a sqrt/log at 0 in the backward, say): the scale halves each time and
the model silently stops training. When the scale falls below 1, or after
`RUN` skips in a row, this is reported as ``nonfinite-grad`` (an error, as the
vocabulary has it: the model is not training) with ``details["amp_skipped"]``
(the cause is non-finite gradients, hidden by the scaler).

The timeline's ``loss`` is divided by the scale of ``scaler.scale(loss)`` (staged with the step's
other values) and the scale is kept as ``loss_scale``.

Observed through declared patches of ``GradScaler.scale``, ``unscale_``, ``step`` and ``update``
(``torch.cuda.amp.GradScaler`` inherits both). Skips are known on the host
(no step hook fired), so nothing extra is synced; the scale is read only after
a skipped step, when the scaler has already synced. Optimizers that take the
scale into their fused step (``_step_supports_amp_scaling``) always step; their
``found_inf`` is staged and a skip is noted in the timeline.
"""
from __future__ import annotations

import weakref
from typing import Dict, List, Optional

import torch

from .base import Check

RUN = 25  # skipped steps in a row that no scale calibration explains (2**16 reaches 1 after 16)


class _Run:
    __slots__ = ("count", "since", "reported")

    def __init__(self) -> None:
        self.count, self.since, self.reported = 0, 0, False


class AmpScaler(Check):
    name = "amp-scaler"
    kinds = {
        "nonfinite-grad": ("error", "a parameter's gradient has NaN/Inf"),
    }
    description = ("GradScaler-skipped steps are no error (marked in the timeline); a scale collapsing on NaN/Inf "
                   "grads is a nonfinite-grad error")
    patches = {"scaler_scale": "torch.amp.GradScaler.scale", "scaler_unscale": "torch.amp.GradScaler.unscale_",
               "scaler_step": "torch.amp.GradScaler.step", "scaler_update": "torch.amp.GradScaler.update"}

    def __init__(self, guard):
        super().__init__(guard)
        self._inflight: Dict[int, bool] = {}  # id(optimizer) -> its step hooks fired inside scaler.step
        self._runs: "weakref.WeakKeyDictionary[object, _Run]" = weakref.WeakKeyDictionary()
        self._skipped_opts: "weakref.WeakKeyDictionary[object, List[weakref.ref]]" = weakref.WeakKeyDictionary()
        self._loss_scale: Optional[float] = None  # the scale of this step's scaled loss, once read
        self._fused_note: Optional[tuple] = None  # (skipped, grad scale) of this step's fused AMP step
        self._fused_ids: set = set()
        self._scaler_of: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
        self._scaled_out: Dict[int, weakref.ref] = {}  # id -> outputs of scaler.scale (losses to back-propagate)

    # scaler.scale(loss): the timeline's loss is the unscaled one --------------------------
    def scaled(self, tensors) -> bool:
        """Whether `tensors` (what ``backward()`` got) is the output of an enabled ``scaler.scale``."""
        ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors or ())
        return any(isinstance(t, torch.Tensor) and self._scaled_out.get(id(t), lambda: None)() is t for t in ts)

    def on_scaler_scale_done(self, args, kwargs, result):
        scaler = args[0]
        if getattr(scaler, "_enabled", False) and isinstance(result, torch.Tensor):
            if len(self._scaled_out) > 64:
                self._scaled_out = {k: r for k, r in self._scaled_out.items() if r() is not None}
            try:
                self._scaled_out[id(result)] = weakref.ref(result)
            except TypeError:
                pass
        scale = getattr(scaler, "_scale", None)
        if (not self.g.sampling or not getattr(scaler, "_enabled", False) or not isinstance(result, torch.Tensor)
                or result.numel() != 1 or not isinstance(scale, torch.Tensor)):
            return
        self.g.stage(scale.detach().reshape(()).float().clone(), self._got_scale)

    def _got_scale(self, value: float) -> None:
        self._loss_scale = value

    def on_resolved(self):
        if self.g.mid_step:
            return  # the user read findings mid-step: the step's loss comes at its end
        scale, self._loss_scale = self._loss_scale, None
        fused, self._fused_note = self._fused_note, None
        tl = self.g.timeline
        if not tl or tl[-1].get("step") != self.g.step:
            return
        entry = tl[-1]
        if scale and "loss" in entry and "loss_scale" not in entry:
            self.g.timeline_note(loss=entry["loss"] / scale, loss_scale=scale)
        if fused is not None and "grad_norm" in entry:
            skipped, grad_scale = fused
            if skipped:
                self.g.timeline_note(grad_norm=None)
            elif grad_scale:
                self.g.timeline_note(grad_norm=entry["grad_norm"] / grad_scale)

    # scaler.unscale_(optimizer): gradients changed in place -------------------------------
    def on_scaler_unscale_done(self, args, kwargs, result):
        opt = args[1] if len(args) > 1 else kwargs.get("optimizer")
        if opt is not None:
            # Norms taken before unscale_ (e.g. by a check at backward time) are of scaled grads:
            # drop them so every gradient check at step time sees the unscaled ones.
            self.g.forget_grad_norms(opt)

    # scaler.step(optimizer) -------------------------------------------------------------
    def on_scaler_step(self, args, kwargs):
        opt = args[1] if len(args) > 1 else kwargs.get("optimizer")
        if opt is not None:
            self._inflight[id(opt)] = False
            self._scaler_of[id(opt)] = args[0]
            if args[0] not in self._runs:
                self._runs[args[0]] = _Run()

    def on_step_pre(self, optimizer):
        if id(optimizer) not in self._inflight:
            return
        self._inflight[id(optimizer)] = True
        found_inf = getattr(optimizer, "found_inf", None)
        if not self.g.is_primary(optimizer) or not self.g.sampling:
            return
        if isinstance(found_inf, torch.Tensor):
            self._fused_ids.add(id(optimizer))
            # Fused step: it unscales and skips by itself, on the device. Read found_inf and the scale
            # with the step's other values; the timeline's grad norm is then unscaled in on_resolved.
            scale = getattr(optimizer, "grad_scale", None)
            vals = [found_inf.detach().reshape(()).float()]
            if isinstance(scale, torch.Tensor):
                vals.append(scale.detach().reshape(()).float().to(vals[0].device))
            stacked = torch.stack(vals)
            self.g.stage_batch(lambda: [(stacked, lambda v: self._fused(optimizer, v))])
        else:
            self.g.timeline_note(skipped=False)

    def _fused(self, optimizer, values: List[float]) -> None:
        skipped = values[0] > 0
        self._fused_note = (skipped, values[1] if len(values) > 1 else None)
        self.g.timeline_note(skipped=skipped)
        scaler = self._scaler_of.get(id(optimizer))
        run = self._runs.get(scaler) if scaler is not None else None
        if run is not None:
            if skipped:
                if run.count == 0:
                    run.since = self.g.step
                run.count += 1
                self._skipped_opts.setdefault(scaler, []).append(weakref.ref(optimizer))
            else:
                run.count = 0

    def on_scaler_step_error(self, args, kwargs, exc):
        opt = args[1] if len(args) > 1 else kwargs.get("optimizer")
        if opt is not None:
            self._inflight.pop(id(opt), None)

    def on_scaler_step_done(self, args, kwargs, result):
        scaler = args[0]
        opt = args[1] if len(args) > 1 else kwargs.get("optimizer")
        if opt is None:
            return
        stepped = self._inflight.pop(id(opt), True)
        if not getattr(scaler, "_enabled", True):
            return
        run = self._runs.get(scaler)
        if run is None:
            run = self._runs[scaler] = _Run()
        if stepped:
            if self.g.is_primary(opt) and id(opt) not in self._fused_ids:
                run.count = 0  # (a fused step counts its skips from found_inf, in _fused)
            return
        if self.g.is_primary(opt) or not self.g.has_optimizer:
            if run.count == 0:
                run.since = self.g.step
            run.count += 1
        self._skipped_opts.setdefault(scaler, []).append(weakref.ref(opt))
        self.g.skipped_step(opt)

    # scaler.update() --------------------------------------------------------------------
    def on_scaler_update_done(self, args, kwargs, result):
        scaler = args[0]
        opts = self._skipped_opts.pop(scaler, None)
        run = self._runs.get(scaler)
        if not opts or run is None or run.count == 0 or run.reported:
            return
        scale = float(scaler.get_scale())  # after a skip the scaler has synced already
        if scale >= 1.0 and run.count < RUN:
            return
        run.reported = True
        names = self._nonfinite_names([o for o in (r() for r in opts) if o is not None])
        where = names[0] if names else "loss"
        shown = ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
        self.emit("nonfinite-grad", where,
                  f"GradScaler skipped optimizer.step() {run.count} steps in a row since step {run.since} and its "
                  f"scale fell to {scale:.3g}: the gradients are NaN/Inf at every scale"
                  + (f" ({shown})" if shown else "") + ", so the model is not training",
                  "This is not an fp16 overflow the scaler can fix: the backward itself makes NaN/Inf (sqrt/log/pow "
                  "at 0, division by zero, a NaN in the data or the loss). Run a step without the scaler (or under "
                  "torch.autograd.detect_anomaly) to find the op; bf16-pretrained models may also need bf16 "
                  "instead of fp16.",
                  step=run.since, seen=self.g.step, source=self.g.source(),
                  details={"amp_skipped": run.count, "scale": scale, "parameters": names[:20]})

    def _nonfinite_names(self, opts) -> List[str]:
        params = [p for o in opts for grp in o.param_groups for p in grp["params"]
                  if p.grad is not None and p.grad.layout is torch.strided and not p.grad.is_meta]
        if not params:
            return []
        with torch.no_grad():
            norms = torch._foreach_norm([p.grad.detach() for p in params])
            ok = torch.stack([torch.isfinite(n).reshape(()).cpu() for n in norms]).tolist()
        return [self.g.param_name(p) for p, good in zip(params, ok) if not good]
