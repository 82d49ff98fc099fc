"""The `Check` base class: what a check declares and the events it can handle.

A check never installs hooks. It declares:

* ``name`` - the check's selection name (``checks=["-name"]``),
* ``kinds`` - the finding kinds it emits (severities come from the vocabulary),
* ``default`` - whether ``checks="default"`` turns it on,
* ``patches`` - ``{event: "dotted.target"}`` shared functions it wants observed,
* ``watches(module)`` / ``steady(module, output)`` - which layers' calls it wants, first and
  after their first call (a layer nobody keeps loses its hooks),

and implements ``on_<event>`` methods. The guard installs only what the active
checks handle and routes each event to them. Events:

``start()``, ``forward_pre(module, path, args, kwargs, is_root)``,
``forward(module, path, args, kwargs, output, is_root)``,
``backward(tensors, kwargs)``, ``backward_done(tensors, kwargs)``,
``step_pre(optimizer)``, ``step_post(optimizer)``, ``step_end(step)``,
``resolved()`` (after staged device values were read: once per step, and when the user reads
findings mid-step, then with ``guard.mid_step`` True: end-of-step work waits for the step's end),
``exception(exc)`` (escaping the guarded block), ``exit()``, and for each
declared patch ``<event>(args, kwargs)``, ``<event>_done(args, kwargs, result)``,
``<event>_error(args, kwargs, exc)``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Dict, Tuple

if TYPE_CHECKING:  # pragma: no cover
    from ..session import Guard

CORE_EVENTS = (
    "start", "forward_pre", "forward", "backward", "backward_done", "step_pre", "step_post",
    "step_end", "resolved", "exception", "exit",
)


class Check:
    """Base class of all checks; subclasses live one per file in ``guard/checks/``."""

    name: ClassVar[str] = ""
    kinds: ClassVar[Tuple[str, ...]] = ()
    default: ClassVar[bool] = True
    description: ClassVar[str] = ""
    patches: ClassVar[Dict[str, str]] = {}

    def __init__(self, guard: "Guard"):
        self.g = guard

    @classmethod
    def events(cls) -> Tuple[str, ...]:
        """The events this check handles (the ``on_*`` methods it defines)."""
        names = set(CORE_EVENTS)
        for ev in cls.patches:
            names |= {ev, ev + "_done", ev + "_error"}
        return tuple(sorted(e for e in names if callable(getattr(cls, "on_" + e, None))))

    def watches(self, module) -> bool:
        """Whether this check's forward handlers want `module`'s non-root calls (asked once per module).

        Root calls always reach every check. Narrowing this (to BatchNorm layers, to modules with
        parameters, ...) takes the check off the hot path of every other layer.
        """
        return True

    def steady(self, module, output) -> bool:
        """After `module`'s first (non-root) call returned `output`: keep watching its later calls?

        Asked once per module, only of checks that watch it. A module no check keeps loses its hooks,
        so that layers with nothing left to check cost nothing per call (the module table, the device
        comparison and the like need one call of each layer).
        """
        return True

    def emit(self, kind: str, where: str, message: str, hint: str, **kw) -> None:
        """Report a finding (de-duplicated by kind and where)."""
        self.g.emit(kind, where, message, hint, check=self, **kw)
