"""torch.distributed awareness without collectives: this process's rank and its report path.

guard never communicates between ranks (no deadlock risk); it only reads the rank.
"""
from __future__ import annotations

import os
import sys
from typing import Optional, Tuple

_last: Optional[Tuple[int, int]] = None  # the rank seen while a process group was alive


def rank_info() -> Optional[Tuple[int, int]]:
    """``(rank, world_size)`` when this process is one rank of several, else None.

    Reads an initialized default process group (remembered once seen, for dumps written at
    exit after ``destroy_process_group()``), or torchrun's ``RANK``/``WORLD_SIZE``.
    """
    global _last
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            _last = (dist.get_rank(), dist.get_world_size())
            return _last
    except Exception:
        pass
    if _last is not None:  # the group was destroyed before exit: this process was still that rank
        return _last
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    return (rank, world) if world > 1 else None


def rank_report_path(path: str) -> str:
    """``report.json`` -> ``report.rank1.json`` when distributed with more than one rank."""
    info = rank_info()
    if info is None or info[1] <= 1:
        return path
    root, ext = os.path.splitext(os.fspath(path))
    return f"{root}.rank{info[0]}{ext}"


def remember_rank(call, args: tuple, kwargs: dict):
    """Installer middleware around ``torch.distributed.destroy_process_group``: read the rank while the group
    still lives, so that a report written at exit still carries it (``report.rank1.json``)."""
    try:
        rank_info()
    except Exception:
        pass
    return call(*args, **kwargs)
