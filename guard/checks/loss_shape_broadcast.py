"""Loss shape broadcast: a regression/BCE loss given input and target of different shapes that broadcast.

``F.mse_loss(out, y)`` with ``out`` of shape ``[N, 1]`` and ``y`` of shape ``[N]``
broadcasts to ``[N, N]``: every prediction is compared with every target, the loss
is minimised by predicting the mean, and PyTorch only prints a UserWarning that is
easy to miss. Observed through declared patches of ``torch.nn.functional``'s
``mse_loss``, ``l1_loss``, ``smooth_l1_loss``, ``huber_loss``, ``binary_cross_entropy``,
``binary_cross_entropy_with_logits``, ``gaussian_nll_loss`` and ``poisson_nll_loss`` (``nn.MSELoss``,
``nn.L1Loss``, ``nn.GaussianNLLLoss``, ... call them; the last two broadcast without even a warning).

Reported when the broadcast shape differs from the input's: the input is replicated
against targets it was never meant to meet. A target that broadcasts *into* the
input's shape (a scalar or a per-feature constant target) pairs each prediction with
one target value and is left alone, unless it holds one class index per sample: an
``mse_loss(out, y.float())`` over ``[N, C]`` outputs with labels ``[N, 1]``, or ``[N]`` when
the batch size happens to equal ``C``, pulls every output toward the label's number (the
seed notes' "MSE needs one-hot"). Such a target is told by its values (whole numbers in
``[0, C)``), read with the step's one transfer, for the first few calls of each shape; an
ensemble of heads fitted to one real-valued target stays silent. Also left alone: as is a single prediction (``numel() == 1``) fitted to many
targets, and equal shapes (a deliberate
``target.expand_as(input)`` included) and the ``weight``/``pos_weight`` arguments.
(The BCE forms raise a ValueError on any size mismatch; guard names the fix first.)

Cost: a shape comparison on the host per loss call; no device work.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from .base import Check

_FNS = ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
        "binary_cross_entropy_with_logits", "gaussian_nll_loss", "poisson_nll_loss")
_SILENT = ("gaussian_nll_loss", "poisson_nll_loss")  # broadcast without even PyTorch's warning
_LABEL_LOOKS = 3  # calls of one (loss, shapes) whose target values are looked at


def _broadcast(a: torch.Size, b: torch.Size) -> Optional[List[int]]:
    try:
        return list(torch.broadcast_shapes(a, b))
    except RuntimeError:
        return None


class LossShapeBroadcast(Check):
    name = "loss-shape-broadcast"
    kinds = {"loss-shape-broadcast": ("error", "a regression/BCE loss gets input and target shapes that broadcast")}
    description = ("mse/l1/smooth_l1/huber/BCE/Gaussian and Poisson NLL with input and target shapes that broadcast "
                   "([N, 1] vs [N] gives [N, N])")
    patches = {f"shape_{fn}": f"torch.nn.functional.{fn}" for fn in _FNS}

    def __init__(self, guard):
        super().__init__(guard)
        self._looked: Dict[Tuple[str, Tuple[int, ...], Tuple[int, ...]], int] = {}

    def _look(self, fn: str, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs.get("input")
        t = args[1] if len(args) > 1 else kwargs.get("target")
        if not isinstance(x, torch.Tensor) or not isinstance(t, torch.Tensor):
            return
        xs, ts = x.shape, t.shape
        if xs == ts or x.numel() == 1:
            return  # a single prediction against many targets is an explicit fit of a constant
        out = _broadcast(xs, ts)
        if out is None:
            return  # not broadcastable: PyTorch raises itself (explain names the cause)
        if out == list(xs):
            self._per_sample_labels(fn, x, t)  # the target fits into the input's shape: fine unless labels
            return
        self._emit(fn, list(xs), list(ts), out)

    def _per_sample_labels(self, fn: str, x: torch.Tensor, t: torch.Tensor) -> None:
        """Stage a look at a target of one value per sample broadcast over `x`'s C outputs."""
        xs, ts = list(x.shape), list(t.shape)
        if fn.startswith("binary_cross_entropy") or fn in _SILENT or len(xs) != 2 or xs[1] < 2 or not t.is_floating_point():
            return
        if not (ts == [xs[0], 1] or (ts == [xs[0]] and xs[0] == xs[1])):
            return
        key = (fn, tuple(xs), tuple(ts))
        n = self._looked.get(key, 0)
        if n >= _LABEL_LOOKS or t.device.type == "meta":
            return
        self._looked[key] = n + 1
        c = xs[1]
        tt = t.detach()
        whole = ((tt == tt.round()) & (tt >= 0) & (tt < c)).all()
        source = self.g.source()

        def told(labels_like: bool) -> None:
            if labels_like:
                self._emit_labels(fn, xs, ts, c, source)
        self.g.stage(whole, told)

    def _emit_labels(self, fn: str, xs: List[int], ts: List[int], c: int, source: Optional[str]) -> None:
        how = ("one per sample, broadcast over the outputs' columns" if len(ts) == 2 else
               f"one per sample, but a 1-d target lines up with the {c} output columns, not with the samples (the batch "
               f"size equals the number of outputs here), so each row is compared with the whole batch's labels")
        message = (f"{fn}() got input {xs} and target {ts} holding class indices (whole numbers in [0, {c})), {how}: "
                   f"every output is pulled toward a label's number instead of a one-hot target; PyTorch only warns")
        hint = (f"For classification use F.cross_entropy(logits, target.long()) (it takes class indices); to keep "
                f"{fn}, give it one-hot targets: F.one_hot(target.long().view(-1), {c}).float().")
        self.emit("loss-shape-broadcast", "loss", message, hint, source=source,
                  details={"loss": fn, "input_shape": xs, "target_shape": ts, "broadcast_shape": xs,
                           "class_indices": True})

    def _emit(self, fn: str, xs: List[int], ts: List[int], out: List[int]) -> None:
        n_in = 1
        for d in xs:
            n_in *= d
        n_out = 1
        for d in out:
            n_out *= d
        if len(xs) == len(ts) + 1 and xs[-1] == 1:
            fix = "target.view_as(input) (or input.squeeze(-1))"
        elif len(ts) == len(xs) + 1 and ts[-1] == 1:
            fix = "target.squeeze(-1) (or input.view_as(target), or input.unsqueeze(-1))"
        else:
            fix = "target.view_as(input) (make the shapes equal)"
        raises = fn.startswith("binary_cross_entropy")
        message = (f"{fn}() got input {xs} and target {ts}: they broadcast to {out} ({n_out:,} pairs for {n_in:,} "
                   f"predictions), so every prediction is compared with every target and the model learns the "
                   f"mean" + (" (PyTorch raises a ValueError for this loss)" if raises else
                              "; PyTorch computes it without a word" if fn in _SILENT else
                              "; PyTorch only warns and computes it"))
        hint = f"Give input and target the same shape: {fix}."
        self.emit("loss-shape-broadcast", "loss", message, hint, source=self.g.source(),
                  details={"loss": fn, "input_shape": xs, "target_shape": ts, "broadcast_shape": out})


def _handler(fn: str):
    def on_call(self, args: tuple, kwargs: dict) -> None:
        self._look(fn, args, kwargs)
    on_call.__name__ = f"on_shape_{fn}"
    return on_call


for _fn in _FNS:
    setattr(LossShapeBroadcast, f"on_shape_{_fn}", _handler(_fn))
