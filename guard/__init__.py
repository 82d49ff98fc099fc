"""guard: a runtime guard for PyTorch training code.

    from guard import guard
    with guard(model, optimizer) as g:
        train()
    print(g.findings)

Importing guard is cheap (standard library only): torch and the checks are imported when
``guard(...)`` is first called or a name below is first used (PEP 562 ``__getattr__``).
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: public name -> the submodule that defines it (imported on first use)
_LAZY = {
    "Guard": "session",
    "GuardInternalWarning": "session",
    "wrap": "wrap",
    "explain_state_dict": "checks.state_dict",
    "Finding": "findings",
    "GuardError": "findings",
    "ConfigError": "config",
}


def __getattr__(name: str) -> Any:
    sub = _LAZY.get(name)
    if sub is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{sub}"), name)
    globals()[name] = value  # later uses are plain attribute reads
    _start_pending()
    return value


def _start_pending() -> None:
    """TORCH_GUARD: if importing guard's modules is what imported torch, the environment's guard starts now."""
    auto = __import__("sys").modules.get("_torch_guard_autostart")
    start = getattr(auto, "start_pending", None)
    if start is not None:
        start()  # does nothing unless a start is pending


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY))


class _GuardFunction:
    """``guard(...)``; also carries ``guard.wrap``, ``guard.Guard`` and ``guard.explain_state_dict``."""

    def __call__(self, model: Any = None, optimizer: Any = None, *, checks: Any = "default", mode: Any = "warn",
                 report: Any = None, live: Any = None, every: Any = 1, **options: Any) -> Any:
        """Create a `Guard` over `model` and `optimizer` (both optional; either may be a list).

        Use it as ``with guard(...) as g:``, as a decorator, or ``g = guard(...).start()`` ... ``g.close()``.
        ``checks``: "default", "all", or names (``"-name"`` removes); ``mode``: "warn", "raise" or "record";
        ``report``: a dump path (``.html`` for HTML, else JSON); ``live``: print findings as they happen;
        ``every``: run per-step device checks every N steps.
        """
        import inspect

        Guard = __getattr__("Guard")
        owner = getattr(model, "__self__", None)
        if inspect.ismethod(model) and _is_module(owner):
            from .config import ConfigError

            raise ConfigError(f"guard: model={type(owner).__name__}.{model.__name__} is a method of a module; "
                              f"allowed: the module itself (guard(model), not guard(model.{model.__name__}))")
        if callable(model) and (inspect.isfunction(model) or inspect.ismethod(model)) and optimizer is None:
            return Guard(None, None, checks=checks, mode=mode, report=report, live=live, every=every, **options)(model)
        return Guard(model, optimizer, checks=checks, mode=mode, report=report, live=live, every=every, **options)

    def __getattr__(self, name: str) -> Any:
        if name in ("wrap", "Guard", "explain_state_dict"):
            return __getattr__(name)
        raise AttributeError(f"guard() has no attribute {name!r}")

    def __repr__(self) -> str:
        return "<function guard>"


def _is_module(obj: Any) -> bool:
    import sys

    nn = sys.modules.get("torch.nn")
    return nn is not None and isinstance(obj, nn.Module)


guard = _GuardFunction()
guard.__doc__ = _GuardFunction.__call__.__doc__

__all__ = ["guard", "wrap", "Guard", "Finding", "GuardError", "ConfigError", "GuardInternalWarning", "explain_state_dict"]
