"""Missing ``zero_grad()``: ``optimizer.step()`` applies gradients summed over earlier steps.

Observed, not guessed from values: ``Optimizer.zero_grad`` and ``Module.zero_grad``
are watched through declared patches. An ``optimizer.step()`` arms the check; a
``zero_grad()`` of that optimizer disarms it (one of a module drops that
module's parameters). At the first ``backward()`` while still armed, every
parameter of the optimizer that still has a gradient is about to accumulate onto
what is left there. Set-to-None (by hand too) leaves no gradient, and zeroing by
hand (``p.grad.zero_()``, ``p.grad.data.zero_()``) leaves zeros, so the
candidates' norms are staged (read with the step's other values, no extra sync)
and only non-zero leftovers count. The finding is made when that optimizer steps
while the stale gradients are still in place, so a ``zero_grad()`` any time
before the step (GAN loops, zeroing before ``backward()``) and deliberate
accumulation (several backwards, one step, then ``zero_grad()``) stay silent.

With no optimizer at all (hand-written updates, ``p -= lr * p.grad`` under
``no_grad``), a few of the model's parameters stand for it: a ``backward()``
that finds their gradients as the last one left them (same tensor, same version)
while the parameters themselves changed in between (their version, or, for
updates through ``.data``, their first values) adds onto gradients that were
already applied. Several backwards before one update (accumulation) change no
parameter in between and stay silent. With an optimizer, the same comparison runs
between the backwards of one step once a step has applied several (SAM's two
passes without ``zero_grad()`` between them), over 8 of the optimizers' own
parameters and by value; a perturbation of only part of them (AWP, FGM) is deliberate.

Cost: nothing per module call and nothing per step while ``zero_grad()`` is
called; the parameters are looked at only at a backward that follows a step
without it (with no optimizer, 4 parameters' versions per backward; in loops of
several backwards a step, 8 parameters' first values per backward).
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..tensors import as_float, fused_norms
from ._params import frame_optimizers
from .base import Check
from .._weak import WeakIdMap


def _first_param(optimizer) -> Optional[torch.Tensor]:
    groups = optimizer.param_groups
    return groups[0]["params"][0] if groups and groups[0]["params"] else None


def _input_leaf(t: torch.Tensor, params_ok: bool = False) -> Optional[torch.Tensor]:
    """The leaf tensor that requires grad behind a model input: the input itself, or one a few ops up (`x + delta`,
    `(x + delta).clamp(0, 1)`); None when a parameter is met first (the input is another model's output), unless
    `params_ok` (a perturbation kept as an nn.Parameter)."""
    if t.grad_fn is None:
        return t
    frontier, found = [t.grad_fn], None
    for _ in range(3):
        nxt = []
        for node in frontier:
            for child, _ in getattr(node, "next_functions", ()):
                if child is None:
                    continue
                var = getattr(child, "variable", None)
                if var is not None:
                    if isinstance(var, nn.Parameter) and not params_ok:
                        return None
                    found = found if found is not None else var
                else:
                    nxt.append(child)
        if found is not None or len(nxt) > 8:
            return found
        frontier = nxt
    return found


def _graph_leaves(tensors: Any, limit: int = 256) -> List[weakref.ref]:
    """Weak references to up to 4 leaf tensors that require grad reached from `tensors` (a bounded walk)."""
    roots = [t.grad_fn for t in ([tensors] if isinstance(tensors, torch.Tensor) else list(tensors or ()))
             if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    out: List[weakref.ref] = []
    seen: set = set()
    stack = roots
    while stack and len(seen) < limit and len(out) < 4:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        var = getattr(node, "variable", None)
        if isinstance(var, torch.Tensor):
            out.append(weakref.ref(var))
            continue
        stack.extend(f for f, _ in getattr(node, "next_functions", ()) if f is not None)
    return out


FIRST_STEPS = 5  # later steps of one backward() each that a first step of several is compared with


class _State:
    __slots__ = ("gen", "zeroed", "armed", "cands", "norms", "verdict", "step_seen", "since", "backward_source",
                 "versions", "added_by")

    def __init__(self) -> None:
        self.gen = 0
        self.zeroed: set = set()  # ids of parameters a Module.zero_grad() cleared since the step
        self.armed = False
        self.clear()

    def clear(self) -> None:
        self.gen += 1
        self.armed = False
        self.zeroed = set()
        self.cands: List[Tuple[weakref.ref, weakref.ref]] = []
        self.norms: Optional[List[torch.Tensor]] = None
        self.verdict: Optional[List[bool]] = None
        self.step_seen = False
        self.since = 0
        self.backward_source: Optional[str] = None
        self.versions: List[int] = []  # the left-over gradients' version counters before the first backward
        # the backward() that added onto them (an actor's, not the critic's that ran first and reached none)
        self.added_by: Optional[str] = None


class MissingZeroGrad(Check):
    name = "missing-zero-grad"
    costly = True  # sampled under a budget: a property of the code (on waking it arms as a step would)
    kinds = {
        "missing-zero-grad": ("warning", "gradients of earlier steps accumulate into a step without zero_grad()"),
    }
    description = "optimizer.step() (or an update by hand) with gradients still holding earlier steps' gradients (no zero_grad())"
    patches = {"opt_zero_grad": "torch.optim.Optimizer.zero_grad",
               "module_zero_grad": "torch.nn.Module.zero_grad"}

    def __init__(self, guard):
        super().__init__(guard)
        self._st = WeakIdMap()  # optimizer -> _State
        # ((ids of the roots, number of parameters), ids of embedding tables, ids of those with max_norm)
        self._embedding_ids: Optional[tuple] = None
        self._per_param_told: set = set()  # optimizer types told once for all their per-parameter instances
        self._armed = False  # some state may be armed (only a step arms one): backwards skip the scan otherwise
        self._pending = False  # some state holds left-over gradients not yet judged: backwards note their line
        self._last_backward: Optional[str] = None  # while pending: the line of the latest backward()
        # id(optimizer) -> [backward() calls, zero_grad() calls] while its step() runs: an L-BFGS closure
        # evaluated many times within one step
        self._during: dict = {}
        self._closure_done = False
        # hand-written updates (no optimizer): [(param ref, grad ref, grad version, param version, first values)]
        self._manual: List[tuple] = []
        self._manual_step = 0  # the step the hand-written update's state was noted at
        self._manual_told = False
        # With an optimizer: backward() calls since any optimizer's last step, whether a step has applied several (then
        # backwards within one step are compared as above: SAM's perturbation between its two passes with no
        # zero_grad()), and whether a step() is running (an L-BFGS closure's backwards are its own business)
        self._since_step = 0
        self._multi = False
        self._in_step = False
        # backward() for an input's gradient (an attack's or a sampler's) since the last zero_grad(): the latest
        # model call's leaf input that requires grad, the leaves back-propagated into, the first such line, and
        # (steps, its line, the loss line) once the loop's own backward followed them
        self._input_leaf: Optional[int] = None
        self._graph_leaf: Optional[int] = None  # a training-mode call's input leaf that requires grad (forces' pos)
        # (id, version, ref) of the last training-mode call's input leaf that requires grad: changed in place before the
        # next call on it, it is a sampler's iterate
        self._moved_leaf: Optional[tuple] = None
        self._input_graph = False  # an input gradient was taken with backward(create_graph=True)
        self._input_backwards: set = set()
        self._input_count = 0
        self._input_source: Optional[str] = None
        self._polluted: Optional[Tuple[int, Optional[str], Optional[str]]] = None
        self._input_told = False
        self._hand_input: Optional[weakref.ref] = None  # the latest model call's input leaf that requires grad
        # with no model call and no optimizer (a camera pose's quaternion and translation as plain leaves, updated by
        # hand): the leaves the latest backward reached stand for the parameters
        self._loss_leaves: List[weakref.ref] = []
        # Another loss's gradients left in an optimizer's parameters (a generator's loss back-propagated through the
        # discriminator after the discriminator's zero_grad()): per optimizer zeroed since its last step, (backwards
        # counted at that zero_grad(), ref); and per polluted optimizer, (backwards counted then, the other optimizer,
        # its backward's line)
        self._backwards = 0
        self._zeroed_opts: Dict[int, Tuple[int, weakref.ref]] = {}
        self._leaked: Dict[int, Tuple[int, str, Optional[str]]] = {}
        self._leak_told = False
        # backward() lines before the first step since the last zero_grad(); then (first step's lines, the loop's line,
        # backward() calls of each later step) while the first steps are compared with it; None once decided
        self._pre: Optional[list] = []
        self._first_steps: Optional[tuple] = None
        self._first_zeroer: Optional[int] = None  # id of the first optimizer seen zeroing
        # (id of an optimizer that zeroed, id of another zeroed before it) -> (ref, version) of the other's first
        # parameter's gradient at that zero_grad()
        self._at_zero: Dict[Tuple[int, int], tuple] = {}
        self._many = False  # a second one zeroed since: leaks between them are looked for

    # ------------------------------------------------------------------ input gradients taken with backward()
    def watches(self, module) -> bool:
        return False  # model calls (roots) only

    def on_forward_pre(self, module, path, args, kwargs, is_root):
        if is_root and not self._manual_told and args and isinstance(args[0], torch.Tensor) and args[0].requires_grad \
                and not self.g.has_optimizer:
            # an input optimised by hand (DeepDream's image, a universal perturbation), no optimizer: its .grad is
            # looked after like a parameter's (`_manual_after`)
            leaf = _input_leaf(args[0], params_ok=True)
            ok = leaf is not None and leaf.is_leaf and not (
                isinstance(leaf, nn.Parameter) and any(leaf is q for q in module.parameters()))
            self._hand_input = weakref.ref(leaf) if ok else None
        if not is_root or self._input_told:
            return
        leaf = None
        if module.training:
            # an attack or a sampler runs the model in eval mode (PGD, Langevin); a loss of the training itself on
            # inputs that require grad (a PINN's collocation points) runs it in training mode and is no such pass,
            # unless its derivative is taken with backward(create_graph=True) (forces as -dE/dpos, see on_backward)
            self._input_leaf = None
            a = args[0] if args else None
            self._graph_leaf = (id(a) if isinstance(a, torch.Tensor) and a.requires_grad and a.is_leaf
                                and not isinstance(a, nn.Parameter) else None)
            if self._graph_leaf is not None:
                # ... except the same input leaf changed in place since the model's last call on it (Langevin's
                # `x -= a * x.grad` under no_grad, in a model with no Dropout or BatchNorm left in train mode): an
                # input-gradient pass, whatever the mode
                last, self._moved_leaf = self._moved_leaf, (id(a), a._version, weakref.ref(a))
                if last is not None and last[0] == id(a) and last[2]() is a and last[1] != a._version \
                        and next(module.parameters(), torch.empty(0)).requires_grad:
                    self._input_leaf = id(a)
            return
        for a in args[:2]:
            if isinstance(a, torch.Tensor) and a.requires_grad and not isinstance(a, nn.Parameter):
                found = _input_leaf(a)
                first = next(module.parameters(), None) if found is not None else None
                if first is not None and first.requires_grad:  # the backward reaches the model's parameters
                    leaf = id(found)
                break
        self._input_leaf = leaf

    def _forget_inputs(self) -> None:
        self._input_backwards, self._input_source, self._polluted, self._input_count = set(), None, None, 0
        self._input_graph = False

    def _input_backward(self) -> None:
        """At a backward(): one through a model call in eval mode on an input that requires grad (a leaf, or a
        few ops from one: `x + delta`) is an input-gradient pass (PGD's iterations, Langevin sampling); the loop's
        own backward after two or more of them, with no zero_grad() between, steps with their gradients in .grad.
        One such pass alone (a WGAN-GP penalty's backward) is left alone."""
        if self._input_leaf is not None:
            self._input_backwards.add(self._input_leaf)
            self._input_count += 1
            if self._input_source is None:
                self._input_source = self.g.source()
        elif (self._input_count >= 2 or self._input_graph) and self._polluted is None:
            self._polluted = (self._input_count, self._input_source, self.g.source())

    def _judge_inputs(self, optimizer) -> None:
        n, src, loss_src = self._polluted
        graph = self._input_graph
        self._forget_inputs()
        if not self.g.is_primary(optimizer):
            return
        self._input_told = True
        opt = type(optimizer).__name__
        what = ("a backward(create_graph=True) for the gradient of an input (" + str(src) + ": forces as -dE/dpos, "
                "a gradient penalty)" if graph and n == 1 else
                f"{n} backward() calls for the gradient of an input ({src}: an attack's or a sampler's iterations)")
        self.emit("missing-zero-grad", self._label(optimizer),
                  f"{what} ran after the last zero_grad() and before the loss's backward() ({loss_src}): "
                  f"{'it' if graph and n == 1 else 'each'} also added the model's gradients into its parameters' "
                  f".grad, and {opt}.step() applies them with the loss's",
                  ("Take the input's gradient with torch.autograd.grad(E.sum(), pos, create_graph=True)[0] (it leaves "
                   "the parameters' .grad alone), or backward(inputs=[pos], create_graph=True)." if graph else
                   "Take input gradients with torch.autograd.grad(out.sum(), x) (it leaves the parameters' .grad "
                   "alone), or call optimizer.zero_grad() after the attack or sampler, right before the training "
                   "loss's backward()."),
                  step=self.g.step, source=loss_src, details={"input_backwards": n, "input_source": src,
                                                              "optimizer": opt, **({"create_graph": True} if graph else {})})

    # ------------------------------------------------------------------ zero_grad observed
    def on_opt_zero_grad_done(self, args, kwargs, result):
        self._forget_inputs()
        self._cleared()
        if args and not self._leak_told and (self._many or id(args[0]) != self._first_zeroer) \
                and isinstance(args[0], torch.optim.Optimizer):
            self._zeroed(args[0], kwargs.get("set_to_none", args[1] if len(args) > 1 else True))
        if self._during and args and id(args[0]) in self._during:
            self._during[id(args[0])][1] += 1
        st = self._st.data.get(id(args[0])) if args else None
        if st is not None:
            st.clear()
            if len(self._st) == 1:
                self._armed = False  # the only state is disarmed: the next backward has nothing to look at

    def on_module_zero_grad_done(self, args, kwargs, result):
        self._forget_inputs()
        self._cleared()
        if args and not self._leak_told and len(self.g.optimizers) > 1:
            to_none = kwargs.get("set_to_none", args[1] if len(args) > 1 else True)
            ids = {id(p) for p in args[0].parameters()}
            for o in self.g.optimizers:
                first = _first_param(o)
                if first is not None and id(first) in ids:
                    self._zeroed(o, to_none)  # D.zero_grad() clears what opt_d steps
        for counts in self._during.values():
            counts[1] += 1  # model.zero_grad() inside a closure clears what the optimizer steps, as a rule
        if not args or not self._st:
            return
        ids = {id(p) for p in args[0].parameters()}
        for st in list(self._st.values()):
            if st.armed:
                st.zeroed |= ids
            if st.cands:
                keep = [i for i, (pref, _) in enumerate(st.cands) if id(pref()) not in ids]
                if not keep:
                    st.clear()
                elif len(keep) < len(st.cands):
                    st.cands = [st.cands[i] for i in keep]
                    if st.norms is not None:
                        st.norms = [st.norms[i] for i in keep]
                    if st.verdict is not None:
                        st.verdict = [st.verdict[i] for i in keep]

    # ------------------------------------------------------------------ steps and backwards
    def on_step_post(self, optimizer):
        self._in_step, self._since_step = False, 0
        if self._manual and self.g.has_optimizer:
            self._manual = []  # the update ran: only backwards within one step are compared
        if self._input_backwards:
            self._forget_inputs()
        if self._zeroed_opts:
            self._zeroed_opts.pop(id(optimizer), None)
        counts = self._during.pop(id(optimizer), None)
        if counts is not None and counts[0] >= 2 and not counts[1] and not self._closure_done:
            self._closure_done = True
            self._emit_closure(optimizer, counts[0])
        st = self._st.data.get(id(optimizer))
        if st is None:
            st = self._st[optimizer] = _State()
        st.clear()
        st.armed, st.since = True, self.g.step
        self._armed = True

    def on_wake(self):
        """Sent events again after sampled-out steps: the primary optimizer's step just ended unseen, and
        its ``step_post`` would have armed it. Other optimizers may have stepped and zeroed unseen: what
        was kept of them is forgotten (they arm again at their next step seen)."""
        self._manual = []  # updates may have run unseen: compare from the next backward's end on
        for opt, st in list(self._st.items()):
            st.clear()
            if self.g.is_primary(opt):
                st.armed, st.since = True, self.g.step - 1
                self._armed = True

    def on_backward(self, tensors, kwargs):
        self._backwards += 1
        if self._pre is not None:
            self._pre_backward()
        if not self._input_told and (kwargs or {}).get("inputs") is None:  # backward(inputs=[x]) fills x.grad only
            if self._graph_leaf is not None and (kwargs or {}).get("create_graph"):
                # `E.sum().backward(create_graph=True); F = -pos.grad`: an input's gradient taken for the loss, which
                # also writes dE/dθ into the parameters' .grad (one such pass is enough)
                self._input_backwards.add(self._graph_leaf)
                self._input_count += 1
                self._input_graph = True
                self._graph_leaf = None
                if self._input_source is None:
                    self._input_source = self.g.source()
                return
            self._input_backward()
        if not self._manual_told and not self.g.has_optimizer:
            self._loss_leaves = _graph_leaves(tensors) if not self.g.named_parameters() else []
            self._manual_backward()
        elif self._multi and not self._manual_told and not self._in_step:
            self._loss_leaves = []
            self._manual_backward(later=False)
        self._since_step += 1
        if self._during:
            for counts in self._during.values():
                counts[0] += 1
        if self._pending:
            self._note_added()
            if self._pending:
                self._last_backward = self.g.source()
        if not self._armed:
            return
        self._armed = False  # every armed state is evaluated (and disarmed) now
        for opt, st in list(self._st.items()):
            if st.armed:
                self._evaluate(opt, st)

    # ------------------------------------------------------------------ a backward() before the loop, never cleared
    def _cleared(self) -> None:
        if self._pre is not None and self._first_steps is None:
            self._pre = []

    def _pre_backward(self) -> None:
        if self._first_steps is None:
            if len(self._pre) < 8:
                self._pre.append(self.g.source())
            return
        lines, loop, counts = self._first_steps
        if self.g.source() != loop:
            self._pre = None  # other backwards in the loop: not the one-backward-a-step pattern
        else:
            counts[-1] += 1

    def _pre_step(self, optimizer) -> None:
        """The first steps of the counted optimizer: a first step that applied the gradients of backward() calls from
        other lines before the loop's own (SNIP's sensitivity pass, a gradient check) with no zero_grad() after them,
        while each later step applies exactly one backward from the loop's line, carried them into its update."""
        if self._first_steps is None:
            lines = self._pre
            first = _first_param(optimizer)
            grad = first.grad if first is not None else None
            # (the earlier backward reached the optimizer's parameters: its gradient was added onto in place, not
            # made by the loop's backward; a saliency pass through another, frozen model reaches none of them)
            if len(lines) < 2 or lines[-1] is None or lines[0] == lines[-1] or grad is None or not grad._version:
                self._pre = None
                return
            self._first_steps = (lines, lines[-1], [0])
            return
        lines, loop, counts = self._first_steps
        if counts[-1] != 1:
            self._pre = None
            return
        if len(counts) < FIRST_STEPS:
            counts.append(0)
            return
        self._pre = None
        early = [ln for ln in lines[:-1] if ln != loop]
        where = self._label(optimizer)
        self.emit("missing-zero-grad", where,
                  f"the first {where}.step() applied the gradients of {len(lines)} backward() calls, "
                  f"{len(lines) - 1} of them before the loop's ({early[0] if early else lines[0]}) with no zero_grad() "
                  f"after them, while each later step applies one, the loop's ({loop}): the first update carries the "
                  f"gradients of a backward() that was never cleared (a sensitivity pass such as SNIP's, a gradient "
                  f"check, a dry run)",
                  "Call optimizer.zero_grad() (or model.zero_grad()) right after that earlier backward(), or zero the "
                  "gradients at the start of each step (zero_grad() before backward(), not only after step()).",
                  step=0, source=early[0] if early else lines[0],
                  details={"optimizer": type(optimizer).__name__, "backwards_before_first_step": len(lines),
                           "first_backward": lines[0], "loop_backward": loop})

    # ------------------------------------------------------------------ no optimizer: updates by hand
    def on_backward_done(self, tensors, kwargs):
        if self._multi and not self._manual_told and not self._in_step:
            self._manual_after()  # (no resolution comes between two backwards of one optimizer step)

    def _manual_backward(self, later: bool = True) -> None:
        """A backward with no optimizer seen (or, `later` False, a later backward of one optimizer step): did the
        parameters change since the last one left their gradients, while those gradients stayed as they were? Then
        the update (or SAM's perturbation) used them and nothing cleared them."""
        kept, self._manual = self._manual, []
        stale, moved, snaps, refs = [], set(), [], []
        judged = 0
        for pref, gref, gv, pv, first in kept:
            p = pref()
            if p is None:
                continue  # gone: a per-step input that required grad (a PINN's collocation batch), nothing to judge
            judged += 1
            g = p.grad
            if g is None or g is not gref():
                continue  # cleared (None, a new tensor) since: this parameter is fine
            # changed in place since (zero_(), or clip_grad_norm_/clip_grad_value_/clamp_ before the update): its
            # norm, read below, tells a cleared gradient (0) from one scaled and kept
            stale.append(p)
            refs.append(gref)
            if p._version != pv and not self._multi:
                moved.add(id(p))
            else:  # (with an optimizer, values: a pruning mask multiplied in again moves the version, not the weights)
                snaps.append((p, first))
        if stale and len(stale) == judged:
            # Zeroed through `.data` (`p.grad.data.zero_()`) keeps the version: only non-zero gradients count, and
            # updates through `.data` keep the parameter's version: then its first values tell. Both are computed
            # now, before this backward adds to the gradients, and read with the step's other values.
            step, src = self.g.step, self.g.source()
            within = self.g.has_optimizer  # (backwards within one optimizer step: SAM's two passes)
            noted = self._manual_step  # the earlier backward's step
            with torch.no_grad():
                grads = [p.grad.detach() for p in stale]
                versions = [g._version for g in grads]  # (a detached view shares its version counter)
                dense = iter(fused_norms([g for g in grads if g.layout is torch.strided])[0])
                values = [(next(dense) if g.layout is torch.strided else
                           torch.linalg.vector_norm(as_float(g._values()))).reshape(()).float() for g in grads]
                values += [(p.detach().reshape(-1)[:first.numel()] != first).any().float() for p, first in snaps]
                staged = torch.stack(values)
            n = len(stale)

            def verdict(vals: List[float]) -> None:
                # only a tensor both changed and still holding its gradient counts: an attack's delta, changed in
                # place with its gradient zeroed, beside weights that kept theirs but did not change (PGD through
                # backward(), zero_grad() before the training backward), is no hand-written update
                now = moved | {id(p) for (p, _), v in zip(snaps, vals[n:]) if v}
                # and only a gradient this backward added onto (in place, or replaced by the sum): a backward through
                # another model, trained after the one updated by hand, leaves the latter's gradients as they were
                now &= {id(p) for p, r, g, v in zip(stale, refs, grads, versions) if p.grad is not r() or g._version != v}
                left = [p for p, v in zip(stale, vals[:n]) if v != 0.0 and id(p) in now]
                if within and len(left) < sum(v != 0.0 for v in vals[:n]):
                    # Part of the weights perturbed (AWP's weight matrices, not the biases; FGM's embeddings), with
                    # the gradients summed on purpose: SAM perturbs every one
                    return
                if left and (not within or self._owner(left) is not None):
                    self._manual_emit(left, step, src, noted)
            self.g.stage_batch(lambda: [(staged, verdict)])
        if kept and self.following and not self.g.costly_step:
            self.follow(False)  # a budget samples this check: one backward after a sampled one was compared
            return
        if later:
            self.g.stage_batch(self._manual_after)

    def _manual_after(self) -> list:
        """At the backward's resolution (after it ran; with an optimizer, at its end): note the state of up to 4
        parameters with gradients (8 of the optimizers' own with an optimizer)."""
        if self._manual_told or (self.g.has_optimizer and not self._multi):
            return []
        out = []
        leaf = self._hand_input() if self._hand_input is not None else None
        leaves = [t for r in self._loss_leaves if (t := r()) is not None]
        # nn.Embedding(max_norm=...) renormalises the rows it looks up in place, in its forward: a change made by the
        # model call, not by an update between two backward()s (gradient accumulation over micro-batches)
        named = self.g.named_parameters()
        key = (tuple(map(id, self.g.roots)), len(named))
        if self._embedding_ids is None or self._embedding_ids[0] != key:  # walked once while the modules stay the same
            embs = [m for r in self.g.roots for m in r.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
            self._embedding_ids = (key, {id(m.weight) for m in embs},
                                   {id(m.weight) for m in embs if m.max_norm is not None})
        # embedding tables left out when there are other weights: FGM-style adversarial training perturbs only them
        # between its two backwards, whose gradients it sums on purpose (SAM perturbs every weight: the others tell it)
        _, table, renormed = self._embedding_ids
        if self.g.has_optimizer:
            # within one step of an optimizer: its own parameters (a model updated by hand beside it, or left from
            # an earlier run in the process, steps nothing that would end the comparison)
            leaf, leaves = None, []
            params = [p for o in self.g.optimizers[:2] for grp in o.param_groups for p in grp["params"]][:64]
        else:
            params = [p for _, p in named[:64]]
        params = [p for p in params if id(p) not in table] or params
        for p in ([leaf] if leaf is not None else []) + params + leaves:
            if not p.is_leaf or id(p) in renormed:
                continue  # a frozen weight updated in place with autograd on: no .grad to read (torch warns)
            g = p.grad
            if g is None or g.layout not in (torch.strided, torch.sparse_coo) or g.is_meta or not p.requires_grad:
                continue  # (a sparse gradient, nn.Embedding(sparse=True)'s, accumulates in place as a dense one does)
            first = p.detach().reshape(-1)[:4].clone()
            out.append((weakref.ref(p), weakref.ref(g), g._version, p._version, first))
            if len(out) == (8 if self.g.has_optimizer else 4):
                break
        self._manual = out
        self._manual_step = self.g.step
        if out and self.g.meter.period > 1:
            self.follow(True)  # sampled by a budget: see the next backward too, to compare with this one
        return []

    def _owner(self, params: List[torch.Tensor]) -> Optional[torch.optim.Optimizer]:
        """The optimizer (watched, or in the user's frames) that holds one of `params`."""
        ids = {id(p) for p in params}
        return next((o for o in [*self.g.optimizers, *frame_optimizers()]
                     if any(id(q) in ids for grp in o.param_groups for q in grp["params"])), None)

    def _manual_emit(self, stale: List[torch.Tensor], step: int, src: Optional[str], noted: int = 0) -> None:
        if self._manual_told:
            return
        self._manual_told = True
        self._manual = []
        names = [self.g.param_name(p) for p in stale]
        opt = self._owner(stale)
        if opt is not None:
            # Known only since its first step: the change in place between the two backwards was no update but a
            # perturbation (SAM's `p.add_(e)`), and the optimizer's step applies the sum of both gradients.
            if not self.g.has_optimizer:
                step = noted  # (steps counted by backward() until that first step, which makes both backwards one step)
            name = type(opt).__name__
            self.emit("missing-zero-grad", name,
                      f"{name}.step() applies the sum of two backward()s: the parameters were changed in place after "
                      f"the first (a SAM-style perturbation, `p.add_(e)`), and this backward() added onto its "
                      f"gradients, which were not cleared ({', '.join(names[:6])}); the update is g(w) + g(w + e), "
                      f"not the gradient at the perturbed point",
                      "Clear the gradients between the two passes: optimizer.zero_grad() after computing the "
                      "perturbation from the first backward's gradients, before the second backward().",
                      step=step, source=src, details={"parameters": names, "optimizer": name,
                                                      "changed_in_between": True})
            return
        model_params = {id(q) for _, q in self.g.named_parameters()}
        if not model_params and not any(self._hand_input is not None and p is self._hand_input() for p in stale):
            # no model at all: tensors the script optimises directly (a pose, a point cloud's offsets)
            listed = ", ".join(f"`{n}`" for n in names[:6])
            its, keeps = ("its gradient", "keeps it") if len(names) == 1 else ("their gradients", "keep them")
            self.emit("missing-zero-grad", names[0],
                      f"{listed}, updated by hand from {its} after each backward() with no model and no optimizer, "
                      f"{keeps}: nothing clears .grad, so each backward() adds onto all earlier ones and every update "
                      f"follows the sum of every gradient so far",
                      f"Clear them after each update, inside the `with torch.no_grad():` block: {names[0]}.grad = None "
                      f"(or .grad.zero_()) for each; or use a torch.optim optimizer over them, with zero_grad().",
                      step=step, source=src, details={"parameters": names, "optimizer": None, "plain_tensors": True})
            return
        if not any(id(p) in model_params for p in stale):
            # an input optimised by hand (gradient ascent on an image, a universal perturbation): its own .grad
            self.emit("missing-zero-grad", names[0],
                      f"`{names[0]}`, an input updated by hand from its gradient after each backward(), keeps that "
                      f"gradient: nothing clears `{names[0]}.grad`, so each backward() adds onto all earlier ones and "
                      f"every update follows the sum of every gradient so far",
                      f"Clear it after each update, inside the `with torch.no_grad():` block: {names[0]}.grad = None "
                      f"(or {names[0]}.grad.zero_()); or take the gradient with torch.autograd.grad(loss, {names[0]}), "
                      f"which does not accumulate.",
                      step=step, source=src, details={"parameters": names, "optimizer": None, "input": True})
            return
        self.emit("missing-zero-grad", "parameters (no optimizer)",
                  f"the parameters were updated by hand after the last backward(), but their gradients were not "
                  f"cleared: this backward() adds onto gradients that were already applied ({', '.join(names)}), so "
                  f"every update sums all earlier steps' gradients",
                  "Clear the gradients after each update: `p.grad = None` (or `p.grad.zero_()`) for every parameter "
                  "inside the `with torch.no_grad():` block, or call model.zero_grad(); a torch.optim optimizer "
                  "(`optimizer.step(); optimizer.zero_grad()`) does both.",
                  step=step, source=src, details={"parameters": names, "optimizer": None})

    def _evaluate(self, opt, st: _State) -> None:
        """First backward since `opt` stepped without zero_grad(): which gradients are left over?"""
        st.armed = False
        cands = []
        zeroed, st.zeroed = st.zeroed, set()
        sparse = torch.sparse_coo
        for group in opt.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None or id(p) in zeroed or g.layout not in (torch.strided, sparse) or g.is_meta:
                    continue  # set to None (skipped by every optimizer), or cleared by a Module.zero_grad()
                cands.append((weakref.ref(p), weakref.ref(g)))
        if not cands:
            return
        with torch.no_grad():
            grads = [gref().detach() for _, gref in cands]
            dense = [g for g in grads if g.layout is torch.strided]
            it = iter(fused_norms(dense)[0] if dense else [])
            # sparse gradients (nn.Embedding(sparse=True)) accumulate in place too: the norm of their values
            norms = [next(it) if g.layout is torch.strided else torch.linalg.vector_norm(as_float(g._values()))
                     for g in grads]
        st.cands, st.norms, st.verdict = cands, norms, None
        st.backward_source = self._last_backward = self.g.source()
        st.versions, st.added_by = [g._version for g in grads], None
        self._pending = True
        gen = st.gen
        oref = weakref.ref(opt)

        def collect():
            if st.gen != gen or st.norms is None:
                return []
            vals = [n.reshape(()).float() for n in st.norms]
            if len({v.device for v in vals}) > 1:
                vals = [v.cpu() for v in vals]
            return [(torch.stack(vals), lambda values: self._verdict(oref, st, gen, values))]

        self.g.stage_batch(collect)

    def _verdict(self, oref, st: _State, gen: int, values: List[float]) -> None:
        if st.gen != gen:
            return
        st.verdict = [v != 0.0 for v in values]
        st.norms = None
        opt = oref()
        if opt is not None and st.step_seen:
            self._judge(opt, st)

    def on_exception(self, exc):
        """The run ends inside an L-BFGS step (its summed gradients diverged to NaN there): the closure's
        backwards without zero_grad() are told now, since that step never ends."""
        for counts in list(self._during.values()):
            opt = counts[2]()
            if opt is not None and counts[0] >= 2 and not counts[1] and not self._closure_done:
                self._closure_done = True
                self._emit_closure(opt, counts[0], counts[3])
        self._during.clear()

    def _zeroed(self, optimizer, to_none: Any) -> None:
        if self._first_zeroer is None:  # one optimizer trains: nothing to leak between (no cost in a plain loop)
            self._first_zeroer = id(optimizer)
            return
        self._many = True
        self._leaked.pop(id(optimizer), None)
        # the other zeroed optimizers' first gradients as this one zeroes: a backward of this one's own loss that
        # leaves them as they are (an inner solve for task weights after the per-task backwards) leaked nothing
        for key, (_, ref) in self._zeroed_opts.items():
            other = ref()
            first = _first_param(other) if other is not None and key != id(optimizer) else None
            if first is not None and len(self._at_zero) < 64:
                g = first.grad
                self._at_zero[(id(optimizer), key)] = (weakref.ref(g) if g is not None else None,
                                                       g._version if g is not None else -1)
        if to_none:  # (zeros left by set_to_none=False cannot tell a later backward's writes without a read)
            self._zeroed_opts[id(optimizer)] = (self._backwards, weakref.ref(optimizer))
        else:
            self._zeroed_opts.pop(id(optimizer), None)

    def _leaks(self, optimizer) -> None:
        """At `optimizer`'s step: another optimizer zeroed since its own last step, whose parameters a backward
        since then gave gradients, gets them from this optimizer's loss (one attribute read per such optimizer)."""
        for key, (n, ref) in list(self._zeroed_opts.items()):
            other = ref()
            if other is None:
                del self._zeroed_opts[key]
                continue
            if other is optimizer or self._backwards <= n:
                continue
            leak = self._leaked.get(key)
            if leak is not None:
                if leak[1] == self._label(optimizer):
                    # this optimizer stepped again after more backwards into them: one loss for both, the other
                    # accumulating it over several of this one's steps (a tower stepped every 4 batches)
                    self._leaked[key] = (self._backwards,) + leak[1:]
                continue
            first = _first_param(other)
            snap = self._at_zero.pop((id(optimizer), key), None)
            if first is not None and first.grad is not None and snap is not None and snap[0] is not None \
                    and snap[0]() is first.grad and snap[1] == first.grad._version:
                continue  # untouched since this optimizer zeroed: its backward did not reach them
            if first is not None and first.grad is not None and not any(
                    q is first for grp in optimizer.param_groups for q in grp["params"]):
                self._leaked[key] = (self._backwards, self._label(optimizer), self.g.root_source)

    def _judge_leak(self, optimizer) -> None:
        leak = self._leaked.pop(id(optimizer), None)
        if leak is None or self._backwards <= leak[0]:
            return  # (no backward of its own since: one joint backward for both optimizers is fine)
        self._leak_told = True
        n, other, src = leak
        where = self._label(optimizer)
        self.emit("missing-zero-grad", where,
                  f"{where}.step() applies gradients that a backward() for {other} ({src}) wrote into its parameters "
                  f"after its zero_grad(), before {other}.step(): that other loss's gradients (a generator's loss "
                  f"back-propagated through the discriminator, an actor's through the critic) are added to this "
                  f"optimizer's own loss's",
                  f"Zero {where}'s gradients right before its own loss's backward(): opt_d.zero_grad(); "
                  f"d_loss.backward(); opt_d.step() (after the other optimizer's step), or freeze its parameters during "
                  f"the other backward (requires_grad_(False) on them; Lightning's toggle_optimizer).",
                  step=self.g.step, source=self.g.source(), details={"optimizer": type(optimizer).__name__,
                                                                     "leaked_from": other, "leaking_backward": src})

    def on_step_pre(self, optimizer):
        self._in_step = True
        if self._since_step >= 2 and not self._multi and not self._manual_told:
            self._multi = True  # several backwards a step (accumulation, SAM's two passes): compared from the next on
        if self._pre is not None and self.g.is_primary(optimizer):
            self._pre_step(optimizer)
        if self._zeroed_opts and not self._leak_told:
            if self._leaked:
                self._judge_leak(optimizer)
            self._leaks(optimizer)
        if self._polluted is None and self._input_graph and not self._input_told:
            # (the loss's own backward after it may not be seen: a model guard sends no event for a backward without
            # a model call of its own since the last one)
            self._polluted = (self._input_count, self._input_source, self.g.source())
        if self._polluted is not None:
            self._judge_inputs(optimizer)
        if not self._closure_done and isinstance(optimizer, torch.optim.LBFGS):
            # the optimizer that re-evaluates its closure within one step(): backwards inside it come from there
            # (with the step's line: told from the exception hook, no user frame is on the stack)
            self._during[id(optimizer)] = [0, 0, weakref.ref(optimizer), self.g.source()]
        st = self._st.data.get(id(optimizer))
        if st is None or not st.cands:
            return
        st.step_seen = True
        if st.verdict is None and not self.g.is_primary(optimizer) and st.norms is not None:
            # this optimizer's step is not the one that resolves staged values: read them now (rare path)
            st.verdict = [float(n) != 0.0 for n in st.norms]
            st.norms = None
        if st.verdict is not None:
            self._judge(optimizer, st)

    def _note_added(self) -> None:
        """Before a backward: a left-over gradient whose version moved since the first backward was added onto by
        the backward before this one (whose line is `_last_backward`)."""
        pending = False
        for st in self._st.values():
            if not st.cands:
                continue  # judged, or cleared by a zero_grad() since
            pending = True
            if st.added_by is None and any(
                    (g := gref()) is not None and g._version != v for (_, gref), v in zip(st.cands, st.versions)):
                st.added_by = self._last_backward
        self._pending = pending

    def _judge(self, opt, st: _State) -> None:
        if st.added_by is None:
            self._note_added()  # the last backward before this step added onto them
        stale = []
        zero_left = 0  # left over too, but exactly 0 (a GRU's weight_hh at a zero initial state): not cleared
        for (pref, gref), left in zip(st.cands, st.verdict or ()):
            p = pref()
            if p is not None and p.grad is not None and p.grad is gref():
                if left:
                    stale.append(p)
                else:
                    zero_left += 1
        total = sum(1 for g in opt.param_groups for p in g["params"] if p.grad is not None)
        since, bsrc = st.since, st.added_by or st.backward_source
        st.clear()
        self._pending = any(other.cands for other in self._st.values())
        if stale:
            self._emit(opt, stale, total, since, bsrc, zero_left)

    def _emit(self, opt, stale: List[torch.Tensor], total: int, since: int, bsrc: Optional[str],
              zero_left: int = 0) -> None:
        where = self._label(opt)
        group = self._per_parameter(opt)
        if group:
            # one optimizer per parameter (stepped from a post-accumulate-grad hook): one finding for all of them
            if type(opt).__name__ in self._per_param_told:
                return
            self._per_param_told.add(type(opt).__name__)
            where = f"{type(opt).__name__} (per-parameter)"
            stale = [p for o in group for grp in o.param_groups for p in grp["params"]
                     if p.grad is not None] if len(stale) == 1 else stale
            total = max(total, len(group))
        names = [self.g.param_name(p) for p in stale[:8]]
        src = self.g.source()
        step = self.g.step
        more = ", ..." if len(stale) > len(names) else ""
        caller = (f"the {len(group)} per-parameter {type(opt).__name__} optimizers (one per parameter) apply" if group
                  else f"{where}.step() applies")
        message = (f"{caller} gradients that still hold those of the step before: no "
                   f"zero_grad() after step {since}, so backward() ({bsrc}) added onto the old gradients of "
                   f"{len(stale)} of {total} parameters ({', '.join(names)}{more}); every update sums all "
                   f"earlier steps' gradients")
        hint = ("Call optimizer.zero_grad() once per optimizer step (before backward() or right after step()). "
                "To accumulate over micro-batches on purpose, step every N backwards and zero_grad() after "
                "that step.")
        if len(stale) + zero_left < total:
            # Some of the optimizer's gradients were cleared and these were not: a zero_grad() over part of them.
            message += (f" (the other {total - len(stale) - zero_left} were cleared or new: a zero_grad() that covers "
                        f"only part of the optimizer's parameters, such as model.zero_grad() on a module that does "
                        f"not hold these, leaves them to pile up)")
            hint = ("model.zero_grad() clears only that module's parameters: call optimizer.zero_grad(), which "
                    "clears every parameter the optimizer holds, once per optimizer step. " + hint.split(". ", 1)[1])
        self.emit("missing-zero-grad", where, message, hint, step=step, source=src,
                  details={"optimizer": type(opt).__name__, "parameters": len(stale), "with_grad": total,
                           "names": names, "stale_since_step": since, "backward_source": bsrc})

    def _emit_closure(self, opt, backwards: int, source: Optional[str] = None) -> None:
        """One step() ran its closure's backward() several times (L-BFGS re-evaluates it) and nothing zeroed
        the gradients in between: each evaluation added onto the last, and the first onto what was there."""
        where = self._label(opt)
        message = (f"{where}.step(closure) ran backward() {backwards} times (its closure, evaluated again by the "
                   f"optimizer) with no zero_grad() in between: each evaluation adds its gradients onto the "
                   f"previous ones, so the line search and the update see running sums, not the gradient")
        hint = ("Call optimizer.zero_grad() at the start of the closure: def closure(): optimizer.zero_grad(); "
                "loss = loss_fn(model(x), y); loss.backward(); return loss.")
        self.emit("missing-zero-grad", where, message, hint, source=source or self.g.source(),
                  details={"optimizer": type(opt).__name__, "closure_backwards": backwards})

    def _per_parameter(self, opt) -> list:
        """The optimizers of `opt`'s type that each hold one parameter, when `opt` is one of several such."""
        def single(o) -> bool:
            return sum(len(g["params"]) for g in o.param_groups) == 1
        if not single(opt):
            return []
        same = [o for o in self.g.optimizers if type(o) is type(opt) and single(o)]
        return same if len(same) > 1 else []

    def _label(self, opt) -> str:
        opts = self.g.optimizers
        name = type(opt).__name__
        same = [o for o in opts if type(o).__name__ == name]
        if len(same) > 1:
            return f"{name}[{next(i for i, o in enumerate(same) if o is opt)}]"
        return name
