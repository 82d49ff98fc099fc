"""Finding the user's source line: the first frame outside torch, guard, frameworks and the standard library.

Frames inside site-packages (Lightning, transformers, accelerate, ...) and the standard library
are not the user's: the line to show is their ``training_step``, ``compute_loss`` or training
loop. Only when no frame of the user's own is on the stack does a framework frame stand in.
"""
from __future__ import annotations

import inspect
import os
import sys
import sysconfig
from typing import Any, Callable, Dict, Optional

import torch

_SKIP = tuple(
    os.path.dirname(os.path.abspath(p)) + os.sep
    for p in (torch.__file__, os.path.dirname(__file__) + os.sep + "__init__.py")
) + (os.path.dirname(os.path.abspath(__import__("contextlib").__file__)) + os.sep + "contextlib.py",)


def _library_roots() -> tuple:
    roots = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        try:
            path = sysconfig.get_paths().get(key)
        except Exception:
            path = None
        if path:
            roots.add(os.path.abspath(path) + os.sep)
    for path in sys.path:
        if path and os.path.basename(path.rstrip(os.sep)) in ("site-packages", "dist-packages"):
            roots.add(os.path.abspath(path) + os.sep)
    return tuple(sorted(roots))


_LIBS = _library_roots()
_MARKERS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
_cache: dict = {}  # filename -> 0 (user), 1 (library: a framework or the stdlib), 2 (torch, guard, <...>)
_TYPED = ("<stdin>", "<ipython-input-")


def _level(filename: str) -> int:
    hit = _cache.get(filename)
    if hit is None:
        path = os.path.abspath(filename)
        if filename.startswith(_TYPED):
            hit = 0  # `python -` and old IPython cells: the user's code, typed in (no file)
        elif filename.startswith("<") or path.startswith(_SKIP):
            hit = 2  # generated code (dataclasses' <string>, torch.fx's <eval_with_key>), frozen modules
        elif path.startswith(_LIBS) or any(m in path for m in _MARKERS):
            hit = 1
        else:
            hit = 0
        if len(_cache) < 10000:
            _cache[filename] = hit
    return hit


def _skipped(filename: str) -> bool:
    """Not the user's code: torch, guard, a library in site-packages, or the standard library."""
    return _level(filename) > 0


def is_skipped(filename: str) -> bool:
    """Whether `filename` is not the user's code (torch, guard, the standard library, installed packages)."""
    return _level(filename) != 0


#: library frames between a call and the user's frame from which a framework runs the loop (Lightning's
#: `trainer.fit(...)`: dozens); a helper the user's loop calls (`accelerator.backward(loss)`) passes a few
DEEP_LIBRARY = 8


def user_source(depth: int = 1, libs: Optional[list] = None) -> Optional[str]:
    """``file:line`` of the innermost user frame (a framework frame when no user frame is on the stack).

    With `libs` (a list), the number of library frames passed before that user frame is appended to it."""
    try:
        f = sys._getframe(depth)
    except ValueError:
        return None
    fallback = None
    passed = 0
    cache = _cache
    while f is not None:
        try:
            level = cache[f.f_code.co_filename]  # inlined lookup (a call per frame, several walks a step)
        except KeyError:
            level = _level(f.f_code.co_filename)
        if level == 2:  # torch and guard: most frames of a walk
            f = f.f_back
            continue
        if level == 0:
            if libs is not None:
                libs.append(passed)
            # The same few lines call the model, backward() and step() at every step: their text is kept
            # by code object and instruction (f_lineno decodes the line table, and the f-string allocates).
            # Keyed by the code object's identity (code objects compare equal across files when their
            # source is the same), which the entry keeps alive so that the id is not reused.
            code = f.f_code
            key = (id(code), f.f_lasti)
            hit = _line_cache.get(key)
            if hit is None or hit[0] is not code:
                name = code.co_filename
                short = _short_cache.get(name)
                hit = (code, f"{short if short is not None else short_path(name)}:{f.f_lineno}")
                if len(_line_cache) >= 4096:
                    _line_cache.clear()
                _line_cache[key] = hit
            return hit[1]
        if level == 1:
            passed += 1
            if fallback is None:
                fallback = f
        f = f.f_back
    return f"{short_path(fallback.f_code.co_filename)}:{fallback.f_lineno}" if fallback is not None else None


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
_line_cache: dict = {}  # (id(code object), instruction offset) -> (the code object, "file:line")


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


_sources: Dict[Any, Optional[str]] = {}


def source_text(fn: Any) -> Optional[str]:
    """The source of a function (a module class's ``forward``), read once and kept; None when it cannot be read
    (C code, a class typed into a notebook cell). The checks that judge a forward by what it says use it."""
    try:
        return _sources[fn]
    except KeyError:
        pass
    except TypeError:  # (an unhashable callable)
        return None
    try:
        src: Optional[str] = inspect.getsource(fn)
    except (OSError, TypeError):
        src = None
    if len(_sources) < 1024:
        _sources[fn] = src
    return src


def source_match(obj: Any, test: Callable[[str], bool]) -> Optional[str]:
    """``file:line`` of the first line of `obj`'s source (a class or a function) that passes `test`; None when none
    does or the source cannot be read (a class defined in a notebook cell, C code)."""
    try:
        lines, start = inspect.getsourcelines(obj)
        fname = inspect.getsourcefile(obj)
    except (OSError, TypeError):
        return None
    for i, text in enumerate(lines):
        if test(text):
            return f"{short_path(fname) if fname else '?'}:{start + i}"
    return None


CO_OPTIMIZED = 0x0001  # inspect.CO_OPTIMIZED: a function's frame (fast locals)


def frame_locals(frame: Any) -> Dict[str, Any]:
    """`frame`'s local variables, read without keeping them alive. Before Python 3.13 a function frame's
    ``f_locals`` is a snapshot the frame keeps until it returns: read in a training loop, it would hold that
    moment's objects (an optimizer replaced since, a loss and its graph) for the rest of the run. So the
    snapshot is copied and emptied, unless something else holds it (the function's own ``locals()`` result)."""
    d = frame.f_locals
    if sys.version_info >= (3, 13) or not frame.f_code.co_flags & CO_OPTIMIZED:  # 3.13+: a write-through view
        return d
    out = dict(d)
    if sys.getrefcount(d) <= 3:  # the frame's own reference, `d` and getrefcount's argument
        d.clear()  # the fast locals are untouched; the next read of f_locals fills it again
    return out



def variable_naming(obj: Any, limit: int = 12) -> Optional[str]:
    """The name of a variable of the user's code (innermost frame first, then its module's globals) whose
    value is `obj` itself (`weights` for ``weights = nn.Parameter(torch.ones(3))``), else an entry of a dict or
    list a variable holds (`params['0.weight']` of ``stack_module_state``). None when none is."""
    scopes = []
    try:
        f = sys._getframe(1)
    except ValueError:
        return None
    while f is not None and len(scopes) < 2 * limit:
        if not is_skipped(f.f_code.co_filename):
            scopes += [frame_locals(f), f.f_globals]
        f = f.f_back
    for scope in scopes:
        for k, v in scope.items():
            if v is obj and not k.startswith("_"):
                return k
    for scope in scopes:
        for k, v in scope.items():
            if k.startswith("_"):
                continue
            if type(v) is dict and len(v) <= 1024:
                for key, item in v.items():
                    if item is obj and isinstance(key, (str, int)):
                        return f"{k}[{key!r}]"
            elif type(v) in (list, tuple) and len(v) <= 1024:
                for i, item in enumerate(v):
                    if item is obj:
                        return f"{k}[{i}]"
    return None
