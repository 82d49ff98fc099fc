"""Evaluation in training mode: a ``no_grad``/``inference_mode`` forward with dropout/BatchNorm still training.

BatchNorm in training mode normalises with the evaluation batch's statistics and
overwrites its running statistics with them; dropout makes metrics noisy. The
check looks only at root model calls: when grad mode is off and the model has
Dropout (``p > 0``) or BatchNorm (tracking running stats) modules in training
mode, that is an evaluation forward in train mode (judged `RECUR` training steps after a call site's
first such forward: one that comes back at training steps is part of the training algorithm, such as
two-pass scheduled sampling, unless it runs BatchNorm layers in training mode, whose running statistics it
overwrites). So is a functional dropout that follows the module's mode (``F.dropout(x, p,
training=self.training)``, HF's BART/OPT/Whisper: no ``nn.Dropout`` to find), seen running in training mode
under ``no_grad`` through the ``F.dropout`` patch.

A frozen network on the gradient path (every parameter ``requires_grad=False``, none in an optimizer: a perceptual
loss's VGG applied to the prediction) whose BatchNorm runs in training mode is an inference use in training mode
too: ``model.train()`` switched it back after a one-time ``.eval()``, and each step overwrites its pretrained
running statistics. Such layers are the only ones this check watches (decided at their first call); one that
sees no gradient (a frozen backbone before a trained head) is left alone.

Threshold (to leave deliberate uses alone): it fires only for a model that is
also trained under the guard, i.e. that has had a grad-enabled forward (before or
after), and only while the model itself is in training mode: after ``model.eval()``
a Dropout or BatchNorm switched back to ``train()`` is deliberate (Monte Carlo
dropout samples predictions that way). So is one training inside a block in eval mode (switched on by
itself: BatchNorm adaptation's ``bn.train()`` per layer, called through a new wrapper). A momentum/EMA teacher
or a DQN target network that only ever runs under ``no_grad`` is never reported, nor are model calls made by ``torch.optim``
(``swa_utils.update_bn`` recomputes BatchNorm statistics in train mode), nor a BatchNorm with
``momentum=None`` (a cumulative average: statistics recomputed by hand), nor calls while an optimizer is
switched to its evaluation weights (schedule-free's ``optimizer.eval()``: its recipe recomputes BatchNorm
statistics that way). To silence it for one module, set
``module.guard_train_mode_ok = True`` on the model or on the Dropout/BatchNorm
module; to silence it everywhere, ``checks=["default", "-eval-in-train-mode"]``.

Cost: one ``torch.is_grad_enabled()`` per root model call; the list of
Dropout/BatchNorm modules is computed once per model; nothing per inner module.
"""
from __future__ import annotations

import contextlib
import linecache
import os
import re
import sys
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parameter import is_lazy
from torch.optim.swa_utils import AveragedModel

from torch.nn.modules.dropout import _DropoutNd

from .._frames import is_skipped, short_path
from ..tensors import iter_tensors
from ._modes import F_DROPOUT_PATCHES, dropout_site, method_owner, mode_sensitive
from .base import Check
from .._weak import WeakIdMap, WeakIdSet

MAX_NAMED = 4
_NORMS = (_BatchNorm, nn.GroupNorm, nn.LayerNorm, nn.modules.instancenorm._InstanceNorm)
#: BatchNorm statistics re-estimated after a reset keep (1 - momentum)^batches of the reset values: above this, told
REESTIMATE_LEFT = 0.01
#: steps after a frozen model's first no_grad call in train mode at which it is judged unchanged (a target network
#: copied from the online one every few steps, or updated by an EMA, has moved by then)
FROZEN_WAIT = 32
MC_KEEP = 64 << 20  # bytes of the last sampled input kept to compare with the next
#: no_grad calls in a row of a model in train mode on one input, from one line, that make Monte Carlo dropout sampling
#: (T samples averaged: T is 10 to 100 in practice; an evaluation computed twice or thrice on one batch is no sampling)
MC_SAMPLES = 4
RECUR = 3  # training steps after a call site's first no_grad forward in training mode within which it may come back
OPT_OUT = "guard_train_mode_ok"


_TORCH_OPTIM = os.path.dirname(os.path.abspath(torch.optim.__file__)) + os.sep  # swa_utils.update_bn
_GUARD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_MODULE_FILES = (os.path.abspath(nn.modules.module.__file__),)
_CONTEXTLIB = os.path.abspath(contextlib.__file__)
_CHECKPOINT = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "utils", "checkpoint.py")
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _recalibrating(m: nn.Module) -> bool:
    """A BatchNorm with ``momentum=None`` keeps a cumulative average, one with ``momentum=1.0`` keeps only this
    batch's statistics for the caller to average: its statistics are being recomputed on purpose (precise BN:
    ``swa_utils.update_bn``, fvcore/detectron2's ``update_bn_stats``)."""
    return isinstance(m, _BatchNorm) and (m.momentum is None or m.momentum == 1.0)


def _sample(module) -> list:
    """A few values of (up to 4 of) a frozen module's parameters, to tell later whether they changed: compared by
    value, since an EMA written through `.data` (`t.data.mul_(m).add_(...)`) leaves the version counters as they
    were. Empty for a module that trains (or whose parameters cannot be read so: sparse, meta)."""
    params = [p for _, p in zip(range(4), module.parameters())]
    if not params or any(p.requires_grad or p.layout is not torch.strided or p.is_meta for p in params):
        return []
    with torch.no_grad():
        return [(p, p.detach().reshape(-1)[:16].clone()) for p in params]


def _frozen_still(module, sample: list) -> bool:
    """Every parameter frozen (requires_grad False) and none of the sampled values changed since `sample` was
    taken: a frozen feature extractor or teacher, whose train mode at every step no training algorithm needs (a
    BYOL/MoCo or mean-teacher target, updated by its EMA, moves)."""
    params = list(module.parameters())
    if not sample or not params or any(p.requires_grad for p in params):
        return False
    with torch.no_grad():
        return all(torch.equal(p.detach().reshape(-1)[:16], old) for p, old in sample)


def _versions(module) -> List[int]:
    """The version counters of (up to 8 of) a module's parameters: they move when the weights change in place."""
    return [p._version for _, p in zip(range(8), module.parameters())]


def _called_by_torch() -> bool:
    """Whether the model call came from ``torch.optim`` (BatchNorm recalibration) rather than from the user."""
    f = sys._getframe(2)
    while f is not None:
        fn = os.path.abspath(f.f_code.co_filename)
        if fn.startswith(_GUARD_DIR) or fn in _MODULE_FILES or fn == _CONTEXTLIB:
            f = f.f_back
            continue
        if fn.startswith(_TORCH_OPTIM) and f.f_code.co_name == "forward":
            f = f.f_back  # swa_utils.AveragedModel passing the call on: who called it decides
            continue
        return fn.startswith(_TORCH_OPTIM)
    return False


def _in_reentrant_checkpoint() -> bool:
    """Whether the call runs in ``torch.utils.checkpoint``'s reentrant first pass (``CheckpointFunction.forward``,
    under no_grad by autograd): a training forward, recomputed with grad during backward, not an evaluation."""
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_name == "forward" and os.path.abspath(f.f_code.co_filename) == _CHECKPOINT:
            return True
        f = f.f_back
    return False


def _accessor(path: str) -> str:
    """Python for a submodule's path relative to its model: ``backbone.0`` -> ``.backbone[0]`` (a root label such
    as ``Net#2`` left out)."""
    parts = [p for p in path.split(".") if "#" not in p]
    return "".join(f"[{p}]" if p.isdigit() else f".{p}" if p.isidentifier() else f"[{p!r}]" for p in parts)


def _from_torch_optim() -> bool:
    """Whether ``torch.optim`` code (``swa_utils.update_bn``) is on the call stack."""
    f = sys._getframe(1)
    while f is not None:
        if os.path.abspath(f.f_code.co_filename).startswith(_TORCH_OPTIM):
            return True
        f = f.f_back
    return False


def _being_built(module: nn.Module, depth: int = 12) -> bool:
    """Whether `module`'s own ``__init__`` is on the call stack (a BatchNorm made now resets its statistics)."""
    f = sys._getframe(1)
    while f is not None and depth:
        if f.f_code.co_name == "__init__" and f.f_locals.get("self") is module:
            return True
        f, depth = f.f_back, depth - 1
    return False


def _dropout_module(frame: Any) -> Optional[nn.Module]:
    """The ``nn.Dropout`` whose forward called the patched ``F.dropout`` (torch's own frame above guard's), or None."""
    f = frame
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(_GUARD_DIR):
        f = f.f_back
    me = f.f_locals.get("self") if f is not None and f.f_code.co_name == "forward" else None
    return me if isinstance(me, _DropoutNd) else None


def _caller_outside(frame: Any) -> Optional[str]:
    """``file:line`` of the first frame of the user's code that is not a module's method (the decoding loop calling
    ``m.encode(src)``)."""
    f = frame
    while f is not None:
        co = f.f_code
        fn = os.path.abspath(co.co_filename)
        if not (fn.startswith(_GUARD_DIR) or fn.startswith(_TORCH_DIR) or fn == _CONTEXTLIB) and method_owner(f) is None:
            return f"{short_path(co.co_filename)}:{f.f_lineno}"
        f = f.f_back
    return None


def _user_method_of(frame: Any, model: nn.Module) -> bool:
    """Whether the first frame of the user's code above `frame` is a method of `model` (or of a module in it)."""
    f = frame
    while f is not None:
        fn = os.path.abspath(f.f_code.co_filename)
        if not (fn.startswith(_GUARD_DIR) or fn.startswith(_TORCH_DIR) or fn == _CONTEXTLIB):
            owner = method_owner(f)
            return owner is not None and any(m is owner for m in model.modules())
        f = f.f_back
    return False


_TRAIN_CALL = re.compile(r"([A-Za-z_][\w.]*)\.train\(\s*(True|mode\s*=\s*True)?\s*\)")
_CALLEE = re.compile(r"([A-Za-z_][\w.]*)\s*\(")
_TRAINING = ("backward(", ".step(")
LOOK_BACK = 8  # lines above a no_grad model call searched for the `model.train()` that set its mode on purpose


def _train_called_before(frame: Any) -> bool:
    """Whether the user's code calls ``.train()`` just before this model call (its line or the `LOOK_BACK` lines
    above it, in its function or in the caller's), with no training step in between: ``model.train()`` then a
    no_grad loop re-estimating BatchNorm statistics, or sampling with Monte Carlo dropout."""
    for _ in range(2):
        while frame is not None and is_skipped(frame.f_code.co_filename):
            frame = frame.f_back
        if frame is None:
            return False
        co, at = frame.f_code, frame.f_lineno
        # what the call's line calls (`model`, `m.encode`): the `.train()` must be that model's (`models.train()` over
        # a container, then a frozen classifier's pseudo-labels, is no word about the classifier)
        callees = set(_CALLEE.findall(linecache.getline(co.co_filename, at).split("#")[0]))
        indent = None  # the least indentation so far: a line indented deeper sits in a block closed before the call
        for n in range(at, max(co.co_firstlineno, at - LOOK_BACK) - 1, -1):
            raw = linecache.getline(co.co_filename, n)
            line = raw.split("#")[0]
            if not line.strip():
                continue
            depth = len(raw) - len(raw.lstrip())
            if any(s in line for s in _TRAINING):
                return False
            if indent is not None and depth > indent:
                continue  # (an `if` branch above the call may not have run)
            indent = depth
            for who, _ in _TRAIN_CALL.findall(line):
                if any(c == who or c.startswith(who + ".") for c in callees):
                    return True
        frame = frame.f_back
    return False


def _parent_training(root: nn.Module, name: str) -> bool:
    """Whether the block holding layer `name` of `root` is in training mode. A BatchNorm or Dropout training
    inside a block in eval mode was switched on by itself, on purpose: `model.train()` sets every layer
    alike (BN adaptation and TENT: `model.eval()`, then `bn.train()` for each BatchNorm, then a wrapper)."""
    parent = name.rpartition(".")[0]
    if not parent:
        return True  # a child of the root: the root's own mode is what is judged
    try:
        return root.get_submodule(parent).training
    except AttributeError:
        return True


class EvalInTrainMode(Check):
    name = "eval-in-train-mode"
    kinds = {
        "eval-in-train-mode": ("warning", "no_grad forward while dropout/BatchNorm are in training mode"),
    }
    description = "no_grad/inference_mode forward while dropout/BatchNorm modules are in training mode"
    patches = dict(F_DROPOUT_PATCHES, bn_reset="torch.nn.modules.batchnorm._NormBase.reset_running_stats")

    def watches(self, module) -> bool:
        # Root calls are judged per model call. Of the layers, only a frozen network holding BatchNorm (a loss
        # network, a frozen encoder) is watched: decided once, at its first call.
        try:
            return self._frozen_network(module)
        except Exception:  # a module whose parameters cannot be listed: not a frozen network to judge
            return False

    def _frozen_network(self, module) -> bool:
        """Every parameter frozen (some outside norm layers), none in an optimizer, and a BatchNorm that tracks
        running statistics inside."""
        if isinstance(module, _BatchNorm) or getattr(module, OPT_OUT, False):
            return False
        params = list(module.parameters())
        if not params or any(p.requires_grad for p in params):
            return False
        if not any(isinstance(m, _BatchNorm) and m.track_running_stats and m.momentum is not None
                   for m in module.modules()):
            return False
        if not any(not isinstance(m, _NORMS) and any(True for _ in m.parameters(recurse=False))
                   for m in module.modules()):
            return False  # only norm layers: BatchNorm with a frozen affine, adapting its statistics on purpose
        held = {id(p) for opt in self.g.optimizers for grp in opt.param_groups for p in grp["params"]}
        return not any(id(p) in held for p in params)  # in an optimizer: frozen for a phase (a GAN's D step)

    def __init__(self, guard):
        super().__init__(guard)
        self._mods: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()
        self._trained = WeakIdSet()  # models seen called with grad enabled
        self._called = WeakIdSet()  # models seen called under no_grad before any other call of theirs
        self._dry: Any = None  # the model whose call under way sizes its lazy modules (a dry run)
        # model -> (step, source, names, types, count, inference) of its first train-mode no_grad forward
        self._pending: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()
        # models never trained with autograd: their weights' version counters at their first evaluation
        self._versions: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()
        self._reported: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
        # call sites (id(model), line) of no_grad forwards in training mode, not yet judged: (model ref, path, the
        # first one's info, the steps they ran at); and those found to run at training steps (`_decide`)
        self._sites: Dict[Tuple[int, Optional[str]], tuple] = {}
        self._recurring: set = set()
        self._mc: set = set()  # (id(model), line) of Monte Carlo sampling: the same input forwarded again and again
        # (the last no_grad train-mode call's (site, step, input data, shape), how many calls in a row had it)
        self._mc_last: Optional[tuple] = None
        self._mc_x: Any = None  # that call's input (or its data pointer, when large)
        self._mc_rest: list = []  # the other tensor arguments of that last call
        self._mc_bn: set = set()  # (id(model), line) sampling one input again and again with BatchNorm in train mode
        self._frozen_wait: List[tuple] = []  # recurring sites of a frozen model: (ref, path, info, values, due step)
        # (module, line) of the first functional dropout of the root call under way that ran in training mode
        # under no_grad, passing the module's mode (F.dropout(x, p, training=self.training): BART, OPT, Whisper)
        self._fdrop: Optional[tuple] = None
        # frozen networks judged (`_frozen_call`), and those seen in training mode during the model call under way
        self._frozen_done = WeakIdSet()
        self._frozen_bns: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()
        self._frozen_roots = WeakIdMap()  # model -> whether it is a frozen network (looked up at every model call)
        self._primary: Any = None  # the optimizer counting steps when those were decided (weak reference)
        self._frozen_seen: List[tuple] = []
        # BatchNorm -> [step of its reset_running_stats() after training began, no_grad train-mode calls since,
        # then (model ref, model path, its name, the first such call's line)]: statistics re-estimated on purpose
        self._reset = WeakIdMap()
        # root calls under way (id -> depth), and the trained model holding each dropout seen outside them (or False)
        self._in_call: Dict[int, int] = {}
        self._deliberate: Dict[Optional[str], bool] = {}  # call line -> whether a `.train()` comes just before it
        self._holder = WeakIdMap()

    def _f_dropout(self, args: tuple, kwargs: dict) -> None:
        # Every dropout call of a training forward comes here (nn.Dropout's too): one test for the usual ones.
        if (args[2] if len(args) > 2 else kwargs.get("training")) is True \
                and not torch.is_grad_enabled() and (args[1] if len(args) > 1 else kwargs.get("p", 0.5)):
            frame = sys._getframe()
            site = None
            if self._fdrop is None:
                site = dropout_site(frame)
                if site is not None and site[2]:
                    self._fdrop = site[:2]
            trained = self._trained.data
            if trained and not any(i in trained for i in self._in_call):  # (a trained model's own call: judged whole)
                self._parts_call(frame, site)

    def _holding_model(self, part: nn.Module) -> Optional[nn.Module]:
        """The trained model that holds `part` (a layer, or a submodule such as a dropout), if any (cached)."""
        model = self._holder.data.get(id(part))
        if model is None:
            model = next((m for m in self._trained if m is not part and any(x is part for x in m.modules())), None)
            self._holder[part] = model = weakref.ref(model) if model is not None else False
        return model() if isinstance(model, weakref.ref) else None

    def _parts_call(self, frame: Any, site: Optional[tuple]) -> None:
        """A dropout running in training mode under no_grad outside every call of the trained model that holds it:
        the model's own methods (a greedy decoder's ``m.encode(src)``, ``m.step(tok, h)``) or its parts called one by
        one. An evaluation of that model, judged like a call of it."""
        drop = _dropout_module(frame) or (site[0] if site is not None else None)
        if drop is None:
            return
        model = self._holding_model(drop)
        if not model or id(model) in self._in_call or not model.training or model in self._reported \
                or model in self._pending or getattr(model, OPT_OUT, False):
            return
        source = _caller_outside(frame)
        self._evaluation(model, self.g.path_of(model), None, source, deliberate=self._set_by_hand(source))

    on_f_dropout = on_f_dropout1d = on_f_dropout2d = on_f_dropout3d = _f_dropout

    def on_forward_pre(self, module, path, args, kwargs, is_root):
        if is_root:
            self._in_call[id(module)] = self._in_call.get(id(module), 0) + 1
        # a model's first call, under no_grad, with lazy modules not sized yet: the documented dry run
        if is_root and not torch.is_grad_enabled() and id(module) not in self._called.data:
            self._called.add(module)
            if any(is_lazy(p) for p in module.parameters()):
                self._dry = module

    def on_forward(self, module, path, args, kwargs, output, is_root):
        if not is_root:
            self._frozen_call(module, path, output)
            return
        n = self._in_call.pop(id(module), 0)
        if n > 1:
            self._in_call[id(module)] = n - 1
        grad = torch.is_grad_enabled()
        if grad:
            if self.g.watched.primary is not self._primary:
                # another optimizer counts the steps (a second stage: a network trained in the first one frozen now,
                # to train a head or a stitch through it): the models are looked at again
                self._primary, self._frozen_roots = self.g.watched.primary, WeakIdMap()
            frozen = self._frozen_roots.data.get(id(module))
            if frozen is None:
                frozen = self._frozen_roots[module] = self.watches(module)  # a frozen network given to guard
            if frozen:  # before the parts seen in this call are judged: it is their outermost
                self._frozen_call(module, path, output, root=True)
        if self._frozen_seen:
            self._judge_frozen()
        dry, self._dry = self._dry, None
        fdrop, self._fdrop = self._fdrop, None
        if self._sites:
            self._decide()
        if self._frozen_wait:
            self._judge_frozen_wait()
        if grad:
            if self._reset.data:
                self._judge_reestimation()  # training resumed: the re-estimation, if any, is over
            if id(module) not in self._trained.data:
                self._trained.add(module)
                pend = self._pending.pop(module, None)
                if pend is not None:
                    self._emit(module, path, *pend)
            return
        if dry is module or module in self._reported or module in self._pending or getattr(module, OPT_OUT, False):
            return  # (dry: the call that sized its lazy modules, `with torch.no_grad(): model(dummy)`)
        if not module.training:
            return  # model.eval() was called: layers in train mode under it were switched back on purpose (MC dropout)
        holder = self._holding_model(module) if self._trained.data else None
        if holder is not None and holder.training and _user_method_of(sys._getframe(), holder):
            # a part of a trained model called by that model's own method (a greedy decoder's `s.enc(x)` inside
            # `m.greedy(x)`, a flow's `sample()` running its couplings' inverses): an evaluation of the model, told
            # once, at the user's line outside its methods (told already: its parts are no findings of their own)
            if holder in self._reported or holder in self._pending:
                return
            source = _caller_outside(sys._getframe())
            self._evaluation(holder, self.g.path_of(holder), fdrop, source, deliberate=self._set_by_hand(source))
            return
        source = self.g.root_source
        if self._mc_samples(module, args, source):
            return
        # model.train() just before: the train mode is this pass's purpose (BatchNorm reset before it still counts
        # its re-estimation batches)
        self._evaluation(module, path, fdrop, source, deliberate=self._set_by_hand(source))

    def _mc_samples(self, module, args: tuple, source: Optional[str]) -> bool:
        """Whether this no_grad call in train mode is the MC_SAMPLES-th in a row on the same input (the same data and
        shape, from the same line, with no step between) while only Dropout acts as in training: Monte Carlo dropout sampling,
        `torch.stack([model(x) for _ in range(T)]).mean(0)` with the train mode left from training on purpose. The
        site is then never told."""
        key = (id(module), source)
        if key in self._mc:
            return True
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        sig = (key, self.g.step, tuple(x.shape), x.dtype, x.device) if x is not None and not x.is_meta else None
        # the other tensor arguments too: a greedy decoder's `model(src, tok, state)` feeds one source with a new
        # token at each call, which is no sampling
        rest = [a for a in args[1:] if isinstance(a, torch.Tensor) and not a.is_meta] if sig is not None else []
        last, prev = self._mc_last, self._mc_x
        same = sig is not None and last is not None and last[0] == sig and prev is not None and self._same_input(prev, x)
        if same and rest:
            before = self._mc_rest
            same = len(before) == len(rest) and all(shape == a.shape and self._same_input(b, a)
                                                    for (shape, b), a in zip(before, rest))
        self._mc_last = (sig, last[1] + 1 if same else 1)
        # the last input itself, to compare with the next: `model(X[pool])` indexes a new copy for each sample
        # (kept up to MC_KEEP bytes; a larger one is compared by its storage only)
        self._mc_x = (x if x.numel() * x.element_size() <= MC_KEEP else x.data_ptr()) if sig is not None else None
        self._mc_rest = [(a.shape, a if a.numel() * a.element_size() <= MC_KEEP else a.data_ptr()) for a in rest]
        if sig is None or self._mc_last[1] < MC_SAMPLES:
            return False
        mods = self._mods.get(module)
        if mods is None:
            mods = self._mods[module] = mode_sensitive(module)
        if any(isinstance(m, _BatchNorm) and m.training for _, r in mods if (m := r()) is not None):
            self._mc_bn.add(key)  # told, with a fix that keeps the sampling
            return False  # BatchNorm in train mode too: each sample normalises with batch statistics and moves them
        self._mc.add(key)
        self._sites.pop(key, None)  # its first sample was deferred as an evaluation
        return True

    @staticmethod
    def _same_input(prev: Any, x: torch.Tensor) -> bool:
        """Whether `x` holds the data of the last sampled input `prev` (that tensor, or its storage's address)."""
        if not isinstance(prev, torch.Tensor):
            return prev == x.data_ptr()
        if prev is x or prev.data_ptr() == x.data_ptr():
            return True
        try:
            return bool(torch.equal(prev, x))  # (no_grad calls in train mode only: a rare path)
        except Exception:
            return False

    def _set_by_hand(self, source: Optional[str]) -> bool:
        """Whether the call from `source` follows a `.train()` in the user's code (decided once per line)."""
        v = self._deliberate.get(source)
        if v is None:
            if len(self._deliberate) > 256:
                self._deliberate.clear()
            v = self._deliberate[source] = _train_called_before(sys._getframe(2))
        return v

    def _evaluation(self, module, path: str, fdrop: Optional[tuple], source: Optional[str],
                    deliberate: bool = False) -> None:
        """A no_grad call of `module` (in training mode) from `source`: deferred as an evaluation if any of its
        Dropout/BatchNorm layers (or a functional dropout, `fdrop`) runs in training mode; not when the train mode
        is `deliberate` (set by the user's `model.train()` for it), whose reset BatchNorms are still counted."""
        mods = self._mods.get(module)
        if mods is None:
            mods = self._mods[module] = mode_sensitive(module)
        if not mods and fdrop is None:
            return
        if any((m := r()) is not None and m.training and _recalibrating(m) for _, r in mods):
            if self._reset.data:  # recomputed in full since its reset: the calls after it are evaluations
                for _, r in mods:
                    if (m := r()) is not None and _recalibrating(m):
                        self._reset.pop(m, None)
            return  # a statistics pass (momentum=None: AdaBN, precise BN by hand): its outputs are thrown away
        # (a BatchNorm whose momentum was set to 0 for this pass keeps its running statistics on purpose: an attack
        # crafted in train mode, TRADES' natural pass, leaves them as training made them)
        live = [(n, m) for n, r in mods if (m := r()) is not None and m.training
                and not getattr(m, OPT_OUT, False) and not _recalibrating(m) and _parent_training(module, n)
                and not (isinstance(m, _BatchNorm) and m.momentum == 0.0)]
        if self._reset.data:
            live = self._reestimation(module, path, live)
        if deliberate and (id(module), source) not in self._mc_bn:
            return  # (model.train() for Monte Carlo dropout switched its BatchNorm layers on too: told)
        training = [(n, type(m).__name__) for n, m in live]
        if not training and fdrop is not None and not getattr(fdrop[0], OPT_OUT, False):
            owner, line = fdrop
            training = [(f"{self.g.known_path(owner) or type(owner).__name__} (F.dropout at {line})",
                         "functional Dropout")]
        if not training:
            return
        if _called_by_torch():
            return  # e.g. torch.optim.swa_utils.update_bn recomputes BatchNorm statistics in train mode on purpose
        if _in_reentrant_checkpoint():
            return  # checkpoint(frozen_layer, x, use_reentrant=True): its no_grad pass is part of the training forward
        if self._optimizer_in_eval():
            return  # schedule-free: BatchNorm statistics recomputed at the averaged weights (optimizer.eval())
        info = (self.g.step, source, [n for n, _ in training], [t for _, t in training],
                torch.is_inference_mode_enabled())
        self._defer(module, path, info)

    def on_bn_reset(self, args, kwargs):
        bn = args[0] if args else None
        if isinstance(bn, _BatchNorm) and self._trained.data and not _from_torch_optim() and not _being_built(bn):
            # (not the reset of a BatchNorm being built, nor swa_utils.update_bn's, which recomputes them in full)
            self._reset[bn] = [self.g.step, 0]

    def _reestimation(self, module, path: str, live: List[Tuple[str, nn.Module]]) -> List[Tuple[str, nn.Module]]:
        """The BatchNorms reset after training (``reset_running_stats()``) re-estimate their statistics in this
        no_grad call, on purpose: counted (judged when training resumes or at the end), not told as an
        evaluation in train mode. The others are returned."""
        kept = []
        for n, m in live:
            ent = self._reset.data.get(id(m))
            if ent is None:
                kept.append((n, m))
                continue
            ent[1] += 1
            if len(ent) == 2:
                ent.extend((weakref.ref(module), path, n, self.g.root_source))
        return kept

    def _judge_reestimation(self) -> None:
        """Re-estimation with a BatchNorm's usual momentum keeps (1 - momentum)^batches of the reset statistics
        (mean 0, variance 1): over too few batches the running statistics match no data."""
        entries, self._reset = list(self._reset.items()), WeakIdMap()
        by_model: Dict[int, list] = {}
        for bn, ent in entries:
            if len(ent) < 6 or ent[2]() is None or not isinstance(bn.momentum, float) or _recalibrating(bn):
                continue
            left = (1.0 - bn.momentum) ** ent[1]
            if left > REESTIMATE_LEFT:
                by_model.setdefault(id(ent[2]()), []).append((bn, ent, left))
        for bad in by_model.values():
            bn, (step, batches, ref, path, _, source), left = max(bad, key=lambda e: e[2])
            module = ref()
            if module is None or module in self._reported:
                continue
            self._reported.add(module)
            names = [e[1][4] for e in bad]
            shown = ", ".join(f"{e[1][4]} ({type(e[0]).__name__})" for e in bad[:MAX_NAMED]) + (f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED
                                                    else "")
            self.emit("eval-in-train-mode", path,
                      f"the running statistics of {shown} were reset (reset_running_stats()) and "
                      f"re-estimated under no_grad at {source} over {batches} batch(es) with momentum "
                      f"{bn.momentum:g}: {left:.0%} of the reset values (mean 0, variance 1) are still in them, so "
                      f"evaluation normalises with statistics that match no data",
                      "Set momentum = None on the BatchNorm layers for the re-estimation passes (a cumulative "
                      "average over all of them, as torch.optim.swa_utils.update_bn does) and restore it after, "
                      "or call torch.optim.swa_utils.update_bn(loader, model).",
                      step=step, source=source,
                      details={"modules": names[:20], "batches": batches, "momentum": bn.momentum,
                               "reset_left": round(left, 4), "reestimation": True})

    def _frozen_call(self, module, path: str, output, root: bool = False) -> None:
        """A frozen network's call: on the gradient path (its output carries gradient back to trained layers:
        a perceptual loss's VGG on the prediction) with BatchNorm in training mode, it is used for inference
        while `model.train()` left it training. Its input without gradient (the feature-extraction recipe:
        a frozen backbone before a trained head) proves nothing."""
        if module in self._frozen_done or not torch.is_grad_enabled():
            return
        if not any(t.requires_grad for t in iter_tensors(output)):
            return
        norms = self._frozen_bns.get(module)
        if norms is None:
            norms = self._frozen_bns[module] = [
                (n, weakref.ref(m)) for n, m in module.named_modules()
                if isinstance(m, _BatchNorm) and m.track_running_stats and not getattr(m, OPT_OUT, False)]
        bns = [(n, type(m).__name__) for n, r in norms
               if (m := r()) is not None and m.training and not _recalibrating(m)]
        if bns:  # (in eval mode now: looked at again at its next call, a later model.train() may switch it)
            self._frozen_done.add(module)
            if not self._frozen_network(module):
                return  # unfrozen since its first call (linear probing, then fine-tuning it): trained, not frozen
            self._frozen_seen.append((weakref.ref(module), path, bns, self.g.step, self.g.source(), root))

    def _judge_frozen(self) -> None:
        """At the end of the model call: report the outermost of the frozen networks seen (not their parts)."""
        seen, self._frozen_seen = self._frozen_seen, []
        paths = [e[1] for e in seen]
        # (a global guard names a model's parts from that model: `f` inside the frozen root `FeatNet`)
        outer = [m for e in seen if e[5] and (m := e[0]()) is not None] if len(seen) > 1 else []
        for ref, path, bns, step, source, root in seen:
            module = ref()
            if module is None or any(path.startswith(q + ".") for q in paths):
                continue
            if any(o is not module and any(module is m for m in o.modules()) for o in outer):
                continue
            shown = ", ".join(f"{path}.{n} ({t})" if n else f"{path} ({t})" for n, t in bns[:MAX_NAMED])
            more = f" and {len(bns) - MAX_NAMED} more" if len(bns) > MAX_NAMED else ""
            attr = _accessor(path)
            holder = self._holding_model(module) if root else None
            if holder is not None:
                # called on its own (a global guard's model call: `s.feat(y_hat)` in the model's method) but held by
                # the trained model, whose train() switches it back: the fix is the holder's, as for a part
                root, attr = False, _accessor(next((n for n, m in holder.named_modules() if m is module), path))
            message = (f"{path} ({type(module).__name__}) is frozen (every parameter requires_grad=False, in no "
                       f"optimizer) and used for inference on the gradient path, but its BatchNorm layers run in "
                       f"training mode: {shown}{more}; each training step overwrites its pretrained running "
                       f"statistics with this run's activations and normalises with batch statistics, so it is no "
                       f"longer the network it was" + ("" if root else " (model.train() switches every submodule "
                                                                        "back to training)"))
            hint = ((f"Put it in eval mode once (.eval()) where it is built, and never call train() on it. " if root
                     else f"Keep it in eval mode after every model.train(): override train() in the model that holds "
                          f"it (def train(self, mode=True): super().train(mode); self{attr}.eval(); return self), "
                          f"or call .eval() on `{path}` after model.train(). ")
                    + "If training mode is deliberate, set `module.guard_train_mode_ok = True` on it.")
            self.emit("eval-in-train-mode", path, message, hint, step=step, source=source,
                      details={"modules": [f"{path}.{n}" if n else path for n, _ in bns[:20]],
                               "types": [t for _, t in bns[:20]], "count": len(bns), "context": "frozen network"})

    # A no_grad forward in training mode that comes back within a few training steps, from one line, is part of
    # the training algorithm (two-pass scheduled sampling feeds its output to the step's own forward, sometimes
    # only with some probability; pseudo-labels or consistency targets with dropout noise), not an evaluation:
    # evaluation runs between epochs. So a call site is judged RECUR steps after its first such forward.
    def _defer(self, module, path: str, info: tuple) -> None:
        key = (id(module), info[1])
        if key in self._recurring:
            return
        # Steps counted with those of optimizers that step while the counting one does not (a student trained after
        # a teacher's pre-training, before it takes the count over): a pass at each of them recurs too
        at = info[0] + self.g.watched.idle
        ent = self._sites.get(key)
        if ent is None:
            self._sites[key] = (weakref.ref(module), path, info, {at}, _sample(module), at)
            if module not in self._trained and module not in self._versions:
                self._versions[module] = sum(_versions(module))
        else:
            ent[3].add(at)

    def _decide(self, final: bool = False) -> None:
        """Judge the call sites whose RECUR steps are over (at the end: all of them)."""
        step = self.g.step
        for key, (ref, path, info, steps, sample, at) in list(self._sites.items()):
            first = info[0]
            if step <= first + RECUR and not final:
                continue
            del self._sites[key]
            # A pass at every training step is part of training, BatchNorm included: FixMatch's weak view of the
            # unlabeled batch (USB's use_cat=False), MixMatch's label guessing feed training data to the statistics
            # as the concatenated forward with grad would. An evaluation runs between epochs.
            recurs = any(at + k in steps for k in range(1, RECUR + 1))
            if recurs:
                self._recurring.add(key)
                module = ref()
                if module is not None and _frozen_still(module, sample):  # judged again FROZEN_WAIT steps on
                    self._frozen_wait.append((ref, path, info, sample, first + FROZEN_WAIT))
                continue
            module = ref()
            if module is None or module in self._reported:
                continue
            if module in self._trained:
                self._emit(module, path, *info)
            elif self._averaged(module):  # (one called at every step, a BYOL/MoCo target, recurs: left above)
                self._emit(module, path, *info)
            elif not final:
                self._pending[module] = info  # told at its first training forward

    def _judge_frozen_wait(self, final: bool = False) -> None:
        """Recurring no_grad calls of a frozen model in train mode, once FROZEN_WAIT steps have passed: still frozen
        and unchanged (no EMA or periodic copy moved it), it is a feature extractor or teacher left in train mode."""
        step, keep = self.g.step, []
        for ent in self._frozen_wait:
            ref, path, info, sample, due = ent
            if step < due and not final:
                keep.append(ent)
                continue
            module = ref()
            if module is not None and module not in self._reported and _frozen_still(module, sample):
                self._emit(module, path, *info, frozen=True)
        self._frozen_wait = keep

    def _averaged(self, module) -> bool:
        """A model never trained with autograd that is the run's averaged network: an `AveragedModel` (SWA), or
        a copy whose weights the loop changes in place (an EMA updated under no_grad). Its evaluation is the
        delivered model's."""
        if isinstance(module, AveragedModel):
            return True
        versions = _versions(module)
        before = self._versions.get(module)
        if before is not None and sum(versions) != before:
            return True
        # changed in place again and again before its first evaluation (a deep copy is at version 0, a checkpoint
        # loaded into it at 1; an EMA updated after every step is at the number of updates)
        return bool(versions) and min(versions) >= 2

    def on_exit(self):
        if self._reset.data:
            self._judge_reestimation()
        self._decide(final=True)
        if self._frozen_wait:
            self._judge_frozen_wait(final=True)
        if self._frozen_seen:
            self._judge_frozen()

    def _optimizer_in_eval(self) -> bool:
        """A watched optimizer switched to its evaluation weights (schedule-free's ``optimizer.eval()`` sets
        ``train_mode`` False): its recipe recomputes BatchNorm statistics there, model in train mode, under
        ``no_grad``, on training batches."""
        for opt in self.g.optimizers:
            if getattr(opt, "train_mode", None) is False or any(
                    grp.get("train_mode") is False for grp in opt.param_groups):
                return True
        return False

    def _emit(self, module, path: str, step: int, source: Optional[str], names: List[str], types: List[str],
              inference: bool, frozen: bool = False) -> None:
        self._reported.add(module)
        shown = ", ".join(f"{n} ({t})" for n, t in zip(names[:MAX_NAMED], types[:MAX_NAMED]))
        more = f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else ""
        ctx = "torch.inference_mode()" if inference else "torch.no_grad()"
        effects = []
        if any("BatchNorm" in t or "Norm" in t for t in types):
            effects.append("BatchNorm normalises with this batch's statistics and overwrites its running "
                           "statistics with evaluation data")
        if any("Dropout" in t for t in types):
            effects.append("dropout randomly zeroes activations, so its outputs (metrics, or targets computed from them) are noisy")
        message = (f"{path} ran under {ctx} at {source} while {len(names)} module(s) are in training mode: "
                   f"{shown}{more}; {'; '.join(effects)}")
        hint = ("Call model.eval() before evaluating (and model.train() before training again). If the train "
                "mode is deliberate, set `module.guard_train_mode_ok = True` on that module.")
        mc = (id(module), source) in self._mc_bn and any("Dropout" in t for t in types)
        if mc:
            # Monte Carlo dropout over a model with BatchNorm: model.eval() alone would switch the sampling off too
            message += ("; one input forwarded again and again from that line is Monte Carlo dropout sampling, but "
                        "its BatchNorm layers normalise each sample with the batch's statistics and move them")
            hint = ("Call model.eval(), then switch only the dropout layers back to training mode: `for m in "
                    "model.modules(): if isinstance(m, nn.Dropout): m.train()` keeps the sampling and freezes "
                    "BatchNorm.")
        if frozen:
            effects = [e.replace("with evaluation data", "with the batches it is fed").replace(
                "(metrics, or targets computed from them)", "(the features or targets computed from them)")
                for e in effects]
            message = (f"{path} is frozen (every parameter requires_grad=False, none changed since) and runs under "
                       f"{ctx} at every training step with {len(names)} module(s) in training mode: "
                       f"{shown}{more}; {'; '.join(effects)}. A frozen feature extractor or teacher left out of "
                       f"eval mode (requires_grad_(False) does not switch modes)")
            hint = (f"Call .eval() on {path} after freezing it, and again after any .train() of a model that "
                    f"contains it. If the train mode is deliberate, set `module.guard_train_mode_ok = True` on it.")
        self.emit("eval-in-train-mode", path, message, hint, step=step, source=source,
                  details={"modules": names[:20], "types": types[:20], "count": len(names),
                           "context": ctx, **({"frozen": True} if frozen else {}),
                           **({"mc_sampling": True} if mc else {})})
