"""The check registry: every `Check` subclass in a module of this package.

Adding a check is adding a file here; nothing else needs editing (``python -m guard.checks
--readme-table`` prints the README's checks table from the registry).
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Dict, Type

from .base import Check

_registry: Dict[str, Type[Check]] = {}


def registry() -> Dict[str, Type[Check]]:
    """name -> Check class, discovered once from the modules of ``guard.checks``."""
    if not _registry:
        found: Dict[str, Type[Check]] = {}
        for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
            if info.name.startswith("_") or info.name == "base":
                continue
            mod = importlib.import_module(f"{__name__}.{info.name}")
            for obj in vars(mod).values():
                if isinstance(obj, type) and issubclass(obj, Check) and obj is not Check and obj.name:
                    if obj.__module__ == mod.__name__:
                        found[obj.name] = obj
        _registry.update(found)
    return _registry


def readme_table() -> str:
    """The README's checks table (markdown, one row per check), generated from the registry."""
    rows = ["| check | kinds (severity) | what it catches | default |", "|---|---|---|---|"]
    for name, cls in sorted(registry().items()):
        kinds = "<br>".join(f"`{k}` ({sev})" for k, (sev, _) in cls.kinds.items())
        rows.append(f"| `{name}` | {kinds} | {cls.description} | {'on' if cls.default else 'off'} |")
    return "\n".join(rows) + "\n"


__all__ = ["Check", "readme_table", "registry"]
