"""Renderers over the report model: console (rich), JSON, HTML.

`build_report` (in `model`) turns a session into the ``guard-report/1`` dict;
every renderer reads only that dict, so a dump written yesterday renders the
same as a live session.
"""
from __future__ import annotations

import os
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
    """Write to a temp file in the same folder, fsync, then rename over `path`."""
    path = os.path.abspath(os.fspath(path))
    folder = os.path.dirname(path) or "."
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
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
