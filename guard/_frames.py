"""Finding the user's source line: the first frame outside torch and guard."""
from __future__ import annotations

import os
import sys
from typing import Optional

import torch

_SKIP = tuple(
    os.path.dirname(os.path.abspath(p)) + os.sep
    for p in (torch.__file__, os.path.dirname(__file__) + os.sep + "__init__.py")
) + (os.path.dirname(os.path.abspath(__import__("contextlib").__file__)) + os.sep + "contextlib.py",)
_cache: dict = {}


def is_skipped(filename: str) -> bool:
    """Whether `filename` belongs to torch, guard or contextlib (not the user's code)."""
    hit = _cache.get(filename)
    if hit is None:
        hit = filename.startswith("<") or os.path.abspath(filename).startswith(_SKIP)
        if len(_cache) < 10000:
            _cache[filename] = hit
    return hit


def user_source(depth: int = 1) -> Optional[str]:
    """``file:line`` of the innermost frame that belongs to neither torch nor guard."""
    try:
        f = sys._getframe(depth)
    except ValueError:
        return None
    cache = _cache
    while f is not None:
        name = f.f_code.co_filename
        skip = cache.get(name)  # inlined is_skipped (a call per frame, several walks a step)
        if skip is None:
            skip = is_skipped(name)
        if not skip:
            short = _short_cache.get(name)
            return f"{short if short is not None else short_path(name)}:{f.f_lineno}"
        f = f.f_back
    return None


def user_frame(depth: int = 1):
    """The innermost frame that belongs to neither torch nor guard (for checks that read its code)."""
    try:
        f = sys._getframe(depth)
    except ValueError:
        return None
    while f is not None and is_skipped(f.f_code.co_filename):
        f = f.f_back
    return f


_short_cache: dict = {}


def short_path(path: str) -> str:
    """`path` relative to the working directory, or whole when it lies outside."""
    key = path  # relpath is slow and asked for several times a step (relative to the first working directory)
    hit = _short_cache.get(key)
    if hit is not None:
        return hit
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    hit = path if rel.startswith("..") else rel  # outside the working directory: the full path reads better
    if len(_short_cache) < 10000:
        _short_cache[key] = hit
    return hit
