"""`Guard`: configuration, lifecycle, hook wiring and the step counter.

The data of a session lives in its `Record` (``g.record``); device values wait in the
`Staging` engine (``guard/staging.py``); events reach the checks through the `Router`
(``guard/router.py``). Renderers in ``guard/report/`` read the record, never the guard.
Hooks and patches are installed only through `guard.hooks.Installer`.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import threading
from time import perf_counter as _clock
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from . import hooks as _hooks
from ._frames import user_source
from ._dist import rank_info as _dist_rank
from .checks import registry
from .checks.base import Check
from .config import Config, ConfigError, make_config
from .findings import ERROR, Finding, GuardError, is_kind, severity_of
from .meter import Meter
from .record import Record
from .router import GuardInternalWarning, Router
from .staging import GradNorms, Staging

MAX_FINDINGS = 1000
MAX_TIMELINE = 4096
MAX_MODULES = 5000

_DP_TYPES: Tuple[type, ...] = (nn.DataParallel, nn.parallel.DistributedDataParallel)
_NO_OUTPUT = object()

__all__ = ["Guard", "GuardInternalWarning", "GradNorms"]


def _as_list(obj: Any, what: str, typ: type, allowed: str) -> List[Any]:
    if obj is None:
        return []
    items = list(obj) if isinstance(obj, (list, tuple)) else [obj]
    for it in items:
        if not isinstance(it, typ):
            raise ConfigError(f"guard: {what}={type(it).__name__} object is not {allowed}; allowed: {allowed}, a list of them, or None")
    return items


class Guard:
    """A runtime guard over a model/optimizer; see ``guard()`` for the arguments."""

    #: a process-wide guard (``TORCH_GUARD=1``): it remembers the rank while the process group lives
    #: and writes its report only if it saw something (a model call, a step, a finding), so helper
    #: processes that merely import torch (compile workers, DataLoader workers) leave no empty dumps
    process_wide: bool = False

    def __init__(self, model: Any = None, optimizer: Any = None, *, checks: Any = "default", mode: Any = "warn",
                 report: Any = None, live: Any = None, every: Any = 1, snoop: Any = False, budget: Any = None,
                 origin: Optional[Dict[str, str]] = None, **extras: Any):
        models = _as_list(model, "model", nn.Module, "an nn.Module")
        opts = _as_list(optimizer, "optimizer", torch.optim.Optimizer, "a torch.optim.Optimizer")
        self._registry = registry()
        self.config: Config = make_config(self._registry, checks=checks, mode=mode, report=report, live=live,
                                          every=every, snoop=snoop, budget=budget, origin=origin,
                                          **extras)
        self._models = [weakref.ref(m) for m in models]
        self._optimizers = [weakref.ref(o) for o in opts]
        self._active = False
        self._closed_once = False
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
        self._module_ids: set = set()  # ids; only gates the one-time module table entry
        self._module_paths: set = set()
        self.router = Router(self)
        self.staging = Staging(self.router.contain, self.flush)
        self._tls = threading.local()
        self._paths_by_id: Dict[int, str] = {}
        self._root_ids: set = set()
        self._paths_weak: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()
        self._roots: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
        self._opt_watch: "weakref.WeakKeyDictionary[torch.optim.Optimizer, bool]" = weakref.WeakKeyDictionary()
        self._seen_optimizers: List[weakref.ref] = list(self._optimizers)
        self._primary: Optional[weakref.ref] = self._optimizers[0] if self._optimizers else None
        self._backward_pending = False
        self._scripted = False  # a TorchScript model runs no Python hooks: own every backward
        self._rank_seen = False
        self._param_names: Dict[int, str] = {}
        self.report_path: Optional[str] = None
        self.report_error: Optional[str] = None
        self._installer = _hooks.Installer()
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
    def timeline(self) -> List[Dict[str, Any]]:
        """Per-step values (loss, gradient norm, learning rate, ...), thinned evenly on long runs."""
        return self.record.timeline

    @property
    def modules(self) -> Dict[str, Dict[str, Any]]:
        """The module table: path -> type, output shape, dtype, device, parameter count."""
        return {m["path"]: m for m in self.record.modules}

    @property
    def notices(self) -> List[str]:
        """What guard cannot see (e.g. under torch.compile), said once each; not findings."""
        return self.record.notices

    @property
    def internal_errors(self) -> List[Dict[str, Any]]:
        """guard's own failures (each check switched off once): check, error, where, step."""
        return self.record.internal_errors

    @property
    def checks(self) -> List[Check]:
        """The active checks (one that failed is switched off and leaves this list)."""
        return self.router.checks

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
    def models(self) -> List[nn.Module]:
        """The watched models (unwrapped from DataParallel/DDP), alive ones only."""
        out = []
        for r in self._models:
            m = r()
            if m is not None:
                out.append(m.module if isinstance(m, _DP_TYPES) else m)
        return out

    @property
    def roots(self) -> List[nn.Module]:
        """The watched models, or under a global guard the outermost modules seen called."""
        return self.models or list(self._roots)

    @property
    def optimizers(self) -> List[torch.optim.Optimizer]:
        """Optimizers given to the guard or seen stepping while it was active."""
        return [o for o in (r() for r in self._seen_optimizers) if o is not None]

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
            self.dispatch("start")
        return self

    def close(self) -> None:
        """Resolve what is pending, remove every hook and patch, write the report. Idempotent."""
        with self._lock:
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
                self._finish()

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

    def _compiled_notice(self, module: nn.Module) -> None:
        self.notice(
            f"guard: {self.path_of(getattr(module, '_orig_mod', module))} runs under torch.compile: module hooks "
            f"added after its first compiled call do not run inside compiled code (and hooks added before are traced "
            f"into it: graph breaks, recompiles). Under compile guard reliably checks the outer call's inputs and "
            f"outputs, losses, gradients and optimizer steps; per-layer checks (NaN origin, BatchNorm, device, "
            f"eval mode) may see nothing. For full checks run a few steps uncompiled under guard.")

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
            old = rec.finding(kind, where)
            if old is not None:
                rec.put(dataclasses.replace(old, count=old.count + 1, last_step=step))
                return None
            if len(rec.findings) >= MAX_FINDINGS:
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
            old = self.record.finding(kind, where)
            if old is None:
                return None
            new = dataclasses.replace(old, details={**old.details, **details})
            self.record.put(new)
            return new

    # ------------------------------------------------------------------ staging (one sync per step)
    def stage(self, value: torch.Tensor, callback: Callable[[float], None]) -> None:
        """Keep a 0-dim device tensor until the step is resolved; then ``callback(host_value)``."""
        self.staging.stage(value, callback)

    def stage_flag(self, ok: torch.Tensor, on_fail: Callable[[], None]) -> None:
        """Keep a 0-dim bool tensor (True = fine); ``on_fail()`` runs at resolution if it is False."""
        self.staging.stage_flag(ok, on_fail)

    def stage_batch(self, collect: Callable[[], List[Tuple[torch.Tensor, Callable[[List[float]], None]]]]) -> None:
        """Register `collect` for this step: at resolution it returns ``[(tensor, callback(values))]``."""
        self.staging.stage_batch(collect)

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

    def forget_grad_norms(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Drop this step's cached norms (the gradients changed in place, e.g. ``GradScaler.unscale_``)."""
        self.staging.forget_grad_norms(optimizer)

    # ------------------------------------------------------------------ services for checks
    def path_of(self, module: nn.Module) -> str:
        """The module's path in its model (``layer4.1.conv2``); the root is its class name."""
        p = self._paths_by_id.get(id(module))
        if p is None:
            p = self._paths_weak.get(module)
            if p is None:
                p = type(module).__name__
        return p

    def known_path(self, module: Any) -> Optional[str]:
        """The path of a module of the watched model(s) (or seen under a global guard), else None."""
        if not isinstance(module, nn.Module):
            return None
        p = self._paths_by_id.get(id(module))
        return p if p is not None else self._paths_weak.get(module)

    def param_name(self, param: torch.Tensor) -> str:
        """A parameter's qualified name in the watched model(s), or a positional fallback."""
        name = self._param_names.get(id(param))
        if name is None:
            for m in self.roots:
                for n, p in m.named_parameters(remove_duplicate=False):
                    self._param_names.setdefault(id(p), n)
            name = self._param_names.get(id(param))
        if name is None:
            for o in self.optimizers:
                for gi, group in enumerate(o.param_groups):
                    for pi, p in enumerate(group["params"]):
                        if p is param:
                            return f"param_groups[{gi}].params[{pi}]"
            return f"param{tuple(param.shape)}"
        return name

    def named_parameters(self) -> List[Tuple[str, nn.Parameter]]:
        """Parameters of the watched models (or of the root modules seen, in global mode)."""
        out, seen = [], set()
        for m in self.roots:
            for n, p in m.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((n, p))
        return out

    @property
    def has_optimizer(self) -> bool:
        return self._primary is not None

    def is_primary(self, optimizer: torch.optim.Optimizer) -> bool:
        return self._primary is not None and self._primary() is optimizer

    def grad_hook(self, param: torch.Tensor, fn: Callable[[torch.Tensor], None]) -> Any:
        """Call ``fn(param)`` each time backward accumulates into `param`'s gradient, until close or the
        returned handle's ``remove()``."""
        return self._installer.grad_hook(param, fn)

    def graph_prehook(self, node: Any, fn: Callable) -> None:
        """Register ``fn`` as a pre-hook of autograd node `node` through the installer (removed on close)."""
        self._installer.graph_prehook(node, fn)

    def replace_attr(self, obj: Any, name: str, value: Any) -> Any:
        """Set ``obj.name = value`` until close or the returned handle's ``remove()`` (then restored)."""
        return self._installer.attr(obj, name, value)

    def source(self) -> Optional[str]:
        """``file:line`` of the user's code that is running now."""
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
                inner = model.module if isinstance(model, _DP_TYPES) else model
                if type(inner).__name__ == "OptimizedModule":
                    self._compiled_notice(inner)
                for path, mod in inner.named_modules():
                    if path.startswith("_orig_mod") and type(inner).__name__ == "OptimizedModule":
                        path = path[len("_orig_mod."):]  # the user's names, not torch.compile's wrapper
                    self._paths_by_id[id(mod)] = path or type(mod).__name__
                self._roots.add(inner)
                self._root_ids.add(id(inner))
                if isinstance(inner, torch.jit.ScriptModule):
                    self._scripted = True
                    self.notice(f"guard: {type(inner).__name__} is a TorchScript module: it runs no Python hooks, "
                                f"so guard checks its losses, gradients and optimizer steps, not its layers.")
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
                    self._opt_watch[opt] = True
                    inst.optimizer_hooks(opt, self._hook_step_pre, self._hook_step_post)
        # Without a given optimizer, any optimizer stepping may be ours (global hooks, filtered).
        if not self._optimizers:
            inst.optimizer_hooks(None, self._hook_step_pre, self._hook_step_post)
        inst.patch("torch.autograd.backward", self._mw_backward)
        for ev, target in router.patch_targets().items():
            try:
                inst.patch(target, router.patch_middleware(ev, lambda: self._active, self._tls, self.meter))
            except (AttributeError, ImportError, ValueError):
                pass  # a target this torch version lacks (private hooks points): the check does without
        inst.process_exit(self)

    # ------------------------------------------------------------------ hooks (hot paths)
    def _hook_pre_global(self, module: nn.Module, args: tuple) -> None:
        t0 = _clock()
        depth = self._push_call(sys._getframe(1))
        if depth == 0:
            if module not in self._paths_weak:
                self._adopt_root(module)
            self._enter_root()
        if self.router.forward_pre and self._active:
            self.router.dispatch_forward_pre(module, args, {}, depth == 0)
        self.meter.own += _clock() - t0

    def _adopt_root(self, module: nn.Module) -> None:
        if isinstance(module, _DP_TYPES):  # paths as in the user's model, without DDP's "module."
            self._paths_weak[module] = type(module).__name__
            module = module.module
        if isinstance(module, _DP_TYPES) or type(module).__name__ == "OptimizedModule":
            if type(module).__name__ == "OptimizedModule":
                self._compiled_notice(module)
            return
        try:
            for path, mod in module.named_modules():
                if path == "" or mod not in self._paths_weak or self._paths_weak[mod] == type(mod).__name__:
                    self._paths_weak[mod] = path or type(mod).__name__
            self._roots.add(module)
        except Exception as exc:
            self.contain(None, exc)

    def _enter_root(self) -> None:
        """An outermost model call starts: remember where it came from."""
        tls = self._tls
        tls.root_source = user_source(3)
        tls.forwards = getattr(tls, "forwards", 0) + 1
        if self._backward_pending:
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
        calls = getattr(self._tls, "calls", None)
        if calls:
            calls.pop()
        self._after_forward(module, args, kwargs, output, not calls)

    def _push_call(self, frame: Any) -> int:
        """Record a module call in flight in this thread (its hook-calling frame); returns how many enclose it.

        A counter would stay raised when a KeyboardInterrupt (any BaseException) leaves a forward, since
        torch then skips the always-called hooks: every later call would look nested. Calls whose frame
        is no longer on this thread's stack are dropped instead (found in a few frame hops per call).
        """
        tls = self._tls
        calls = getattr(tls, "calls", None)
        if calls is None:
            calls = tls.calls = []
        if calls:
            top, f, hops = calls[-1], frame.f_back, 8
            while f is not None and f is not top and hops:
                f, hops = f.f_back, hops - 1
            if f is not top:
                live = set()
                f = frame.f_back
                while f is not None:
                    live.add(id(f))
                    f = f.f_back
                while calls and id(calls[-1]) not in live:
                    calls.pop()
        calls.append(frame)
        return len(calls) - 1

    def _hook_post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self._after_forward(module, args, kwargs, output, id(module) in self._root_ids)

    def _after_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any, is_root: bool) -> None:
        if not self._active:
            return
        t0 = _clock()
        try:
            self._after_forward_timed(module, args, kwargs, output, is_root)
        finally:
            self.meter.own += _clock() - t0

    def _after_forward_timed(self, module: nn.Module, args: tuple, kwargs: dict, output: Any, is_root: bool) -> None:
        first = id(module) not in self._module_ids
        if first:
            self._record_module(module, output)
        self.router.dispatch_forward(module, args, kwargs, output, is_root)
        if first and not is_root and output is not None:
            # A layer no check keeps loses its hooks (model mode): torch's hook-free speed from now on.
            keep_pre, keep_post = self.router.settle(module, output)
            handles = self._mod_handles.get(id(module))
            if handles is not None and id(module) not in self._root_ids:
                if handles[0] is not None and not keep_pre:
                    handles[0].remove()
                if not keep_post:
                    handles[1].remove()

    def _record_module(self, module: nn.Module, output: Any) -> None:
        try:
            self._module_ids.add(id(module))
            if len(self._module_paths) >= MAX_MODULES:
                return
            path = self.path_of(module)
            if path in self._module_paths:
                return
            from .tensors import first_tensor

            t = first_tensor(output)
            self._module_paths.add(path)
            self.record.add_module({
                "path": path,
                "type": type(module).__name__,
                "output_shape": list(t.shape) if t is not None and not t.is_nested else None,
                "dtype": str(t.dtype) if t is not None else None,
                "device": str(t.device) if t is not None else None,
                "params": sum(p.numel() for p in module.parameters(recurse=True)),
            })
        except Exception as exc:
            self.contain(None, exc)

    def _watches_optimizer(self, opt: torch.optim.Optimizer) -> bool:
        known = self._opt_watch.get(opt)
        if known is None:
            models = self.models
            if not models:
                known = True
            else:
                ids = {id(p) for m in models for p in m.parameters()}
                known = any(id(p) in ids for g in opt.param_groups for p in g["params"])
            self._opt_watch[opt] = known
            if known:
                if all(r() is not opt for r in self._seen_optimizers):
                    self._seen_optimizers.append(weakref.ref(opt))
                if self._primary is None or self._primary() is None:
                    if self._primary is None and self.step:
                        self._renumber_to_first_step()
                    self._primary = weakref.ref(opt)
                    self._backward_pending = False
        return known

    def _renumber_to_first_step(self) -> None:
        """The first optimizer step arrives after several backward() calls (gradient accumulation
        under a global guard): they were all part of step 0, not steps of their own."""
        self.step = 0
        self.sampling = True
        rec = self.record
        rec.findings[:] = [dataclasses.replace(f, step=0, last_step=0) for f in rec.findings]
        merged: Dict[str, Any] = {"step": 0}
        for entry in rec.timeline:
            merged.update({k: v for k, v in entry.items() if k != "step"})
        rec.timeline = [merged] if len(merged) > 1 else []

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
        if self.step == 0 and self._models and not self._module_ids and not self._scripted and "torch._dynamo" in sys.modules:
            self.notice("guard: optimizer steps ran but no call of the watched model was seen: if it runs through "
                        "a torch.compile'd wrapper (compiled code skips module hooks), guard that compiled module "
                        "instead; until then only gradients and parameters are checked.")
        if self.process_wide and not self._rank_seen:  # the rank, while the process group lives (dumps come at exit)
            self._rank_seen = _dist_rank() is not None
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
        if self._primary is None:
            self._end_step()

    def _mw_backward(self, call: Callable, args: tuple, kwargs: dict) -> Any:
        tls = self._tls
        if not self._active or getattr(tls, "in_backward", False) or (self._models and not self._scripted and not getattr(tls, "forwards", 0)):
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
                if self._primary is None:
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
    def _on_process_exit(self, reason: str) -> None:
        try:
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

    def _finish(self) -> None:
        path = self.config.report
        if path and not (self.process_wide and self.idle):
            from ._dist import rank_report_path

            path = rank_report_path(path)  # one dump per rank: report.rank{N}.json
            from .report import write_report

            try:
                self.report_path = write_report(self.report(), path)
            except Exception as exc:
                self.report_error = f"{type(exc).__name__}: {exc}"
                self.console().internal(f"guard: could not write the report to {path!r}: {self.report_error}")
        try:
            self.console().summary(self)
        except Exception:
            pass
