"""Which process this is, and where its report goes when every process writes its own.

A background guard (what ``TORCH_GUARD`` starts) runs in every process that imports torch: the
main program, ``torch.multiprocessing.spawn`` children, forked ``mp.Process`` workers, DataLoader
workers. Each writes its own dump, like the per-rank files: ``guard-report.json`` for the main
process, ``guard-report.rank1.json`` for a distributed rank, ``guard-report.worker0-pid123.json``
for a DataLoader worker, ``guard-report.pid123.json`` for any other process. The main process is
the first one that started a background guard; it exports its pid to its children.
"""
from __future__ import annotations

import glob
import json
import os
import sys
from typing import Any, Dict, List, Optional

#: set by the main process's background guard, inherited by every child (fork, spawn, subprocess)
MAIN_PID_VAR = "_TORCH_GUARD_MAIN_PID"


def mark_main() -> None:
    """This process is the main one unless a guarded ancestor said otherwise."""
    os.environ.setdefault(MAIN_PID_VAR, str(os.getpid()))


def main_pid() -> Optional[int]:
    try:
        return int(os.environ[MAIN_PID_VAR])
    except (KeyError, ValueError):
        return None


def is_main() -> bool:
    pid = main_pid()
    if pid is not None:
        return pid == os.getpid()
    import multiprocessing

    return multiprocessing.parent_process() is None


def process_tag() -> Optional[str]:
    """None for the main process; else a name unique to this process (``worker0-pid123``, ``pid123``)."""
    if is_main():
        return None
    role = ""
    data = sys.modules.get("torch.utils.data")
    if data is not None:
        try:
            info = data.get_worker_info()
            if info is not None:
                role = f"worker{info.id}-"
        except Exception:
            pass
    return f"{role}pid{os.getpid()}"


def process_report_path(path: str) -> str:
    """`path` for the main process, ``report.rank{N}.json`` for a rank, ``report.<tag>.json`` for others."""
    from ._dist import rank_info, rank_report_path

    if rank_info() is not None:
        return rank_report_path(path)
    tag = process_tag()
    if tag is None:
        return path
    root, ext = os.path.splitext(os.fspath(path))
    return f"{root}.{tag}{ext}"


def describe() -> Dict[str, Any]:
    """What the dump of a process other than the main one says about it."""
    tag = process_tag()
    return {} if tag is None else {"process": tag, "main_pid": main_pid()}


def other_reports(path: str, since: float) -> List[Dict[str, Any]]:
    """Dumps written since `since` (a time.time()) by the other processes of this run, next to `path`."""
    root, ext = os.path.splitext(os.fspath(path))
    me = os.getpid()
    found = []
    for name in sorted(glob.glob(glob.escape(root) + ".*" + glob.escape(ext))):
        try:
            if os.path.getmtime(name) < since - 1:
                continue  # an earlier run's file
            if ext.lower() in (".html", ".htm"):
                continue  # HTML dumps do not say whose they are
            with open(name, encoding="utf-8") as fh:
                env = json.load(fh).get("environment", {})
            if env.get("main_pid") == me:
                found.append({"file": os.path.basename(name), "pid": env.get("pid"), "process": env.get("process")})
        except Exception:
            continue  # being written, unreadable, not ours: not listed
    return found


# --------------------------------------------------------------------------- background and explicit guards

import weakref  # noqa: E402

#: started background guards (TORCH_GUARD's) of this process, and the guards from the code active now:
#: while one of the latter runs, the former step aside (one report line per finding, the user's report kept)
_background: "weakref.WeakSet[Any]" = weakref.WeakSet()
_explicit: "weakref.WeakSet[Any]" = weakref.WeakSet()
_explicit_reports: set = set()  # report paths of the guards from the code (a background guard never overwrites one)


def _aside_note(g: Any) -> str:
    if not g.config.report:
        return ("guard: a guard from the code (no report of its own) was active in this process; the environment's "
                "guard stepped aside meanwhile, and that guard's findings are listed here with its step numbers")
    return (f"guard: a guard from the code (report {g.config.report}) was active in this process; the environment's "
            f"guard stepped aside meanwhile, so that guard's findings are in its own report, not here")


def environment_guard_running() -> bool:
    """Whether an environment's guard (TORCH_GUARD, ``guard run``) was started in this process."""
    return bool(list(_background))  # (closed ones leave it)


def after_start(g: Any) -> None:
    """A guard started: a background one marks the main process; one from the code makes background ones pause."""
    if g.config.background:
        mark_main()
        _background.add(g)
        for other in list(_explicit):
            if other.active:
                g.pause(_aside_note(other))
                break
        return
    _explicit.add(g)
    if g.config.report:
        _explicit_reports.add(g.config.report)
    for bg in list(_background):
        bg.pause(_aside_note(g))


def after_close(g: Any) -> None:
    """A guard closed: when no guard from the code is left active, background guards watch again."""
    if g.config.background:
        _background.discard(g)
        return
    _explicit.discard(g)
    for bg in list(_background):
        bg.aside_findings.extend(g.findings)
        if not g.config.report:
            # a guard from the code that writes no report: its findings and steps go to the environment's, which a
            # CI job reads (else the run's report would say nothing of them, or be missing when it found nothing)
            for f in g.findings:
                bg.record.put(f)
            bg.aside_steps += max(g.step, 1)
    if not any(e.active for e in _explicit):
        for bg in list(_background):
            bg.resume()


def report_path_for(g: Any) -> Optional[str]:
    """Where `g` writes its report now, or None for no report.

    A background guard writes one file per process, and nothing when it saw nothing; any other guard
    writes its `report` (``.rank{N}`` under torch.distributed).
    """
    from ._dist import rank_report_path

    path = g.config.report
    if not path:
        return None
    if not g.config.background:
        return rank_report_path(path)
    if not (g.step or g.findings or g.modules or g.timeline or g.internal_errors or g.aside_steps):
        return None  # a helper process that merely imported torch (a compile worker): no empty dump
    path = process_report_path(path)
    if path in _explicit_reports:
        root, ext = os.path.splitext(path)
        path = f"{root}.env{ext}"
    if process_tag() is None:
        if _written_by_another_run(path, g.started_at):
            # two runs started in one folder at once (two TORCH_GUARD=1 jobs): each keeps its own report
            root, ext = os.path.splitext(path)
            path = f"{root}.pid{os.getpid()}{ext}"
        g.processes = other_reports(path, g.started_at)
    return path


def _written_by_another_run(path: str, since: float) -> bool:
    """Whether `path` was written, while this run went on, by a process that is neither this one nor its child."""
    try:
        if os.path.getmtime(path) < since - 1:
            return False  # an earlier run's report: replaced, as always
        with open(path, encoding="utf-8") as fh:
            env = json.load(fh).get("environment", {})
    except Exception:
        return False
    me = os.getpid()
    return env.get("pid") not in (None, me) and env.get("main_pid") != me
