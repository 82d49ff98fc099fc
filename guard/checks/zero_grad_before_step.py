"""``zero_grad()`` between ``backward()`` and ``optimizer.step()``: the step applies no gradient.

``loss.backward(); optimizer.zero_grad(); optimizer.step()`` wipes the gradients
just computed: with ``set_to_none=True`` (the default) the step skips every
parameter, with zeros only weight decay and momentum act. Nothing learns, and no
error says so.

Observed, not guessed from values: ``Optimizer.zero_grad`` and ``Module.zero_grad``
are watched through declared patches, ``backward()`` through the guard. Backwards
are counted; an optimizer's ``zero_grad()`` remembers the count. At that optimizer's
``step()``, the bug is: a backward came after its previous step, then ``zero_grad()``,
and no backward since. Zeroing before ``backward()``, after ``step()``, gradient
accumulation (several backwards, one step, then ``zero_grad()``) and GAN loops (one
network's ``zero_grad()`` after the other's backward, then its own backward) stay
silent. A ``Module.zero_grad()`` counts for an optimizer only when the module holds
all of that optimizer's parameters (zeroing one part on purpose is left alone).

A ``zero_grad()`` that finds no gradient on its parameters wiped nothing: the backwards never reached
them (an optimizer built over the original of a deep-copied model that trains). That is
``param-not-in-optimizer``'s or the copy notice's to tell, not this check's.

Gradients found at the step after such a ``zero_grad()`` (zeros, or set by hand on
purpose: gradient surgery assigns ``p.grad``) are checked: their joint norm is staged
with the step's other values, and only an all-zero one counts.

Cost: a counter per ``backward()``, a few attribute writes per ``zero_grad()``, one
comparison per ``step()``; device work only in the buggy order. Nothing per module call.
"""
from __future__ import annotations

import weakref
from typing import Optional, Tuple

import torch

from ..tensors import fused_norms
from .base import Check
from .._weak import WeakIdMap


def _stored(g: torch.Tensor) -> bool:
    """Whether a sparse gradient stores any value (``_nnz()``, known on the host)."""
    try:
        return g._nnz() > 0
    except Exception:
        return True  # a layout that does not tell: not taken for wiped


class _Opt:
    __slots__ = ("zero_at", "zero_src", "stepped_at", "n_params", "ids", "had_grads")

    def __init__(self, stepped_at: int) -> None:
        self.zero_at = -1  # backward count at its latest zero_grad()
        self.zero_src: Optional[str] = None
        self.stepped_at = stepped_at  # backward count at its latest step()
        self.n_params = -1
        self.ids: frozenset = frozenset()
        self.had_grads = True  # whether its parameters held gradients when its latest zero_grad() began


class ZeroGradBeforeStep(Check):
    name = "zero-grad-before-step"
    costly = True  # sampled under a budget: a property of the code, seen on any step it runs
    kinds = {"zero-grad-before-step": ("error", "zero_grad() between backward() and optimizer.step(): the step "
                                                "applies no gradient")}
    description = "zero_grad() called between backward() and optimizer.step(): the step applies no gradient"
    patches = {"order_opt_zero_grad": "torch.optim.Optimizer.zero_grad",
               "order_module_zero_grad": "torch.nn.Module.zero_grad"}

    def watches(self, module) -> bool:
        return False

    def __init__(self, guard):
        super().__init__(guard)
        self._backwards = 0
        self._backward_src: Optional[str] = None
        self._st = WeakIdMap()  # optimizer -> _Opt

    def _state(self, opt) -> _Opt:
        st = self._st.data.get(id(opt))
        if st is None:
            st = self._st[opt] = _Opt(0)
        return st

    def on_backward_done(self, tensors, kwargs):
        self._backwards += 1
        self._backward_src = self.g.root_source

    def on_order_opt_zero_grad(self, args, kwargs):
        if not args or not isinstance(args[0], torch.optim.Optimizer):
            return
        st = self._state(args[0])
        if self._backwards > st.stepped_at:
            # Only the suspicious order pays for this look: no gradient to wipe means none of this optimizer's
            # parameters was reached by those backwards (it is built over another copy of the model).
            st.had_grads = any(p.grad is not None for grp in args[0].param_groups for p in grp["params"])

    def on_order_opt_zero_grad_done(self, args, kwargs, result):
        if not args or not isinstance(args[0], torch.optim.Optimizer):
            return
        st = self._state(args[0])
        if not st.had_grads:
            st.had_grads = True
            st.zero_at = -1  # it wiped nothing
            return
        st.zero_at = self._backwards
        # Only a zero_grad() after a backward (and before the step) can be reported: the line is looked up then.
        st.zero_src = self.g.source() if st.zero_at > st.stepped_at else None

    def on_order_module_zero_grad_done(self, args, kwargs, result):
        if not args or self._backwards == 0:
            return
        mod = args[0]
        mids = None
        for opt in self.g.optimizers:
            st = self._state(opt)
            if st.stepped_at >= self._backwards:
                continue  # no backward since its last step: nothing to wipe
            n = sum(len(grp["params"]) for grp in opt.param_groups)
            if n != st.n_params:
                st.n_params = n
                st.ids = frozenset(id(p) for grp in opt.param_groups for p in grp["params"])
            if mids is None:
                mids = {id(p) for p in mod.parameters()}
            if st.ids and st.ids <= mids:
                st.zero_at = self._backwards
                st.zero_src = self.g.source()

    def on_step_pre(self, optimizer):
        st = self._st.data.get(id(optimizer))
        if st is None or st.zero_at != self._backwards or st.zero_at <= st.stepped_at:
            return
        present = [g for grp in optimizer.param_groups for p in grp["params"] if (g := p.grad) is not None]
        if not present:
            self._emit(optimizer, st, none=True)
            return
        if any(g.layout is not torch.strided and not g.is_meta and _stored(g) for g in present):
            return  # a sparse gradient holding values after zero_grad(): set by hand (surgery on an embedding's)
        grads = [g for g in present if g.layout is torch.strided and not g.is_meta]
        if not grads:
            return
        # Gradients present after a zero_grad(): zeros (set_to_none=False), or set by hand on purpose (gradient
        # surgery: p.grad = merged). Their joint norm is read with the step's other values: zero means wiped.
        with torch.no_grad():
            _, totals = fused_norms(grads)
        total = torch.stack([t.float().cpu() if len(totals) > 1 else t.float() for t in totals.values()]).sum()
        oref = weakref.ref(optimizer)
        info = (st.zero_src, self._backward_src, self.g.source(), self.g.step)

        def verdict(v: float) -> None:
            opt = oref()
            if v == 0.0 and opt is not None:
                self._emit(opt, st, none=False, info=info)

        self.g.stage(total, verdict)

    def on_step_post(self, optimizer):
        self._state(optimizer).stepped_at = self._backwards

    def _emit(self, opt, st: _Opt, none: bool, info: Optional[Tuple] = None) -> None:
        zero_src, backward_src, src, step = info or (st.zero_src, self._backward_src, self.g.source(), self.g.step)
        where = self._label(opt)
        effect = ("every gradient is None, so the step skips all parameters" if none else
                  "every gradient is zero, so only weight decay and momentum move the parameters")
        message = (f"{where}.step() runs right after zero_grad() ({zero_src}), which came after backward() "
                   f"({backward_src}): the gradients of this step were wiped before the update; {effect}, "
                   f"and the model does not learn")
        hint = ("Zero the gradients before backward() (or right after step()): optimizer.zero_grad(); "
                "loss.backward(); optimizer.step().")
        self.emit("zero-grad-before-step", where, message, hint, source=src, step=step,
                  details={"optimizer": type(opt).__name__, "zero_grad_source": zero_src,
                           "backward_source": backward_src, "grads": "None" if none else "zero"})

    def _label(self, opt) -> str:
        name = type(opt).__name__
        same = [o for o in self.g.optimizers if type(o).__name__ == name]
        if len(same) > 1 and any(o is opt for o in same):
            return f"{name}[{next(i for i, o in enumerate(same) if o is opt)}]"
        return name
