"""Gradient explosion: the total norm far above its running level.

Per sampled step and optimizer: the total gradient norm from the shared, fused
``g.grad_norms(opt)`` (no extra reduction), staged and read with the step's
other values. Host side, a window of the logs of the last `WINDOW` finite,
non-zero totals. After `WARMUP` steps a total fires when its log lies above the
window's median by more than the run's own spread allows: ``Z`` robust standard
deviations (1.4826 x the median absolute deviation of the logs), ``HIGH`` x the
window's largest total (``HIGH_HEAVY`` x when that is already ``SPREAD`` x the median: a heavy tail), and never less than ``FACTOR`` x the median. Runs whose norms vary by design (random extra
terms, losses summed over episodes of varying length) thus set their own,
higher bar; a steady run keeps the ``FACTOR`` floor. A burst (consecutive
totals above the bar) is reported once; the next report needs a total back
below it first; totals above the bar stay out of the window. The per-parameter norms are read (one sync) only when one fires,
to name the largest.

All-zero totals are left out of the window; they are reported as ``grads-all-zero``
by ``grads_all_zero.py``.

The gradients seen are the unscaled ones under AMP: ``GradScaler.step`` unscales
before ``optimizer.step()``; for optimizers that unscale inside their fused step
(``opt.grad_scale``/``opt.found_inf`` set by the scaler) the total is divided by
the scale on the device, and a step the scaler will skip is ignored.

Also adds the learning rate of group 0 of the main optimizer to the timeline.
"""
from __future__ import annotations

import math
import weakref
from collections import deque
from statistics import median
from typing import Optional

import torch

from .base import Check
from .._weak import WeakIdMap

WARMUP = 10
WINDOW = 50
FACTOR = 10.0  # the least ratio to the median that fires, however steady the run
Z = 6.0  # robust standard deviations of log norms above the median that fire
HIGH = 2.0  # and the least ratio to the largest norm in the window
LOG_HIGH = math.log(HIGH)
# A window whose largest norm is already SPREAD x its median is heavy-tailed (meta-learning over random tasks, a
# few hard batches): its next largest is often twice the last, so a jump must be HIGH_HEAVY x the largest there.
SPREAD = 5.0
HIGH_HEAVY = 4.0
# the first batch of a new task: a loss back within NEW_DATA_LOSS x the run's first, and NEW_DATA_RISE x above the
# window's median loss, allows norms up to NEW_DATA_HIGH x the run's first ones
NEW_DATA_LOSS = 20.0
NEW_DATA_RISE = 10.0
NEW_DATA_HIGH = 10.0
LOG_NEW_DATA_HIGH = math.log(NEW_DATA_HIGH)


DIVERGE = 1000.0  # a total this many times the window's median, after a steady climb, is a divergence
CLIMB = 10  # ... the last CLIMB totals of which at least CLIMB_HIGHS were each the window's new largest
CLIMB_HIGHS = 7

#: a spike whose step's loss rose by at least this power of the norm's ratio (and at most HEAVIER_MAX) is a heavier
#: batch: more (longer) samples summed (``reduction="sum"`` over length buckets), the loss and its gradient growing
#: together; a squared error's wild sample raises the loss by about the square of its gradient's ratio
HEAVIER = 0.5
HEAVIER_MAX = 1.6
FIRST_LOSS_MIN = 1e-3  # a first loss below this sets no scale for "diverging from the start"
HEAVIER_LOSS_MAX = 1000.0  # the most a heavier batch raises the loss by (more frames summed, not a blow-up)
#: optimizers whose update is normalised per element by the gradients' running size: a heavier batch's larger
#: gradient does not move the weights proportionally further
ADAPTIVE = ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "Adafactor", "SparseAdam")

#: a window whose median gradient, per element (RMS), is below this was no training signal: the model sat at its
#: optimum or its only loss term was gated off (AdaRound starts at the exact weights; its rounding term joins after a
#: warm-up). A rise from there is that term switching on (below Adam's eps, 1e-8, its steps were near nothing), and
#: the clip it would suggest (3x that median) would cancel the term
QUIET_RMS = 1e-8
#: ... or below this fraction of the parameters' own RMS while the window's median loss was below QUIET_LOSS x this
#: step's: the loss sat at ~0 and a new term joined it (a later layer's rounding variables, reconstructed to float
#: precision, have gradients ~1e-6 of their size and a loss of 1e-7 before their rounding term adds 2.4)
QUIET_REL = 1e-5
QUIET_LOSS = 1e-4

RAMP_STEPS = 6  # steps in a row whose learning rate grew by one same factor: an LR range test
RAMP_MIN = 1.02  # the least growth factor per step of such a test (fastai and torch-lr-finder: ~1.05-1.3)


class _State:
    __slots__ = ("window", "top", "where", "burst", "highs", "diverged", "early", "pushed", "losses", "first_loss",
                 "most")

    def __init__(self, most: int = 0) -> None:
        self.most = most  # the most parameters with a gradient in one step so far
        self.window: deque = deque(maxlen=WINDOW)  # log norms
        self.top = -math.inf  # max(window), kept as values come and go (not recomputed every step)
        self.where: Optional[str] = None
        self.burst = False
        self.highs: deque = deque(maxlen=CLIMB)  # whether each recent total was the window's new largest
        self.diverged = False
        self.early = -math.inf  # the largest of the run's first WARMUP totals (an untrained model's gradients)
        self.pushed = 0
        self.losses: deque = deque(maxlen=WINDOW)  # the steps' positive losses, beside their norms
        self.first_loss: Optional[float] = None  # the run's first positive loss

    def push(self, lv: float) -> None:
        if self.pushed < WARMUP:
            self.pushed += 1
            self.early = max(self.early, lv)
        w = self.window
        out = w[0] if len(w) == w.maxlen else None
        w.append(lv)
        if out is not None and out == self.top and lv < out:
            self.top = max(w)  # the largest left the window
        elif lv > self.top:
            self.top = lv


class _Ramp:
    """Whether an optimizer's learning rate is growing geometrically (an LR range test: it diverges on purpose)."""
    __slots__ = ("last", "factor", "run")

    def __init__(self) -> None:
        self.last: Optional[float] = None
        self.factor = 0.0
        self.run = 0

    def note(self, lr: float) -> bool:
        # One same factor (to 1e-4): a linear warm-up's factors t / (t - 1) differ by more from step to step.
        last, self.last = self.last, lr
        if last is None or last <= 0 or lr <= last * RAMP_MIN:
            self.run = 0
            return False
        f = lr / last
        self.run = self.run + 1 if self.run and abs(f - self.factor) <= 1e-4 * self.factor else 1
        self.factor = f
        return self.run >= RAMP_STEPS


def _bar(logs) -> tuple:
    """(median, threshold ratio to it) for a window of log norms: at least FACTOR, Z robust sigmas, and
    HIGH x the window's largest norm (rare by-design jumps of a run are not its explosions)."""
    m = median(logs)
    sigma = 1.4826 * median(abs(x - m) for x in logs)
    spread = math.exp(max(logs) - m)
    return math.exp(m), max(FACTOR, math.exp(Z * sigma), (HIGH_HEAVY if spread >= SPREAD else HIGH) * spread)


def _adaptive(opt) -> bool:
    return any(c.__name__ in ADAPTIVE for c in type(opt).__mro__)


def _quiet(gn, med: float, loss: Optional[float], losses) -> bool:
    """Whether the window's median total norm `med` is below QUIET_RMS per element of the step's gradients, or below
    QUIET_REL x the parameters' RMS while the loss rose from ~0 (`losses`: the window's, `loss`: this step's)."""
    ps = [p for p in gn.params if p.numel()]
    n = sum(p.numel() for p in ps)
    if not n:
        return False
    rms = med / math.sqrt(n)
    if rms < QUIET_RMS:
        return True
    if loss is None or not math.isfinite(loss) or not losses or not median(losses) <= QUIET_LOSS * loss:
        return False
    try:
        with torch.no_grad():  # (read only when a spike would be reported: one read)
            norms = torch._foreach_norm([p.detach() if p.dtype in (torch.float32, torch.float64) else
                                         p.detach().abs().float() for p in ps])
            dev = norms[0].device
            size = float(torch.linalg.vector_norm(torch.stack([t.float().to(dev) for t in norms])))
    except Exception:  # (weights that cannot be reduced this way, meta or sparse ones: told as before)
        return False
    return rms < QUIET_REL * size / math.sqrt(n)


def _nice(x: float) -> str:
    if x <= 0 or not math.isfinite(x):
        return "1.0"
    e = math.floor(math.log10(x))
    m = x / 10 ** e
    m = 1 if m < 1.5 else 2 if m < 3.5 else 5 if m < 7.5 else 10
    return f"{m * 10 ** e:g}"


class GradExplosion(Check):
    name = "grad-explosion"
    # Not costly: a spike comes on one step, and a sampled-out step would miss it. Its norms are the
    # guard's shared ones (the NaN check needs them anyway); its medians are computed for rare totals only.
    kinds = {
        "grad-explosion": ("warning", "total gradient norm jumps far above its running level"),
    }
    description = "total gradient norm far above its running median, by more than the run's own spread"

    def __init__(self, guard):
        super().__init__(guard)
        self._state = WeakIdMap()  # optimizer -> _State
        self._ramps = WeakIdMap()  # optimizer -> _Ramp

    def on_step_pre(self, optimizer):
        if not self.sampling:
            return
        if self.g.is_primary(optimizer):
            self._note_lr(optimizer)
        lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
        if isinstance(lr, float):
            ramp = self._ramps.data.get(id(optimizer))
            if ramp is None:
                ramp = self._ramps[optimizer] = _Ramp()
            if ramp.note(lr):
                return  # an LR range test: the divergence it looks for is no explosion (nor a norm to keep)
        gn = self.g.grad_norms(optimizer)
        totals = list(gn.totals.values())
        if not totals:
            return
        # The totals carry no autograd history (made without grad), nor do the detached scaler values.
        total = totals[0]
        if len(totals) > 1:
            total = torch.linalg.vector_norm(torch.stack([t.to(total.device) for t in totals]))
        scale = getattr(optimizer, "grad_scale", None)
        if isinstance(scale, torch.Tensor):  # fused AMP step: grads are still scaled
            total = total / scale.detach().to(total.device).reshape(()).float()
        found_inf = getattr(optimizer, "found_inf", None)
        if isinstance(found_inf, torch.Tensor):  # the fused step will skip: not a signal
            total = torch.where(found_inf.detach().to(total.device).reshape(()) > 0,
                                torch.full_like(total, float("nan")), total)
        step, source, oref = self.g.step, self.g.source(), weakref.ref(optimizer)
        self.g.stage(total, lambda v: self._seen(oref, gn, v, step, source))

    def _note_lr(self, optimizer) -> None:
        groups = optimizer.param_groups
        lr = groups[0].get("lr") if groups else None
        if isinstance(lr, torch.Tensor):
            self.g.stage(lr.detach().reshape(()).float(), lambda v: self.g.timeline_note(lr=v))
        elif isinstance(lr, (int, float)):
            self.g.timeline_note(lr=float(lr))

    def _seen(self, oref, gn, v: float, step: int, source: Optional[str]) -> None:
        opt = oref()
        if opt is None or not math.isfinite(v):
            return  # NaN/Inf is the nonfinite check's business (or a step the scaler skips)
        st = self._state.data.get(id(opt))
        if st is None:
            st = self._state[opt] = _State()
        n = len(gn.params)
        if n > st.most:
            if st.most:
                # More parameters have gradients than ever before: a warm-up that trained a new table alone
                # (`backward(inputs=[emb.weight])`), then everything; a layer unfrozen. The total's level changes
                # by design: its window starts again.
                st = self._state[opt] = _State(n)
            st.most = n
        if v == 0.0:
            return  # all-zero gradients are the grads-all-zero check's business (grads_all_zero.py)
        # The bar is never below HIGH x the window's largest norm: a total under that cannot fire, and the
        # medians (two sorts a step) are computed only for a total above it.
        lv = math.log(v)
        if len(st.window) >= WARMUP:
            # A total no larger than HIGH x the run's first ones is the gradient of a model meeting what it has not
            # learned yet (the next task of a continual-learning run, a new data source), not an explosion.
            if lv > LOG_HIGH + st.top and lv > self._early_bar(st) + st.early:
                med, ratio = _bar(st.window)
                if v > ratio * med and _quiet(gn, med, self.g.step_loss, st.losses):
                    # a loss term joining a model that sat at its optimum: the level changes by design, its window
                    # starts again
                    st = self._state[opt] = _State(st.most)
                elif v > ratio * med:
                    heavier = self._heavier(st, v / med)
                    if heavier and _adaptive(opt):
                        return  # Adam's step barely grows with it: nothing about to jump
                    if not st.burst:  # once per burst, not once per step
                        st.burst = True
                        self._report(opt, st, gn, v, med, ratio, step, source, heavier=heavier)
                    return  # an explosion does not raise the bar for the next one
            st.burst = False
            self._note_loss(st)
            # A steady climb (1.5x a step) never jumps HIGH x above the window's largest: a run that diverges
            # slowly is told by its new highs, once far above the window's median.
            high = lv > st.top
            st.highs.append(high)
            if high and not st.diverged and sum(st.highs) >= CLIMB_HIGHS:
                med = math.exp(median(st.window))
                if v >= DIVERGE * med:
                    st.diverged = True
                    self._report(opt, st, gn, v, med, DIVERGE, step, source, climbing=sum(st.highs))
        else:
            # (climbing: the step before set a new high too; one wild batch among the first is no divergence)
            if len(st.window) >= 2 and not st.diverged and lv >= math.log(DIVERGE) + st.window[0] \
                    and st.window[-1] == st.top and st.window[-1] > st.window[0] and self._loss_blew(st):
                # diverging from the start, before the window is set: 1000x the first step's norm within the first
                # steps, and the loss with it (a regression target in raw units, 0-80 m, with SGD at lr 0.01)
                st.diverged = True
                first = math.exp(st.window[0])
                self._report(opt, st, gn, v, first, DIVERGE, step, source, climbing=len(st.window) + 1, early=True)
            self._note_loss(st)
        st.push(lv)

    def _early_bar(self, st: _State) -> float:
        """Log of how far above the run's first norms a total must be. A model meeting data it has not learned (the
        first batch of the next task in class-incremental learning, the old task learned down to a loss near 0) has
        gradients a few times its untrained ones: while the step's loss is back within NEW_DATA_LOSS x the run's
        first loss and well above the window's median loss, the bar is NEW_DATA_HIGH x those norms."""
        loss = self.g.step_loss
        first = st.first_loss
        if loss is None or first is None or not math.isfinite(loss) or not st.losses:
            return LOG_HIGH
        if loss <= NEW_DATA_LOSS * first and loss >= NEW_DATA_RISE * median(st.losses):
            return LOG_NEW_DATA_HIGH
        return LOG_HIGH

    def _loss_blew(self, st: _State) -> bool:
        """Whether this step's loss is at least 100x the run's first one (diverging, not a loss on a new scale). A
        first loss near 0 (a consistency loss between a student and its just-copied teacher) sets no scale."""
        loss = self.g.step_loss
        return (bool(st.losses) and st.losses[0] >= FIRST_LOSS_MIN and loss is not None and math.isfinite(loss)
                and loss >= 100.0 * st.losses[0]
                # gradients piling up without zero_grad() blow up too: that finding names the cause
                and not any(f.kind == "missing-zero-grad" for f in self.g.findings))

    def _note_loss(self, st: _State) -> None:
        loss = self.g.step_loss
        if loss is not None and loss > 0.0 and math.isfinite(loss):
            st.losses.append(loss)
            if st.first_loss is None:
                st.first_loss = loss

    def _heavier(self, st: _State, norm_ratio: float) -> float:
        """The ratio of this step's loss to the run's median loss when it rose with the norm (a heavier batch:
        at least ``norm_ratio ** HEAVIER``), else 0."""
        loss = self.g.step_loss
        if loss is None or not loss > 0.0 or not math.isfinite(loss) or len(st.losses) < WARMUP:
            return 0.0
        r = loss / median(st.losses)
        # (a loss rising far more than its gradient, as a squared error does, is one wild sample: not this; nor is
        # a loss up a thousandfold, no batch is that much heavier: an unstable rollout blowing up)
        return r if 1.0 < r <= HEAVIER_LOSS_MAX and HEAVIER <= math.log(r) / math.log(norm_ratio) <= HEAVIER_MAX else 0.0

    def _report(self, opt, st: _State, gn, v: float, med: float, ratio: float, step: int,
                source: Optional[str], climbing: int = 0, heavier: float = 0.0, early: bool = False) -> None:
        values = gn.per_param()
        ranked = sorted(zip(gn.names, values), key=lambda nv: -nv[1] if math.isfinite(nv[1]) else 0.0)[:5]
        where = st.where or (ranked[0][0] if ranked else "loss")
        st.where = where
        largest = ", ".join(f"{n} ({x:.3g})" for n, x in ranked)
        if early:
            message = (f"total gradient norm {v:.3g} is {v / med:.0f}x the first step's ({med:.3g}) after "
                       f"{climbing - 1} step(s), and the loss is {self.g.step_loss / st.losses[0]:.3g}x the first "
                       f"one with it: training diverges from the start; largest: {largest}")
            hint = (f"Each update overshoots and the next gradient is larger: the learning rate is too high for the "
                    f"scale of this loss (a regression target in raw units, metres or prices, makes large gradients: "
                    f"normalise the target, y = (y - mean) / std, and invert it for predictions). Lower the learning "
                    f"rate, add a warm-up, and clip gradients before optimizer.step(): "
                    f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={_nice(3 * med)}).")
        elif climbing:
            message = (f"total gradient norm {v:.3g} is {v / med:.0f}x its running median {med:.3g} after climbing "
                       f"steadily ({climbing} of the last {CLIMB} steps set a new high): training is diverging; "
                       f"largest: {largest}")
            hint = (f"Each update overshoots and the next gradient is larger: the learning rate is too high for this "
                    f"model (or momentum with it). Lower it (try a tenth), add a warm-up, and clip gradients before "
                    f"optimizer.step(): torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm="
                    f"{_nice(3 * med)}).")
        elif heavier:
            message = (f"total gradient norm {v:.3g} is {v / med:.0f}x its running median {med:.3g} (last "
                       f"{len(st.window)} steps; this run's norms vary up to about {ratio:.0f}x), and this step's "
                       f"loss is {heavier:.0f}x the run's median loss with it: a heavier batch (more or longer "
                       f"samples summed, or an outlier), whose update {type(opt).__name__} scales with the gradient; "
                       f"largest: {largest}")
            hint = (f"Normalise the loss by what it sums over (frames, tokens, objects: reduction='mean' or divide by "
                    f"the count rather than the batch size), or clip gradients before optimizer.step(): "
                    f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={_nice(3 * med)}).")
        else:
            message = (f"total gradient norm {v:.3g} is {v / med:.0f}x its running median {med:.3g} "
                       f"(last {len(st.window)} steps; this run's norms vary up to about {ratio:.0f}x); "
                       f"largest: {largest}")
            if _adaptive(opt):
                # Adam-like steps are normalised: the update grows a few times at most, but its moments take the
                # spike in, and spikes that come back are how such runs start to diverge
                hint = (f"{type(opt).__name__} normalises its step, so this update grows only a few times, but the "
                        f"spike enters its moment estimates; if it comes back, lower the learning rate (or lengthen "
                        f"its warm-up) and clip gradients before optimizer.step(): "
                        f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={_nice(3 * med)}) (a few times "
                        f"the usual norm here).")
            else:
                hint = (f"The update is about to jump far: lower the learning rate (or lengthen its warm-up), and clip "
                        f"gradients before optimizer.step(): torch.nn.utils.clip_grad_norm_(model.parameters(), "
                        f"max_norm={_nice(3 * med)}) (a few times the usual norm here).")
        self.emit("grad-explosion", where, message, hint, step=step, source=source,
                  details={"optimizer": type(opt).__name__, "total_norm": v, "running_median": med,
                           "ratio": v / med, "threshold_ratio": ratio, "largest": [{"name": n, "norm": x} for n, x in ranked],
                           **({"diverging": True} if climbing else {}), **({"from_start": True} if early else {}),
                           **({"heavier_batch": True, "loss_ratio": heavier} if heavier else {})})
