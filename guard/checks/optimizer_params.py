"""Which parameters the optimizers hold: frozen ones handed to them, trainable ones left out.

* ``frozen-param-in-optimizer`` [info]: ``requires_grad=False`` parameters in an
  optimizer's groups (the freeze-layers recipe done halfway), named by module prefix.
  Checked at an optimizer's first ``step()``, and for groups added later (``add_param_group``) at the
  first ``step()`` after they were added.
* ``param-not-in-optimizer`` [warning]: parameters of the watched model that receive
  gradients but are in no watched optimizer (e.g. a layer replaced after the optimizer
  was built), looked at the first step and reported (with that step) `CONFIRM_STEPS` steps
  later, if no optimizer that stepped meanwhile holds them: every optimizer stepping the model
  is watched, and by then each one of the loop has stepped (a GAN's two, an encoder's own
  optimizer stepping every other batch). A parameter
  that changed in place meanwhile (its version counter) was updated after all: by an
  optimizer not given to guard (a probe's own), or by hand; it is not reported. After the first look,
  the model is looked at again every `RELOOK` steps: layers unfrozen mid-run (``requires_grad_(True)``)
  without ``add_param_group`` get gradients that no optimizer applies (nor zeroes: they pile up).

  Parameters outside the watched models too: the backwards of step 1 (up to `OUTSIDE_WALKS`; and every `OUTSIDE_EVERY` steps) are
  walked for ``nn.Parameter``s that belong to no watched model and no optimizer holds (a target network run
  outside ``no_grad``, a bare ``log_vars``), confirmed `CONFIRM_STEPS` steps later like the others.

Host-only work, once per optimizer / once per run (and one bounded graph walk every `OUTSIDE_EVERY` steps);
no device values are read except, once, the norms of the gradients about to be reported.
"""
from __future__ import annotations

import weakref
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .._frames import frame_locals
from ..tensors import as_float, unexpanded
from ._graphs import Budget, user_frames, walk
from ._params import WatchedParams, frame_optimizers, module_prefixes
from .base import Check
from .._weak import WeakIdMap, WeakIdSet


#: primary optimizer steps between the look at the missing parameters and the report: optimizers that step less
#: often than the primary one (every 2nd or 4th batch) have stepped by then
CONFIRM_STEPS = 8
#: primary optimizer steps between later looks (a layer unfrozen mid-run is found within this many steps)
RELOOK = 16


#: the first step whose backward is walked for parameters outside the watched models (every optimizer has
#: stepped by then), and the steps between later walks
OUTSIDE_FIRST = 1
OUTSIDE_EVERY = 64
OUTSIDE_NODES = 20_000  # graph nodes one such walk visits at most
OUTSIDE_WALKS = 4  # backwards of that step walked at most
TARGET_FIX = ("Compute what they produce under torch.no_grad() (a DQN/SAC/TD3 target: with torch.no_grad(): "
              "y = r + gamma * target(next_obs).max(1).values), or freeze them: target.requires_grad_(False).")


def _outside_names(params: List[torch.Tensor]) -> Tuple[List[str], Optional[str], Dict[str, str]]:
    """Names for parameters outside the watched models, from the user's variables: a module holding them
    (`target.0.weight`), a plain list or dict attribute of a module holding them unregistered
    (`model.gains[0]`), or the variable bound to one (`log_vars`); the owner's name when one module holds them
    all; and the plain attributes found ({`model.gains`: "list" or "dict"})."""
    ids = {id(p): i for i, p in enumerate(params)}
    names: List[Optional[str]] = [None] * len(params)
    owners: set = set()
    plain: Dict[str, str] = {}
    for fr in user_frames(12):
        for scope in (frame_locals(fr), fr.f_globals):
            for var, value in list(scope.items()):
                if var.startswith("__"):
                    continue
                if isinstance(value, nn.Parameter) and id(value) in ids and names[ids[id(value)]] is None:
                    names[ids[id(value)]] = var
                    owners.add(var)
                elif isinstance(value, nn.Module):
                    try:
                        for pname, p in value.named_parameters():
                            k = ids.get(id(p))
                            if k is not None and names[k] is None:
                                names[k] = f"{var}.{pname}"
                                owners.add(var)
                        if all(n is not None for n in names):
                            continue
                        for mpath, m in value.named_modules():
                            for attr, held in list(vars(m).items()):
                                if attr.startswith("_") or not isinstance(held, (list, tuple, dict)):
                                    continue
                                items = list(held.items() if isinstance(held, dict) else enumerate(held))[:256]
                                for key, p in items:
                                    k = ids.get(id(p))
                                    if k is not None and names[k] is None:
                                        base = f"{var}.{mpath}.{attr}" if mpath else f"{var}.{attr}"
                                        names[k] = f"{base}[{key!r}]"
                                        plain[base] = "dict" if isinstance(held, dict) else "list"
                                        owners.add(var)
                    except Exception:
                        continue
            if all(n is not None for n in names):
                break
        if all(n is not None for n in names):
            break
    out = [n if n is not None else f"parameter {list(p.shape)}" for n, p in zip(names, params)]
    owner = next(iter(owners)) if len(owners) == 1 and all(n is not None for n in names) else None
    return out, owner, plain


def _module_named(var: str) -> Optional[nn.Module]:
    """The module bound to the user's variable `var` (the owner `_outside_names` found), or None."""
    for fr in user_frames(12):
        for scope in (frame_locals(fr), fr.f_globals):
            value = scope.get(var)
            if isinstance(value, nn.Module):
                return value
    return None


def _listing(prefixes: List[str], more: bool) -> str:
    return ", ".join(prefixes) + (", ..." if more else "")


class OptimizerParams(Check):
    name = "optimizer-params"
    kinds = {
        "frozen-param-in-optimizer": ("info", "parameters with requires_grad=False were handed to the optimizer"),
        "param-not-in-optimizer": ("warning", "trainable parameters that get gradients are in no optimizer"),
    }
    description = "requires_grad=False parameters handed to an optimizer; trainable ones that are in none"
    patches = {"module_init": "torch.nn.Module.__init__",  # (shared with module-not-registered: one wrapper)
               # `m.weight = nn.Parameter(...)` (a head's weight replaced, or re-bound every step to renormalize)
               "register_parameter": "torch.nn.Module.register_parameter",
               # (shared with state-dict) a target synced by load_state_dict is no Polyak target (`_polyak`)
               "load_state_dict": "torch.nn.Module.load_state_dict",
               # (shared) gradients taken with create_graph=True with respect to the parameters: `_matched`
               "autograd_grad": "torch.autograd.grad",
               # `encoder.requires_grad_(True)` mid-run: a part unfrozen (its step and line, for `_missing`)
               "module_requires_grad": "torch.nn.Module.requires_grad_"}

    def __init__(self, guard):
        super().__init__(guard)
        self._seen = WeakIdMap()  # optimizer -> how many of its param groups were looked at
        # frozen parameters an optimizer was built with, told at the end unless some were unfrozen meanwhile
        # (gradual unfreezing, ULMFiT's one layer group per epoch: holding them from the start is the method)
        self._frozen_later: list = []
        self._missing_done = False
        self._cand = None  # (names missing at a look, that step, its line): confirmed CONFIRM_STEPS later
        self._first_look: Optional[Tuple[int, set]] = None  # (step, ids of trainable parameters) of the first look
        self._was_held: set = set()  # ids of the parameters the optimizers held at the last look that found none
        # (id(module), name) -> (times its parameter was replaced, the step of the first time)
        self._rebinds: Dict[Tuple[int, str], Tuple[int, int]] = {}
        # parameters that replaced one at least the second time (re-bound per call or per step) -> first step
        self._rebound = WeakIdMap()
        self._registered = WeakIdMap()  # every nn.Parameter registered in a module while guard runs (ties reuse one)
        self._made_in_call: set = set()  # (id(module), name) re-bound whose first replaced parameter no optimizer held
        # a parameter that replaced another (the first time at that name) -> (step, line, weak reference to the old)
        self._replaced = WeakIdMap()
        self._held_step = 0  # the step of that look
        self._looked = 0  # step of the last look at the missing parameters
        self._told: set = set()  # names already reported as missing
        self._looked_before = False  # a look before the current one found nothing missing
        self._moved: dict = {}  # names missing at a look but changed in place by the confirmation -> that look's step
        self._params = WatchedParams(guard)
        self._walk_at = OUTSIDE_FIRST  # the step of the next walk for parameters outside the watched models
        self._walk_step, self._walks = -1, 0  # the step of the latest walk, and the backwards walked in it
        # the parameters such a walk found: id -> (parameter ref, its version, its gradient's (ref, version)), step
        self._outside: Optional[Tuple[Dict[int, tuple], int]] = None
        # backward() calls so far: a gradient written more often since a look (the model's, the outside walk's) than
        # backward() accumulated into it was cleared or used by the code (a center loss's hand update then
        # `.grad.zero_()`), not left to pile up
        self._backwards = 0
        self._cand_at = self._outside_at = 0  # `_backwards` at each look
        self._outside_sample: Optional[tuple] = None  # (ref, first values) of one parameter outside, at the look
        self._outside_told: set = set()
        self._synced = WeakIdSet()  # modules something loaded a state_dict into (a target synced every N steps)
        self._attrs: Dict[int, str] = {}  # id(tensor) -> the module attribute holding it (a plain tensor to train)
        self._matched: set = set()  # shapes of gradients taken with create_graph=True (gradient matching, MAML)
        self._unfrozen = WeakIdMap()  # parameter -> (step, line) of the `module.requires_grad_(True)` that unfroze it

    def on_module_requires_grad(self, args, kwargs):
        mod = args[0] if args else None
        if not isinstance(mod, nn.Module) or not (args[1] if len(args) > 1 else kwargs.get("requires_grad", True)):
            return
        frozen = [p for p in mod.parameters() if not p.requires_grad]  # (called before the change: still frozen)
        if frozen and len(self._unfrozen) < 100_000:
            at = (self.g.step, self.g.source())
            for p in frozen:
                self._unfrozen[p] = at

    def on_load_state_dict(self, args, kwargs):
        if args and isinstance(args[0], nn.Module):
            self._synced.add(args[0])

    def on_backward(self, tensors, kwargs):
        self._backwards += 1
        step = self.g.step
        if step < self._walk_at and step != self._walk_step:
            return  # the usual backward: two comparisons
        if step >= self._walk_at:
            self._walk_at, self._walk_step, self._walks = step + OUTSIDE_EVERY, step, 0
        # every backward of that step, up to OUTSIDE_WALKS (an actor's and a critic's: a temperature parameter left
        # out of every optimizer is reached by the actor's only)
        if self._walks < OUTSIDE_WALKS and self.g.optimizers and (self._outside is None or self._outside[1] == step):
            self._walks += 1
            self._walk_outside(tensors)

    def _walk_outside(self, tensors) -> None:
        """The nn.Parameters this backward will give gradients to that belong to no watched model and that no
        optimizer holds: a target or teacher network run outside torch.no_grad(), a loss module's or a bare
        nn.Parameter left out of the optimizer. Confirmed CONFIRM_STEPS steps later (`_confirm_outside`)."""
        roots = [t.grad_fn for t in ([tensors] if isinstance(tensors, torch.Tensor) else list(tensors or ()))
                 if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        if not roots:
            return
        watched = {id(p) for p in self._params()}
        held = self._held()
        found: Dict[int, tuple] = {}
        plain: List[torch.Tensor] = []
        for node in walk(roots, Budget(OUTSIDE_NODES)):
            var = unexpanded(getattr(node, "variable", None))
            if (isinstance(var, torch.Tensor) and var.requires_grad and id(var) not in watched
                    and id(var) not in held and id(var) not in self._outside_told and len(found) < 256):
                if not isinstance(var, nn.Parameter):
                    plain.append(var)  # kept only if a watched module holds it as an attribute (below)
                    continue
                g = var.grad
                found[id(var)] = (weakref.ref(var), var._version, (weakref.ref(g), g._version) if g is not None else None)
        if plain:
            attrs = self._tensor_attributes({id(t) for t in plain})
            for var in plain:
                if id(var) in attrs:
                    g = var.grad
                    found[id(var)] = (weakref.ref(var), var._version,
                                      (weakref.ref(g), g._version) if g is not None else None)
            self._attrs.update(attrs)
        if found:
            if self._outside is not None and self._outside[1] == self.g.step:
                self._outside[0].update(found)  # another backward of the same step
            else:
                self._outside = (found, self.g.step)
                self._outside_at = self._backwards - 1  # this backward accumulates into them after the walk
                first = next(iter(found.values()))[0]()
                # a sample of one of them: a Polyak target moves a little between steps, a re-initialised net (dataset
                # distillation's `net.reset_parameters()` at every outer step) all the way
                self._outside_sample = (weakref.ref(first), first.detach().flatten()[:64].clone()) \
                    if first is not None and first.layout is torch.strided and not first.is_meta else None

    def _tensor_attributes(self, ids: set) -> Dict[int, str]:
        """``{id(tensor): "path.attr"}`` of the tensors among `ids` that a watched module keeps as a plain attribute
        (``self.bias2 = torch.zeros(3, requires_grad=True)``: no nn.Parameter, so parameters() misses it). Looked up
        only when a walk met plain leaves that need a gradient."""
        out: Dict[int, str] = {}
        for m in self.g.models or self.g.roots:  # (under a global guard: the outermost modules seen called)
            for path, mod in m.named_modules():
                for k, v in vars(mod).items():
                    if isinstance(v, torch.Tensor) and id(v) in ids and not k.startswith("_"):
                        out[id(v)] = f"{path}.{k}" if path else k
        return out

    def _held(self) -> set:
        opts = list(self.g.optimizers) + self.g.watched.stepping_optimizers()
        return {id(p) for o in opts for grp in o.param_groups for p in grp["params"]}

    def _confirm_outside(self) -> None:
        """Still in no optimizer, not changed in place (no one updates them), and their gradients still coming."""
        found, step = self._outside
        self._outside = None
        held = self._held()
        params, piling = [], []
        for pid, (pref, version, gstate) in found.items():
            p = pref()
            if p is None or pid in held or not p.is_leaf:
                continue
            g = p.grad
            if p._version != version:
                if g is not None and gstate is not None and g is gstate[0]() \
                        and 0 < g._version - gstate[1] <= self._backwards - self._outside_at:
                    piling.append(p)  # moved, its gradients piling up: a Polyak/EMA target run with grad
                continue
            if g is None or (gstate is not None and g is gstate[0]() and g._version == gstate[1]):
                continue  # no gradient since: that backward was a one-off
            params.append(p)
        if piling and not params:
            names, owner, _ = _outside_names(piling)
            how = self._moved_how()
            if how is None:
                self._polyak(piling, names, step, self.g.source(), owner)
            elif how == "by hand":
                self._piled_by_hand(piling, names, step, self.g.source(), owner)
        if not params:
            return
        with torch.no_grad():
            norms = torch.stack([as_float(p.grad.coalesce().values() if p.grad.is_sparse else p.grad).norm().cpu()
                                 for p in params]).tolist()
        params = [p for p, v in zip(params, norms) if v != 0.0]
        if params:
            # an optimizer of the user's that has not stepped yet (a hyper-optimizer stepping once per inner loop
            # of 10 steps) holds them: guard knows optimizers from their first step
            waiting = {id(q) for o in frame_optimizers() for grp in o.param_groups for q in grp["params"]}
            params = [p for p in params if id(p) not in waiting]
        if not params or any(f.kind in ("loss-disconnected", "module-not-registered") for f in self.g.findings):
            return
        self._outside_told.update(id(p) for p in params)
        attrs = [p for p in params if id(p) in self._attrs]
        if attrs:
            self._tensor_attribute(attrs, step, opts=", ".join(type(o).__name__ for o in self.g.optimizers))
            return
        names, owner, plain = _outside_names(params)
        prefixes = module_prefixes(names, names, limit=11)
        # a few parameters are named themselves (`m.log_noise`, not the module `m` that holds it)
        shown, more = (names, False) if len(names) <= 3 else (prefixes[:10], len(prefixes) > 10)
        opts = ", ".join(type(o).__name__ for o in self.g.optimizers)
        if plain and all(any(n.startswith(b + "[") for b in plain) for n in names):
            self._plain_container(params, names, plain, step, opts)
            return
        held = self._held()
        mod = _module_named(owner) if owner else None
        partly = mod is not None and any(id(q) in held for q in mod.parameters())  # its other parameters train
        what = (f"of {owner}, whose other parameters train, " if partly else
                f"of {owner}, which guard does not watch, " if owner else "outside the watched models ")
        message = (f"{len(params)} parameter(s) {what}get gradients from the loss but are in no optimizer ({opts}): "
                   f"{_listing(shown, more)}; backward() computes gradients for them that nothing uses, and they pile "
                   f"up (zero_grad() of the optimizer does not clear them)")
        add = "optimizer.add_param_group({'params': [" + ", ".join(names[:3]) + "]})"
        if partly:
            # the optimizer holds the owner's other parameters: groups listed by hand that left these out, no
            # target network (whose parameters are in no optimizer at all)
            hint = (f"Add them to the optimizer: {add}; its parameter groups list {owner}'s other parameters by hand "
                    f"and leave these out (or build the groups from {owner}.named_parameters()). If they are meant to "
                    f"stay fixed, set requires_grad=False.")
        elif all("." not in n and not n.startswith("parameter ") for n in names):
            # bare nn.Parameters (a soft prompt, learnable loss weights): meant to train, left out of the optimizer
            hint = (f"Add them to the optimizer: {add} (or list them when building it). If they are meant to stay "
                    f"fixed, set requires_grad=False.")
        else:
            hint = ("If it is a target or teacher network: " + TARGET_FIX + " If they should train (a loss "
                    f"module's weights, a learnable loss weight), add them to the optimizer: {add}.")
        self.emit("param-not-in-optimizer", shown[0], message, hint, step=step, source=self.g.source(),
                  details={"modules": shown, "parameters": len(params), "names": names[:20], "appeared_mid_run": False,
                           "outside_watched_models": True, **({"owner": owner} if owner else {})})

    def _tensor_attribute(self, tensors: list, step: int, opts: str) -> None:
        """A learnable tensor kept as a plain attribute of a module (a tensor with requires_grad=True, not an
        nn.Parameter): the optimizer built from model.parameters() does not hold it."""
        names = [self._attrs[id(t)] for t in tensors]
        attr = names[0].rsplit(".", 1)[-1]
        shape = list(tensors[0].shape)
        message = (f"{len(tensors)} tensor(s) a module keeps as a plain attribute with requires_grad=True "
                   f"({', '.join(f'`{n}`' for n in names[:4])}) get gradients but are no nn.Parameter: "
                   f"module.parameters() does not list them, so the optimizer ({opts}) does not update them, "
                   f"state_dict() does not save them and .to(device) does not move them; their gradients pile up")
        hint = (f"Register it as a parameter in __init__: self.{attr} = nn.Parameter(torch.zeros({', '.join(map(str, shape))})) "
                f"(or self.register_parameter('{attr}', ...)), then build the optimizer from model.parameters().")
        self.emit("param-not-in-optimizer", names[0], message, hint, step=step, source=self.g.source(),
                  details={"modules": names[:10], "parameters": len(tensors), "names": names[:20],
                           "appeared_mid_run": False, "outside_watched_models": True, "plain_tensor_attribute": True})

    def _plain_container(self, params: list, names: List[str], plain: Dict[str, str], step: int, opts: str) -> None:
        """Parameters held in a plain list/dict attribute of a module (not nn.ParameterList/ParameterDict)."""
        bases = list(plain)
        base, kind = bases[0], plain[bases[0]]
        attr = base.rsplit(".", 1)[-1]
        listed = ", ".join(f"`{b}`" for b in bases[:3])
        message = (f"{len(params)} parameter(s) are held in a plain Python {kind} attribute ({listed}), not an "
                   f"nn.{'ParameterDict' if kind == 'dict' else 'ParameterList'}: module.parameters() does not list "
                   f"them, so the optimizer ({opts}) built from it does not hold them and state_dict() does not save "
                   f"them; backward() computes gradients for them that nothing uses")
        fix = ("nn.ParameterDict({...})" if kind == "dict" else "nn.ParameterList([...])")
        hint = (f"Register them: self.{attr} = {fix} in __init__ (then the optimizer over model.parameters() "
                f"trains them, .to(device) moves them and state_dict() saves them).")
        self.emit("param-not-in-optimizer", base, message, hint, step=step, source=self.g.source(),
                  details={"modules": bases, "parameters": len(params), "names": names[:20], "appeared_mid_run": False,
                           "outside_watched_models": True, "plain_container": kind})

    def on_step_pre(self, optimizer):
        groups = optimizer.param_groups
        seen = self._seen.data.get(id(optimizer))
        if seen != len(groups):
            self._seen[optimizer] = len(groups)
            self._frozen(optimizer, groups[seen or 0:], added=seen is not None)
        if self._outside is not None and self.g.step - self._outside[1] >= CONFIRM_STEPS and self.g.is_primary(optimizer):
            self._confirm_outside()
        if self._missing_done and self.g.step - self._looked < RELOOK:
            return  # the usual step: two comparisons
        if not self.g.is_primary(optimizer):
            return
        if self._missing_done:
            self._missing_done = False  # a later look: layers unfrozen since without add_param_group
            self._cand = None
        # Looked at the first step, told some steps later: by then every optimizer of the loop has stepped
        # (a GAN's two, a probe's own optimizer beside the one given to guard) and is watched.
        if self._cand is None:
            self._looked = self.g.step
            missing = self._loose()
            versions = {n: (p._version, weakref.ref(p.grad), p.grad._version, weakref.ref(p)) for n, p in missing
                        if n not in self._told}
            if not versions:
                if not self._looked_before:
                    # what was there and trainable at the first look: a parameter of those found missing later had
                    # its gradient after this step's look (a second network's backward after the primary's step)
                    held = {id(p) for o in self.g.optimizers for grp in o.param_groups for p in grp["params"]}
                    self._first_look = (self.g.step, {id(p) for p in self._params()
                                                      if p.requires_grad and id(p) not in held})
                self._missing_done = self._looked_before = True  # every parameter with a gradient is held
                # what the optimizers held then: a parameter missing at a later look was taken out of them since
                self._was_held = {id(p) for o in self.g.optimizers for grp in o.param_groups for p in grp["params"]}
                self._held_step = self.g.step
                return
            self._cand = (versions, self.g.step, self.g.source())
            self._cand_at = self._backwards
            first = next(p for n, p in missing if n in versions)
            self._outside_sample = (weakref.ref(first), first.detach().flatten()[:64].clone()) \
                if first.layout is torch.strided and not first.is_meta else None
        elif self.g.step - self._cand[1] >= CONFIRM_STEPS or not self._still_missing():
            self._confirm()

    def _still_missing(self) -> bool:
        """Whether any candidate is still in no optimizer (an optimizer seen since may hold them all)."""
        still = set(self._missing_names())
        return any(n in still for n in self._cand[0])

    def on_exit(self):
        if not self._missing_done and self._cand is not None:
            self._confirm()  # a run of one step
        for refs, step, source, (kind, where, message, hint, details) in self._frozen_later:
            params = [p for p in (r() for r in refs) if p is not None]
            if params and not any(p.requires_grad for p in params):
                self.emit(kind, where, message, hint, step=step, source=source, details=details)

    def _confirm(self) -> None:
        self._missing_done = True
        versions, step, source = self._cand
        still = set(self._missing_names())
        named = dict(self.g.named_parameters())
        if still:
            # an optimizer the user's code holds that has not stepped yet (physical constants stepped every 20 steps
            # beside the network's optimizer): a global guard knows an optimizer from its first step only
            waiting = {id(q) for o in frame_optimizers() for grp in o.param_groups for q in grp["params"]}
            still = {n for n in still if n not in named or id(named[n]) not in waiting}
        # A parameter changed in place since (its version counter moved) was updated after all: by an
        # optimizer guard was not given (a probe's own), or by hand. One whose gradient is the same tensor, unchanged,
        # gets no more gradients: what is left of a finished run (an earlier round's model kept in a list).
        # The same parameter object still (or one re-bound in its place: `self.weight = nn.Parameter(...)` per
        # step): a model copied anew at every step (DARTS's unrolled model, whose gradients are read by hand) has
        # another one under the same name by now, and the first is gone.
        rebound = self._rebound.data
        missing = [n for n, (v, gref, gv, pref) in versions.items() if n in still and n in named
                   and (named[n] is pref() or id(named[n]) in rebound) and named[n]._version == v
                   and (named[n].grad is not gref() or named[n].grad._version != gv)]
        # Moved in place, yet in no optimizer: overwritten now and then (a target network synced by load_state_dict)
        # or trained elsewhere; if a later look finds them unmoved, that says which (and since when)
        for n, (v, _, _, _) in versions.items():
            if n in still and n in named and named[n]._version != v:
                self._moved.setdefault(n, step)
        # Moved, and their gradients piled up meanwhile (the same tensor, added to, never cleared): no optimizer uses
        # them, and what moves the weights is no gradient step: a Polyak/EMA target run with grad for the TD target
        piling = [n for n, (v, gref, gv, pref) in versions.items() if n in still and n in named
                  and named[n] is pref() and named[n]._version != v and named[n].grad is not None
                  and named[n].grad is gref() and 0 < named[n].grad._version - gv <= self._backwards - self._cand_at]
        # Replaced by a new nn.Parameter while an optimizer holds the old one (a dead latent resampled by
        # `sae.W_dec = nn.Parameter(W)`): what moves the new one is the code's own in-place renormalisation
        replaced = [n for n in piling if self._old_held(named[n])]
        if replaced and not missing:
            piling = [n for n in piling if n not in replaced]
            self._told.update(replaced)
            self._missing(replaced, step, source)
        how = self._moved_how() if piling and not missing else "none"
        if how == "by hand":
            self._piled_by_hand([named[n] for n in piling], piling, step, source)
            self._told.update(piling)
        if how is None and self._polyak([named[n] for n in piling], piling, step, source):
            self._told.update(piling)
        if missing:
            # Gradients computed as exactly 0 (a head whose loss term is weighted by 0, left out of the optimizer
            # on purpose) carry no signal to miss. Read once, when reporting.
            with torch.no_grad():
                grads = [named[n].grad.detach() for n in missing]
                norms = torch.stack([as_float(g.coalesce().values() if g.is_sparse else g).norm().cpu()
                                     for g in grads]).tolist()
            missing = [n for n, v in zip(missing, norms) if v != 0.0]
        if missing and self._matching_only(missing, named):
            missing = []
        if missing:
            self._told.update(missing)
            later = self._looked_before
            told = self._told_disconnected(missing) if later else None
            if told is not None:
                later, step = False, told  # missing from their first backward
            first_look = self._first_look[0] if self._first_look is not None else 0
            if later and not any(n in self._moved for n in missing) and all(
                    named[n].grad is not None for n in missing) and min(
                    named[n].grad._version for n in missing) + 1 >= step - first_look:
                # their gradients have piled up at every step since the first look: called from the start, only
                # after that look within its step (a global guard's per-layer roots: forward-forward's last layer)
                later, step = False, first_look
            if later and self._first_look is not None and all(
                    id(named[n]) in self._first_look[1] for n in missing):
                # there and trainable since the first look (co-teaching's second network, its optimizer built over
                # the first one's parameters): missing from the start, not appeared mid-run
                later, step = False, self._first_look[0]
            self._missing(missing, step, source, later=later)
        self._looked_before = True

    def _frozen(self, opt, groups: list, added: bool) -> None:
        frozen = [p for grp in groups for p in grp["params"] if not p.requires_grad]
        if not frozen:
            return
        names = [self.g.param_name(p) for p in frozen]
        prefixes = module_prefixes(names, [n for n, _ in self.g.named_parameters()], limit=11)
        shown, more = prefixes[:10], len(prefixes) > 10
        name = type(opt).__name__
        if added:  # a group added later while still frozen: its layer was never unfrozen, so it never trains
            message = (f"a param group added to {name} (add_param_group) holds {len(frozen)} parameter(s) with "
                       f"requires_grad=False ({_listing(shown, more)}): they get no gradient, so the optimizer "
                       f"never trains them")
            hint = ("Unfreeze them when adding their group: module.requires_grad_(True) before (or right after) "
                    "optimizer.add_param_group({'params': module.parameters()}).")
        else:
            total = sum(len(g["params"]) for g in opt.param_groups)
            message = (f"{len(frozen)} of the {total} parameters handed to {name} have requires_grad=False "
                       f"({_listing(shown, more)}): they are frozen, yet the optimizer holds them")
            ctor = f"torch.optim.{name}" if type(opt).__module__.startswith("torch.optim") else name
            hint = (f"Pass only trainable parameters: {ctor}(filter(lambda p: p.requires_grad, "
                    "model.parameters()), ...). If you unfreeze them later on purpose, this is fine.")
            tables = {id(m.weight) for root in self.g.watched.roots for m in root.modules()
                      if isinstance(m, nn.Embedding)}
            if frozen and all(id(p) in tables for p in frozen):
                # (pretrained vectors meant to be fine-tuned: from_pretrained freezes them unless told not to)
                hint += (" Embedding tables frozen by nn.Embedding.from_pretrained(vectors), whose freeze=True is "
                         "the default: pass freeze=False if they were meant to be fine-tuned.")
        args = ("frozen-param-in-optimizer", shown[0], message, hint)
        details = {"optimizer": name, "modules": shown, "parameters": len(frozen), "names": names[:20],
                   **({"added_group": True} if added else {})}
        if added:
            self.emit(*args, source=self.g.source(), details=details)
        else:
            self._frozen_later.append(([weakref.ref(p) for p in frozen], self.g.step, self.g.source(),
                                       args + (details,)))

    def _missing_names(self) -> List[str]:
        """Trainable parameters of the watched models with a gradient that no watched optimizer holds."""
        return [n for n, _ in self._loose()]

    def _loose(self) -> list:
        """(name, parameter) of the trainable parameters with a gradient that no watched optimizer holds; the
        parameters are looked at first, the (costlier) names only for those."""
        held = {id(p) for o in self.g.optimizers for grp in o.param_groups for p in grp["params"]}
        loose = [p for p in self._params() if p.requires_grad and p.is_leaf and p.grad is not None and id(p) not in held]
        if not loose:
            return []
        ids = {id(p) for p in loose}
        return [(n, p) for n, p in self.g.named_parameters() if id(p) in ids]

    def on_autograd_grad_done(self, args, kwargs, result):
        # (the inputs may be a generator, `net.parameters()`, which torch has consumed by now: the gradients' shapes
        # stand for them)
        create = kwargs.get("create_graph", args[4] if len(args) > 4 else False)
        if create and isinstance(result, (tuple, list)) and len(self._matched) < 4096:
            self._matched.update(tuple(t.shape) for t in result if isinstance(t, torch.Tensor))

    def _matching_only(self, missing: List[str], named: Dict[str, torch.Tensor]) -> bool:
        """Whether the `missing` parameters are a fixed model an attack matches gradients of: shaped as gradients
        taken with create_graph=True while every optimizer trains only tensors outside the watched models (Deep
        Leakage from Gradients optimising dummy inputs: their own `.grad` is a by-product, and they must keep
        requires_grad for that torch.autograd.grad)."""
        if not all(tuple(named[n].shape) in self._matched for n in missing):
            return False
        watched = {id(p) for p in self._params()}
        return not any(id(p) in watched for o in self.g.optimizers for grp in o.param_groups for p in grp["params"])

    def on_module_init(self, args, kwargs):
        self._params.forget()  # a module built since (a new head to assign): list the parameters again

    def on_register_parameter(self, args, kwargs):
        self._params.forget()  # a parameter assigned since: list the parameters again
        if len(args) >= 3 and isinstance(args[0], nn.Module) and isinstance(args[2], nn.Parameter) \
                and args[0]._parameters.get(args[1]) is not None:
            # a parameter replaced by a new nn.Parameter: more than once is a re-binding at every call. One already
            # registered in a module (weight tying, `head.weight = emb.weight`) is no new parameter: not counted
            if id(args[2]) in self._registered.data:
                return
            key = (id(args[0]), args[1])
            n, first = self._rebinds.get(key, (0, self.g.step))
            if n == 0:  # the first time: which one it replaced, when and where
                old = args[0]._parameters[args[1]]
                self._replaced[args[2]] = (self.g.step, self.g.source(), weakref.ref(old))
                # whether an optimizer held the one replaced: none did when the parameter is made in forward (never
                # there when the optimizer was built: `self.pos_embed = nn.Parameter(...)` in forward)
                opts = self.g.optimizers  # (none known yet under a global guard before the first step: no verdict)
                if opts and not any(q is old for o in opts for grp in o.param_groups for q in grp["params"]):
                    self._made_in_call.add(key)
            self._rebinds[key] = (n + 1, first)
            if n + 1 >= 2:
                self._rebound[args[2]] = first  # the step of the first re-binding
            if len(self._rebinds) > 4096:
                self._rebinds.clear()
        if len(args) >= 3 and isinstance(args[2], nn.Parameter):
            self._registered[args[2]] = True

    def _owner_of(self, name: str) -> Optional[nn.Module]:
        """The watched module holding the parameter named `name` (a qualified name)."""
        path = name.rpartition(".")[0]
        for root in self.g.roots:
            try:
                return root.get_submodule(path) if path else root
            except AttributeError:
                continue
        return None

    def _told_disconnected(self, missing: List[str]) -> Optional[int]:
        """The step of a `loss-disconnected` finding that named these parameters as the only ones the loss reaches,
        held by no optimizer (a probe's optimizer built over the frozen base): they are missing since then, not
        unfrozen or replaced mid-run."""
        for f in self.g.findings:
            if f.kind == "loss-disconnected":
                said = " ".join(r for r in f.details.get("reaches", ()) if "held by no optimizer" in r)
                if said and all(f" {n} " in said or f".{n} " in said for n in missing):
                    return f.step
        return None

    def _old_held(self, param: torch.Tensor) -> Optional[tuple]:
        """(step, line) of the re-binding that put `param` in place of a parameter an optimizer still holds."""
        ent = self._replaced.data.get(id(param))
        old = ent[2]() if ent is not None else None
        if old is None or not any(q is old for o in self.g.optimizers for grp in o.param_groups for q in grp["params"]):
            return None
        return ent[0], ent[1]

    def _moved_how(self) -> Optional[str]:
        """Whether the sampled parameter outside the optimizers moved by half its norm or more since the look: drawn
        anew (`reset_parameters()` each outer step of dataset distillation or of a hyper-parameter search), not
        averaged toward another network; or moved along its own (piled-up) gradient: updated by hand with it
        (PENCIL's `label_logits -= lr * label_logits.grad`), no Polyak target either."""
        sample, self._outside_sample = self._outside_sample, None
        p = sample[0]() if sample is not None else None
        if p is None:
            return None
        with torch.no_grad():
            now = p.detach().flatten()[:64].to(sample[1].device, sample[1].dtype)
            delta = now - sample[1]
            if bool(delta.norm() > 0.5 * sample[1].norm()):
                return "drawn anew"
            g = p.grad
            if g is None or g.layout is not torch.strided or g.is_meta:
                return None
            g = g.detach().flatten()[:64].to(delta.device, delta.dtype)
            if not bool(torch.nn.functional.cosine_similarity(delta, -g, dim=0) > 0.5):
                return None
            # A mean teacher run with gradient moves toward the student its loss pulls it to, along -grad too: an
            # average of a trained parameter of the same shape (moved toward it) is Polyak/EMA, not an update by hand
            for o in self.g.optimizers:
                for group in o.param_groups:
                    for q in group["params"]:
                        if q.shape == p.shape and q is not p and q.device == p.device:
                            toward = q.detach().flatten()[:64].to(delta.device, delta.dtype) - sample[1]
                            if bool(torch.nn.functional.cosine_similarity(delta, toward, dim=0) > 0.8):
                                return None
            return "by hand"

    def _piled_by_hand(self, params: List[torch.Tensor], names: List[str], step: int, source, owner=None) -> None:
        """In no optimizer, moved in place along their own gradient, which piles up: an update by hand (PENCIL's
        label logits, `p -= lr * p.grad`) that never clears `.grad`, so every update sums all earlier steps'."""
        self._outside_told.update(id(p) for p in params)
        named, owned, _ = _outside_names(params)
        if all(named):
            names, owner = named, owned or owner
        shown = module_prefixes(names, names, limit=11)[:10]
        what = owner or ", ".join(shown[:3])
        self.emit("param-not-in-optimizer", shown[0],
                  f"{len(params)} parameter(s) of {what} are in no optimizer and are updated by hand along their own "
                  f"gradient (`p -= lr * p.grad`), which is never cleared: .grad piles up, so each update applies the "
                  f"sum of every earlier step's gradients",
                  f"Clear the gradient after each update by hand ({shown[0]}.grad = None, or .zero_()), or hand the "
                  f"tensor to an optimizer and call its zero_grad() with the others.",
                  step=step, source=source,
                  details={"modules": shown, "parameters": len(params), "names": names[:20], "updated_by_hand": True,
                           "appeared_mid_run": False})

    def _polyak(self, params: List[torch.Tensor], names: List[str], step: int, source, owner=None) -> bool:
        """Parameters in no optimizer, changed in place at every step while gradients pile up on them: a target
        network updated by Polyak averaging (TD3, SAC, DDPG) whose TD target is computed with gradient."""
        synced = {id(p) for m in list(self._synced) for p in m.parameters()}
        params = [p for p in params if id(p) not in self._outside_told and id(p) not in synced]
        if not params:
            return False
        with torch.no_grad():
            if not any(bool((p.grad != 0).any()) for p in params if p.grad.layout is torch.strided):
                return False
        self._outside_told.update(id(p) for p in params)  # (told once: not again by a later look or walk)
        if any(f.kind == "loss-disconnected" for f in self.g.findings):
            return True  # the loss trains an averaged copy instead of the model (SWA's model forwarded): told so there
        named, owned, _ = _outside_names(params)  # the user's variables (`critic_t.q.0.weight`): clearer than paths
        if all(named):
            names, owner = named, owned or owner
        prefixes = module_prefixes(names, names, limit=11)
        shown = prefixes[:10]
        what = owner or ", ".join(shown[:3])
        self.emit("param-not-in-optimizer", shown[0],
                  f"{len(params)} parameter(s) of {what} get gradients from the loss at every step, are in no optimizer, "
                  f"and change in place between steps while those gradients pile up in .grad (nothing uses or clears "
                  f"them): a target network updated by Polyak/EMA averaging, run with gradient for the targets it gives (a TD target, a mean teacher's): "
                  f"the target is not a constant, and back-propagation goes through it for nothing",
                  TARGET_FIX, step=step, source=source,
                  details={"modules": shown, "parameters": len(params), "names": names[:20], "polyak_target": True,
                           "appeared_mid_run": False})
        return True

    def _missing(self, missing: List[str], step: int, source, later: bool = False) -> None:
        named = self.g.named_parameters()
        prefixes = module_prefixes(missing, [n for n, _ in named], limit=11)
        shown, more = prefixes[:10], len(prefixes) > 10
        opts = ", ".join(type(o).__name__ for o in self.g.optimizers)
        synced = [n for n in missing if n in self._moved]
        extra: dict = {}
        gone = set(missing)
        rebound = [self._rebound.data[id(p)] for n, p in named if n in gone and id(p) in self._rebound.data]
        replaced = [self._old_held(p) for n, p in named if n in gone]
        made = rebound and all((id(mod), attr) in self._made_in_call for n in gone if (
            mod := self._owner_of(n)) is not None and (attr := n.rpartition(".")[2]))
        if rebound and made:
            # made anew at every call and never held by an optimizer (built before the first forward): a parameter
            # created in forward, not one renormalised by re-binding
            step = min(rebound)
            message = (f"{len(missing)} trainable parameter(s) get gradients but are in no optimizer ({opts}): "
                       f"{_listing(shown, more)}; each is created anew as an nn.Parameter at every call (in forward), "
                       f"so none was there when the optimizer was built, and each new one starts from scratch: it "
                       f"never trains")
            hint = ("Create the parameter once, in __init__ (`self.pos_embed = nn.Parameter(torch.zeros(1, n, d))`), "
                    "and only use it in forward; build the optimizer after the model is complete.")
            later, extra = False, {"rebound_per_call": True, "created_in_forward": True}
        elif rebound:
            # re-bound again and again (in forward, or after each step): the optimizer holds the first one; before
            # the `later` cases, which would take the new ones for a layer unfrozen mid-run
            step = min(rebound)
            message = (f"{len(missing)} trainable parameter(s) get gradients but are in no optimizer ({opts}): "
                       f"{_listing(shown, more)}; each is replaced by a new nn.Parameter again and again (`self.weight "
                       f"= nn.Parameter(...)` in forward or after each step, to renormalize it) since step {step}, so "
                       f"the optimizer holds the first one, "
                       f"which gets no gradient any more, and the new ones are never updated")
            hint = ("Change the weight in place instead of re-binding it: `with torch.no_grad(): "
                    "self.weight.copy_(self.weight / sigma)`, or compute the normalized weight as a tensor used in "
                    "forward (w = self.weight / sigma), or register a parametrization "
                    "(torch.nn.utils.parametrizations.spectral_norm, parametrize.register_parametrization).")
            later, extra = False, {"rebound_per_call": True}
        elif replaced and all(replaced):
            step, line = min(r[0] for r in replaced), replaced[0][1]
            message = (f"{len(missing)} trainable parameter(s) get gradients but are in no optimizer ({opts}): "
                       f"{_listing(shown, more)}; each was replaced by a new nn.Parameter at step {step} ({line}), "
                       f"and the optimizer still holds the old one: the new one is never updated by it, and its "
                       f"gradients pile up (zero_grad() never clears them)")
            hint = ("Write the new values into the parameter the optimizer holds instead of re-binding it: `with "
                    "torch.no_grad(): module.weight.copy_(new_values)` (and reset the optimizer's state for the rows "
                    "you changed, e.g. Adam's exp_avg/exp_avg_sq), or rebuild the optimizer over the new parameters.")
            extra = {"replaced": True, "replaced_at": line}
        elif later and len(synced) == len(missing):
            # Seen with gradients before, but overwritten in place meanwhile: a copy synced now and then (a target
            # network's load_state_dict every N steps) that a forward outside no_grad gives gradients to.
            step = min(self._moved[n] for n in synced)
            message = (f"{len(missing)} parameter(s) get gradients but are in no optimizer ({opts}): {_listing(shown, more)}; "
                       f"they have had gradients since step {step} and are only overwritten now and then (a target "
                       f"network synced with load_state_dict or copy_), so the forward through them ran outside "
                       f"torch.no_grad(): backward() computes gradients for them that nothing uses, and they pile up")
            hint = TARGET_FIX + " If they are meant to train, add them to the optimizer."
            later, extra = False, {"synced_copy": True}
        elif later and all(id(p) in self._was_held for n, p in named if n in set(missing)):
            # Held by an optimizer at the last look: taken out of it since (a param group popped to freeze a part,
            # the optimizer rebuilt without them) while they still require grad.
            message = (f"{len(missing)} parameter(s) were taken out of the optimizer ({opts}) after step "
                       f"{self._held_step} (a param group removed, the optimizer rebuilt without them) but still "
                       f"require grad and get gradients: {_listing(shown, more)}; backward() computes gradients for "
                       f"them that nothing uses, and they pile up (zero_grad() no longer clears them)")
            hint = ("To freeze them, set requires_grad_(False) on them (or run that part under torch.no_grad()): "
                    "backward() then skips them. If they should still train, put them back in the optimizer.")
            extra = {"removed_from_optimizer": True}
        elif later and (unfrozen := self._unfrozen_at(missing, named)) is not None:
            # made trainable by a `requires_grad_(True)` guard saw, after the optimizer was built over the rest
            step, source = unfrozen
            message = (f"{len(missing)} parameter(s) of {_listing(shown, more)} were made trainable at step {step} "
                       f"({source}: requires_grad_(True)) but are in no optimizer ({opts}): optimizer.step() never "
                       f"updates them, and zero_grad() never clears their gradients, which pile up")
            hint = ("Add them to the optimizer when unfreezing: optimizer.add_param_group({'params': "
                    "model.<module>.parameters()}) (with the learning rate you want for them), or build the optimizer "
                    "over every parameter you will train and keep the frozen ones' requires_grad=False until then.")
            extra = {"unfrozen": True, "unfrozen_at": source}
        elif later and self._whole_models(missing, named):
            # A whole model called since the last look, none of it in an optimizer, while the optimizer trains
            # another: a second network (a teacher or target copied from the model) run outside no_grad.
            models = self._whole_models(missing, named)
            shown, more = models[:10], len(models) > 10
            message = (f"{len(missing)} parameter(s) of {_listing(shown, more)}, a model that appeared mid-run (by "
                       f"step {step}) beside the one {opts} trains, get gradients but are in no optimizer: "
                       f"backward() computes gradients for them that nothing uses, and they pile up (zero_grad() "
                       f"never clears them)")
            hint = ("If it is a teacher or target network (a copy of the model made mid-run for distillation, LwF, "
                    "or a target): " + TARGET_FIX + " If it should train, add it to the optimizer: "
                    "optimizer.add_param_group({'params': other_model.parameters()}).")
            extra = {"second_model": models[:3]}
        elif later:
            # They had no gradient at the earlier looks: unfrozen mid-run (requires_grad_(True)) and never added.
            since = (f"since a step between {self._held_step + 1} and {step} (the look at step {self._held_step} found "
                     f"none)" if self._looked_before and self._held_step + 1 < step else
                     f"since step {step} or a little earlier")
            message = (f"{len(missing)} parameter(s) that had no gradient before get gradients {since} (a layer "
                       f"attached, unfrozen or replaced mid-run?) but are in no optimizer ({opts}): {_listing(shown, more)}; "
                       f"optimizer.step() never updates them, and zero_grad() never clears their gradients, which "
                       f"pile up")
            hint = ("When unfreezing or replacing a layer mid-run, add its parameters to the optimizer too: "
                    "optimizer.add_param_group({'params': model.<module>.parameters()}) (with the learning rate "
                    "you want for them), or build a new optimizer over model.parameters().")
        elif self._masters(missing, named):
            message = (f"{len(missing)} trainable parameter(s) get gradients but are in no optimizer ({opts}): "
                       f"{_listing(shown, more)}; {opts} holds copies of them in another dtype (fp32 master "
                       f"weights), which it updates, but the model keeps its own weights: optimizer.step() never "
                       f"changes the model that runs")
            hint = ("Copy the updated master weights back into the model after each step: with torch.no_grad(): "
                    "for m, p in zip(master_params, model.parameters()): p.copy_(m). (torch.autocast with a float32 "
                    "model does this bookkeeping for you.)")
            extra = {"master_copies": True}
        else:
            message = (f"{len(missing)} trainable parameter(s) get gradients but are in no optimizer ({opts}): "
                       f"{_listing(shown, more)}; optimizer.step() never updates them")
            hint = ("Build the optimizer after the model is final (e.g. after replacing a layer or head), or add "
                    "them: optimizer.add_param_group({'params': model.<module>.parameters()}). If they are meant "
                    "to stay fixed, set requires_grad=False.")
        rest = self._rest_of_parents(shown, missing, named)
        if rest:
            parents = sorted({q for q, _ in rest})
            message += (f" (the rest of {', '.join(parents[:3])}{' ...' if len(parents) > 3 else ''}, {len(rest)} "
                        f"parameter(s) with no gradient signal yet, is in no optimizer either)")
            extra["rest_of_module"] = [n for _, n in rest][:20]
        self.emit("param-not-in-optimizer", shown[0], message, hint, step=step, source=source,
                  details={"modules": shown, "parameters": len(missing), "names": missing[:20],
                           "appeared_mid_run": later, **extra})

    def _unfrozen_at(self, missing: List[str], named: list) -> Optional[Tuple[int, Optional[str]]]:
        """(step, line) of the earliest `requires_grad_(True)` that unfroze every missing parameter; None if not so."""
        gone = set(missing)
        ats = [self._unfrozen.data.get(id(p)) for n, p in named if n in gone]
        if not ats or any(a is None for a in ats):
            return None
        return min(ats, key=lambda a: a[0])

    def _whole_models(self, missing: List[str], named: list) -> List[str]:
        """The outermost models (a global guard's roots) that hold every missing parameter and none held by an
        optimizer, while another model has parameters an optimizer holds: [] unless that is so."""
        want = {id(p) for n, p in named if n in set(missing)}
        held = self._held()
        whole, other = [], False
        for root in self.g.roots:
            ps = [p for p in root.parameters() if p.requires_grad]
            if not ps:
                continue
            if any(id(p) in held for p in ps):
                other = True
            elif all(id(p) in want for p in ps):
                owner = _outside_names(ps[:1])[1]  # the variable holding it (`teacher`), if any
                whole.append(owner or self.g.path_of(root))
                want -= {id(p) for p in ps}
        return whole if whole and other and not want else []

    def _masters(self, missing: List[str], named: list) -> bool:
        """Whether the optimizers hold tensors of the missing parameters' shapes in another dtype, with gradients
        (fp32 master weights of a half-precision model, fed its gradients by hand)."""
        want = set(missing)
        params = [p for n, p in named if n in want]
        held = [p for o in self.g.optimizers for grp in o.param_groups for p in grp["params"]]
        if not params or len(held) < len(params) or any(p.grad is None for p in held):
            return False
        shapes = sorted(tuple(p.shape) for p in held)
        return all(tuple(p.shape) in shapes for p in params) and \
            {p.dtype for p in params}.isdisjoint({p.dtype for p in held})

    def _rest_of_parents(self, shown: List[str], missing: List[str], named: list) -> List[Tuple[str, str]]:
        """(parent, name) of the trainable parameters no optimizer holds under the parent modules of `shown`
        (a block whose last layer is reported) that are not reported themselves: their gradients are exactly 0
        (a zero-initialised last layer passes no gradient back), but the block as a whole is left out."""
        parents = {m.rsplit(".", 1)[0] for m in shown if "." in m}
        if not parents:
            return []
        held = {id(p) for o in self.g.optimizers for grp in o.param_groups for p in grp["params"]}
        reported = set(missing)
        return [(q, n) for n, p in named if p.requires_grad and id(p) not in held and n not in reported
                for q in parents if n.startswith(q + ".")]
