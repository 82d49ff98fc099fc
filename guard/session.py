"""`Guard`: configuration, lifecycle, hook wiring and the step counter.

The data of a session lives in its `Record` (``g.record``); device values wait in the
`Staging` engine (``guard/staging.py``); events reach the checks through the `Router`
(``guard/router.py``). Renderers in ``guard/report/`` read the record, never the guard.
Hooks and patches are installed only through `guard.hooks.Installer`.
"""
from __future__ import annotations

import functools
import os
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from torch import nn

from . import hooks as _hooks
from ._frames import user_frame, user_source
from .compiled import CompileBoundary
from ._modules import RecursionRoom
from ._dist import rank_info as _dist_rank
from .checks import registry
from .checks.base import Check
from .config import Config, ConfigError, as_list, make_config
from .findings import ERROR, Finding, GuardError, is_kind, printable, severity_of
from .meter import Meter
from .record import Record
from .router import FRESH, GuardInternalWarning, Router
from .staging import GradNorms, Staging
from .watched import Watched, model_labels, unheld, unwrapped_optimizer
from .wiring import Wiring

MAX_FINDINGS = 1000
MAX_TIMELINE = 4096


__all__ = ["Guard", "GuardInternalWarning", "GradNorms"]


def _delegate(part: str, name: str, doc: str) -> property:
    """A read-only property: ``self.<part>.<name>``."""
    return property(lambda self: getattr(getattr(self, part), name), doc=doc)


class Guard(Wiring):
    """A runtime guard over a model/optimizer; see ``guard()`` for the arguments."""

    def __init__(self, model: Any = None, optimizer: Any = None, *, checks: Any = "default", mode: Any = "warn",
                 report: Any = None, live: Any = None, every: Any = 1, snoop: Any = False, budget: Any = None,
                 origin: Optional[Dict[str, str]] = None, **extras: Any):
        models = as_list(model, "model", nn.Module, "an nn.Module")
        given = as_list(unheld(optimizer), "optimizer", torch.optim.Optimizer, "a torch.optim.Optimizer")
        opts = [u for u in map(unwrapped_optimizer, given) if u is not None]
        # an Optimizer subclass that skipped Optimizer.__init__ and holds no optimizer inside cannot be hooked
        self._unhooked = [type(o).__name__ for o in given if unwrapped_optimizer(o) is None]
        self._registry = registry()
        self.config: Config = make_config(self._registry, checks=checks, mode=mode, report=report, live=live,
                                          every=every, snoop=snoop, budget=budget, origin=origin,
                                          **extras)
        self._models = [weakref.ref(m) for m in models]  # never keep the user's model or optimizer alive
        self._labels = model_labels(models, user_frame(2)) if len(models) > 1 else None
        self._optimizers = [weakref.ref(o) for o in opts]
        self._active = False
        self._paused = False  # a background guard stepping aside for a guard from the code
        self._closed_once = False
        self._entered = 0  # `with` blocks of this guard open now (re-entered: closed by the outermost only)
        self._pid = os.getpid()  # a forked copy (another pid) never writes this guard's report
        self._lock = threading.RLock()
        self._reset()

    # ------------------------------------------------------------------ state
    def _reset(self) -> None:
        self.step = 0
        self._copied_at: Optional[str] = None  # where a watched model was first copied (a notice's clue)
        self.sampling = True
        self._mid_step = False
        self.room = RecursionRoom()  # recursion-limit room for deep models
        #: whether the costly checks (`Check.costly`) run this step: always, unless a budget samples them
        self.costly_step = True
        self.meter = Meter(self.config.budget)
        self.record = Record()
        #: findings of the guards from the code this (background) guard stepped aside for: theirs to report,
        #: counted by `guard run --fail-on`
        self.aside_findings: List[Any] = []
        self.aside_steps = 0  # ... and their steps (the run's report counts them: it is the one a CI job reads)
        self.router = Router(self)
        self.staging = Staging(self.router.contain, self.flush)
        self.watched = w = Watched(self._models, self._optimizers, self.notice, self.router.contain, self._labels)
        self._root_ids, self._paths_weak = w.root_ids, w.paths_weak  # read on every module call
        # services for checks (see CheckContext), bound once
        self.path_of, self.known_path, self.named_parameters = w.path_of, w.known_path, w.named_parameters
        self.stage, self.stage_flag, self.stage_batch = self.staging.stage, self.staging.stage_flag, self.staging.stage_batch
        self.forget_grad_norms = self.staging.forget_grad_norms
        self._tls = threading.local()
        self.is_primary = w.is_primary
        self.dispatch = self.router.dispatch  # type: ignore[method-assign]  (one Python call per event fewer)
        self._backward_pending = False
        self.backwards_elsewhere = 0  # backward() calls with no watched model run since the last (Wiring._mw_backward)
        self.graph_seq = -1  # autograd's sequence number of the last completed backward()'s newest node
        self.first_graph_seq = -1  # ... and of the run's first backward()'s (what was made before the loop)
        self.report_path: Optional[str] = None
        self.report_error: Optional[str] = None
        self.processes: List[Dict[str, Any]] = []  # other processes' dumps of this run (background guard)
        self._rank_known = False
        self.started_at = 0.0  # time.time() of start()
        self._installer = inst = _hooks.Installer()
        self.grad_hook, self.graph_prehook, self.replace_attr = inst.grad_hook, inst.graph_prehook, inst.attr
        self._mod_handles: Dict[int, Tuple[Any, Any]] = {}  # id(module) -> (pre, post) hook handles (model mode)
        self._root_seen = False  # a watched model was called (model mode)
        self._fresh_step = False  # a step just ended: no model call or backward() since (Wiring._hook_step_pre)
        self._lagging: Optional[Any] = None  # an optimizer stepping after the step it belongs to ended
        # the thread followed: (ident, thread, whether it stepped yet) (Wiring._foreign)
        self._owner: Optional[Tuple[int, threading.Thread, bool]] = None
        self._told_threads = False  # another thread's events were seen while one is followed
        self._noticed_threads = False
        self._left_alone: Dict[int, threading.Thread] = {}  # threads whose steps were skipped (Wiring._foreign)
        self._standins: Set[int] = set()  # ids of layers whose calls stand in for a model never called (Wiring._standin)
        self.compile = CompileBoundary(self, {"pre": self._hook_pre, "post": self._hook_post,
                                              "pre_global": self._hook_pre_global, "post_global": self._hook_post_global},
                                       self._mod_handles, inst, model_mode=bool(self._models))

    # ------------------------------------------------------------------ public API
    @property
    def findings(self) -> List[Finding]:
        """Findings in the order they were first seen (repeats bump ``count``), current when read.

        Device values staged so far in this step are read first (one batched read, only when asked),
        so a NaN input is here right after the forward that saw it, not only after ``optimizer.step()``.
        """
        self._resolve_for_reader()
        return list(self.record.findings)

    @property
    def modules(self) -> Dict[str, Dict[str, Any]]:
        """The module table: path -> type, output shape, dtype, device, parameter count."""
        return {m["path"]: m for m in self.record.modules}

    timeline = _delegate("record", "timeline", "Per-step values (loss, gradient norm, lr, ...), thinned evenly on long runs.")
    notices = _delegate("record", "notices", "What guard cannot see (e.g. under torch.compile), said once each.")
    internal_errors = _delegate("record", "internal_errors", "guard's own failures: check, error, at, step.")
    checks = _delegate("router", "checks", "The active checks (one that failed is switched off and leaves).")
    models = _delegate("watched", "models", "The watched models (unwrapped from DataParallel/DDP), alive ones only.")
    roots = _delegate("watched", "roots", "The watched models, or under a global guard the outermost modules seen.")
    optimizers = _delegate("watched", "optimizers", "Optimizers given to the guard or seen stepping while it was active.")

    def _resolve_for_reader(self) -> None:
        """Resolve what is staged now because the user reads the findings (or the report) mid-step.

        The step's loss, gradient norms and timeline entry wait for the step's own resolution; checks
        see ``resolved()`` with ``mid_step`` True (the nonfinite check's window closes, as on a flush).
        """
        if not self._active or self._mid_step or not self.staging.has_staged():
            return
        with self._lock:
            self._mid_step = True
            try:
                self.staging.resolve(keep_step_values=True)
                self.dispatch("resolved")
            finally:
                self._mid_step = False

    @property
    def mid_step(self) -> bool:
        """True while staged values are resolved because the user reads findings mid-step."""
        return self._mid_step

    @property
    def active(self) -> bool:
        return self._active

    @property
    def given_optimizers(self) -> bool:
        """Whether optimizers were handed to ``guard()`` (all known from the start)."""
        return bool(self._optimizers)

    def start(self) -> "Guard":
        """Install hooks and patches; returns self. Starting a started guard does nothing."""
        with self._lock:
            if self._active:
                return self
            if self._closed_once:
                self._reset()
            self._active = True
            try:
                self._build_checks()
                self._install()
            except BaseException:
                self._installer.close()
                self._active = False
                raise
            self.started_at = time.time()
            if self.config.background:
                import multiprocessing.util

                multiprocessing.util.register_after_fork(self, Guard._after_fork)
            from . import _procs

            _procs.after_start(self)
            self.dispatch("start")
            for name in self._unhooked:
                self.notice(f"guard: the optimizer {name} has none of Optimizer's step hooks (its __init__ did not "
                            f"call Optimizer.__init__) and wraps no optimizer that has: its steps are seen only "
                            f"through the optimizers it calls, if any is a torch.optim.Optimizer.")
        return self

    def close(self, *, write_report: bool = True) -> None:
        """Resolve what is pending, remove every hook and patch, write the report. Idempotent.

        ``write_report=False`` writes no report and prints no summary (the guard is discarded).
        """
        with self._lock:
            if self._paused:
                self._paused, self._active = False, True
            if not self._active:
                return
            try:
                try:
                    self._resolve()
                    if self._backward_pending:
                        self._advance_backward_step()
                finally:
                    self.dispatch("exit")
            finally:
                self._active = False
                self._closed_once = True
                self.room.restore()
                self._installer.remove_copies(m for r in self._models if (root := r()) is not None
                                              for m in root.modules())
                self._installer.close()
                self.staging.clear()
                from . import _procs

                _procs.after_close(self)
                if write_report:
                    self._finish()

    def pause(self, reason: str) -> None:
        """Ignore every event until `resume()` (hooks stay in place); `reason` goes to the dump's notices."""
        with self._lock:
            if self._active:
                self._active, self._paused = False, True
            if reason not in self.record.notices:
                self.record.notices.append(reason)

    def resume(self) -> None:
        """Watch again after `pause()`."""
        with self._lock:
            if self._paused:
                self._active, self._paused = True, False

    def _after_fork(self) -> None:
        """In a forked multiprocessing child (a worker): record only what this process sees, write it at its exit."""
        import multiprocessing.util

        installer, handles = self._installer, self._mod_handles
        self._pid = os.getpid()
        self._reset()  # the parent's records, models and the checks' memory of them are not this process's
        self._installer, self._mod_handles = installer, handles  # its hooks stay in place (and are removed at close)
        self.compile.installer, self.compile.handles = installer, handles
        self._build_checks()
        self.dispatch("start")
        self.started_at = time.time()
        # forked children leave through os._exit (no atexit): multiprocessing's own exit runs this
        multiprocessing.util.Finalize(None, _hooks.run_exit_callback, args=(self, "exit"), exitpriority=100)

    def __enter__(self) -> "Guard":
        # Re-entered while its own `with` block runs (`with g:` inside `with g:`, a decorated function calling
        # itself): the inner block's end must not close the guard the outer block still runs under.
        if self._entered and self._active:
            self._entered += 1
            return self
        self._entered = 1
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if self._entered > 1:
            self._entered -= 1
            if exc is not None:
                self.exception(exc)  # explained where it leaves the inner block (it may be caught there)
            return False
        self._entered = 0
        if exc is not None:
            self.exception(exc)
            try:
                self.close()
            except GuardError:
                pass  # the user's exception is the one to see
        else:
            self.close()
        return False

    def on_uncaught(self, exc: BaseException) -> None:
        """`exc` ends the program uncaught while this guard runs (called from sys.excepthook): explain it."""
        if self._active:
            self.exception(exc)

    def exception(self, exc: BaseException) -> None:
        """Tell the checks that `exc` escaped the guarded code (they may explain it); never raises."""
        try:
            self.dispatch("exception", exc)
        except GuardError:
            pass  # the user's exception propagates unchanged (raise mode included)

    def close_on_error(self, obj: Any, name: str) -> None:
        """Until close, an exception leaving ``obj.<name>()`` ends the guard as a ``with`` block it escaped
        would (the checks explain it, the report is written, everything is removed); then it propagates.

        For frameworks that give no exception event (the Hugging Face Trainer): their per-step method.
        """
        inner = getattr(obj, name)
        guard = self

        @functools.wraps(inner)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return inner(*args, **kwargs)
            except BaseException as exc:
                if guard._active:
                    guard.__exit__(type(exc), exc, exc.__traceback__)
                raise

        self._installer.attr(obj, name, call)

    def __call__(self, fn: Callable) -> Callable:
        """Use the guard as a decorator: the function runs under it, each call anew."""
        if not callable(fn):
            raise ConfigError(f"guard: cannot decorate {type(fn).__name__}; allowed: a function")
        import inspect

        if inspect.isgeneratorfunction(fn) or inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
            # its call only makes the generator or coroutine: the guard would close before any of its code runs
            what = "a generator function" if inspect.isgeneratorfunction(fn) else "an async function"
            raise ConfigError(f"guard: cannot decorate {getattr(fn, '__name__', fn)!r}, {what} (it would close "
                              f"before its body runs); allowed: a plain function, or `with guard(...):` inside it")

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        run.guard = self  # type: ignore[attr-defined]
        return run

    def __repr__(self) -> str:
        state = "active" if self._active else "inactive"
        return f"<Guard {state} step={self.step} findings={len(self.record.findings)} mode={self.config.mode}>"

    # ------------------------------------------------------------------ checks & routing
    def _build_checks(self) -> None:
        names = self.config.checks
        self.router.set_checks([cls(self) for name, cls in self._registry.items() if name in names])

    def dispatch(self, event: str, *args: Any) -> None:
        """Send `event` to the checks that handle it (a failing check is contained)."""
        self.router.dispatch(event, *args)

    def follow(self, check: Check, on: bool) -> None:
        """Route every step's events to `check` while `on` (see `Check.follow`)."""
        self.router.rebuild()  # the budget's table of sleeping checks leaves it out, or takes it back

    def mute(self, check: Check, event: str) -> None:
        """Send `event` to `check` no more (see `Check.mute`): its handler leaves the tables."""
        self.router.drop(check, event)

    def contain(self, check: Optional[Check], exc: BaseException) -> None:
        """`check` (or guard itself, None) failed: switch it off, say so once, keep training going."""
        self.router.contain(check, exc)

    def notice(self, message: str, *, console: bool = True) -> None:
        """Say once what guard cannot check (stderr unless not `console`; always the dump's ``notices``)."""
        message = printable(message)
        if message not in self.record.notices:
            self.record.notices.append(message)
            if console:
                self.console().internal(message)

    # ------------------------------------------------------------------ findings
    def emit(self, kind: str, where: str, message: str, hint: str, *, check: Optional[Check] = None,
             step: Optional[int] = None, source: Optional[str] = None, details: Optional[Dict[str, Any]] = None,
             severity: Optional[str] = None, seen: Optional[int] = None) -> Optional[Finding]:
        """Record a finding; the first of each (kind, where) is reported, later ones are counted.

        `step` is where the condition began; `seen` (default `step`) the step it is seen at now, the finding's
        `last_step` (a run of zero gradients since step 0, seen again at step 12)."""
        if not is_kind(kind):
            raise ValueError(f"unknown finding kind {kind!r}")
        if kind not in self.config.kinds:
            return None
        step = self.step if step is None else step
        where = printable(where)  # the key findings are counted by, as it is recorded
        rec = self.record
        with self._lock:
            seen = step if seen is None else max(seen, step)
            if rec.repeat(kind, where, seen) or len(rec.findings) >= MAX_FINDINGS:
                return None
            details = dict(details or {})
            if _dist_rank() is not None:
                details.setdefault("rank", _dist_rank()[0])
            finding = Finding(kind=kind, severity=severity or severity_of(kind), message=printable(message),
                              hint=printable(hint), where=where, step=step, count=1,
                              source=printable(source), details=details, last_step=seen)
            rec.put(finding)
        self.console().finding(finding)
        if self.config.mode == "raise" and finding.severity == ERROR:
            raise GuardError(finding)
        return finding

    def seen_again(self, kind: str, where: str) -> None:
        """A reported condition that lasts is seen at this step too: its finding's count and `last_step` follow."""
        with self._lock:
            self.record.repeat(kind, printable(where), self.step)

    def update_details(self, kind: str, where: str, **details: Any) -> Optional[Finding]:
        """Merge `details` into the recorded (kind, where) finding (e.g. a trace captured later)."""
        with self._lock:
            return self.record.update_details(kind, printable(where), details)

    # ------------------------------------------------------------------ staging (one sync per step)
    def flush(self) -> None:
        """Resolve staged device values now (bounded memory when steps are rare or absent)."""
        self._resolve()

    def _resolve(self) -> None:
        """Read every staged value (one transfer per device), note the step's values, then ``resolved``."""
        entry = self.staging.resolve()
        if entry:
            entry["step"] = self.step
            self.record.add_timeline(entry, MAX_TIMELINE)
        self.dispatch("resolved")

    def timeline_note(self, **values: Any) -> None:
        """Add values (e.g. ``skipped=True``, ``lr=...``) to the current step's timeline entry."""
        tl = self.record.timeline
        if tl and tl[-1]["step"] == self.step:
            tl[-1].update(values)
        else:
            self.record.add_timeline({"step": self.step, **values}, MAX_TIMELINE)

    def grad_norms(self, optimizer: Optional[torch.optim.Optimizer] = None) -> GradNorms:
        """This step's gradient norms (fused ``_foreach_norm``), computed once per optimizer and step."""
        gn = self.staging.step_norms.get(id(optimizer))  # asked by several checks a step: no closure then
        if gn is not None:
            return gn
        return self.staging.grad_norms(optimizer, lambda: [p for _, p in self.named_parameters()], self.param_name)

    # ------------------------------------------------------------------ services for checks
    def param_name(self, param: torch.Tensor) -> str:
        """A parameter's qualified name in the watched model(s), or a positional fallback."""
        return self.watched.param_name(param, self.optimizers)

    @property
    def step_loss(self) -> Optional[float]:
        """The host value of the loss of the step being resolved (None before it is read, or without one)."""
        return self.staging.step_loss

    @property
    def has_optimizer(self) -> bool:
        return self.watched.primary is not None

    def source(self) -> Optional[str]:
        """``file:line`` of the user's code that is running now."""
        m = self.router.memo  # within one dispatch: walked once
        if m is FRESH:
            line = self._line_at(3)
            self.router.memo = (threading.get_ident(), line)  # tagged: another thread's dispatch walks its own
            return line
        if m is not None and m[0] == threading.get_ident():
            return m[1]
        return self._line_at(3)

    @property
    def root_source(self) -> Optional[str]:
        """Source line of the current (outermost) model call in this thread."""
        return getattr(self._tls, "root_source", None)

    # ------------------------------------------------------------------ exit & report
    def on_process_exit(self, reason: str) -> None:
        """At interpreter exit or on a fatal SIGTERM (called by the installer): close (and write), never raise.
        On a SIGTERM that the program's own handler takes over (``"SIGTERM-handled"``): write the report now
        and keep watching until the real exit."""
        try:
            if reason == "SIGTERM-handled":
                self.save()
            else:
                self.close()
        except BaseException:
            pass

    def console(self):
        """The live console (findings as they happen, the summary at close)."""
        con = getattr(self, "_console_obj", None)
        if con is None:
            from .report.console import LiveConsole

            con = self._console_obj = LiveConsole(self.config.live)
        return con

    @property
    def idle(self) -> bool:
        """Nothing seen yet: no step, finding, model call, timeline value or internal error."""
        r = self.record
        return not (self.step or r.findings or r.modules or r.timeline or r.internal_errors)

    def cost(self) -> Dict[str, Any]:
        """Guard's measured cost: ``overhead`` (0.031 = 3.1% of the step time), and under a budget the
        costly checks it sampled and their period."""
        sampled = [c.name for c in self.checks if c.costly] if self.meter.max_period > 1 else []
        return self.meter.to_dict(sampled)

    def report(self) -> Dict[str, Any]:
        """The report dump as a dict (schema ``guard-report/1``), with what is pending resolved first."""
        from .report.model import build_report

        self._resolve_for_reader()
        return build_report(self)

    def save(self) -> Optional[str]:
        """Write the report now, as it stands, and keep watching (``close()`` writes it again). Returns the path."""
        return self._write_report()

    def _write_report(self) -> Optional[str]:
        if os.getpid() != self._pid:
            return None  # a forked copy of a guard started in the parent: the parent writes this report
        from . import _procs

        path = _procs.report_path_for(self)
        if not path:
            return None
        from .report import write_report

        for _ in (1, 2):  # once more: a signal's handler (a DataLoader worker's death) may raise mid-write
            try:
                self.report_path = write_report(self.report(), path)
                self.report_error = None
                return self.report_path
            except Exception as exc:
                self.report_error = f"{type(exc).__name__}: {exc}"
        self.console().internal(f"guard: could not write the report to {path!r}: {self.report_error}")
        return None

    def _finish(self) -> None:
        self._write_report()
        try:
            self.console().summary(self)
        except Exception:
            pass
