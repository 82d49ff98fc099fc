"""The ``guard`` command line (``python -m guard`` or ``torch-guard``), on argparse.

    python -m guard run [options] script.py [args...]   run a script under a global guard
    python -m guard run [options] -m module [args...]   ... or a module, like ``python -m``
    python -m guard report FILE.json [FILE...] [--html OUT.html]
    python -m guard checks                               list checks, kinds, severities, defaults

``python -m guard COMMAND --help`` explains each. Bad input: one line on stderr, exit status 2.
"""
from __future__ import annotations

import argparse
import difflib
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

FAIL_ON = ("error", "warning", "info")


class UsageError(Exception):
    """Bad command-line input (printed as one line, exit status 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse with guard's error style: one line naming what was wrong, exit status 2 (no usage block).

    No abbreviations: ``run`` splits its options from the script's by the option names it knows.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        if message.startswith("unrecognized arguments: "):
            opts = message.split(": ", 1)[1].split()
            message = f"unknown option {opts[0]!r}"
        raise UsageError(f"{self.prog.replace('python -m ', '')}: {message}; see {self.prog} --help")


def _fail(message: str) -> int:
    sys.stderr.write(message.rstrip("\n") + "\n")
    sys.stderr.flush()
    return 2


def build_parsers() -> Dict[str, argparse.ArgumentParser]:
    """The top-level parser (``""``) and one per command, each with its own ``--help``."""
    top = _Parser(prog="python -m guard", description="guard: catch PyTorch training pitfalls as they happen.",
                  epilog="Run 'python -m guard COMMAND --help' for a command's options.")
    sub = top.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    run = sub.add_parser(
        "run", help="run a script (or -m module) under a global guard",
        description="Run a Python script, or a module with -m, under a global guard that watches every "
                    "nn.Module and optimizer. Options go before the script; everything after it is the script's.",
        usage="python -m guard run [options] (script.py | -m module) [args...]")
    run.add_argument("--mode", default="warn", help="warn (report, go on), raise (stop at the first error), "
                                                    "record (collect silently); default: warn")
    run.add_argument("--report", default="guard-report.json", metavar="PATH",
                     help="dump path (.html for the HTML report, else JSON); default: guard-report.json")
    run.add_argument("--no-report", dest="report", action="store_const", const=None, help="write no dump")
    run.add_argument("--checks", default="default", metavar="SPEC",
                     help="'default', 'all', check names or kinds, comma-separated; '-name' removes one")
    run.add_argument("--every", default="1", metavar="N", help="run the per-step device checks every N steps")
    run.add_argument("--live", dest="live", action="store_const", const=True, default=None,
                     help="print findings as they happen (the default unless --mode record)")
    run.add_argument("--no-live", dest="live", action="store_const", const=False,
                     help="print nothing while running (the dump still holds everything)")
    run.add_argument("--fail-on", metavar="SEVERITY", default=None,
                     help="exit status 1 if any finding is this severe or worse: " + ", ".join(FAIL_ON))
    run.add_argument("-m", dest="module", metavar="MODULE", help="run a module as 'python -m MODULE' does")
    run.add_argument("script", nargs="?", help="the script to run, followed by its own arguments")
    rep = sub.add_parser(
        "report", help="show a dump in the terminal, or write it as HTML",
        description="Show guard dumps in the terminal: a summary, every finding with its fix, and the timeline. "
                    "Several dumps (one per rank or process) are merged into one view.",
        usage="python -m guard report FILE.json [FILE.json ...] [--html OUT.html]")
    rep.add_argument("files", nargs="*", metavar="FILE.json", help="guard-report/1 dumps")
    rep.add_argument("--html", metavar="OUT.html", help="write a self-contained HTML page instead "
                                                         "(the one-line summary is still printed)")
    chk = sub.add_parser("checks", help="list checks, their kinds, severities and default on/off",
                         description="List every check with the finding kinds it reports, their severities, "
                                     "and whether it is on by default.", usage="python -m guard checks")
    chk.add_argument("extra", nargs="*", help=argparse.SUPPRESS)
    return {"": top, "run": run, "report": rep, "checks": chk}


# --------------------------------------------------------------------------- run

_RUN_VALUED = ("--mode", "--report", "--checks", "--every", "--fail-on")


def _split_run(argv: Sequence[str]) -> tuple:
    """``(guard's options and the target, the target's own arguments)``; the target is a script or ``-m module``.

    argparse alone would take a script's ``--mode`` for guard's: the split happens at the target.
    """
    argv = list(argv)
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "-m":
            return argv[:i + 2], argv[i + 2:]
        if a.startswith("-") and a != "-":
            i += 2 if a in _RUN_VALUED else 1
            continue
        return argv[:i + 1], argv[i + 1:]
    return argv, []


def _parse_run(argv: Sequence[str]) -> Dict[str, Any]:
    ours, rest = _split_run(argv)
    ns = build_parsers()["run"].parse_args(ours)
    opts = vars(ns)
    opts["args"] = rest
    if opts["script"] is None and opts["module"] is None:
        raise UsageError("guard run: no script given; usage: python -m guard run [options] script.py [args...]")
    if opts["fail_on"] is not None and opts["fail_on"] not in FAIL_ON:
        raise UsageError(f"guard run: --fail-on={opts['fail_on']!r} is not a severity; allowed: {', '.join(FAIL_ON)}")
    if opts["script"] is not None and not os.path.isfile(opts["script"]):
        raise UsageError(f"guard run: cannot open script {opts['script']!r}: no such file")
    return opts


def _exit_code(code: Any) -> int:
    """Python's own mapping of ``sys.exit(code)`` to an exit status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF if code >= 0 else code % 256
    sys.stderr.write(f"{code}\n")
    return 1


def _guard_children(g: Any, opts: Dict[str, Any]) -> Dict[str, Optional[str]]:
    """Processes the script starts as new interpreters (``torch.multiprocessing.spawn``, ``subprocess``) get
    the environment's guard with the same options, as under ``TORCH_GUARD=1``: each writes its own report
    next to this one (``report.pid123.json``). This process stays the main one. Without a report, they
    are not guarded (the environment's guard always writes one)."""
    report = g.config.report
    if not report:
        return {}
    from ._procs import MAIN_PID_VAR, mark_main

    mode = g.config.mode
    env = {"TORCH_GUARD": "1" if mode == "warn" else mode, "TORCH_GUARD_REPORT": report,
           "TORCH_GUARD_EVERY": str(g.config.every)}
    if opts.get("checks") is not None:
        checks = opts["checks"]
        env["TORCH_GUARD_CHECKS"] = checks if isinstance(checks, str) else ",".join(checks)
    if opts.get("live") is not None:
        env["TORCH_GUARD_LIVE"] = {True: "1", False: "0"}.get(opts["live"], str(opts["live"]))
    saved = {k: os.environ.get(k) for k in list(env) + [MAIN_PID_VAR]}
    mark_main()
    os.environ.update(env)
    return saved  # put back when the run ends


def _child_findings(g: Any) -> List[Any]:
    """Findings in the reports the run's other processes wrote next to this one (``report.pid123.json``)."""
    from .record import Record

    report = g.config.report
    out: List[Any] = []
    if not report:
        return out
    from ._procs import other_reports

    folder = os.path.dirname(report)
    # listed in this process's report when it wrote one; a main process that saw nothing writes none
    for entry in g.processes or other_reports(report, getattr(g, "started_at", 0.0)):
        try:
            out.extend(Record.load(os.path.join(folder, entry["file"])).findings)
        except Exception:
            continue  # unreadable: its process said so when it wrote it, if it did
    return out


def _own_guard_module(folder: str) -> bool:
    """Whether `folder` holds a ``guard`` module of the program's own (a guard.py next to the script)."""
    ours = os.path.dirname(os.path.abspath(__file__))
    for path in (os.path.join(folder, "guard.py"), os.path.join(folder, "guard", "__init__.py")):
        if os.path.isfile(path) and os.path.dirname(os.path.abspath(path)) != ours:
            return True
    return False


def _run_apart(g: Any, opts: Dict[str, Any]) -> int:
    """The script's folder has a ``guard`` of its own, which its ``import guard`` must get: run it in a new
    interpreter under the environment's guard (TORCH_GUARD=1 loads this package under a private name there),
    with the same options; the exit status is the script's, `--fail-on` reads the reports it wrote."""
    import subprocess
    import tempfile
    import time

    from ._procs import MAIN_PID_VAR

    cfg = g.config
    env = {k: v for k, v in os.environ.items() if k != MAIN_PID_VAR}
    env["TORCH_GUARD"] = "1" if cfg.mode == "warn" else cfg.mode
    env["TORCH_GUARD_EVERY"] = str(cfg.every)
    scratch = None
    if cfg.report:
        env["TORCH_GUARD_REPORT"] = cfg.report
    else:  # --no-report: the environment's guard always writes one; it goes to a folder removed afterwards
        scratch = tempfile.mkdtemp(prefix="guard-run-")
        env["TORCH_GUARD_REPORT"] = os.path.join(scratch, "guard-report.json")
    if opts.get("checks") is not None:
        checks = opts["checks"]
        env["TORCH_GUARD_CHECKS"] = checks if isinstance(checks, str) else ",".join(checks)
    if opts.get("live") is not None:
        env["TORCH_GUARD_LIVE"] = {True: "1", False: "0"}.get(opts["live"], str(opts["live"]))
    started = time.time()
    try:
        code = subprocess.run([sys.executable, opts["script"], *opts["args"]], env=env).returncode
    except KeyboardInterrupt:
        code = 130
    try:
        if opts["fail_on"] is not None:
            from .record import Record

            root, ext = os.path.splitext(env["TORCH_GUARD_REPORT"])
            import glob

            found = []
            for name in [root + ext] + glob.glob(glob.escape(root) + ".*" + glob.escape(ext)):
                try:
                    if os.path.getmtime(name) >= started - 1:
                        found.extend(Record.load(name).findings)
                except Exception:
                    continue
            code = _fail_on(found, opts["fail_on"], code)
    finally:
        if scratch is not None:
            import shutil

            shutil.rmtree(scratch, ignore_errors=True)
    return code if code >= 0 else 128 - code


def cmd_run(argv: Sequence[str]) -> int:
    opts = _parse_run(argv)
    import runpy
    import traceback

    auto = sys.modules.get("_torch_guard_autostart")
    if auto is not None:  # TORCH_GUARD is set too: the command line's guard replaces the environment's
        auto.discard()
    from . import guard
    from .config import ConfigError

    live = opts["live"]
    if live is None and str(opts["mode"] or "").strip().lower() != "record":
        live = True  # like the environment's guard, `guard run` prints its findings off a terminal too (a log, CI)
    try:
        # The environment's kind of guard, as under TORCH_GUARD=1: it steps aside while a guard from the script's
        # own code runs (each finding printed once), and each process of the run writes its own report.
        g = guard(checks=opts["checks"], mode=opts["mode"], report=opts["report"], live=live,
                  every=opts["every"], background=True,
                  origin={"checks": "--checks", "mode": "--mode", "report": "--report", "every": "--every"})
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    if opts["module"] is None and _own_guard_module(os.path.dirname(os.path.abspath(opts["script"]))):
        return _run_apart(g, opts)
    saved_env = _guard_children(g, opts)
    saved_argv, saved_path0 = list(sys.argv), sys.path[0] if sys.path else None
    code = 0
    try:
        if opts["module"] is not None:
            sys.argv = [opts["module"]] + list(opts["args"])
            if sys.path:
                sys.path[0] = os.getcwd()
            with g:
                runpy.run_module(opts["module"], run_name="__main__", alter_sys=True)
        else:
            script = opts["script"]
            sys.argv = [script] + list(opts["args"])
            if sys.path:
                sys.path[0] = os.path.dirname(os.path.abspath(script))
            with g:
                # Absolute, as python makes a main script's __file__ (a script that chdir()s still finds
                # its own folder; tracebacks name the full path).
                runpy.run_path(os.path.abspath(script), run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 130
    except BaseException:
        # Like python itself: the traceback (with guard's exception notes), status 1; drop runpy's frames.
        etype, exc, tb = sys.exc_info()
        ours = (__file__, runpy.__file__, "<frozen runpy>")
        while tb is not None and tb.tb_frame.f_code.co_filename in ours:
            tb = tb.tb_next
        traceback.print_exception(etype, exc, tb)
        code = 1
    finally:
        g.close()
        sys.argv = saved_argv
        if saved_path0 is not None and sys.path:
            sys.path[0] = saved_path0
        for key, value in saved_env.items():  # `main()` may run in a longer-lived process (tests, tools)
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    try:
        sys.stdout.flush()
    except Exception:
        pass
    if opts["fail_on"] is not None:
        # this process's findings, those of the script's own guards, and those its child processes reported
        code = _fail_on(list(g.findings) + list(g.aside_findings) + _child_findings(g), opts["fail_on"], code)
    return code


def _fail_on(findings: List[Any], severity: str, code: int) -> int:
    """`--fail-on`: the exit status 1 (one line saying why) when a finding is that severe; else `code`."""
    from .findings import SEVERITY_RANK

    limit = SEVERITY_RANK[severity]
    bad = [f for f in findings if SEVERITY_RANK.get(f.severity, 99) <= limit]
    if bad:
        sys.stderr.write(f"guard: {len(bad)} finding(s) of severity {severity} or worse "
                         f"({', '.join(sorted({f.kind for f in bad}))})\n")
        if code == 0:
            return 1
    return code


# --------------------------------------------------------------------------- report

def _load_all(files: Sequence[str]) -> List[Any]:
    """Each dump as a validated `Record`; any bad file is one line naming it (never a traceback)."""
    from .record import Record, SchemaError

    out = []
    for path in files:
        try:
            out.append(Record.load(path))
        except FileNotFoundError:
            raise UsageError(f"guard report: {path}: no such file") from None
        except IsADirectoryError:
            raise UsageError(f"guard report: {path} is a directory; allowed: a guard-report/1 JSON dump") from None
        except OSError as exc:
            raise UsageError(f"guard report: cannot read {path}: {exc.strerror or exc}") from None
        except SchemaError as exc:
            raise UsageError(f"guard report: {exc}") from None
        except (RecursionError, MemoryError):
            raise UsageError(f"guard report: {path} is too large or nested too deeply to be a guard report") from None
    return out


def cmd_report(argv: Sequence[str]) -> int:
    ns = build_parsers()["report"].parse_args(list(argv))
    if not ns.files:
        raise UsageError("guard report: no dump given; usage: python -m guard report FILE.json [...] [--html OUT.html]")
    if ns.html is not None and not ns.html.strip():
        raise UsageError("guard report: --html needs an output path")
    if ns.html and any(os.path.abspath(ns.html) == os.path.abspath(f) for f in ns.files):
        raise UsageError(f"guard report: --html {ns.html!r} is one of the dumps read; allowed: another path "
                         f"(the dump would be replaced by the page)")
    if ns.html:
        from .config import ConfigError, parse_report

        try:
            parse_report(ns.html, "--html")
        except ConfigError as exc:
            raise UsageError(f"guard report: {str(exc)[len('guard: '):]}") from None
    from .record import Record

    record = Record.merge(_load_all(ns.files), ns.files)
    if ns.html:
        from .report import atomic_write
        from .report.html import render_html

        try:
            path = atomic_write(ns.html, render_html(record))
        except OSError as exc:
            raise UsageError(f"guard report: cannot write {ns.html!r}: {exc.strerror or exc}") from None
        print(record.summary_line())  # a CI log shows the result without opening the page
        print(f"guard: wrote {path}")
        return 0
    from .report.terminal import render_terminal

    render_terminal(record, _console())
    return 0


# --------------------------------------------------------------------------- checks

def _console():
    """rich console on stdout; wide when piped (logs), the terminal's width otherwise."""
    from rich.console import Console

    try:
        tty = sys.stdout.isatty()
    except Exception:
        tty = False
    return Console(highlight=False, width=None if tty else 140)


def cmd_checks(argv: Sequence[str]) -> int:
    extra = build_parsers()["checks"].parse_args(list(argv)).extra
    if extra:
        raise UsageError(f"guard checks: takes no arguments (got {' '.join(extra)!r})")
    from rich.table import Table

    from .checks import registry
    from .findings import KINDS

    table = Table(title="guard checks", title_justify="left", show_lines=True)
    for col in ("check", "default", "kinds (severity)"):
        table.add_column(col, no_wrap=True)
    table.add_column("what it catches", overflow="fold")
    for name, cls in sorted(registry().items()):
        kinds = "\n".join(f"{k} ({KINDS[k][0]})" for k in cls.kinds if k in KINDS)
        table.add_row(name, "on" if cls.default else "off", kinds, cls.description or "")
    _console().print(table)
    print('select with checks=... / --checks / TORCH_GUARD_CHECKS: "default", "all", names or kinds, "-name" removes')
    return 0


# --------------------------------------------------------------------------- main

COMMANDS = {"run": cmd_run, "report": cmd_report, "checks": cmd_checks}


def _dispatch(args: List[str]) -> int:
    if not args:
        build_parsers()[""].print_usage(sys.stderr)
        return 2
    cmd, rest = args[0], args[1:]
    if cmd == "help":  # `python -m guard help [COMMAND]`
        args = (rest[:1] if rest[:1] and rest[0] in COMMANDS else []) + ["--help"]
        cmd, rest = args[0], args[1:]
    if cmd in COMMANDS:
        return COMMANDS[cmd](rest)
    if cmd.startswith("-"):  # --help, or an option before any command
        build_parsers()[""].parse_args(args)
        raise UsageError(f"guard: {cmd!r} needs a command first; allowed: {', '.join(COMMANDS)}")
    near = difflib.get_close_matches(cmd, COMMANDS, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    raise UsageError(f"guard: unknown command {cmd!r}{hint}; allowed: {', '.join(COMMANDS)}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m guard`` and the ``torch-guard`` console script; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(args)
    except BrokenPipeError:  # `python -m guard checks | head`: the reader left, not an error of ours
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
    except UsageError as exc:
        return _fail(str(exc))
    except SystemExit as exc:  # argparse's --help
        return exc.code if isinstance(exc.code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
