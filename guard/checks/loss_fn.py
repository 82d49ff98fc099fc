"""Loss-function misuse: softmax before CrossEntropy, non-log-probabilities into NLL, sigmoid before BCE,
class targets outside ``[0, C)``.

Observed through reversible patches of ``torch.nn.functional.cross_entropy``,
``nll_loss`` and ``binary_cross_entropy`` (``nn.CrossEntropyLoss``,
``nn.NLLLoss`` and ``nn.BCELoss`` call these), so losses are seen whether or
not they are modules of the guarded model.

Cost model:

* ``softmax-before-cross-entropy``: a few reductions over at most `ROWS` rows of
  the input, on its device, staged as one flag (no sync); off once found.
* ``sigmoid-before-bce``: host-only, reads the input's ``grad_fn`` chain (or
  whether it is the output of an ``nn.Sigmoid`` module under ``no_grad``).
* ``target-out-of-range``: on the CPU PyTorch always raises ("Target 7 is out of
  bounds."), so guard checks nothing on the happy path and explains on the
  error path (bad values, ``C``) before the exception leaves the loss. On an
  accelerator the kernel's device-side assert kills the context
  asynchronously, so a staged flag read later would be unreadable: instead the
  (small, integer) target is copied to host memory with ``non_blocking=True``
  (no sync; the copy is ordered before the loss kernel on the stream) and
  examined on the host when the step is resolved, when an exception escapes
  (the assert surfacing), or when the loss raises.
"""
from __future__ import annotations

import re
import weakref
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Tuple

import torch
from torch import nn

from .base import Check
from ._notes import NOTE_PREFIX, add_guard_note

ROWS = 64
_VIEWS = ("Squeeze", "Unsqueeze", "View", "Reshape", "UnsafeView", "Permute", "TBackward", "Transpose",
          "Select", "Slice", "ToCopy", "Clone", "Expand", "Alias", "Index", "Clamp")
#: devices where PyTorch itself raises synchronously for bad targets: explain on the error path only
SYNC_RAISING = ("cpu",)
MAX_COPIES = 16


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def _checkable(t: Any) -> bool:
    return (type(t) in (torch.Tensor, nn.Parameter) and t.layout is torch.strided and t.device.type != "meta"
            and t.numel() > 0)


def _tol(t: torch.Tensor) -> float:
    return 2e-2 if t.dtype in (torch.float16, torch.bfloat16) else 1e-3


#: grad_fns that make (log-)probabilities: softmax, log_softmax, a division by a sum, exp, sigmoid, log, x - logsumexp
_MAKES_PROBS = re.compile(r"Softmax|Div|Exp|Sigmoid|Log|Sub|Norm")


def _one_row(shape: List[int]) -> bool:
    """Whether a cross_entropy input of `shape` ([C], [N, C] or [N, C, d1, ...]) holds a single row of classes."""
    if not shape:
        return False
    c = shape[1] if len(shape) >= 2 else shape[0]
    n = 1
    for d in shape:
        n *= d
    return c > 0 and n // c == 1


def _rows(x: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """At most `ROWS` samples of the input (every row must hold the property), and the class dim."""
    if x.dim() >= 2:
        return x.detach()[:ROWS].float(), 1
    return x.detach().float(), 0


def _bad_targets(t: torch.Tensor, n_classes: int, ignore_index: int) -> torch.Tensor:
    return ((t < 0) | (t >= n_classes)) & (t != ignore_index)


# Probabilities into CrossEntropy are a property of the code, not of a batch: look on the first
# steps and then every PROB_EVERY-th one, not on every loss call.
PROB_STEPS = 5
PROB_EVERY = 50

class LossMisuse(Check):
    name = "loss-fn"
    # Not costly: the probe samples itself (PROB_EVERY), and the copies of accelerator targets must be made
    # on every step to explain a device-side assert whenever it comes (a budget must not skip them).
    kinds = {
        "softmax-before-cross-entropy": ("warning", "CrossEntropyLoss/NLLLoss fed probabilities or double log-softmax"),
        "sigmoid-before-bce": ("info", "BCELoss after sigmoid; BCEWithLogitsLoss is the stable form"),
        "target-out-of-range": ("error", "class targets outside [0, C)"),
    }
    description = ("probabilities into CrossEntropy/NLL/CTC/KLDiv, sigmoid before BCELoss, class targets outside [0, C) "
                   "(CTC targets also: the blank)")
    patches = {"cross_entropy": "torch.nn.functional.cross_entropy",
               "nll_loss": "torch.nn.functional.nll_loss",
               "ctc_loss": "torch.nn.functional.ctc_loss",
               "binary_cross_entropy": "torch.nn.functional.binary_cross_entropy",
               "kl_div": "torch.nn.functional.kl_div",
               # shared with loss-shape-broadcast (one wrapper): logits that are a sigmoid's output already
               "shape_binary_cross_entropy_with_logits": "torch.nn.functional.binary_cross_entropy_with_logits"}

    def watches(self, module) -> bool:
        return isinstance(module, nn.Sigmoid)  # remembers sigmoid outputs for sigmoid-before-bce

    def __init__(self, guard):
        super().__init__(guard)
        kinds = guard.config.kinds
        self._want_prob = "softmax-before-cross-entropy" in kinds
        self._want_sig = "sigmoid-before-bce" in kinds
        self._want_double = self._want_prob  # a sigmoid's output given to binary_cross_entropy_with_logits
        self._want_tgt = "target-out-of-range" in kinds
        self._sig_mods: Dict[type, bool] = {}  # module type -> is nn.Sigmoid
        self._sig_out: Optional[weakref.ref] = None
        # host copies of accelerator targets of this step: (copy, C, ignore_index, fn, step, source)
        self._copies: Deque[Tuple[torch.Tensor, int, int, str, int, Optional[str]]] = deque(maxlen=MAX_COPIES)
        self._exc: Optional[BaseException] = None  # the exception being explained, if any
        self._ctc_told = False  # a CTC target finding was made (once per run)
        self._firsts: Dict[Tuple[str, type], int] = {}  # (loss function, its input's grad_fn type) -> probes made

    # ------------------------------------------------------------------ cross_entropy / nll_loss
    def on_cross_entropy(self, args, kwargs):
        self._class_loss("cross_entropy", args, kwargs)

    def on_nll_loss(self, args, kwargs):
        self._class_loss("nll_loss", args, kwargs)

    def _due(self, fn: str, x: Any) -> bool:
        """Whether a probability probe is due: on the run's first steps, every PROB_EVERY-th, and on the first
        PROB_STEPS calls of a loss function on an input made by an op not probed there before (a phase that starts
        after training: test-time pseudo-labels through `cross_entropy` at step 60)."""
        if not (self._want_prob and self.sampling):
            return False
        key = (fn, type(getattr(x, "grad_fn", None)))
        n = self._firsts.get(key, 0)
        if n < PROB_STEPS and len(self._firsts) < 256:
            self._firsts[key] = n + 1
            return True
        step = self.g.step
        return step < PROB_STEPS or step % PROB_EVERY == 0

    def _class_loss(self, fn: str, args: tuple, kwargs: dict) -> None:
        probe = self._due(fn, args[0] if args else kwargs.get("input"))
        if not probe:
            # The usual call: no probe due, and targets on the CPU (they raise by themselves): nothing to do.
            t = args[1] if len(args) > 1 else kwargs.get("target")
            if not (self._want_tgt and isinstance(t, torch.Tensor) and t.device.type not in SYNC_RAISING):
                return
        try:
            self._class_loss_checks(fn, args, kwargs, probe)
        except Exception:
            # an earlier device-side assert surfacing here (sticky CUDA error): the host copies made before
            # it are complete, so explain first; then the error takes its course
            self._scan_copies(wait=False)
            raise

    def _class_loss_checks(self, fn: str, args: tuple, kwargs: dict, probe: bool) -> None:
        x = _arg(args, kwargs, 0, "input")
        t = _arg(args, kwargs, 1, "target")
        step = self.g.step
        # Targets on the CPU raise by themselves (explained on the error path): the usual healthy call
        # on the host ends here, before any look at the tensors.
        copy = self._want_tgt and isinstance(t, torch.Tensor) and t.device.type not in SYNC_RAISING
        if not (probe or copy):
            return
        if not isinstance(x, torch.Tensor) or not _checkable(x) or not x.is_floating_point():
            return
        if copy and _checkable(t) and not t.is_floating_point():
            self._copy_targets(fn, x, t, _arg(args, kwargs, 4, "ignore_index", -100))
        if probe:
            rows, cd = _rows(x)
            info = (fn, list(x.shape), type(x.grad_fn).__name__ if x.grad_fn is not None else None,
                    self.g.step, self.g.source())
            if fn == "cross_entropy":
                # code 1: rows that are probabilities, non-negative and summing to 1 (NaN compares False: no
                # alarm); code 3: rows that are log-probabilities, all <= 0 with logsumexp 0 over the classes
                # (a log_softmax before the loss; rows masked whole or overflowed are left out of it)
                dev = (rows.sum(dim=cd) - 1).abs().amax()
                probs = (rows.amin() >= 0) & (dev <= _tol(x))
                code = probs.float()
                if rows.shape[cd] >= 2:
                    lse = torch.logsumexp(rows, dim=cd)
                    fin = torch.isfinite(lse)
                    logp = (fin.sum() > 0) & (torch.where(fin, lse.abs(), 0.0).amax() <= _tol(x)) & (rows.amax() <= _tol(x))
                    code = code + 3.0 * (logp & ~probs).float()
                self.g.stage(code, lambda v, info=info: v and self._report_prob(*info, code=v))
            else:
                # log-probabilities have logsumexp 0 over the classes; code 0 fine, 1 probabilities, 2 scores.
                # Rows whose logsumexp is NaN/Inf (an overflowed log-softmax: all -inf) say nothing of the kind:
                # the NaN checks report them. (-inf entries of masked rows leave a finite logsumexp.)
                lse = torch.logsumexp(rows, dim=cd)
                fin = torch.isfinite(lse)
                bad = torch.where(fin, lse.abs(), 0.0).amax() > _tol(x)
                # Rows with no positive entry are reweighted log-probabilities (focal loss:
                # nll_loss((1 - p) ** gamma * log_p, y), which only gathers and negates), not scores.
                bad = bad & (torch.where(fin, rows.amax(dim=cd), float("-inf")).amax() > _tol(x))
                probs = (rows.amin() >= 0) & (rows.amax() <= 1)
                code = bad.float() * (2.0 - probs.float())
                self.g.stage(code, lambda v, info=info: v and self._report_prob(*info, code=v))

    # ------------------------------------------------------------------ kl_div
    def on_kl_div(self, args, kwargs):
        """``kl_div(input, target)`` takes log-probabilities as its input (the target is in log space only with
        ``log_target=True``): an input that is non-negative with values above 0 (a softmax's output) is none."""
        x = _arg(args, kwargs, 0, "input")
        if not self._due("kl_div", x):
            return
        step = self.g.step
        if not isinstance(x, torch.Tensor) or not _checkable(x) or not x.is_floating_point() or x.dim() < 1:
            return
        d = x.detach()
        code = ((d.amin() >= 0) & (d.amax() > _tol(x))).float()
        info = ("kl_div", list(x.shape), type(x.grad_fn).__name__ if x.grad_fn is not None else None,
                step, self.g.source())
        self.g.stage(code, lambda v, info=info: v and self._report_prob(*info, code=v))

    # ------------------------------------------------------------------ ctc_loss
    def on_ctc_loss(self, args, kwargs):
        lp = _arg(args, kwargs, 0, "log_probs")
        if not isinstance(lp, torch.Tensor) or not _checkable(lp) or not lp.is_floating_point() or lp.dim() < 2:
            return
        c = lp.shape[-1]
        t = _arg(args, kwargs, 1, "targets")
        # On the CPU ctc_loss does not check its targets (it reads past the class dimension): they are looked at
        # before the call, on the host (no sync: CPU tensors), until a finding is made.
        if self._want_tgt and not self._ctc_told and isinstance(t, torch.Tensor) and _checkable(t) \
                and not t.is_floating_point() and t.device.type == "cpu":
            self._ctc_targets(t, _arg(args, kwargs, 3, "target_lengths"), c,
                              int(_arg(args, kwargs, 4, "blank", 0)))
        step = self.g.step
        if self._due("ctc_loss", lp):
            rows = lp.detach().reshape(-1, c)[:ROWS].float()
            lse = torch.logsumexp(rows, dim=1)
            # (rows of zeros: frames past an utterance's input length, padded after log_softmax, which ctc_loss never
            # reads; no row of log-probabilities or probabilities over C >= 2 classes is all 0)
            fin = torch.isfinite(lse) & (rows != 0).any(1)
            bad = torch.where(fin, lse.abs(), 0.0).amax() > _tol(lp)
            probs = (rows.amin() >= 0) & (rows.amax() <= 1)
            code = bad.float() * (2.0 - probs.float())
            info = ("ctc_loss", list(lp.shape), type(lp.grad_fn).__name__ if lp.grad_fn is not None else None,
                    step, self.g.source())
            self.g.stage(code, lambda v, info=info: v and self._report_prob(*info, code=v))

    def _ctc_targets(self, t: torch.Tensor, lengths: Any, c: int, blank: int) -> None:
        """CTC targets outside [0, C), or equal to the blank (a real label encoded as "no output")."""
        vals = t.detach()
        if vals.dim() == 2:  # padded [N, S]: only the first target_lengths[n] entries of row n count
            tl = torch.as_tensor(lengths) if isinstance(lengths, (list, tuple)) else lengths
            if not isinstance(tl, torch.Tensor) or tl.device.type != "cpu" or tl.numel() != vals.shape[0]:
                return
            vals = vals[torch.arange(vals.shape[1]) < tl.reshape(-1, 1)]
        vals = vals.reshape(-1)
        out = (vals < 0) | (vals >= c)
        blanks = vals == blank
        if not bool(out.any()) and not bool(blanks.any()):
            return
        self._ctc_told = True
        bad = out if bool(out.any()) else blanks
        values = torch.unique(vals[bad])
        shown = [int(v) for v in values[:10]]
        count = int(bad.sum())
        if bool(out.any()):
            message = (f"ctc_loss() got targets outside [0, {c}): {shown}" + (" ..." if values.numel() > 10 else "")
                       + f" ({count} of {vals.numel()} target labels; log_probs has C={c} classes, blank={blank}); "
                       f"on the CPU ctc_loss does not check them: it reads past the class dimension, so the loss "
                       f"is wrong and soon NaN (or memory is corrupted)")
            hint = (f"The output layer needs one unit per label plus the blank: C = len(vocabulary) + 1 (here labels "
                    f"reach {int(values.max())}, so C must be at least {int(values.max()) + 1}); with blank=0, "
                    f"encode labels as 1..C-1.")
        else:
            message = (f"ctc_loss() got targets equal to the blank index {blank} ({count} of {vals.numel()} target "
                       f"labels): CTC reads the blank as \"no label\", so that symbol is never learned (and targets "
                       f"holding it have no valid alignment)")
            hint = (f"Keep the blank out of the vocabulary: encode labels as 1..C-1 with blank=0 (0-based labels: "
                    f"y + 1, and C = len(vocabulary) + 1), or pass blank=C-1 with labels 0..C-2.")
        self.emit("target-out-of-range", "loss", message, hint, step=self.g.step, source=self.g.source(),
                  details={"loss": "ctc_loss", "classes": c, "blank": blank, "bad_values": shown,
                           "bad_count": count, **({"blank_targets": True} if not bool(out.any()) else {})})

    def _report_prob(self, fn, shape, grad_fn, step, source, code: float) -> None:
        if fn == "cross_entropy" and _one_row(shape) and grad_fn is not None and not _MAKES_PROBS.search(grad_fn):
            # One row that sums to 1 (or has logsumexp 0) by chance, straight from a Linear (microbatches of one
            # in DP-SGD): too little to tell; a softmax's output is told from its next batches or its own grad_fn.
            return
        self._want_prob = False  # reported once; no more per-call work
        if fn == "ctc_loss":
            probs = code == 1.0
            what = "probabilities (softmax without log)" if probs else "values that are not log-probabilities"
            self.emit("softmax-before-cross-entropy", "loss",
                      f"ctc_loss() (CTCLoss) got {what} over the classes: the rows of its last dimension do not "
                      f"have logsumexp 0 (input {shape}" + (f", made by {grad_fn}" if grad_fn else "") + "), so "
                      f"the loss is meaningless",
                      "CTCLoss expects log-probabilities over the classes, the last dimension of [T, N, C]: "
                      "log_probs = logits.log_softmax(-1) (not softmax, and not log_softmax over the time or batch "
                      "dimension).",
                      step=step, source=source, details={"loss": fn, "input_shape": shape, "grad_fn": grad_fn,
                                                         "looks_like": "probabilities" if probs else "scores"})
            return
        if fn == "kl_div":
            self.emit("softmax-before-cross-entropy", "loss",
                      f"kl_div() (KLDivLoss) got an input that is not log-probabilities: non-negative, with values "
                      f"above 0 (input {shape}" + (f", made by {grad_fn}" if grad_fn else "") + "), probabilities "
                      f"(a softmax without log), so the loss is not the KL divergence and its gradients are wrong",
                      "KLDivLoss expects log-probabilities as its input: kl(student_logits.log_softmax(1), "
                      "teacher_probs) (the target stays probabilities; pass log_target=True to give it as "
                      "log-probabilities too).",
                      step=step, source=source, details={"loss": fn, "input_shape": shape, "grad_fn": grad_fn,
                                                         "looks_like": "probabilities"})
            return
        if fn == "cross_entropy" and code == 3.0:
            self.emit("softmax-before-cross-entropy", "loss",
                      f"cross_entropy() (CrossEntropyLoss) got rows that are already log-probabilities (each row's "
                      f"logsumexp is 0; input {shape}" + (f", made by {grad_fn}" if grad_fn else "") + "): "
                      "log_softmax is applied twice. The loss and gradients equal those of the logits (log_softmax "
                      "of log-probabilities changes nothing), but the model does not return the logits the loss "
                      "expects",
                      "Use one of the two pairs: return logits and keep CrossEntropyLoss (it applies log_softmax "
                      "itself), or keep the final log_softmax and use NLLLoss (nn.NLLLoss / F.nll_loss), which "
                      "expects log-probabilities.",
                      step=step, source=source, details={"loss": fn, "input_shape": shape, "grad_fn": grad_fn,
                                                         "looks_like": "log-probabilities"})
            return
        if fn == "cross_entropy":
            self.emit("softmax-before-cross-entropy", "loss",
                      f"cross_entropy() (CrossEntropyLoss) got rows that are already probabilities (non-negative, "
                      f"each summing to 1; input {shape}" + (f", made by {grad_fn}" if grad_fn else "") + "): "
                      "softmax was applied twice, which flattens the loss and makes gradients vanish",
                      "CrossEntropyLoss takes raw logits (it applies log_softmax itself): remove the softmax "
                      "before the loss and apply it only to get predictions.",
                      step=step, source=source, details={"loss": fn, "input_shape": shape, "grad_fn": grad_fn,
                                                         "looks_like": "probabilities"})
            return
        probs = code == 1.0
        what = "probabilities (softmax without log)" if probs else "raw scores, not log-probabilities"
        self.emit("softmax-before-cross-entropy", "loss",
                  f"nll_loss() (NLLLoss) got {what}: its rows do not have logsumexp 0 over the classes "
                  f"(input {shape}" + (f", made by {grad_fn}" if grad_fn else "") + "), so the loss is meaningless",
                  "NLLLoss expects log-probabilities: apply `log_softmax(dim=1)` (not softmax) before it, or feed "
                  "raw logits to CrossEntropyLoss, which does both in one stable step.",
                  step=step, source=source, details={"loss": fn, "input_shape": shape, "grad_fn": grad_fn,
                                                     "looks_like": "probabilities" if probs else "scores"})

    # ------------------------------------------------------------------ target-out-of-range
    def _n_classes(self, x: torch.Tensor) -> int:
        return x.shape[1] if x.dim() >= 2 else x.shape[0]

    def _copy_targets(self, fn: str, x: torch.Tensor, t: torch.Tensor, ignore_index: int) -> None:
        cp = t.detach().to("cpu", non_blocking=True)
        self._copies.append((cp, self._n_classes(x), int(ignore_index), fn, self.g.step, self.g.source()))

    def _scan_copies(self, wait: bool) -> None:
        copies = list(self._copies)
        self._copies.clear()
        if not copies:
            return
        if wait:
            _synchronize()
        for cp, c, ii, fn, step, source in copies:
            if self._explain_targets(fn, cp, c, ii, step, source):
                return

    def _explain_targets(self, fn: str, t: torch.Tensor, c: int, ii: int, step: int, source: Optional[str]) -> bool:
        """Host-side: report the bad values of CPU tensor `t` (a sync is fine here: we are on the error path)."""
        bad = _bad_targets(t, c, ii)
        if not bool(bad.any()):
            return False
        values = torch.unique(t[bad])
        shown = [int(v) for v in values[:10]]
        count = int(bad.sum())
        message = (f"{fn}() got class targets outside [0, {c}): {shown}" + (" ..." if values.numel() > 10 else "")
                   + f" ({count} of {t.numel()} targets; the input has C={c} classes"
                   + (f", ignore_index={ii}" if ii != -100 else "") + ")")
        # 255 is the usual "void" label of segmentation masks (VOC, Cityscapes): its ignore_index is 255, not -100
        void = 255 in shown and ii != 255
        hint = (f"Targets must be class indices in [0, {c - 1}]: check the label encoding (1-based labels need "
                f"`y - 1`), the model's number of outputs (C={c}), or mark padding with ignore_index "
                f"(default -100)." + (" The value 255 is the void label of segmentation masks: pass "
                                      "ignore_index=255 to the loss (nn.CrossEntropyLoss(ignore_index=255))."
                                      if void else ""))
        exc, self._exc = self._exc, None
        if exc is not None:  # the opaque error gets the explanation as a note on its traceback
            add_guard_note(exc, f"{NOTE_PREFIX}target-out-of-range at loss (step {step}): {message}\n  fix: {hint}")
        self.emit("target-out-of-range", "loss", message, hint, step=step, source=source,
                  details={"loss": fn, "classes": c, "bad_values": shown, "bad_count": count, "ignore_index": ii})
        return True

    def on_cross_entropy_error(self, args, kwargs, exc):
        self._class_loss_error("cross_entropy", args, kwargs, exc)

    def on_nll_loss_error(self, args, kwargs, exc):
        self._class_loss_error("nll_loss", args, kwargs, exc)

    def _class_loss_error(self, fn: str, args: tuple, kwargs: dict, exc: BaseException) -> None:
        if not self._want_tgt:
            return
        self._exc = exc
        try:
            x = _arg(args, kwargs, 0, "input")
            t = _arg(args, kwargs, 1, "target")
            if self._copies:
                self._scan_copies(wait=True)
                return
            if not (isinstance(x, torch.Tensor) and isinstance(t, torch.Tensor) and _checkable(t) and x.dim() >= 1
                    and not t.is_floating_point() and t.device.type in SYNC_RAISING):
                return
            self._explain_targets(fn, t.detach(), self._n_classes(x),
                                  int(_arg(args, kwargs, 4, "ignore_index", -100)), self.g.step, self.g.source())
        finally:
            self._exc = None  # never keep the exception (and its frames) alive

    def on_step_pre(self, optimizer):
        if self._copies and self.g.is_primary(optimizer):
            self._scan_copies(wait=True)  # once per step; the guard syncs right after to read staged flags

    def on_resolved(self):
        if self._copies:
            self._scan_copies(wait=True)

    def on_exception(self, exc):
        self._exc = exc
        try:
            self._scan_copies(wait=True)  # a device-side assert surfacing: the host copies were made before it
        finally:
            self._exc = None

    def on_exit(self):
        self._scan_copies(wait=True)

    # ------------------------------------------------------------------ BCE after sigmoid
    def on_forward(self, module, path, args, kwargs, output, is_root):
        if not (self._want_sig or self._want_double):
            return
        is_sig = self._sig_mods.get(type(module))
        if is_sig is None:
            is_sig = self._sig_mods[type(module)] = issubclass(type(module), nn.Sigmoid)
        if is_sig and isinstance(output, torch.Tensor):
            self._sig_out = weakref.ref(output)

    def _sigmoid_of(self, x: Any) -> Optional[str]:
        """How `x` came out of a sigmoid (torch.sigmoid in its graph, or the last nn.Sigmoid's output), or None."""
        if not isinstance(x, torch.Tensor):
            return None
        via = _sigmoid_in_graph(x)
        if via is None and self._sig_out is not None and self._sig_out() is x:
            via = "an nn.Sigmoid module"
        return via

    def on_binary_cross_entropy(self, args, kwargs):
        if not self._want_sig:
            return
        via = self._sigmoid_of(_arg(args, kwargs, 0, "input"))
        if via is None:
            return
        self.emit("sigmoid-before-bce", "loss",
                  f"binary_cross_entropy() (BCELoss) is fed the output of a sigmoid ({via}): log(sigmoid(x)) in "
                  f"two steps loses precision and saturates for large logits (BCELoss clamps log to -100)",
                  "Drop the sigmoid and use `nn.BCEWithLogitsLoss` (F.binary_cross_entropy_with_logits) on the "
                  "logits: it is numerically stable; apply torch.sigmoid only to get probabilities.",
                  source=self.g.source(), details={"loss": "binary_cross_entropy", "via": via})
        self._want_sig = False  # reported once; no more per-call work

    def on_shape_binary_cross_entropy_with_logits(self, args, kwargs):
        """binary_cross_entropy_with_logits fed probabilities: the sigmoid applied twice."""
        if not self._want_double:
            return
        via = self._sigmoid_of(_arg(args, kwargs, 0, "input"))
        if via is None:
            return
        self._want_double = False  # reported once; no more per-call work
        self.emit("softmax-before-cross-entropy", "loss",
                  f"binary_cross_entropy_with_logits() (BCEWithLogitsLoss) is fed the output of a sigmoid ({via}): it "
                  f"applies its own sigmoid, so the model's probabilities in (0, 1) become (0.5, 0.73): the loss can "
                  f"never reach 0, negatives are never predicted below 0.5, and the gradients are squashed",
                  "Remove the final sigmoid (nn.Sigmoid / torch.sigmoid) from the model and give the logits to "
                  "BCEWithLogitsLoss; apply torch.sigmoid only to get probabilities for metrics. (Or keep the sigmoid and "
                  "use nn.BCELoss.)",
                  source=self.g.source(), details={"loss": "binary_cross_entropy_with_logits", "via": via,
                                                   "double_sigmoid": True})


def _sigmoid_in_graph(x: torch.Tensor) -> Optional[str]:
    fn = x.grad_fn
    for _ in range(6):
        if fn is None:
            return None
        name = type(fn).__name__
        if name.startswith("SigmoidBackward"):
            return "torch.sigmoid / nn.Sigmoid in the autograd graph"
        if not name.startswith(_VIEWS):
            return None
        nxt = [f for f, _ in fn.next_functions if f is not None]
        fn = nxt[0] if len(nxt) == 1 else None
    return None


def _synchronize() -> None:
    """Wait for pending device work so non-blocking host copies are complete (errors: they already are)."""
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    except Exception:
        pass  # a device-side assert surfaces here; copies enqueued before it are complete
    try:
        acc = getattr(torch, "accelerator", None)
        if acc is not None and acc.is_available() and acc.current_accelerator().type != "cuda":
            acc.synchronize()
    except Exception:
        pass
