"""A loss that cannot change: ``cross_entropy`` over a single class (C = 1) is identically 0.

``log_softmax`` over one class is 0 whatever the logits, so the loss is 0 and
every gradient is 0: the model never trains (a ``[N, 1]`` output meant for
``binary_cross_entropy_with_logits``, or a head built with ``out_features=1``).
Reported at the loss line, at the first such call.

Observed through the reversible patch of ``torch.nn.functional.cross_entropy``
(shared with the ``loss-fn`` check; ``nn.CrossEntropyLoss`` calls it). Cost:
a shape test per call on the host; nothing on the device.

Also a loss whose value stays bit-identical for `IDENTICAL` steps while the gradients are not zero: it
does not follow what the model learns, such as a DPO loss stuck at log 2 because the "reference" is the
policy object itself (no deepcopy), so their log-probabilities always cancel. Read from the timeline
values guard reads at every step anyway (the loss, and the gradient norm that the default checks
compute); values a half-precision loss can take exactly (0, 1, 0.5, a bf16 or fp16 loss's coarse steps)
are left out, since such a loss may repeat while it trains, and so are gradients below `MIN_NORM` and
L-BFGS (a converged fit stays put). While the loss repeats, the model calls' output sums are read too: outputs
that stand still with it are a piecewise-constant forward's plateau (spiking outputs below threshold, sign weights
trained full-batch), told only after `PLATEAU` steps.
"""
from __future__ import annotations

import math
import struct
from typing import Any, Optional

import torch

from ..tensors import iter_tensors
from ._graphs import Budget, walk
from .base import Check, add_call_handlers


IDENTICAL = 8  # steps in a row with the very same loss value and non-zero gradients
#: ... when the model's outputs stayed the same too (their sums, read from the 2nd identical step on): a forward that
#: is piecewise constant in the weights (spiking units below threshold, sign or rounding with a straight-through or
#: surrogate gradient) sits on a plateau until a unit crosses, which training does within a few dozen steps
PLATEAU = 100
MIN_NORM = 1e-4  # gradients below this are a converged fit's, whose loss may stay put
#: ... and so are gradients below this fraction of the run's first ones (the largest of its first FIRST steps):
#: a full-batch GLM, GP or Cox fit under Adam sits at 1e-4 of its first gradient, its float32 loss unchanged
REL_NORM = 1e-3
FIRST = 10


def _coarse(v: float) -> bool:
    """Whether `v` is a value a bf16 or fp16 loss can take exactly (such losses repeat while they train)."""
    try:
        if struct.unpack("<f", struct.pack("<f", v))[0] != v:
            return False  # not even a float32 value: a float64 loss
        if struct.unpack("<I", struct.pack("<f", v))[0] & 0xFFFF == 0:
            return True
        return struct.unpack("<e", struct.pack("<e", v))[0] == v
    except (OverflowError, struct.error):
        return False


#: losses that are 0 whenever input and target are equal (they compare the two element by element)
_DISTANCES = ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss")


class LossConstant(Check):
    name = "loss-constant"
    costly = True  # sampled under a budget: a property of the code, seen on any step it runs
    kinds = {"loss-constant": ("error", "the loss cannot change, e.g. cross_entropy over a single class (C = 1) "
                                        "is identically 0")}
    description = ("a loss that cannot change: cross_entropy over a single class (C = 1) is identically 0, and so is a "
                   "distance between a prediction and itself (mse_loss(pred, pred)); a loss "
                   "bit-identical for 8 steps while its gradients are not zero (a DPO reference that is the policy)")
    patches = {"cross_entropy": "torch.nn.functional.cross_entropy",
               # shared with loss-shape-broadcast (one wrapper per function): a distance between a tensor and itself
               **{f"shape_{fn}": f"torch.nn.functional.{fn}" for fn in _DISTANCES}}

    def __init__(self, guard):
        super().__init__(guard)
        self._done = False
        # the identical-value rule: the value, since which step, how many steps had it, the last step seen
        self._same_value = None
        self._same_from = -1
        self._same = 0
        self._seen_step = -1
        self._same_done = False
        self._first_norm, self._firsts = 0.0, 0  # the largest gradient norm of the run's first steps
        # while the loss repeats: the sums of the model calls' outputs, per step ({step: [sum, ...]})
        self._outs: dict = {}
        self._weights: list = []  # (parameter, a sample of its values) at the start of a repeat

    def watches(self, module) -> bool:
        return False  # the model calls' outputs only (root calls): no layer keeps a hook for this check

    def on_backward(self, tensors, kwargs):
        step = self.g.step
        if self._done:
            self.mute("backward")  # told: no handler call after it
            return
        if step > 1 and step & (step - 1):
            # looked at on steps 0, 1, 2, 4, 8, ... all run long: an EWC anchor is taken after the first task, and a
            # power of two falls within the second task whatever its length
            return
        for t in ([tensors] if isinstance(tensors, torch.Tensor) else tensors or ()):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                leaf = _self_difference(t.grad_fn)
                if leaf is not None:
                    self._done = True
                    self._anchor("hand-written", leaf, list(leaf.shape),
                                 "a hand-written penalty computes `p - anchor` with the anchor being the parameter "
                                 "itself (the same tensor on both sides of the subtraction)")
                    return

    def on_forward(self, module, path, args, kwargs, output, is_root):
        if self._same < 2 or self._same_done or not is_root:
            return  # (every step but those of a repeating loss: one comparison)
        # (not a 0-dim loss a model returns beside its logits: Hugging Face's ModelOutput puts it first)
        floats = [t for t in iter_tensors(output) if t.is_floating_point()]
        t = next((t for t in floats if t.numel() > 1), floats[0] if floats else None)
        if t is not None:
            vals = self._outs.setdefault(self.g.step, [])
            self.g.stage(t.detach().sum(), vals.append)

    def _outputs_moved(self) -> bool:
        """Whether the model's outputs changed while the loss repeated (True when too few were read to tell)."""
        steps = [v for _, v in sorted(self._outs.items()) if v]
        return len(steps) < 2 or any(a != b for a, b in zip(steps, steps[1:]))

    def on_resolved(self):
        g = self.g
        if self._same_done or g.mid_step or not g.timeline:
            return
        entry = g.timeline[-1]
        step = entry.get("step")
        if step == self._seen_step:
            return
        self._seen_step = step
        loss, norm = entry.get("loss"), entry.get("grad_norm")
        if isinstance(norm, float) and self._firsts < FIRST and math.isfinite(norm):
            self._firsts += 1
            self._first_norm = max(self._first_norm, norm)
        if (loss != self._same_value or not isinstance(norm, float) or not norm > MIN_NORM
                or not norm > REL_NORM * self._first_norm):
            # (most steps end here: a new value; the rest of the tests runs for repeats only)
            self._same_value, self._same_from, self._same = loss, step, 1
            if self._outs:
                self._outs = {}
            return
        if (not isinstance(loss, float) or not math.isfinite(norm) or not math.isfinite(loss) or _coarse(loss)
                or any(isinstance(o, torch.optim.LBFGS) for o in g.optimizers)):  # converged: stays put on purpose
            self._same_value, self._same = None, 0
            return
        self._same += 1
        if self._same == 2:  # a repeat begins: a sample of the weights, to tell a plateau from weights that never move
            held = [p for o in g.optimizers for grp in o.param_groups for p in grp["params"]
                    if isinstance(p, torch.Tensor)][:4] or [p for _, p in g.named_parameters() if p.requires_grad][:4]
            self._weights = [(p, p.detach().reshape(-1)[:64].clone()) for p in held]
        if self._same >= IDENTICAL:
            if any(f.kind == "missing-zero-grad" for f in g.findings):
                self._same_done = True
                return  # the "non-zero gradients" are old ones piling up (no zero_grad()): that finding is the cause
            if any(f.kind == "params-not-updating" for f in g.findings):
                self._same_done = True
                return  # a learning rate of 0 (a schedule run past its end): that finding says why nothing moves
            if self._outputs_moved():
                self._same_done = True
                self._emit_same(loss)
            elif self._same >= PLATEAU:
                self._same_done = True
                self._emit_plateau(loss)
            elif len(self._outs) > 4:  # the outputs stood still: keep the first and the last steps' sums only
                keys = sorted(self._outs)
                self._outs = {keys[0]: self._outs[keys[0]], keys[-1]: self._outs[keys[-1]]}

    def _emit_same(self, loss: float) -> None:
        extra = " (log 2: a sigmoid of exactly 0, as in a DPO loss)" if abs(loss - math.log(2)) < 1e-6 else ""
        self.emit("loss-constant", "loss",
                  f"the loss has been exactly {loss!r}{extra} for {self._same} steps (since step {self._same_from}) "
                  f"while the gradients are not zero: its value does not follow what the model learns",
                  "Look for a term that compares the model with itself: a reference or target model that is the "
                  "same object as the trained one (ref = policy instead of copy.deepcopy(policy)), so their "
                  "outputs always cancel; or parameters that never change (lr=0, an optimizer over another copy "
                  "of the model).",
                  step=self._same_from, source=self.g.source(),
                  details={"loss": loss, "steps": self._same, "why": "identical loss value"})

    def _weights_moved(self) -> bool:
        with torch.no_grad():
            return not self._weights or any(not torch.equal(p.detach().reshape(-1)[:64], old)
                                            for p, old in self._weights)

    def _emit_plateau(self, loss: float) -> None:
        lead = f"the loss has been exactly {loss!r} for {self._same} steps (since step {self._same_from}), and so have"
        if not self._weights_moved():
            message = (f"{lead} the model's outputs and its weights, while the gradients are not zero: nothing "
                       f"updates the weights")
            hint = ("Make the update happen: optimizer.step() with its parentheses (`optimizer.step` only names the "
                    "method), and an update by hand that writes into the parameter (`p -= lr * p.grad` under "
                    "torch.no_grad()), not one that re-binds the loop variable (`p = p - lr * p.grad` leaves the "
                    "model as it was).")
            why = "identical loss, outputs and weights"
        else:
            message = (f"{lead} the model's outputs, while the gradients are not zero and the optimizer updates the "
                       f"weights: the forward is piecewise constant in them (spiking units, sign or rounding, trained "
                       f"through a surrogate or straight-through gradient) and no unit crosses its threshold")
            hint = ("Make units reach their threshold: scale up the last layers' initialisation or lower the firing "
                    "threshold (output neurons that never spike give all-zero counts, a uniform prediction), raise "
                    "the learning rate of the latent weights, or add a firing-rate term to the loss.")
            why = "identical loss and outputs"
        self.emit("loss-constant", "loss", message, hint, step=self._same_from, source=self.g.source(),
                  details={"loss": loss, "steps": self._same, "why": why})

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

    def _itself(self, fn: str, args: tuple, kwargs: dict) -> None:
        """A distance whose target is the input's own data (`mse_loss(pred, pred)`, `pred.detach()` as the target)."""
        if self._done:
            return
        x = args[0] if args else kwargs.get("input")
        t = args[1] if len(args) > 1 else kwargs.get("target")
        if not isinstance(x, torch.Tensor) or not isinstance(t, torch.Tensor) or not x.requires_grad or x.numel() == 0:
            return  # (two empty selections share a data pointer: a mean over nothing is NaN, nonfinite's business)
        if t is not x and (x.is_meta or x.dtype != t.dtype or x.shape != t.shape or x.stride() != t.stride()
                           or x.device != t.device or x.data_ptr() != t.data_ptr()) and not _same_selection(x, t):
            return
        self._done = True
        shape = list(x.shape)
        same = ("the same tensor" if t is x else
                "the same selection of one tensor twice (indexed alike on both sides, as in `x[mask]` and `x[mask]`)" if x.data_ptr() != t.data_ptr() else
                "a view of the same data (the input's .detach() or a copy-free view)")
        why = f"{fn}(input, target) was given {same} as input and target"
        if x.grad_fn is None:  # a leaf: a parameter pulled toward an anchor that is itself
            self._anchor(fn, x, shape, why)
            return
        self.emit("loss-constant", "loss",
                  f"{why} (shape {shape}): a tensor compared with itself is identically 0, and so is its gradient: "
                  f"this loss (or this term of a sum) teaches the model nothing",
                  f"Pass the target as the second argument: F.{fn}(pred, y) (or the loss module's loss_fn(pred, y)), "
                  f"with y the labels or values the model should predict, not its own output (in feature "
                  f"distillation, the teacher's features: F.{fn}(student_feat, teacher_feat.detach())).",
                  source=self.g.source(), details={"loss": fn, "input_shape": shape, "why": f"{fn} of a tensor and itself"})


    def _anchor(self, fn: str, x: torch.Tensor, shape: list, why: str) -> None:
        """`mse_loss(w, anchor)` with the anchor holding `w` itself: a regulariser toward reference weights (a FedProx
        proximal term, L2-SP, EWC) whose reference aliases the parameters. That term is 0; the rest of the loss trains."""
        name = self.g.param_name(x)
        self.emit("loss-constant", "loss",
                  f"{why} (shape {shape}): the parameter {name} is compared with itself, so this term is identically 0 "
                  f"and adds no gradient: a pull toward reference weights (a FedProx proximal term, L2-SP, EWC) whose "
                  f"reference is the parameter itself does nothing, and the rest of the loss trains as if it were absent",
                  "Take the reference as a copy before training changes the weights: "
                  "`ref = [p.detach().clone() for p in global_model.parameters()]` (the server's or pretrained weights, "
                  "not `list(model.parameters())`, which holds the very parameters being trained), then "
                  + (f"F.{fn}(p, r)" if fn.isidentifier() else "((p - r) ** 2).sum()")
                  + " over zip(model.parameters(), ref).",
                  source=self.g.source(),
                  details={"loss": fn, "input_shape": shape, "parameter": name, "anchor": True,
                           "why": f"{fn} of a parameter and itself"})


def _same_selection(x: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether `x` and `t` are the same tensor indexed the same way twice (`po[mask]` and `po[mask]`: two copies of
    one selection, a typo for the target's)."""
    a, b = x.grad_fn, t.grad_fn
    if a is None or b is None or type(a) is not type(b) or type(a).__name__ != "IndexBackward0":
        return False
    try:
        same_input = [n for n, _ in a.next_functions] == [n for n, _ in b.next_functions]
        ia, ib = a._saved_indices, b._saved_indices
    except Exception:  # saved tensors freed, or another torch's layout
        return False
    return same_input and len(ia) == len(ib) and all(i is j or (i is not None and j is not None and i.data_ptr() == j.data_ptr())
                                                    for i, j in zip(ia, ib))


def _self_difference(root: Any, budget: int = 512) -> Optional[torch.Tensor]:
    """The parameter of a `p - p` in the graph behind `root` (both operands of a subtraction are the same leaf: an
    EWC or FedProx anchor `{n: p for n, p in model.named_parameters()}` taken without .detach().clone())."""
    for node in walk([root], Budget(budget), prune=lambda n: type(n).__name__ == "AccumulateGrad"):
        if type(node).__name__ == "SubBackward0":
            nxt = node.next_functions
            if len(nxt) == 2 and nxt[0][0] is not None and nxt[0][0] is nxt[1][0] \
                    and type(nxt[0][0]).__name__ == "AccumulateGrad":
                return nxt[0][0].variable
    return None


add_call_handlers(LossConstant, "shape_", _DISTANCES, "_itself")
