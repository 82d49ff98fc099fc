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
gradient stayed zero.

Cost per sampled step: the per-parameter gradient norms are the shared fused
``g.grad_norms(opt)``; one ``_foreach_norm`` over the candidates' weights; both
are read with the step's other staged values (one transfer, no extra sync).
"""
from __future__ import annotations

import math
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..tensors import fused_norms
from ._params import module_prefixes
from .base import Check

STEPS = 3  # consecutive sampled steps with a zero gradient before reporting (not one unlucky batch)


class _Track:
    __slots__ = ("ref", "first_step", "count", "first_norm", "last_norm", "group", "why", "wd", "reported")

    def __init__(self, p: torch.Tensor, step: int, norm: float, group: int, why: str, wd: float):
        self.ref = weakref.ref(p)
        self.first_step, self.count, self.first_norm, self.last_norm = step, 0, norm, norm
        self.group, self.why, self.wd, self.reported = group, why, wd, False


def _has_momentum_state(state: Any) -> bool:
    if not state:
        return False
    return state.get("momentum_buffer") is not None or "exp_avg" in state


class WeightDecayWithoutGrad(Check):
    name = "weight-decay-without-grad"
    kinds = ("weight-decay-without-grad",)
    description = "weight decay or momentum keeps moving parameters whose gradients are all zero"

    def __init__(self, guard):
        super().__init__(guard)
        # per optimizer: id(param) -> _Track
        self._tracks: "weakref.WeakKeyDictionary[torch.optim.Optimizer, Dict[int, _Track]]" = (
            weakref.WeakKeyDictionary())

    def on_step_pre(self, optimizer):
        if not self.g.sampling:
            return
        gn = self.g.grad_norms(optimizer)
        if not gn.params:
            return
        index = {id(p): i for i, p in enumerate(gn.params)}
        state = optimizer.state
        cands: List[Tuple[torch.Tensor, int, int, str, float]] = []  # (param, norm index, group, why, wd)
        for gi, group in enumerate(optimizer.param_groups):
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
        if not cands:
            self._tracks.pop(optimizer, None)
            return
        with torch.no_grad():
            pnorms, _ = fused_norms([c[0].detach() for c in cands])
        gnorms = [gn.norms[c[1]] for c in cands]
        step, source = self.g.step, self.g.source()
        oref = weakref.ref(optimizer)

        def collect():
            vals = [t.detach().reshape(()).float() for t in gnorms + pnorms]
            devs = {v.device for v in vals}
            if len(devs) > 1:
                vals = [v.cpu() for v in vals]  # rare (model split across devices): still one read per step
            return [(torch.stack(vals), lambda values: self._update(oref, cands, values, step, source))]

        self.g.stage_batch(collect)

    def _update(self, oref, cands, values: List[float], step: int, source: Optional[str]) -> None:
        opt = oref()
        if opt is None:
            return
        n = len(cands)
        tracks = self._tracks.setdefault(opt, {})
        live: Dict[int, _Track] = {}
        for (p, _, gi, why, wd), gval, pval in zip(cands, values[:n], values[n:]):
            if gval != 0.0:
                continue
            t = tracks.get(id(p))
            if t is None or t.ref() is not p:
                t = _Track(p, step, pval, gi, why, wd)
            t.count += 1
            t.last_norm, t.group, t.why, t.wd = pval, gi, why, wd
            live[id(p)] = t
        self._tracks[opt] = live  # a step with signal (or not a candidate) breaks the run
        due = [t for t in live.values() if not t.reported and t.count >= STEPS and t.last_norm != t.first_norm]
        if due:
            self._report(opt, due, source)

    def _report(self, opt, due: List[_Track], source: Optional[str]) -> None:
        names: Dict[int, str] = {}
        by_group: Dict[int, List[_Track]] = {}
        for t in due:
            p = t.ref()
            if p is None:
                continue
            t.reported = True
            names[id(t)] = self.g.param_name(p)
            by_group.setdefault(t.group, []).append(t)
        model_names = [n for n, _ in self.g.named_parameters()]
        for gi, ts in by_group.items():
            chosen = {names[id(t)]: t for t in ts}
            for prefix in module_prefixes(chosen, model_names):
                mine = [t for n, t in chosen.items() if n == prefix or n.startswith(prefix + ".")]
                self._emit(opt, gi, prefix, mine, source)

    def _emit(self, opt, gi: int, where: str, ts: List[_Track], source: Optional[str]) -> None:
        first = sum(t.first_norm ** 2 for t in ts) ** 0.5
        now = sum(t.last_norm ** 2 for t in ts) ** 0.5
        change = (now - first) / first * 100 if first else 0.0
        wd = ts[0].wd
        decay = any(t.why == "weight_decay" for t in ts)
        since = min(t.first_step for t in ts)
        count = max(t.count for t in ts)
        opt_name = type(opt).__name__
        momentum = any(_has_momentum_state(opt.state.get(t.ref())) for t in ts if t.ref() is not None)
        lr = opt.param_groups[gi].get("lr", 0.0)
        lr = float(lr) if not isinstance(lr, torch.Tensor) else float(lr.detach().cpu())
        trend = "shrank" if change < 0 else "grew"
        if decay:
            by = f"weight decay ({wd:g})" + (f" and {opt_name}'s momentum from earlier steps" if momentum else "")
            what = (f"{where}: {len(ts)} parameter(s) in {opt_name} param_groups[{gi}] got all-zero gradients "
                    f"for {count} steps, yet optimizer.step() keeps moving them by {by}: their norm {trend} "
                    f"{abs(change):.2g}% since step {since}")
            if lr * wd > 0 and type(opt).__name__ in ("SGD", "AdamW") and not momentum:
                what += f" (decay alone halves it every ~{math.log(2) / (lr * wd):,.0f} steps)"
            hint = (f"Weight decay pulls {where} toward 0 while it gets no gradient; when it is used again its "
                    f"output will be near 0. Remove these parameters from the optimizer for this phase, put "
                    f"them in their own group with weight_decay=0, or let their grads be None "
                    f"(zero_grad(set_to_none=True), which optimizers skip).")
        else:
            what = (f"{where}: {len(ts)} parameter(s) in {opt_name} param_groups[{gi}] got all-zero gradients "
                    f"for {count} steps, yet {opt_name}'s momentum from earlier steps keeps moving them: their "
                    f"norm {trend} {abs(change):.2g}% since step {since}")
            hint = (f"Momentum/Adam state from earlier steps keeps updating {where} although it gets no gradient. "
                    f"Remove these parameters from the optimizer for this phase, or let their grads be None "
                    f"(zero_grad(set_to_none=True), which optimizers skip).")
        self.emit("weight-decay-without-grad", where, what, hint, step=since, source=source,
                  details={"optimizer": opt_name, "group": gi, "weight_decay": wd,
                           "cause": "weight_decay" if decay else "momentum", "momentum": momentum, "lr": lr, "parameters": len(ts),
                           "zero_grad_steps": count, "norm_first": first, "norm_now": now,
                           "norm_change_pct": change,
                           "names": sorted(self.g.param_name(t.ref()) for t in ts if t.ref() is not None)[:20]})
