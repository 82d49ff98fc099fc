"""``TORCH_GUARD=...`` turns on a process-wide guard with no change to the program.

The ``torch_guard_autostart.pth`` line imports the tiny top-level hook ``_torch_guard_autostart``,
which does nothing unless ``TORCH_GUARD`` is on; then it locates *this* package while ``sys.path``
holds only the interpreter's and the environment's folders (not yet the script's folder or the
working directory, so a user's own ``guard.py`` is never taken for guard) and loads this file.
This module imports only the standard library until torch is imported.

PYTEST_DONT_REWRITE: pytest marks this distribution's modules for assertion rewriting (guard's pytest
plugin), and this one is imported at interpreter start, before pytest: without the marker pytest
warns that it cannot rewrite it, an error under ``-W error`` or ``filterwarnings = error``.

`install` validates the environment (a bad value: one line on stderr, exit status 2; an unknown
``TORCH_GUARD_*`` variable: a one-line warning), then puts a `sys.meta_path` finder in place that
waits for ``import torch``; once torch has finished importing, a global guard starts through the
public API: ``guard(background=True, **env_options())``. A background guard writes one report per
process, only if that process saw anything, and steps aside while a guard from the code is active.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Optional

#: the name this module is registered under (the .pth hook replaces itself with it; runs once per process)
MODULE_NAME = "_torch_guard_autostart"
#: the installed package this hook belongs to (its folder), found when the .pth line ran
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
#: the name the package is loaded under when the program's own ``guard`` module takes the name ``guard``
ALIAS = "_torch_guard_pkg"

_guard: Any = None  # the started guard (held strongly: the exit hook holds guards weakly)
_finder: Optional["_TorchFinder"] = None
_pending = False  # torch is imported but guard itself was still importing


def _config_module():
    """``guard/config.py`` (standard library only) without importing the package or naming ``guard``."""
    import importlib
    import importlib.util

    pkg = _loaded_package()
    if pkg is not None:
        return importlib.import_module(pkg.__name__ + ".config")

    spec = importlib.util.spec_from_file_location("_torch_guard_config", os.path.join(PACKAGE_DIR, "config.py"))
    mod = sys.modules.get(spec.name)
    if mod is None:
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up while the class is made
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def _is_ours(module: Any) -> bool:
    try:
        return os.path.dirname(os.path.abspath(module.__file__)) == PACKAGE_DIR
    except Exception:
        return False


def _loaded_package() -> Any:
    """This package if it is already imported (as ``guard`` or under the alias), else None."""
    for name in ("guard", ALIAS):
        mod = sys.modules.get(name)
        if mod is not None and _is_ours(mod):
            return mod
    return None


def _package() -> Any:
    """This installed package: imported as ``guard`` when that name is ours, else loaded under `ALIAS`."""
    pkg = _loaded_package()
    if pkg is not None:
        return pkg
    import importlib
    import importlib.util

    if "guard" not in sys.modules:
        spec = importlib.util.find_spec("guard")
        if spec is not None and spec.origin and os.path.dirname(os.path.abspath(spec.origin)) == PACKAGE_DIR:
            return importlib.import_module("guard")
    # The program has a `guard` of its own (a guard.py next to the script): leave that name to it.
    spec = importlib.util.spec_from_file_location(ALIAS, os.path.join(PACKAGE_DIR, "__init__.py"),
                                                  submodule_search_locations=[PACKAGE_DIR])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[ALIAS] = mod
    try:
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
    except BaseException:
        sys.modules.pop(ALIAS, None)
        raise
    return mod


def _fail(message: str) -> None:
    """Stop the program with one line and exit status 2 (no traceback)."""
    try:
        for stream in (sys.stdout, sys.stderr):  # os._exit skips the flush of what the program printed
            try:
                stream.flush()
            except Exception:
                pass
        sys.stderr.write(message.rstrip("\n") + "\n")
        sys.stderr.flush()
    finally:
        os._exit(2)


def install(environ: Optional[dict] = None) -> bool:
    """Validate ``TORCH_GUARD*`` and arrange for a guard to start once torch is imported.

    Returns True when a guard is (or will be) started. Idempotent.
    """
    global _finder
    cfg = _config_module()
    try:
        opts = cfg.env_options(environ)
    except cfg.ConfigError as exc:
        _fail(str(exc))
        return False
    if opts is None:
        return False
    if _guard is not None or _finder is not None:
        return True
    if "_TORCH_GUARD_MAIN_PID" not in os.environ:  # said once, by the main process, not by each worker
        for line in cfg.unknown_env(environ):
            sys.stderr.write(line + "\n")
    if "torch" in sys.modules and getattr(sys.modules["torch"], "nn", None) is not None:
        start()
        return True
    _finder = _TorchFinder()
    sys.meta_path.insert(0, _finder)
    return True


class _TorchFinder:
    """A meta-path finder that only watches for the top-level ``torch`` import."""

    def find_spec(self, name: str, path: Any = None, target: Any = None):
        if name != "torch":
            return None
        self.remove()
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _StartAfterLoader(spec.loader)
                return spec
        return None

    def remove(self) -> None:
        global _finder
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        if _finder is self:
            _finder = None


class _StartAfterLoader:
    """Runs torch's own loader, puts it back on the module, then starts the guard."""

    def __init__(self, loader: Any):
        self._loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        try:
            module.__loader__ = self._loader
            if getattr(module, "__spec__", None) is not None:
                module.__spec__.loader = self._loader
        except Exception:
            pass
        self._loader.exec_module(module)
        if _guard_importing():
            # one of guard's own modules is importing torch: start once it is complete (its Guard is needed)
            global _pending
            _pending = True
            sys.meta_path.insert(0, _PendingStart())
            return
        start()


def _guard_importing() -> bool:
    """Is a module of this package being imported right now (half made)?"""
    for name, mod in list(sys.modules.items()):
        if (name == "guard" or name.startswith(("guard.", ALIAS))) and _is_ours(mod) \
                and getattr(getattr(mod, "__spec__", None), "_initializing", False):
            return True
    return False


class _PendingStart:
    """Starts the waiting guard at the next import once guard's own modules are complete."""

    def find_spec(self, name: str, path: Any = None, target: Any = None):
        if not _pending:
            self._remove()
        elif not _guard_importing():
            self._remove()
            start_pending()
        return None

    def _remove(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


def start_pending() -> None:
    """Start the guard whose start waited for guard's own modules (called when they are complete)."""
    global _pending
    if _pending and not _guard_importing():
        _pending = False
        start()


def start() -> Any:
    """Start the process-wide guard from the environment (torch is imported by now)."""
    global _guard
    if _guard is not None:
        return _guard
    pkg = _package()
    import importlib

    cfg = importlib.import_module(pkg.__name__ + ".config")
    try:
        opts = cfg.env_options()
        if opts is None:
            return None
        g = pkg.guard(None, None, background=True, **opts)
        g.start()
    except cfg.ConfigError as exc:
        _fail(str(exc))
        return None
    if g.config.report and os.environ.get("_TORCH_GUARD_MAIN_PID") == str(os.getpid()):
        # children (subprocesses, spawned workers) write next to this process's report, whatever their cwd
        os.environ[f"{cfg.ENV_PREFIX}_REPORT"] = g.config.report
    _guard = g
    return g


def active() -> Any:
    """The guard started from the environment, or None."""
    return _guard


def discard() -> None:
    """Stop the environment's guard without writing its report (``python -m guard run`` brings its own)."""
    global _guard
    if _finder is not None:
        _finder.remove()
    g, _guard = _guard, None
    if g is not None:
        g.close(write_report=False)
