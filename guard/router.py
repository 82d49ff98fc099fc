"""The event router: which check hears which event, and what happens when a check fails.

The router holds the active checks and their handler tables (built from the ``on_<event>``
methods each check defines), narrows per-layer forward events with `Check.watches` and
`Check.steady`, and contains a check's failure once: the check is switched off, a
`GuardInternalWarning` says so, and training goes on.
"""
from __future__ import annotations

import time
import traceback
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch

from .checks.base import Check
from .findings import GuardError, printable

if TYPE_CHECKING:  # pragma: no cover
    from .session import Guard

Handler = Tuple[Check, Callable]


def _transforms_active() -> bool:  # a torch without the C switch (it has been there since 2.0)
    peek = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


#: True while a torch.func transform (vmap, grad, jacrev, ...) runs (the C switch: peek_interpreter_stack
#: costs about ten times as much inside a training step)
FRESH = object()  # `Router.memo` in a dispatch whose handlers have not asked for the source line yet

in_transform = getattr(torch._C, "_are_functorch_transforms_active", None) or _transforms_active


def _sleeps(event: str) -> bool:
    """Whether a sampled-out costly check misses `event`: the per-step hot path does; start, exit,
    exceptions and the error paths of patched calls (explanations of a crash) reach every check."""
    return not (event.endswith("_error") or event in ("start", "exception", "exit", "wake"))


class GuardInternalWarning(RuntimeWarning):
    """guard's own failure: a check raised and was switched off; training is unaffected."""


# Not shown by default: guard prints its own one line for it (shown, the warning would add two more: its text
# again and a source line). Appended, so any filter of the program's own (-W error, pytest's filterwarnings,
# simplefilter, catch_warnings) comes first.
warnings.filterwarnings("ignore", category=GuardInternalWarning, append=True)


class Router:
    """Routes events to the active checks of one guard; contains their failures."""

    def __init__(self, guard: "Guard"):
        self.g = guard
        self.checks: List[Check] = []
        self.handlers: Dict[str, List[Handler]] = {}
        self.forward_pre: List[Handler] = []
        self.forward: List[Handler] = []
        # Per module id: (weakref, handlers of checks that watch it in non-root calls), narrowed
        # after its first call to those that keep it (Check.steady).
        self.pre_for: Dict[int, Tuple[Any, List[Handler]]] = {}
        self.post_for: Dict[int, Tuple[Any, List[Handler]]] = {}
        # The dispatch running now: FRESH until a handler asks for the source line, then (thread id, line).
        self.memo: Any = None
        # Handler tables with every active check, and without the costly ones (the steps a budget samples
        # them out): switched in O(1) at a step's end (`wake`), so a sleeping check costs nothing per step.
        self._tables: Tuple[Dict[str, List[Handler]], Dict[str, List[Handler]]] = ({}, {})
        self.awake = True
        self.all_forward_pre: List[Handler] = []  # both: per-layer handler lists are chosen from these
        self.all_forward: List[Handler] = []

    def set_checks(self, checks: List[Check]) -> None:
        """Route to `checks` from now on."""
        self.checks = list(checks)
        self.rebuild()

    def rebuild(self) -> None:
        """Rebuild the handler tables from the checks' ``on_*`` methods (a check switched off leaves them)."""
        handlers: Dict[str, List[Handler]] = {}
        for check in self.checks:
            for ev in check.events():
                if ev not in check.muted:
                    handlers.setdefault(ev, []).append((check, getattr(check, "on_" + ev)))
        light = {}
        for ev, hs in handlers.items():
            kept = [h for h in hs if not h[0].costly or h[0].following] if _sleeps(ev) else hs
            if kept:
                light[ev] = kept
        self._tables = (handlers, light)
        self.all_forward_pre = handlers.get("forward_pre", [])
        self.all_forward = handlers.get("forward", [])
        self._use()
        active = set(map(id, self.checks))
        for cache in (self.pre_for, self.post_for):
            for k, (ref, hs) in list(cache.items()):
                cache[k] = (ref, [h for h in hs if id(h[0]) in active])

    def drop(self, check: Check, event: str) -> None:
        """Leave `check`'s handler for `event` out of both tables from now on (the check muted it): no rebuild."""
        for table in self._tables:
            hs = table.get(event)
            if hs is not None:
                kept = [h for h in hs if h[0] is not check]
                if kept:
                    table[event] = kept
                else:
                    del table[event]
        self._use()

    def wake(self, costly: bool) -> None:
        """From the next event on, route to the costly checks too (`costly`) or let them sleep."""
        if costly != self.awake:
            self.awake = costly
            self._use()
            if costly:
                self.dispatch("wake")  # state a sleeping check kept across steps may be out of date

    def _use(self) -> None:
        table = self._tables[0 if self.awake else 1]
        self.handlers = table
        self.forward_pre = table.get("forward_pre", [])
        self.forward = table.get("forward", [])

    def patch_targets(self) -> Dict[str, str]:
        """``{event: "dotted.target"}`` of every active check's patches."""
        targets: Dict[str, str] = {}
        for check in self.checks:
            targets.update(check.patches)
        return targets

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, event: str, *args: Any) -> None:
        """Call every handler of `event`; a failing check is contained, a `GuardError` propagates."""
        hs = self.handlers.get(event)
        if not hs:
            return
        # The user's source line is the same for every handler of one dispatch: `Guard.source()`
        # walks the frames once per dispatch (in this thread), not once per check that asks.
        outer, self.memo = self.memo, FRESH
        try:
            for check, fn in hs:
                try:
                    fn(*args)
                except GuardError:
                    raise
                except Exception as exc:
                    self.contain(check, exc)
        finally:
            self.memo = outer

    def nonroot(self, cache: Dict[int, Tuple[Any, List[Handler]]], handlers: List[Handler], module: Any) -> List[Handler]:
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
                self.contain(check, exc)
        if len(cache) > 100_000:
            cache.clear()
        cache[id(module)] = (weakref.ref(module), chosen)
        return chosen

    def layer_handlers(self, cache: Dict[int, Tuple[Any, List[Handler]]], handlers: List[Handler],
                       module: Any) -> List[Handler]:
        """`nonroot` handlers of `module` for this step: without the costly checks while they sleep."""
        hs = self.nonroot(cache, handlers, module)
        if hs and not self.awake:
            hs = [h for h in hs if not h[0].costly]
        return hs

    def dispatch_forward_pre(self, module: Any, args: tuple, kwargs: dict, is_root: bool) -> None:
        handlers = self.forward_pre if is_root else self.layer_handlers(self.pre_for, self.all_forward_pre, module)
        if not handlers:
            return
        path = self.g.path_of(module)
        for check, fn in handlers:
            try:
                fn(module, path, args, kwargs, is_root)
            except GuardError:
                raise
            except Exception as exc:
                self.contain(check, exc)

    def dispatch_forward(self, handlers: List[Handler], module: Any, args: tuple, kwargs: dict, output: Any,
                         is_root: bool) -> None:
        """Run `handlers` (``forward`` if root, else ``layer_handlers(post_for, all_forward, module)``)."""
        path = self.g.path_of(module)
        for check, fn in handlers:
            try:
                fn(module, path, args, kwargs, output, is_root)
            except GuardError:
                raise
            except Exception as exc:
                self.contain(check, exc)

    def settle(self, module: Any, output: Any) -> Tuple[bool, bool]:
        """A layer's first call is done: later calls reach only the checks that keep it (`Check.steady`).

        Returns whether any check keeps its (pre, post) calls.
        """
        key = id(module)
        keeps = []
        for cache in (self.pre_for, self.post_for):
            ent = cache.get(key)
            kept = []
            if ent is not None and ent[0]() is module:
                for check, fn in ent[1]:
                    try:
                        if check.steady(module, output):
                            kept.append((check, fn))
                    except Exception as exc:
                        self.contain(check, exc)
                cache[key] = (ent[0], kept)
            keeps.append(bool(kept))
        return keeps[0], keeps[1]

    def patch_middleware(self, event: Any, active: Callable[[], bool], tls: Any, meter: Any = None) -> Callable:
        """An installer middleware that sends `event`, `event_done`, `event_error` around a patched call.

        `event` may be a tuple of events that patch the same target: one wrapper layer for all of them
        (pre events in order, done/error events in reverse, as nested layers would). Events without
        handlers are not dispatched. The time of the dispatches (not of the call) is added to `meter`
        (guard's own cost).
        """
        clock = time.perf_counter
        events = (event,) if isinstance(event, str) else tuple(event)
        done = tuple(e + "_done" for e in reversed(events))
        error = tuple(e + "_error" for e in reversed(events))
        # a torch.func transform starting (explain lifts its saved-tensor hooks for it) is seen inside another one
        # too (vmap(grad(...)) in a model's forward): those handlers touch no tensor
        anywhere = all(e.startswith("functorch_") for e in events)

        def middleware(call: Callable, args: tuple, kwargs: dict) -> Any:
            if not active() or getattr(tls, "in_patch", False) or (in_transform() and not anywhere):
                # Inside vmap/grad the values are functorch's wrapped tensors: checks must not keep them
                # (they cannot be read after the transform), and the user's own call is seen outside it.
                return call(*args, **kwargs)
            hs = self.handlers  # replaced by rebuild(): read at call time
            t0 = clock()
            for ev in events:
                if ev in hs:
                    tls.in_patch = True
                    try:
                        self.dispatch(ev, args, kwargs)
                    finally:
                        tls.in_patch = False
            if meter is not None:
                meter.own += clock() - t0
            try:
                result = call(*args, **kwargs)
            except BaseException as exc:
                for ev in error:
                    if ev in self.handlers:
                        try:
                            self.dispatch(ev, args, kwargs, exc)
                        except GuardError:
                            pass  # the call's own exception is the one to see (raise mode included)
                raise
            hs = self.handlers
            t0 = clock()
            try:
                for ev in done:
                    if ev in hs:
                        self.dispatch(ev, args, kwargs, result)
            finally:
                if meter is not None:
                    meter.own += clock() - t0
            return result

        return middleware

    # ------------------------------------------------------------------ containment
    def contain(self, check: Optional[Any], exc: BaseException) -> None:
        """A check (or guard itself, `check` None) failed: switch it off, say so once, keep training going."""
        if not isinstance(check, Check):
            check = None
        name = check.name if check is not None else "guard"
        if check is not None and check in self.checks:
            self.checks = [c for c in self.checks if c is not check]
            self.rebuild()
        errors = self.g.record.internal_errors
        if any(e["check"] == name for e in errors):
            return
        tb = traceback.extract_tb(exc.__traceback__)
        at = f"{tb[-1].filename}:{tb[-1].lineno}" if tb else "?"
        first = (str(exc).strip().splitlines() or [""])[0][:300]  # torch errors can run to 100 lines
        entry = {"check": name, "error": printable(f"{type(exc).__name__}: {first}"), "at": printable(at),
                 "step": self.g.step}
        errors.append(entry)
        msg = (f"guard: internal error in check {name!r} ({entry['error']} at {at}); "
               f"the check is switched off, training continues")
        try:
            warnings.warn(msg, GuardInternalWarning, stacklevel=2)  # for code that catches or filters it
        except Exception:
            pass  # warnings turned into errors (-W error, pytest's filterwarnings): never raised into training
        self.g.console().internal(msg)  # the one line on stderr (the warning is not shown by default, below)
