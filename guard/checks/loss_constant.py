"""A loss that cannot change: ``cross_entropy`` over a single class (C = 1) is identically 0.

``log_softmax`` over one class is 0 whatever the logits, so the loss is 0 and
every gradient is 0: the model never trains (a ``[N, 1]`` output meant for
``binary_cross_entropy_with_logits``, or a head built with ``out_features=1``).
Reported at the loss line, at the first such call.

Observed through the reversible patch of ``torch.nn.functional.cross_entropy``
(shared with the ``loss-fn`` check; ``nn.CrossEntropyLoss`` calls it). Cost:
a shape test per call on the host; nothing on the device.
"""
from __future__ import annotations

import torch

from .base import Check


class LossConstant(Check):
    name = "loss-constant"
    costly = True  # sampled under a budget: a property of the code, seen on any step it runs
    kinds = {"loss-constant": ("error", "the loss cannot change, e.g. cross_entropy over a single class (C = 1) "
                                        "is identically 0")}
    description = "a loss that cannot change: cross_entropy over a single class (C = 1) is identically 0"
    patches = {"cross_entropy": "torch.nn.functional.cross_entropy"}

    def __init__(self, guard):
        super().__init__(guard)
        self._done = False

    def on_cross_entropy(self, args, kwargs):
        if self._done:
            return
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return
        cdim = 1 if x.dim() >= 2 else 0
        if x.shape[cdim] != 1 or x.numel() <= 1:
            # A single row of one class is the ragged last batch of in-batch negatives (CLIP's [N, N]
            # logits with N = 1), not a head built with one output: that one shows on every full batch.
            return
        self._done = True
        shape = list(x.shape)
        why = f"cross_entropy over {shape} has a single class (C = 1): log_softmax over one class is 0"
        self.emit("loss-constant", "loss",
                  f"{why}, so the loss is identically 0 and every gradient is 0: the model cannot learn",
                  "For a binary target keep one logit and use F.binary_cross_entropy_with_logits(out, y.float()) "
                  "(nn.BCEWithLogitsLoss, out and y of the same shape); for C classes give the last layer C outputs "
                  "(nn.Linear(..., C)) and keep cross_entropy.",
                  source=self.g.source(), details={"loss": "cross_entropy", "input_shape": shape, "classes": 1,
                                                   "why": "cross_entropy over a single class (C = 1)"})
