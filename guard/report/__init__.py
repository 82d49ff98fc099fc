"""Renderers over the report model: console (rich), JSON, HTML.

`build_report` (in `model`) turns a session into the ``guard-report/1`` dict;
every renderer reads only that dict, so a dump written yesterday renders the
same as a live session.
"""
from __future__ import annotations

import os
import secrets
import threading
from typing import Any, Dict

from .model import SCHEMA, build_report, load_report


def write_report(report: Dict[str, Any], path: str) -> str:
    """Write `report` to `path` atomically: HTML for a ``.html`` suffix, JSON otherwise."""
    if str(path).lower().endswith((".html", ".htm")):
        from .html import render_html

        text = render_html(report)
    else:
        from .jsonfile import render_json

        text = render_json(report)
    return atomic_write(path, text)


def atomic_write(path: str, text: str) -> str:
    """Write to a temp file in the same folder, fsync, then rename over `path`.

    The temp name is unique per writer (pid, thread, random), so two guards of one process writing
    the same path at once never share a temp file; the last rename wins with a whole file.
    """
    path = os.path.abspath(os.fspath(path))
    folder = os.path.dirname(path) or "."
    tag = f"{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}"
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{tag}.tmp")
    try:
        # O_EXCL: a temp name is never shared, even by a writer that picked the same random tag
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


__all__ = ["SCHEMA", "build_report", "load_report", "write_report", "atomic_write"]
