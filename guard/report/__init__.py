"""Renderers over a `guard.record.Record`: console (rich, live), terminal (dumps), JSON, HTML.

Every renderer takes a `Record` and reads its typed fields, so a dump written
yesterday renders the same as a live session. A ``guard-report/1`` dict is still
accepted (converted with `Record.of`) for callers that hold one.
"""
from __future__ import annotations

import os
from typing import Union

from ..record import SCHEMA, Record
from .model import build_record, build_report


def write_report(report: Union[Record, dict], path: str) -> str:
    """Write `report` (a Record or its dict) to `path` atomically: HTML for a ``.html`` suffix, JSON otherwise."""
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


__all__ = ["SCHEMA", "Record", "build_record", "build_report", "write_report", "atomic_write"]
