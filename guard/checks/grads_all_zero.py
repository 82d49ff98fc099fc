"""All-zero gradients: every gradient the optimizer applies is exactly zero, step after step.

Per sampled step and optimizer: the total gradient norm from the shared, fused
``g.grad_norms(opt)`` (the same reduction ``grad-explosion`` uses, computed once
per step), staged and read with the step's other values. `STEPS` steps in a row
with a total of exactly 0 mean training has stopped (under ``every=N`` a run's steps
are followed one by one: sampled steps with zeros in between are no run). A step whose loss
is exactly 0 breaks a run: there was nothing to learn (an episode without reward), unless the
loss cannot change at all (a ``loss-constant`` finding). When the cause is
already known (a ``loss-constant`` finding: ``cross_entropy`` over one class),
the message names it.

Cost: one staged 0-dim value per sampled step (no extra reduction when another
gradient check runs; one fused ``_foreach_norm`` otherwise); host-only after that.
"""
from __future__ import annotations

import weakref
from typing import Any, List, Optional

import torch

from .base import Check
from .._weak import WeakIdMap

STEPS = 5  # consecutive steps with all-zero gradients before reporting
IDLE_RUN = 20  # steps with a loss of exactly 0 and zero gradients, every step of a run, before it is told at its end
#: steps with a gradient that still leave a run idle: a margin met from the second step on (a triplet loss whose
#: margin the untrained embeddings already meet, bar a first batch) trained nothing either
IDLE_TRAINED = 2


class _Run:
    __slots__ = ("count", "since", "last", "source", "beside", "n")

    def __init__(self) -> None:
        self.count, self.since, self.last, self.source = 0, 0, -1, None
        self.beside = False  # the run's steps had another optimizer training: judged when the run ends
        self.n = 0


class GradsAllZero(Check):
    name = "grads-all-zero"
    kinds = {"grads-all-zero": ("warning", "every gradient the optimizer applies has been exactly zero for "
                                           "several steps: training has stopped")}
    description = "every gradient the optimizer applies exactly zero for several steps (training has stopped)"
    # shared with clip-before-unscale (one patch): a clip to 0 zeroes every gradient after backward()
    patches = {"clip_grad_norm": "torch.nn.utils.clip_grad_norm_", "clip_grad_value": "torch.nn.utils.clip_grad_value_"}

    def __init__(self, guard):
        super().__init__(guard)
        self._runs = WeakIdMap()  # optimizer -> _Run
        self._zeros: list = []  # (optimizer ref, step, source, parameters) of this step's zero totals
        self._trains = False  # whether an optimizer's gradients were not all zero in this step
        self._grad_seen = WeakIdMap()  # optimizer -> (its first gradient, that gradient's version) at the last look
        self._ever = False  # some step had a non-zero gradient
        self._trained = 0  # steps with a non-zero gradient
        self._idle: Optional[list] = None  # [(first idle step's zeros entry), steps with loss 0 and zero gradients]
        self._clip_zero: Optional[tuple] = None  # (function, argument, its line) of a clip to 0 seen
        # steps in a row, from the run's start, whose optimizer held no gradient at all although the model was
        # called: [count, first step, its line] (False once told or once a gradient was seen)
        self._none: Any = None

    def on_clip_grad_norm(self, args, kwargs):
        self._clip("clip_grad_norm_", "max_norm", args[1] if len(args) > 1 else kwargs.get("max_norm"))

    def on_clip_grad_value(self, args, kwargs):
        self._clip("clip_grad_value_", "clip_value", args[1] if len(args) > 1 else kwargs.get("clip_value"))

    def _clip(self, fn: str, arg: str, value) -> None:
        if self._clip_zero is None and isinstance(value, (int, float)) and value == 0:
            self._clip_zero = (fn, arg, self.g.source())

    def on_step_pre(self, optimizer):
        if not self.sampling:
            return
        gn = self.g.grad_norms(optimizer)
        totals = list(gn.totals.values())
        if not totals:
            if not self._ever and self._none is not False:
                self._no_gradient(optimizer)
            return
        total = totals[0]
        if len(totals) > 1:
            with torch.no_grad():
                total = torch.linalg.vector_norm(torch.stack([t.to(total.device) for t in totals]))
        step, source, oref, n = self.g.step, self.g.source(), weakref.ref(optimizer), len(gn.params)
        self.g.stage(total, lambda v: self._seen(oref, v, step, source, n))

    def _no_gradient(self, optimizer) -> None:
        """A step of an optimizer none of whose parameters has a gradient, before any gradient was seen in the
        run. With the model called in each such step and no loss ever back-propagated, `backward()` never runs:
        `loss.backward` without parentheses (it names the method, and calls nothing)."""
        params = [p for grp in optimizer.param_groups for p in grp["params"] if isinstance(p, torch.Tensor)]
        if not params or any(p.grad is not None for p in params) or not any(p.requires_grad for p in params):
            self._none = False  # gradients of another layout, or a frozen part: not this
            return
        if any(e.get("loss") is not None for e in self.g.timeline):
            self._none = False  # a loss was back-propagated: never this
            return
        if not self.g.watched.primary_called or not self.g.is_primary(optimizer):
            self._none = None  # no model call in this step (an LR schedule stepped on its own)
            return
        if self._none is None:
            self._none = [0, self.g.step, self.g.source()]
        self._none[0] += 1
        if self._none[0] < STEPS:
            return
        count, step, source = self._none
        self._none = False
        if any(f.kind == "zero-grad-before-step" for f in self.g.findings):
            return  # the gradients were there (written by hand, `p.grad = ...`), and that zero_grad() wiped them: told
        name = type(optimizer).__name__
        self.emit("grads-all-zero", "loss",
                  f"{name}.step() ran at each of the last {count} steps, with the model called before it, but none of "
                  f"the {len(params)} parameter(s) it updates ever had a gradient: no loss was back-propagated since "
                  f"the run began, so every step skipped all parameters and nothing was trained",
                  "Call loss.backward() before optimizer.step(): `loss.backward` without parentheses only names the "
                  "method and computes nothing (the same for `optimizer.step`).",
                  step=step, seen=self.g.step, source=source,
                  details={"optimizer": name, "steps": count, "parameters": len(params), "no_backward": True})

    def _seen(self, oref, v: float, step: int, source: Optional[str], n: int) -> None:
        opt = oref()
        if opt is None:
            return
        run = self._runs.data.get(id(opt))
        if run is None:
            run = self._runs[opt] = _Run()
        if v != 0.0:  # NaN/Inf or a real gradient: the run is broken
            self._break(run)
            self._trains = self._trains or v == v
            self._ever = True
            self._trained += 1
            return
        self._zeros.append((oref, step, source, n))  # counted in on_resolved, once the step's loss is known

    def on_resolved(self):
        if self.g.mid_step:
            return  # a read for the user mid-step: the step's loss comes with the step's own resolution
        trains, self._trains = self._trains, False
        if not self._zeros:
            return
        zeros, self._zeros = self._zeros, []
        tl = self.g.timeline
        entry = tl[-1] if tl else {}
        # A loss of exactly 0 has nothing to teach (a REINFORCE episode without reward, a hinge loss with
        # every margin met): zero gradients then are no sign that training stopped. Unless the loss
        # cannot change at all (loss-constant: cross_entropy over one class), which is the bug.
        idle = (entry.get("loss") == 0.0 and entry.get("step") == zeros[0][1]
                and not any(f.kind == "loss-constant" for f in self.g.findings))
        if idle and self._trained <= IDLE_TRAINED:
            # nothing trained so far, the loss 0 at every such step: judged when the run ends (a mask that selects
            # nothing makes every step's loss 0; an episode without reward, a met margin, is a step, not a run)
            if self._idle is None:
                self._idle = [zeros[0], 0]
            self._idle[1] += 1
        for oref, step, source, n in zeros:
            opt = oref()
            run = self._runs.data.get(id(opt)) if opt is not None else None
            if run is None:
                continue
            # Another optimizer's gradients carry signal: training goes on. This one's part, when no backward
            # reached it (a domain head whose phase ended, stepped over gradients zeroed in place), is no stop;
            # one a backward reached with zeros (a decoder behind a saturated clamp) has stopped learning.
            if idle or (trains and not self._reached(opt)):
                self._break(run)
                continue
            if run.count and step != run.last + 1:
                run.count = 0  # steps every=N left out lie between: a pattern of its period is no run
            if run.count == 0:
                run.since, run.source, run.beside = step, source, False
                self.follow(True)  # under every=N, see the run's steps one by one
            run.count += 1
            run.last, run.n = step, n
            run.beside = run.beside or trains
            if run.count >= STEPS and not run.beside:
                self._report(opt, run, n)

    def _reached(self, opt) -> bool:
        """Whether a backward wrote the gradient of `opt`'s first parameter since the last look: a new tensor, or
        the same one changed more than once (zero_grad(set_to_none=False) zeroes it in place: one change)."""
        g = next((p.grad for grp in opt.param_groups for p in grp["params"] if p.grad is not None), None)
        if g is None:
            return False
        last = self._grad_seen.data.get(id(opt))
        self._grad_seen[opt] = (weakref.ref(g), g._version)
        return last is None or last[0]() is not g or g._version - last[1] >= 2

    def on_exit(self):
        if self._idle is not None and self._trained <= IDLE_TRAINED and self._idle[1] >= IDLE_RUN:
            self._report_idle(*self._idle)
        # A part that got only zero gradients while another optimizer trained, to the end of the run: dead (a
        # decoder behind a saturated clamp). One whose zeros ended was waiting (a loss term weighted 0 for a warm-up).
        for opt, run in list(self._runs.items()):
            if run.beside and run.count >= STEPS:
                self._report(opt, run, run.n, to_end=True)

    def _report_idle(self, first: tuple, steps: int) -> None:
        oref, step, source, n = first
        opt = oref()
        name = type(opt).__name__ if opt is not None else "the optimizer"
        if any(f.kind in ("loss-constant", "loss-disconnected") or f.kind.startswith("nonfinite-") for f in self.g.findings):
            return  # the cause is told already
        self.emit("grads-all-zero", "loss",
                  f"the loss was exactly 0 at every one of the run's {steps} training steps (from step {step}), and "
                  f"every gradient of the {n} parameter(s) {name} updates was exactly 0: nothing was trained",
                  "The loss is 0 by construction: look at what weights it at the first step. A mask that selects "
                  "nothing (a validity mask with its comparison reversed: `gt > max_depth` for `gt < max_depth`; "
                  "print `mask.sum()`), a term multiplied by 0, a hinge or margin that every sample meets from the "
                  "start, a reward that never comes (sparse-reward RL: no episode reached it).",
                  step=step, seen=self.g.step, source=source,
                  details={"optimizer": name, "steps": steps, "parameters": n, "loss_always_zero": True})

    def _break(self, run: _Run) -> None:
        if run.count:
            run.count = 0
            self.follow(any(r.count for r in self._runs.values()))

    def _report(self, opt, run: _Run, n: int, to_end: bool = False) -> None:
        cause = next((f for f in self.g.findings if f.kind == "loss-constant"), None)
        because = (f" because the loss is constant ({cause.source or cause.where}: {cause.details.get('why', '')})"
                   if cause is not None else "")
        # The norms are 0, but the gradients may not be: below ~1e-19 their squares underflow float32. Read once.
        tiny = cause is None and _nonzero(opt)
        clip = self._clip_zero if cause is None and not tiny else None
        what = ("has had a norm of 0 (its values are not all 0, but too small to square in float32: below ~1e-19)"
                if tiny else "has been exactly zero")
        hint = ("The gradients shrank geometrically to nothing: something scales them down at every step. A "
                "gradient hook registered inside the loop (p.register_hook(lambda g: g * 0.5)) adds one more hook per "
                "step, and they pile up; register hooks once, before the loop. Otherwise look for a loss scaled "
                "by a factor that decays to 0, or saturated outputs." if tiny else
                "The loss no longer depends on the parameters: look for detach()/.item()/argmax/round in the "
                "loss path, a loss multiplied by 0 or a constant, cross_entropy over a single class, dead ReLUs "
                "or saturated outputs.")
        hooked = _hooked(opt) if cause is None and clip is None and not tiny else 0
        if hooked:
            # tensor hooks on the parameters rewrite their gradients (clipping by hook, torch.clamp(g, -c, c) with c
            # read as 0 from a config): the path is not cut, the hooks return zeros
            because = (f" while {hooked} of them carry gradient hooks (p.register_hook), which rewrite each gradient "
                       f"as it is computed")
            hint = ("Look at what the hooks return: a clamp to a limit of 0 (torch.clamp(g, -c, c) with c = 0 from a "
                    "config meaning 'no clipping'), a mask or scale of 0. Register the hook only when clipping is on, "
                    "or use torch.nn.utils.clip_grad_norm_ after backward() with the limit you meant.")
        zeros = _zero_matrices(opt) if cause is None and clip is None and not tiny and not hooked else []
        if len(zeros) >= 2:
            # LoRA with A and B both initialised to zeros: d(A @ B)/dA = grad @ B.T = 0 and the same for B, forever
            named = ", ".join(self.g.param_name(p) for p in zeros[:4]) + (", ..." if len(zeros) > 4 else "")
            because = (f" while {len(zeros)} of its weight matrices are exactly 0 ({named}): in a product of two "
                       f"factors that are both 0, each factor's gradient is the other one times the output's, 0")
            hint = ("Initialise one factor of each product non-zero: LoRA starts A random (kaiming_uniform_, or "
                    "normal with std 1/r) and B at zeros, so that B gets a gradient from the first step and the "
                    "adapter's output still starts at 0.")
        if clip is not None:
            because = f" because {clip[0]}({clip[1]}=0) at {clip[2]} scales every gradient to 0 after backward()"
            hint = (f"{clip[1]}=0 does not mean \"no clipping\": it clips every gradient to 0. Skip the call when "
                    f"clipping is off (`if cfg.clip > 0: torch.nn.utils.{clip[0]}(model.parameters(), cfg.clip)`), "
                    f"or pass the limit you meant (1.0 is common).")
        stopped = ("training has stopped" if not to_end else
                   "that part of the model stopped learning, to the end of the run, while the other optimizer(s) "
                   "trained the rest")
        self.emit("grads-all-zero", "loss",
                  f"every gradient of the {n} parameter(s) {type(opt).__name__} updates {what} for "
                  f"{run.count} steps since step {run.since}{because}: {stopped}",
                  (cause.hint if cause is not None else hint),
                  step=run.since, seen=self.g.step, source=run.source,
                  details={"optimizer": type(opt).__name__, "steps": run.count, "parameters": n,
                           "cause": cause.kind if cause is not None else ("clip_to_zero" if clip is not None else
                                                                          "gradient_hooks" if hooked else
                                                                          "zero_factors" if len(zeros) >= 2 else None),
                           "cause_source": cause.source if cause is not None else (clip[2] if clip is not None else None),
                           **({"underflow": True} if tiny else {}), **({"beside_training": True} if to_end else {})})


def _hooked(opt) -> int:
    """How many of `opt`'s parameters carry tensor gradient hooks (read when reporting)."""
    return sum(1 for grp in opt.param_groups for p in grp["params"] if getattr(p, "_backward_hooks", None))


def _zero_matrices(opt, limit: int = 512) -> List[torch.Tensor]:
    """`opt`'s parameters of 2 or more dimensions whose values are all exactly 0 (read once, when reporting)."""
    out = []
    with torch.no_grad():
        for grp in opt.param_groups:
            for p in grp["params"][:limit]:
                if p.dim() >= 2 and p.layout is torch.strided and not p.is_meta and not bool(p.detach().any()):
                    out.append(p)
    return out


def _nonzero(opt) -> bool:
    """Whether any gradient `opt` holds has a non-zero value (its norm underflowed)."""
    with torch.no_grad():
        for grp in opt.param_groups:
            for p in grp["params"]:
                g = p.grad if p.is_leaf else None
                if g is not None and g.layout is torch.strided and not g.is_meta and bool((g != 0).any()):
                    return True
    return False
