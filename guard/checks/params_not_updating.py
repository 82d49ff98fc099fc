"""Parameters that get non-zero gradients yet do not change: ``lr=0`` (a config typo, a scheduler that
drove it to 0), or an optimizer built over another copy of the model.

* A param group whose learning rate is 0 (or below `TINY_LR`, far under float32's
  resolution for any weight: a per-epoch scheduler such as ``StepLR`` stepped
  every batch) for `STEPS` sampled optimizer steps in a row while its gradients
  are non-zero: no torch optimizer moves a parameter with ``lr=0``, and one of
  ``1e-20`` changes none by a representable amount. The learning rate is a host value; the group's
  gradient norm is reduced (one ``_foreach_norm``) and staged only while its
  ``lr`` is 0, so a healthy run pays one float comparison per group and step.
  Warm-up from ``lr=0`` (one step at 0), the last step of a cosine schedule,
  steps a ``GradScaler`` skips (``optimizer.step()`` never runs) and frozen
  parameters (no gradient: the group's norm is 0 or absent) stay silent.
* At the `STEPS`-th step of the main optimizer, a watched model with gradients
  none of whose parameters is in any optimizer that stepped: the optimizer was
  built over another copy (``copy.deepcopy(model)``, a model rebuilt after the
  optimizer). Host-only, once. ``param-not-in-optimizer`` also names the
  parameters; this finding names the cause.
* At the end of the run, an optimizer that stepped `STEPS` times or more while
  none of its parameters ever had a gradient, over parameters of no module
  guard saw called, shaped like those of a module that was called and got
  gradients: it was built over a copy (``copy.deepcopy(model)`` for a
  fine-tuning phase or a first-order MAML learner) while backward runs through
  the other one. One look per step until its first gradient, then none.
"""
from __future__ import annotations

import weakref
from collections import Counter
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
from torch import nn

from .._frames import frame_locals, variable_naming
from ._graphs import user_frames
from ._params import frame_optimizers, module_prefixes
from .base import Check
from .._weak import WeakIdMap

STEPS = 20  # sampled optimizer steps with lr = 0 and non-zero gradients before reporting
#: a learning rate this small moves no float32 weight (its resolution is ~1e-7 of the weight's size); no schedule
#: in use spends many steps below it, except by mistake (a cosine to 0 over 100k steps spends its last 2 there)
TINY_LR = 1e-12
#: the step of the main optimizer at which the optimizers the user's code holds that never stepped are noted
#: (those whose parameters get gradients): one that still never stepped at the end of the run is told
IDLE_LOOK = 8


#: half-precision weights stepped directly: every HALF_EVERY-th step of the main optimizer, whether a sample of
#: them changed; HALF_LOOKS such looks in a row with none changed while their gradients are non-zero are reported
HALF_EVERY = 16
HALF_LOOKS = 4
HALF_SAMPLE = 4096  # elements of each sampled weight compared
# below this fraction of the sampled elements with a non-zero gradient changed by one update, the weights are taken
# as not updating (Adam at lr 1e-5 on bf16 weights near 0.02 moves 3-5% of them: 95% of the updates round away)
HALF_MOVED = 0.1
_HALF = (torch.float16, torch.bfloat16)


#: an optimizer class written outside torch (a hand-written LARS, LAMB or momentum SGD): every STUCK_EVERY-th step of
#: it, whether a sample of its parameters changed since the look before; STUCK_LOOKS looks in a row with none
#: changed while their gradients are non-zero are reported (its step() never writes them)
STUCK_EVERY = 16
STUCK_LOOKS = 2
STUCK_SAMPLE = 256  # elements of each sampled parameter compared


class _Run:
    __slots__ = ("count", "since", "source", "reported", "lr", "deferred", "renewed")

    def __init__(self) -> None:
        self.count, self.since, self.source, self.reported = 0, 0, None, False
        self.renewed = False  # counted over optimizers made anew at one line (federated clients' per round)
        self.deferred = False  # a group set apart at lr=0 by hand: told at the run's end if still there
        self.lr = 0.0  # the learning rate when the run was reported (0, or a tiny one)


#: future scheduler steps a LambdaLR's factors are looked at, for a group held at lr=0
HORIZON = 20_000


def _lambda_factors(opt: Any, i: int) -> Iterator[Tuple[Callable[[int], Any], int]]:
    """(factor function of group `i`, the scheduler's last epoch) of each LambdaLR over `opt`, found among the
    optimizer's referrers (a few ms: only when a report is due)."""
    import gc

    for sched in gc.get_referrers(opt):
        lambdas = getattr(sched, "lr_lambdas", None)
        if (isinstance(sched, torch.optim.lr_scheduler.LambdaLR) and getattr(sched, "optimizer", None) is opt
                and isinstance(lambdas, list) and i < len(lambdas)):
            yield lambdas[i], getattr(sched, "last_epoch", 0)


def _scheduled_back(opt: Any, i: int) -> bool:
    """Whether a LambdaLR over `opt` gives group `i` a non-zero factor again within HORIZON steps: a group held at 0
    for a while on purpose (a backbone that starts after the head's warm-up). A MultiplicativeLR's factors multiply
    the current lr: 0 stays 0."""
    for fn, now in _lambda_factors(opt, i):
        try:
            if any(fn(e) != 0 for e in range(now + 1, now + 1 + HORIZON)):
                return True
        except Exception:  # a factor that cannot be asked about the future: not known to come back
            continue
    return False


def _int_zero(opt: Any, i: int) -> Optional[int]:
    """The step at which a LambdaLR over `opt` whose factor for group `i` is the integer 0 now (an integer division,
    `s // warmup`: 0 until step `warmup`) first gives a non-zero factor; None when it is not such a schedule. A delayed
    start written on purpose gives a float or a bool (`0.0 if s < k else 1.0`, `float(s >= k)`)."""
    for fn, now in _lambda_factors(opt, i):
        try:
            v = fn(now)
            if type(v) is not int or v != 0:
                continue
            return next((e for e in range(now + 1, now + 1 + HORIZON) if fn(e) != 0), None)
        except Exception:
            continue
    return None


def _set_apart(opt: Any, i: int) -> bool:
    """Whether group `i` sits at exactly lr=0 by hand (no scheduler) while another group trains: a per-group
    freeze the script may lift later by setting the lr (LSQ step sizes learned after a warm-up, a backbone
    unfrozen in stage 2). A typo'd rate is global or comes with the schedule; this one is told only at the end."""
    groups = opt.param_groups
    g = groups[i]
    return (len(groups) > 1 and _lr(g) == 0.0 and "initial_lr" not in g
            and any(_lr(o) > TINY_LR for j, o in enumerate(groups) if j != i))


def _lr(group) -> float:
    lr = group.get("lr")
    if isinstance(lr, torch.Tensor):
        return float(lr.detach()) if lr.device.type == "cpu" and lr.numel() == 1 else -1.0  # no device read per step
    return float(lr) if isinstance(lr, (int, float)) else -1.0


def _module_variable(opt: Any) -> Optional[str]:
    """The user's variable holding the smallest module that holds every parameter of `opt` (`vf`), if any."""
    ids = {id(p) for grp in opt.param_groups for p in grp["params"]}
    best: Optional[tuple] = None
    for fr in user_frames():
        for scope in (frame_locals(fr), fr.f_globals):
            for k, v in list(scope.items()):
                if isinstance(v, nn.Module) and not k.startswith("_"):
                    own = {id(p) for p in v.parameters()}
                    if ids <= own and (best is None or len(own) < best[0]):
                        best = (len(own), k)
    return best[1] if best else None


class ParamsNotUpdating(Check):
    name = "params-not-updating"
    kinds = {"params-not-updating": ("warning", "parameters with non-zero gradients do not change for many steps "
                                                "(lr=0, optimizer over another copy of the model)")}
    description = "parameters with non-zero gradients that do not change: lr=0 (or below 1e-12) for many steps, optimizer over a copy"

    def __init__(self, guard):
        super().__init__(guard)
        self._runs = WeakIdMap()  # optimizer -> {group index: _Run}
        self._copy_done = False
        self._held_first: Optional[set] = None  # ids of the watched models an optimizer held at the first step
        self._versions: Dict[int, int] = {}  # the watched models' parameters' version counters at the first step
        self._half_before: Optional[Any] = None  # (step, [(weight, sample copy)]) taken before this step's update
        self._half_run: list = []  # steps of the looks in a row at which no sampled half-precision weight moved
        self._half_told = False
        self._has_half = WeakIdMap()  # optimizer -> (its number of param groups, whether it holds half weights)
        self._own_class = WeakIdMap()  # optimizer -> whether its class is written outside torch
        self._stuck_before: Optional[Any] = None  # (step, [(parameter, sample copy)]) of the last look
        self._stuck_run: list = []  # first steps of the windows in a row in which no sampled parameter changed
        self._stuck_told = False
        self._idle: Optional[list] = None  # [(optimizer ref, [(parameter ref, version, gradient ref)])] (IDLE_LOOK)
        self._backwards = 0  # backward() calls while no optimizer has stepped
        self._sites: Dict[tuple, tuple] = {}  # (optimizer type, step line) -> (the last one's ref, its runs)
        # optimizer -> False once any of its parameters had a gradient at its step, else [steps, line of the first,
        # (its variable, the variable of the module holding its parameters)]: an optimizer over a copy
        self._gradless = WeakIdMap()

    def _note_idle(self) -> None:
        """The optimizers the user's code holds that have not stepped (guard saw no step of theirs) although some
        of their parameters hold gradients: a sample of those parameters, to compare at the end of the run."""
        stepped = self.g.watched.stepped_in  # id(optimizer) -> the thread it stepped in: those that stepped
        self._idle = []
        for o in frame_optimizers():
            if id(o) in stepped:
                continue
            ps = [p for grp in o.param_groups for p in grp["params"] if isinstance(p, torch.Tensor)
                  and p.grad is not None and p.grad.layout is torch.strided and not p.grad.is_meta][:4]
            if ps:
                self._idle.append((weakref.ref(o), [(weakref.ref(p), p._version, weakref.ref(p.grad)) for p in ps],
                                   variable_naming(o), _module_variable(o)))

    def _judge_idle(self) -> None:
        """An optimizer that never stepped in the whole run while its parameters kept getting new gradients
        (cleared and computed again, by its zero_grad() and a backward) and never changed: its step() is missing."""
        stepped = self.g.watched.stepped_in  # id(optimizer) -> the thread it stepped in: those that stepped
        for oref, sample, var, held_by in self._idle or ():
            opt = oref()
            if opt is None or id(opt) in stepped:
                continue
            ps = [(p, g) for pref, v, gref in sample if (p := pref()) is not None and p._version == v
                  and (g := p.grad) is not None and g is not gref()]
            if not ps or len(ps) < len(sample):
                continue  # moved (updated another way), or no new gradients since the look
            with torch.no_grad():
                if not any(bool((g != 0).any()) for _, g in ps):
                    continue
            params = [p for grp in opt.param_groups for p in grp["params"] if isinstance(p, torch.Tensor)
                      and p.grad is not None]
            names = [self.g.param_name(p) for p in params]
            prefixes = [held_by] if held_by else module_prefixes(names, [n for n, _ in self.g.named_parameters()],
                                                                 limit=6)
            var = var or type(opt).__name__
            self.emit("params-not-updating", prefixes[0] if prefixes else names[0],
                      f"`{var}` ({type(opt).__name__}) never stepped in the run, while the {len(params)} parameter(s) "
                      f"it holds ({', '.join(prefixes[:4])}) got new gradients step after step (cleared and computed "
                      f"again) and never changed: its step() is never called, so that part of the model does not "
                      f"learn",
                      f"Call {var}.step() after the backward() of its loss (before its next zero_grad()); "
                      f"`{var}.step` without parentheses only names the method. If those "
                      f"parameters are meant to stay fixed, set requires_grad=False on them and drop the optimizer.",
                      step=0, seen=self.g.step, source=None,
                      details={"optimizer": type(opt).__name__, "variable": var, "parameters": len(params),
                               "modules": prefixes[:6], "never_stepped": True, "whole_run": True})

    def on_backward_done(self, tensors, kwargs):
        if self.g.watched.stepped_in:
            return  # (an optimizer steps: looked at by its step's count, on_step_post)
        if self._idle is not None:
            if self._idle and all(e[0]() is None for e in self._idle):
                self._note_idle()  # those noted are gone: optimizers made anew each round (federated clients)
            return
        # No optimizer has stepped yet: the IDLE_LOOK-th backward notes those held (`opt.step` without parentheses)
        self._backwards += 1
        if self._backwards >= IDLE_LOOK:
            if any(e.get("skipped") for e in self.g.timeline):
                self._idle = []  # a GradScaler skipped the steps (inf/NaN gradients): told as such, not as a step missing
            else:
                self._note_idle()

    def on_step_pre(self, optimizer):
        if not self.g.sampling:
            return
        runs = self._runs.data.get(id(optimizer))
        if runs is None:
            # an optimizer made anew for each round (a federated client's, each living a few steps) continues the
            # counts of the one that stepped from this line before it, once that one is gone
            site = (type(optimizer).__name__, self.g.source())
            prev = self._sites.get(site)
            runs = prev[1] if prev is not None and prev[0]() is None else {}
            for run in runs.values():
                run.renewed = True
            self._runs[optimizer] = runs
            if len(self._sites) < 64:
                self._sites[site] = (weakref.ref(optimizer), runs)
        for i, group in enumerate(optimizer.param_groups):
            if not 0.0 <= _lr(group) <= TINY_LR:
                run = runs.get(i)
                if run is not None:
                    run.count = 0
                continue
            grads = [p.grad for p in group["params"] if p.grad is not None and p.grad.layout is torch.strided
                     and not p.grad.is_meta]
            if not grads:
                continue  # frozen: nothing to apply
            with torch.no_grad():
                norms = torch._foreach_norm(grads)
                total = torch.linalg.vector_norm(torch.stack([n.float().to(norms[0].device) for n in norms]))
            step, source, oref = self.g.step, self.g.source(), weakref.ref(optimizer)
            self.g.stage(total, lambda v, i=i: self._seen(oref, i, v, step, source))
        if self._held_first is None and self.g.is_primary(optimizer):
            held = {id(p) for o in self.g.optimizers for grp in o.param_groups for p in grp["params"]}
            models = self.g.models or self.g.roots  # (a global guard: the outermost modules seen called)
            self._held_first = {id(m) for m in models if any(id(p) in held for p in m.parameters())}
            self._versions = {id(p): p._version for m in models for p in m.parameters()}
        if self.g.step % HALF_EVERY == 0 and not self._half_told and self.g.is_primary(optimizer):
            self._half_snapshot(optimizer)
        if self.g.step % STUCK_EVERY == 0 and not self._stuck_told and self.g.is_primary(optimizer):
            self._stuck_look(optimizer)
        if not self._copy_done and self.g.is_primary(optimizer) and self.g.step >= STEPS - 1:
            self._copy_done = True
            self._other_copy()

    def _stuck_look(self, optimizer) -> None:
        """A hand-written optimizer whose step() writes nothing (`p = p - lr * d` re-binds a local name): a sample
        of its parameters, compared with the one taken STUCK_EVERY steps before, while their gradients are not 0."""
        known = self._own_class.data.get(id(optimizer))
        if known is None:  # torch's optimizers always write their parameters: decided once per optimizer
            known = self._own_class[optimizer] = not type(optimizer).__module__.startswith("torch.")
        if not known:
            return
        before, self._stuck_before = self._stuck_before, None
        # (a group without a learning rate, Adafactor's relative step, counts; one at 0 is the lr=0 rule's)
        ps = [p for g in optimizer.param_groups if _lr(g) > TINY_LR or g.get("lr") is None for p in g["params"]
              if p.grad is not None and p.grad.layout is torch.strided and not p.is_meta and p.dtype not in _HALF][:4]
        if not ps:
            return
        with torch.no_grad():
            # (weak references: a model released between looks is not kept alive by guard)
            # (by identity: list equality would compare another model's tensors of the same shapes element-wise)
            if before is not None and len(before[1]) == len(ps) and all(r() is p for (r, _), p in zip(before[1], ps)):
                same = torch.stack([(p.detach().reshape(-1)[:STUCK_SAMPLE] == old).all()
                                    for p, (_, old) in zip(ps, before[1])]).all()
                grads = torch.stack([p.grad.detach().float().abs().amax() for p in ps]).amax()
                flag = (same & (grads > 0)).float()
                step, src, name, refs = before[0], self.g.source(), type(optimizer).__name__, [r for r, _ in before[1]]
                self.g.stage(flag, lambda v: self._stuck_seen(v, step, src, name, refs))
            self._stuck_before = (self.g.step, [(weakref.ref(p), p.detach().reshape(-1)[:STUCK_SAMPLE].clone())
                                                for p in ps])

    def _stuck_seen(self, v: float, since: int, source, opt_name: str, params) -> None:
        if v != 1.0:
            self._stuck_run = []
            return
        self._stuck_run.append(since)
        if len(self._stuck_run) < STUCK_LOOKS or self._stuck_told:
            return
        params = [p for p in (r() for r in params) if p is not None]
        if not params:
            return
        self._stuck_told = True
        first = self._stuck_run[0]
        names = [self.g.param_name(p) for p in params]
        steps = self.g.step - first
        self.emit("params-not-updating", names[0],
                  f"{opt_name}.step() has not changed its parameters ({', '.join(names[:4])}) in {steps} steps since "
                  f"step {first}, although their gradients are non-zero and the learning rate is not 0: the "
                  f"hand-written step() does not write them (a name re-bound, `p = p - lr * d`, instead of an update "
                  f"in place), so the model does not learn",
                  "Update the parameters in place inside step(), under torch.no_grad(): p.add_(d, alpha=-lr) (or "
                  "p -= lr * d); `p = p - lr * d` only re-binds the loop variable and leaves the parameter as it was.",
                  step=first, seen=self.g.step, source=source,
                  details={"optimizer": opt_name, "parameters": names[:4], "looks": len(self._stuck_run),
                           "every": STUCK_EVERY, "step_writes_nothing": True})

    def _half_snapshot(self, optimizer) -> None:
        """Before the update: a copy of a sample of the float16/bfloat16 weights with non-zero-able gradients."""
        groups = optimizer.param_groups
        known = self._has_half.data.get(id(optimizer))
        if known is None or known[0] != len(groups):  # decided once per optimizer (and per number of groups)
            known = (len(groups), any(p.dtype in _HALF for g in groups for p in g["params"]))
            self._has_half[optimizer] = known
        if not known[1]:
            return
        ps = [p for g in groups if _lr(g) > TINY_LR for p in g["params"]
              if p.dtype in _HALF and p.grad is not None and p.grad.layout is torch.strided and not p.is_meta]
        # weight matrices first: biases and norm shifts start at 0, where half-precision numbers are dense, so they
        # move while the matrices' updates round away (a pure-bf16 transformer: only its biases train)
        ps = ([p for p in ps if p.dim() >= 2] or ps)[:4]
        if ps:
            self._half_before = (self.g.step, [(p, p.detach().reshape(-1)[:HALF_SAMPLE].clone()) for p in ps])

    def on_step_post(self, optimizer):
        if self._gradless.data.get(id(optimizer)) is not False:
            self._gradless_step(optimizer)
        if self._idle is None and self.g.step >= IDLE_LOOK and self.g.is_primary(optimizer):
            self._note_idle()  # once (a walk of the user's frames)
        before, self._half_before = self._half_before, None
        if before is None or not self.g.is_primary(optimizer):
            return
        step, pairs = before
        pairs = [(p, old) for p, old in pairs if p.grad is not None and p.grad.shape == p.shape]
        if not pairs:
            return
        with torch.no_grad():  # 1: (almost) no sampled element moved although the gradients are not all zero
            # among the elements whose gradient is not 0 (rows of an embedding a batch does not look up need not move)
            live = [(p.grad.detach().reshape(-1)[:HALF_SAMPLE] != 0) for p, _ in pairs]
            hits = torch.cat([(p.detach().reshape(-1)[:HALF_SAMPLE] != old) & g for (p, old), g in zip(pairs, live)])
            moved = hits.float().sum() / torch.cat(live).float().sum().clamp_min(1.0)
            grads = torch.stack([p.grad.detach().float().abs().amax() for p, _ in pairs if p.grad is not None]).amax()
            flag = ((moved < HALF_MOVED) & (grads > 0)).float()
        names = [p for p, _ in pairs]
        self.g.stage(flag, lambda v, step=step, source=self.g.source(): self._half_seen(v, step, source, names))

    def _half_seen(self, v: float, step: int, source, params) -> None:
        if v != 1.0:  # moved, or no gradient to apply: not this signal
            self._half_run = []
            return
        self._half_run.append(step)
        if len(self._half_run) < HALF_LOOKS or self._half_told:
            return
        self._half_told = True
        names = [self.g.param_name(p) for p in params]
        dtype = str(params[0].dtype).replace("torch.", "")
        since = self._half_run[0]
        self.emit("params-not-updating", names[0],
                  f"the {dtype} weights the optimizer steps directly ({', '.join(names[:4])}) hardly change: fewer "
                  f"than {HALF_MOVED:.0%} of their elements moved in the update at each of {len(self._half_run)} "
                  f"looks since step {since}, although their gradients are non-zero: each "
                  f"update (learning rate x gradient) is below half the spacing of {dtype} numbers near the weights "
                  f"and rounds away, so the model does not learn",
                  "Keep the weights in float32 and compute in half precision with torch.autocast (and a GradScaler "
                  "for float16), or keep float32 master weights that the optimizer updates and copy them into the "
                  "half-precision model after each step; a larger learning rate only hides it.",
                  step=since, seen=self.g.step, source=source,
                  details={"dtype": dtype, "looks": len(self._half_run), "every": HALF_EVERY,
                           "parameters": names[:4], "rounded_away": True})

    def _seen(self, oref, i: int, v: float, step: int, source) -> None:
        opt = oref()
        if opt is None:
            return
        run = self._runs[opt].setdefault(i, _Run())
        if not v > 0.0:  # zero (frozen this step) or NaN: not this check's signal
            run.count = 0
            if run.deferred == "scheduled":
                run.deferred = False  # the schedule has started: a later run at 0 is judged afresh
            return
        if run.count == 0:
            run.since, run.source = step, source
        run.count += 1
        if run.count >= STEPS and not run.reported and not run.deferred:
            if _lr(opt.param_groups[i]) == 0.0 and _scheduled_back(opt, i):
                start = _int_zero(opt, i)
                if start is not None:
                    # not a delayed start: an integer division (`s // warmup`) holds the warm-up at exactly 0
                    run.reported = True
                    self._report_lr(opt, i, run, int_division=start)
                    return
                # a LambdaLR holds the group at 0 on purpose for a while (a delayed start): told only if the run ends
                # before that start
                run.deferred = "scheduled"
                return
            if _set_apart(opt, i) or run.renewed:
                # a staged freeze raises it later by hand, or the rounds' optimizers are made at a rate warmed up from
                # 0 (`lr = base * rnd / warm`): only a whole run at 0 is told
                run.deferred = True
                return
            run.reported = True
            self._report_lr(opt, i, run)

    def _gradless_step(self, optimizer) -> None:
        """A step of an optimizer none of whose parameters has had a gradient at its steps so far (after the step:
        a closure's backward has run)."""
        if any(p.grad is not None for grp in optimizer.param_groups for p in grp["params"]
               if isinstance(p, torch.Tensor)):
            self._gradless[optimizer] = False
            return
        entry = self._gradless.data.get(id(optimizer))
        if entry is None:
            entry = self._gradless[optimizer] = [0, self.g.source(), None, self.g.step]
        entry[0] += 1
        if entry[0] == IDLE_LOOK:  # names read while the user's frames are there (a global guard ends at exit)
            shapes = Counter(tuple(p.shape) for grp in optimizer.param_groups for p in grp["params"])
            twins = {id(m): variable_naming(m) for m in self.g.roots if isinstance(m, nn.Module)
                     and not shapes - Counter(tuple(p.shape) for p in m.parameters())}
            entry[2] = (variable_naming(optimizer), _module_variable(optimizer), twins)

    def _judge_gradless(self) -> None:
        """Optimizers that stepped STEPS times or more and never saw a gradient, over a copy of a module that was
        called and got gradients (see the module docstring)."""
        if any(f.kind == "params-not-updating" and f.details.get("over_copy") for f in self.g.findings):
            return  # told at the 20th step (a watched model none of whose parameters the optimizer holds)
        roots = [m for m in self.g.roots if isinstance(m, nn.Module)]
        called = {id(p) for m in roots for p in m.parameters()}
        for opt, entry in list(self._gradless.items()):
            if entry is False or entry[0] < STEPS:
                continue
            ps = [p for grp in opt.param_groups for p in grp["params"] if isinstance(p, torch.Tensor)]
            if not ps or any(id(p) in called for p in ps) or any(p.grad is not None for p in ps):
                continue
            shapes = Counter(tuple(p.shape) for p in ps)
            twin = None
            for m in roots:
                own = list(m.parameters())
                if any(p.grad is not None for p in own) and \
                        (len(ps) >= 2 or len(own) == 1) and not shapes - Counter(tuple(p.shape) for p in own):
                    twin = m
                    break
            if twin is None:
                continue
            var, held_by, twins = entry[2] or (None, None, {})
            var = var or type(opt).__name__
            mine = held_by or "a copy"
            # (a learner copied anew for each task is another object at the end: the name it had then)
            other = (twins.get(id(twin)) or variable_naming(twin) or next((n for n in twins.values() if n), None)
                     or type(twin).__name__)
            self.emit("params-not-updating", held_by or type(opt).__name__,
                      f"`{var}` ({type(opt).__name__}) stepped {entry[0]} times, and none of the {len(ps)} parameter(s) "
                      f"it holds ({mine}) ever had a gradient: backward() ran through `{other}`, whose parameters have "
                      f"the same shapes, so the optimizer was built over a copy of the model that is not the one "
                      f"trained, and its steps change nothing",
                      f"Build {var} over the parameters of the model the loss is computed with "
                      f"({other}.parameters(), after any copy.deepcopy), or compute the loss with the model it holds. "
                      f"For a first-order meta-gradient kept on a copy, copy it back before the step: "
                      f"p.grad = q.grad.clone() for p, q in zip(model.parameters(), {other}.parameters()).",
                      step=entry[3], seen=self.g.step, source=entry[1],
                      details={"optimizer": type(opt).__name__, "variable": var, "parameters": len(ps),
                               "steps": entry[0], "module": held_by, "trained": other, "over_copy": True,
                               "whole_run": True})

    def on_exit(self):
        if self._idle:
            self._judge_idle()
        if self._gradless:
            self._judge_gradless()
        for opt, runs in list(self._runs.items()):
            for i, run in runs.items():
                if (run.deferred and not run.reported and run.count >= STEPS and i < len(opt.param_groups)
                        and _lr(opt.param_groups[i]) == 0.0):
                    run.reported = True
                    self._report_lr(opt, i, run, to_end=True)

    def _report_lr(self, opt, i: int, run: _Run, to_end: bool = False, int_division: Optional[int] = None) -> None:
        group = opt.param_groups[i]
        run.lr = lr = max(_lr(group), 0.0)
        params = [p for p in group["params"] if p.grad is not None]
        names = [self.g.param_name(p) for p in params]
        every = [n for n, _ in self.g.named_parameters()]
        prefixes = module_prefixes(names, every, limit=6)
        models = self.g.models
        if models and set(names) >= set(every):  # the whole model: name it, not its top-level children
            prefixes = [type(models[0]).__name__]
        shown = ", ".join(prefixes[:5]) + (", ..." if len(prefixes) > 5 else "")
        groups = len(opt.param_groups)
        which = f"param group {i} of {type(opt).__name__}" if groups > 1 else type(opt).__name__
        sched = " (a learning-rate scheduler may have driven it there)" if "initial_lr" in group else ""
        if lr == 0.0 and int_division is not None:
            has = "is held at lr=0 by its LambdaLR"
            effect = (f"its factor is the integer 0 until the scheduler's step {int_division} (an integer division, "
                      f"`s // warmup`), so optimizer.step() changes nothing during the warm-up and the full learning "
                      f"rate then starts at once, on an untrained model")
            hint = ("Make the warm-up factor a float: `s / warmup` (or `min(1.0, (s + 1) / warmup)`), not "
                    "`s // warmup`, which is 0 for every step before `warmup`.")
        elif lr == 0.0 and to_end and run.deferred == "scheduled":
            has = "was held at lr=0 by its LambdaLR (its factor is 0 now and becomes non-zero only later)"
            effect = "optimizer.step() never changed them, to the end of the run: the run ended before the schedule started"
            hint = ("The scheduler's factor is 0 for every step this run made: check the lambda (an integer division, "
                    "`min(1.0, s // warmup)`, is 0 until step `warmup`: write `s / warmup`) and its warm-up length "
                    "against the run's number of steps.")
        elif lr == 0.0 and to_end and run.renewed:
            has = "was made with lr=0 at every round (a new optimizer each time, from the same line)"
            effect = "optimizer.step() never changed them, to the end of the run"
            hint = ("Check the learning rate each round's optimizer is made with: `int(...)` of a float below 1, or an "
                    "integer division, gives 0; a warm-up from 0 must reach a non-zero rate.")
        elif lr == 0.0 and to_end:
            has = "was set to lr=0 (the other groups train)"
            effect = "optimizer.step() never changed them, to the end of the run"
            hint = ("If this group is meant to train, give it its learning rate (the value set for it in the "
                    "param-group dict or the config it reads). To freeze it on purpose, set requires_grad=False "
                    "on its parameters instead: the same result without computing their gradients.")
        elif lr == 0.0:
            has = f"has lr=0{sched}"
            effect = "optimizer.step() does not change them"
            hint = ("Check the learning rate in the config (a typo such as lr=0 or an int division) and the "
                    "scheduler (a LambdaLR/LinearLR that reaches 0 before training ends, or training past its last "
                    "step). To freeze parameters on purpose, set requires_grad=False instead: it also saves their "
                    "gradients.")
        else:
            start = group.get("initial_lr")
            has = (f"has lr={lr:.1e}" + (f", down from {start:.1e}," if isinstance(start, (int, float)) else "")
                   + sched)
            effect = "updates that small are below float32's resolution, so optimizer.step() changes nothing"
            hint = ("A scheduler meant to step once per epoch (StepLR, MultiStepLR, ExponentialLR: step_size and "
                    "milestones count scheduler.step() calls) is probably stepped once per batch: call "
                    "scheduler.step() after the epoch's loop, or give step_size in batches. Otherwise check the "
                    "learning rate in the config.")
        self.emit("params-not-updating", prefixes[0] if prefixes else f"param_groups[{i}]",
                  f"{which} {has} for {run.count} steps since step {run.since} while its {len(params)} "
                  f"parameter(s) get non-zero gradients ({shown}): {effect}",
                  hint,
                  step=run.since, seen=self.g.step, source=run.source,
                  details={"optimizer": type(opt).__name__, "group": i, "lr": lr, "steps": run.count,
                           "initial_lr": group.get("initial_lr"), "modules": prefixes[:5],
                           "parameters": len(params), "whole_run": to_end,
                           **({"integer_division_until": int_division} if int_division is not None else {})})

    def _masters(self, model: nn.Module, named: list, tensors: list) -> bool:
        """Master weights never copied back: the optimizer holds one tensor of another dtype per parameter of `model`
        (same shapes, same order: float32 copies of a half-precision model), and the model's parameters have not
        changed since the first step. Told (True) when so."""
        params = [p for _, p in named]
        if not params or len(tensors) != len(params) or not all(p.requires_grad for p in params):
            return False
        if any(t.shape != p.shape or t.dtype == p.dtype for t, p in zip(tensors, params)):
            return False
        if any(self._versions.get(id(p), p._version) != p._version for p in params):
            return False  # copied back in place: the recipe works
        mname = self.g.path_of(model)
        dtype, mdtype = str(params[0].dtype).replace("torch.", ""), str(tensors[0].dtype).replace("torch.", "")
        opts = self.g.optimizers
        self.emit("params-not-updating", mname,
                  f"the optimizer ({', '.join(type(o).__name__ for o in opts)}) steps {len(tensors)} {mdtype} copies of "
                  f"the {len(params)} {dtype} parameters of {mname} (master weights), but they are never copied back: "
                  f"{mname}, which computes the loss, has not changed in {self.g.step + 1} steps",
                  f"After each optimizer.step(), copy the master weights into the model: with torch.no_grad(): for p, m "
                  f"in zip(model.parameters(), master): p.copy_(m). Or keep the model in float32 and compute in half "
                  f"precision with torch.autocast, which needs no master copy.",
                  step=0, source=self.g.source(),
                  details={"model": mname, "parameters": len(params), "master_weights": True, "dtype": dtype,
                           "master_dtype": mdtype})
        return True

    def _other_copy(self) -> None:
        tensors = [p for o in self.g.optimizers for grp in o.param_groups for p in grp["params"]]
        held = {id(p) for p in tensors}
        # A copy holds parameters shaped like the model's; an optimizer over plain tensors (the input image of style
        # transfer, a feature net left trainable but meant to stay fixed) is no copy: param-not-in-optimizer says it.
        shapes = {tuple(p.shape) for p in tensors if isinstance(p, nn.Parameter)}
        models = self.g.models
        if not models:
            # a global guard: only the master-weights form (its shapes match one for one); a model beside another one
            # trained (a probe beside its base) is no copy
            for model in self.g.roots:
                if not any(id(p) in held for p in model.parameters()) and \
                        self._masters(model, list(model.named_parameters()), tensors):
                    return
            return
        if any(id(p) in held for m in models for p in m.parameters()):
            # the optimizer trains a watched model: another one it does not hold is a second network (a target
            # network given gradients by a forward outside no_grad: param-not-in-optimizer says it), not a copy
            return
        for model in models:
            named = list(model.named_parameters())
            if self._masters(model, named, tensors):
                return
            with_grad = [n for n, p in named if p.requires_grad and p.is_leaf and p.grad is not None]
            if not with_grad or any(id(p) in held for _, p in named):
                continue
            if self._held_first and id(model) in self._held_first:
                # held at the first step: its parameters were replaced since (load_state_dict(..., assign=True), an
                # init assigning new nn.Parameters), which param-not-in-optimizer and loss-disconnected tell with
                # their step; it is no copy the optimizer was built over
                continue
            if not any(tuple(p.shape) in shapes for _, p in named):
                continue
            if any(self._versions.get(id(p), p._version) != p._version for _, p in named):
                continue  # changed in place since the first step: updated by hand (copied back from fp32 masters)
            opts = self.g.optimizers
            n_held = sum(len(grp["params"]) for o in opts for grp in o.param_groups)
            mname = type(model).__name__
            self.emit("params-not-updating", mname,
                      f"none of the {len(named)} parameters of {mname} is in the optimizer "
                      f"({', '.join(type(o).__name__ for o in opts)}, {n_held} parameters of another module) "
                      f"although {len(with_grad)} get gradients: the optimizer was built over another copy of the "
                      f"model, so {mname} has not changed in {self.g.step + 1} steps",
                      f"Build the optimizer from the model you train, after any copy, load or rebuild: "
                      f"optimizer = torch.optim.X({'model'}.parameters(), ...) (not from a deepcopy, or from the "
                      f"model before it was replaced).",
                      step=0, source=self.g.source(),
                      details={"model": mname, "parameters": len(named), "with_grad": len(with_grad),
                               "optimizer_parameters": n_held, "over_copy": True})
