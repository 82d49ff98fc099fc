"""Loss at initialisation: the first steps' cross-entropy far above ``log(C)``.

A freshly initialised classifier should predict close to uniformly, so its
cross-entropy starts near ``log(C)`` for ``C`` classes ("verify the loss at init").
A loss several times higher means confidently wrong logits from the start: a badly
scaled last layer (large init, a missing normalisation, logits multiplied up), which
wastes the first part of training undoing it and can destabilise it.

Observed through a declared patch of ``torch.nn.functional.cross_entropy``
(``nn.CrossEntropyLoss`` calls it): on the first `STEPS` optimizer steps, each
grad-enabled, ``reduction="mean"`` call's value is staged (read with the step's other
values: no extra sync). At the end of step `STEPS - 1` (or at exit), if even the
lowest of them is above both ``RATIO * log(C)`` and ``log(C) + MARGIN``, it is
reported (info). Class weights, label smoothing and soft targets all give
``log(C)`` for uniform predictions, so the bar holds for them. A resumed, trained
model starts below ``log(C)`` and is silent. When guard already reported
``input-not-normalized`` (raw 0-255 pixels make huge logits), that is the cause and
the high loss is not reported again.

Cost: a few staged scalars on the first steps, then one integer comparison per
cross-entropy call.
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch

from .base import Check

STEPS = 3
RATIO = 3.0
MARGIN = 1.0


_NORMS = ("LinalgVectorNormBackward0", "NormBackward1", "NormBackward0")
_WALK = 40  # graph nodes looked at behind the logits


def _cosine_logits(x: torch.Tensor) -> bool:
    """Whether the logits are scaled cosines (a margin-softmax head: ArcFace, CosFace, NormFace): within a few
    operations of the logits, the features or the class weights were L2-normalised (a norm node). One is enough:
    the other side may be normalised outside the graph (features of a frozen encoder run under no_grad, a
    locked tower's precomputed embeddings), and a plain Linear over normalised features does not start high."""
    fn = x.grad_fn
    if fn is None:
        return False
    todo, seen = [fn], {id(fn)}
    while todo and len(seen) <= _WALK:
        node = todo.pop()
        if type(node).__name__ in _NORMS:
            return True
        for child, _ in getattr(node, "next_functions", ()):
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                todo.append(child)
    return False


class InitLossHigh(Check):
    name = "init-loss-high"
    kinds = {"init-loss-high": ("info", "the first steps' cross-entropy is far above log(C)")}
    description = "the first steps' cross-entropy far above log(C) (a badly scaled last layer)"
    patches = {"init_cross_entropy": "torch.nn.functional.cross_entropy"}

    def watches(self, module) -> bool:
        return False

    def __init__(self, guard):
        super().__init__(guard)
        self._vals: List[Tuple[float, int, Optional[str]]] = []  # (loss, C, source)
        self._done = False

    def on_init_cross_entropy_done(self, args, kwargs, result):
        if self._done or self.g.step >= STEPS or not torch.is_grad_enabled():
            return
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, torch.Tensor) or not isinstance(result, torch.Tensor) or result.numel() != 1:
            return
        if kwargs.get("reduction", args[6] if len(args) > 6 else "mean") != "mean" or x.dim() < 1:
            return
        if kwargs.get("size_average") is not None or kwargs.get("reduce") is not None:
            return  # legacy reduction arguments: not a mean for sure
        if not x.is_floating_point() or x.device.type == "meta":
            return
        c = x.shape[1] if x.dim() >= 2 else x.shape[0]
        if c < 2:
            return
        if _cosine_logits(x):
            return  # a margin softmax (ArcFace, CosFace): s * cos(theta + m) starts far above log(C) by design
        src = self.g.source()
        self.g.stage(result.detach().float().reshape(()), lambda v, c=c, src=src: self._vals.append((v, c, src)))

    def on_step_end(self, step):
        if not self._done and step >= STEPS - 1:
            self._judge()

    def on_exit(self):
        if not self._done:
            self._judge()

    def _judge(self) -> None:
        self._done = True
        vals = [(v, c, s) for v, c, s in self._vals if v == v]  # NaN is the nonfinite check's business
        self._vals = []
        if not vals or any(f.kind == "input-not-normalized" for f in self.g.findings):
            return  # raw 0-255 inputs already reported: the high loss is their symptom, not a second cause
        low, c, src = min(vals, key=lambda e: e[0] / math.log(e[1]))
        ref = math.log(c)
        if not (low > RATIO * ref and low > ref + MARGIN) or low == float("inf"):
            return
        message = (f"the cross-entropy of the first {len(vals)} loss call(s) is at least {low:.3g}, "
                   f"{low / ref:.1f}x log(C) = {ref:.3g} for C={c} classes, the loss of uniform predictions: the "
                   f"model starts out confidently wrong")
        hint = ("Verify the loss at init: scale the last layer down (e.g. initialise its weight with a small std "
                "or zeros and its bias to the class log-priors), and look for logits multiplied up or an "
                "unnormalised input.")
        self.emit("init-loss-high", "loss", message, hint, step=0, source=src,
                  details={"min_loss": low, "log_c": ref, "classes": c, "ratio": low / ref, "calls": len(vals)})
