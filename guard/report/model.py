"""A live session turned into a `Record` (and its ``guard-report/1`` dict); the run's environment."""
from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import platform
import sys
from typing import TYPE_CHECKING, Any, Dict, List

from ..record import SCHEMA, Record

if TYPE_CHECKING:  # pragma: no cover
    from ..session import Guard

__all__ = ["SCHEMA", "Record", "build_record", "build_report", "environment"]


def environment() -> Dict[str, Any]:
    import torch

    env: Dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "argv": list(sys.argv),
        "pid": os.getpid(),
        "devices": _devices(),
    }
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            env["rank"] = dist.get_rank()
            env["world_size"] = dist.get_world_size()
    except Exception:
        pass
    if "rank" not in env:  # a dump written at exit, after destroy_process_group(): the rank seen before
        from .._dist import rank_info

        info = rank_info()
        if info is not None:
            env["rank"], env["world_size"] = info
    from .._procs import describe

    env.update(describe())  # a process other than the main one: which, and whose
    return env


def _devices() -> List[str]:
    import torch

    out = ["cpu"]
    try:
        if torch.cuda.is_available():
            out += [f"cuda:{i} ({torch.cuda.get_device_name(i)})" for i in range(torch.cuda.device_count())]
    except Exception:
        pass
    try:
        if torch.backends.mps.is_available():
            out.append("mps")
    except Exception:
        pass
    return out


def build_record(g: "Guard") -> Record:
    """The `Record` of a live guard, its environment read now (compatibility path until the guard owns one)."""
    own = getattr(g, "record", None)
    if isinstance(own, Record):
        rec = dataclasses.replace(own, findings=list(g.findings))
    else:
        rec = Record(findings=list(g.findings), timeline=list(g.timeline), modules=list(g.modules.values()),
                     notices=list(getattr(g, "notices", [])), internal_errors=list(g.internal_errors))
    rec.environment = environment()
    rec.config = g.config.to_dict()
    rec.steps = g.step + getattr(g, "aside_steps", 0)  # an environment's guard: with those of the code's guards
    cost = getattr(g, "cost", None)
    rec.cost = cost() if callable(cost) else {}
    if getattr(g, "processes", None):
        rec.extra = {**rec.extra, "processes": list(g.processes)}
    rec.created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return rec


def build_report(g: "Guard") -> Dict[str, Any]:
    """The dump of one guard session (JSON-safe dict, schema ``guard-report/1``)."""
    return build_record(g).to_json()
