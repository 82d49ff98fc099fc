"""The report model: a session turned into the ``guard-report/1`` dict, and back."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import sys
from typing import TYPE_CHECKING, Any, Dict, List

from ..record import SCHEMA

if TYPE_CHECKING:  # pragma: no cover
    from ..session import Guard


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


def build_report(g: "Guard") -> Dict[str, Any]:
    """The dump of one guard session (JSON-safe): its record, with environment, config and steps filled in."""
    rec = g.record
    rec.environment = environment()
    rec.config = g.config.to_dict()
    rec.steps = g.step
    rec.cost = g.cost()
    if g.processes:
        rec.extra["processes"] = list(g.processes)
    rec.created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return rec.to_json()


def load_report(path: str) -> Dict[str, Any]:
    """Read a dump and check its schema (one clear line on a wrong file)."""
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ValueError(f"guard: {path} is not a guard report (schema {SCHEMA!r} expected)")
    return data
