"""Training in eval mode: optimizer steps while the model's dropout/BatchNorm modules are in eval mode.

The classic: ``model.eval()`` for validation at the end of an epoch and no
``model.train()`` before the next one, so from then on dropout is off and
BatchNorm normalises with frozen running statistics. Training goes on without
an error, with less regularisation and stale statistics.

What counts: the last grad-enabled call of a root model before an optimizer step
was made with the root in eval mode (``model.training`` False) while it holds
Dropout (``p > 0``) or BatchNorm (tracking running statistics) modules in eval mode, or its
forward ran a functional dropout that follows the module's mode (``F.dropout(x, p,
training=self.training)``, HF's BART/OPT/Whisper: no ``nn.Dropout`` to find), seen switched off through
the ``F.dropout`` patch.
Frozen BatchNorm on purpose (``bn.eval()`` on the BatchNorm layers while the model
trains) leaves the root in training mode and stays silent, as do models without
dropout/BatchNorm, and a frozen backbone kept in eval mode while the trained parts
are in training mode (a linear probe: ``model.eval(); model.head.train()``, every
module holding a parameter the optimizer updates in training mode). ``Module.train`` is watched through a declared patch, so the
finding names where ``.eval()`` (or ``.train(False)``) was called. To silence it for
a model trained in eval mode on purpose, set ``model.guard_eval_mode_ok = True``.

Cost: one ``is_grad_enabled()`` and one attribute read per root model call; at each
optimizer step, nothing unless that call was in eval mode. Nothing per module call.
"""
from __future__ import annotations

import sys
import weakref
from typing import List, Optional, Tuple

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from .base import Check
from ._modes import F_DROPOUT_PATCHES, dropout_site, mode_sensitive
from .._weak import WeakIdMap, WeakIdSet

MAX_NAMED = 4
OPT_OUT = "guard_eval_mode_ok"


class TrainInEvalMode(Check):
    name = "train-in-eval-mode"
    kinds = {"train-in-eval-mode": ("warning", "optimizer steps while dropout/BatchNorm modules are in eval mode")}
    description = "optimizer steps with dropout/BatchNorm in eval mode (model.eval() for validation, no model.train() after)"
    patches = {"module_train": "torch.nn.Module.train", **F_DROPOUT_PATCHES}

    def watches(self, module) -> bool:
        return False  # root model calls only

    def __init__(self, guard):
        super().__init__(guard)
        self._roots = WeakIdSet()
        self._mods: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()
        # root -> (step, source) of the latest .eval() / .train(False) call on it
        self._eval_at: "weakref.WeakKeyDictionary[nn.Module, Tuple[int, Optional[str]]]" = weakref.WeakKeyDictionary()
        # roots whose last grad-enabled call was in eval mode: root -> source of that call
        self._eval_calls = WeakIdMap()  # model -> line of its last grad-enabled call in eval mode
        self._reported: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
        self._again = WeakIdMap()  # reported models trained in eval mode again this step -> their path
        # A functional dropout (F.dropout(x, p, training=self.training): BART, OPT, Whisper) switched off by
        # eval mode in a grad-enabled forward: (module, line) of the first of the root call under way, then
        # per model whose grad-enabled call in eval mode made it
        self._fdrop: Optional[tuple] = None
        self._fdrops = WeakIdMap()
        self._frozen_rest = WeakIdMap()  # model -> (step decided, whether all it holds beside the trained parts is frozen)

    def _f_dropout(self, args: tuple, kwargs: dict) -> None:
        # Every dropout call of a training forward comes here (nn.Dropout's too): one test for the usual ones.
        if (args[2] if len(args) > 2 else kwargs.get("training")) is False and self._fdrop is None \
                and torch.is_grad_enabled() and (args[1] if len(args) > 1 else kwargs.get("p", 0.5)):
            site = dropout_site(sys._getframe())
            if site is not None and site[2]:
                self._fdrop = site[:2]

    on_f_dropout = on_f_dropout1d = on_f_dropout2d = on_f_dropout3d = _f_dropout

    def on_module_train(self, args, kwargs):
        if not args:
            return
        mode = args[1] if len(args) > 1 else kwargs.get("mode", True)
        if not mode and isinstance(args[0], nn.Module):
            # Module.train recurses into children: the root's entry is the one read (any module may be a root)
            self._eval_at[args[0]] = (self.g.step, self.g.source())

    def on_forward(self, module, path, args, kwargs, output, is_root):
        if not is_root:
            return
        fdrop, self._fdrop = self._fdrop, None
        if id(module) not in self._roots.data:
            self._roots.add(module)
            if not module.training and module not in self._eval_at:
                self._eval_at[module] = (self.g.step, None)  # in eval mode before the guard started
        if not torch.is_grad_enabled():
            return
        if module.training:
            mods = module._modules
            inner = mods.get("module") if type(mods) is dict else None  # (a ScriptModule's is no dict)
            if inner is not None and not inner.training:
                # a wrapper in training mode around a model in eval mode (DDP's `model.module.eval()` for rank 0's
                # validation, and no train() after it): the wrapped model is what trains in eval mode
                module = inner
                if module in self._reported:
                    self._again[module] = self.g.path_of(module)
                else:
                    self._eval_calls[module] = self.g.root_source
            elif id(module) in self._eval_calls.data:
                self._eval_calls.pop(module)
        elif module not in self._reported:
            self._eval_calls[module] = self.g.root_source
            if fdrop is not None:
                self._fdrops[module] = fdrop
        else:
            self._again[module] = path  # still trained in eval mode: the finding lasts (counted at the step)

    def on_step_pre(self, optimizer):
        if self._again.data:
            for model, path in list(self._again.items()):
                del self._again[model]
                if not model.training:
                    self.g.seen_again("train-in-eval-mode", path)
        if not self._eval_calls.data:
            return
        if isinstance(optimizer, torch.optim.LBFGS):
            # L-BFGS evaluates its closure again and again within a step (line search, curvature pairs): a model put
            # in eval mode for it on purpose keeps the closure deterministic (no fresh dropout mask per evaluation)
            self._eval_calls.clear()
            return
        for model, call_src in list(self._eval_calls.items()):
            del self._eval_calls[model]
            if model in self._reported or model.training or getattr(model, OPT_OUT, False):
                continue
            owners = self._owners(model, optimizer)
            if not owners:
                continue
            if all(m.training for m in owners):
                continue  # the trained parts were put in training mode on purpose (a linear probe's head)
            mods = self._mods.get(model)
            if mods is None:
                mods = self._mods[model] = mode_sensitive(model)
            off = [(n, type(m).__name__) for n, r in mods if (m := r()) is not None and not m.training]
            fdrop = self._fdrops.pop(model, None) if self._fdrops.data else None
            if not off and fdrop is not None:
                owner, line = fdrop
                off = [(f"{self.g.known_path(owner) or type(owner).__name__} (F.dropout at {line})", "functional Dropout")]
            if off and not self._rest_frozen(model, owners, [n for n, _ in off]):
                self._emit(model, off, call_src)

    def _rest_frozen(self, model: nn.Module, owners: List[nn.Module], off: List[str]) -> bool:
        """Whether `model` is frozen but for a head retrained on its fixed features (deep feature reweighting,
        classifier re-training): every parameter outside the trained parts requires no gradient, none of the
        trained parts acts differently in eval mode or holds a frozen weight (an adapter), and each layer acting as in evaluation (`off`, paths) sits
        in the frozen part: its parent holds a frozen parameter (not a head's own Dropout). Decided again every
        64 steps."""
        hit = self._frozen_rest.data.get(id(model))
        if hit is not None and self.g.step < hit[0] + 64:
            return hit[1]
        trained = {id(p) for m in owners for p in m.parameters()}
        rest = [p for p in model.parameters() if id(p) not in trained]
        # A trained part that holds frozen weights itself (a LoRA wrapper around a frozen Linear, BitFit's trained
        # biases beside frozen weights) adapts the network in place: that is fine-tuning, not a head retrained on
        # fixed features, and its eval mode after a validation is the forgotten model.train()
        ok = bool(rest) and not any(p.requires_grad for p in rest) and not any(
            isinstance(m, (_BatchNorm, _DropoutNd)) or not all(p.requires_grad for p in m.parameters()) for m in owners)
        for path in off if ok else ():
            try:
                parent = model.get_submodule(path.rpartition(".")[0])
            except Exception:
                ok = False
                break
            if all(p.requires_grad for p in parent.parameters()):
                ok = False  # a layer of the trained head (its Dropout) switched off: the forgotten model.train()
                break
        self._frozen_rest[model] = (self.g.step, ok)
        return ok

    def _owners(self, model: nn.Module, optimizer) -> List[nn.Module]:
        """The modules of `model` that hold a parameter `optimizer` updates (none: a step of another
        network says nothing about this one)."""
        ids = {id(p) for grp in optimizer.param_groups for p in grp["params"]}
        return [m for m in model.modules() if any(p is not None and id(p) in ids for p in m._parameters.values())]

    def _emit(self, model: nn.Module, off: List[Tuple[str, str]], call_src: Optional[str]) -> None:
        """`off`: (path, type name) of the modules acting as in evaluation."""
        self._reported.add(model)
        path = self.g.path_of(model)
        step = self.g.step
        since, eval_src = self._eval_at.get(model, (None, None))
        shown = ", ".join(f"{n} ({t})" for n, t in off[:MAX_NAMED])
        more = f" and {len(off) - MAX_NAMED} more" if len(off) > MAX_NAMED else ""
        effects = []
        types = [t for _, t in off]
        if any("Dropout" in t for t in types):
            effects.append("dropout is off (no regularisation)")
        if any("Norm" in t for t in types):
            effects.append("BatchNorm normalises with its frozen running statistics and stops updating them")
        hint = ("Call model.train() at the start of every training epoch (after validation, which calls "
                "model.eval()). If training in eval mode is deliberate, set `model.guard_eval_mode_ok = True`.")
        copied = None
        if eval_src:
            where_eval = f"{path}.eval() was called at {eval_src} (before step {since})"
            if since == 0 and all(p.requires_grad for p in model.parameters()):
                # called before any training, on a model the optimizer trains whole: eval() taken for a freeze
                hint += (" If .eval() was meant to freeze it: eval() only switches Dropout and BatchNorm to inference; "
                         "its weights still train. Freeze with model.requires_grad_(False) (and leave its parameters "
                         "out of the optimizer).")
        elif since:
            # first called mid-run, already in eval mode: made during the run, most often as a copy of a model in eval
            # mode (copy.deepcopy keeps the mode), e.g. a federated client's copy of the server model after its evaluation
            copied = self._copied_from(model)
            where_eval = f"{path} was in eval mode from its first call (step {since})"
            if copied is not None:
                where_eval += (f", made during the run like a copy of {copied[0]}, which was put in eval mode at "
                               f"{copied[1]} (copy.deepcopy keeps the mode of what it copies)")
                hint = ("Call .train() on the copy before training it (`model = copy.deepcopy(global_model); "
                        "model.train()`): a copy of a model in eval mode is in eval mode. If training in eval mode is "
                        "deliberate, set `model.guard_eval_mode_ok = True`.")
        elif since is not None:
            where_eval = f"{path} was already in eval mode when guard started"
        else:
            where_eval = f"{path} is in eval mode"
        message = (f"optimizer step {step} trains {path} in eval mode: {where_eval} and no {path}.train() "
                   f"followed before the training forward ({call_src}); {len(off)} module(s) act as in "
                   f"evaluation: {shown}{more}; {' and '.join(effects)}")
        details = {"eval_step": since, "eval_source": eval_src, "forward_source": call_src,
                   "modules": [n for n, _ in off[:20]], "types": types[:20], "count": len(off)}
        if copied is not None:
            details["copied_from"] = {"model": copied[0], "eval_source": copied[1]}
        self.emit("train-in-eval-mode", path, message, hint, step=step, source=eval_src or call_src, details=details)

    def _copied_from(self, model: nn.Module) -> Optional[Tuple[str, str]]:
        """(path, line of its .eval()) of a model of the same class and parameter shapes put in eval mode by a call
        the check saw: what `model`, first called in eval mode mid-run, was most likely copied from."""
        shapes = [tuple(p.shape) for p in model.parameters()]
        for other, (_, src) in list(self._eval_at.items()):
            if other is model or src is None or type(other) is not type(model):
                continue
            if [tuple(p.shape) for p in other.parameters()] == shapes:
                return self.g.path_of(other), src
        return None
