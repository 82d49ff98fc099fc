"""Module calls in flight per thread, for a global guard that must tell outermost calls from nested ones."""
from __future__ import annotations

from typing import Any, List


def push_call(tls: Any, frame: Any) -> int:
    """Record a module call in flight in this thread (its hook-calling frame); returns how many enclose it.

    A counter would stay raised when a KeyboardInterrupt (any BaseException) leaves a forward, since
    torch then skips the always-called hooks: every later call would look nested. Calls whose frame
    is no longer on this thread's stack are dropped instead (found in a few frame hops per call).
    """
    calls: List[Any] = getattr(tls, "calls", None)
    if calls is None:
        calls = tls.calls = []
    if calls:
        top = calls[-1]
        f, hops = frame.f_back, 12  # a direct child: _call_impl, _wrapped_call_impl, parent's forward, top
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


def pop_call(tls: Any) -> bool:
    """A module call returned: True when it was an outermost one."""
    calls = getattr(tls, "calls", None)
    if calls:
        calls.pop()
    return not calls
