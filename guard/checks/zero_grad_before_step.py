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
from typing import Dict, Optional, Tuple

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


def _first_grad(opt) -> Optional[torch.Tensor]:
    """The gradient of the optimizer's first parameter that has one (its very first parameter's, usually)."""
    groups = opt.param_groups
    if groups and groups[0]["params"]:
        g = groups[0]["params"][0].grad
        if g is not None:
            return g
    return next((g for grp in groups for p in grp["params"] if (g := p.grad) is not None), None)


class _Opt:
    __slots__ = ("zero_at", "zero_src", "stepped_at", "n_params", "ids", "had_grads", "wiped", "wiped_src", "run",
                 "run_src", "run_step", "module_zero", "seen_grad", "hand", "hand_src", "post_version", "bw_grad",
                 "drun", "drun_step", "loop", "to_none")

    def __init__(self, stepped_at: int) -> None:
        self.zero_at = -1  # backward count at its latest zero_grad()
        self.zero_src: Optional[str] = None
        self.stepped_at = stepped_at  # backward count at its latest step()
        self.n_params = -1
        self.ids: frozenset = frozenset()
        self.had_grads = True  # whether its parameters held gradients when its latest zero_grad() began
        # parameters whose gradients its latest zero_grad() wiped after a backward (before a step), and that
        # backward's line: a backward after the wipe that leaves some of them without gradient lost theirs
        self.wiped: Optional[list] = None
        self.wiped_src: Optional[str] = None
        self.run, self.run_src, self.run_step = 0, None, -1  # steps in a row with such a partial wipe
        self.module_zero = False  # its latest zero_grad() after a backward was a module's covering its parameters
        # Gradients written by hand (DP-SGD's `p.grad = noisy_clipped`, from torch.func, no backward()): the first
        # gradient its latest step() applied (its id), whether a zero_grad() with no backward since that
        # step found another one (written since), and then that zero_grad()'s line
        self.seen_grad = 0  # id() of that gradient (alive while compared: .grad holds it until replaced), or 0
        self.hand = False
        self.hand_src: Optional[str] = None
        self.post_version = -1  # its first parameter's version counter after its latest step (-1: none yet)
        self.bw_grad = 0  # id() of its first gradient after the latest backward() while `wiped` is armed
        self.drun, self.drun_step = 0, -1  # steps in a row whose earlier backward's gradients were all discarded
        self.loop = False  # the backward its latest zero_grad() wiped was a plain one (no `inputs=`)
        self.to_none = True  # its latest zero_grad() set the gradients to None (the default since torch 2.0)


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
        self._sites: Dict[tuple, str] = {}  # (zero_grad line, backward line, step line) -> the where it was told at
        self._backwards = 0
        self._backward_src: Optional[str] = None
        self._st = WeakIdMap()  # optimizer -> _Opt
        self._any_step = 0  # backward count at the latest step() of any optimizer
        self._armed = False  # some optimizer's zero_grad() wiped a backward's gradients that no step used yet
        self._plain = True  # the latest backward was a plain one (not restricted to `inputs=`)

    def _state(self, opt) -> _Opt:
        st = self._st.data.get(id(opt))
        if st is None:
            st = self._st[opt] = _Opt(0)
        return st

    def on_backward_done(self, tensors, kwargs):
        self._backwards += 1
        self._backward_src = self.g.root_source
        # a backward restricted to some inputs (latent inference) or for an input's gradient is no training backward
        self._plain = not (kwargs and kwargs.get("inputs") is not None)
        if self._armed:  # a zero_grad() wiped a backward's gradients before any step: which gradient this one left
            for o, st in self._st.items():
                if st.wiped is not None:
                    g = _first_grad(o)
                    st.bw_grad = id(g) if g is not None else 0

    def on_order_opt_zero_grad(self, args, kwargs):
        if not args or not isinstance(args[0], torch.optim.Optimizer):
            return
        st = self._state(args[0])
        if self._backwards <= st.stepped_at:
            # no backward since its last step: gradients there now that its step did not apply were written by hand
            g0 = _first_grad(args[0])
            st.hand = g0 is not None and id(g0) != st.seen_grad
        if self._backwards > st.stepped_at:
            # Only the suspicious order pays for this look: no gradient to wipe means none of this optimizer's
            # parameters was reached by those backwards (it is built over another copy of the model).
            wiped = [p for grp in args[0].param_groups for p in grp["params"] if p.grad is not None]
            st.had_grads = bool(wiped)
            # Gradients a step of any optimizer came after are leftovers (GDAS/DARTS: the architecture step's
            # backward also fills the weights' gradients, which the weights' zero_grad() rightly drops): only a
            # backward no step has followed yet can have its work lost.
            st.wiped = wiped if wiped and self._backwards > self._any_step else None
            st.wiped_src = self._backward_src
            st.loop = self._plain  # whether the backward it wipes was a plain one (see _discarded)
            st.to_none = bool(kwargs.get("set_to_none", args[1] if len(args) > 1 else True))
            if st.wiped is not None and st.post_version >= 0:
                groups = args[0].param_groups
                p0 = groups[0]["params"][0] if groups and groups[0]["params"] else None
                if p0 is not None and p0._version != st.post_version:
                    # the weights were changed in place since its last step, after that backward: an update by hand
                    # or SAM's perturbation used its gradients; zeroing them then is the recipe
                    st.wiped = None
            self._armed = self._armed or st.wiped is not None

    def on_order_opt_zero_grad_done(self, args, kwargs, result):
        if not args or not isinstance(args[0], torch.optim.Optimizer):
            return
        st = self._state(args[0])
        st.module_zero = False
        if st.hand:
            st.hand, st.hand_src = False, self.g.source()
        if not st.had_grads:
            st.had_grads = True
            st.zero_at = -1  # it wiped nothing
            return
        st.zero_at = self._backwards
        # Only a zero_grad() after a backward (and before the step) can be reported: the line is looked up then.
        st.zero_src = self.g.source() if st.zero_at > st.stepped_at else None
        if st.zero_src is not None:
            # a wrapper sharing its base optimizer's param_groups (SAM, Lookahead) zeroes the base's gradients
            for o, _ in self._st.items():
                if o is not args[0] and getattr(o, "param_groups", None) is args[0].param_groups:
                    other = self._state(o)
                    if self._backwards > other.stepped_at:
                        other.zero_at, other.zero_src = st.zero_at, st.zero_src
                        other.wiped, other.wiped_src = st.wiped, st.wiped_src

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
                st.module_zero, st.wiped_src = True, self._backward_src

    def on_step_pre(self, optimizer):
        st = self._st.data.get(id(optimizer))
        if st is None:
            st = self._first_step(optimizer)
        if st is None:
            st = self._state(optimizer)
        g0 = _first_grad(optimizer)
        if st.hand_src is not None:
            zero_src, st.hand_src = st.hand_src, None
            if g0 is None and self._backwards <= st.stepped_at:
                self._emit(optimizer, st, none=True, info=(zero_src, None, self.g.source(), self.g.step, None))
        st.seen_grad = id(g0) if g0 is not None else 0
        if st.zero_at <= st.stepped_at:
            return
        between = st.zero_at != self._backwards
        if between:
            if st.wiped is not None:
                self._partial(optimizer, st)
                return
            if not st.module_zero:
                return
            # `wm_loss.backward(); wm.zero_grad(); cr_loss.backward(); cr_opt.step(); wm_opt.step()`: the backwards
            # after the module's zero_grad() may have reached none of this optimizer's parameters
        present = [g for grp in optimizer.param_groups for p in grp["params"] if (g := p.grad) is not None]
        info = (st.zero_src, st.wiped_src if between else self._backward_src, self.g.source(), self.g.step,
                self._backward_src if between else None)
        if not present:
            self._emit(optimizer, st, none=True, info=info)
            return
        if st.to_none and not between and not st.module_zero:
            # zero_grad(set_to_none=True) left None and no backward came since: these gradients were written by hand
            # after it (Reptile's pseudo-gradient `p.grad = before - after`), as the recipe has it, whatever their value
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

        def verdict(v: float) -> None:
            opt = oref()
            if v == 0.0 and opt is not None:
                self._emit(opt, st, none=False, info=info)

        self.g.stage(total, verdict)

    def _first_step(self, optimizer) -> Optional[_Opt]:
        """An optimizer first seen at its step: a base optimizer whose wrapper (SAM, sharing its param_groups)
        zeroed the gradients just before calling it; the wrapper's zero_grad() counts for it."""
        for o, other in self._st.items():  # (a wrapper that never steps itself is no watched optimizer)
            if o is not optimizer and getattr(o, "param_groups", None) is optimizer.param_groups:
                if other.zero_at > other.stepped_at:
                    st = self._state(optimizer)
                    st.zero_at, st.zero_src, st.wiped, st.wiped_src = (other.zero_at, other.zero_src, other.wiped,
                                                                       other.wiped_src)
                    return st
        return None

    def _partial(self, optimizer, st: _Opt) -> None:
        """A backward came after the zero_grad(): the step applies its gradients. The parameters that only the
        backward before the zero_grad() reached have none (None, or zeros left by set_to_none=False): that
        backward's work was thrown away (`opt.zero_grad(); loss_pi.backward(); opt.zero_grad(); loss_v.backward();
        opt.step()`). Told at the third step in a row (a one-off diagnostic backward is no bug)."""
        wiped, st.wiped = st.wiped, None
        g0 = _first_grad(optimizer)
        # gradients written by hand after the last backward (gradient surgery: PCGrad projects each task's gradients,
        # kept aside between zero_grad()s, and assigns p.grad): the zeroing was part of the recipe
        hand = g0 is None or id(g0) != st.bw_grad
        lost = [p for p in wiped if p.grad is None]
        kept = [p for p in wiped if p.grad is not None and p.grad.layout is torch.strided and not p.grad.is_meta]
        info = (st.zero_src, st.wiped_src, self.g.source(), self.g.step)
        oref = weakref.ref(optimizer)
        if st.to_none:
            # zero_grad(set_to_none=True) left None: a gradient there now was computed by the later backward, exactly 0
            # or not (an energy model's output bias cancels in E(pos).mean() - E(neg).mean())
            kept = []
        if not kept:
            self._lost(oref, st, lost, info, hand)
            return
        with torch.no_grad():
            grads = [p.grad for p in kept]
            try:
                norms = torch.stack(list(torch._foreach_norm(grads)))
            except RuntimeError:  # mixed devices or dtypes (a model split across GPUs)
                norms = torch.stack([torch.linalg.vector_norm(g.float()).cpu() for g in grads])
        prefs = [weakref.ref(p) for p in kept]

        def verdict(n_zero: float) -> None:
            # which ones are read only when some are zero (the buggy order: one more read then)
            zeros = [r() for r, v in zip(prefs, norms.tolist()) if v == 0.0] if n_zero > 0 else []
            self._lost(oref, st, lost + [p for p in zeros if p is not None], info, hand)

        self.g.stage((norms == 0).sum().float(), verdict)

    def _lost(self, oref, st: _Opt, lost: list, info: Tuple, hand: bool = False) -> None:
        zero_src, wiped_src, src, step = info
        if not lost:
            st.run = 0
            self._discarded(oref, st, info, hand)
            return
        st.run = st.run + 1 if st.run_src == zero_src and st.run_step == step - 1 else 1
        st.run_src, st.run_step = zero_src, step
        opt = oref()
        if st.run < 3 or opt is None:
            return
        names = [self.g.param_name(p) for p in lost if p is not None]
        where = self._label(opt)
        shown = ", ".join(names[:6]) + (" ..." if len(names) > 6 else "")
        message = (f"{where}.step() applies only the gradients of the backward() after zero_grad() ({zero_src}): "
                   f"that zero_grad() came after an earlier backward() ({wiped_src}) and wiped its gradients before "
                   f"any step used them; {len(names)} parameter(s) that only the earlier one reaches get no gradient "
                   f"at the step ({shown}), at every step since step {step - st.run + 1}, and do not learn")
        hint = ("Zero the gradients once per step, before the first backward(): opt.zero_grad(); "
                "loss_a.backward(); loss_b.backward(); opt.step() (the gradients add up), or (loss_a + loss_b)."
                "backward().")
        self.emit("zero-grad-before-step", where, message, hint, source=src, step=step - st.run + 1,
                  details={"optimizer": type(opt).__name__, "zero_grad_source": zero_src,
                           "backward_source": wiped_src, "grads": "wiped then partly recomputed",
                           "lost": names[:20]})

    def _discarded(self, oref, st: _Opt, info: Tuple, hand: bool) -> None:
        """Every parameter the wiped backward reached got a gradient again from the backward after the zero_grad(), at
        the same line: zero_grad() at the top of each micro-batch of an accumulation, so the step applies only the
        last micro-batch's gradients. Told at the third step in a row; not when the gradients at the step were written
        by hand (`hand`: gradient surgery keeps each pass's gradients aside and assigns p.grad)."""
        zero_src, wiped_src, src, step = info
        # Only a loop over micro-batches (`for mb in chunks: opt.zero_grad(); loss(mb).backward()`, then the step): the
        # wiped backward ran at the line of the last one. Two backwards at two lines with a zero_grad() between are
        # often deliberate (an attack's input-gradient backward, a diagnostic pass before the training one).
        if hand or not (st.loop and self._plain and wiped_src == self._backward_src):
            st.drun = 0
            return
        st.drun = st.drun + 1 if st.drun_step == step - 1 else 1
        st.drun_step = step
        opt = oref()
        if st.drun < 3 or opt is None:
            return
        where = self._label(opt)
        message = (f"{where}.step() applies only the gradients of the last backward() before it: zero_grad() "
                   f"({zero_src}) came after an earlier backward() ({wiped_src}) and wiped its gradients before any step "
                   f"used them, at every step since step {step - st.drun + 1}"
                   + ": each micro-batch's zero_grad() throws away the gradients of the ones before it, so the step "
                     "sees one micro-batch, not the accumulated batch")
        hint = ("Zero the gradients once per step, before the first backward(): opt.zero_grad(); then every "
                "backward() of the step (micro-batches: (loss / n_micro).backward() each; several losses: "
                "loss_a.backward(); loss_b.backward(), or (loss_a + loss_b).backward()); then opt.step().")
        self.emit("zero-grad-before-step", where, message, hint, source=src, step=step - st.drun + 1,
                  details={"optimizer": type(opt).__name__, "zero_grad_source": zero_src,
                           "backward_source": wiped_src, "grads": "wiped then recomputed", "discarded": True,
                           "micro_batches": True})

    def on_step_post(self, optimizer):
        st = self._state(optimizer)
        st.stepped_at = self._any_step = self._backwards
        groups = optimizer.param_groups
        if groups and groups[0]["params"]:
            st.post_version = groups[0]["params"][0]._version
        if self._armed:
            self._armed = any(o.wiped is not None for o in self._st.values())

    def _emit(self, opt, st: _Opt, none: bool, info: Optional[Tuple] = None) -> None:
        zero_src, backward_src, src, step, later = info or (st.zero_src, self._backward_src, self.g.source(),
                                                            self.g.step, None)
        where = self._label(opt)
        # one finding a site: the members of a deep ensemble stepped by one loop line (`for m, o in zip(models,
        # opts)`) are one bug, and one optimizer's label changes when a global guard meets the next of its type
        site = (zero_src, backward_src, src)
        first = self._sites.get(site)
        if first is not None and first != where:
            self.g.seen_again("zero-grad-before-step", first)
            return
        if len(self._sites) < 64:
            self._sites[site] = where
        effect = ("every gradient is None, so the step skips all parameters" if none else
                  "every gradient is zero, so only weight decay and momentum move the parameters")
        if backward_src is None:  # gradients written by hand (`p.grad = ...`), no backward()
            self.emit("zero-grad-before-step", where,
                      f"{where}.step() runs right after zero_grad() ({zero_src}), which came after the gradients were "
                      f"written by hand (`p.grad = ...`, no backward() since the last step): they were wiped before "
                      f"the update; {effect}, and the model does not learn",
                      "Zero the gradients before writing them (or right after step()): optimizer.zero_grad(); "
                      "p.grad = ...; optimizer.step().",
                      source=src, step=step,
                      details={"optimizer": type(opt).__name__, "zero_grad_source": zero_src, "backward_source": None,
                               "grads": "None", "written_by_hand": True})
            return
        message = (f"{where}.step() runs right after zero_grad() ({zero_src}), which came after backward() "
                   f"({backward_src}): the gradients of this step were wiped before the update; {effect}, "
                   f"and the model does not learn" if later is None else
                   f"zero_grad() ({zero_src}) came after backward() ({backward_src}) and before {where}.step(), and "
                   f"the backward() after it ({later}) reached none of {where}'s parameters: the gradients of this "
                   f"step were wiped before the update; {effect}, and that part of the model does not learn")
        hint = ("Zero the gradients before backward() (or right after step()): optimizer.zero_grad(); "
                "loss.backward(); optimizer.step().")
        self.emit("zero-grad-before-step", where, message, hint, source=src, step=step,
                  details={"optimizer": type(opt).__name__, "zero_grad_source": zero_src,
                           "backward_source": backward_src, "grads": "None" if none else "zero",
                           **({"later_backward_source": later} if later is not None else {})})

    def _label(self, opt) -> str:
        name = type(opt).__name__
        same = [o for o in self.g.optimizers if type(o).__name__ == name]
        if len(same) > 1 and any(o is opt for o in same):
            return f"{name}[{next(i for i, o in enumerate(same) if o is opt)}]"
        return name
