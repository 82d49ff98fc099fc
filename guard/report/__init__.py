"""Renderers over a `guard.record.Record`: console (rich, live), terminal (dumps), JSON, HTML.

Every renderer takes a `Record` and reads its typed fields, so a dump written
yesterday renders the same as a live session. A ``guard-report/1`` dict is still
accepted (converted with `Record.of`) for callers that hold one.
"""
from __future__ import annotations

import os
import secrets
import threading
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


__all__ = ["SCHEMA", "Record", "build_record", "build_report", "write_report", "atomic_write"]
