"""guard: a runtime guard for PyTorch training code.

    from guard import guard
    with guard(model, optimizer) as g:
        train()
    print(g.findings)
"""
from __future__ import annotations

from typing import Any

from .config import ConfigError
from .findings import Finding, GuardError
from .session import Guard, GuardInternalWarning
from .wrap import wrap
from .checks.state_dict import explain_state_dict

__version__ = "0.1.0"


def guard(model: Any = None, optimizer: Any = None, *, checks: Any = "default", mode: Any = "warn",
          report: Any = None, live: Any = None, every: Any = 1, **options: Any) -> Guard:
    """Create a `Guard` over `model` and `optimizer` (both optional; either may be a list).

    Use it as ``with guard(...) as g:``, as a decorator, or ``g = guard(...).start()`` ... ``g.close()``.
    ``checks``: "default", "all", or names (``"-name"`` removes); ``mode``: "warn", "raise" or "record";
    ``report``: a dump path (``.html`` for HTML, else JSON); ``live``: print findings as they happen;
    ``every``: run per-step device checks every N steps.
    """
    import inspect

    if callable(model) and (inspect.isfunction(model) or inspect.ismethod(model)) and optimizer is None:
        return Guard(None, None, checks=checks, mode=mode, report=report, live=live, every=every, **options)(model)
    return Guard(model, optimizer, checks=checks, mode=mode, report=report, live=live, every=every, **options)


guard.wrap = wrap  # type: ignore[attr-defined]
guard.Guard = Guard  # type: ignore[attr-defined]
guard.explain_state_dict = explain_state_dict  # type: ignore[attr-defined]

__all__ = ["guard", "wrap", "Guard", "Finding", "GuardError", "ConfigError", "GuardInternalWarning", "explain_state_dict"]

# TORCH_GUARD: when `import guard` is what imported torch, the environment's guard starts now.
_autostart = __import__("sys").modules.get("_torch_guard_autostart")
if _autostart is not None:
    _autostart.start_pending()
del _autostart
