"""Weight decay (or momentum) moving parameters that got no gradient signal.

The pitfall: a part of the model (say ``layer4``) is unused in this phase and its
gradients are all zeros (``zero_grad(set_to_none=False)`` on grads that existed
before, or zeros filled in by DDP for unused parameters), yet it sits in a group
with ``weight_decay > 0``: every ``optimizer.step()`` shrinks it toward 0.

Measured on torch 2.13 (tests/test_optimizer_checks.py): a ``None`` gradient
never moves a parameter (SGD, SGD+momentum, Adam, AdamW, RMSprop, Adagrad skip
it), so those are not candidates; an all-zero gradient moves it in all of them
when ``weight_decay > 0``, and in SGD+momentum/Adam/AdamW even with
``weight_decay=0`` once optimizer state exists. Rather than trusting a table,
the check reports only parameters whose norm really changed while their
gradient stayed zero (3 steps in a row; 20 for a part that had a gradient before and
is not frozen: LayerDrop skips a block three times in a row now and then), and that
were not in the step's autograd graph at all
(a parameter that was, with an exactly-zero gradient, is a cancellation: an L1
loss's output bias when as many residuals lie above as below). Whether backward
reached a parameter is told by a post-accumulate-grad hook, put on a parameter
only once its gradient was zero (a suspect): a healthy run has none.

Cost per sampled step: the per-parameter gradient norms are the shared fused
``g.grad_norms(opt)``, stacked and read with the step's other staged values (one
transfer, no extra sync). Weights are reduced (one ``_foreach_norm``) only for
parameters whose gradient was zero at the previous step, so a healthy run pays
no extra reduction; the norm change is measured from the 2nd zero step on.
"""
from __future__ import annotations

import math
import re
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..tensors import Norms
from ._params import module_prefixes
from .base import Check
from .._weak import WeakIdMap

STEPS = 3  # consecutive steps with a zero gradient before reporting (not one unlucky batch)
# ... for parameters that had a gradient at an earlier step of their optimizer: a part that trained and stopped
# (layer4 left out after a warm-up) shrinks for the rest of the run; one that a step leaves out now and then (LayerDrop
# or stochastic depth skipping a block, p = 0.5: three skips in a row are common, twenty are one start in a million)
# trains again at the next step that keeps it
TRAINED_STEPS = 20
# A layer in the graph whose gradients are computed as exactly 0 is reported only when they have been zero from the
# optimizer's first step on, for this many steps: a head whose loss term is weighted by 0. A detection head's box
# branch on background-only batches (zero for a few steps between batches with positives) is training.
IN_GRAPH_STEPS = 30


def _common_module(names: List[str]) -> str:
    """The longest dotted module path that all `names` lie under ("" when none)."""
    parts = [n.split(".") for n in names]
    common: List[str] = []
    for level in zip(*parts):
        if any(x != level[0] for x in level):
            break
        common.append(level[0])
    return ".".join(common[:-1] if common and any(len(p) == len(common) for p in parts) else common)


class _Track:
    __slots__ = ("ref", "first_step", "last_step", "count", "first_norm", "last_norm", "group", "why", "wd",
                 "reported", "unreached", "in_graph")

    def __init__(self, p: torch.Tensor, step: int, group: int, why: str, wd: float):
        self.ref = weakref.ref(p)
        self.first_step, self.last_step, self.count = step, step, 0
        self.first_norm: Optional[float] = None  # weights measured from the 2nd zero-gradient step on
        self.last_norm: Optional[float] = None
        self.group, self.why, self.wd, self.reported = group, why, wd, False
        self.unreached = False  # seen outside a backward graph of its step at least once
        self.in_graph = False  # reached by backward, its whole layer's gradients computed as exactly 0


def _frozen(t: _Track) -> bool:
    """A parameter frozen with requires_grad_(False) while its optimizer keeps it: it will not train again."""
    p = t.ref()
    return p is not None and not p.requires_grad


def _norms(ts: List[_Track]) -> Tuple[float, float, float]:
    """Joint norm of the tracked weights when first measured, now, and the change in percent."""
    first = sum((t.first_norm or 0.0) ** 2 for t in ts) ** 0.5
    now = sum((t.last_norm or 0.0) ** 2 for t in ts) ** 0.5
    return first, now, ((now - first) / first * 100 if first else 0.0)


def _setting(value: Any) -> Any:
    """A group setting as a cache key (a tensor by identity: reading it would sync)."""
    return ("tensor", id(value)) if isinstance(value, torch.Tensor) else value


def _has_momentum_state(state: Any) -> bool:
    if not state:
        return False
    return state.get("momentum_buffer") is not None or "exp_avg" in state


def _momentum_moves(state: Any) -> bool:
    """Whether a momentum buffer holds something that moves the parameter (a branch that never had a non-zero
    gradient has AdamW's exp_avg all 0). Reads the device: when reporting only."""
    if not _has_momentum_state(state):
        return False
    buf = state.get("momentum_buffer")
    if buf is None:
        buf = state.get("exp_avg")
    if not isinstance(buf, torch.Tensor):
        return False
    try:
        return bool(buf.detach().ne(0).any())
    except Exception:  # a buffer that cannot be read here (meta): as before, it counts
        return True


class WeightDecayWithoutGrad(Check):
    name = "weight-decay-without-grad"
    costly = True  # sampled under a budget
    kinds = {
        "weight-decay-without-grad": ("warning", "weight decay or momentum moves parameters that got no gradient"),
    }
    description = "weight decay or momentum keeps moving parameters whose gradients are all zero"

    def __init__(self, guard):
        super().__init__(guard)
        # per optimizer: id(param) -> _Track
        self._tracks = WeakIdMap()
        self._reported: Dict[Tuple[int, str], List[_Track]] = {}  # (id(opt), where) -> its tracks
        self._suspects: set = set()  # ids of parameters whose gradient was zero at the last resolved step
        self._reached: set = set()  # suspects the backward(s) of this step accumulated a gradient into
        # per optimizer: (key, candidates, ids of the parameters with a gradient, that list of parameters)
        self._cands = WeakIdMap()
        self._hooked: Dict[int, Any] = {}  # id(param) -> handle of our post-accumulate-grad hook on it
        self._first_seen = WeakIdMap()  # optimizer -> the first step this check saw it at
        self._source = WeakIdMap()  # optimizer -> the line of its last step with a zero-gradient run
        self._walked = False  # a backward since the last round was looked at
        self._lone: set = set()  # ids of weight matrices at exactly 0 beside a bias that learns (`_whole_layers`)
        self._zeroed: set = set()  # ids of suspects whose gradient was not 0 when backward accumulated it
        self._stepped = False  # an optimizer stepped since then (every optimizer of a round sees it)

    # Was the parameter in this step's graph at all? An all-zero gradient of a parameter that was
    # (an L1 loss's output bias when residual signs balance, say) is a legitimate cancellation, not
    # "no signal". Autograd tells: a suspect carries a post-accumulate-grad hook, which fires only if
    # backward reaches it (zeros written by DDP for unused parameters do not fire it).
    def on_backward(self, tensors, kwargs):
        if self._stepped:  # the first backward after a step: a new round of graphs
            self._reached, self._walked, self._stepped = set(), False, False
        if self._suspects and self.sampling:
            self._walked = True

    def _hook_suspects(self) -> None:
        """A hook on each parameter whose gradient was zero two sampled steps in a row (the third decides
        a report). It stays until close: firing costs next to nothing, while adding and removing hooks for
        gradients that are zero now and then (a layer of dead ReLUs for some batches) costs every step."""
        hooked = self._hooked
        for tracks in self._tracks.values():
            for key, t in tracks.items():
                if t.count >= STEPS - 1 and key not in hooked:
                    p = t.ref()
                    if p is not None and p.requires_grad:
                        hooked[key] = self.g.grad_hook(p, self._accumulated)

    def _accumulated(self, param: torch.Tensor) -> None:
        if id(param) in self._suspects:
            self._reached.add(id(param))
            g = param.grad
            if id(param) not in self._zeroed and g is not None and not g.is_meta and g.layout == torch.strided:
                # the gradient backward accumulated (read with the step's values): not 0 while the step sees 0, it
                # was zeroed by hand after backward (`p.grad.zero_()` to "freeze" a part), not computed as 0
                key = id(param)
                self.g.stage(torch.linalg.vector_norm(g.detach()).float(),
                             lambda v: self._zeroed.add(key) if v > 0 else None)

    def on_step_pre(self, optimizer):
        self._stepped = True
        if id(optimizer) not in self._first_seen.data:
            self._first_seen[optimizer] = self.g.step
        if not self.sampling:
            return
        gn = self.g.grad_norms(optimizer)
        if not gn.params:
            return
        cands = self._candidates(optimizer, gn)
        if not cands:
            self._tracks.pop(optimizer, None)
            if self.following and not any(self._tracks.values()):
                self.follow(False)
            return
        # Weights are measured only for parameters whose gradient was zero at the last resolved step:
        # nothing extra to reduce while every gradient carries signal.
        tracks = self._tracks.data.get(id(optimizer))
        if not tracks and len(gn.stacked) == 1:
            self._quick(optimizer, gn, cands)
            return
        tracks = tracks or {}
        suspects = [c[0] for c in cands if id(c[0]) in tracks] if tracks else []  # none: no pass over the parameters
        pstack, pids = None, []
        if suspects:
            pn = Norms([p.detach() for p in suspects])  # detached: no autograd history to keep out
            if len(pn.stacked) == 1:
                pstack, pids = next(iter(pn.stacked.values()))  # pids: the suspects' order in the stack
            else:  # rare: suspects on several devices
                pstack, pids = torch.stack([n.float().cpu() for n in pn.norms]), list(range(len(suspects)))
        step, source = self.g.step, self.g.source()
        oref = weakref.ref(optimizer)
        sids = [id(p) for p in suspects]
        # Suspects checked against this step's graph: reached ones had a real (cancelled) gradient.
        # Known unreached: a hooked suspect whose hook did not fire, or one that needs no gradient (frozen).
        hooked, reached_ids = self._hooked, self._reached
        checked = ({id(p) for p in suspects if id(p) not in reached_ids and (id(p) in hooked or not p.requires_grad)}
                   if self._walked else set())
        reached = {i for i in sids if i in self._reached}

        def collect():
            # The per-parameter gradient norms are the guard's shared stacked ones (no second stack).
            if len(gn.stacked) == 1:
                (gstack, gids), = gn.stacked.values()
                parts = [gstack] + ([pstack] if pstack is not None else [])
                if all(t.device == gstack.device for t in parts):
                    stacked = torch.cat(parts) if len(parts) > 1 else gstack
                    return [(stacked, lambda values: update(values, gids, gstack.numel()))]
            vals = [gn.norms[c[1]].detach().reshape(()).float().cpu() for c in cands]  # rare: a model split
            if pstack is not None:                                                     # across devices
                vals += list(pstack.cpu().unbind())
            return [(torch.stack(vals), lambda values: update(values, [c[1] for c in cands], len(cands)))]

        def update(values, gids, n_g):
            """`values`: gradient norms in `gids` order, then the suspects' weight norms in `pids` order."""
            if not suspects and 0.0 not in values[:n_g]:
                opt = oref()
                if opt is None or not self._tracks.data.get(id(opt)):
                    return  # the healthy step (no zero gradient, no run under way): no per-parameter pass
            if self._converged(values[:n_g]):
                return
            by_param = dict(zip(gids, values))
            g_vals = [by_param[c[1]] for c in cands]
            p_vals = [0.0] * len(pids)
            for k, i in enumerate(pids):
                p_vals[i] = values[n_g + k]
            self._update(oref, cands, sids, g_vals + p_vals, step, source, checked, reached)

        self.g.stage_batch(collect)

    def _quick(self, optimizer, gn, cands) -> None:
        """The usual step, with no zero-gradient run under way: only the shared gradient norms are read, and
        a zero among the candidates' starts a run (as `on_step_pre`'s full path would, without suspects)."""
        (gstack, gids), = gn.stacked.values()
        step, source, oref = self.g.step, self.g.source(), weakref.ref(optimizer)

        def seen(values):
            if 0.0 not in values:
                opt = oref()
                if opt is None or not self._tracks.data.get(id(opt)):
                    return  # the healthy step
            if self._converged(values):
                return
            by_param = dict(zip(gids, values))
            self._update(oref, cands, [], [by_param[c[1]] for c in cands], step, source, set(), set())

        self.g.stage_batch(lambda: [(gstack, seen)])

    def _converged(self, grad_norms) -> bool:
        """Every gradient of the optimizer exactly 0 with a loss of exactly 0: a hinge or margin loss that every
        sample meets (a triplet loss converged). Nothing is left without a gradient that others get; whether the
        run trains at all is `grads-all-zero`'s question."""
        return all(v == 0.0 for v in grad_norms) and self.g.step_loss == 0.0

    def _candidates(self, optimizer, gn) -> List[Tuple[torch.Tensor, int, int, str, float]]:
        """(param, norm index, group, why, wd) of the parameters a step would move without a gradient.

        Kept per optimizer while its groups, their settings, the parameters with a gradient and the
        size of its state stay the same (the usual case: every step alike).
        """
        groups = optimizer.param_groups
        state = optimizer.state
        hit = self._cands.data.get(id(optimizer))
        # The list of parameters with a gradient is the same object from step to step while it does not
        # change (the guard keeps it): then its ids need no new tuple.
        ps = gn.params
        ids = hit[2] if hit is not None and hit[3] is ps else tuple(map(id, ps))
        key = (tuple((id(g["params"]), len(g["params"]), _setting(g.get("weight_decay"))) for g in groups),
               ids, len(state))
        if hit is not None and hit[0] == key:
            if hit[3] is not ps:
                self._cands[optimizer] = (key, hit[1], ids, ps)
            return hit[1]
        index = {id(p): i for i, p in enumerate(gn.params)}
        cands: List[Tuple[torch.Tensor, int, int, str, float]] = []
        for gi, group in enumerate(groups):
            wd = group.get("weight_decay", 0) or 0
            wd = float(wd) if not isinstance(wd, torch.Tensor) else float(wd.detach().cpu())
            for p in group["params"]:
                i = index.get(id(p))
                if i is None:
                    continue  # grad None: every optimizer skips it
                if wd > 0:
                    cands.append((p, i, gi, "weight_decay", wd))
                elif _has_momentum_state(state.get(p)):
                    cands.append((p, i, gi, "momentum", wd))
        self._cands[optimizer] = (key, cands, ids, ps)
        return cands

    def _update(self, oref, cands, sids, values: List[float], step: int, source: Optional[str],
                checked: set, reached: set) -> None:
        opt = oref()
        if opt is None:
            return
        n = len(cands)
        zeros = [k for k, v in enumerate(values[:n]) if v == 0.0]  # zero gradients only
        tracks = self._tracks.setdefault(opt, {})
        if not zeros and not tracks:
            return  # the healthy step: no run to start or break, nothing hooked or reported changes
        pnorm = dict(zip(sids, values[n:]))
        live: Dict[int, _Track] = {}
        whole = self._whole_layers(cands, zeros) if any(id(cands[k][0]) in reached for k in zeros) else set()
        for k in zeros:
            p, _, gi, why, wd = cands[k]
            if id(p) in reached and id(p) not in whole:
                continue
            t = tracks.get(id(p))
            if t is None or t.ref() is not p or t.last_step != step - 1:
                # A run is of consecutive steps: every=N or a budget leaves gaps, and a head trained every
                # other step would otherwise look like one (the check follows a run's steps, see below).
                t = _Track(p, step, gi, why, wd)
            t.last_step = step
            t.count += 1
            if id(p) in checked:
                t.unreached = True
            elif id(p) in whole:
                t.unreached = t.in_graph = True  # no signal either: the whole layer's gradient is computed as 0
            t.group, t.why, t.wd = gi, why, wd
            pval = pnorm.get(id(p))
            if pval is not None:
                if t.first_norm is None:
                    t.first_norm = pval
                t.last_norm = pval
            live[id(p)] = t
        self._tracks[opt] = live  # a step with signal (or not a candidate) breaks the run
        self._suspects = {i for o, tr in self._tracks.items() for i in tr}
        self.follow(bool(self._suspects))  # sampled by every=N or a budget: see a run's steps one by one
        self._hook_suspects()
        first = self._first_seen.get(opt, 0)
        # (a whole layer whose gradients backward computes as exactly 0 is judged when the run ends: a loss term
        # weighted by 0 for a warm-up, BBN's re-balancing branch during its first epoch, trains later)
        # (gradients backward computed and the code zeroed in place after it are no computed 0: told in the run, a
        # head "frozen" with p.grad.zero_() after it trained under one optimizer too)
        due = [t for t in live.values() if not t.reported and t.unreached
               and t.count >= (STEPS if t.first_step <= first or _frozen(t) else TRAINED_STEPS)
               and t.first_norm is not None and t.last_norm != t.first_norm
               and (not t.in_graph or id(t.ref()) in self._zeroed)]
        self._source[opt] = source
        if due:
            self._report(opt, due, source)
        for (oid, where), ts in list(self._reported.items()):
            if oid == id(opt) and any(id(t.ref()) in live and live[id(t.ref())] is t for t in ts if t.ref() is not None):
                first, now, change = _norms(ts)
                self.g.update_details("weight-decay-without-grad", where, norm_now=now, norm_change_pct=change,
                                      zero_grad_steps=max(t.count for t in ts), measured_at_step=step)
                self.g.seen_again("weight-decay-without-grad", where)

    def on_exit(self):
        for opt, live in list(self._tracks.items()):
            first = self._first_seen.get(opt, 0)
            due = [t for t in live.values() if not t.reported and t.in_graph and t.count >= IN_GRAPH_STEPS
                   and t.first_step <= first and t.first_norm is not None and t.last_norm != t.first_norm]
            if due:
                self._report(opt, due, self._source.get(opt))

    def _whole_layers(self, cands, zeros: List[int]) -> set:
        """Ids of zero-gradient parameters whose layer's gradients are all exactly zero: a loss term weighted by 0,
        or every unit after the layer dead. A lone zero among a layer's gradients is a cancellation (an L1 loss's
        output bias when residual signs balance), and so is a lone bias."""
        zero_ids = {id(cands[k][0]) for k in zeros}
        layers: Dict[str, List[torch.Tensor]] = {}
        for p, *_ in cands:
            prefix, _, leaf = self.g.param_name(p).rpartition(".")
            # an element of an nn.ParameterList (`grids.3`: a hash grid's level, a task's prompt) is a layer of its own
            layers.setdefault(prefix + "." + leaf if leaf.isdigit() else prefix, []).append(p)
        out = set()
        for ps in layers.values():
            if all(id(p) in zero_ids for p in ps) and (len(ps) >= 2 or ps[0].numel() > 1):
                out.update(id(p) for p in ps)
            elif len(ps) == 2 and id(ps[0]) in zero_ids and id(ps[1]) not in zero_ids and ps[0].dim() >= 2 \
                    and [self.g.param_name(p).rpartition(".")[2] for p in ps] == ["weight", "bias"]:
                # A layer's weight matrix at exactly 0 while its bias learns: no cancellation zeroes a whole matrix
                # step after step. The weight reaches the output only through an op without a derivative (a
                # fake-quantiser's straight-through estimator detached on the wrong term), or its input is 0.
                out.add(id(ps[0]))
                self._lone.add(id(ps[0]))
        return out

    def _report(self, opt, due: List[_Track], source: Optional[str]) -> None:
        # Once NaN/Inf has been reported, zero gradients are its consequence (a NaN activation's
        # backward, a layer fed NaN), not a phase of training: the NaN finding is the one to fix.
        broken = any(f.kind.startswith("nonfinite-") for f in self.g.findings)
        names: Dict[int, str] = {}
        by_group: Dict[int, List[_Track]] = {}
        for t in due:
            p = t.ref()
            if p is None:
                continue
            t.reported = True
            if broken:
                continue
            names[id(t)] = self.g.param_name(p)
            by_group.setdefault(t.group, []).append(t)
        model_names = [n for n, _ in self.g.named_parameters()]
        # gradients cut by an op without a derivative (round without a straight-through estimator), reported by
        # vanishing-gradients: the layers before it all compute exactly 0, one finding for them all, naming the cut
        cut = next((f for f in self.g.findings if f.kind == "vanishing-gradients" and f.details.get("cut")), None)
        for gi, ts in by_group.items():
            if cut is not None:
                before = [t for t in ts if t.in_graph and id(t.ref()) not in self._zeroed]
                if len(before) > 1:
                    order = {n: i for i, n in enumerate(model_names)}
                    before.sort(key=lambda t: order.get(names[id(t)], len(order)))
                    prefixes = module_prefixes({names[id(t)]: t for t in before}, model_names)
                    self._emit(opt, gi, prefixes[0] if prefixes else names[id(before[0])], before, source, cut=cut)
                    ts = [t for t in ts if t not in before]
            lone = [t for t in ts if id(t.ref()) in self._lone]
            if lone:  # weight matrices of several layers, each beside its learning bias: one finding, at the first
                self._emit(opt, gi, names[id(lone[0])], lone, source)
                ts = [t for t in ts if id(t.ref()) not in self._lone]
            chosen = {names[id(t)]: t for t in ts}
            prefixes = module_prefixes(chosen, model_names)
            common = _common_module(prefixes)
            if len(prefixes) > 1 and common:
                # parts of one branch (a box head's convs and norm weights, its norm biases learning from the
                # regulariser): one finding at the branch, not one per part
                prefixes = [common]
            for prefix in prefixes:
                mine = [t for n, t in chosen.items() if n == prefix or n.startswith(prefix + ".")]
                self._emit(opt, gi, prefix, mine, source)

    def _emit(self, opt, gi: int, where: str, ts: List[_Track], source: Optional[str], cut: Any = None) -> None:
        self._reported[(id(opt), where)] = ts
        first, now, change = _norms(ts)
        wd = ts[0].wd
        decay = any(t.why == "weight_decay" for t in ts)
        since = min(t.first_step for t in ts)
        count = max(t.count for t in ts)
        opt_name = type(opt).__name__
        momentum = any(_momentum_moves(opt.state.get(t.ref())) for t in ts if t.ref() is not None)
        lr = opt.param_groups[gi].get("lr", 0.0)
        lr = float(lr) if not isinstance(lr, torch.Tensor) else float(lr.detach().cpu())
        trend = "shrank" if change < 0 else "grew"
        lone = [t for t in ts if (p := t.ref()) is not None and id(p) in self._lone]
        if decay:
            by = f"weight_decay={wd:g}" + (f", plus {opt_name}'s momentum from earlier steps" if momentum else "")
            what = (f"{where}: {len(ts)} parameter(s) in {opt_name} param_groups[{gi}] got all-zero gradients "
                    f"for {count} steps, yet optimizer.step() keeps moving them ({by}): their norm {trend} "
                    f"{abs(change):.2g}% since step {since}")
            if lr * wd > 0 and type(opt).__name__ in ("SGD", "AdamW") and not momentum:
                what += f" (decay alone halves it every ~{math.log(2) / (lr * wd):,.0f} steps)"
            hint = (f"Weight decay pulls {where} toward 0 while it gets no gradient; when it is used again its "
                    f"output will be near 0. Remove these parameters from the optimizer for this phase, put "
                    f"them in their own group with weight_decay=0, or let their grads be None "
                    f"(zero_grad(set_to_none=True), which optimizers skip).")
            if cut is not None:
                what += (" (" + ", ".join(self.g.param_name(t.ref()) for t in ts[:8]) + (", ..." if len(ts) > 8 else "")
                         + f"; backward reaches them, but their gradients are computed as exactly 0: they lie before "
                         f"the cut that vanishing-gradients reported at {cut.where}, an op without a derivative "
                         f"(torch.round, sign, argmax) between them and the loss)")
                hint = ("Give the cut a gradient, and these parameters learn again: a straight-through estimator "
                        "`z + (torch.round(z) - z).detach()` (the same for sign), or a relaxed choice instead of argmax. "
                        "Until then weight decay only shrinks them.")
            elif all(t.in_graph for t in ts) and len(lone) == len(ts):
                if len(ts) > 1:
                    what += " (" + ", ".join(self.g.param_name(t.ref()) for t in ts[:8]) + (", ..." if len(ts) > 8 else "") + ")"
                what += (" (backward reaches them, but their gradients are computed as exactly 0 while their layers' "
                         "biases learn: the weights reach the output only through an op whose derivative is 0, "
                         "round() or sign() in a fake-quantiser whose straight-through estimator detaches the wrong "
                         "term; or what they produce is masked out after them, attention keys all masked by a "
                         "key_padding_mask written with True meaning keep (PyTorch's True means ignore); or their "
                         "layers' inputs are exactly 0)")
                hint = (f"These weights never learn and weight decay shrinks them. For a straight-through "
                        f"estimator keep the weight itself in the graph: w_q = w + (quant(w) - w).detach() (not "
                        f"w.detach() + (quant(w) - w.detach())), and look for round/sign/argmax applied to the weights "
                        f"without one; for an attention mask, key_padding_mask must be True at the padding "
                        f"(~attention_mask when 1 means a real token); if their inputs are 0, look at the layer before "
                        f"them.")
            elif all(t.in_graph for t in ts) and all(id(t.ref()) in self._zeroed for t in ts):
                what += (" (backward computes non-zero gradients for them, but they are 0 at optimizer.step(): they "
                         "are zeroed in place after backward, `p.grad.zero_()` or `p.grad.fill_(0)` to freeze them, "
                         "and the optimizer still decays them)")
                hint = (f"Zeroing gradients does not freeze parameters under weight decay or momentum. To freeze "
                        f"{where}: {where}.requires_grad_(False) and leave it out of the optimizer (or a param group "
                        f"with weight_decay=0), or set p.grad = None instead of zeroing it: optimizers skip None.")
            elif all(t.in_graph for t in ts):
                what += (" (backward reaches them, but their gradients are computed as exactly 0: a loss term "
                         "weighted by 0, a term with nothing to learn from in these batches (a box branch kept in "
                         "the graph with `reg.sum() * 0` while no batch has a box), or every unit after them dead)")
                hint = (f"Weight decay pulls {where} toward 0 while its gradient is exactly 0. If its loss term is "
                        f"weighted by 0 on purpose, leave the term out of the loss (its grads then stay None, which "
                        f"optimizers skip) or put {where} in a group with weight_decay=0; if it learns only from "
                        f"rare batches (objects, positives), the decay between them is what shrinks it: a group "
                        f"with weight_decay=0 keeps it; if its units are dead, look at the activation after it.")
        else:
            what = (f"{where}: {len(ts)} parameter(s) in {opt_name} param_groups[{gi}] got all-zero gradients "
                    f"for {count} steps, yet {opt_name}'s momentum from earlier steps keeps moving them: their "
                    f"norm {trend} {abs(change):.2g}% since step {since}")
            hint = (f"Momentum/Adam state from earlier steps keeps updating {where} although it gets no gradient. "
                    f"Remove these parameters from the optimizer for this phase, or let their grads be None "
                    f"(zero_grad(set_to_none=True), which optimizers skip).")
        frozen = [t for t in ts if (p := t.ref()) is not None and not p.requires_grad]
        if frozen and len(frozen) == len(ts):
            # frozen after the optimizer was built: their zero gradients are left over (zero_grad(set_to_none=False)),
            # none is computed, and the optimizer still steps them
            what = what.replace("got all-zero gradients", "are frozen (requires_grad=False) but still hold zero "
                                                         "gradients (none computed)")
            hint = (f"{where} was frozen after the optimizer was built: requires_grad=False stops its gradients, not "
                    f"the optimizer, and the zero gradients left on it (zero_grad(set_to_none=False)) make every step "
                    f"apply weight decay and momentum to it. Set its .grad to None once when freezing "
                    f"(p.grad = None; optimizers skip such parameters), or rebuild the optimizer without it.")
        elif change > 0 and momentum:
            hint = hint.replace(f"Weight decay pulls {where} toward 0", f"Momentum from earlier steps keeps moving "
                                                                        f"{where} (its norm grew) and weight decay "
                                                                        f"pulls it toward 0")
        expert = not (frozen and len(frozen) == len(ts)) and re.search(r"(^|\.)experts?\.\d+($|\.)", where) is not None
        if expert:
            # a mixture-of-experts expert the router stopped sending tokens to: the zero gradients are the routing's
            hint += (f" If {where} is an expert the router stopped choosing (a collapsed expert), that is the cause to "
                     f"fix: raise the load-balancing loss's weight or the capacity factor; the weight decay only "
                     f"shrinks what the router left idle.")
        self.emit("weight-decay-without-grad", where, what, hint, step=since, seen=self.g.step, source=source,
                  details={"optimizer": opt_name, "group": gi, "weight_decay": wd,
                           "cause": "weight_decay" if decay else "momentum", "momentum": momentum, "lr": lr, "parameters": len(ts),
                           "zero_grad_steps": count, "norm_first": first, "norm_now": now,
                           **({"frozen": True} if frozen and len(frozen) == len(ts) else {}),
                           **({"expert": True} if expert else {}),
                           **({"after_cut": cut.where} if cut is not None else {}),
                           **({"zero_beside_learning_bias": True} if lone and len(lone) == len(ts) else {}),
                           **({"zeroed_after_backward": True} if all(id(t.ref()) in self._zeroed for t in ts) else {}),
                           "norm_change_pct": change,
                           "names": sorted(self.g.param_name(t.ref()) for t in ts if t.ref() is not None)[:20]})
