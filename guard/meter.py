"""Guard's own cost, measured per step, and the sampling period that keeps it under a budget.

Every entry point of guard (module hooks, patched functions, optimizer hooks, backward) adds the
time it spent to the current step (`Meter.add`); the time of the user's code it calls is not
counted. At each step's end, the step's wall time (from the previous step's end) and guard's share
of it give the overhead. With a budget (``guard(..., budget=0.05)``) the costly checks run every
`period`-th step only: the period doubles while the recent overhead is over the budget and halves
while it is well under it. The cheap, exact checks (NaN/Inf, AMP) never skip a step.
"""
from __future__ import annotations

import math
import time
from typing import Any, Dict, Optional

MAX_PERIOD = 1024
WINDOW = 8  # steps between two decisions on the period
WARMUP = 3  # steps (after the first) not counted: guard's one-time work happens there


class Meter:
    """Guard's time per step against the step's time; adapts the costly checks' period to `budget`.

    Under a budget the period is worked out from what the costly checks add: guard's time on the
    steps they run minus its time on the steps they skip. They get what the budget leaves after the
    cheap checks (at least a quarter of it), so a model where even the cheap checks are over budget
    still runs the costly ones now and then.
    """

    __slots__ = ("budget", "period", "own", "total_own", "total_wall", "steps", "max_period", "_last_end",
                 "_n", "_seen", "_own_costly", "_own_cheap", "_rest", "_was_costly", "_pinned")

    def __init__(self, budget: Optional[float]):
        self.budget = budget
        self.period = 1
        self.max_period = 1
        self.own = 0.0  # guard's seconds in the current step
        self.total_own = 0.0
        self.total_wall = 0.0
        self.steps = 0
        self._last_end: Optional[float] = None
        self._n = 0
        self._seen = 0
        self._own_costly: Optional[float] = None  # moving averages, seconds per step
        self._own_cheap: Optional[float] = None
        self._rest: Optional[float] = None
        self._was_costly = True
        self._pinned = False

    def pin(self, period: int) -> None:
        """Sample the costly checks every `period`-th step from now on, whatever the measured cost (for
        tests and benchmarks that need a known period; the budget no longer adapts it)."""
        if not isinstance(period, int) or isinstance(period, bool) or not 1 <= period <= MAX_PERIOD:
            raise ValueError(f"guard: period={period!r} is not allowed; allowed: an int in [1, {MAX_PERIOD}]")
        self.period, self._pinned = period, True
        self.max_period = max(self.max_period, period)

    def add(self, seconds: float) -> None:
        self.own += seconds

    def end_step(self, step: int) -> None:
        """Step `step` ended: account it; with a budget, adapt the period."""
        try:
            self._account(self._was_costly)
        finally:
            self._was_costly = self.costly_step(step + 1)

    def _account(self, was_costly: bool) -> None:
        now = time.perf_counter()
        own, self.own = self.own, 0.0
        if self._last_end is None:  # the first step's start is unknown: measure from its end on
            self._last_end = now
            return
        wall = now - self._last_end
        self._last_end = now
        self._seen += 1
        if self._seen < WARMUP:
            return  # first calls of every layer, the first steps' extra explanations: one-time costs
        if wall <= own:
            return
        self.total_own += own
        self.total_wall += wall
        self.steps += 1
        if self.budget is None or self._pinned:
            return
        self._rest = _avg(self._rest, wall - own)
        if was_costly:
            self._own_costly = _avg(self._own_costly, own)
        else:
            self._own_cheap = _avg(self._own_cheap, own)
        self._n += 1
        if self._n % WINDOW:
            return
        rest, costly, cheap = self._rest, self._own_costly, self._own_cheap
        if cheap is None or costly is None:
            if costly is not None and costly / rest > self.budget:
                self.period = 2  # learn what the cheap checks cost alone
        else:
            extra = max(costly - cheap, 0.0)
            allowance = max(self.budget - cheap / rest, self.budget / 4) * rest
            self.period = int(min(MAX_PERIOD, max(1, math.ceil(extra / allowance))))
        self.max_period = max(self.max_period, self.period)

    def costly_step(self, step: int) -> bool:
        """Whether the costly checks run at `step`."""
        return self.period == 1 or step % self.period == 0

    @property
    def overhead(self) -> Optional[float]:
        """Guard's time over the rest of the steps' time (0.031 = 3.1%), or None before two steps."""
        if self.steps == 0 or self.total_wall <= self.total_own:
            return None
        return self.total_own / (self.total_wall - self.total_own)

    def to_dict(self, sampled: Any = ()) -> Dict[str, Any]:
        out: Dict[str, Any] = {"overhead": self.overhead, "steps_measured": self.steps,
                               "guard_seconds": round(self.total_own, 6), "step_seconds": round(self.total_wall, 6)}
        if self.budget is not None:
            out.update({"budget": self.budget, "period": self.period, "max_period": self.max_period,
                        "sampled_checks": sorted(sampled)})
        return out


def _avg(old: Optional[float], new: float, alpha: float = 0.25) -> float:
    return new if old is None else old + alpha * (new - old)
