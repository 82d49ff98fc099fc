"""What the ``torch_guard_autostart.pth`` line calls: ``TORCH_GUARD=...`` turns on a global guard.

The ``.pth`` line loads this file by path (it imports only the standard library, never
``guard``'s package or torch), only when ``TORCH_GUARD`` is in the environment. `install`
validates the environment (a bad value: one line on stderr, exit status 2), then puts a
`sys.meta_path` finder in place that waits for ``import torch``; once torch has finished
importing, a global guard (``guard()`` with no model) starts with `guard.config.env_options`.
The report is written at exit (``TORCH_GUARD_REPORT``, default ``guard-report.json``), only
if the process ran a model, an optimizer step, or produced findings, so helper processes that
merely import torch (compile workers, spawned DataLoader workers) leave no empty dumps.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Optional

#: the name this module is registered under when loaded by the .pth line (runs once per process)
MODULE_NAME = "_torch_guard_autostart"

_guard: Any = None  # the started guard (held strongly: the exit hook holds guards weakly)
_finder: Optional["_TorchFinder"] = None
_pending = False  # torch is imported but guard itself was still importing


def _config_module():
    """``guard/config.py`` without importing the package (which imports torch)."""
    loaded = sys.modules.get("guard.config")
    if loaded is not None:
        return loaded
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config.py")
    spec = importlib.util.spec_from_file_location("_torch_guard_config", path)
    mod = sys.modules.get(spec.name)
    if mod is None:
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up while the class is made
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
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
        if opts is not None:  # env_options leaves the report path to guard(); check it now, not at import torch
            cfg.parse_report(opts.get("report"), f"{cfg.ENV_PREFIX}_REPORT")
    except cfg.ConfigError as exc:
        _fail(str(exc))
        return False
    if opts is None:
        return False
    if _guard is not None or _finder is not None:
        return True
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
        pkg = sys.modules.get("guard")
        if pkg is not None and getattr(getattr(pkg, "__spec__", None), "_initializing", False):
            # `import guard` is importing torch: guard/__init__.py calls start_pending() once it is complete.
            global _pending
            _pending = True
            return
        start()


def start_pending() -> None:
    """Called at the end of guard/__init__.py: start the guard whose start waited for guard itself."""
    global _pending
    if _pending:
        _pending = False
        start()


def start() -> Any:
    """Start the process-wide guard from the environment (torch is imported by now)."""
    global _guard
    if _guard is not None:
        return _guard
    from guard.config import ConfigError, env_options

    try:
        opts = env_options()
        if opts is None:
            return None
        from guard.session import Guard

        g = Guard(None, None, **opts)
        g.process_wide = True  # report only if the process did anything guard saw; remember its rank
        g.start()
    except ConfigError as exc:
        _fail(str(exc))
        return None
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
        import dataclasses

        g.config = dataclasses.replace(g.config, report=None, live=False)
        g.close()
