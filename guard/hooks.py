"""The one installer: every hook and patch guard puts into torch goes through here.

Two layers:

* `Installer` is per guard. It owns an `ExitStack` of removable handles
  (module hooks, optimizer hooks, global module hooks, grad hooks, patch
  subscriptions) and removes all of them in `close()`, in reverse order.
* Patches of shared functions (``torch.autograd.backward``,
  ``DataLoader.__iter__``, ...) are installed once per process and
  reference-counted: every guard subscribes a middleware to the one wrapper,
  and the original is put back when the last guard leaves. This keeps nested
  and concurrent guards correct even when they close out of order.
"""
from __future__ import annotations

import atexit
import functools
import importlib
import os
import signal
import sys
import types
import warnings
import threading
import weakref
from collections import OrderedDict
from contextlib import ExitStack
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.nn.modules import module as _module_mod
from torch.optim import optimizer as _optim_mod

from ._frames import is_skipped

Middleware = Callable[[Callable[..., Any], tuple, dict], Any]

# torch.compile traces module hooks and patched functions called inside a compiled region. Guard's
# code must never enter a graph (graph breaks move random ops and change RNG consumption; recompiles
# on its closures): every hook and wrapper returns at once when dynamo traces it. Dynamo folds this call
# to True while tracing, so the hook inlines to nothing (no graph break, no guard on guard's state).
_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)
# torch.jit.trace runs the model with its hooks: guard's tensor tests there would be recorded into the
# trace (TracerWarnings) and the tracing pass taken for an evaluation. Not None while tracing.
_tracing = getattr(torch._C, "_get_tracing_state", lambda: None)


def _fx_tracing() -> bool:
    """Whether torch.fx.symbolic_trace runs (the module calls see Proxy objects, not tensors)."""
    fx = sys.modules.get("torch.fx._symbolic_trace")
    return fx is not None and fx._is_fx_tracing_flag


def _eager_only(fn: Callable) -> Callable:
    """`fn` as a hook that does nothing inside code torch.compile traces, nor while torch.jit.trace or
    torch.fx.symbolic_trace runs."""

    def hook(*args: Any, **kwargs: Any) -> Any:
        if _compiling() or _tracing() is not None or _fx_tracing():
            return None
        return fn(*args, **kwargs)

    hook.__wrapped__ = fn  # type: ignore[attr-defined]
    return hook


def eager_frames() -> None:
    """Have dynamo run guard's hook and wrapper frames eagerly, with all they call, when torch code it
    does not trace (``Module._call_impl`` under a compiled call) calls them.

    Otherwise dynamo compiles such a frame on its own, where `_compiling()` is folded to True: the
    check would silently never run. Inlined into a traced frame they still fold to nothing. Only
    once ``torch._dynamo`` is loaded (guard never imports it itself).
    """
    if "torch._dynamo" not in sys.modules:
        return
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        strategy = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
        with _lock:
            codes = ({_HOOK_CODE, _STEP_HOOK_CODE} | _EAGER_CODES
                     | {p.wrapper.__code__ for p in list(_patches.values()) + _orphans})
        for code in codes:
            set_code_exec_strategy(code, strategy)
    except Exception:  # a torch without these internals: hooks entered that way are skipped, nothing breaks
        pass


_HOOK_CODE = _eager_only(len).__code__


def _outside_graphs(fn: Callable) -> Callable:
    """`fn` as an optimizer step hook that a compiled ``opt.step()`` (torch.compile over a function that steps,
    the compiled-optimizer recipe) runs eagerly at a graph break of its own, around the step's graph.

    Dynamo does not inline a function marked ``_torchdynamo_disable`` (the mark torch.compiler.disable sets;
    set here without importing dynamo): traced, guard's step hooks made some twenty graph breaks and a
    recompile per step on guard's state. `eager_frames` has the hook's frame, and what it calls, run
    uncompiled. Unlike a module hook, a step hook cannot fold to nothing: the step is what guard counts by.
    """

    def step_hook(*args: Any) -> Any:
        return fn(*args)

    step_hook._torchdynamo_disable = True  # type: ignore[attr-defined]
    step_hook.__wrapped__ = fn  # type: ignore[attr-defined]
    return step_hook


_STEP_HOOK_CODE = _outside_graphs(len).__code__


def caller_frame() -> Any:
    """The frame that called the running hook (torch's ``inner``), past guard's own hook wrapper."""
    f = sys._getframe(2)
    while f is not None and f.f_code in _PASS_CODES:
        f = f.f_back
    return f
_EAGER_CODES: set = set()


def eager(fn: Callable) -> Callable:
    """Mark a callback torch calls by itself (a saved-tensors hook) to run eagerly, see `eager_frames`."""
    _EAGER_CODES.add(fn.__code__)
    return fn

_lock = threading.RLock()

# nn.Module's per-instance hook tables, all keyed by hook id.
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


class _Handle:
    """A removable handle for anything: calls `fn` once on `remove()`."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[[], None]):
        self._fn: Optional[Callable[[], None]] = fn

    def remove(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()


# --------------------------------------------------------------------------- patches

_resolved: Dict[str, Tuple[Any, str]] = {}


def _resolve_target(target: str) -> Tuple[Any, str]:
    """``"torch.utils.data.DataLoader.__iter__"`` -> (DataLoader class, "__iter__"), looked up once per target
    (trying the longest importable module first costs failed imports, at every guard start otherwise)."""
    hit = _resolved.get(target)
    if hit is None:
        hit = _resolved[target] = _find_target(target)
    return hit


def _find_target(target: str) -> Tuple[Any, str]:
    parts = target.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for p in parts[i:-1]:
            obj = getattr(obj, p)
        return obj, parts[-1]
    raise ValueError(f"guard: cannot resolve patch target {target!r}")


class _Patch:
    """One shared wrapper around ``owner.attr`` that runs the subscribed middlewares."""

    def __init__(self, owner: Any, attr: str):
        self.owner, self.attr = owner, attr
        self.had_own = attr in getattr(owner, "__dict__", {})
        self.raw = owner.__dict__[attr] if self.had_own else None
        self.original = getattr(owner, attr)
        self.subscribers: List[Tuple[int, Middleware]] = []
        raw = self.raw
        kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
        func = raw.__func__ if kind is not None else self.original
        patch = self

        reattribute = _warns_at_caller(owner, attr)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            subs = patch.subscribers
            if not subs or _compiling():  # traced by torch.compile: the plain function, nothing of guard's
                return func(*args, **kwargs)
            try:
                call = _at_caller(sys._getframe(1), func) if reattribute else func
                if len(subs) == 1:  # the usual case: one guard on the target
                    return subs[0][1](call, args, kwargs)
                return patch._chain(call, subs, 0, args, kwargs)
            except BaseException as exc:
                _drop_own_frames(exc)
                raise

        wrapper.__wrapped__ = func  # type: ignore[attr-defined]
        wrapper.__name__ = getattr(func, "__name__", attr)
        wrapper.__qualname__ = getattr(func, "__qualname__", attr)
        wrapper.__doc__ = getattr(func, "__doc__", None)
        wrapper._guard_patch = True  # type: ignore[attr-defined]
        # TorchScript compiles what a scripted function or module calls from its source: it must see the original
        # (`F.dropout` inside a scripted `nn.Dropout`), not this wrapper. Recursive scripting asks
        # `__prepare_scriptable__`; `torch.jit.script(fn)` itself unwraps `__script_if_tracing_wrapper`.
        wrapper.__prepare_scriptable__ = lambda: func  # type: ignore[attr-defined]
        setattr(wrapper, "__script_if_tracing_wrapper", True)
        setattr(wrapper, "__original_fn", func)
        self.wrapper = wrapper
        self.installed = kind(wrapper) if kind is not None else wrapper

    def _chain(self, func: Callable, subs: list, i: int, args: tuple, kwargs: dict) -> Any:
        if i >= len(subs) - 1:  # the innermost middleware calls the function itself (no wrapper lambda)
            return subs[i][1](func, args, kwargs) if i < len(subs) else func(*args, **kwargs)
        nxt = lambda *a, **k: self._chain(func, subs, i + 1, a, k)  # noqa: E731
        return subs[i][1](nxt, args, kwargs)

    def install(self) -> None:
        setattr(self.owner, self.attr, self.installed)
        self.aliases: List[Callable[[], None]] = []  # undo of the user's names rebound to the wrapper
        if isinstance(self.owner, types.ModuleType):
            _unaliased.append(self)

    def uninstall(self) -> bool:
        """Put the original back; False when someone patched over us (we then stay as a pass-through)."""
        aliases, self.aliases = getattr(self, "aliases", []), []
        for undo in aliases:
            undo()
        current = self.owner.__dict__.get(self.attr) if hasattr(self.owner, "__dict__") else None
        if current is not self.installed and getattr(self.owner, self.attr, None) is not self.installed:
            return False
        if self.had_own:
            setattr(self.owner, self.attr, self.raw)
        else:
            try:
                delattr(self.owner, self.attr)
            except AttributeError:
                setattr(self.owner, self.attr, self.original)
        return True


_GUARD_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_MAX_ALIAS_NAMES = 20_000  # candidate names rebound per guard start, at most (a bounded start cost)


_module_kinds: Dict[str, Tuple[Any, bool]] = {}  # module name -> (weak reference to the module, whether the user's)


def _user_modules() -> List[types.ModuleType]:
    """The user's own modules (``__main__`` and files that are neither torch, guard, installed packages nor the
    standard library); each module is judged once."""
    out = []
    kinds = _module_kinds
    for name, mod in list(sys.modules.items()):
        hit = kinds.get(name)
        if hit is None or hit[0]() is not mod:
            f = getattr(mod, "__file__", None)
            mine = isinstance(mod, types.ModuleType) and (
                name == "__main__" or (isinstance(f, str) and not is_skipped(f)))
            try:
                kinds[name] = (weakref.ref(mod), mine)
            except TypeError:  # an object in sys.modules that takes no weak reference: judged each time
                pass
            hit = (None, mine)
        if hit[1]:
            out.append(mod)
    return out


_unaliased: List["_Patch"] = []  # module-function patches installed whose aliases were not yet rebound


def rebind_aliases(extra: Optional[List[Dict[str, Any]]] = None) -> None:
    """A patched module function is also reached through the user's names bound before guard started
    (``from torch.nn.functional import cross_entropy``, ``LOSS = partial(F.mse_loss, ...)``, a module-level
    table of losses, and in `extra` namespaces such as a watched model's attributes: ``self.loss_fn =
    F.cross_entropy``): point them at the wrapper, in one pass over the user's modules for every patch just
    installed; each patch puts its names back when it is uninstalled."""
    with _lock:
        patches = {id(p.original): p for p in _unaliased if _patches.get((id(p.owner), p.attr)) is p}
        _unaliased.clear()
    if not patches:
        return
    budget = [_MAX_ALIAS_NAMES]
    partial, function = functools.partial, types.FunctionType

    def swap(container: Any, key: Any, value: Any, depth: int) -> None:
        budget[0] -= 1
        # a wrapper left by an earlier guard (the name was bound while it was patched) stands for the original
        p = patches.get(id(getattr(value, "__wrapped__", None) if getattr(value, "_guard_patch", False) else value))
        if p is not None and (value is p.original or getattr(value, "__wrapped__", None) is p.original):
            container[key] = p.installed

            def back(c=container, k=key, p=p, old=value) -> None:
                if c.get(k) is p.installed:
                    c[k] = old
            p.aliases.append(back)
        elif type(value) is partial:
            p = patches.get(id(value.func))
            if p is not None and value.func is p.original:
                _set_partial_func(value, p.installed)

                def back_partial(v=value, p=p) -> None:
                    if v.func is p.installed:
                        _set_partial_func(v, p.original)
                p.aliases.append(back_partial)
        elif depth == 0 and type(value) is dict and len(value) <= 256:
            for k2, v2 in list(value.items()):
                if id(v2) in patches or type(v2) is partial:
                    swap(value, k2, v2, 1)

    try:
        for d in [mod.__dict__ for mod in _user_modules()] + list(extra or ()):
            for key, value in list(d.items()):
                # most values are none of the three: tested inline (a call per name cost ~10 ms a start)
                t = type(value)
                if (id(value) in patches or t is partial or (t is dict and not (type(key) is str and key[:2] == "__"))
                        or (t is function and getattr(value, "_guard_patch", False))):
                    if budget[0] <= 0:
                        return
                    swap(d, key, value, 0)
    except Exception:  # an odd module namespace: the names not yet rebound stay as they were
        pass


def _set_partial_func(p: functools.partial, func: Callable) -> None:
    """Swap a partial's function in place (its ``func`` is read-only; ``__setstate__`` is how pickle rebuilds it)."""
    p.__setstate__((func, p.args, p.keywords or {}, p.__dict__ or None))


def _warns_at_caller(owner: Any, attr: str) -> bool:
    """Functions whose own warnings name their caller (``stacklevel=2``): the losses, torch.load, ..."""
    name = getattr(owner, "__name__", "")
    return name.startswith("torch.nn.functional") or name == "torch" or attr == "load_state_dict"


# A patched function that warns with ``stacklevel=2`` names the frame that called it. Under guard that
# frame would be guard's own (the middleware calling the original), so the original is called from a
# one-line trampoline whose code carries the caller's file and line and whose globals are the caller's:
# the warning then names the user's line and goes through the user's filters and registry exactly as
# without guard. (Catching and re-issuing each call's warnings instead cost ~5 us a call, and changing
# the filters on every call made "once per line" warnings of the user's own repeat at every step.)
_AT_NAME = "_guard_at_caller"


def _trampoline_code() -> types.CodeType:
    _f = None
    def _guard_at_caller(*args, **kwargs): return _f(*args, **kwargs)  # noqa: E704  (one line: see _at_caller)
    return _guard_at_caller.__code__


_AT_CODE = _trampoline_code()
# (id(caller's code), its instruction offset, id(func)) -> (that code, func, trampoline). By identity: code
# objects of the same source in two files compare equal; the entry keeps both objects, so no id is reused.
_AT_SITES: Dict[Tuple[int, int, int], Tuple[Any, Callable, Callable]] = {}


def _at_caller(caller: Any, func: Callable) -> Callable:
    """`func`, called from a frame that looks like `caller`'s line to ``warnings`` (one per call site)."""
    code, glb = caller.f_code, caller.f_globals
    key = (id(code), caller.f_lasti, id(func))
    hit = _AT_SITES.get(key)
    if hit is None or hit[0] is not code or hit[1] is not func or hit[2].__globals__ is not glb:
        if len(_AT_SITES) >= 1024:
            _AT_SITES.clear()
        tcode = _AT_CODE.replace(co_filename=code.co_filename, co_firstlineno=caller.f_lineno)
        hit = _AT_SITES[key] = (code, func, types.FunctionType(tcode, glb, _AT_NAME, None, (types.CellType(func),)))
    return hit[2]


def _drop_own_frames(exc: BaseException) -> None:
    """Leave only the outermost guard frame (the wrapper itself) in a traceback that passes through guard."""
    tb = exc.__traceback__
    if tb is None:
        return
    try:
        kept = []
        t = tb.tb_next
        while t is not None:
            code = t.tb_frame.f_code
            if not code.co_filename.startswith(_GUARD_DIR) and code.co_name != _AT_NAME:
                kept.append(t)
            t = t.tb_next
        new = None
        for t in reversed(kept):
            new = types.TracebackType(new, t.tb_frame, t.tb_lasti, t.tb_lineno)
        exc.__traceback__ = types.TracebackType(new, tb.tb_frame, tb.tb_lasti, tb.tb_lineno)
    except Exception:
        pass


_patches: Dict[Tuple[int, str], _Patch] = {}
_orphans: List[_Patch] = []  # patched over by someone else: kept alive as pass-throughs


def _subscribe(target: str, middleware: Middleware) -> _Handle:
    owner, attr = _resolve_target(target)
    key = (id(owner), attr)
    token = id(middleware)
    with _lock:
        patch = _patches.get(key)
        if patch is None:
            patch = _Patch(owner, attr)
            patch.install()
            _patches[key] = patch
        patch.subscribers = patch.subscribers + [(token, middleware)]

    def remove() -> None:
        with _lock:
            patch.subscribers = [s for s in patch.subscribers if s[0] != token]
            if not patch.subscribers and _patches.get(key) is patch:
                del _patches[key]
                if not patch.uninstall():
                    _orphans.append(patch)

    return _Handle(remove)


def active_patches() -> List[str]:
    """Targets currently patched by guard (for tests and debugging)."""
    with _lock:
        return [f"{getattr(p.owner, '__name__', p.owner)}.{p.attr}" for p in _patches.values()]


# --------------------------------------------------------------------------- process exit

_exit_callbacks: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_exit_installed = False
_prev_sigterm: Any = None
_sigterm_installed = False
_prev_excepthook: Any = None  # sys.excepthook before guard's, while guard's is installed


_exiting = 0  # exit callbacks running now (a report being written)
_kill_after_exit = False  # a fatal SIGTERM came while they ran: delivered once they are done


def _run_exit_callbacks(reason: str) -> None:
    # guards from the code close first (`guard.wrap`, `.start()` never closed): the environment's guard, which
    # stepped aside for them, then writes the run's report with their findings
    objs = sorted(_exit_callbacks.values(), key=lambda o: bool(getattr(getattr(o, "config", None), "background", False)))
    for obj in objs:
        run_exit_callback(obj, reason)


def run_exit_callback(obj: Any, reason: str) -> None:
    """``obj.on_process_exit(reason)``, never raising. A fatal SIGTERM arriving meanwhile (``Pool.terminate()``
    while a worker, leaving on its own, writes its report) waits for it to finish, then ends the process."""
    global _exiting, _kill_after_exit
    _exiting += 1
    try:
        obj.on_process_exit(reason)
    except Exception:  # never let guard break interpreter shutdown
        pass
    finally:
        _exiting -= 1
    if not _exiting and _kill_after_exit:
        _kill_after_exit = False
        try:
            signal.signal(signal.SIGTERM, _prev_sigterm if _prev_sigterm is not None else signal.SIG_DFL)
        except (ValueError, OSError, TypeError):
            pass
        os.kill(os.getpid(), signal.SIGTERM)


def _on_uncaught(exc_type: Any, exc: Any, tb: Any) -> None:
    """sys.excepthook: an exception no `with guard` block saw ends the program (a guard from `TORCH_GUARD=1`,
    or one started with `.start()`): the running guards explain it (notes on it), then it is printed as
    before, with them."""
    if isinstance(exc, BaseException):
        for obj in list(_exit_callbacks.values()):
            try:
                obj.on_uncaught(exc)
            except Exception:  # the user's traceback comes first, whatever guard's trouble
                pass
    (_prev_excepthook or sys.__excepthook__)(exc_type, exc, tb)


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM: write the reports (`_sigterm_once`). A SIGCHLD that arrived just before SIGTERM may still run
    torch's handler inside this one, before ours holds SIGCHLD, and raise there (a DataLoader worker died):
    then the work is done once more, and that error is raised after it, as the program would have seen it."""
    raised: List[BaseException] = []
    passed: List[bool] = []  # set once the program's own SIGTERM handler has been called: no second run then
    for _ in range(3):
        try:
            _sigterm_once(signum, frame, passed)
            break
        except Exception as exc:
            if passed:
                raise  # the program's own handler raised: its exception, at once
            raised.append(exc)
    if raised:
        raise raised[0]


def _sigterm_once(signum: int, frame: Any, passed: List[bool]) -> None:
    """Write the reports first, shielded from other signals' handlers, then let SIGTERM do what it did before.

    Under SLURM ``scancel`` or ``docker stop`` the whole process group gets SIGTERM: DataLoader workers die too,
    and torch's SIGCHLD handler raises ("DataLoader worker ... is killed by signal") wherever the main thread
    is, the report writer included. Held SIGCHLDs are replayed after the write unless the process ends here.
    A program's own SIGTERM handler (graceful shutdown: a few more steps, a checkpoint) runs after the write,
    and the guards keep watching until the process really exits.
    """
    global _kill_after_exit
    prev = _prev_sigterm
    fatal = not callable(prev) and prev != signal.SIG_IGN  # SIG_DFL (or unknown): the process ends now
    if fatal and _exiting:
        _kill_after_exit = True  # a report is being written below this handler: let it finish first
        return
    held: List[Any] = []
    chld = getattr(signal, "SIGCHLD", None)
    old_chld = None
    if chld is not None:
        try:
            old_chld = signal.signal(chld, lambda s, f: held.append(f))
        except (ValueError, OSError, TypeError):
            chld = None
    try:
        _run_exit_callbacks("SIGTERM" if fatal else "SIGTERM-handled")
        if fatal:
            # Re-deliver with the previous disposition so the exit status stays "killed by SIGTERM";
            # the held SIGCHLDs die with the process.
            signal.signal(signal.SIGTERM, prev if prev is not None else signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        if chld is not None:
            try:
                signal.signal(chld, old_chld if old_chld is not None else signal.SIG_DFL)
            except (ValueError, OSError, TypeError):
                pass
    if callable(prev):
        passed.append(True)
        prev(signum, frame)
    if held and callable(old_chld):
        old_chld(chld, held[0])  # what the program would have seen without guard (e.g. torch's worker error)


def _watch_process_exit(obj: Any) -> _Handle:
    """Call ``obj.on_process_exit(reason)`` at interpreter exit and on SIGTERM while registered."""
    global _exit_installed, _prev_sigterm, _sigterm_installed, _prev_excepthook
    with _lock:
        _exit_callbacks[id(obj)] = obj
        if not _exit_installed:
            atexit.register(_run_exit_callbacks, "exit")
            _exit_installed = True
        if sys.excepthook is not _on_uncaught:
            _prev_excepthook, sys.excepthook = sys.excepthook, _on_uncaught
        if not _sigterm_installed and threading.current_thread() is threading.main_thread():
            try:
                _prev_sigterm = signal.getsignal(signal.SIGTERM)
                signal.signal(signal.SIGTERM, _on_sigterm)
                _sigterm_installed = True
            except (ValueError, OSError):  # not the main interpreter / unsupported
                pass
    key = id(obj)

    def remove() -> None:
        global _sigterm_installed, _prev_excepthook
        with _lock:
            _exit_callbacks.pop(key, None)
            if not len(_exit_callbacks) and sys.excepthook is _on_uncaught:
                sys.excepthook, _prev_excepthook = _prev_excepthook or sys.__excepthook__, None
            # (not while an exit callback runs: the process is leaving, and a SIGTERM now, Pool.terminate() on a
            # worker that is writing its report, must wait for the report, not kill it half-written)
            if not len(_exit_callbacks) and _sigterm_installed and not _exiting:
                try:
                    if signal.getsignal(signal.SIGTERM) is _on_sigterm:
                        signal.signal(signal.SIGTERM, _prev_sigterm)
                        _sigterm_installed = False
                except (ValueError, OSError):
                    pass

    return _Handle(remove)


# --------------------------------------------------------------------------- shared process-wide torch hooks

# torch runs a global hook table by iterating one OrderedDict; a guard starting or ending in one thread while another
# thread is inside that loop (running guard's own hook) would change the dict under it ("OrderedDict mutated during
# iteration", raised in the user's step or assignment). So all guards share one torch hook of each such kind,
# registered while any guard needs it, and change only their own tuple, which they replace (never mutate): a loop
# under way keeps the tuple it started with.
_shared_lock = threading.Lock()


class _SharedHook:
    """One torch-level hook for all guards: ``register(hook)`` installs it, ``call(subs, *args)`` runs theirs."""

    __slots__ = ("_register", "_call", "subs", "_handle")

    def __init__(self, register: Callable[[], Callable[[Callable], Any]], call: Callable[..., Any]):
        self._register = register  # looked up when first needed: a torch version may lack the hook point
        self._call = call
        self.subs: Tuple[Callable, ...] = ()
        self._handle: Any = None

    def hook(self, *args: Any) -> Any:
        return self._call(self.subs, *args)

    def subscribe(self, fn: Callable) -> _Handle:
        with _shared_lock:
            if self._handle is None:
                self._handle = self._register()(self.hook)
            self.subs = self.subs + (fn,)

        def remove() -> None:
            with _shared_lock:
                self.subs = tuple(f for f in self.subs if f is not fn)
                if not self.subs and self._handle is not None:
                    self._handle.remove()
                    self._handle = None

        return _Handle(remove)


def _run_pre(subs: Tuple[Callable, ...], opt: Any, args: tuple, kwargs: dict) -> Any:
    changed = None
    for fn in subs:
        result = fn(opt, args, kwargs)
        if result is not None:  # a pre hook may replace (args, kwargs): the next one sees them, as torch chains them
            args, kwargs = changed = result
    return changed


def _run_post(subs: Tuple[Callable, ...], opt: Any, args: tuple, kwargs: dict) -> None:
    for fn in subs:
        fn(opt, args, kwargs)


def _run_registration(subs: Tuple[Callable, ...], parent: nn.Module, name: str, module: Any) -> None:
    for fn in subs:
        try:
            fn(parent, name, module)
        except Exception:  # naming a new layer is never worth the user's assignment
            pass


def _run_each(subs: Tuple[Callable, ...], *args: Any) -> None:
    for fn in subs:  # guard's module hooks only look: none replaces the args or the output
        fn(*args)


def _forward_hook_registrar() -> Callable[[Callable], Any]:
    def register(hook: Callable) -> _Handle:
        handle = _module_mod.register_module_forward_hook(_eager_only(hook), with_kwargs=True, always_call=True)

        def remove() -> None:
            handle.remove()
            # torch leaves the with_kwargs entry behind; it alone makes _has_any_global_hook() true
            # for ever after (and every torch.compile'd module call warn about global hooks).
            getattr(_module_mod, "_global_forward_hooks_with_kwargs", {}).pop(handle.id, None)

        return _Handle(remove)

    return register


_OPT_PRE = _SharedHook(lambda: lambda hook: _optim_mod.register_optimizer_step_pre_hook(_outside_graphs(hook)),
                       _run_pre)
_OPT_POST = _SharedHook(lambda: lambda hook: _optim_mod.register_optimizer_step_post_hook(_outside_graphs(hook)),
                        _run_post)
_REGISTRATION = _SharedHook(lambda: _module_mod.register_module_module_registration_hook, _run_registration)
# torch calls these for every module call in the process, with the dynamo and jit.trace test in front of the loop
_FORWARD_PRE = _SharedHook(lambda: lambda hook: _module_mod.register_module_forward_pre_hook(_eager_only(hook)),
                           _run_each)
_FORWARD_POST = _SharedHook(_forward_hook_registrar, _run_each)
# frames between torch and a hook
_PASS_CODES = {_HOOK_CODE, _STEP_HOOK_CODE, _SharedHook.hook.__code__, _run_each.__code__}


# --------------------------------------------------------------------------- installer

class Installer:
    """Installs hooks and patches for one guard and removes every one of them in `close()`."""

    def __init__(self) -> None:
        self._stack = ExitStack()
        self._graph_handles: List[Any] = []
        self._grad_handles: Dict[int, _Handle] = {}
        # What this guard put on module instances, left out when a module is copied or pickled.
        self._hook_ids: set = set()
        self._hook_fns: set = set()  # the functions given to module_hooks (bound methods: equal, not identical)
        self._module_attrs: Dict[Tuple[int, str], Any] = {}
        self._strips = False
        self.on_copy: Optional[Callable[[nn.Module], None]] = None  # told of each module copied or pickled

    def _keep(self, handle: Any) -> Any:
        self._stack.callback(handle.remove)
        return handle

    # module hooks -----------------------------------------------------------
    def module_hooks(self, module: nn.Module, pre: Optional[Callable], post: Optional[Callable]) -> List[Any]:
        """Forward pre-hook ``pre(module, args, kwargs)`` and always-called ``post(module, args, kwargs, out)``.

        Returns the handles: removing one early (a module nothing watches any more) is safe, close()
        removes whatever is left.
        """
        self._strip_on_copy()
        handles = []
        if pre is not None:
            handles.append(self._keep(module.register_forward_pre_hook(_eager_only(pre), with_kwargs=True)))
        if post is not None:
            handles.append(self._keep(module.register_forward_hook(_eager_only(post), with_kwargs=True,
                                                                   always_call=True)))
        self._hook_ids.update(h.id for h in handles)
        self._hook_fns.update(f for f in (pre, post) if f is not None)
        return handles

    def remove_copies(self, modules: Any) -> None:
        """Remove this installer's module hooks that torch copied onto other modules (``prepare_qat`` and
        ``convert`` register the hooks of a module they swap out on its replacement, under new ids)."""
        fns = self._hook_fns
        if not fns:
            return
        for module in modules:
            for name in _HOOK_DICTS:
                d = module.__dict__.get(name)
                if d:
                    for k in [k for k, v in d.items() if getattr(v, "__wrapped__", None) in fns]:
                        for table in _HOOK_DICTS:  # with its with_kwargs / always_call flags
                            module.__dict__.get(table, {}).pop(k, None)

    def _strip_on_copy(self) -> None:
        """Leave guard's hooks and attributes out of a module's pickled state (``__getstate__``).

        ``copy.deepcopy(model)``, ``torch.save(model)``, ``pickle.dumps(model)`` and
        ``AveragedModel(model)`` then give a plain, unguarded module: the hooks are bound to the
        guard (locks, weak references) and a copy is not what the guard watches.
        """
        if not self._strips:
            self._strips = True
            self._keep(_subscribe("torch.nn.Module.__getstate__", self._strip_state))

    def _strip_state(self, call: Callable, args: tuple, kwargs: dict) -> Any:
        state = call(*args, **kwargs)
        if not isinstance(state, dict):
            return state
        if self.on_copy is not None and args:
            try:
                self.on_copy(args[0])
            except Exception:  # a note for a later notice: never the user's copy's business
                pass
        ids = self._hook_ids
        if ids:
            for name in _HOOK_DICTS:
                d = state.get(name)
                if d and not ids.isdisjoint(d):
                    state[name] = OrderedDict((k, v) for k, v in d.items() if k not in ids)
        if self._module_attrs and args:
            key = id(args[0])
            for (oid, name), (value, had, old) in self._module_attrs.items():
                if oid == key and state.get(name) is value:
                    if had:
                        state[name] = old
                    else:
                        del state[name]
        return state

    def global_module_hooks(self, pre: Optional[Callable], post: Optional[Callable]) -> None:
        """Hooks on every ``nn.Module`` call in the process: ``pre(module, args)``, ``post(module, args, kwargs, out)``.
        Shared by all guards, as the global step hooks are (torch loops over its table at every module call)."""
        if pre is not None:
            self._keep(_FORWARD_PRE.subscribe(pre))
        if post is not None:
            self._keep(_FORWARD_POST.subscribe(post))

    def module_registrations(self, fn: Callable[[nn.Module, str, nn.Module], None]) -> None:
        """``fn(parent, name, module)`` whenever a module registers a submodule anywhere in the process
        (``add_module``, an attribute assignment, ``Sequential.append``); nothing on a torch without the hook.
        Shared by all guards, as the global step hooks are (torch loops over its table during registrations)."""
        if getattr(_module_mod, "register_module_module_registration_hook", None) is not None:
            self._keep(_REGISTRATION.subscribe(fn))

    # optimizer hooks --------------------------------------------------------
    def optimizer_hooks(self, optimizer: Optional[torch.optim.Optimizer], pre: Callable, post: Callable) -> None:
        """Step hooks ``pre(opt, args, kwargs)``/``post(opt, args, kwargs)`` on one optimizer, or all when None."""
        if optimizer is None:
            self._keep(_OPT_PRE.subscribe(pre))
            self._keep(_OPT_POST.subscribe(post))
        else:
            self._keep(optimizer.register_step_pre_hook(_outside_graphs(pre)))
            self._keep(optimizer.register_step_post_hook(_outside_graphs(post)))

    def grad_hook(self, param: torch.Tensor, fn: Callable) -> _Handle:
        """A post-accumulate-grad hook on `param`, until close or the handle's ``remove()``.

        Kept apart from the exit stack so that hooks added and removed every step do not pile up there.
        """
        inner = param.register_post_accumulate_grad_hook(fn)
        live = self._grad_handles

        def remove() -> None:
            live.pop(id(handle), None)
            inner.remove()

        handle = _Handle(remove)
        live[id(handle)] = handle
        return handle

    # patches ----------------------------------------------------------------
    def patch(self, target: str, middleware: Middleware) -> None:
        """Subscribe ``middleware(call, args, kwargs)`` to the shared wrapper of `target` (a dotted path)."""
        self._keep(_subscribe(target, middleware))

    def ignore_warning(self, message: str, category: type = UserWarning) -> None:
        """Ignore warnings whose message matches the regex `message` until close (a warning guard causes)."""
        import warnings

        warnings.filterwarnings("ignore", message=message, category=category)
        entry = warnings.filters[0]

        def remove() -> None:
            try:
                warnings.filters.remove(entry)
                warnings._filters_mutated()  # type: ignore[attr-defined]
            except (ValueError, AttributeError):
                pass

        self._keep(_Handle(remove))

    def attr(self, obj: Any, name: str, value: Any) -> _Handle:
        """Set ``obj.<name> = value`` (an instance attribute) until close or the handle's ``remove()``.

        The previous instance attribute (or its absence) is restored, unless someone replaced ours meanwhile.
        """
        had = name in getattr(obj, "__dict__", {})
        old = obj.__dict__[name] if had else None
        setattr(obj, name, value)
        key = (id(obj), name)
        if isinstance(obj, nn.Module):
            self._strip_on_copy()
            self._module_attrs[key] = (value, had, old)

        def restore() -> None:
            self._module_attrs.pop(key, None)
            if obj.__dict__.get(name) is not value:
                return
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)

        return self._keep(_Handle(restore))

    def graph_prehook(self, node: Any, fn: Callable) -> None:
        """A pre-hook on an autograd graph node (``grad_fn``): it dies with the graph, or is removed on close."""
        handles = self._graph_handles
        if len(handles) >= 1024:  # drop handles whose graph is gone, keep the list bounded
            handles[:] = [h for h in handles if h.hooks_dict_ref() is not None]
        handles.append(node.register_prehook(fn))

    def _remove_graph_hooks(self) -> None:
        handles, self._graph_handles = self._graph_handles, []
        for h in handles:
            h.remove()

    def process_exit(self, obj: Any) -> None:
        self._keep(_watch_process_exit(obj))

    def close(self) -> None:
        stack, self._stack = self._stack, ExitStack()
        try:
            stack.close()
        finally:
            self._hook_ids, self._hook_fns, self._module_attrs, self._strips = set(), set(), {}, False
            self._remove_graph_hooks()
            for handle in list(self._grad_handles.values()):
                handle.remove()
