"""Evaluation outside ``torch.no_grad()``: model forwards whose graphs are never back-propagated.

Each grad-enabled call of a guarded root model whose outputs require grad tags
its output nodes: a sentinel in ``grad_fn.metadata`` (it lives exactly as long
as the graph) and a node pre-hook (installed by the guard's installer, removed at
exit at the latest) that marks the forward as used when any
``backward()`` or ``torch.autograd.grad`` executes that node, whoever calls it
(a second ``backward()`` in the same step, a GAN's generator loss after the
discriminator's step). The hook belongs to the graph, not to the model, and goes
away with it. At the end of a training step a forward that was not
back-propagated and whose graph is gone (it can no longer be) was built for
nothing; one whose graph is still alive is given two more steps. At the end of
the guard every unused forward counts. Steps without any ``backward()`` are not
judged, and a guard that never saw one reports nothing (inference scripts).

Cost: one ``torch.is_grad_enabled()``, one metadata write and one hook
registration per root model call; nothing per inner module, no graph walks.
A call site (model, its mode, the calling line) whose last `TRUST` tagged
forwards were all back-propagated is then tagged on every `SAMPLE`-th call only:
a training step's forward is the same line every step, while an evaluation loop
run from that line still has one of every `SAMPLE` forwards tagged (and all of
them happen at one step, so the finding's step is the same).
Reported once; afterwards the check stops tracking.
"""
from __future__ import annotations

import re
import sys
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.autograd.forward_ad as _forward_ad

from torch.nn.modules.batchnorm import _BatchNorm

from .._frames import frame_locals, source_text
from ._graphs import Budget, fmt_bytes, graph_holders, graph_outputs, graph_size, user_frames, walk
from ._modes import mode_sensitive
from .base import Check
from .._weak import WeakIdMap

KEY = "guard.eval_no_grad"
WALK_BUDGET = 50_000  # graph nodes visited when looking for the variable that holds unused graphs
MAX_PENDING = 4096
GRACE = 2  # steps a still-alive, unclaimed graph may wait for its backward
#: outputs of one forward tagged; a forward with more graph outputs is not judged (the one back-propagated
#: may be any of them)
MAX_OUTPUTS = 64
MIN_DROPPED = 3  # training-mode forwards whose graphs were dropped at once, before they are worth a word
TRUST = 8  # back-propagated forwards in a row after which a call site is sampled
SAMPLE = 8  # a trusted call site has one forward in this many tagged
#: a call site skips batches on what their forward showed while its runs of dropped forwards number fewer than this
#: many per back-propagated forward; one dropped between (nearly) every two backwards is built for nothing each step
SKIPPING = 0.9
FIRST_RUN = 8  # forwards dropped in the first run of a back-propagated line, told without waiting for a second run


def _NONE() -> None:
    return None  # the weak reference of a model without BatchNorm


_BACKWARD = re.compile(r"\.backward\(|autograd\.backward\(")


def _adapts_in_forward(module: Any) -> bool:
    """Whether `module`'s class runs a backward in its own forward: a test-time adaptation wrapper (TENT, SAR,
    EATA's forward-and-adapt) whose graphs its forward back-propagates, or leaves on purpose when its filter keeps no
    sample (SAR under a strong shift rejects every one). Read on the report path."""
    src = source_text(getattr(type(module), "forward", None))
    return src is not None and bool(_BACKWARD.search(src))


class _Tag:
    __slots__ = ("rec", "__weakref__")

    def __init__(self, rec: "_Fwd"):
        self.rec = rec


class _Fwd:
    __slots__ = ("step", "source", "path", "used", "tags", "outs", "age", "module", "eval_mode", "short", "site",
                 "backwards", "trusted", "held")

    def __init__(self, step: int, source: Optional[str], path: str, module: Any = None, site: Any = None):
        self.step, self.source, self.path, self.site = step, source, path, site
        self.module = weakref.ref(module) if module is not None else None
        self.eval_mode = module is not None and not getattr(module, "training", True)
        self.short = False  # its graph was gone by the next model call: dropped at once (x = G(z).detach())
        self.used = False
        self.tags: List[weakref.ref] = []
        self.outs: List[weakref.ref] = []
        self.age = 0
        self.backwards = 0  # backward() calls seen before this forward
        self.trusted = False  # its call site was sampled (its forwards back-propagated TRUST times in a row)
        self.held = False  # its graph outlived the step it was made in (kept in a variable, not dropped at once)

    def __call__(self, grad_outputs):
        self.used = True  # a node pre-hook: this forward's output is being back-propagated
        return None

    def alive(self) -> bool:
        return any(t() is not None for t in self.tags)


class EvalWithoutNoGrad(Check):
    name = "eval-without-no-grad"
    kinds = {
        "eval-without-no-grad": ("warning", "forward passes build graphs that are never back-propagated"),
    }
    description = "model forwards that build graphs never back-propagated (evaluation outside no_grad)"
    patches = {"autograd_grad": "torch.autograd.grad"}

    def watches(self, module) -> bool:
        return False  # judged per model call: root calls

    def __init__(self, guard):
        super().__init__(guard)
        self._key = f"{KEY}.{id(self)}"  # per guard: nested guards keep their own marks
        self._pending: List[_Fwd] = []
        self._backward_in_step = False
        self._any_backward = False
        self._done = False
        self._backwards = self._backwards_at_call = 0  # backward() calls seen, and at the last root call's start
        self._drops: Dict[Tuple[str, Optional[str]], int] = {}  # (path, line) -> training-mode graphs dropped at once
        self._probes: Dict[int, tuple] = {}  # id(module) -> ([backwards that reached its weights], hook handle)
        self._probe_seen: Dict[int, int] = {}  # id(module) -> its probe's count as the last judged step ended
        self._deferred: Optional[_Fwd] = None  # a dropped forward waiting for its module's weights to be reached
        self._drop_first: Dict[Tuple[str, Optional[str]], int] = {}  # (path, line) -> the step of the first of them
        self._drop_versions: Dict[Tuple[str, Optional[str]], int] = {}  # (path, line) -> its weights' versions then
        self._first_bn = WeakIdMap()  # root model -> weak reference to its first BatchNorm (or to nothing)
        self._streak: Dict[Tuple[int, bool, Optional[str]], int] = {}  # call site -> back-propagated in a row
        self._tick = 0  # forwards of trusted call sites
        self._on_path = WeakIdMap()  # models some backward() ran through (a frozen backbone before a trained prompt)
        # call site -> [its forwards back-propagated (tagged ones), separate runs of its forwards dropped at once,
        # the backward() count before the last dropped one]: a site that trains and skips in many places
        self._skips: Dict[Any, List[Any]] = {}
        self._restricted: list = []  # graph roots of this step's backwards restricted to some inputs (_keep_roots)
        # call site never back-propagated -> its unused forwards held past their step, by a model that trains through
        # another line: judged at the end of the run (`_wait`)
        self._later: Dict[Any, List[_Fwd]] = {}

    def on_forward_pre(self, module, path, args, kwargs, is_root):
        if is_root:
            self._backwards_at_call = self._backwards
            for rec in self._pending:
                if not rec.used and not rec.short and not rec.alive():
                    rec.short = True

    def on_forward(self, module, path, args, kwargs, output, is_root):
        if not is_root or self._done or not torch.is_grad_enabled():
            return
        if self._backwards != self._backwards_at_call:
            return  # back-propagated inside the call itself (Lightning manual optimization in training_step,
            # a force field's autograd.grad of its energy)
        if _forward_ad._current_level >= 0:
            return  # under forward-mode AD the loss may be built from the output's tangent, not its primal graph
        source = self.g.root_source
        site = (id(module), module.training, source)
        trusted = self._streak.get(site, 0) >= TRUST
        if trusted:
            self._tick += 1
            if self._tick % SAMPLE:
                return
        if self._recalibrating(module):
            return  # BatchNorm statistics recomputed on purpose (Lightning's SWA epoch runs forward only)
        outs = graph_outputs(output, MAX_OUTPUTS + 1)
        if not outs or len(outs) > MAX_OUTPUTS or len(self._pending) >= MAX_PENDING:
            return
        rec = _Fwd(self.g.step, source, path, module, site)
        rec.backwards, rec.trusted = self._backwards, trusted
        for t in outs:
            md = t.grad_fn.metadata
            if self._key in md:
                continue  # an output passed through unchanged from an earlier tagged forward
            tag = _Tag(rec)
            md[self._key] = tag
            self.g.graph_prehook(t.grad_fn, rec)  # runs when any backward/autograd.grad executes this node
            rec.tags.append(weakref.ref(tag))
            rec.outs.append(weakref.ref(t))
        if rec.tags:
            self._pending.append(rec)

    def _owner_model(self, part) -> Any:
        """The outermost model seen (trained: its forwards were back-propagated) that holds `part` as a proper part, if
        any (looked up when reporting)."""
        for m in self.g.roots:
            if m is not part and id(m) in self._on_path.data and any(x is part for x in m.modules()):
                return m
        return None

    def _recalibrating(self, module) -> bool:
        """A BatchNorm of `module` with ``momentum`` None (a cumulative average) or 1.0 in training mode: its
        running statistics are being recomputed (SWA's update_bn, Lightning's StochasticWeightAveraging, precise
        BN), which runs forwards whose graphs nobody back-propagates."""
        ref = self._first_bn.data.get(id(module))
        if ref is None:
            bn = next((m for m in module.modules() if isinstance(m, _BatchNorm)), None)
            ref = self._first_bn[module] = weakref.ref(bn) if bn is not None else _NONE
        bn = ref()
        return bn is not None and bn.training and (bn.momentum is None or bn.momentum == 1.0)

    def on_backward(self, tensors, kwargs):
        self._backward_in_step = self._any_backward = True
        self._backwards += 1
        if kwargs.get("inputs") is not None:
            self._keep_roots(tensors)

    def on_autograd_grad(self, args, kwargs):
        self._backward_in_step = self._any_backward = True
        # counted like a backward(): one inside the model's own call consumed its graph (forces = -dE/dx computed
        # in forward by a force field, whose validation must run with grad on): that forward is not tagged
        self._backwards += 1
        self._keep_roots(args[0] if args else kwargs.get("outputs"))

    def _keep_roots(self, outputs) -> None:
        """The graph of a backward restricted to some inputs (``autograd.grad``, ``backward(inputs=...)``): it
        executes only the nodes on the way to them. A forward whose output is in that graph but off that way (a
        predictive-coding layer's prediction of a latent from the data, differentiated with respect to the latent
        only) was used all the same: looked for at the step's end, if a forward is left unused."""
        for t in ([outputs] if isinstance(outputs, torch.Tensor) else outputs or ()):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                self._restricted.append(t.grad_fn)
        if len(self._restricted) >= 16:  # (a loop of relaxation steps: looked at 16 graphs at a time, kept no longer)
            roots, self._restricted = self._restricted, []
            if not all(rec.used for rec in self._pending):
                self._reached(roots)

    def _reached(self, roots: list) -> None:
        key = self._key
        for node in walk(roots, Budget(WALK_BUDGET)):
            try:
                tag = node.metadata.get(key)
            except Exception:
                continue
            if tag is not None:
                tag.rec.used = True

    def on_step_end(self, step):
        roots, self._restricted = self._restricted, []
        if self._done:
            return
        if roots and not all(rec.used for rec in self._pending):
            self._reached(roots)
        if not self._backward_in_step:
            if not any(r.alive() for r in self._pending):
                self._pending = []  # a step without backward: not judged
            return
        self._backward_in_step = False
        keep, unused = [], []
        streak = self._streak
        # A call site whose forwards were back-propagated at least as often as not in this step uses its outputs
        # on a condition: an adaptive ODE solver's rejected trial steps, a retried sample. Its unused forwards
        # were not evaluation (whether an output is needed is known only after computing it).
        # (the counts behind it are made only on a step with a forward not back-propagated)
        conditional = self._conditional() if not all(rec.used for rec in self._pending) else None
        for rec in self._pending:
            if rec.used:
                if self._later:
                    self._later.pop(rec.site, None)
                streak[rec.site] = streak.get(rec.site, 0) + 1
                ent = self._skips.get(rec.site)
                if ent is None:
                    ent = self._skips[rec.site] = [0, 0, None]
                ent[0] += SAMPLE if rec.trusted else 1  # (a sampled site's tagged forward stands for SAMPLE)
                m = rec.module() if rec.module is not None else None
                if m is not None and id(m) not in self._on_path.data:
                    self._on_path[m] = True
                continue
            rec.age += 1
            if rec.alive() and rec.age <= GRACE:
                if rec.age == 1:
                    rec.held = True
                keep.append(rec)
            elif conditional(rec) or self._skipped_batch(rec) or self._wait(rec):
                continue
            else:
                streak[rec.site] = 0
                unused.append(rec)
        self._pending = keep
        for k, (box, _) in self._probes.items():
            self._probe_seen[k] = box[0]
        if len(streak) > 256:
            streak.clear()
        if unused:
            self._report(unused)

    def _wait(self, rec: _Fwd) -> bool:
        """Whether `rec` is held back until the run ends: a training-mode forward kept in a variable past its step
        (not detached at once) at a line never back-propagated yet, by a model that trains through another line.
        Its output may be used on a condition that has not held yet: FixMatch's strong view before any pseudo-label
        passes the confidence threshold, an unsupervised term added to the loss after a warm-up, whose variable the
        next step's forward replaces. Once the line is back-propagated it is such a use; at the end of a run where it
        never was, it is told."""
        if not rec.held or rec.eval_mode or rec.alive():
            return False  # (still alive steps later: graphs piling up in an accumulator, told as such)
        ent = self._skips.get(rec.site)
        m = rec.module() if rec.module is not None else None
        if (ent and ent[0]) or m is None or id(m) not in self._on_path.data:
            return False
        later = self._later.get(rec.site)
        if later is None:
            if len(self._later) >= 64:
                return False
            later = self._later[rec.site] = []
        if len(later) < 2 * MIN_DROPPED:
            later.append(rec)
        self._unreached(rec)  # the probe goes on at the first of them (whether the model trains meanwhile)
        return True

    def _skipped_batch(self, rec: _Fwd) -> bool:
        """A training line's forward whose batch the loss then skipped with a constant (a miner that found no
        triplet: `return torch.zeros((), requires_grad=True)`), backward() run anyway: that step's backward reached
        none of the model's weights (their gradients are still None after it). Whether a batch is of use is known
        only after its forward; an evaluation or a detach that starves the model is not in steps like these."""
        ent = self._skips.get(rec.site)
        m = rec.module() if rec.module is not None else None
        if rec.eval_mode or not ent or not ent[0] or m is None:
            return False
        p = next((q for q in m.parameters() if q.requires_grad), None)
        if p is None:
            return False
        if p.grad is None:
            return True
        # zero_grad(set_to_none=False) leaves zeros: whether this step's backward reached them, by the probe
        # (put on at the module's first dropped forward; its count as the last step ended)
        probe = self._probes.get(id(m))
        if probe is None:
            self._unreached(rec)
            return False
        return probe[0][0] == self._probe_seen.get(id(m))

    def _conditional(self):
        """A test of unused forwards, over the pending ones: whether one is a forward whose output was used on a
        condition, not an evaluation. A site whose forwards were back-propagated at least as often as not: an
        adaptive ODE solver's rejected trial steps. A sampled site (its used forwards are mostly not tagged) with
        this forward alone between two backwards: a skipped batch (`if loss.item() > 3 * running: continue`),
        where an evaluation from that line is a run of them."""
        counts: Dict[Any, List[int]] = {}
        runs: Dict[Any, int] = {}  # (site, backward() calls before it) -> unused forwards
        for rec in self._pending:
            # a forward of a sampled site stands for SAMPLE of them: its used forwards, mostly untagged, are not
            # outnumbered by the unused ones of an earlier step tagged in full (a learned optimizer's unroll, whose
            # last update is computed and never evaluated, kept alive for a step by the loop's variable)
            counts.setdefault(rec.site, [0, 0])[0 if rec.used else 1] += SAMPLE if rec.trusted else 1
            if not rec.used:
                runs[(rec.site, rec.backwards)] = runs.get((rec.site, rec.backwards), 0) + 1

        frozen: Dict[int, bool] = {}

        def test(rec: _Fwd) -> bool:
            used, unused = counts[rec.site]
            if used >= unused or (rec.trusted and runs[(rec.site, rec.backwards)] == 1):
                return True
            # Test-time adaptation that picks its batches (EATA, SAR): each batch is forwarded with grad, in train
            # mode, through a model frozen but for a few parameters (its norm layers' affine), and adapted only when
            # it holds reliable samples; under a strong shift many batches in a row are skipped.
            return used > 0 and not rec.eval_mode and self._adapted_in_part(rec, frozen)

        return test

    @staticmethod
    def _adapted_in_part(rec: _Fwd, seen: Dict[int, bool]) -> bool:
        """Whether `rec`'s model has both frozen and trainable parameters, at most a quarter of its elements trainable."""
        m = rec.module() if rec.module is not None else None
        if m is None:
            return False
        v = seen.get(id(m))
        if v is None:
            sizes = [(p.numel(), p.requires_grad) for p in m.parameters()]
            trained = sum(n for n, r in sizes if r)
            v = seen[id(m)] = 0 < trained <= sum(n for n, _ in sizes) // 4
        return v

    def on_exception(self, exc):
        self._crashed()

    def _crashed(self) -> None:
        """The step crashed (target out of range, a failing loss): its forwards never got to backward(),
        which is the exception's doing, not an evaluation outside no_grad."""
        step = self.g.step
        self._pending = [r for r in self._pending if r.step < step or r.used]

    def on_exit(self):
        if self._done or not self._any_backward:
            return
        if getattr(sys, "last_value", None) is not None:
            self._crashed()  # an uncaught exception ends the process (a global guard closes at exit)
        roots, self._restricted = self._restricted, []
        if roots and not all(rec.used for rec in self._pending):
            self._reached(roots)
        conditional = self._conditional()
        # (held back ones first: the last step's forwards of the same line, still held by its variable, would
        # make them look like an evaluation that keeps its graphs)
        unused = [r for recs in self._later.values() for r in recs if not r.used] or [
            r for r in self._pending if not r.used and not conditional(r)]
        if self._deferred is not None:
            unused = [self._deferred]  # dropped forwards waiting for a backward that never reached their weights
        if unused:
            self._report(unused, final=True)

    def _holders(self, recs: set) -> Tuple[Optional[str], List[torch.Tensor]]:
        """A variable in the user's frames whose graph reaches these forwards (e.g. `val_loss`), and its tensors."""
        budget = Budget(WALK_BUDGET)
        for fr in user_frames():
            for name, value in list(frame_locals(fr).items()):
                try:
                    cands = list(graph_holders(name, value))
                except Exception:
                    continue
                for cname, _, ts in cands:
                    for node in walk([t.grad_fn for t in ts], budget):
                        try:
                            tag = node.metadata.get(self._key)
                        except Exception:
                            tag = None
                        if tag is not None and id(tag.rec) in recs:
                            return cname, ts
        return None, []

    def _trained(self, unused: List[_Fwd]) -> List[_Fwd]:
        """Forwards of modules an optimizer trains: a module no optimizer updates (a throwaway
        ``nn.LSTM(3, 3)`` called to show its output) is not being evaluated, whatever its graph."""
        opts = self.g.optimizers
        if not opts:
            if not self.g.has_optimizer:
                # manual updates: nothing tells trained from untrained, but a model whose every parameter is frozen
                # is not trained by hand either; its graph is the input's (DeepDream's image, read through a hook on
                # an inner layer, so that the layers after it build a graph no backward uses)
                return [r for r in unused if (m := r.module() if r.module is not None else None) is None
                        or any(p.requires_grad for p in m.parameters()) or not any(True for _ in m.parameters())]
            # The optimizers are gone (collected before a global guard closes at exit, the training having
            # run in a function): a module with trainable parameters may have been trained; one without
            # (a quantization observer called by convert()) was not.
            return [r for r in unused if (m := r.module() if r.module is not None else None) is not None
                    and any(p.requires_grad for p in m.parameters())]
        trained = {id(p) for o in opts for group in o.param_groups for p in group["params"]}
        verdict: Dict[int, bool] = {}
        keep = []
        for r in unused:
            m = r.module() if r.module is not None else None
            if m is None:
                continue
            ok = verdict.get(id(m))
            if ok is None:
                # or frozen but on the training's gradient path (back-propagated through at a training step: a
                # backbone before a trained soft prompt), so its graph is the training's graph, built for nothing
                ok = verdict[id(m)] = any(id(p) in trained for p in m.parameters()) or id(m) in self._on_path.data
            if ok:
                keep.append(r)
        return keep

    def _starved(self, rec: _Fwd) -> int:
        """How many trainable parameters of `rec`'s module an optimizer holds, when none of them has a gradient
        (None, or zeros left by zero_grad(set_to_none=False)); 0 otherwise. Looked at once, when reporting."""
        m = rec.module() if rec.module is not None else None
        if m is None or self.g.step < 2:
            return 0
        probe = self._probes.get(id(m))
        if probe is not None and probe[0][0]:
            return 0  # a backward reached its weights since its first dropped forward: it trains, between them
        # Held by the optimizer that counts the steps, which has stepped twice since: a GAN's generator, whose
        # own optimizer may not have stepped yet (WGAN's critic steps first), is not judged starved.
        held = {id(p) for o in self.g.optimizers if self.g.is_primary(o) for grp in o.param_groups
                for p in grp["params"]}
        params = [p for p in m.parameters() if p.requires_grad and id(p) in held][:256]
        if not params:
            return 0
        for p in params:
            g = p.grad
            if g is not None and (g.is_sparse or bool(g.detach().ne(0).any())):
                return 0
        return len(params)

    def _unreached(self, rec: _Fwd) -> bool:
        """Whether no backward() has reached `rec`'s module's weights since its first dropped forward (a probe: a
        post-accumulate-grad hook on its first trainable parameter, put there at that forward's first report)."""
        m = rec.module() if rec.module is not None else None
        if m is None:
            return False
        probe = self._probes.get(id(m))
        if probe is None:
            p = next((q for q in m.parameters() if q.requires_grad), None)
            if p is None or len(self._probes) > 64:
                return False
            box = [0]

            def hit(_param: Any, box: list = box) -> None:
                box[0] += 1
            probe = self._probes[id(m)] = (box, self.g.grad_hook(p, hit))
        return probe[0][0] == 0

    def _never_reached(self, rec: _Fwd) -> int:
        """At the end: how many trainable parameters of `rec`'s module some optimizer holds, when no backward reached
        them since its first dropped forward (the probe never fired); 0 otherwise."""
        m = rec.module() if rec.module is not None else None
        probe = self._probes.get(id(m)) if m is not None else None
        if probe is None or probe[0][0]:
            return 0
        held = {id(p) for o in self.g.optimizers for grp in o.param_groups for p in grp["params"]}
        return sum(1 for p in m.parameters() if p.requires_grad and id(p) in held)

    def _report(self, unused: List[_Fwd], final: bool = False) -> None:
        # A training-mode forward whose graph was dropped at once (a lazy module's dry run, a GAN's
        # `fake = G(z).detach()` for the critic) kept nothing: a few such calls are no evaluation; when
        # they recur they are reported as what they are (graphs built for nothing), not as kept memory.
        for r in unused:
            if not r.eval_mode and not r.short and not r.alive():
                r.short = True  # gone by now, with no model call after it to tell when: counted as dropped
        if any(f.kind == "loss-disconnected" for f in self.g.findings):
            # graphs of training-mode forwards left unused because the loss was cut off from them (loss =
            # torch.tensor(loss.item(), ...)), dropped at once or still held by the last step's variables: that
            # finding is their cause
            unused = [r for r in unused if r.eval_mode]
        unused = [r for r in unused if r.module is None or (m := r.module()) is None or not _adapts_in_forward(m)]
        drops = self._drops  # counted over the run: once per epoch recurs as surely as thrice in a step
        runs: Dict[Any, int] = {}  # (site, backward() calls before them) -> forwards dropped at once
        for r in unused:
            if r.short and not r.eval_mode:
                self._unreached(r)  # the probe goes on at a module's first dropped forward
                drops[(r.path, r.source)] = drops.get((r.path, r.source), 0) + 1
                if (r.path, r.source) not in self._drop_first:
                    self._drop_first[(r.path, r.source)] = r.step
                    m = r.module() if r.module is not None else None
                    if m is not None:  # its weights' versions then: moved by the report, an optimizer trains it
                        self._drop_versions[(r.path, r.source)] = sum(p._version for _, p in zip(range(64), m.parameters()))
                runs[(r.site, r.backwards)] = runs.get((r.site, r.backwards), 0) + 1
        if len(drops) > 256:
            drops.clear()
            self._drop_first.clear()
            self._drop_versions.clear()
        # A training line whose forwards are also back-propagated, dropped in two or more separate runs between its
        # backwards, but not between (nearly) every two: batches skipped on what the forward showed (`if not hard.any():
        # continue` in hard-example mining, a batch without a pair), known only after computing it; so is its last
        # forward, skipped and still held by the loop's variable at the end. (An evaluation from that same line is
        # then not told apart from them.) One dropped between every two backwards is built for nothing each step
        # (FixMatch's weak view on the strong view's line, `logits_w = net(xw); logits_s = net(xs)`).
        skips = self._skips
        if len(skips) > 256:
            skips.clear()
        for site, b in runs:
            ent = skips.get(site)
            if ent is None:
                ent = skips[site] = [0, 0, None]
            if ent[2] != b:
                ent[1], ent[2] = ent[1] + 1, b
        # A first run of a few dropped at once, from a training line, waits for a second run to tell skips from a pass
        # that recurs (three batches in a row with no foreground ray, skipped after the forward, among batches that
        # train); graphs kept (an evaluation's losses gathered in a list) are told at once.
        unused = self._trained([r for r in unused if r.eval_mode or (
            (not r.short or drops.get((r.path, r.source), 0) >= MIN_DROPPED)
            and not ((ent := skips.get(r.site)) and ent[1] >= 2 and ent[1] < SKIPPING * ent[0])
            and not (r.short and ent and ent[0] and ent[1] < 2 and drops.get((r.path, r.source), 0) < FIRST_RUN))])
        if not unused:
            return
        first = unused[0]
        m = first.module() if first.module is not None else None
        if not final and first.short and not first.eval_mode and m is not None and id(m) not in self._on_path.data \
                and self._unreached(first):
            # dropped forwards of a model no backward has reached since the first of them: it may be a GAN's generator
            # whose own step comes later (told then as graphs built for nothing) or one cut off from every loss (a
            # generator loss on `fake.detach()`: told at the end as such, not with a no_grad fix that would keep it so)
            self._deferred = first
            return
        self._done = True
        self._pending = []
        where = first.path
        by_source: Dict[Optional[str], int] = {}
        for r in unused:
            if r.path == first.path:  # the message is about this model: count only its calls
                by_source[r.source] = by_source.get(r.source, 0) + 1
        same = [r for r in unused if r.source == first.source and r.path == first.path]
        alive = [t for r in same for t in (o() for o in r.outs) if t is not None]
        holder = None
        if not alive and any(r.alive() for r in same):
            holder, alive = self._holders(set(map(id, same)))
        details: Dict[str, Any] = {"forwards": len(same), "sources": {str(k): v for k, v in by_source.items()},
                                   "graphs_alive": sum(1 for r in same if r.alive())}
        mem = ""
        if alive:
            nodes, saved = graph_size(alive)
            details.update(graph_nodes=nodes, saved_bytes=saved)
            if saved:
                alive_n = details["graphs_alive"]
                by = f" (through `{holder}`)" if holder else ""
                mem = f"; the {alive_n} graph(s) still alive{by} hold {fmt_bytes(saved)} of saved activations"
            if holder:
                details["holder"] = holder
        n = len(same)
        dropped = all(r.short and not r.eval_mode for r in same)
        details["dropped_at_once"] = dropped
        if dropped:
            n = details["forwards"] = max(n, drops.get((first.path, first.source), 0))
        starved = self._starved(first) if dropped else 0
        if dropped and not starved and final:
            starved = self._never_reached(first)
        if dropped and starved:
            # Its trainable weights are in an optimizer and never got a gradient: the detach cuts off a part
            # meant to train (a helper's `return backbone(x).detach()`), not a GAN's critic step.
            details["parameters_without_gradient"] = starved
            message = (f"{n} forward pass{'es' if n != 1 else ''} of {first.path} at {first.source} built autograd "
                       f"graphs that were dropped at once (a `.detach()`ed or discarded output), and none of its "
                       f"{starved} trainable parameter(s), which an optimizer holds, has got a gradient: the detach "
                       f"cuts {first.path} off from the loss, so it never trains")
            hint = (f"If {first.path} should train, remove the .detach() (or torch.no_grad()) between it and the "
                    f"loss; if it is frozen on purpose, set requires_grad=False on it and run it under "
                    f"`with torch.no_grad():`.")
        elif dropped:
            message = (f"{n} forward pass{'es' if n != 1 else ''} of {first.path} at {first.source} built autograd "
                       f"graphs (outputs require grad) that were dropped at once, never back-propagated (a "
                       f"`.detach()`ed or discarded output): building them costs time and memory for nothing")
            hint = ("Run forwards whose outputs need no gradient under `with torch.no_grad():` (a GAN's critic "
                    "step: `with torch.no_grad(): fake = G(z)`); for evaluation also call model.eval() first.")
            module = first.module() if first.module is not None else None
            then = self._drop_versions.get((first.path, first.source))
            still = (module is not None and then is not None and self.g.step > first.step
                     and sum(p._version for _, p in zip(range(64), module.parameters())) == then)
            noisy = ([f"{n_} ({type(m).__name__})" for n_, r in mode_sensitive(module) if (m := r()) is not None
                      and m.training] if still else [])
            if noisy:
                # a model no optimizer trains now (a trained teacher queried as `teacher(x).detach()`): its Dropout and
                # BatchNorm run in training mode on outputs that serve as targets or features
                details["train_mode_modules"] = noisy[:20]
                message += (f"; {first.path} is not trained now and runs with {', '.join(noisy[:3])}"
                            f"{' ...' if len(noisy) > 3 else ''} in training mode, so what it gives (a teacher's "
                            f"targets, frozen features) carries dropout noise and batch statistics")
                hint = (f"Put {first.path} in eval mode once (.eval()) and query it under `with torch.no_grad():` "
                        f"(`with torch.no_grad(): targets = teacher(x)`): no graph, and deterministic outputs; "
                        f".detach() alone keeps its Dropout and BatchNorm in training mode.")
        elif final and not any(r.eval_mode for r in same) and (ent := self._skips.get(first.site)) and ent[0]:
            # the run ended with training forwards of a line whose forwards were back-propagated before: the loop's
            # last partial window (truncated BPTT every K steps, a remainder of accumulation) never trained
            sampled = any(r.trusted for r in same)
            n = details["forwards"] = sum(SAMPLE if r.trusted else 1 for r in same)
            details["last_window"] = True
            message = (f"the run ended with {'about ' if sampled else ''}{n} forward passes of {first.path} at "
                       f"{first.source} that no backward() used: training-mode forwards of a line whose forwards were "
                       f"back-propagated before, so the loop's last partial window (truncated BPTT's remainder, "
                       f"micro-batches left over from accumulation) is never back-propagated, and that data never "
                       f"trains{mem}")
            hint = ("Back-propagate the remainder too when the data ends (`if len(losses) == K or i == T - 1:` before "
                    "backward() and step()); if the partial window is dropped on purpose, run it under "
                    "`with torch.no_grad():` or leave it out of the loop.")
        else:
            waste = ("keeps every activation for a backward that never comes" if details["graphs_alive"] else
                     "saves activations and spends time on graphs for a backward that never comes")
            message = (f"{n} forward pass{'es' if n != 1 else ''} of {first.path} at {first.source} built autograd "
                       f"graphs (outputs require grad) that no backward() used; evaluation outside "
                       f"torch.no_grad() {waste}{mem}")
            hint = ("Run evaluation under `with torch.no_grad():` (or `torch.inference_mode()`), and call "
                    "model.eval() first; this saves the activation memory and time.")
            owner = self._owner_model(m) if m is not None else None
            if owner is not None:
                # a part of a model the loop trains, called outside that model's forward (a flow's `sample()` running
                # its couplings in reverse, a decoder's `generate()`): the model is what the user calls
                where = self.g.path_of(owner) or type(owner).__name__
                details["part_of"] = where
                message = (f"{n} forward pass{'es' if n != 1 else ''} of {first.path}, a part of {where} called "
                           f"outside {where}'s forward (by a method of the model such as sample() or generate(), or "
                           f"directly) at {first.source}, built autograd graphs (outputs require grad) that no "
                           f"backward() used: sampling or evaluating outside torch.no_grad() {waste}{mem}")
                hint = (f"Make that call under `with torch.no_grad():` (`with torch.no_grad(): samples = "
                        f"model.sample(n)`, or `feats = model.backbone(x)`), or decorate the method with "
                        f"@torch.no_grad(); call model.eval() first when it evaluates.")
        more = [(src, k) for src, k in by_source.items() if src != first.source]
        if more:  # the model's other lines with unused forwards: said, not only listed in details.sources
            message += "; also " + ", ".join(f"{k} at {src}" for src, k in more[:3]) + (" ..." if len(more) > 3 else "")
        # dropped graphs are told once they recur: from the step of the first of them
        step = min(first.step, self._drop_first.get((first.path, first.source), first.step)) if dropped else first.step
        self.emit("eval-without-no-grad", where, message, hint, step=step, source=first.source,
                  details=details)
