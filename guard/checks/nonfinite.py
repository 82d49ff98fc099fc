"""NaN/Inf: dirty inputs, the first module that makes them, the loss, gradients and parameters.

Cost model: every screened tensor costs one ``sum`` and one ``isfinite`` on its
own device, staged without a host sync. Module inputs that are the output of
an earlier module are not screened again (identity lookup). Layers that cannot
make NaN/Inf (pass-through, and standard layers computing in fp32/fp64) are
watched on their first call only (`steady`), so they run hook-free after it.
Weights are reduced only when something went non-finite (and once at exit).
Once per step the guard reads all flags at once; only when one fired does this
check look closer (exact counts, which module, which parameters), and only then
syncs.
"""
from __future__ import annotations

import cmath
import functools
import inspect
import math
import re
import weakref
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Tuple

import torch
from torch import nn

from .. import tensors as _tensor_mod
from ..tensors import (distinct_view, finite_stats, fused_norms, iter_named_tensors, iter_tensors, nonfinite_counts,
                       screenable, stored_values)
from .._weak import WeakIdMap
from ._graphs import Budget, walk
from .base import Check, add_call_handlers

_HALF = (torch.float16, torch.bfloat16)
_WIDE_SUM = (torch.float32, torch.float64)  # 0-dim tensors of these dtypes are used as their own sum
_MAX_WINDOW = 4096  # screened tensors per resolution window
_FEW = 16  # CPU sums read one by one up to this many (more: one stack)


#: a model input whose values reach this is in raw units (incomes, prices): told with exploding gradients
INPUT_SCALE = 1e3


class _Call:
    """One module call's screened inputs and outputs, by flag index."""

    __slots__ = ("path", "type", "is_root", "inputs", "outputs", "source", "step", "module", "graded", "padded",
                 "evaluating", "masks", "made", "zeros", "half")

    def __init__(self, path: str, mtype: str, is_root: bool, source: Optional[str], step: int, module: Any,
                 inputs: List[Tuple[str, int]], outputs: List[Tuple[str, int]]):
        self.path, self.type, self.is_root, self.source, self.step = path, mtype, is_root, source, step
        self.inputs, self.outputs = inputs, outputs
        self.module = weakref.ref(module)
        self.graded = torch.is_grad_enabled()  # a training forward (not an evaluation under no_grad)
        self.evaluating = not self.graded and not module.training  # eval mode under no_grad: no loss will follow
        self.padded: Optional[int] = None  # flag of the output outside its fully masked rows (attention, see below)
        self.masks: Optional[tuple] = None  # an attention's (query, key_padding_mask, attn_mask), read if it made NaN
        self.made = False  # a root call whose first input has autograd history (made by a model: a GAN's fakes)
        self.zeros: Optional[List[str]] = None  # its number arguments equal to 0 (a temperature annealed to 0)
        self.half = False  # its output is float16 (65504 overflows)


# Modules whose output cannot become NaN/Inf from finite inputs (and parameter-free containers):
# their outputs inherit their input's flag instead of being reduced again.
_PASSTHROUGH = tuple(getattr(nn, n) for n in (
    "ReLU", "ReLU6", "LeakyReLU", "RReLU", "Tanh", "Sigmoid", "Hardtanh", "Hardsigmoid", "Hardswish",
    "SiLU", "GELU", "ELU", "CELU", "SELU", "Mish", "Softsign", "Tanhshrink", "Softshrink", "Hardshrink",
    "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "FeatureAlphaDropout", "Identity",
    "Flatten", "Unflatten", "MaxPool1d", "MaxPool2d", "MaxPool3d", "AdaptiveMaxPool1d", "AdaptiveMaxPool2d",
    "AdaptiveMaxPool3d", "Softmax", "Softmax2d", "ZeroPad2d", "ConstantPad1d", "ConstantPad2d",
    "ReflectionPad2d", "ReplicationPad2d", "ChannelShuffle", "PixelShuffle", "PixelUnshuffle", "Upsample",
    "Sequential", "ModuleList", "ModuleDict",
) if hasattr(nn, n))


# Standard layers that cannot make NaN/Inf from finite inputs and finite weights unless float32
# overflows (|values| ~ 1e38, where the weights blow up first and nonfinite-param reports them).
# In float32/float64 they inherit their input's flag too; half-precision outputs are always screened
# (65504 overflows for real under AMP). Weights are checked after every optimizer step.
_SAFE_WIDE = tuple(getattr(nn, n) for n in (
    "Linear", "Bilinear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
    "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "LayerNorm", "GroupNorm", "InstanceNorm1d",
    "InstanceNorm2d", "InstanceNorm3d", "LocalResponseNorm", "Embedding", "EmbeddingBag", "AvgPool1d", "AvgPool2d",
    "AvgPool3d", "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d",
) if hasattr(nn, n))
_WIDE = (torch.float32, torch.float64)


def _standard(cls: type, group: Tuple[type, ...]) -> bool:
    """`cls` is one of `group`'s layers, or a subclass that keeps its forward (a quantization-aware or
    weight-standardised ``nn.Linear``/``nn.Conv2d`` subclass computes something else: it is screened)."""
    return any(issubclass(cls, b) and getattr(cls, "forward", None) is getattr(b, "forward", None) for b in group)


def _scores_module(mtype: str) -> bool:
    """Whether a module of type `mtype` takes scores that a mask of -inf may fill (softmax, attention)."""
    low = mtype.lower()
    return "softmax" in low or "attention" in low or "attn" in low or "logsumexp" in low


def _tensors(obj: Any, prefix: str) -> List[Tuple[str, torch.Tensor]]:
    """Tensors in `obj` with their names; a fast path for the one-tensor case (not yet filtered)."""
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)]
    if type(obj) is tuple and len(obj) == 1 and isinstance(obj[0], torch.Tensor):
        return [(prefix + "[0]", obj[0])]
    if not obj:
        return []
    return list(iter_named_tensors(obj, prefix))


#: losses whose target is looked at when the loss is NaN/Inf from finite outputs
_TARGETED = ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
             "binary_cross_entropy_with_logits", "kl_div")


class NonFinite(Check):
    name = "nonfinite"
    # (a CTC loss of the step gives its infinite loss its own fix: an utterance with no valid alignment)
    patches = {"ctc_loss": "torch.nn.functional.ctc_loss",
               # shared with eval-without-no-grad (one wrapper): derivatives taken for the loss (forces as -dE/dpos)
               "autograd_grad": "torch.autograd.grad",
               # shared with loss-shape-broadcast (one wrapper per function): the target of a NaN loss is looked at
               **{f"shape_{fn}": f"torch.nn.functional.{fn}" for fn in _TARGETED}}
    kinds = {
        "nonfinite-input": ("error", "NaN/Inf in a tensor fed to the guarded model"),
        "nonfinite-output": ("error", "a module produced NaN/Inf from finite inputs"),
        "nonfinite-loss": ("error", "the tensor backward() was called on is NaN/Inf"),
        "nonfinite-grad": ("error", "a parameter's gradient has NaN/Inf"),
        "nonfinite-param": ("error", "a parameter became NaN/Inf after optimizer.step()"),
    }
    description = "NaN/Inf in inputs, module outputs (module of origin), loss, gradients and parameters"

    def steady(self, module, output) -> bool:
        """Layers that cannot make NaN/Inf (pass-through, and standard layers computing in fp32/fp64) are
        not screened one by one after their first call: the next screened module screens what they made."""
        cls = type(module)
        if _standard(cls, _PASSTHROUGH):
            return False
        if _standard(cls, _SAFE_WIDE):
            return any(t.dtype not in _WIDE for _, t in _tensors(output, "output"))
        return True

    def __init__(self, guard):
        super().__init__(guard)
        self._new_window()
        self._bad_param_names: set = set()
        self._screened: Deque[int] = deque(maxlen=8)  # the last steps whose gradients were staged
        self._maskers: set = set()  # (module path, argument): where -inf masks were seen on healthy steps
        self._takers: set = set()  # (root path, argument): NaN/Inf inputs a model took and handled on healthy steps
        self._handled: set = set()  # (module path, output): NaN/Inf outputs handled downstream on healthy steps
        self._pad_rows: Optional[torch.Tensor] = None  # (batch, query) rows fully masked in this model call
        self._bad_grad_steps: set = set()
        self._passthrough: Dict[type, bool] = {}
        self._armed: Dict[int, str] = {}  # id(module) -> path: capture exact counts at its next call
        self._update: Optional[Tuple[int, Optional[str]]] = None  # (step, source line) of the last update
        self._in_update: Optional[Tuple[int, Optional[str]]] = None  # an update under way (between step hooks)
        self._pending_update: Optional[Tuple[int, Optional[str]]] = None  # step_pre seen, not yet resolved
        self._step_call: Optional[Tuple[int, Optional[str]]] = None  # (step, line) of the last step_pre
        # parameters NaN/Inf before their optimizer's first update ("inf" or "nan"): a -inf gate logit or
        # forbidden CRF transitions hold -inf by design (softmax/logsumexp give them weight 0, gradient 0)
        self._born = WeakIdMap()
        # id(optimizer) -> (weak reference whose callback checks the weights as it dies, its param_groups):
        # a script whose model and optimizer are locals of main() drops them before guard's exit
        self._ends: Dict[int, Tuple[Any, list]] = {}
        self._left: Dict[int, Tuple[int, int]] = {}  # id(optimizer) -> (its first weight's version after its last update, window)
        self._by_hand = False  # the backward under way is of a loss scaled by hand (`_scaled_by_hand`)
        self._ctc_steps: Deque[int] = deque(maxlen=8)  # the last steps with a ctc_loss call without zero_infinity
        # (step, line, results) of this step's torch.autograd.grad(..., create_graph=True) calls: looked at only when
        # a loss is NaN while the model's outputs were finite; dropped when the step is resolved
        self._derivs: Deque[tuple] = deque(maxlen=4)
        self._grads_told = -1  # the step of the last nonfinite-grad finding
        self._post_version: Tuple[int, int] = (0, 0)  # (id, version counter) of the first weight after the last update
        self._last_loss: Optional[weakref.ref] = None  # the tensor of the last backward()
        self._bw_steps: Deque[int] = deque(maxlen=4)  # the last steps at which a backward() ran
        self._root_in: Optional[tuple] = None  # (sum, number of elements) of the last model call's one input tensor

    def _new_window(self) -> None:
        self._sums: List[torch.Tensor] = []  # one per screened tensor in this window; index = flag
        self._bad: set = set()
        self._masks: set = set()  # flags whose only non-finite values are -inf (a mask, see _on_resolved)
        self._tensors: Dict[int, Tuple[weakref.ref, int]] = {}  # id(tensor) -> (ref, flag index)
        self._refs: Dict[int, weakref.ref] = {}  # flag index -> tensor ref (for details)
        self._calls: List[_Call] = []
        self._losses: List[Tuple[int, Optional[str], int]] = []
        self._loss_fns: Dict[int, Any] = {}  # loss flag -> its grad_fn (the node structure outlives backward())
        self._grads: List[Tuple[int, Any, int, Optional[str]]] = []
        # (loss function, its target) of this window: held (a temporary `y[idx]` is gone by the read) until the
        # step is read, a few per window
        self._targets: List[Tuple[str, torch.Tensor]] = []
        # updates staged in this window: (calls made before it, the optimizer, its gradients' flags, whether its
        # weights were as its previous update left them: `_broken_after`)
        self._updates: List[Tuple[int, weakref.ref, List[int], Any]] = []
        self._clean_after: list = []  # models called with finite values after the last update (window resolved)
        self._window = getattr(self, "_window", 0) + 1

    # staging ---------------------------------------------------------------
    def _flag(self, t: torch.Tensor, own: bool = False) -> int:
        """Keep a sum of `t` (NaN/Inf anywhere makes it non-finite); all are tested once per step."""
        i = len(self._sums)
        d = t.detach() if t.requires_grad else t
        if own and d.dtype in _WIDE_SUM and d.dim() == 0:
            # guard's own 0-dim float tensors (gradient norms, never changed in place) are their own sum.
            self._sums.append(d)
        else:
            if 0 in d.stride():
                d = distinct_view(d)  # an expand()ed view: its distinct values only (2**40 rows cost nothing)
            self._sums.append(d.sum(dtype=torch.float32) if d.dtype in _HALF else d.sum())
        if i == 0:
            self.g.stage_batch(self._collect)
        elif i >= _MAX_WINDOW:
            self.g.flush()  # e.g. a long no_grad evaluation: resolve now, keep memory bounded
        return i

    def _collect(self):
        """At resolution: one ``isfinite(stack(sums))`` per device; marks the bad flag indices."""
        sums, bad, masks = self._sums, self._bad, self._masks
        by_dev: Dict[Any, List[int]] = {}
        for i, s in enumerate(sums):
            by_dev.setdefault(s.device, []).append(i)
        out = []
        # A sum is -inf only when -inf is the one non-finite value in its tensor (+inf or NaN make it
        # +inf or NaN): such flags go to `masks` as well.
        for dev, idx in by_dev.items():
            if dev.type == "cpu" and len(idx) <= _FEW and _tensor_mod.HOST_DIRECT:
                # Host values: read one by one (no transfer to batch, and no stack kernel).
                for i in idx:
                    v = sums[i].item()
                    if not (cmath.isfinite(v) if isinstance(v, complex) else math.isfinite(v)):
                        bad.add(i)
                        if v == _NEG_INF:
                            masks.add(i)
                continue
            st = torch.stack([sums[i] for i in idx])
            if st.dtype is torch.float32:
                # The sums themselves are read (exactly, as float32) and tested on the host: no
                # isfinite and no bool->float copy on the device (five small ops a step fewer).
                def mark(values, idx=idx):
                    for i, v in zip(idx, values):
                        if not math.isfinite(v):
                            bad.add(i)
                            if v == _NEG_INF:
                                masks.add(i)
                out.append((st, mark))
                continue
            if st.dtype is torch.float64:
                # Read as float32 the sums could overflow: tested on the device, 0 finite, -1 -inf, 1 else.
                code = torch.where(torch.isfinite(st), 0.0, torch.where(st == _NEG_INF, -1.0, 1.0))

                def mark_code(values, idx=idx):
                    for i, v in zip(idx, values):
                        if v:
                            bad.add(i)
                            if v < 0:
                                masks.add(i)
                out.append((code, mark_code))
                continue
            ok = torch.isfinite(st)  # complex sums: tested on the device

            def mark_ok(values, idx=idx):
                bad.update(i for i, v in zip(idx, values) if not v)
            out.append((ok, mark_ok))
        return out

    def _screen(self, t: torch.Tensor, reuse: bool) -> Optional[int]:
        """The flag index of `t`: reused when `t` itself was screened already, None if not screenable."""
        if reuse:
            hit = self._tensors.get(id(t))
            if hit is not None and hit[0]() is t:
                return hit[1]
        if not screenable(t):
            t = stored_values(t)  # a sparse or jagged nested batch: its stored values
            if t is None:
                return None
            return self._flag(t)
        i = self._flag(t)
        try:  # `_remember`, inlined: two tensors of every root call come here
            ref = weakref.ref(t)
        except TypeError:
            return i
        self._tensors[id(t)] = (ref, i)
        self._refs.setdefault(i, ref)
        return i

    def _remember(self, t: torch.Tensor, i: int) -> None:
        try:
            ref = weakref.ref(t)
        except TypeError:
            return
        self._tensors[id(t)] = (ref, i)
        self._refs.setdefault(i, ref)

    # events ----------------------------------------------------------------
    def on_forward(self, module, path, args, kwargs, output, is_root):
        if self._armed and id(module) in self._armed:
            self._capture(module, args, kwargs, output)
        if not self.g.sampling:
            return
        cls = type(module)
        passthrough = self._passthrough.get(cls)
        if passthrough is None:
            passthrough = self._passthrough[cls] = (
                True if _standard(cls, _PASSTHROUGH) else "wide" if _standard(cls, _SAFE_WIDE) else False)
        tensors = self._tensors
        # Fast path: one tensor in, one tensor out (most layers).
        if (not kwargs and type(args) is tuple and len(args) == 1 and isinstance(args[0], torch.Tensor)
                and isinstance(output, torch.Tensor)):
            x = args[0]
            hit = tensors.get(id(x))
            if hit is not None and hit[0]() is x:
                src: Optional[int] = hit[1]
            else:
                src = self._screen(x, False)
            if is_root and src is not None:
                self._root_in = (self._sums[src], x.numel())  # the model's input's sum: its scale, if reported
            inputs = [("args[0]", src)] if src is not None else []
            if passthrough and not is_root and (passthrough is True or output.dtype in _WIDE):
                self._inherit(output, src)
                return
            out = self._screen(output, False)
            outputs = [("output", out)] if out is not None else []
        else:
            inputs, outputs = self._screen_structures(args, kwargs, output, passthrough is True and not is_root)
            if outputs is None:
                return
        call = _Call(path, cls.__name__, is_root, self.g.root_source, self.g.step, module, inputs, outputs)
        if type(output) is torch.Tensor and output.dtype is torch.float16:
            call.half = True
        if (len(args) > 1 or kwargs) and outputs:
            # float arguments at 0 (an int 0 is an index: Lightning's batch_idx); named when reporting, if the
            # forward's signature calls them a temperature or scale (a time t = 0.0 of an ODE is no divisor)
            zeros = [i for i, a in enumerate(args) if type(a) is float and a == 0.0] + [
                k for k, v in kwargs.items() if type(v) is float and v == 0.0]
            if zeros:
                call.zeros = zeros
        if is_root and args and isinstance(args[0], torch.Tensor) and args[0].grad_fn is not None:
            call.made = True
        if outputs and (self._pad_rows is not None or (
                cls is nn.MultiheadAttention and not module.training and not torch.is_grad_enabled())):
            call.padded = self._padded_flag(module, args, kwargs, output)
        elif cls is nn.MultiheadAttention and outputs and (len(args) > 3 or kwargs):
            call.masks = _attention_masks(args, kwargs)  # kept (not read) until the step is resolved
        if is_root:
            self._pad_rows = None
        self._calls.append(call)

    def _padded_flag(self, module, args, kwargs, output) -> Optional[int]:
        """The flag of an attention's output with its fully masked query rows zeroed.

        torch's MultiheadAttention fast path (eval mode, no grad) returns NaN for a query whose keys are all
        masked (a left-padded position under a causal mask: a softmax over no key): padding that the script
        discards (SASRec's evaluation reads the last position). Only those rows NaN is no origin."""
        try:
            if type(module) is not nn.MultiheadAttention:
                # a later layer of the same model call: the same rows zeroed, when its output has them
                out, rows = output, self._pad_rows
                if not isinstance(out, torch.Tensor) or out.dim() < 2:
                    return None
                if tuple(out.shape[:2]) != tuple(rows.shape):
                    rows = rows.t()
                    if tuple(out.shape[:2]) != tuple(rows.shape):
                        return None
                return self._flag(out.masked_fill(rows.reshape(*rows.shape, *[1] * (out.dim() - 2)), 0))
            rows = _masked_rows(module.batch_first, *_attention_masks(args, kwargs))
            if rows is None:
                return None
            out = output[0] if isinstance(output, tuple) else output
            self._pad_rows = rows
            if not module.batch_first:
                rows = rows.t()
            return self._flag(out.masked_fill(rows.unsqueeze(-1), 0))
        except Exception:  # a mask of another layout: screened as any other output
            return None

    def _inherit(self, t: torch.Tensor, src: Optional[int]) -> None:
        """A pass-through layer's output shares its input's flag; screened itself only without one."""
        hit = self._tensors.get(id(t))
        if hit is not None and hit[0]() is t:
            return  # the same tensor object (in-place layer, container): already known
        if src is None:
            self._screen(t, False)
        elif screenable(t):
            self._remember(t, src)

    def _screen_structures(self, args, kwargs, output, passthrough):
        screen = self._screen
        inputs = [(n, i) for n, i in ((n, screen(t, True)) for n, t in _tensors(args, "args")) if i is not None]
        if kwargs:
            inputs += [(n, i) for n, i in ((n, screen(t, True)) for n, t in _tensors(kwargs, "kwargs"))
                       if i is not None]
        outs = _tensors(output, "output")
        if passthrough:
            # Cannot originate NaN/Inf: outputs share the input's flag (no extra reduction).
            src = inputs[0][1] if inputs else None
            for _, t in outs:
                self._inherit(t, src)
            return inputs, None
        return inputs, [(n, i) for n, i in ((n, screen(t, False)) for n, t in outs) if i is not None]

    def on_backward(self, tensors, kwargs):
        # before any optimizer step, the gradients of a backward are judged at once (below: unless scaled by hand)
        self._by_hand = not self.g.has_optimizer and self._scaled_by_hand(tensors)
        if not self._bw_steps or self._bw_steps[-1] != self.g.step:
            self._bw_steps.append(self.g.step)  # (NaN gradients of a step without backward were written by hand)
        if not self.g.sampling:
            return
        ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors or ())
        for t in ts:
            if isinstance(t, torch.Tensor) and screenable(t):
                # A 0-dim fp32/fp64 loss is its own sum (it is read at the step's end, as the timeline's loss is).
                self._losses.append((flag := self._flag(t, own=True), self.g.root_source, self.g.step))
                self._loss_fns[flag] = t.grad_fn  # its graph's last nodes, walked only for a NaN/Inf loss's hint
                self._last_loss = weakref.ref(t)  # (gradients staged in the next window: their loss's graph, if alive)

    def on_ctc_loss(self, args, kwargs):
        if not (args[6] if len(args) > 6 else kwargs.get("zero_infinity", False)) and (
                not self._ctc_steps or self._ctc_steps[-1] != self.g.step):
            self._ctc_steps.append(self.g.step)

    def on_backward_done(self, tensors, kwargs):
        if not self.g.has_optimizer and self.g.sampling and not self._scaled(tensors) and not self._by_hand:
            self._stage_grads(None)

    def _scaled(self, tensors) -> bool:
        """`tensors` came from an enabled ``GradScaler.scale``: its gradients are the scaler's to judge
        (before the first optimizer step of a global guard is seen, a skipped step shows no step hook)."""
        amp = next((c for c in self.g.checks if c.name == "amp-scaler"), None)
        return amp is not None and amp.scaled(tensors)

    @staticmethod
    def _scaled_by_hand(tensors) -> bool:
        """`tensors` (before its backward, while the graph keeps what it saved) is a loss scaled by hand by a
        constant of at least 128 (``(loss * scale).backward()``: apex/fairseq-style dynamic loss scaling, which
        skips the steps whose gradients overflow itself)."""
        fn = getattr(tensors, "grad_fn", None)
        if type(fn).__name__ != "MulBackward0":
            return False
        try:
            other = fn._saved_other
        except Exception:
            return False
        # a Python number is saved as a CPU scalar: reading it costs no device sync
        return isinstance(other, torch.Tensor) and other.dim() == 0 and other.device.type == "cpu" \
            and abs(float(other)) >= 128

    def on_step_pre(self, optimizer):
        # The resolution that follows is before the update; later ones until step_post (an LBFGS
        # closure's further calls) happen mid-update, and NaN weights then are this step's.
        self._pending_update = self._step_call = (self.g.step, self.g.source())
        if id(optimizer) not in self._ends:
            self._first_step(optimizer)
        # A GradScaler's fused step (found_inf set on the optimizer) skips NaN/Inf grads itself: expected.
        if self.g.sampling and not isinstance(getattr(optimizer, "found_inf", None), torch.Tensor):
            self._stage_grads(optimizer)

    def _first_step(self, optimizer) -> None:
        """Before an optimizer's first update: note the weights already NaN/Inf (in the step's one read), and
        look at the weights once more when the optimizer dies (the last update may have broken them)."""
        key = id(optimizer)

        def died(_: Any) -> None:
            ent = self._ends.pop(key, None)
            if ent is not None and self.g.active:
                try:
                    self._check_params([p for grp in ent[1] for p in grp["params"]], at_end=True)
                except Exception as exc:
                    self.g.contain(self, exc)

        self._ends[key] = (weakref.ref(optimizer, died), optimizer.param_groups)
        params = [p for grp in optimizer.param_groups for p in grp["params"] if screenable(p)]
        if not params:
            return
        by_device: Dict[Any, List[torch.Tensor]] = {}
        for p in params:
            by_device.setdefault(p.device, []).append(p)

        # computed now, before the update (the step's read comes later: after it, for an optimizer stepping
        # after the one whose steps guard counts), read with the step's other values
        out = []
        with torch.no_grad():
            for group in by_device.values():
                norms, _ = fused_norms([p.detach() for p in group])
                out.append((torch.stack([n.reshape(()).float() for n in norms]),
                            lambda values, group=group: self._note_born(group, values)))
        self.g.stage_batch(lambda: out)

    def _inf_params(self) -> List[str]:
        """Names of the watched parameters holding +-inf and no NaN (looked at on the error path only): held so by
        design since before any update (forbidden CRF transitions), or `_born` says so."""
        out = []
        for name, p in list(self.g.named_parameters())[:256]:
            if not screenable(p) or self._born.get(p) == "nan":
                continue
            d = p.detach()
            if bool(torch.isinf(d).any()) and not bool(torch.isnan(d).any()):
                out.append(name)
        return out

    def _note_born(self, params: List[torch.Tensor], values: List[float]) -> None:
        plus = []
        for p, v in zip(params, values):
            if v != v:
                self._born[p] = "nan"
            elif v in (_INF, _NEG_INF):
                self._born[p] = "inf"
                if len(plus) < 8 and bool((p.detach() == _INF).any()):  # (read once, at the first step)
                    plus.append(p)
        if plus:
            self._born_plus(plus)

    def _born_plus(self, params: List[torch.Tensor]) -> None:
        """Parameters an optimizer holds with +inf entries before its first update. A -inf logit can be an off switch
        by design (softmax gives it weight 0); +inf is none: a change of variables taken at its domain's edge
        (Carlini-Wagner's w = atanh(2x - 1) of pixels at exactly 0 or 1), hidden by a tanh after it, never moves,
        its gradient there being 0."""
        names = [self.g.param_name(p) for p in params]
        counts = [int(torch.isinf(p.detach()).sum()) for p in params]
        shown = ", ".join(f"{n} ({c} of {p.numel()})" for n, c, p in zip(names, counts, params))
        self.emit("nonfinite-param", names[0],
                  f"{len(params)} parameter(s) an optimizer holds hold +inf before its first update: {shown} "
                  f"values are infinite; a tanh or sigmoid after them hides it (tanh(inf) = 1), their gradient there "
                  f"is 0, and the optimizer never moves them",
                  "Make them finite where they are made: a change of variables at its domain's edge (atanh(2x - 1) "
                  "of values at exactly 0 or 1: clamp x to [1e-6, 1 - 1e-6] first; log of 0), or a checkpoint "
                  "holding inf.",
                  step=self.g.step, source=self.g.source(),
                  details={"parameters": names, "inf_counts": counts, "before_any_update": True})

    def _as_born(self, p: torch.Tensor, norm: float) -> bool:
        """Whether `p` (of L2 norm `norm`) is NaN/Inf only as it was before its first update."""
        born = self._born.get(p)
        return born == "nan" or (born == "inf" and norm == _INF)

    def _stage_grads(self, optimizer) -> None:
        self._screened.append(self.g.step)
        gn = self.g.grad_norms(optimizer)
        flags = []
        for total in gn.totals.values():
            flags.append(self._flag(total, own=True))
            self._grads.append((flags[-1], gn, self.g.step, self.g.source()))
        if optimizer is not None:  # (None: gradients of a backward with no optimizer known yet)
            # whether its weights are as its previous update, in a window read before this one, left them
            left = self._left.get(id(optimizer))
            groups = optimizer.param_groups
            p0 = groups[0]["params"][0] if groups and groups[0]["params"] else None
            intact = "first" if left is None else (p0 is not None and left[0] == p0._version and left[1] < self._window)
            self._updates.append((len(self._calls), weakref.ref(optimizer), flags, intact))

    # Weights are not reduced after every step: NaN/Inf weights make the next forward's outputs (and
    # loss) non-finite, and only then, at that resolution, are the weights looked at, before any module
    # is blamed. The step and line of the last update are kept to say when they went bad.
    def on_step_post(self, optimizer):
        self._in_update = self._pending_update = None
        call = self._step_call  # the same optimizer.step() call as its pre-hook: its line is known
        self._update = call if call is not None and call[0] == self.g.step else (self.g.step, self.g.source())
        # The version counter of its first weight as the update left them (one read): when weights are found NaN
        # later and it moved since, they were changed in place after the update (SAM's perturbation, an EMA swap),
        # which may have broken them instead.
        groups = optimizer.param_groups
        if groups and groups[0]["params"]:
            p0 = groups[0]["params"][0]
            self._post_version = (id(p0), p0._version)
            self._left[id(optimizer)] = (p0._version, self._window)

    def on_exit(self):
        """At the end the weights are looked at once: the last update may have broken them."""
        ends, self._ends = self._ends, {}
        params = [p for o in self.g.optimizers for grp in o.param_groups for p in grp["params"]]
        seen = {id(p) for p in params}
        for _, groups in ends.values():  # optimizers that are still alive but no longer watched
            params += [p for grp in groups for p in grp["params"] if id(p) not in seen]
        self._check_params(params, at_end=True)

    def _check_params(self, params: Optional[List[torch.Tensor]] = None, at_end: bool = False) -> bool:
        """NaN/Inf weights after an update: True when that was just reported (later findings are its effects).

        `at_end` (the last look, with no NaN/Inf seen after the last update): weights whose only non-finite
        values are -inf are set so on purpose (a mixture component pruned with its logit at -inf, which
        log_softmax and Adam keep there), not broken by an update: an update that made -inf makes NaN next."""
        update = self._in_update or self._update
        if update is None:
            return False
        step, source = update
        if params is None:
            params = [p for o in self.g.optimizers for grp in o.param_groups for p in grp["params"]]
        params = [p for p in params if screenable(p)]
        if not params:
            return False
        with torch.no_grad():
            norms, _ = fused_norms([p.detach() for p in params])
            values = torch.stack([n.reshape(()).float().cpu() for n in norms]).tolist()
        group = [p for p, v in zip(params, values) if not math.isfinite(v) and not self._as_born(p, v)
                 and not (at_end and v == _INF and _only_neg_inf(p))]
        if not group:
            return False
        return self._report_params(group, step, source, caused=step in self._bad_grad_steps)

    def _capture(self, module, args, kwargs, output) -> None:
        """The origin's tensors were gone at resolution: record exact counts from this next call."""
        path = self._armed.pop(id(module))
        with torch.no_grad():
            broken = any(not bool(torch.isfinite(t).all()) for t in list(module.parameters())
                         + list(iter_tensors((args, kwargs))) if screenable(t))
        if broken:  # the NaN update came first: this call's counts would be those of broken weights, not the origin's
            self.g.update_details("nonfinite-output", path,
                                  counts_unavailable="its weights or inputs were NaN/Inf by its next call")
            return
        counts = {n: nonfinite_counts(t) for n, t in iter_named_tensors(output, "output") if screenable(t)}
        stats_in = {n: finite_stats(t) for n, t in iter_named_tensors((args, kwargs), "inputs") if screenable(t)}
        self.g.update_details("nonfinite-output", path, counts=counts, input_stats=stats_in,
                              counts_from_step=self.g.step)

    # resolution -------------------------------------------------------------
    def on_resolved(self):
        promote, self._pending_update = self._pending_update, None
        try:
            self._on_resolved()
        finally:
            if promote is not None:
                self._in_update = promote
            if self._derivs:
                self._derivs.clear()

    def _on_resolved(self):
        bad, masks = self._bad, self._masks
        window = (self._calls, self._losses, self._grads, self._refs, self._targets, self._loss_fns, self._sums)
        self._window_updates = (self._calls, self._updates)
        self._new_window()
        if not bad:
            return
        calls, losses, grads, refs = window[:4]
        known: set = set()  # flags of -inf masks seen before (not an origin)
        held = {f for f, _, _ in losses} | {f for f, _, _, _ in grads}  # the loss and gradient flags
        if masks:
            # -inf alone is a mask value (an additive attention mask from generate_square_subsequent_mask,
            # logits masked with masked_fill(mask, -inf)), not NaN/Inf trouble, on a step where nothing
            # else is bad: the tensors (module and argument) that carry it are then known as masks. On a
            # bad step, -inf counts again unless it comes from a known mask: an overflow to -inf (a
            # hand-written log-softmax) is the origin, a mask that was always there is not.
            sites = [((call.path, name), i) for call in calls for name, i in call.inputs + call.outputs if i in masks]
            if all(i in masks and i not in held for i in bad):
                if held:
                    # Learnt from training forwards only: a finite loss and gradients show the -inf was masked on
                    # purpose. An evaluation pass (no loss) proves nothing: log(softmax(z)) underflowing to -inf.
                    self._maskers.update((call.path, name) for call in calls if call.graded
                                         for name, i in call.inputs + call.outputs if i in masks)
                return
            known = {i for site, i in sites if site in self._maskers}
            bad = {i for i in bad if i not in known}
        # Flags are numbered as they are made. A window read at the steps of the optimizer guard counts can hold
        # another optimizer's whole step (a GAN's generator stepping after the discriminator): when a loss or
        # gradients are the first NaN/Inf of the window, its update broke the weights and every later call's
        # NaN is its effect. Those calls are no origin.
        # (weights already NaN/Inf before this window make NaN gradients of their own: not an origin)
        params_known_bad = bool(self._bad_param_names)
        if bad and not params_known_bad and min(bad) in held:
            first = min(bad)
            calls = [c for c in calls if all(i < first for _, i in c.inputs + c.outputs)]
            losses = [e for e in losses if e[0] <= first]
            grads = [e for e in grads if e[0] <= first]
        produced = {i for call in calls for _, i in call.outputs}
        if bad <= {i for c in calls if c.is_root for _, i in c.inputs} - produced:
            # NaN/Inf only in what the model was given, with every output, the loss and the gradients finite:
            # the model handles it on purpose (imputes missing features, masks targets marked NaN as missing).
            # Dirty data that matters makes an output or the loss NaN, and is then the origin reported.
            self._takers.update((c.path, name) for c in calls if c.is_root for name, i in c.inputs if i in bad)
            return
        if held and not bad & held:
            # NaN/Inf in the forward only, with this step's loss and gradients finite: what the modules made was
            # handled downstream on purpose (rows masked whole, softmax'd to NaN and replaced by nan_to_num or
            # masked_fill before the loss; outputs the loss does not use). Dirty values that matter reach the
            # loss or the gradients, and are then reported from their origin.
            train = [c for c in calls if not c.evaluating]
            self._takers.update((c.path, name) for c in train if c.is_root for name, i in c.inputs if i in bad)
            self._handled.update((c.path, name) for c in train for name, i in c.outputs if i in bad)
            # An evaluation (eval mode, no_grad) run before this step's forward made NaN/Inf no loss can have
            # handled: judged on its own, as one after the last step is (its metric is NaN).
            calls = [c for c in calls if c.evaluating]
            bad = {i for c in calls for _, i in c.inputs + c.outputs if i in bad} | {
                c.padded for c in calls if c.padded in bad}
            if not bad:
                return
        if not bad & held and calls and all(c.evaluating for c in calls) and not any(
                i in bad for c in calls if c.is_root for _, i in c.inputs + c.outputs):
            # An evaluation whose model took and gave only finite values: what its layers made was handled inside
            # the model (a distance matrix with +inf on its diagonal turned into zeros), as on training steps.
            return
        # ... and on a bad step such an input (where NaN was taken on healthy steps) is not the dirty data: the
        # module taking it made the NaN (a masked loss whose batch was masked whole divides 0 by 0)
        taken = {i for c in calls if c.is_root for name, i in c.inputs
                 if i in bad and i not in produced and (c.path, name) in self._takers} if self._takers else set()
        earlier = set(self._bad_grad_steps)
        self._bad_grad_steps.update(step for flag, _, step, _ in window[2] if flag in bad)
        # No update in this window, and a model call in it took and gave finite values before anything went bad: the
        # weights were finite after the last update, and code outside the optimizer broke them since (a zeroth-order
        # update written through .data, which moves no version counter)
        first = min(bad)
        self._clean_after = [] if self._window_updates[1] else [
            c.module for c in window[0] if c.is_root and c.outputs and all(i < first for _, i in c.inputs + c.outputs)]
        if self._check_params():
            return
        # weights found NaN/Inf now, broken by the update of an earlier step whose NaN/Inf gradients were there and
        # a NaN/Inf finding told by then: this window's NaN loss and inputs are their effect (a parameter optimised
        # directly, with no model call)
        update = self._in_update or self._update
        params_known_bad = params_known_bad or (
            bool(self._bad_param_names) and update is not None and update[0] in earlier
            and any(f.kind.startswith("nonfinite-") and f.step <= update[0] for f in self.g.findings))
        # A root call whose NaN input an earlier call made (a loss module, any module called on the
        # model's outputs under a global guard) is not fed dirty data: the origin lies upstream. Calls
        # are listed as they return, so the calls before a root call's own inner calls (those up to the
        # previous root call) ran before it; matching by flag misses reshaped outputs (logits.view(-1, C)).
        upstream = False  # some call that ended before the current root call began made NaN/Inf
        done = 0
        # (with weights already NaN/Inf, a NaN input computed with autograd is as much their effect as a NaN output: a
        # GAN's generated batch from the broken generator, given to the discriminator; a batch of data is not)
        for k, call in enumerate(calls):
            if not call.is_root:
                continue
            if not upstream and not (params_known_bad and call.made) and any(
                    i in bad and i not in produced and i not in taken for _, i in call.inputs):
                if (not any(i in bad for _, i in call.outputs) and not any(f in bad for f, _, _ in losses)
                        and any(f in bad for f, _, _, _ in grads)):
                    # The model kept its NaN input out of its outputs and the loss is finite, yet the gradients
                    # are NaN: the input is taken on purpose (imputed, masked), and a backward through the NaN
                    # (torch.where over it) made the NaN gradients, not the data reaching the loss.
                    args = [name for name, i in call.inputs if i in bad]
                    self._takers.update((call.path, name) for name in args)
                    for flag, gn, step, source in grads:
                        if flag in bad:
                            self._report_grads(gn, step, source, taken_input=(call.path, args))
                            return
                self._report_input(call, bad, refs)
                return
            upstream = upstream or any(i in bad for c in calls[done:k + 1] for _, i in c.outputs)
            done = k + 1
        padding = None  # an attention of this model call that made NaN only in fully masked rows (_padded_flag)
        for call in calls:
            if call.padded is not None and call.padded not in bad:
                padding = padding or (call if not call.is_root else None)
                continue
            if (padding and call.padded is not None and call.type == "MultiheadAttention"
                    and any(i in bad for _, i in call.inputs)):
                # a later attention took those rows as keys: NaN values of masked keys still make NaN (0 * NaN)
                self._report_padded(padding, call, bad, refs)
                return
            if padding and call.padded is None:
                # returned after it in the same model call, with no such rows to tell: its NaN came from them (the
                # model around it, a block whose input was finite, a pooled output)
                padding = padding if not call.is_root else None
                continue
            padding = padding if not call.is_root else None
            # inputs whose only non-finite values are -inf (a mask), from which the call made NaN: a softmax over a row
            # that is all -inf; its NaN rows dropped after it still back-propagate NaN (0 * NaN)
            mask_in = [name for name, i in call.inputs if i in bad and i in masks and i not in taken]
            if any(i in bad for _, i in call.outputs) and not any(
                    i in bad and i not in taken and i not in masks for _, i in call.inputs) and (
                    not mask_in or not all(i in masks for _, i in call.outputs if i in bad)):
                # -inf alone in what it made, on a step whose NaN/Inf came from elsewhere too: a mask (first seen
                # on a bad step, so not yet known as one) that later arithmetic turned into NaN
                masked = all(i in masks for _, i in call.outputs if i in bad)
                if self._report_output(call, bad, refs, [name for name, i in call.inputs if i in taken], masked,
                                       mask_in):
                    return
        for flag, source, step in losses:
            if flag in bad:
                if params_known_bad:
                    return
                if not calls or not any(i in bad for c in calls for _, i in c.outputs):
                    if any(i in known for c in calls for _, i in c.outputs):
                        self.emit("nonfinite-loss", "loss",
                                  "the loss passed to backward() is NaN/Inf; the model's outputs held -inf (a mask) "
                                  "but no NaN",
                                  "A row masked whole (every class -inf) has no probability to take: softmax and "
                                  "cross_entropy give NaN there; leave at least one entry per row unmasked. "
                                  + MASK_HINT,
                                  step=step, source=source, details={"masked_outputs": True})
                    elif step in self._ctc_steps:
                        self.emit("nonfinite-loss", "loss",
                                  "the loss passed to backward() is NaN/Inf although the model's outputs were finite; "
                                  "this step's ctc_loss runs without zero_infinity",
                                  CTC_HINT, step=step, source=source, details={"ctc": True})
                    elif self._bad_derivative(step) is not None:
                        at = self._bad_derivative(step)
                        self.emit("nonfinite-loss", "loss",
                                  f"the loss passed to backward() is NaN/Inf although the model's outputs were finite: "
                                  f"the derivative torch.autograd.grad took at {at} (create_graph=True, forces as "
                                  f"-dE/dpos) is NaN/Inf, and the loss uses it",
                                  "An op in the forward has an infinite derivative where the forward takes it: sqrt or a "
                                  "norm at 0 (pairwise distances with their diagonal, r = 0), pow with an exponent "
                                  "below 1 at 0, acos/asin at +-1. Compute sqrt(r2 + eps) (or mask the zeros before "
                                  "the sqrt: torch.where after it does not help, the unused branch's derivative is "
                                  "still NaN).",
                                  step=step, source=source, details={"derivative_source": at})
                    elif self._dirty_target(step, source, window[4]):
                        pass
                    elif (unstable := _log_of(window[5].get(flag))) is not None and unstable[0] == "softmax" \
                            and _masked_below(window[5].get(flag)):
                        # log(softmax) of logits masked with -inf: p * log p is 0 * -inf at the masked entries,
                        # with log_softmax too
                        self.emit("nonfinite-loss", "loss",
                                  "the loss passed to backward() is NaN/Inf although the model's outputs were finite: "
                                  "it takes the log of a softmax of logits masked with -inf (masked_fill), and a masked "
                                  "entry's p * log p is 0 * -inf = NaN, with F.log_softmax too",
                                  "Compute the entropy from the logits, torch.distributions.Categorical(logits=logits)"
                                  ".entropy(), or torch.special.xlogy(p, p) (0 where p is 0), or zero the masked entries "
                                  "before the product (log_p.masked_fill(~mask, 0)); or mask with "
                                  "torch.finfo(logits.dtype).min instead of -inf.",
                                  step=step, source=source, details={"log_of": "softmax", "masked": True})
                    elif (unstable := _log_of(window[5].get(flag))) is not None:
                        inner, stable = unstable
                        self.emit("nonfinite-loss", "loss",
                                  f"the loss passed to backward() is NaN/Inf although the model's outputs were finite: "
                                  f"it takes the log of a {inner}, which underflows to 0 or overflows to inf (log "
                                  f"gives -inf or inf)",
                                  f"Compute it in log space: {stable} is exact where the log of the value underflows (or "
                                  f"use the built-in loss that takes logits: F.binary_cross_entropy_with_logits, "
                                  f"F.cross_entropy; for a mixture, torch.distributions.MixtureSameFamily's log_prob).",
                                  step=step, source=source, details={"log_of": inner, "stable": stable})
                    elif (smoothing := _cross_entropy_of(window[5].get(flag))) is not None and \
                            _plus_inf(window[6], flag):
                        # +inf from cross_entropy of finite outputs: log_softmax is -inf only at a logit of -inf, set
                        # between the model and the loss (a mask); NaN (an empty mean) has the generic hint
                        self.emit("nonfinite-loss", "loss",
                                  "the loss passed to backward() is +inf although the model's outputs were finite: "
                                  "cross_entropy was given a logit of -inf "
                                  + ("(a mask) and label_smoothing, which gives every class a share of the target, "
                                     "the masked ones too" if smoothing else
                                     "(a mask) at a row's target class: the mask hides the class the row is labelled "
                                     "with, and -log(0) is inf"),
                                  ("Mask with a large finite value (torch.finfo(logits.dtype).min or -1e4) instead of "
                                   "-inf, or drop label_smoothing for masked logits: smoothing spreads the target over "
                                   "every class, masked ones included." if smoothing else
                                   "Check that the mask and the targets agree: a task-incremental mask built for another "
                                   "task (an off-by-one task id), targets not remapped to the classes the mask keeps, "
                                   "or padding positions masked whole but not given ignore_index (-100)."),
                                  step=step, source=source,
                                  details={"masked_target": True, "label_smoothing": smoothing})
                    elif (held := self._inf_params()):
                        # parameters holding +-inf by design since before any update (forbidden CRF transitions):
                        # a path through one gives -inf, and -inf - (-inf) or 0 * -inf is NaN
                        self.emit("nonfinite-loss", "loss",
                                  f"the loss passed to backward() is NaN/Inf although the model's outputs were finite; "
                                  f"{', '.join(f'`{n}`' for n in held[:3])} holds -inf/inf (a hard "
                                  f"constraint written into a parameter), and a score through it is -inf, whose "
                                  f"difference with another -inf (the gold path's score minus the partition "
                                  f"function) or product with 0 is NaN",
                                  "Use a large finite value for forbidden entries (-1e4, not -inf), and check that the "
                                  "gold sequences respect the constraint (the right axis of the transition matrix: "
                                  "trans[from, to]); a parameter at -inf also gets NaN gradients.",
                                  step=step, source=source, details={"inf_parameters": held[:20]})
                    else:
                        ops = _domain_ops(window[5].get(flag))
                        said = "; ".join(_DOMAIN_HINTS[o] for o in ops)
                        self.emit("nonfinite-loss", "loss",
                                  "the loss passed to backward() is NaN/Inf although the model's outputs were finite"
                                  + (f"; between them it computes {', '.join(ops)}, {'each ' if len(ops) > 1 else ''}NaN/Inf outside its domain"
                                     if ops else ""),
                                  (f"Look at those ops' inputs: {said}. " if ops else
                                   "The loss computation itself overflows or divides by zero (log(0), sqrt(<0), x/0): "
                                   "clamp its inputs (e.g. torch.log(p.clamp_min(1e-8))) or use a stable built-in loss. ")
                                  + "A mean over zero elements is NaN too, built-in losses included: a selection that "
                                  "can be empty (F.cross_entropy(logits[mask], y[mask]) when no row passes the mask) "
                                  "needs `if mask.any():`, or (per_row * mask).sum() / mask.sum().clamp_min(1).",
                                  step=step, source=source, details={"ops": ops} if ops else None)
                return
        for flag, gn, step, source in grads:
            if flag in bad and not params_known_bad:  # NaN weights from an earlier window make NaN grads: not news
                if any(f.kind in _FORWARD_KINDS and f.step == step for f in self.g.findings):
                    return  # this step's NaN input, output or loss was reported (resolved in an earlier read)
                unseen = not window[0] and self._model_unseen()
                self._report_grads(gn, step, source, masked=any(i in known for c in calls for _, i in c.outputs),
                                   graphs=list(window[5].values()), loss_seen=bool(losses), model_unseen=unseen,
                                   by_hand=step not in self._bw_steps and not window[0] and not unseen)
                return

    def _target(self, fn: str, args: tuple, kwargs: dict) -> None:
        t = args[1] if len(args) > 1 else kwargs.get("target")
        if isinstance(t, torch.Tensor) and len(self._targets) < TARGETS and self.g.sampling:
            self._targets.append((fn, t))  # looked at only if the loss turns out NaN/Inf

    def _dirty_target(self, step: int, source: Optional[str], targets: list) -> bool:
        """A NaN/Inf loss from finite outputs whose loss function's target holds NaN/Inf (error path): told so."""
        for fn, t in targets:
            if not screenable(t) or bool(torch.isfinite(t.detach()).all()):
                continue
            hint = ("The targets are dirty, not the loss: a normalisation that divided by a zero standard deviation "
                    "(a constant column in (y - mean) / std: clamp it, std.clamp_min(1e-6)), the log of a 0 in a "
                    "target encoding (a box regression's log(gw / aw) of a box clipped to zero width: drop "
                    "degenerate boxes) or NaN in the labels. "
                    "Clean or clamp them where they are made, and check torch.isfinite(y).all() once on the "
                    "dataset.")
            if fn == "kl_div":
                # a teacher's log-probabilities taken as torch.log(F.softmax(t / T)): -inf where the softmax underflows,
                # and kl_div(log_target=True) computes exp(-inf) * (-inf - x) = NaN there
                hint = ("The target's log-probabilities hold -inf or NaN: torch.log(F.softmax(t, -1)) is -inf wherever the "
                        "softmax underflows to 0 (a sharp teacher, a low temperature); compute them with "
                        "F.log_softmax(t, -1), which stays finite, or pass probabilities with log_target=False.")
            self.emit("nonfinite-loss", "loss",
                      f"the loss passed to backward() is NaN/Inf although the model's outputs were finite: the target "
                      f"given to {fn} holds NaN/Inf ({_counted(nonfinite_counts(t))})",
                      hint, step=step, source=source, details={"target_of": fn, "counts": nonfinite_counts(t)})
            return True
        return False

    def on_autograd_grad_done(self, args, kwargs, result):
        if kwargs.get("create_graph") and isinstance(result, (tuple, list)):
            # held (not weakly: `f = -grad(...)[0]` drops the result at once) until the step is resolved
            self._derivs.append((self.g.step, self.g.source(), [t for t in result[:4] if isinstance(t, torch.Tensor)]))

    def _bad_derivative(self, step: int) -> Optional[str]:
        """The line of this step's torch.autograd.grad(create_graph=True) whose result holds NaN/Inf (read on the
        error path only), or None."""
        for at, src, ts in self._derivs:
            if at != step:
                continue
            for t in ts:
                if t.is_floating_point() and not t.is_meta and not bool(torch.isfinite(t.detach()).all()):
                    return src
        return None

    def _broken_after(self, call: _Call, module: Any, bad: set) -> bool:
        """Whether the module's weights found NaN/Inf (some are) were finite when `call` ran, and broken after it (in the window resolved
        now) by an update with NaN/Inf gradients of an optimizer holding them: an actor stepped after the critic
        whose step the window ends at (TD3/SAC's order). Finite then: nothing changed them since that optimizer's
        previous update, which a window read before this one had finite gradients for (or it is the optimizer's
        first update, and they were finite before it)."""
        calls, updates = getattr(self, "_window_updates", ((), ()))
        pos = next((k for k, c in enumerate(calls) if c is call), None)
        if pos is None:
            return False
        held = [p for p in module.parameters() if screenable(p) and not bool(torch.isfinite(p.detach()).all())]
        if not held:
            return False
        ids = {id(p) for p in held}
        for before, ref, flags, intact in updates:
            opt = ref()
            if before > pos and opt is not None and any(f in bad for f in flags) and any(
                    id(p) in ids for grp in opt.param_groups for p in grp["params"]):
                return intact is True or (intact == "first" and all(self._born.get(p) is None for p in held))
        return False

    def _report_padded(self, first: _Call, spread: _Call, bad: set, refs: Dict[int, weakref.ref]) -> None:
        counts = {n: nonfinite_counts(t) for n, i in spread.outputs
                  if i in bad and (t := refs.get(i, lambda: None)()) is not None}
        self.emit("nonfinite-output", first.path,
                  f"{first.path} (MultiheadAttention) produced NaN in its fully masked query rows (padding: every key "
                  f"masked: a softmax over no key); {spread.path} then took those rows as keys and values, and a "
                  f"masked key's NaN value still makes NaN (0 * NaN), so positions that are not padding are NaN too",
                  "Zero the padded rows after each attention (`a = a.masked_fill(pad.unsqueeze(-1), 0)`; multiplying "
                  "by a mask keeps NaN, since NaN * 0 is NaN), or replace them with torch.nan_to_num(a) before the "
                  "next layer.",
                  step=first.step, source=first.source,
                  details={"module": first.type, "padding_rows_only": True, "spread_by": spread.path,
                           "counts": counts, "nonfinite_params": []})

    def _optimised(self, call: _Call, bad: set, refs: Dict[int, weakref.ref]) -> List[str]:
        """The optimizers (their class names) that hold a NaN/Inf input of `call` itself (style transfer's image, an
        adversarial patch: the input is what they train)."""
        held = {id(p): type(o).__name__ for o in self.g.optimizers for grp in o.param_groups for p in grp["params"]}
        return [held[id(t)] for name, i in call.inputs if i in bad
                and (t := refs.get(i, lambda: None)()) is not None and id(t) in held]

    def _report_input(self, call: _Call, bad: set, refs: Dict[int, weakref.ref]) -> None:
        args, counts = [], {}
        for name, i in call.inputs:
            if i in bad:
                args.append(name)
                t = refs.get(i, lambda: None)()
                if t is not None:
                    counts[name] = nonfinite_counts(t)
        optimised = self._optimised(call, bad, refs)
        if optimised:
            # the optimised input itself (style transfer's image, an adversarial patch): written NaN by its update
            self.emit("nonfinite-input", "input",
                      f"the input to {call.path} contains NaN/Inf ({', '.join(args)}): it is the tensor {optimised[0]} "
                      f"optimises, made NaN/Inf by its update (a NaN gradient, such as a hand-written normalisation "
                      f"g / g.norm() at a zero norm, or a learning rate too high), not by the data",
                      "Guard the update: divide by g.norm().clamp_min(1e-12) (or add an epsilon), clip the gradient, "
                      "or lower the learning rate; clamp the tensor in place after each step (x.clamp_(0, 1) under "
                      "torch.no_grad()) if it must stay in range.",
                      step=call.step, source=call.source,
                      details={"module": call.type, "arguments": args, "counts": counts, "optimised_input": True})
            return
        columns = {}
        for name, i in call.inputs:
            t = refs.get(i, lambda: None)() if i in bad else None
            if t is not None and t.dim() == 2 and t.is_floating_point() and 1 < t.shape[1] <= 100_000 \
                    and 0 not in t.stride() and t.numel() <= 1 << 26:
                # a table's rows and features: which feature columns hold NaN/Inf (a constant column z-scored by 0)
                with torch.no_grad():
                    cols = (~torch.isfinite(t.detach())).any(0).nonzero().flatten()[:11].tolist()
                if cols:
                    columns[name] = cols
        where_cols = ", ".join(f"columns {c[:10]}{' ...' if len(c) > 10 else ''} of {n}" for n, c in columns.items())
        self.emit("nonfinite-input", "input",
                  f"the input to {call.path} contains NaN/Inf ({', '.join(args)})"
                  + (f", in {where_cols}" if where_cols else "") + ": the data is dirty, or a value computed for it "
                  f"before the call is",
                  "Check the dataset and transforms for NaN/Inf (e.g. torch.isfinite(x).all() in the Dataset), "
                  "or filter such samples before they reach the model; a value the loop computes for the model (a "
                  "normalisation dividing by a zero std or count, deg.pow(-0.5) of a node with no edges, log of 0) "
                  "needs a clamp or an epsilon where it is made.",
                  step=call.step, source=call.source,
                  details={"module": call.type, "arguments": args, "counts": counts,
                           **({"columns": columns} if columns else {})})

    def _report_output(self, call: _Call, bad: set, refs: Dict[int, weakref.ref], taken: List[str] = (),
                       masked: bool = False, mask_in: List[str] = ()) -> bool:
        module = call.module()
        after = module is not None and self._broken_after(call, module, bad)
        if self._bad_param_names and not after:
            # Weights are already NaN/Inf (found after an optimizer step): every later NaN output is
            # their consequence, and standard layers with such weights passed their input's flag on.
            return True
        bad_params: List[str] = []
        born_bad = True  # every NaN/Inf weight was so before any update, or is frozen (none an update made)
        if module is not None and not after:
            for n, p in module.named_parameters():
                if screenable(p) and not bool(torch.isfinite(p.detach()).all()) and self._born.get(p) != "inf":
                    if self.g.param_name(p) in self._bad_param_names:
                        return True  # a consequence of an already reported nonfinite-param
                    bad_params.append(n)
                    born_bad = born_bad and (self._born.get(p) == "nan" or not p.requires_grad)
        out_counts, in_stats, out_stats = {}, {}, {}
        for name, i in call.outputs:
            t = refs.get(i, lambda: None)()
            if t is not None and i in bad:
                out_counts[name] = nonfinite_counts(t)
                out_stats[name] = finite_stats(t)
        for name, i in call.inputs:
            t = refs.get(i, lambda: None)()
            if t is not None:
                in_stats[name] = finite_stats(t)
        if not out_counts and module is not None:
            self._armed[id(module)] = call.path
        if call.is_root and out_counts and not bad_params and all(
                (n.endswith("['loss']") or n.endswith(".loss")) and c.get("numel") == 1 for n, c in out_counts.items()):
            self._report_inner_loss(call, out_counts)
            return True
        why = (f"its parameters {', '.join(bad_params[:5])} are non-finite" if bad_params
               else f"its inputs held only the NaN/Inf it takes on purpose ({', '.join(taken)}: it handled them on "
                    f"the healthy steps before)" if taken
               else f"its inputs held no NaN, only -inf ({', '.join(mask_in)}: a mask), from which it made NaN: a softmax "
                    f"or logsumexp over a row that is all -inf has nothing to normalise" if mask_in
               else "its inputs were finite")
        if any((call.path, name) in self._handled for name, i in call.outputs if i in bad):
            why += ("; it made NaN/Inf on earlier steps too, which were handled after it (the loss and gradients "
                    "stayed finite), but on this step they reached the loss or the gradients")
        hint = _output_hint(call.type, bool(bad_params))
        # (the output's own graph when the tensor is still alive: keeping its grad_fn per call would keep each step's
        # graph alive, which other checks read; else the ops its forward's source names)
        alive = next((t for name, i in call.outputs if i in bad and (t := refs.get(i, lambda: None)()) is not None), None)
        ops = _graph_ops(alive.grad_fn) if not bad_params and alive is not None and alive.grad_fn is not None else set()
        if not ops and not bad_params and module is not None and not (type(module).__module__ or "").startswith("torch."):
            ops = _source_ops(type(module))  # computed from tensors without autograd history: no node to walk
        call.zeros = _divisor_names(module, call.zeros) if call.zeros and module is not None else None
        if call.zeros and not bad_params and not taken and not mask_in:
            why += (f"; it was called with {', '.join(call.zeros[:3])} equal to 0 (a temperature or scale annealed "
                    f"to 0, which the forward divides by)")
            hint = ("A number argument of the forward reached 0: a Gumbel-softmax or distillation temperature, a "
                    "scale or a step size annealed to 0 makes x / tau Inf or NaN. Keep the schedule above a floor "
                    "(tau = max(tau, 0.1)); the weights are not the cause, so lowering the learning rate will not help.")
        if call.type == "CTCLoss" and call.step in self._ctc_steps and not bad_params:
            hint = CTC_HINT  # a loss module called on its own (a global guard's outermost call)
        if call.type == "KLDivLoss" and not bad_params and module is not None and not getattr(module, "log_target", True):
            # its target is taken as probabilities: log-probabilities there (negative) make target * log(target) NaN
            why += ("; KLDivLoss takes log-probabilities as its input and probabilities as its target "
                    "(log_target=False): a target holding log-probabilities (negative values) gives NaN")
            hint = ("Pass kl(F.log_softmax(student, -1), F.softmax(teacher, -1)) (input first, as log-probabilities; "
                    "target second, as probabilities), or keep both as log-probabilities with "
                    "nn.KLDivLoss(log_target=True); in TRADES the adversarial logits are the input, the clean ones "
                    "the target.")
        if call.type in ("CrossEntropyLoss", "NLLLoss") and not bad_params and not mask_in and not taken \
                and module is not None and getattr(module, "reduction", None) == "mean":
            # finite logits give a finite cross-entropy per row: NaN from the module itself is its mean's 0 / 0
            ii = getattr(module, "ignore_index", -100)
            why += (f"; with reduction='mean' it divides by the weight of the targets that count, and a batch whose "
                    f"every target is ignore_index ({ii}), or whose classes all have weight 0, makes that 0 / 0")
            hint = (f"A batch with no target that counts (all {ii}: unlabelled samples only) has no mean: skip its "
                    f"term (`if (y != {ii}).any():`), or use reduction='sum' divided by "
                    f"(y != {ii}).sum().clamp_min(1); the learning rate is not the cause.")
            details_extra = {"all_ignored": ii}
        else:
            details_extra = None
        if bad_params and call.step == 0 and all(n.rsplit(".", 1)[-1].startswith("original") for n in bad_params) \
                and (call.type == "ParametrizationList" or all(".parametrizations." in n for n in bad_params)):
            # made when the parametrization was registered: its right_inverse maps the weight to the stored one
            hint = ("The stored weight of a parametrization is already NaN/Inf before training: registering it ran "
                    "its right_inverse on the layer's weight (log(W) of a weight with negative entries, a division "
                    "by a zero norm). Make right_inverse defined on that weight (log(W.abs() + eps)), or "
                    "initialise the layer into its domain before registering.")
        user_module = module is not None and not (type(module).__module__ or "").startswith("torch.")
        if not bad_params and not mask_in and not taken and not call.zeros and (call.half or (ops and user_module)):
            if call.half:
                why += "; its output is float16, whose largest value is 65504"
                hint = ("Float16 overflows above 65504: scale attention scores by 1/sqrt(d) before the softmax, keep "
                        "large products out of half precision (autocast in bfloat16, or the op in float32), or "
                        "normalise the inputs; the learning rate is not the cause of a forward that overflows at once.")
            elif {"exp", "log"} <= ops:
                why += "; its forward takes the log of exponentials, which overflow float32 above 88"
                hint = ("Use the stable built-ins: F.softplus(x) for log(1 + exp(x)), torch.logsumexp(z, dim) for "
                        "log(sum(exp(z))), F.log_softmax for log(softmax).")
            elif ops & set(_DOMAIN_HINTS):
                named = [o for o in _DOMAIN_HINTS if o in ops and o != "division"] or [o for o in _DOMAIN_HINTS if o in ops]
                why += f"; its forward computes {', '.join(named[:4])}, NaN/Inf outside its domain"
                hint = "Look at those ops' inputs: " + "; ".join(_DOMAIN_HINTS[o] for o in named[:4]) + "."
        if not bad_params and not mask_in and not taken and not call.zeros and module is not None \
                and not (type(module).__module__ or "").startswith("torch.") and _writes_neg_inf(type(module)):
            # a forward of the user's that fills -inf itself (masked_fill(pad, float('-inf')) before a softmax): a row
            # masked whole (an empty document, a sequence of padding only) has nothing to normalise, and is NaN
            why += ("; its forward fills -inf itself (masked_fill before a softmax), and a row masked whole, all "
                    "padding, gives softmax 0/0 = NaN")
            hint = ("Keep at least one entry per row unmasked (drop empty sequences in the data, or unmask one "
                    "position: mask[:, 0] = False), or fill with torch.finfo(x.dtype).min instead of -inf, which gives "
                    "a uniform row instead of NaN; zeroing the NaN rows after the softmax is not enough: their "
                    "backward still makes NaN gradients.")
        if mask_in and not bad_params:
            hint = ("Leave at least one entry per row unmasked, or give fully masked rows a finite score before the "
                    "softmax (scores.masked_fill(torch.isneginf(scores).all(-1, keepdim=True), 0.0)); zeroing or dropping the NaN rows after "
                    "it is not enough: their backward still makes NaN gradients (0 * NaN). " + MASK_HINT)
            if mask_in == ["args[0]"] and not call.is_root and not _scores_module(call.type):
                # the data a layer transforms is no mask: a logarithm of 0 made it, in the model's forward before it
                why = (f"its inputs held no NaN, only -inf (args[0], the data it transforms), from which it made NaN: "
                       f"the -inf was made before it from finite values, most often a logarithm of an exact 0 "
                       f"(torch.log(x), a logit log(x) - log1p(-x) of a pixel at 0 or 1, log of a probability that "
                       f"underflowed)")
                hint = ("Keep the logarithm's argument off 0 where the -inf is made: x.clamp_min(eps) before torch.log, "
                        "a logit of alpha + (1 - 2 * alpha) * x (RealNVP's alpha = 0.05) instead of x, "
                        "F.log_softmax instead of softmax().log(), torch.special.xlogy(p, p) for p * log(p). A mask of "
                        "-inf belongs in attention scores, not in the data a layer transforms.")
        where, what = call.path, f"{call.path} ({call.type})"
        if bad_params and born_bad and module is not None and not all(
                n.rsplit(".", 1)[-1].startswith("original") for n in bad_params):  # (a parametrization: its hint above)
            # weights NaN/Inf from the start (pretrained vectors whose out-of-vocabulary rows were never filled, a bad
            # checkpoint) or frozen: no update made them; named at the submodule holding them
            owner = bad_params[0].rpartition(".")[0]
            if owner and all(n.rpartition(".")[0] == owner for n in bad_params):
                sub = module.get_submodule(owner)
                where, what = (self.g.path_of(sub) or owner), f"{owner} ({type(sub).__name__})"
            why = (f"its parameters {', '.join(bad_params[:5])} are NaN/Inf and were so before any optimizer update"
                   + (" (frozen: no update touches them)" if all(
                       not p.requires_grad for n, p in module.named_parameters() if n in bad_params) else ""))
            hint = ("Repair the weights where they are made: pretrained vectors with unfilled rows (words missing "
                    "from the embedding file) need those rows filled (w[torch.isnan(w).any(1)] = 0, or small random "
                    "vectors) before Embedding.from_pretrained; a checkpoint holding NaN needs an earlier one; "
                    "weights the code writes itself, outside any optimizer (load_state_dict of an average or a "
                    "server update that divides by 0: FedNova's local steps, a weight of 0 clients), need that "
                    "division guarded. The learning rate is not the cause.")
        if masked and not bad_params:
            # a forward that writes no mask: an underflow to 0 before a log (probabilities multiplied in linear space)
            no_mask = module is not None and not _masks_in(type(module))
            exp_log = {"exp", "log"} <= ops
            self.emit("nonfinite-output", where,
                      f"{what} produced -inf (and no NaN or +inf) from finite inputs, and NaN/Inf followed in the "
                      f"loss or the gradients: " + (
                          ("its forward masks nothing and takes the log of exponentials: a sum of exp that "
                           "underflowed to 0 (log 0 = -inf) or overflowed to inf above 88 (z - log(inf) = -inf)"
                           if exp_log else
                           "its forward masks nothing, so the -inf is log(0): of a quantity that is 0 (a silent "
                           "frame's power, a zero count) or of a probability that underflowed to 0") if no_mask else
                          "if the -inf is a mask (masked_fill(~mask, float('-inf'))), what is computed from it made "
                          "the NaN"),
                      ("Compute in log space with the stable built-ins, which subtract the maximum first: "
                       "torch.logsumexp(z, dim), F.log_softmax(z, dim), F.softplus(x); an epsilon inside the log does "
                       "not fix an overflow and only hides an underflow." if exp_log and no_mask else
                       "A quantity that can be 0: add an epsilon inside the log (torch.log(x + 1e-6), "
                       "x.clamp_min(1e-10).log()). A probability or product computed in linear space that underflowed "
                       "(a mixture's log(sum(pi * exp(logp))), an HMM's forward recursion over many steps): compute in "
                       "log space, logsumexp(log(pi) + logp), log_softmax instead of log(softmax), or scale each step; "
                       "an epsilon there only hides the underflow and biases the likelihood.") if no_mask else
                      MASK_HINT + " If the -inf is not meant, it is most often log(0) (the log power of a silent or "
                      "padded frame, a zero probability): add an epsilon inside the log (torch.log(x + 1e-6), "
                      "x.clamp_min(1e-10).log()); otherwise this module overflowed: clamp its inputs or lower the "
                      "learning rate.",
                      step=call.step, source=call.source,
                      details={"module": call.type, "counts": {n: nonfinite_counts(t) for n, i in call.outputs
                                                               if i in bad and (t := refs.get(i, lambda: None)()) is not None},
                               "only_neg_inf": True, "nonfinite_params": [],
                               **({"no_mask_in_forward": True} if no_mask else {})})
            return True
        huge = self._huge_weights(module) if module is not None and not bad_params else []
        inf_buffers, inf_params = [], []
        if module is not None and not bad_params and not huge:
            # (read when reporting only) a buffer of the module's own holding +-inf: a hard constraint (forbidden CRF
            # transitions) that a path the data takes meets, where -inf - -inf or 0 * -inf makes NaN
            # Running statistics of a norm layer in training mode are written by this very call and unused by it: NaN
            # there is the NaN made upstream in the module, not its cause.
            written = {f"{n}.{b}" if n else b for n, m in module.named_modules()
                       if isinstance(m, nn.modules.batchnorm._NormBase) and m.training
                       for b in ("running_mean", "running_var")}
            inf_buffers = [n for n, b in module.named_buffers()
                           if n not in written and screenable(b) and not bool(torch.isfinite(b).all())]
            # the same constraint kept as a parameter that held +-inf before any update (`transitions` of a CRF)
            inf_params = [n for n, p in module.named_parameters()
                          if self._born.get(p) == "inf" and screenable(p) and not bool(torch.isfinite(p.detach()).all())]
        nan_buffers = [n for n in inf_buffers if bool(torch.isnan(dict(module.named_buffers())[n]).any())]
        if nan_buffers:
            why = (f"its inputs were finite, but its buffer {', '.join(f'`{n}`' for n in nan_buffers[:3])} holds NaN "
                   f"(statistics computed from data with NaN in it: a mean or std over a dataset with missing "
                   f"readings), and every output that uses it is NaN")
            hint = ("Compute the statistics from clean data: drop or impute the NaN readings first, or use "
                    "torch.nanmean and a NaN-aware std; then check the buffer once after filling it "
                    "(torch.isfinite(buf).all()).")
        elif inf_buffers or inf_params:
            held = (f"buffer {', '.join(f'`{n}`' for n in inf_buffers[:3])}" if inf_buffers else
                    f"parameter {', '.join(f'`{n}`' for n in inf_params[:3])}")
            why = (f"its inputs were finite, but its {held} holds "
                   f"-inf/inf (a hard constraint, such as forbidden CRF transitions): a path the data takes meets it, "
                   f"and -inf - -inf or 0 * -inf is NaN")
            hint = ("Use a large finite value for forbidden entries (-1e4 rather than -inf), or check that the gold "
                    "sequences respect the constraints (a noisy label that takes a forbidden transition); a "
                    "logsumexp over rows that are all -inf is -inf, and its difference with itself NaN.")
        module_masks = call.masks if not bad_params and not huge and module is not None else None
        rows = _fully_masked(module, module_masks, next((refs.get(i, lambda: None)() for name, i in call.outputs
                                                          if i in bad), None)) if module_masks else None
        if rows is not None:
            samples = int(rows.all(-1).sum())
            why = (f"its inputs were finite, but {int(rows.sum())} of its query rows have every key masked"
                   + (f" ({samples} sample(s) with no key left at all)" if samples else "")
                   + ": softmax over keys that are all -inf is 0/0 = NaN")
            hint = ("Leave at least one key unmasked for every query: a sample whose keys are all padding (an empty or "
                    "missing stream) needs a placeholder key (a learned null token) or to be left out of the batch. "
                    "Check the mask's convention too: torch's key_padding_mask and boolean attn_mask are True where "
                    "a key is IGNORED, the opposite of a Hugging Face attention_mask (1 = keep): pass "
                    "`key_padding_mask=~attention_mask.bool()`.")
            if not samples and module_masks[2] is not None and module_masks[1] is not None:
                # no sample without keys: queries whose causal window holds only padding (left-padded histories,
                # SASRec): the leading pad positions see nothing but pad keys
                why += ("; no sample is empty: with the causal attn_mask, the leading positions of left-padded "
                        "sequences see only padding keys")
                hint = ("Pad on the right (the causal window of every real position then starts at a real key), or let "
                        "each padding query attend to itself (unmask the diagonal of the combined mask) and mask their "
                        "outputs and loss afterwards; dropping such samples would drop every left-padded sequence.")
        if huge:
            # The standard layers inside are not screened one by one: their weights say which one overflowed.
            owners = list(dict.fromkeys(owner for _, _, owner in huge))
            shown = ", ".join(f"{n} up to {v:.1e}" for n, v, _ in huge[:3]) + (" ..." if len(huge) > 3 else "")
            if len(owners) == 1:
                path = self.g.known_path(owners[0]) or call.path
                where, what = path, f"{path} ({type(owners[0]).__name__})"
                why = f"its inputs were finite but its weights are huge ({shown}), so it overflowed float32's range"
            else:
                why = (f"its inputs were finite but the weights of {len(owners)} of its layers are huge ({shown}): "
                       f"one of them overflowed float32's range")
            hint = ("The weights grew far beyond normal: the learning rate is too high or a scheduler keeps raising "
                    "it (a LambdaLR factor above 1), or a loaded checkpoint is corrupt. Lower the learning rate, "
                    "check the scheduler's factor, and clip gradients (torch.nn.utils.clip_grad_norm_).")
        self.emit("nonfinite-output", where,
                  f"{what} produced NaN/Inf; {why}",
                  hint,
                  step=call.step, source=call.source,
                  details={"module": call.type, "counts": out_counts, "input_stats": in_stats,
                           "output_stats": out_stats, "nonfinite_params": bad_params,
                           **({"fully_masked_rows": int(rows.sum())} if rows is not None else {}),
                           **({"huge_weights": {n: v for n, v, _ in huge[:20]}} if huge else {}),
                           **({"nonfinite_buffers": inf_buffers[:20]} if inf_buffers else {}),
                           **({"constraint_params": inf_params[:20]} if inf_params and not inf_buffers else {}),
                           **({"zero_arguments": call.zeros} if call.zeros and not bad_params else {}),
                           **({"before_any_update": True} if bad_params and born_bad else {}),
                           **(details_extra or {})})
        return True

    def _report_inner_loss(self, call: _Call, counts: Dict[str, Any]) -> None:
        """Only the loss a model computes inside its forward (HF's ``labels=``) is NaN/Inf: the loss, not the model."""
        names = ", ".join(counts)
        self.emit("nonfinite-loss", "loss",
                  f"the loss {call.path} computed inside its forward ({names}) is NaN/Inf while its other outputs "
                  f"were finite: a mean over zero elements is NaN, such as a batch whose labels are all -100 "
                  f"(prompt-only or truncated samples, an empty packed sequence)",
                  "Skip batches with no supervised token (if (labels != -100).any(): ...) or drop samples whose "
                  "labels are all -100 in the collator; a loss written by hand can divide by the count clamped to 1: "
                  "(per_token * mask).sum() / mask.sum().clamp_min(1).",
                  step=call.step, source=call.source,
                  details={"module": call.type, "counts": counts, "outputs": list(counts), "inside_model": True})

    def _huge_weights(self, module: nn.Module) -> List[Tuple[str, float, nn.Module]]:
        """Finite weights of `module` far beyond any trained network's (looked at on a bad step only):
        (name, largest |value|, the module holding it), largest first."""
        found = []
        for mname, owner in module.named_modules():
            for pname, p in owner.named_parameters(recurse=False):
                if screenable(p):
                    v = float(p.detach().abs().amax())
                    if HUGE_WEIGHT < v < _INF:
                        found.append((f"{mname}.{pname}" if mname else pname, v, owner))
        return sorted(found, key=lambda e: -e[1])

    def _report_grads(self, gn, step: int, source: Optional[str], masked: bool = False,
                      taken_input: Optional[Tuple[str, List[str]]] = None, loss_seen: bool = True,
                      graphs: Optional[list] = None, model_unseen: bool = False, by_hand: bool = False) -> None:
        values = gn.per_param()
        names = [n for n, v in zip(gn.names, values) if v != v or v in (float("inf"), float("-inf"))]
        if not names or step == self._grads_told:
            return  # (one finding a step: a global guard sees the gradients at backward() and again at step())
        self._grads_told = step
        nan = any(v != v for v in values)
        if nan and not graphs:  # the last backward's graph, looked at on this error path only
            last = self._last_loss() if self._last_loss is not None else None
            graphs = [last.grad_fn] if last is not None and last.grad_fn is not None else []
        if not nan and taken_input is None and not masked:
            # an infinite norm of finite elements: float32's sum of squares overflows past 3.4e38 (|g| ~ 1e20)
            huge = _overflowed_norms(gn.params, values)
            if huge is not None and len(huge) == len(names):
                self._report_huge_grads(gn, huge, step, source)
                return
        extra = ""
        if taken_input is not None:
            extra = (f" while the loss and {taken_input[0]}'s outputs were finite: its input held NaN/Inf "
                     f"({', '.join(taken_input[1])}) that it kept out of its outputs")
            hint = ("A backward through NaN/Inf makes NaN even where the forward masked it: torch.where(mask, f(x), 0) "
                    "(or masked_fill, or indexing after f) over NaN entries still multiplies NaN by 0 in f's "
                    "backward. Replace the NaN before computing with it: f(torch.where(mask, x, 0)) (a second where "
                    "on the input), or torch.nan_to_num(x) first; the same holds for NaN targets in a masked loss.")
        elif nan:
            # the forward and the loss were finite (else their origin was reported): NaN made by the backward
            hint = (("The forward and the loss were finite" if loss_seen else "No NaN/Inf was seen in the forward")
                    + ": NaN made by the backward comes from 0 * inf there. "
                    "torch.where(mask, f(x), 0) or a masked loss over NaN/Inf values (targets marked missing with "
                    "NaN, log or sqrt of the masked entries) still back-propagates NaN from the masked branch: "
                    "replace them first (f(torch.where(mask, x, safe)), torch.nan_to_num(y)). sqrt or a norm at "
                    "exactly 0 has an infinite derivative (add an eps), and so does logsumexp over a row that is "
                    "all -inf. An overflow of the backward itself (an exploding loss) is rare in float32: clip "
                    "gradients (torch.nn.utils.clip_grad_norm_) if their norms grew before.")
            steep = _steep_ops(graphs) if graphs else []
            if steep:
                hint = ("; ".join(_STEEP_HINTS[o] for o in steep[:2]) + ". Otherwise: " + hint)
            if by_hand:
                # no backward() and no model call at this step: torch.func per-sample gradients written into .grad
                hint = ("No backward() ran at this step: these gradients were written into .grad by hand (per-sample "
                        "gradients from torch.func.grad/vmap, clipped and noised for DP-SGD; a Reptile or evolution-"
                        "strategies update). Look at that arithmetic first: a normalisation by a norm that can be 0 "
                        "(g / g.norm() of an all-zero per-sample gradient is 0/0); clip with "
                        "g * (C / (norm + 1e-6)).clamp(max=1.0), and add an eps inside any log or sqrt there.")
            elif model_unseen:
                # a compiled train step (module hooks compiled away) or a module guard never saw: nothing was screened
                hint = ("No call of the watched model was seen at this step (compiled code skips module hooks, see "
                        "guard's notice), so its inputs, outputs and loss were not screened: look first for NaN/Inf "
                        "in the batch and the loss (torch.isfinite(x).all()), or call the model outside the compiled "
                        "function for guard to name the origin. Otherwise: " + hint[0].lower() + hint[1:])
        else:
            hint = ("The backward pass overflowed (e.g. sqrt/log/pow at 0, division by a tiny value, or an exploding "
                    "loss): clip with torch.nn.utils.clip_grad_norm_, lower the learning rate, or use AMP's GradScaler "
                    "which skips such steps.")
        if nan and taken_input is None:
            bad = [p for p, n in zip(gn.params, gn.names) if n in names]
            # (a parameter used k times in the loss graph has its gradient summed in place k - 1 times by autograd)
            uses = _leaf_uses(graphs, {id(p) for p in bad}) if bad else {}
            if bad and all(p.grad is not None and p.grad._version > max(0, uses.get(id(p), 1) - 1) for p in bad):
                # written in place since backward made them (or added to by several backwards): code that edits .grad
                # between backward() and step(), a rescale by a norm that is 0, makes 0 * inf there. All of them: a
                # layer applied twice has its gradient accumulated in place by autograd itself, the others not.
                hint = ("Their gradients were changed in place after backward() made them (their version counters "
                        "moved, as they also do under zero_grad(set_to_none=False) or several backward() calls per "
                        "step): look first at code that edits .grad before step(), a rescale by a norm that can be 0 "
                        "(p.grad.mul_(1 / total_norm) when every gradient is 0, a hinge or margin already met): use "
                        "torch.nn.utils.clip_grad_norm_ (it adds an eps) or divide by total_norm.clamp_min(1e-6). "
                        "Otherwise: " + hint)
        if masked:
            # the forward was finite apart from -inf masks: the backward of an expression over them made the NaN
            hint = ("The model's outputs held -inf (a mask) and the loss was finite: a torch.where(mask, f(x), 0) "
                    "over the masked values still back-propagates NaN from f at -inf (0 * -inf in p * log p). "
                    + MASK_HINT)
        self.emit("nonfinite-grad", names[0],
                  f"{len(names)} parameter gradient(s) are NaN/Inf: {', '.join(names[:5])}"
                  + (" ..." if len(names) > 5 else "")
                  + (" while the loss was finite and the model's outputs held -inf masks but no NaN" if masked else extra),
                  hint, step=step, source=source,
                  details={"parameters": names[:20], "count": len(names), **({"masked_outputs": True} if masked else {}),
                           **({"taken_input": taken_input[1]} if taken_input is not None else {})})

    def _model_unseen(self) -> bool:
        """Whether guard watches models of which no call was seen at all in this run (compiled away)."""
        w = self.g.watched
        return bool(self.g.roots) and not w.module_ids and not w.scripted

    def _report_huge_grads(self, gn, huge: List[Tuple[int, float]], step: int, source: Optional[str]) -> None:
        names = [gn.names[i] for i, _ in huge]
        top = max(v for _, v in huge)
        kinds = {type(o).__name__ for o in self.g.optimizers}
        adaptive = not kinds or any(k.startswith(("Adam", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "Adafactor"))
                                    for k in kinds)
        how = ("Adam then divides by sqrt(inf) and freezes those weights, SGD moves them by lr * |g|" if adaptive else
               f"{'/'.join(sorted(kinds))} moves them by lr * |g|, far out of range")
        hint = (f"The gradients explode: {how}. Find what grows without bound (a recurrence whose eigenvalues exceed 1 "
                f"in modulus, parametrise them as exp(-exp(nu)); a loss multiplied by a huge factor; a learning rate "
                f"too high), and clip gradients (torch.nn.utils.clip_grad_norm_) once it is bounded.")
        scale = self._input_scale()
        if scale is not None:
            hint = (f"The model's input averages {scale:.3g}: raw features in their own units "
                    f"(incomes, prices, counts) make gradients of that size times the error, and each step overshoots "
                    f"further. Standardise each input column with the training data's statistics, x = (x - mean) / "
                    f"std (and a regression target likewise), before any other change. " + hint)
        self.emit("nonfinite-grad", names[0],
                  f"{len(names)} parameter gradient(s) have norms that overflow float32 to inf: {', '.join(names[:5])}"
                  + (" ..." if len(names) > 5 else "") + f"; their elements are finite but as large as {top:.3g}, "
                  f"so anything that squares them (the norm, Adam's exp_avg_sq) is inf",
                  hint, step=step, source=source,
                  details={"parameters": names[:20], "count": len(names), "finite_elements": True,
                           "largest_abs": top, **({"input_scale": scale} if scale is not None else {})})

    def _input_scale(self) -> Optional[float]:
        """The mean |value| of the last model call's one input (from its screened sum) when it is beyond INPUT_SCALE
        (raw, unstandardised features), else None. Read when reporting only."""
        if self._root_in is None:
            return None
        total, n = self._root_in
        if not n or not total.is_floating_point() or total.is_meta:
            return None
        v = abs(float(total)) / n
        return v if math.isfinite(v) and v >= INPUT_SCALE else None

    def _edited_since_update(self) -> bool:
        """Whether the first weight of the last stepped optimizer was changed in place since that update."""
        pid, version = self._post_version
        for o in self.g.optimizers:
            groups = o.param_groups
            if groups and groups[0]["params"] and id(groups[0]["params"][0]) == pid:
                return groups[0]["params"][0]._version != version
        return False

    def _bad_lr(self, params: List[torch.Tensor]) -> Optional[str]:
        """The NaN/Inf learning rate of a param group holding one of `params` (as text), if any."""
        ids = {id(p) for p in params}
        for o in self.g.optimizers:
            for grp in o.param_groups:
                lr = grp.get("lr")
                if isinstance(lr, float) and not math.isfinite(lr) and any(id(p) in ids for p in grp["params"]):
                    return repr(lr)
        return None

    def _ran_clean(self, group: List[torch.Tensor]) -> bool:
        """Whether a model holding some of `group` was called after their last update with finite values."""
        ids = {id(p) for p in group}
        return any(m is not None and any(id(q) in ids for q in m.parameters())
                   for m in (ref() for ref in self._clean_after))

    def _report_params(self, group: List[torch.Tensor], step: int, source: Optional[str], caused: bool) -> bool:
        bad = [self.g.param_name(p) for p in group if not bool(torch.isfinite(p.detach()).all())]
        new = [n for n in bad if n not in self._bad_param_names]
        self._bad_param_names.update(bad)
        if not new or caused:
            return False  # already known, or the step's gradients were NaN/Inf (reported upstream)
        screened = step in self._screened
        # During an update (an LBFGS closure's later evaluations), weights changed since the last update are
        # this update's own trial points, not an edit after it.
        during = self._in_update is not None
        edited = [self.g.param_name(p) for p in group] if not during and self._edited_since_update() else []
        if during:
            why = (f"; found by a forward inside optimizer.step() (its closure, evaluated again by the optimizer at "
                   f"the trial weights it moved to), so this update's own steps made them NaN/Inf")
            hint = ("The optimizer's steps inside step(closure) diverged: with LBFGS use line_search_fn='strong_wolfe' "
                    "and a lower lr (and max_iter), make sure the closure calls optimizer.zero_grad() before backward(), "
                    "and that the loss is finite and bounded below at the starting weights.")
        elif screened and not edited and self._ran_clean(group):
            why = (f"; the model's calls after that update had finite inputs and outputs, so they became NaN/Inf "
                   f"later, changed outside the optimizer")
            hint = ("Look at what changes the weights after optimizer.step(): an update by hand (a zeroth-order or "
                    "evolution-strategies step through p.data, a perturbation that is not restored, a projection "
                    "dividing by a norm of 0). Through .data no version counter moves, so guard cannot name the line: "
                    "check those updates with torch.isfinite, and bound the step they take.")
            edited = bad
        elif screened and edited:
            # changed in place after the update returned: the change, not the update, may have made the NaN
            why = (f"; they were changed in place after that update ({', '.join(edited[:3])}: their version counters "
                   f"moved since optimizer.step() returned), so that change, made before step {step + 1}'s forward, "
                   f"may have made them NaN/Inf rather than the update")
            hint = ("Look at what changes the weights in place between optimizer.step() and the next forward (a "
                    "SAM-style perturbation rho * g / grad_norm: 0/0 when every gradient is 0, so add an eps, "
                    "rho / (grad_norm + 1e-12); an EMA or Lookahead swap; an update by hand). If it is innocent, the "
                    "update overflowed: lower the learning rate, check eps=0 or a huge momentum, and clip gradients.")
        elif screened and self._bad_lr(group):
            # the rate itself is NaN/Inf (a Polyak step loss / ||g||^2 at 0/0, a schedule's factor): no overflow
            why = f"; the learning rate of their optimizer is {self._bad_lr(group)}"
            hint = ("The learning rate itself became NaN/Inf: a step size computed from the batch (loss / ||g||^2, "
                    "a Polyak or line-search step) divides by zero when the gradients are 0; add an eps to the "
                    "denominator (loss / (gsq + 1e-8)) and skip the update when it is not finite.")
        elif screened:
            why = ""
            hint = ("The update itself overflowed although the gradients were finite: lower the learning rate, "
                    "check optimizer settings such as eps=0 or a huge momentum, and clip gradients.")
        else:  # every=N: that step's inputs, loss and gradients were not looked at
            why = (f" (step {step} was not screened: every={self.g.config.every} samples the NaN/Inf checks, so "
                   f"a NaN input, loss or gradient of that step may be the cause)")
            hint = ("Run with every=1 (the default) to see where NaN/Inf first appears; if the gradients were "
                    "finite, the update overflowed: lower the learning rate, check eps=0 or a huge momentum, and "
                    "clip gradients.")
        self.emit("nonfinite-param", bad[0],
                  f"after optimizer.step() {len(bad)} parameter(s) are NaN/Inf: {', '.join(bad[:5])}"
                  + (" ..." if len(bad) > 5 else "") + why,
                  hint, step=step, source=source,
                  details={"parameters": bad[:20], "count": len(bad), "grads_screened": screened,
                           **({"changed_after_update": edited[:20]} if screened and edited else {})})
        return True


CTC_HINT = ("CTC's loss is infinite for an utterance with no valid alignment: its input (after the model's "
            "subsampling) is shorter than its target, plus one frame between repeated labels. Pass zero_infinity=True "
            "(nn.CTCLoss(zero_infinity=True)), or drop such utterances (keep input_lengths >= target_lengths); check "
            "that input_lengths are counted after subsampling.")

_FORWARD_KINDS = ("nonfinite-input", "nonfinite-output", "nonfinite-loss")
_NEG_INF = float("-inf")
_INF = float("inf")
MASK_HINT = ("Arithmetic on -inf makes NaN: 0 * -inf (an entropy sum(p * log_softmax(logits)) where p is 0), "
             "-inf - -inf, and torch.where(mask, f(x), 0), whose backward still gets NaN from the masked branch. Use "
             "torch.distributions.Categorical(logits=...).entropy(), torch.special.xlogy(p, p), or zero the masked "
             "entries before the product (log_p.masked_fill(~mask, 0)); or mask with torch.finfo(x.dtype).min "
             "instead of -inf.")
#: a weight this large is no trained network's: a blown-up update (float32 overflows at 3.4e38)
HUGE_WEIGHT = 1e10


def _overflowed_norms(params: List[torch.Tensor], norms: List[float]) -> Optional[List[Tuple[int, float]]]:
    """(index, largest |element|) of each parameter whose gradient norm is inf while every element is finite; None
    when some infinite norm has an infinite element (read on the error path only)."""
    out = []
    for i, (p, v) in enumerate(zip(params, norms)):
        if v != _INF:
            continue
        g = p.grad
        if g is None or g.is_sparse:
            return None
        g = g.detach()
        if not bool(torch.isfinite(g).all()):
            return None
        out.append((i, float(g.abs().amax())))
    return out


_MASK_WORDS = re.compile(r"mask|inf\b|finfo|float\(\s*['\"]-?inf")


@functools.lru_cache(maxsize=256)
def _masks_in(cls: type) -> bool:
    """Whether `cls`'s forward (source read once per class) may write a mask: it names a mask, -inf or finfo; True
    when its source cannot be read (a built-in module: its mask is an argument)."""
    fwd = getattr(cls, "forward", None)
    if fwd is None or (getattr(cls, "__module__", "") or "").startswith("torch."):
        return True
    try:
        return bool(_MASK_WORDS.search(inspect.getsource(fwd)))
    except (OSError, TypeError):
        return True


_NEG_INF_FILL = re.compile(r"""(float\(\s*['"]-inf['"]\s*\)|-\s*(math|torch|np|numpy)\.inf\b|-float\(\s*['"]inf['"]\s*\))""")


def _writes_neg_inf(cls: type) -> bool:
    """Whether `cls`'s forward (source read on the error path) writes -inf itself: `masked_fill(..., float('-inf'))`."""
    fwd = getattr(cls, "forward", None)
    try:
        return fwd is not None and bool(_NEG_INF_FILL.search(inspect.getsource(fwd)))
    except (OSError, TypeError):
        return False


def _only_neg_inf(t: torch.Tensor) -> bool:
    """Whether -inf is the one non-finite value in `t` (no NaN, no +inf); read on the error path only."""
    d = t.detach()
    return not bool(torch.isnan(d).any()) and not bool((d == _INF).any())


# Ops with a restricted domain, by autograd node, as the hint names them (in this order)
#: loss targets kept per step, read only when the loss is NaN/Inf (a detection loss written per image: 2 a box)
TARGETS = 32

_DOMAIN_OPS = {"StdBackward0": "std", "VarBackward0": "std", "StdMeanBackward0": "std", "VarMeanBackward0": "std",
               "ExpBackward0": "exp", "AcosBackward0": "acos", "AsinBackward0": "asin", "AtanhBackward0": "atanh", "LogBackward0": "log",
               "Log2Backward0": "log", "Log10Backward0": "log", "Log1pBackward0": "log1p", "SqrtBackward0": "sqrt",
               "RsqrtBackward0": "rsqrt", "PowBackward0": "pow", "PowBackward1": "pow", "DivBackward0": "division",
               "ReciprocalBackward0": "division"}
_DOMAIN_HINTS = {
    "std": "std() and var() of one element are NaN (the unbiased estimate divides by n - 1 = 0): a last minibatch of "
           "one sample when advantages or features are normalised per minibatch; use drop_last, or "
           "x.std(unbiased=False), or normalise over the whole rollout",
    "acos": "acos/asin of a value outside [-1, 1] is NaN, and a cosine of normalised vectors rounds to 1.0000001: "
            "clamp it first, cos.clamp(-1 + 1e-7, 1 - 1e-7); a value far above 1 (print cos.abs().max()) is no cosine: "
            "L2-normalise both sides of the dot product (a margin head's class weights too, F.normalize(W)), which "
            "a clamp would not fix",
    "asin": "asin of a value outside [-1, 1] is NaN: clamp it to [-1 + 1e-7, 1 - 1e-7] first",
    "atanh": "atanh of +-1 is Inf and outside (-1, 1) NaN: clamp it to [-1 + 1e-6, 1 - 1e-6]",
    "log": "log(0) is -Inf and log of a negative value NaN: a value the model predicts and that must be positive "
           "(a standard deviation, a rate) needs a positive parameterisation, F.softplus(raw) + 1e-6 or raw.exp() "
           "(clamping a negative one leaves it stuck with no gradient); a probability needs an epsilon "
           "(p.clamp_min(1e-8), log(1 - tanh(u)^2 + 1e-6)) or the computation in log space; the log of data with "
           "no gradient (ground-truth depths of 0 at invalid pixels, counts of 0) is not in the graph but gives -inf "
           "too: mask those entries before the log",
    "log1p": "log1p of a value <= -1 is -Inf or NaN",
    "sqrt": "sqrt of a negative value is NaN (a variance computed as E[x^2] - E[x]^2 cancels below 0 for data far "
            "from 0: compute it in two passes, ((x - mu) ** 2).mean(), or x.var(unbiased=False), in float32)",
    "rsqrt": "rsqrt of 0 is Inf and of a negative value NaN: add an eps, (v + 1e-5).rsqrt()",
    "pow": "a fractional power of a negative value is NaN and a negative power of 0 Inf",
    "division": "a division by 0 is Inf (0/0 NaN): add an eps to the denominator or clamp it",
    "exp": "exp of a value above 88 overflows float32 to Inf (an unconstrained model output exponentiated, a "
           "density or rate: use softplus, or clamp before exp), and Inf times 0 is NaN; when its input is bounded "
           "(a PPO ratio exp(logp - old_logp)), look at the values without gradient the loss multiplies by, which "
           "are not in the graph (advantages normalised by the std() of a minibatch of one sample: NaN)",
}


# Ops whose derivative is infinite at a finite point of their input, by autograd node: the forward is finite there and
# the backward makes 0 * inf (read when gradients are NaN from a finite loss)
# (torch's norms and cdist take a subgradient of 0 at a vector of zeros: not among them)
_STEEP_OPS = {"CtcLossBackward0": "ctc", "AcosBackward0": "acos", "AsinBackward0": "asin", "SqrtBackward0": "sqrt"}
_STEEP_HINTS = {
    # (first: an infinite CTC loss is there to be found, and a filter after it hides it from the forward)
    "ctc": "ctc_loss (in the loss graph) gives NaN gradients for an utterance whose loss is inf (no valid alignment: "
           "its input, after the model's subsampling, shorter than its target plus one frame between repeated "
           "labels), even when that loss is dropped afterwards (an isfinite filter or torch.where over the "
           "per-utterance losses): pass zero_infinity=True (nn.CTCLoss(zero_infinity=True) zeroes such losses and "
           "their gradients); and for log-probs of -inf (classes masked with -inf before log_softmax), which "
           "zero_infinity does not cover: mask with torch.finfo(x.dtype).min instead of -inf",
    "acos": "acos (in the loss graph) has an infinite derivative at exactly 1 or -1, reached when two rotations or "
            "directions match (a geodesic loss acos((tr(R1^T R2) - 1) / 2) at a perfect prediction): clamp its input "
            "to [-1 + 1e-7, 1 - 1e-7]",
    "asin": "asin (in the loss graph) has an infinite derivative at exactly 1 or -1: clamp its input to "
            "[-1 + 1e-7, 1 - 1e-7]",
    "sqrt": "sqrt (in the loss graph) has an infinite derivative at exactly 0, a distance between identical points "
            "(a Chamfer or end-point error, an edge feature of a point to itself): add an eps inside, "
            "torch.sqrt(d2 + 1e-12)",
}


def _steep_ops(graphs: List[Any], budget: int = 256) -> List[str]:
    """The ops with an infinite derivative at a finite point (`_STEEP_OPS`) in the loss graph, in hint order."""
    found = {op for n in walk(graphs, Budget(budget)) if (op := _STEEP_OPS.get(type(n).__name__)) is not None}
    return [o for o in _STEEP_HINTS if o in found]


_SOURCE_OPS = (("sqrt", re.compile(r"(?<!r)sqrt\(")), ("rsqrt", re.compile(r"rsqrt\(")),
               ("log", re.compile(r"\blog\(|\.log\(\)")), ("exp", re.compile(r"\bexp\(|\.exp\(\)")),
               ("acos", re.compile(r"acos\(")), ("asin", re.compile(r"asin\(")))


def _source_ops(cls: type) -> set:
    """The restricted-domain ops a user module's forward names in its source (read on the error path only)."""
    try:
        src = inspect.getsource(cls.forward)
    except (OSError, TypeError, AttributeError):
        return set()
    return {op for op, pattern in _SOURCE_OPS if pattern.search(src)}


def _clamped_below(node: Any, depth: int = 3) -> bool:
    """Whether a clamp lies within `depth` nodes under `node` through elementwise arithmetic (log(1 - p.clamp(...)))."""
    frontier = [node]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            try:
                kids = [k for k, _ in n.next_functions if k is not None]
            except Exception:
                continue
            for k in kids:
                name = type(k).__name__
                if name.startswith("Clamp"):
                    return True
                if name.startswith(("Rsub", "Sub", "Add", "Neg", "Mul", "Div")):
                    nxt.append(k)
        frontier = nxt
    return False


def _op_of(node: Any) -> Optional[str]:
    """The restricted-domain op (`_DOMAIN_OPS` name) an autograd node computes, if any: a whole power is none, and
    neither is a log or sqrt of a clamped input (log(1 - p.clamp(1e-4, 1 - 1e-4)))."""
    op = _DOMAIN_OPS.get(type(node).__name__)
    if op == "pow":
        e = getattr(node, "_saved_exponent", None)  # a scalar exponent outlives backward; a whole one is fine
        if isinstance(e, (int, float)) and float(e).is_integer() and e >= 0:
            return None
    elif op in ("log", "sqrt", "rsqrt") and _clamped_below(node):
        return None
    elif op == "sqrt" and _sum_of_squares(node):
        return None  # a distance, sqrt((a - b).pow(2).sum()): never negative, so never NaN in the forward
    return op


def _sum_of_squares(node: Any, budget: int = 32) -> bool:
    """Whether the input of a sqrt node is a sum of squares (or a square), which cannot be negative: squares, summed
    or added up (`sum(((p - r) ** 2).sum() for ...)`), a few dozen nodes at most."""
    try:
        todo = [k for k, _ in node.next_functions if k is not None][:1]
        while todo:
            budget -= 1
            if budget < 0:
                return False
            kid = todo.pop()
            name = type(kid).__name__
            kids = [k for k, _ in kid.next_functions if k is not None]
            if name.startswith("SumBackward") or name == "AddBackward0":
                todo.extend(kids)
            elif name == "PowBackward0":
                if getattr(kid, "_saved_exponent", None) != 2:
                    return False
            elif not (name == "MulBackward0" and len(kid.next_functions) == 2
                      and kid.next_functions[0][0] is not None and kid.next_functions[0][0] is kid.next_functions[1][0]):
                return False
        return True
    except Exception:
        return False


def _graph_ops(fn: Any, budget: int = 64) -> set:
    """The restricted-domain ops in the graph behind `fn`, a few dozen nodes deep (a module's output: its own ops
    first); exp and division kept."""
    return {op for n in walk([fn], Budget(budget)) if (op := _op_of(n)) is not None}


def _domain_ops(fn: Any, budget: int = 64) -> List[str]:
    """The restricted-domain ops (acos, log, sqrt, ...) in the loss graph behind `fn`, a few dozen nodes deep, in the
    order the hint names them; a division or exp only when nothing else is there (they are everywhere), and then
    both (a NeRF depth `(w * t).sum(-1) / acc` at acc = 0 beside the alphas' exp: the exp alone was named)."""
    found = _graph_ops(fn, budget)
    if found - {"division", "exp"}:
        found -= {"division", "exp"}
    return [o for o in _DOMAIN_HINTS if o in found]


_SELECTIONS = frozenset(("GatherBackward0", "IndexBackward0", "SelectBackward0", "SqueezeBackward1", "SqueezeBackward0",
                          "SliceBackward0", "TakeAlongDimBackward0"))
_STABLE_LOG = {"SigmoidBackward0": ("sigmoid", "F.logsigmoid(x)"), "SoftmaxBackward0": ("softmax", "F.log_softmax(x, dim)")}


def _log_of(fn: Any, budget: int = 64) -> Optional[Tuple[str, str]]:
    """(what, its stable form) when the loss graph behind `fn` takes the log of a sigmoid or softmax output
    (`torch.log(torch.sigmoid(x))`); None otherwise. A few dozen nodes from the loss at most."""
    stack = [fn] if fn is not None else []
    while stack and budget > 0:
        node = stack.pop()
        budget -= 1
        try:
            nxt = [n for n, _ in node.next_functions if n is not None]
        except Exception:
            continue
        if type(node).__name__ == "LogBackward0":
            # (through a selection of the probabilities first: a focal loss's log(softmax(x).gather(1, y)))
            for _ in range(3):
                nxt = [k for n in nxt for k in ([m for m, _ in n.next_functions if m is not None]
                                                if type(n).__name__ in _SELECTIONS else [n])]
            for n in nxt:
                hit = _STABLE_LOG.get(type(n).__name__)
                if hit is not None:
                    return hit
                if type(n).__name__ == "RsubBackward1" and any(
                        k is not None and type(k).__name__ == "SigmoidBackward0" for k, _ in n.next_functions):
                    # log(1 - sigmoid(x)): 0 once sigmoid rounds to 1 (x above ~17 in float32)
                    return ("1 - sigmoid", "F.logsigmoid(-x) (log(1 - sigmoid(x)) = logsigmoid(-x))")
                if type(n).__name__.startswith(("SumBackward", "MeanBackward")) and _exp_below(n, 4):
                    # log(sum(pi * exp(...))): a mixture's likelihood in linear space, 0 when every term underflows
                    return ("sum of exponentials (a mixture's likelihood computed in linear space)",
                            "torch.logsumexp(log_weights + log_densities, dim)")
                if type(n).__name__ == "CumsumBackward0" and _exp_below(n, 4):
                    # log(cumsum(exp(eta))): a Cox partial likelihood's risk sets, inf once exp overflows (or 0)
                    return ("cumulative sum of exponentials (a Cox model's risk sets: log(cumsum(exp(eta))))",
                            "torch.logcumsumexp(eta, dim=0)")
        stack.extend(nxt)
    return None


def _cross_entropy_of(fn: Any, budget: int = 32) -> Optional[bool]:
    """Whether the loss graph behind `fn` (a few dozen nodes) holds cross_entropy (nll_loss of a log_softmax): None if
    not, else whether with label smoothing (a second use of the same log_softmax, its smoothing sum)."""
    uses: Dict[int, int] = {}
    found = None
    for node in walk([fn], Budget(budget)):
        try:
            nxt = [n for n, _ in node.next_functions if n is not None]
        except Exception:
            continue
        for n in nxt:
            if type(n).__name__ == "LogSoftmaxBackward0":
                uses[id(n)] = uses.get(id(n), 0) + 1
                if type(node).__name__ == "NllLossBackward0":
                    found = id(n)
    return None if found is None else uses.get(found, 0) > 1


def _leaf_uses(roots: list, ids: set, budget: int = 20_000) -> Dict[int, int]:
    """How many graph edges behind `roots` lead to the leaf of each parameter id in `ids` (a few thousand nodes, on
    the error path only)."""
    uses: Dict[int, int] = {}
    for node in walk(roots, Budget(budget)):
        try:
            nxt = node.next_functions
        except Exception:
            continue
        for child, _ in nxt:
            var = getattr(child, "variable", None) if child is not None else None
            if var is not None and id(var) in ids:
                uses[id(var)] = uses.get(id(var), 0) + 1
    return uses


def _plus_inf(sums: List[torch.Tensor], flag: int) -> bool:
    """Whether the kept sum of the loss at `flag` is +inf (not NaN): read on the error path only."""
    try:
        return float(sums[flag]) == math.inf
    except Exception:
        return False


def _masked_below(fn: Any, budget: int = 64) -> bool:
    """Whether a masked_fill lies in the loss graph behind `fn` (a few dozen nodes): logits masked with -inf."""
    return any(type(n).__name__.startswith("MaskedFill") for n in walk([fn], Budget(budget)))


def _exp_below(node: Any, depth: int) -> bool:
    """Whether an exp node lies within `depth` nodes under `node` (through elementwise arithmetic)."""
    if depth <= 0 or node is None:
        return False
    if type(node).__name__ == "ExpBackward0":
        return True
    try:
        return any(_exp_below(n, depth - 1) for n, _ in node.next_functions if n is not None)
    except Exception:
        return False


def _counted(c: Dict[str, int]) -> str:
    return f"{c.get('nan', 0)} NaN and {c.get('posinf', 0) + c.get('neginf', 0)} Inf of {c.get('numel', '?')} values"


def _attention_masks(args: tuple, kwargs: dict) -> tuple:
    """A MultiheadAttention call's (query, key_padding_mask, attn_mask)."""
    named = dict(zip(("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask"), args))
    named.update(kwargs)
    return named.get("query"), named.get("key_padding_mask"), named.get("attn_mask")


def _masked_rows(batch_first: bool, q: Any, kpm: Any, am: Any) -> Optional[torch.Tensor]:
    """The (batch, query) rows of an attention call whose keys are all masked, or None (no mask, other layout)."""
    if (kpm is None and am is None) or not isinstance(q, torch.Tensor) or q.dim() != 3:
        return None
    bsz, tgt = (q.shape[0], q.shape[1]) if batch_first else (q.shape[1], q.shape[0])
    full = None
    if kpm is not None:
        k = kpm if kpm.dtype is torch.bool else torch.isneginf(kpm)
        full = k.reshape(bsz, 1, -1)
    if am is not None:
        a = am if am.dtype is torch.bool else torch.isneginf(am)
        a = a.reshape(1, tgt, -1) if a.dim() == 2 else a.reshape(bsz, -1, tgt, a.shape[-1]).any(1)
        full = a if full is None else full | a
    return full.all(-1).expand(bsz, tgt)


def _fully_masked(module: Any, masks: tuple, out: Any) -> Optional[torch.Tensor]:
    """The fully masked (batch, query) rows of an attention call whose output `out` is NaN/Inf in those rows
    only (error path), or None."""
    try:
        rows = _masked_rows(module.batch_first, *masks)
        if rows is None or not bool(rows.any()):
            return None
        if not isinstance(out, torch.Tensor) or out.dim() != 3:
            return rows  # the output is gone (freed after the step's backward): its rows cannot be compared
        bad = ~torch.isfinite(out.detach()).all(-1)
        if not module.batch_first:
            bad = bad.t()
        return rows if tuple(bad.shape) == tuple(rows.shape) and not bool((bad & ~rows).any()) else None
    except Exception:  # a mask of another layout: the generic message
        return None


_DIVISOR = re.compile(r"(tau|temp|temperature|scale|inv_temp|beta|alpha|gamma|t_?emp\w*)$", re.I)


def _divisor_names(module: Any, zeros: List[Any]) -> Optional[List[str]]:
    """The names, in `module.forward`'s signature, of the float arguments at 0 that read as a temperature or scale
    (`tau`, `temperature`, `scale`): such a 0 is a divisor; others (a time `t`, a dropout rate) are left out."""
    try:
        params = [p for p in inspect.signature(module.forward).parameters]
    except (TypeError, ValueError):
        return None
    names = [params[z] if isinstance(z, int) and z < len(params) else z for z in zeros]
    named = [n for n in names if isinstance(n, str) and _DIVISOR.search(n)]
    return named or None


def _output_hint(mtype: str, params: bool) -> str:
    if params:
        return ("The module's weights are already NaN/Inf (a bad checkpoint or an earlier overflow): reload good "
                "weights and lower the learning rate.")
    if "Norm" in mtype:
        return ("A normalisation layer divided by a near-zero variance or got constant input: raise its eps, "
                "or check for constant/zero features.")
    return ("This module's computation overflowed or hit an undefined point (log(0), sqrt(<0), x/0, exp of a large "
            "value): clamp inputs, add an epsilon, lower the learning rate, or clip gradients.")


add_call_handlers(NonFinite, "shape_", _TARGETED, "_target")
