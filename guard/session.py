"""`Guard`: configuration, lifecycle, hook wiring and the step counter.

The data of a session lives in its `Record` (``g.record``); device values wait in the
`Staging` engine (``guard/staging.py``); events reach the checks through the `Router`
(``guard/router.py``). Renderers in ``guard/report/`` read the record, never the guard.
Hooks and patches are installed only through `guard.hooks.Installer`.
"""
from __future__ import annotations

import functools
import os
import sys
import threading
import time
from time import perf_counter as _clock
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from . import hooks as _hooks
from ._frames import user_source
from .callstack import pop_call, push_call
from ._dist import rank_info as _dist_rank
from .checks import registry
from .checks.base import Check
from .config import Config, ConfigError, as_list, make_config
from .findings import ERROR, Finding, GuardError, is_kind, severity_of
from .meter import Meter
from .record import Record
from .router import GuardInternalWarning, Router
from .staging import GradNorms, Staging
from .watched import Watched

MAX_FINDINGS = 1000
MAX_TIMELINE = 4096

_NO_OUTPUT = object()

__all__ = ["Guard", "GuardInternalWarning", "GradNorms"]


def _delegate(part: str, name: str, doc: str) -> property:
    """A read-only property: ``self.<part>.<name>``."""
    return property(lambda self: getattr(getattr(self, part), name), doc=doc)


class Guard:
    """A runtime guard over a model/optimizer; see ``guard()`` for the arguments."""

    def __init__(self, model: Any = None, optimizer: Any = None, *, checks: Any = "default", mode: Any = "warn",
                 report: Any = None, live: Any = None, every: Any = 1, snoop: Any = False, budget: Any = None,
                 origin: Optional[Dict[str, str]] = None, **extras: Any):
        models = as_list(model, "model", nn.Module, "an nn.Module")
        opts = as_list(optimizer, "optimizer", torch.optim.Optimizer, "a torch.optim.Optimizer")
        self._registry = registry()
        self.config: Config = make_config(self._registry, checks=checks, mode=mode, report=report, live=live,
                                          every=every, snoop=snoop, budget=budget, origin=origin,
                                          **extras)
        self._models = [weakref.ref(m) for m in models]  # never keep the user's model or optimizer alive
        self._optimizers = [weakref.ref(o) for o in opts]
        self._active = False
        self._paused = False  # a background guard stepping aside for a guard from the code
        self._closed_once = False
        self._pid = os.getpid()  # a forked copy (another pid) never writes this guard's report
        self._lock = threading.RLock()
        self._reset()

    # ------------------------------------------------------------------ state
    def _reset(self) -> None:
        self.step = 0
        self.sampling = True
        self._mid_step = False
        #: whether the costly checks (`Check.costly`) run this step: always, unless a budget samples them
        self.costly_step = True
        self.meter = Meter(self.config.budget)
        self.record = Record()
        self.router = Router(self)
        self.staging = Staging(self.router.contain, self.flush)
        self.watched = w = Watched(self._models, self._optimizers, self.notice, self.router.contain)
        self._root_ids, self._paths_weak = w.root_ids, w.paths_weak  # read on every module call
        # services for checks (see CheckContext), bound once
        self.path_of, self.known_path, self.named_parameters = w.path_of, w.known_path, w.named_parameters
        self.stage, self.stage_flag, self.stage_batch = self.staging.stage, self.staging.stage_flag, self.staging.stage_batch
        self.forget_grad_norms = self.staging.forget_grad_norms
        self._tls = threading.local()
        self.is_primary = w.is_primary
        self._backward_pending = False
        self.report_path: Optional[str] = None
        self.report_error: Optional[str] = None
        self.processes: List[Dict[str, Any]] = []  # other processes' dumps of this run (background guard)
        self._rank_known = False
        self.started_at = 0.0  # time.time() of start()
        self._installer = inst = _hooks.Installer()
        self.grad_hook, self.graph_prehook, self.replace_attr = inst.grad_hook, inst.graph_prehook, inst.attr
        self._mod_handles: Dict[int, Tuple[Any, Any]] = {}  # id(module) -> (pre, post) hook handles (model mode)

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
        self._build_checks()
        self.dispatch("start")
        self.started_at = time.time()
        # forked children leave through os._exit (no atexit): multiprocessing's own exit runs this
        multiprocessing.util.Finalize(None, self.on_process_exit, args=("exit",), exitpriority=100)

    def __enter__(self) -> "Guard":
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc is not None:
            self.exception(exc)
            try:
                self.close()
            except GuardError:
                pass  # the user's exception is the one to see
        else:
            self.close()
        return False

    def exception(self, exc: BaseException) -> None:
        """Tell the checks that `exc` escaped the guarded code (they may explain it); never raises."""
        try:
            self.dispatch("exception", exc)
        except GuardError:
            pass  # the user's exception propagates unchanged (raise mode included)

    def __call__(self, fn: Callable) -> Callable:
        """Use the guard as a decorator: the function runs under it, each call anew."""
        if not callable(fn):
            raise ConfigError(f"guard: cannot decorate {type(fn).__name__}; allowed: a function")

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

    def contain(self, check: Optional[Check], exc: BaseException) -> None:
        """`check` (or guard itself, None) failed: switch it off, say so once, keep training going."""
        self.router.contain(check, exc)

    def notice(self, message: str) -> None:
        """Say once (stderr and the dump's ``notices``) what guard cannot check; not a finding."""
        if message not in self.record.notices:
            self.record.notices.append(message)
            self.console().internal(message)

    # ------------------------------------------------------------------ findings
    def emit(self, kind: str, where: str, message: str, hint: str, *, check: Optional[Check] = None,
             step: Optional[int] = None, source: Optional[str] = None, details: Optional[Dict[str, Any]] = None,
             severity: Optional[str] = None) -> Optional[Finding]:
        """Record a finding; the first of each (kind, where) is reported, later ones are counted."""
        if not is_kind(kind):
            raise ValueError(f"unknown finding kind {kind!r}")
        if kind not in self.config.kinds:
            return None
        step = self.step if step is None else step
        rec = self.record
        with self._lock:
            if rec.repeat(kind, where, step) or len(rec.findings) >= MAX_FINDINGS:
                return None
            details = dict(details or {})
            if _dist_rank() is not None:
                details.setdefault("rank", _dist_rank()[0])
            finding = Finding(kind=kind, severity=severity or severity_of(kind), message=message, hint=hint,
                              where=where, step=step, count=1, source=source, details=details,
                              last_step=step)
            rec.put(finding)
        self.console().finding(finding)
        if self.config.mode == "raise" and finding.severity == ERROR:
            raise GuardError(finding)
        return finding

    def update_details(self, kind: str, where: str, **details: Any) -> Optional[Finding]:
        """Merge `details` into the recorded (kind, where) finding (e.g. a trace captured later)."""
        with self._lock:
            return self.record.update_details(kind, where, details)

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
        return self.staging.grad_norms(optimizer, lambda: [p for _, p in self.named_parameters()], self.param_name)

    # ------------------------------------------------------------------ services for checks
    def param_name(self, param: torch.Tensor) -> str:
        """A parameter's qualified name in the watched model(s), or a positional fallback."""
        return self.watched.param_name(param, self.optimizers)

    @property
    def has_optimizer(self) -> bool:
        return self.watched.primary is not None

    def source(self) -> Optional[str]:
        """``file:line`` of the user's code that is running now."""
        m = self.router.memo
        if m is not None and m[0] == threading.get_ident():  # within one dispatch: walked once
            if not m[2]:
                m[1], m[2] = user_source(2), True
            return m[1]
        return user_source(2)

    @property
    def root_source(self) -> Optional[str]:
        """Source line of the current (outermost) model call in this thread."""
        return getattr(self._tls, "root_source", None)

    # ------------------------------------------------------------------ installation
    def _install(self) -> None:
        inst = self._installer
        router = self.router
        if self._models:
            # Per-module pre-hooks only when a check needs them; roots always get one (the
            # model call's source line, step bookkeeping). Post-hooks fill the module table.
            every_pre = bool(router.forward_pre)
            for mref in self._models:
                model = mref()
                if model is None:
                    continue
                inner = self.watched.index(model)
                for mod in dict.fromkeys(m for _, m in inner.named_modules()):
                    if isinstance(mod, torch.jit.ScriptModule):
                        continue  # register_forward_*hook raises on ScriptModules
                    wanted = mod is inner or (every_pre and router.nonroot(router.pre_for, router.forward_pre, mod))
                    handles = inst.module_hooks(mod, self._hook_pre if wanted else None, self._hook_post)
                    if mod is not inner and id(mod) not in self._mod_handles:
                        self._mod_handles[id(mod)] = (handles[0] if wanted else None, handles[-1])
        else:
            inst.global_module_hooks(self._hook_pre_global, self._hook_post_global)
        if self._optimizers:
            for oref in self._optimizers:
                opt = oref()
                if opt is not None:
                    inst.optimizer_hooks(opt, self._hook_step_pre, self._hook_step_post)
        # Without a given optimizer, any optimizer stepping may be ours (global hooks, filtered).
        if not self._optimizers:
            inst.optimizer_hooks(None, self._hook_step_pre, self._hook_step_post)
        inst.patch("torch.autograd.backward", self._mw_backward)
        by_target: Dict[str, List[str]] = {}  # one wrapper layer per target, whatever the number of checks on it
        for ev, target in router.patch_targets().items():
            by_target.setdefault(target, []).append(ev)
        for target, evs in by_target.items():
            try:
                inst.patch(target, router.patch_middleware(tuple(evs), lambda: self._active, self._tls, self.meter))
            except (AttributeError, ImportError, ValueError):
                pass  # a target this torch version lacks (private hooks points): the check does without
        inst.process_exit(self)

    # ------------------------------------------------------------------ hooks (hot paths)
    def _hook_pre_global(self, module: nn.Module, args: tuple) -> None:
        t0 = _clock()
        depth = push_call(self._tls, sys._getframe(1))
        if depth == 0:
            if module not in self._paths_weak:
                self.watched.adopt_root(module)
            self._enter_root()
        if self.router.forward_pre and self._active:
            self.router.dispatch_forward_pre(module, args, {}, depth == 0)
        self.meter.own += _clock() - t0

    def _enter_root(self) -> None:
        """An outermost model call starts: remember where it came from."""
        tls = self._tls
        tls.root_source = user_source(3)
        tls.forwards = getattr(tls, "forwards", 0) + 1
        if self._backward_pending and self._active:
            self._advance_backward_step()

    def _hook_pre(self, module: nn.Module, args: tuple, kwargs: Optional[dict]) -> None:
        t0 = _clock()
        is_root = id(module) in self._root_ids
        if is_root:
            self._enter_root()
        if self.router.forward_pre and self._active:
            self.router.dispatch_forward_pre(module, args, kwargs or {}, is_root)
        self.meter.own += _clock() - t0

    def _hook_post_global(self, module: nn.Module, args: tuple, kwargs: dict, output: Any = _NO_OUTPUT) -> None:
        if output is _NO_OUTPUT:  # forward raised: torch calls always_call global hooks as (module, args, result)
            kwargs, output = {}, kwargs
        self._after_forward(module, args, kwargs, output, pop_call(self._tls))

    def _hook_post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self._after_forward(module, args, kwargs, output, id(module) in self._root_ids)

    def _after_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any, is_root: bool) -> None:
        if not self._active:
            return
        t0 = _clock()
        first = id(module) not in self.watched.module_ids
        if first:
            self.watched.record_module(module, output, self.record)
        r = self.router
        handlers = r.forward if is_root else r.nonroot(r.post_for, r.forward, module)
        try:
            if handlers:
                r.dispatch_forward(handlers, module, args, kwargs, output, is_root)
            if first and not is_root and output is not None:
                # A layer no check keeps loses its hooks (model mode): torch's hook-free speed from now on.
                keep_pre, keep_post = self.router.settle(module, output)
                handles = self._mod_handles.get(id(module))
                if handles is not None and id(module) not in self._root_ids:
                    if handles[0] is not None and not keep_pre:
                        handles[0].remove()
                    if not keep_post:
                        handles[1].remove()
        finally:
            self.meter.own += _clock() - t0

    def _watches_optimizer(self, opt: torch.optim.Optimizer) -> bool:
        known, became = self.watched.watch_optimizer(opt)
        if became is not None:
            if became and self.step:
                self._renumber_to_first_step()
            self._backward_pending = False
        return known

    def _renumber_to_first_step(self) -> None:
        """The first optimizer step arrives after several backward() calls (gradient accumulation
        under a global guard): they were all part of step 0, not steps of their own."""
        self.step = 0
        self.sampling = True
        self.record.restart_at_step_zero()

    def _hook_step_pre(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if not self._active or not self._watches_optimizer(opt):
            return
        t0 = _clock()
        try:
            self.dispatch("step_pre", opt)
            if self.is_primary(opt):
                self._resolve()
        except GuardError:
            raise
        except Exception as exc:
            self.contain(None, exc)
        finally:
            self.meter.own += _clock() - t0

    def _hook_step_post(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if not self._active or not self._watches_optimizer(opt):
            return
        t0 = _clock()
        try:
            self.dispatch("step_post", opt)
            if self.is_primary(opt):
                self._end_step(t0)
        except GuardError:
            raise
        except Exception as exc:
            self.contain(None, exc)

    def skipped_step(self, optimizer: torch.optim.Optimizer) -> None:
        """An AMP ``GradScaler`` skipped ``optimizer.step()`` (inf/NaN grads): end the step without step hooks.

        The step still counts (step numbers follow the training loop) and is marked ``skipped`` in
        the timeline; its scaled, non-finite gradient norms are dropped.
        """
        if not self._active or not self._watches_optimizer(optimizer) or not self.is_primary(optimizer):
            return
        try:
            self.staging.forget_grad_norms(optimizer)
            self.timeline_note(skipped=True)
            self._resolve()
            self._end_step()
        except GuardError:
            raise
        except Exception as exc:
            self.contain(None, exc)

    def _end_step(self, t0: Optional[float] = None) -> None:
        self._tls.forwards = 0  # forwards combined into one loss leave a surplus; a step settles it
        if self.step == 0 and self._models and not self.watched.module_ids and not self.watched.scripted and "torch._dynamo" in sys.modules:
            self.notice("guard: optimizer steps ran but no call of the watched model was seen: if it runs through "
                        "a torch.compile'd wrapper (compiled code skips module hooks), guard that compiled module "
                        "instead; until then only gradients and parameters are checked.")
        self.dispatch("step_end", self.step)
        meter = self.meter
        if t0 is not None:
            meter.own += _clock() - t0
        meter.end_step(self.step)
        self.step += 1
        self.sampling = self.step % self.config.every == 0
        self.costly_step = meter.costly_step(self.step)

    def _advance_backward_step(self) -> None:
        """Without an optimizer a backward() ends the step; advance lazily at the next forward/backward."""
        self._backward_pending = False
        if self.watched.primary is None:
            self._end_step()

    def _mw_backward(self, call: Callable, args: tuple, kwargs: dict) -> Any:
        tls = self._tls
        if not self._active or getattr(tls, "in_backward", False) or (self._models and not self.watched.scripted and not getattr(tls, "forwards", 0)):
            return call(*args, **kwargs)
        tensors = args[0] if args else kwargs.get("tensors")
        tls.in_backward = True
        t0 = _clock()
        try:
            try:
                if self._backward_pending:
                    self._advance_backward_step()
                tls.root_source = user_source(2)
                if self.sampling:
                    self.staging.add_loss(tensors)
                self.dispatch("backward", tensors, kwargs)
            except GuardError:
                raise
            except Exception as exc:
                self.contain(None, exc)
            self.meter.own += _clock() - t0
            result = call(*args, **kwargs)
            t0 = _clock()
            try:
                self.dispatch("backward_done", tensors, kwargs)
                if self.watched.primary is None:
                    if self.sampling:
                        self._resolve()
                    self._backward_pending = True
            except GuardError:
                raise
            except Exception as exc:
                self.contain(None, exc)
            return result
        finally:
            self.meter.own += _clock() - t0
            tls.in_backward = False
            # A model guard owns a backward only while its model has forwards not yet back-propagated
            # in this thread (two forwards, two backwards: both are ours; another model's: not).
            tls.forwards = max(0, getattr(tls, "forwards", 0) - 1)

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
