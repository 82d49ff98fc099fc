"""Healthy training scripts: common correct patterns that must produce no findings.

Each module defines ``train(use_guard=True, **guard_options) -> (guard_or_None, model)``;
with ``use_guard=False`` the identical body runs without guard (for numerics comparisons).
"""
import importlib
import pkgutil

NAMES = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def load(name):
    return importlib.import_module(f"{__name__}.{name}")
