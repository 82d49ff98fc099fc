"""torchsnooper on demand: trace the next forward of the module that produced NaN/Inf.

Off unless ``snoop=True`` or ``TORCH_GUARD_SNOOP=1`` (tracing every line is slow).
When a ``nonfinite-output`` finding appears (checked once per step), the next
call of that module runs its ``forward`` under ``torchsnooper.snoop()``: the
module gets an instance attribute ``forward`` for exactly one call, set and
removed through the guard's Installer (so it is gone on close too). The
line-by-line trace (shapes, dtypes, devices, NaN flags) is stored in the
finding's ``details["trace"]`` (capped) and, when live output is on, a
collapsed form (the first line whose result holds NaN/Inf) is printed.

torchsnooper 0.8 imports ``pkg_resources`` (only to read its own version),
which setuptools >= 82 no longer ships: when that import fails, a minimal
stand-in is put in ``sys.modules`` while torchsnooper is imported, and taken
out again. Without an importable torchsnooper guard says so once, in one
line, and carries on without traces.
"""
from __future__ import annotations

import os
import re
import sys
import warnings
import weakref
from typing import Any, List, Optional, Set

from ..config import ConfigError, parse_bool
from .base import Check

KIND = "nonfinite-output"
MAX_LINES = 200
MAX_CHARS = 240
_said: Set[str] = set()  # one line per process per problem
_NAN = re.compile(r"has_(nan|inf)")


def _say_once(key: str, line: str) -> None:
    if key in _said:
        return
    _said.add(key)
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except Exception:
        pass


class _DistributionNotFound(Exception):
    pass


class _Distribution:
    def __init__(self, name: str):
        from importlib import metadata

        try:
            self.version = metadata.version(name)
        except metadata.PackageNotFoundError:
            raise _DistributionNotFound(name) from None
        self.project_name = name


def _pkg_resources_stand_in() -> Any:
    """The part of ``pkg_resources`` torchsnooper 0.8 uses (``get_distribution(name).version``)."""
    import types

    mod = types.ModuleType("pkg_resources", "guard's stand-in while torchsnooper is imported")
    mod.get_distribution = _Distribution  # type: ignore[attr-defined]
    mod.DistributionNotFound = _DistributionNotFound  # type: ignore[attr-defined]
    return mod


def _import_torchsnooper() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pkg_resources' own deprecation warning
        try:
            import torchsnooper  # type: ignore[import-not-found]
            return torchsnooper
        except ImportError as exc:
            if getattr(exc, "name", None) != "pkg_resources" or "pkg_resources" in sys.modules:
                raise
        stand_in = sys.modules["pkg_resources"] = _pkg_resources_stand_in()
        try:
            import torchsnooper  # type: ignore[import-not-found]  # noqa: F811
            return torchsnooper
        finally:
            if sys.modules.get("pkg_resources") is stand_in:
                del sys.modules["pkg_resources"]


def load_torchsnooper() -> Any:
    """The torchsnooper module, or None after saying once why it cannot be imported."""
    try:
        return _import_torchsnooper()
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"
        _say_once("import", f"guard: snoop is on but torchsnooper cannot be imported ({why}); "
                            f"continuing without traces")
        return None


def collapse(trace: List[str]) -> Optional[str]:
    """The first traced source line whose result holds NaN/Inf, with that value (None if none did)."""
    last_line = None
    for ln in trace:
        s = ln.strip()
        if " line " in f" {s} " and not s.startswith(("New var", "Modified var", "Starting var", "Return value")):
            num, _, code = s.split("line", 1)[-1].strip().partition(" ")
            last_line = f"line {num}: {code.strip()}"
        elif _NAN.search(s):
            return f"{last_line} -> {s.split('.. ', 1)[-1]}" if last_line else s
    return None


class SnoopTrace(Check):
    name = "snoop"
    default = False  # listed "off": it acts only with snoop=True
    # Emits nothing itself; it adds a trace to nonfinite-output findings, so it is built whenever that kind is
    # on (`always`). Switch it with snoop=, not checks=.
    always = True
    kinds = {
        KIND: ("error", "a module produced NaN/Inf from finite inputs"),
    }
    description = ("option snoop=True / TORCH_GUARD_SNOOP=1 (not checks=): torchsnooper trace of the next forward "
                   "of a module that produced NaN/Inf")

    def __init__(self, guard):
        super().__init__(guard)
        on = bool(guard.config.snoop)
        env = os.environ.get("TORCH_GUARD_SNOOP")
        if not on and env is not None:
            try:
                on = parse_bool(env, "TORCH_GUARD_SNOOP")
            except ConfigError as exc:
                _say_once("env", f"{exc}; snoop stays off")
        self._on = on
        self._ts: Any = None
        self._done: Set[str] = set()  # `where`s already armed or traced
        self._seen = 0

    def on_start(self):
        if self._on:
            self._ts = load_torchsnooper()
            self._on = self._ts is not None

    def on_resolved(self):
        if not self._on:
            return
        findings = self.g.findings
        if len(findings) == self._seen:
            return
        new, self._seen = findings[self._seen:], len(findings)
        for f in new:
            if f.kind == KIND and f.where not in self._done:
                self._done.add(f.where)
                module = self._module_at(f.where)
                if module is not None:
                    self._arm(module, f.where)

    def _module_at(self, path: str) -> Any:
        roots = self.g.roots  # global mode: the roots seen
        for root in roots:
            for mod in root.modules():
                if self.g.path_of(mod) == path:
                    return mod
        return None

    def _arm(self, module: Any, where: str) -> None:
        fwd = getattr(type(module), "forward", None)
        if getattr(fwd, "__code__", None) is None:
            return  # not a Python function (scripted, C++): nothing to trace line by line
        lines: List[str] = []

        def write(s: str) -> None:
            for ln in s.splitlines():
                if len(lines) < MAX_LINES:
                    lines.append(ln[:MAX_CHARS])
                elif len(lines) == MAX_LINES:
                    lines.append(f"... trace capped at {MAX_LINES} lines")

        snooped = self._ts.snoop(output=write, normalize=True, color=False, max_variable_length=120)(fwd)
        ref = weakref.ref(module)
        check = self
        handle: List[Any] = []

        def forward(*args: Any, **kwargs: Any) -> Any:
            handle[0].remove()  # exactly one traced call
            mod = ref()
            try:
                return snooped(mod, *args, **kwargs)
            finally:
                check._store(where, lines)

        # Through the Installer: removed after the call, or on close if the module never runs again.
        handle.append(self.g.replace_attr(module, "forward", forward))

    def _store(self, where: str, lines: List[str]) -> None:
        short = collapse(lines)
        self.g.update_details(KIND, where, trace=list(lines), trace_step=self.g.step, trace_first_nonfinite=short)
        if self.g.config.live and self.g.config.mode != "record":
            _say_once(f"trace:{id(self.g)}:{where}",
                      f"guard: torchsnooper trace of `{where}` at step {self.g.step} ({len(lines)} lines in "
                      f"details.trace)" + (f"; first NaN/Inf: {short}" if short else "; no NaN/Inf this time"))
