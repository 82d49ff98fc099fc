"""What the framework callbacks share: counting findings by severity, closing a guard safely."""
from __future__ import annotations

from typing import Any, Dict, Optional

from ..findings import GuardError


def counts(g: Any) -> Dict[str, float]:
    """``{"guard/errors": n, "guard/warnings": n, "guard/infos": n}`` of a guard's findings."""
    out = {"guard/errors": 0.0, "guard/warnings": 0.0, "guard/infos": 0.0}
    for f in g.findings:
        key = f"guard/{f.severity}s"
        if key in out:
            out[key] += 1
    return out


def close(g: Optional[Any], exc: Optional[BaseException] = None) -> None:
    """Close `g` (report written); with `exc`, as a ``with`` block left by that exception."""
    if g is None or not g.active:
        return
    if exc is not None:
        g.__exit__(type(exc), exc, exc.__traceback__)
        return
    try:
        g.close()
    except GuardError:
        pass  # raise mode: the finding was raised (and seen) when it happened
