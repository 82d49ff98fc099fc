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

Hand-written losses (``((pred - y) ** 2).mean()``, ``(w * per_sample).mean()``) broadcast the same way
with no warning at all. They are found in the loss's autograd graph at ``backward()``: from the loss,
through the elementwise arithmetic and reductions a loss is written with, to a ``-``, ``+``, ``*``,
``/``, ``**`` (a tensor exponent) or ``torch.where`` whose one operand that carries gradient was widened along a
new dimension of its own batch size
(``[N, 1]`` against ``[N]`` gives ``[N, N]``; ``[N]`` against ``[N, 1]`` the same), a ``-``/``+`` only below a square,
an absolute value or a log-cosh (a fit; a difference fed to softplus or a hinge is a ranking term). Left alone: both
operands with gradient (pairwise terms between predictions, residual streams), an operand made
``[N, 1]`` on purpose (``unsqueeze``, ``[:, None]``, ``view(-1, 1)`` of a 1-d tensor, ``expand``,
a transpose), a known other operand that already has the full shape, and everything inside the
model (the walk stops at the first other operation). Looked at on the backward calls of steps 0, 1
and every power of two (a loss term switched on later is seen within twice its start step), and at the
first backward of a loss whose last operation is of a kind not seen before (a probe trained after the
model, under one global guard, is looked at on its first step).

Cost: a shape comparison on the host per loss call; a walk of up to 512 graph nodes per backward on the
looked-at steps; no device work.
"""
from __future__ import annotations

import linecache
import os
import re
from typing import Any, Dict, List, Optional, Tuple

import torch

from .base import Check, add_call_handlers

_FNS = ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
        "binary_cross_entropy_with_logits", "gaussian_nll_loss", "poisson_nll_loss")
_SILENT = ("gaussian_nll_loss", "poisson_nll_loss")  # broadcast without even PyTorch's warning
_LABEL_LOOKS = 3  # calls of one (loss, shapes) whose target values are looked at

# What a hand-written loss is made of, between the scalar and the op that pairs prediction and target.
_ARITH = frozenset((
    "MeanBackward0", "MeanBackward1", "SumBackward0", "SumBackward1", "NansumBackward0", "NanmeanBackward0",
    "PowBackward0", "PowBackward1", "PowBackward2", "MulBackward0", "MulBackward1", "DivBackward0",
    "DivBackward1", "DivBackward2", "AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1",
    "RsubBackward0", "RsubBackward1", "AbsBackward0", "SqrtBackward0", "NegBackward0", "ClampMinBackward0",
    "ClampMinBackward1", "ClampMaxBackward0", "ClampBackward0", "ClampBackward1", "MaximumBackward0",
    "MinimumBackward0", "WhereBackward0", "LogBackward0", "Log1PBackward0", "SoftplusBackward0",
    "ReluBackward0", "CoshBackward0", "LogSigmoidBackward0", "SigmoidBackward0"))  # not exp: a kernel exp(-(x - c) ** 2) over bins or centers is pairwise on purpose
_PAIRS = {"SubBackward0": "-", "RsubBackward0": "-", "AddBackward0": "+", "MulBackward0": "*",
          "DivBackward0": "/", "PowBackward1": "**", "WhereBackward0": "where"}
# ops judged wherever they lie (not only below a fit), and the saved tensor that holds their other operand's shape
# for the operand with gradient at position 0 / 1 (where's one is its condition)
_OTHER = {"*": ("_saved_other", "_saved_self"), "/": ("_saved_other", "_saved_self"),
          "**": ("_saved_exponent", "_saved_self"), "where": ("_saved_condition", "_saved_condition")}
# What makes a difference a fit of prediction to target (a square, an absolute value, log-cosh): a `-` or `+` is
# judged only below one of these. A difference fed to softplus, a sigmoid or a hinge alone is a ranking term,
# pairwise by design (an AUC surrogate against a queue of scores, RankNet).
_FITS = frozenset(("PowBackward0", "PowBackward1", "AbsBackward0", "SqrtBackward0", "CoshBackward0"))
# An operand shaped for broadcasting on purpose: pairwise terms, not a shape accident.
_SHAPED = frozenset(("UnsqueezeBackward0", "UnsqueezeBackward1", "ExpandBackward0", "PermuteBackward0",
                     "TBackward0", "TransposeBackward0", "TransposeBackward1"))
_VIEWS = frozenset(("ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0"))
_WALK = 512  # graph nodes looked at per backward at most (a per-image loop of detection losses adds dozens per image)


_BACKWARD = re.compile(r"(\w+)\s*\.\s*backward\s*\(|backward\s*\(\s*(\w+)")
_DEF = re.compile(r"^\s*(async\s+)?def\s")


def _text_of(source: Optional[str]) -> str:
    """The text of a ``file:line`` source ("" when unknown)."""
    path, _, no = (source or "").rpartition(":")
    return linecache.getline(os.path.abspath(path), int(no)) if path and no.isdigit() else ""


def loss_line(source: Optional[str]) -> Optional[str]:
    """``file:line`` assigning the tensor that a ``backward()`` line (`source`) is called on: the loss line
    (``loss = ...`` above ``loss.backward()`` in the same function) when only one line there assigns it (two,
    in the branches of an ``if``, cannot be told apart from the text), else None."""
    if not source:
        return None
    path, _, no = source.rpartition(":")
    try:
        n = int(no)
    except ValueError:
        return None
    full = os.path.abspath(path)
    m = _BACKWARD.search(linecache.getline(full, n))
    if not m:
        return None
    assign = re.compile(rf"^\s*{re.escape(m.group(1) or m.group(2))}\s*(=(?!=)|\+=)")
    found = []
    for k in range(n, max(0, n - 60), -1):
        line = linecache.getline(full, k)
        if assign.match(line):
            found.append(k)
        if k < n and _DEF.match(line):
            break
    return f"{path}:{found[0]}" if len(found) == 1 else None


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _widened(shape: List[int], out: List[int]) -> Optional[int]:
    """The size n when `shape`, broadcast to `out`, gained a dimension of size n that it already has elsewhere
    (``[N, 1]`` or ``[N]`` turned into ``[N, N]``); None otherwise."""
    if len(out) < 2 or _numel(shape) >= _numel(out):
        return None
    pad = [1] * (len(out) - len(shape)) + list(shape)
    for i, (s, o) in enumerate(zip(pad, out)):
        if s == 1 and o > 1 and any(d == o for j, d in enumerate(pad) if j != i):
            return o
    return None


def _made_on_purpose(fn: Any) -> bool:
    name = type(fn).__name__
    if name in _SHAPED:
        return True
    if name in _VIEWS:
        try:
            before = [int(d) for d in fn._saved_self_sym_sizes]
            after = [int(d) for d in fn._input_metadata[0].shape]
        except (AttributeError, RuntimeError, IndexError):
            return False
        # view(-1, 1) of a 1-d tensor: a dimension added for broadcasting
        return len(after) > len(before) and [d for d in after if d != 1] == [d for d in before if d != 1]
    return False


def _saved_shape(node: Any, attr: str) -> Optional[List[int]]:
    try:
        t = getattr(node, attr)
    except (AttributeError, RuntimeError):
        return None
    return list(t.shape) if isinstance(t, torch.Tensor) else None


def _extra_one(a: Optional[List[int]], b: Optional[List[int]]) -> Optional[int]:
    """The dimension (-1 for the last) of size 1 that `a` has beyond `b`: removing it gives `b` ([8, 1, 32, 32] against
    [8, 32, 32]: 1); None when there is no such dimension."""
    if a is None or b is None or len(a) != len(b) + 1:
        return None
    for i, n in enumerate(a):
        if n == 1 and list(a[:i]) + list(a[i + 1:]) == list(b):
            return -1 if i == len(a) - 1 else i
    return None


def crossed_pairs(loss: torch.Tensor) -> List[Dict[str, Any]]:
    """The broadcast accidents in a hand-written loss's graph (see the module's docstring)."""
    found: List[Dict[str, Any]] = []
    start = loss.grad_fn
    if start is None:
        return found
    todo, seen = [(start, False)], {id(start)}
    while todo and len(seen) <= _WALK:
        node, fitted = todo.pop()  # fitted: a square, an absolute value, ... lies between the loss and `node`
        name = type(node).__name__
        if name not in _ARITH:
            continue
        nexts = node.next_functions
        op = _PAIRS.get(name)
        if op is not None and len(nexts) == 2:
            hit = _kept_dim(node, op, nexts) or (_both_widened(node, op, nexts) if op in ("-", "+", "*", "/") else None)
            if hit is not None:
                found.append(hit)
                continue
        if op is not None and len(nexts) == 2 and (fitted or op in _OTHER):
            hit = _judge(node, op, nexts)
            if hit is not None:
                found.append(hit)
                continue
        fitted = fitted or name in _FITS or (name == "MulBackward0" and len(nexts) == 2
                                             and nexts[0][0] is not None and nexts[0][0] is nexts[1][0]) \
            or (name in ("MaximumBackward0", "MinimumBackward0") and _pinball(nexts))
        for fn, _ in nexts:
            if fn is not None and id(fn) not in seen:
                seen.add(id(fn))
                todo.append((fn, fitted))
    return found


#: reductions whose keepdim=True result is [N, 1]: against a [N] vector of the same samples it broadcasts to [N, N]
_KEEPDIM = frozenset(("MaxBackward0", "MinBackward0", "AmaxBackward0", "AminBackward0", "MeanBackward1",
                      "SumBackward1", "LogsumexpBackward0", "NormBackward1"))


def _kept_dim(node: Any, op: str, nexts: Any) -> Optional[Dict[str, Any]]:
    """``d_ap - d_an + m`` with ``d_an = dist.max(1, keepdim=True)`` ([N, 1]) and ``d_ap`` of shape [N]: both carry
    gradient, and the result is [N, N], each anchor's term paired with every other sample's (batch-hard triplet
    mining). A reduction kept 2-d against a 1-d vector of the same size is no pairwise term written on purpose."""
    try:
        out = [int(d) for d in node._input_metadata[0].shape]
        if len(out) != 2 or out[0] != out[1] or out[0] < 2:
            return None
        shapes = []
        for fn, idx in nexts:
            if fn is None:
                return None
            shapes.append((type(fn).__name__, [int(d) for d in fn._input_metadata[idx].shape]))
    except (AttributeError, RuntimeError, IndexError):
        return None
    n = out[0]
    for k, ((_, kshape), (_, vshape)) in enumerate(((shapes[0], shapes[1]), (shapes[1], shapes[0]))):
        if kshape == [n, 1] and vshape == [n]:
            how = _kept_how(*nexts[k], kshape)
            if how == "keepdim" and op in ("-", "+"):
                return {"op": op, "grad_shape": vshape, "other_shape": kshape, "broadcast_shape": out, "keepdim": True}
            if how == "column":
                return {"op": op, "grad_shape": vshape, "other_shape": kshape, "broadcast_shape": out, "column": True}
    return None


def _both_widened(node: Any, op: str, nexts: Any) -> Optional[Dict[str, Any]]:
    """``s_pos - s_neg`` with both scores from the model, ``s_pos`` [N, 1] as its Linear left it and ``s_neg`` [N]
    (squeezed): the result is [N, N], every positive against every negative (BPR over in-batch pairs by accident).
    Pairs meant as such are written with the [N, 1] made on purpose (``s[:, None]``, ``unsqueeze``, ``view(-1, 1)``)."""
    try:
        out = [int(d) for d in node._input_metadata[0].shape]
        if len(out) != 2 or out[0] != out[1] or out[0] < 2 or any(fn is None for fn, _ in nexts):
            return None
        shapes = [[int(d) for d in fn._input_metadata[idx].shape] for fn, idx in nexts]
    except (AttributeError, RuntimeError, IndexError):
        return None
    n = out[0]
    for k in (0, 1):
        if shapes[k] == [n, 1] and shapes[1 - k] == [n] and not _made_on_purpose(nexts[k][0]):
            return {"op": op, "grad_shape": shapes[1 - k], "other_shape": shapes[k], "broadcast_shape": out,
                    "both": True}
    return None


def _kept_how(fn: Any, idx: int, shape: List[int]) -> Optional[str]:
    """How an [N, 1] operand came to keep its second dimension, through ops that keep its shape (exp, a scale, a
    negation): "keepdim" (a reduction with keepdim=True), "column" (a column sliced as `out[:, 1:]` from an [N, k]
    output, k >= 2, beside `out[:, 0]`: a Gaussian NLL's log-variance against its mean), or None."""
    for _ in range(8):
        name = type(fn).__name__
        if name in _KEEPDIM:
            return "keepdim"
        if name == "SliceBackward0":
            try:
                dim, sizes = int(fn._saved_dim), [int(d) for d in fn._saved_self_sym_sizes]
            except (AttributeError, RuntimeError, TypeError):
                return None
            return "column" if len(sizes) == 2 and dim in (1, -1) and sizes[1] >= 2 else None
        inner = [(f, i) for f, i in fn.next_functions if f is not None]
        if len(inner) != 1:
            return None
        fn, idx = inner[0]
        try:
            if [int(d) for d in fn._input_metadata[idx].shape] != shape:
                return None
        except (AttributeError, RuntimeError, IndexError):
            return None
    return None


def _pinball(nexts: Any) -> bool:
    """``maximum(tau * e, (tau - 1) * e)``: the pinball (quantile) loss, a fit of `e` like an absolute value."""
    firsts = []
    for fn, _ in nexts:
        if fn is None or not type(fn).__name__.startswith("MulBackward"):
            return False
        inner = [f for f, _ in fn.next_functions if f is not None]
        if len(inner) != 1:
            return False  # a product of two tensors: no multiple of one difference
        firsts.append(inner[0])
    return len(firsts) == 2 and firsts[0] is firsts[1]


def _judge(node: Any, op: str, nexts: Any) -> Optional[Dict[str, Any]]:
    with_grad = [(k, fn, idx) for k, (fn, idx) in enumerate(nexts) if fn is not None]
    if len(with_grad) != 1:
        return None  # both carry gradient (pairwise between predictions), or neither
    k, fn, idx = with_grad[0]
    if _made_on_purpose(fn):
        return None
    try:
        out = [int(d) for d in node._input_metadata[0].shape]
        shape = [int(d) for d in fn._input_metadata[idx].shape]
    except (AttributeError, RuntimeError, IndexError):
        return None
    n = _widened(shape, out)
    if n is None:
        return None
    other = None
    if op in _OTHER:
        other = _saved_shape(node, _OTHER[op][k])
        if other is not None and _numel(other) >= _numel(out):
            return None  # the other operand (where's condition) has the full shape already: a deliberate [N, N] term
    return {"op": op, "grad_shape": shape, "other_shape": other, "broadcast_shape": out}


def _broadcast(a: torch.Size, b: torch.Size) -> Optional[List[int]]:
    try:
        return list(torch.broadcast_shapes(a, b))
    except RuntimeError:
        return None


class LossShapeBroadcast(Check):
    name = "loss-shape-broadcast"
    kinds = {"loss-shape-broadcast": ("error", "a regression/BCE loss gets input and target shapes that broadcast")}
    description = ("mse/l1/smooth_l1/huber/BCE/Gaussian and Poisson NLL with input and target shapes that broadcast "
                   "([N, 1] vs [N] gives [N, N]), and the same in hand-written losses (`((pred - y) ** 2).mean()`)")
    patches = {f"shape_{fn}": f"torch.nn.functional.{fn}" for fn in _FNS}

    def __init__(self, guard):
        super().__init__(guard)
        self._looked: Dict[Tuple[str, Tuple[int, ...], Tuple[int, ...]], int] = {}
        # (input shape, broadcast shape) reported from a loss function's call: its own arithmetic (gaussian_nll_loss
        # is written in Python) is the same broadcast, not a second one
        self._called: set = set()
        self._roots: set = set()  # the types of the losses' last operations looked at (a new loss is looked at at once)

    def on_backward(self, tensors, kwargs):
        step = self.g.step
        if step > 1 and step & (step - 1):  # graphs are looked at on steps 0, 1, 2, 4, 8, ...
            root = type(getattr(tensors, "grad_fn", None))
            if root in self._roots or len(self._roots) > 64:
                return
            self._roots.add(root)  # ... and when a loss of another kind appears
        for t in ([tensors] if isinstance(tensors, torch.Tensor) else tensors or ()):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                self._roots.add(type(t.grad_fn))
                if t.numel() == 1:
                    for hit in crossed_pairs(t):
                        self._emit_written(hit)

    def _emit_written(self, hit: Dict[str, Any]) -> None:
        op, shape, other, out = hit["op"], hit["grad_shape"], hit["other_shape"], hit["broadcast_shape"]
        if (tuple(shape), tuple(out)) in self._called:
            return
        if hit.get("keepdim"):
            what = (f"a hand-written loss computes `a {op} b` with b of shape {other} from a reduction kept 2-d "
                    f"(keepdim=True: the hardest negative's distance, a row's max) and a of shape {shape}: the result "
                    f"has shape {out}, so each sample's term is paired with every other sample's (a triplet hinge "
                    f"over all pairs of anchors), not with its own")
            fix = "reduce without keepdim (dist.max(1).values, .amax(1)) or b.squeeze(-1), so both are [N]"
        elif hit.get("both"):
            kind = ("two scores of the model, one kept [N, 1] (by the Linear that made it) and one squeezed to [N]"
                    if op in ("-", "+") else
                    "a per-sample weight or scale kept [N, 1] by the Linear head that made it, and a per-sample term")
            what = (f"a hand-written loss computes `{op}` between operands of shapes {other} and {shape}, both "
                    f"carrying gradient ({kind}), and the result has shape {out}: each sample's term is paired with "
                    f"every other sample's, not with its own")
            fix = (f"squeeze the [N, 1] one (s.squeeze(-1)) so both are [N] (or, when every pair is meant, make it "
                   f"explicit: a.view(-1)[:, None] {op} b.view(-1)[None, :])")
        elif hit.get("column"):
            what = (f"a hand-written loss computes `a {op} b` with b of shape {other}, a column sliced from the "
                    f"model's output kept 2-d (`out[:, 1:]`: a log-variance, a scale), and a of shape {shape}: the result has shape {out}, so each sample's term is paired with "
                    f"every other sample's, not with its own")
            fix = "index the column without keeping its dimension (out[:, 1], not out[:, 1:]), or b.squeeze(-1)"
        elif op in ("-", "+") and len(out) > 2 and other is None:
            # the target carries no gradient, so autograd kept nothing of its shape: with more than two dimensions
            # many shapes give this result ([4, 1, 16, 16] and [4, 1, 1, 1] against [4, 16, 16]), none is named
            what = (f"a hand-written loss computes `prediction {op} target` with a prediction of shape {shape}, and "
                    f"the result has shape {out}: the target's shape differs from the prediction's and broadcasts "
                    f"against it, so each prediction is compared with other samples' targets and the model learns "
                    f"their mean")
            fix = ("pred.view_as(y) - y (a prediction squeezed of a dimension the target keeps, `net(x).squeeze()` "
                   "against [N, 1, H, W]), or y.view_as(pred)" if len(out) > len(shape) else
                   "pred - y.view_as(pred), or pred.view_as(y) - y")
        elif op in ("-", "+"):
            pad = [1] * (len(out) - len(shape)) + shape
            target = [o if s == 1 else 1 for s, o in zip(pad, out)]
            while len(target) > 1 and target[0] == 1:
                target.pop(0)  # the smallest target that gives this result: [1, N] is written [N]
            what = (f"a hand-written loss computes `prediction {op} target` with a prediction of shape {shape}, and "
                    f"the result has shape {out}: a target of shape {target} broadcasts this way, so every "
                    f"prediction is compared with every target and the model learns their mean")
            fix = ("pred.squeeze(-1) - y, or pred - y.view_as(pred)" if shape[-1:] == [1] else
                   "pred - y.squeeze(-1), or pred.view_as(y) - y")
        elif op in ("**", "where"):
            of = f" of shape {other}" if other is not None else ""
            w = "an exponent" if op == "**" else "a condition"
            what = (f"a hand-written loss computes `{'x ** e' if op == '**' else 'torch.where(c, x, ...)'}` with x (it "
                    f"carries gradient) of shape {shape} and {w}{of}, and the result has shape {out}: each sample's "
                    f"term meets every sample's {'exponent' if op == '**' else 'condition'} (a label, a mask), not "
                    f"only its own")
            e = "e" if op == "**" else "c"
            fix = (f"{e}.view_as(x) (or {e}.squeeze(-1)) so the shapes are equal"
                   if other is not None and other[-1:] == [1] else f"give x and {e} the same shape")
        else:
            of = f" of shape {other}" if other is not None else ""
            what = (f"a hand-written loss computes `{'x * w' if op == '*' else 'x / w'}` with x (it carries gradient) "
                    f"of shape {shape} and w{of}, and the result has shape {out}: each sample's term meets every "
                    f"sample's w (a weight or a mask), not only its own")
            xi, wi = _extra_one(shape, other), _extra_one(other, shape)
            fix = (f"x.squeeze({xi}) (or w.unsqueeze({xi})) so the shapes are equal" if xi is not None else
                   f"w.squeeze({wi}) (or w.view_as(x)) so the shapes are equal" if wi is not None else
                   "w.view_as(x) (or w.squeeze(-1)) so the shapes are equal" if other is not None and other[-1:] == [1]
                   else "give both the same shape (x.squeeze(-1), or w.view_as(x))")
        message = what[0].upper() + what[1:] + "; PyTorch computes it without a warning"
        hint = f"Make the shapes equal before `{'torch.where' if op == 'where' else op}`: {fix}."
        source = self.g.source()
        line = loss_line(source) or source
        if op in ("-", "+") and not hit.get("both") and ".log_prob(" in _text_of(line):
            # the subtraction is torch.distributions' own (`(value - loc) / scale`): no `-` in the user's code
            message = (f"`log_prob(y)` of a distribution whose parameters have shape {shape} takes `value - loc` "
                       f"inside torch.distributions, and the result has shape {out}: a value y of another shape "
                       f"broadcasts against the parameters, so every prediction is scored against every target; "
                       f"PyTorch computes it without a warning")
            hint = ("Give the value the parameters' shape: dist.log_prob(y.view_as(mu)), or build the distribution "
                    "from mu.squeeze(-1) and sigma.squeeze(-1) for a [N] target.")
        self.emit("loss-shape-broadcast", "loss", message, hint, source=line,
                  details={"loss": "hand-written", "op": op, "input_shape": shape, "target_shape": other,
                           "broadcast_shape": out, **({"keepdim": True} if hit.get("keepdim") else {}),
                           **({"column": True} if hit.get("column") else {}),
                           **({"both_with_gradient": True} if hit.get("both") else {})})

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
        self._called.add((tuple(xs), tuple(out)))
        raises = fn.startswith("binary_cross_entropy")
        message = (f"{fn}() got input {xs} and target {ts}: they broadcast to {out} ({n_out:,} pairs for {n_in:,} "
                   f"predictions), so every prediction is compared with every target and the model learns the "
                   f"mean" + (" (PyTorch raises a ValueError for this loss)" if raises else
                              "; PyTorch computes it without a word" if fn in _SILENT else
                              "; PyTorch only warns and computes it"))
        hint = f"Give input and target the same shape: {fix}."
        self.emit("loss-shape-broadcast", "loss", message, hint, source=self.g.source(),
                  details={"loss": fn, "input_shape": xs, "target_shape": ts, "broadcast_shape": out})


add_call_handlers(LossShapeBroadcast, "shape_", _FNS, "_look")
