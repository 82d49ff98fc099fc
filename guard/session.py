"""`Guard`: configuration, lifecycle, event routing, the step counter and the findings store.

The session is the data model; renderers in ``guard/report/`` read it and never
the other way round. Hooks and patches are installed only through
`guard.hooks.Installer`.
"""
from __future__ import annotations

import functools
import sys
import threading
import traceback
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import hooks as _hooks
from ._frames import user_source
from ._dist import rank_info as _dist_rank
from .checks import registry
from .checks.base import Check
from .config import Config, ConfigError, make_config
from .findings import ERROR, KINDS, Finding, GuardError, severity_of
from .tensors import Norms

MAX_FINDINGS = 1000
MAX_TIMELINE = 4096
MAX_MODULES = 5000
MAX_STAGED = 8192

_DP_TYPES: Tuple[type, ...] = (nn.DataParallel, nn.parallel.DistributedDataParallel)
_VALUE, _FLAG, _FINITE, _BATCH = 0, 1, 2, 3
_NO_OUTPUT = object()


class GuardInternalWarning(RuntimeWarning):
    """guard's own failure: a check raised and was switched off; training is unaffected."""


def _as_list(obj: Any, what: str, typ: type, allowed: str) -> List[Any]:
    if obj is None:
        return []
    items = list(obj) if isinstance(obj, (list, tuple)) else [obj]
    for it in items:
        if not isinstance(it, typ):
            raise ConfigError(f"guard: {what}={type(it).__name__} object is not {allowed}; allowed: {allowed}, a list of them, or None")
    return items


class GradNorms:
    """Per-parameter gradient norms of one step, kept on the device until the step is resolved."""

    __slots__ = ("params", "totals", "stacked", "_all", "_namer", "_names")

    def __init__(self, params: List[torch.Tensor], namer: Callable[[torch.Tensor], str]):
        self.params, self._namer, self._names = params, namer, None
        with torch.no_grad():
            self._all = Norms([p.grad for p in params], key=tuple(map(id, params)))
        self.totals, self.stacked = self._all.totals, self._all.stacked

    @property
    def norms(self) -> List[torch.Tensor]:
        """0-dim norm per parameter (made on first use)."""
        return self._all.norms

    @property
    def names(self) -> List[str]:
        """Parameter names, computed on first use (only needed once something fired)."""
        if self._names is None:
            self._names = [self._namer(p) for p in self.params]
        return self._names

    def per_param(self) -> List[float]:
        """Host values of every norm (one sync; call only after something fired)."""
        if not self.norms:
            return []
        return [float(v) for v in torch.stack([n.float().cpu() for n in self.norms]).tolist()]


class Guard:
    """A runtime guard over a model/optimizer; see ``guard()`` for the arguments."""

    def __init__(self, model: Any = None, optimizer: Any = None, *, checks: Any = "default", mode: Any = "warn",
                 report: Any = None, live: Any = None, every: Any = 1, snoop: Any = False,
                 origin: Optional[Dict[str, str]] = None, **extras: Any):
        models = _as_list(model, "model", nn.Module, "an nn.Module")
        opts = _as_list(optimizer, "optimizer", torch.optim.Optimizer, "a torch.optim.Optimizer")
        self._registry = registry()
        self.config: Config = make_config(self._registry, checks=checks, mode=mode, report=report, live=live,
                                          every=every, snoop=snoop, origin=origin, **extras)
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
        self._findings: Dict[Tuple[str, str], Finding] = {}
        self.internal_errors: List[Dict[str, Any]] = []
        self.notices: List[str] = []  # what guard cannot see (e.g. under torch.compile), said once each
        self.timeline: List[Dict[str, Any]] = []
        self._timeline_stride = 1
        self.modules: Dict[str, Dict[str, Any]] = {}
        self._modules_seen: set = set()  # ids; only gates the one-time module table entry
        self._staged: List[Tuple[torch.Tensor, Callable, int]] = []  # (tensor, callback, _VALUE/_FLAG/_FINITE)
        self._collectors: List[Callable[[], List[Tuple[torch.Tensor, Callable[[List[float]], None]]]]] = []
        self._step_loss: Optional[torch.Tensor] = None
        self._grad_norms: Dict[int, GradNorms] = {}
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
        self._param_names: Dict[int, str] = {}
        self.checks: List[Check] = []
        self._handlers: Dict[str, List[Tuple[Check, Callable]]] = {}
        self.report_path: Optional[str] = None
        self.report_error: Optional[str] = None
        self._installer = _hooks.Installer()
        self._mod_handles: Dict[int, Tuple[Any, Any]] = {}  # id(module) -> (pre, post) hook handles (model mode)
        self._pre_for: Dict[int, Tuple[Any, list]] = {}
        self._post_for: Dict[int, Tuple[Any, list]] = {}

    # ------------------------------------------------------------------ public API
    @property
    def findings(self) -> List[Finding]:
        """Findings in the order they were first seen (repeats bump ``count``)."""
        return list(self._findings.values())

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
                m = m.module if isinstance(m, _DP_TYPES) else m
                if type(m).__name__ == "OptimizedModule":  # torch.compile's wrapper: the user's names
                    m = m._orig_mod
                out.append(m)
        return out

    @property
    def optimizers(self) -> List[torch.optim.Optimizer]:
        """Optimizers given to the guard or seen stepping while it was active."""
        return [o for o in (r() for r in self._seen_optimizers) if o is not None]

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
            self._dispatch("start")
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
                    self._dispatch("exit")
            finally:
                self._active = False
                self._closed_once = True
                self._installer.close()
                self._staged = []
                self._grad_norms = {}
                self._step_loss = None
                self._finish()

    def __enter__(self) -> "Guard":
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc is not None:
            try:
                self._dispatch("exception", exc)
            except GuardError:
                pass  # the user's exception propagates unchanged (raise mode included)
            try:
                self.close()
            except GuardError:
                pass  # the user's exception is the one to see
        else:
            self.close()
        return False

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
        return f"<Guard {state} step={self.step} findings={len(self._findings)} mode={self.config.mode}>"

    # ------------------------------------------------------------------ checks & routing
    def _build_checks(self) -> None:
        kinds = self.config.kinds
        self.checks = [cls(self) for cls in self._registry.values() if set(cls.kinds) & kinds]
        self._rebuild_handlers()

    def _rebuild_handlers(self) -> None:
        handlers: Dict[str, List[Tuple[Check, Callable]]] = {}
        for check in self.checks:
            for ev in check.events():
                handlers.setdefault(ev, []).append((check, getattr(check, "on_" + ev)))
        self._handlers = handlers
        self._h_forward_pre = handlers.get("forward_pre", [])
        self._h_forward = handlers.get("forward", [])
        # Per module, the handlers of checks that watch it in non-root calls (Check.watches), narrowed
        # after its first call to those that keep it (Check.steady). A check switched off leaves them.
        active = set(map(id, self.checks))
        for name in ("_pre_for", "_post_for"):
            cache = getattr(self, name, None) or {}
            setattr(self, name, {k: (ref, [h for h in hs if id(h[0]) in active]) for k, (ref, hs) in cache.items()})

    def handles(self, event: str) -> bool:
        return bool(self._handlers.get(event))

    def _dispatch(self, event: str, *args: Any) -> None:
        for check, fn in self._handlers.get(event, ()):
            try:
                fn(*args)
            except GuardError:
                raise
            except Exception as exc:
                self._contain(check, exc)

    def _contain(self, check: Optional[Check], exc: BaseException) -> None:
        """A check (or guard itself) failed: switch it off, say so once, keep training going."""
        name = check.name if check is not None else "guard"
        if check is not None and check in self.checks:
            self.checks = [c for c in self.checks if c is not check]
            self._rebuild_handlers()
        if any(e["check"] == name for e in self.internal_errors):
            return
        tb = traceback.extract_tb(exc.__traceback__)
        at = f"{tb[-1].filename}:{tb[-1].lineno}" if tb else "?"
        first = (str(exc).strip().splitlines() or [""])[0][:300]  # torch errors can run to 100 lines
        entry = {"check": name, "error": f"{type(exc).__name__}: {first}", "at": at, "step": self.step}
        self.internal_errors.append(entry)
        msg = (f"guard: internal error in check {name!r} ({entry['error']} at {at}); "
               f"the check is switched off, training continues")
        warnings.warn(msg, GuardInternalWarning, stacklevel=2)
        self._console().internal(msg)

    def notice(self, message: str) -> None:
        """Say once (stderr and the dump's ``notices``) what guard cannot check; not a finding."""
        if message not in self.notices:
            self.notices.append(message)
            self._console().internal(message)

    def _compiled_notice(self, module: nn.Module) -> None:
        self.notice(
            f"guard: {self.path_of(getattr(module, '_orig_mod', module))} runs under torch.compile: guard checks it at "
            f"the compiled call's boundary (its inputs and outputs, the loss, gradients, parameters and optimizer "
            f"steps) and stays out of the compiled code (no graph break, no recompile); checks of the layers inside "
            f"(NaN origin, BatchNorm, device, eval mode) do not run there. For full checks run a few steps uncompiled "
            f"under guard.")

    # ------------------------------------------------------------------ findings
    def emit(self, kind: str, where: str, message: str, hint: str, *, check: Optional[Check] = None,
             step: Optional[int] = None, source: Optional[str] = None, details: Optional[Dict[str, Any]] = None,
             severity: Optional[str] = None) -> Optional[Finding]:
        """Record a finding; the first of each (kind, where) is reported, later ones are counted."""
        if kind not in KINDS:
            raise ValueError(f"unknown finding kind {kind!r}")
        if kind not in self.config.kinds:
            return None
        step = self.step if step is None else step
        key = (kind, where)
        with self._lock:
            old = self._findings.get(key)
            if old is not None:
                import dataclasses

                self._findings[key] = dataclasses.replace(old, count=old.count + 1, last_step=step)
                return None
            if len(self._findings) >= MAX_FINDINGS:
                return None
            details = dict(details or {})
            if _dist_rank() is not None:
                details.setdefault("rank", _dist_rank()[0])
            finding = Finding(kind=kind, severity=severity or severity_of(kind), message=message, hint=hint,
                              where=where, step=step, count=1, source=source, details=details,
                              last_step=step)
            self._findings[key] = finding
        self._console().finding(finding)
        if self.config.mode == "raise" and finding.severity == ERROR:
            raise GuardError(finding)
        return finding

    def update_details(self, kind: str, where: str, **details: Any) -> Optional[Finding]:
        """Merge `details` into the recorded (kind, where) finding (e.g. a trace captured later)."""
        import dataclasses

        with self._lock:
            old = self._findings.get((kind, where))
            if old is None:
                return None
            new = dataclasses.replace(old, details={**old.details, **details})
            self._findings[(kind, where)] = new
            return new

    # ------------------------------------------------------------------ staging (one sync per step)
    def stage(self, value: torch.Tensor, callback: Callable[[float], None]) -> None:
        """Keep a 0-dim device tensor until the step is resolved; then ``callback(host_value)``."""
        self._staged.append((value, callback, _VALUE))
        if len(self._staged) > MAX_STAGED:
            self._resolve()

    def stage_flag(self, ok: torch.Tensor, on_fail: Callable[[], None]) -> None:
        """Keep a 0-dim bool tensor (True = fine); ``on_fail()`` runs at resolution if it is False."""
        self._staged.append((ok, on_fail, _FLAG))
        if len(self._staged) > MAX_STAGED:
            self._resolve()

    def stage_finite(self, value: torch.Tensor, on_fail: Callable[[], None]) -> None:
        """Keep a 0-dim tensor (e.g. a sum); ``on_fail()`` runs at resolution if it is NaN/Inf.

        Cheaper than `stage_flag` with ``torch.isfinite``: the test runs once, batched, at resolution.
        """
        self._staged.append((value, on_fail, _FINITE))
        if len(self._staged) > MAX_STAGED:
            self._resolve()

    def stage_batch(self, collect: Callable[[], List[Tuple[torch.Tensor, Callable[[List[float]], None]]]]) -> None:
        """Register `collect` for this step: at resolution it returns ``[(tensor, callback(values))]``.

        For checks that gather many device values per step themselves: they stack once, at the end,
        instead of staging each value (the cheapest path for per-module-call values).
        """
        self._collectors.append(collect)

    def flush(self) -> None:
        """Resolve staged device values now (bounded memory when steps are rare or absent)."""
        self._resolve()

    def _resolve(self) -> None:
        """Read every staged value with one transfer per device, run callbacks, then ``resolved``."""
        staged, self._staged = self._staged, []
        collectors, self._collectors = self._collectors, []
        for collect in collectors:
            try:
                staged.extend((t, cb, _BATCH) for t, cb in collect())
            except GuardError:
                raise
            except Exception as exc:
                owner = getattr(collect, "__self__", None)
                self._contain(owner if isinstance(owner, Check) else None, exc)
        loss, self._step_loss = self._step_loss, None
        norms, self._grad_norms = self._grad_norms, {}
        entry: Dict[str, Any] = {}
        if loss is not None:
            staged.append((loss, lambda v: entry.__setitem__("loss", v), _VALUE))
        totals: List[float] = []
        for gn in norms.values():
            for t in gn.totals.values():
                staged.append((t, totals.append, _VALUE))
        if staged:
            values = self._read(staged)
            for (t, cb, kind), v in zip(staged, values):
                try:
                    if kind == _VALUE or kind == _BATCH:
                        cb(v)
                    elif not v:
                        cb()
                except GuardError:
                    raise
                except Exception as exc:
                    owner = getattr(cb, "__self__", None)
                    self._contain(owner if isinstance(owner, Check) else None, exc)
        if totals:
            entry["grad_norm"] = float(sum(t * t for t in totals) ** 0.5)
        if entry:
            entry["step"] = self.step
            self._add_timeline(entry)
        self._dispatch("resolved")

    @staticmethod
    def _read(staged: Sequence[Tuple[torch.Tensor, Any, int]]) -> List[Any]:
        """Host values of all staged tensors: batched per device and kind, one transfer per device.

        0-dim entries give a float each, `_BATCH` entries a list of floats.
        """
        groups: Dict[torch.device, Tuple[List[int], List[int], List[int], List[int]]] = {}
        for i, (t, _, kind) in enumerate(staged):
            groups.setdefault(t.device, ([], [], [], []))[kind].append(i)
        out: List[Any] = [0.0] * len(staged)
        for lists in groups.values():
            parts: List[torch.Tensor] = []
            spans: List[Tuple[int, int, int]] = []  # (entry, start, length); length -1: a scalar
            pos = 0
            for kind, idx in enumerate(lists):
                if not idx:
                    continue
                if kind == _BATCH:
                    for i in idx:
                        v = staged[i][0].detach().reshape(-1).to(torch.float32)
                        parts.append(v)
                        spans.append((i, pos, v.numel()))
                        pos += v.numel()
                    continue
                ts = torch.stack([staged[i][0].detach().reshape(()) for i in idx])
                if kind == _FINITE:
                    ts = torch.isfinite(ts)
                parts.append(ts.to(torch.float32))
                for i in idx:
                    spans.append((i, pos, -1))
                    pos += 1
            vals = (torch.cat(parts) if len(parts) > 1 else parts[0]).tolist()
            for i, start, n in spans:
                out[i] = vals[start] if n < 0 else vals[start:start + n]
        return out

    def _add_timeline(self, entry: Dict[str, Any]) -> None:
        if entry["step"] % self._timeline_stride:
            return
        if self.timeline and self.timeline[-1]["step"] == entry["step"]:
            self.timeline[-1].update(entry)
            return
        self.timeline.append(entry)
        if len(self.timeline) > MAX_TIMELINE:  # downsample, never drop the whole history
            self._timeline_stride *= 2
            self.timeline = [e for e in self.timeline if e["step"] % self._timeline_stride == 0]

    def timeline_note(self, **values: Any) -> None:
        """Add values (e.g. ``skipped=True``, ``lr=...``) to the current step's timeline entry."""
        if self.timeline and self.timeline[-1]["step"] == self.step:
            self.timeline[-1].update(values)
        else:
            self._add_timeline({"step": self.step, **values})

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
            self._index_params()
            name = self._param_names.get(id(param))
        if name is None:
            for o in self.optimizers:
                for gi, group in enumerate(o.param_groups):
                    for pi, p in enumerate(group["params"]):
                        if p is param:
                            return f"param_groups[{gi}].params[{pi}]"
            return f"param{tuple(param.shape)}"
        return name

    def _index_params(self) -> None:
        roots = self.models or list(self._roots)
        for m in roots:
            for n, p in m.named_parameters(remove_duplicate=False):
                self._param_names.setdefault(id(p), n)

    def named_parameters(self) -> List[Tuple[str, nn.Parameter]]:
        """Parameters of the watched models (or of the root modules seen, in global mode)."""
        out, seen = [], set()
        for m in (self.models or list(self._roots)):
            for n, p in m.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((n, p))
        return out

    def grad_norms(self, optimizer: Optional[torch.optim.Optimizer] = None) -> GradNorms:
        """This step's gradient norms (fused ``_foreach_norm``), computed once per optimizer and step."""
        key = id(optimizer)
        gn = self._grad_norms.get(key)
        if gn is None:
            if optimizer is not None:
                params = [p for g in optimizer.param_groups for p in g["params"]]
            else:
                params = [p for _, p in self.named_parameters()]
            strided = torch.strided
            params = [p for p in params if (gr := p.grad) is not None and gr.layout is strided and not gr.is_meta]
            gn = GradNorms(params, self.param_name)
            self._grad_norms[key] = gn
        return gn

    def forget_grad_norms(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Drop this step's cached norms (the gradients changed in place, e.g. ``GradScaler.unscale_``)."""
        self._grad_norms.pop(id(optimizer), None)

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
        if self._models:
            # Per-module pre-hooks only when a check needs them; roots always get one (the
            # model call's source line, step bookkeeping). Post-hooks fill the module table.
            every_pre = bool(self._h_forward_pre)
            for mref in self._models:
                model = mref()
                if model is None:
                    continue
                inner = model.module if isinstance(model, _DP_TYPES) else model
                for path, mod in inner.named_modules():
                    if type(inner).__name__ == "OptimizedModule":
                        path = path[len("_orig_mod."):]  # the user's names, not torch.compile's wrapper
                        mod_type = type(inner._orig_mod).__name__ if mod is inner else type(mod).__name__
                    else:
                        mod_type = type(mod).__name__
                    self._paths_by_id[id(mod)] = path or mod_type
                self._roots.add(inner)
                self._root_ids.add(id(inner))
                if isinstance(inner, torch.jit.ScriptModule):
                    self._scripted = True
                    self.notice(f"guard: {type(inner).__name__} is a TorchScript module: it runs no Python hooks, "
                                f"so guard checks its losses, gradients and optimizer steps, not its layers.")
                compiled = self._compiled_root(inner)
                for mod in dict.fromkeys(m for _, m in inner.named_modules()) if not compiled else (inner,):
                    if isinstance(mod, torch.jit.ScriptModule):
                        continue  # register_forward_*hook raises on ScriptModules
                    wanted = mod is inner or (every_pre and self._nonroot(self._pre_for, self._h_forward_pre, mod))
                    if compiled and getattr(mod, "_compiled_call_impl", None) is not None:
                        continue  # model.compile(): the boundary around its compiled call does the root's part
                    handles = inst.module_hooks(mod, self._hook_pre if wanted else None, self._hook_post)
                    if id(mod) not in self._mod_handles:
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
        inst.patch("torch.compile", self._mw_compile)
        inst.patch("torch.nn.Module.compile", self._mw_module_compile)
        _hooks.eager_frames()
        if not self._models:  # the global hooks fire for torch.compile's wrapper too; guard counts it once
            inst.ignore_warning(r"Using `torch\.compile\(module\)` when there are global hooks on modules")
        for ev, target in self._patch_targets().items():
            try:
                inst.patch(target, self._make_patch_middleware(ev))
            except (AttributeError, ImportError, ValueError):
                pass  # a target this torch version lacks (private hooks points): the check does without
        inst.process_exit(self)

    # ------------------------------------------------------------------ torch.compile boundary
    def _compiled_root(self, model: nn.Module) -> bool:
        """A watched model that torch.compile runs: hooks only at its boundary, outside the compiled code.

        Hooks inside are traced by dynamo (they return at once there, see hooks._eager_only), so
        per-layer hooks would cost without seeing anything.
        """
        if type(model).__name__ == "OptimizedModule":
            self._compiled_notice(model)
            return True
        if getattr(model, "_compiled_call_impl", None) is not None:  # model.compile()
            self._compiled_notice(model)
            self._wrap_compiled_call(model)
            return True
        return False

    def _wrap_compiled_call(self, module: nn.Module) -> None:
        """After ``module.compile()`` even its own hooks run inside the compiled call: check around it."""
        compiled = module._compiled_call_impl
        if getattr(compiled, "_guard_boundary", None) is self:
            return
        model_mode = bool(self._models)

        def boundary(*args: Any, **kwargs: Any) -> Any:
            if model_mode:
                self._hook_pre(module, args, kwargs)
            else:
                self._hook_pre_global(module, args)
            try:
                out = compiled(*args, **kwargs)
            except BaseException as exc:
                if not model_mode:
                    self._hook_post_global(module, args, exc)
                raise
            if model_mode:
                self._hook_post(module, args, kwargs, out)
            else:
                self._hook_post_global(module, args, kwargs, out)
            return out

        boundary._guard_boundary = self  # type: ignore[attr-defined]
        self._installer.attr(module, "_compiled_call_impl", boundary)

    def _drop_module_hooks(self, model: nn.Module) -> None:
        """The model is compiled now: its layers' hooks would only be traced, the boundary replaces its own."""
        for mod in model.modules():
            for h in self._mod_handles.pop(id(mod), ()) or ():
                if h is not None:
                    h.remove()

    def _mw_compile(self, call: Callable, args: tuple, kwargs: dict) -> Any:
        """``torch.compile(model)`` while guard runs: the wrapper becomes the model's checked boundary."""
        result = call(*args, **kwargs)
        try:
            orig = getattr(result, "_orig_mod", None)
            if self._active and self._models and type(result).__name__ == "OptimizedModule" and id(orig) in self._root_ids:
                self._compiled_notice(result)
                self._paths_by_id[id(result)] = self.path_of(orig)
                self._root_ids.add(id(result))
                self._drop_module_hooks(orig)
                self._installer.module_hooks(result, self._hook_pre, self._hook_post)
            _hooks.eager_frames()
        except Exception as exc:
            self._contain(None, exc)
        return result

    def _mw_module_compile(self, call: Callable, args: tuple, kwargs: dict) -> Any:
        """``model.compile()`` while guard runs: check around the compiled call of a watched model."""
        result = call(*args, **kwargs)
        try:
            module = args[0] if args else None
            if self._active and isinstance(module, nn.Module) and (not self._models or id(module) in self._root_ids):
                self._compiled_notice(module)
                if self._models:
                    self._drop_module_hooks(module)
                self._wrap_compiled_call(module)
            _hooks.eager_frames()
        except Exception as exc:
            self._contain(None, exc)
        return result

    def _patch_targets(self) -> Dict[str, str]:
        targets: Dict[str, str] = {}
        for check in self.checks:
            targets.update(check.patches)
        return targets

    def _make_patch_middleware(self, event: str) -> Callable:
        def middleware(call: Callable, args: tuple, kwargs: dict) -> Any:
            if not self._active or getattr(self._tls, "in_patch", False):
                return call(*args, **kwargs)
            self._tls.in_patch = True
            try:
                self._dispatch(event, args, kwargs)
            finally:
                self._tls.in_patch = False
            try:
                result = call(*args, **kwargs)
            except BaseException as exc:
                try:
                    self._dispatch(event + "_error", args, kwargs, exc)
                except GuardError:
                    pass  # the call's own exception is the one to see (raise mode included)
                raise
            self._dispatch(event + "_done", args, kwargs, result)
            return result

        return middleware

    # ------------------------------------------------------------------ hooks (hot paths)
    def _hook_pre_global(self, module: nn.Module, args: tuple) -> None:
        tls = self._tls
        depth = getattr(tls, "depth", 0)
        tls.depth = depth + 1
        if depth == 0:
            if module not in self._paths_weak:
                self._adopt_root(module)
            self._enter_root()
        if self._h_forward_pre and self._active:
            self._dispatch_forward_pre(module, args, {}, depth == 0)

    def _adopt_root(self, module: nn.Module) -> None:
        if isinstance(module, _DP_TYPES):  # paths as in the user's model, without DDP's "module."
            self._paths_weak[module] = type(module).__name__
            module = module.module
        if type(module).__name__ == "OptimizedModule":
            # torch.compile's wrapper runs eagerly (hooks fire here); its _orig_mod carries the user's names.
            self._compiled_notice(module)
            self._paths_weak[module] = type(module._orig_mod).__name__
            module = module._orig_mod
        if isinstance(module, _DP_TYPES):
            return
        try:
            for path, mod in module.named_modules():
                if path == "" or mod not in self._paths_weak or self._paths_weak[mod] == type(mod).__name__:
                    self._paths_weak[mod] = path or type(mod).__name__
            self._roots.add(module)
        except Exception as exc:
            self._contain(None, exc)

    def _enter_root(self) -> None:
        """An outermost model call starts: remember where it came from."""
        tls = self._tls
        tls.root_source = user_source(3)
        tls.forwards = getattr(tls, "forwards", 0) + 1
        if self._backward_pending:
            self._advance_backward_step()

    def _hook_pre(self, module: nn.Module, args: tuple, kwargs: Optional[dict]) -> None:
        is_root = id(module) in self._root_ids
        if is_root:
            self._enter_root()
        if self._h_forward_pre and self._active:
            self._dispatch_forward_pre(module, args, kwargs or {}, is_root)

    def _nonroot(self, cache: Dict[int, Tuple[Any, list]], handlers: list, module: nn.Module) -> list:
        """`handlers` of the checks that watch `module` in a non-root call, decided once per module."""
        ent = cache.get(id(module))
        if ent is not None and ent[0]() is module:
            return ent[1]
        chosen = []
        for check, fn in handlers:
            try:
                if check.watches(module):
                    chosen.append((check, fn))
            except Exception as exc:
                self._contain(check, exc)
        if len(cache) > 100_000:
            cache.clear()
        cache[id(module)] = (weakref.ref(module), chosen)
        return chosen

    def _dispatch_forward_pre(self, module: nn.Module, args: tuple, kwargs: dict, is_root: bool) -> None:
        handlers = self._h_forward_pre if is_root else self._nonroot(self._pre_for, self._h_forward_pre, module)
        if not handlers:
            return
        path = self.path_of(module)
        for check, fn in handlers:
            try:
                fn(module, path, args, kwargs, is_root)
            except GuardError:
                raise
            except Exception as exc:
                self._contain(check, exc)

    def _hook_post_global(self, module: nn.Module, args: tuple, kwargs: dict, output: Any = _NO_OUTPUT) -> None:
        if output is _NO_OUTPUT:  # forward raised: torch calls always_call global hooks as (module, args, result)
            kwargs, output = {}, kwargs
        tls = self._tls
        depth = getattr(tls, "depth", 1) - 1
        tls.depth = depth if depth > 0 else 0
        self._after_forward(module, args, kwargs, output, depth <= 0)

    def _hook_post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self._after_forward(module, args, kwargs, output, id(module) in self._root_ids)

    def _after_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any, is_root: bool) -> None:
        if not self._active:
            return
        first = id(module) not in self._modules_seen
        if first:
            self._record_module(module, output)
        handlers = self._h_forward if is_root else self._nonroot(self._post_for, self._h_forward, module)
        if handlers:
            path = self.path_of(module)
            for check, fn in handlers:
                try:
                    fn(module, path, args, kwargs, output, is_root)
                except GuardError:
                    raise
                except Exception as exc:
                    self._contain(check, exc)
        if first and not is_root and output is not None:
            self._settle(module, output)

    def _settle(self, module: nn.Module, output: Any) -> None:
        """A layer's first call is done: later calls reach only the checks that keep it (Check.steady).

        In model mode a layer no check keeps loses its hooks, so it runs at torch's hook-free speed.
        """
        key = id(module)
        keeps = []
        for cache in (self._pre_for, self._post_for):
            ent = cache.get(key)
            kept = []
            if ent is not None and ent[0]() is module:
                for check, fn in ent[1]:
                    try:
                        if check.steady(module, output):
                            kept.append((check, fn))
                    except Exception as exc:
                        self._contain(check, exc)
                cache[key] = (ent[0], kept)
            keeps.append(bool(kept))
        handles = self._mod_handles.get(key)
        if handles is None or key in self._root_ids:
            return
        pre, post = handles
        if pre is not None and not keeps[0]:
            pre.remove()
        if not keeps[1]:
            post.remove()

    def _record_module(self, module: nn.Module, output: Any) -> None:
        try:
            self._modules_seen.add(id(module))
            if len(self.modules) >= MAX_MODULES:
                return
            path = self.path_of(module)
            if path in self.modules:
                return
            from .tensors import first_tensor

            t = first_tensor(output)
            self.modules[path] = {
                "path": path,
                "type": type(module).__name__,
                "output_shape": list(t.shape) if t is not None and not t.is_nested else None,
                "dtype": str(t.dtype) if t is not None else None,
                "device": str(t.device) if t is not None else None,
                "params": sum(p.numel() for p in module.parameters(recurse=True)),
            }
        except Exception as exc:
            self._contain(None, exc)

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
        import dataclasses

        self.step = 0
        self.sampling = True
        self._findings = {k: dataclasses.replace(f, step=0, last_step=0) for k, f in self._findings.items()}
        merged: Dict[str, Any] = {"step": 0}
        for entry in self.timeline:
            merged.update({k: v for k, v in entry.items() if k != "step"})
        self.timeline = [merged] if len(merged) > 1 else []

    def _hook_step_pre(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if not self._active or not self._watches_optimizer(opt):
            return
        try:
            self._dispatch("step_pre", opt)
            if self.is_primary(opt):
                self._resolve()
        except GuardError:
            raise
        except Exception as exc:
            self._contain(None, exc)

    def _hook_step_post(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if not self._active or not self._watches_optimizer(opt):
            return
        try:
            self._dispatch("step_post", opt)
            if self.is_primary(opt):
                self._end_step()
        except GuardError:
            raise
        except Exception as exc:
            self._contain(None, exc)

    def skipped_step(self, optimizer: torch.optim.Optimizer) -> None:
        """An AMP ``GradScaler`` skipped ``optimizer.step()`` (inf/NaN grads): end the step without step hooks.

        The step still counts (step numbers follow the training loop) and is marked ``skipped`` in
        the timeline; its scaled, non-finite gradient norms are dropped.
        """
        if not self._active or not self._watches_optimizer(optimizer) or not self.is_primary(optimizer):
            return
        try:
            self._grad_norms.pop(id(optimizer), None)
            self.timeline_note(skipped=True)
            self._resolve()
            self._end_step()
        except GuardError:
            raise
        except Exception as exc:
            self._contain(None, exc)

    def _end_step(self) -> None:
        self._tls.forwards = 0  # forwards combined into one loss leave a surplus; a step settles it
        if self.step == 0 and self._models and not self.modules and not self._scripted and "torch._dynamo" in sys.modules:
            self.notice("guard: optimizer steps ran but no call of the watched model was seen: if it runs through "
                        "a torch.compile'd wrapper (compiled code skips module hooks), guard that compiled module "
                        "instead; until then only gradients and parameters are checked.")
        self._dispatch("step_end", self.step)
        self.step += 1
        self.sampling = self.step % self.config.every == 0

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
        try:
            try:
                if self._backward_pending:
                    self._advance_backward_step()
                tls.root_source = user_source(2)
                if self.sampling:
                    self._stage_loss(tensors)
                self._dispatch("backward", tensors, kwargs)
            except GuardError:
                raise
            except Exception as exc:
                self._contain(None, exc)
            result = call(*args, **kwargs)
            try:
                self._dispatch("backward_done", tensors, kwargs)
                if self._primary is None:
                    if self.sampling:
                        self._resolve()
                    self._backward_pending = True
            except GuardError:
                raise
            except Exception as exc:
                self._contain(None, exc)
            return result
        finally:
            tls.in_backward = False
            # A model guard owns a backward only while its model has forwards not yet back-propagated
            # in this thread (two forwards, two backwards: both are ours; another model's: not).
            tls.forwards = max(0, getattr(tls, "forwards", 0) - 1)

    def _stage_loss(self, tensors: Any) -> None:
        ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors or ())
        for t in ts:
            if isinstance(t, torch.Tensor) and t.numel() == 1 and t.is_floating_point() and t.device.type != "meta":
                v = t.detach().reshape(()).float()
                self._step_loss = v if self._step_loss is None or self._step_loss.device != v.device else self._step_loss + v

    # ------------------------------------------------------------------ exit & report
    def _on_process_exit(self, reason: str) -> None:
        try:
            self.close()
        except BaseException:
            pass

    def _console(self):
        con = getattr(self, "_console_obj", None)
        if con is None:
            from .report.console import LiveConsole

            con = self._console_obj = LiveConsole(self.config.live)
        return con

    def report(self) -> Dict[str, Any]:
        """The report dump as a dict (schema ``guard-report/1``)."""
        from .report.model import build_report

        return build_report(self)

    def _finish(self) -> None:
        path = self.config.report
        if path:
            from ._dist import rank_report_path

            path = rank_report_path(path)  # one dump per rank: report.rank{N}.json
            from .report import write_report

            try:
                self.report_path = write_report(self.report(), path)
            except Exception as exc:
                self.report_error = f"{type(exc).__name__}: {exc}"
                self._console().internal(f"guard: could not write the report to {path!r}: {self.report_error}")
        try:
            self._console().summary(self)
        except Exception:
            pass


def make_guard(model: Any = None, optimizer: Any = None, **options: Any) -> Guard:
    return Guard(model, optimizer, **options)
