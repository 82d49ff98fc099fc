"""The ``guard`` command line (``python -m guard`` or ``torch-guard``).

    python -m guard run [options] script.py [args...]   run a script under a global guard
    python -m guard run [options] -m module [args...]   ... or a module, like ``python -m``
    python -m guard report FILE.json [FILE...] [--html OUT.html]
    python -m guard checks                               list checks, kinds, severities, defaults

Bad input: one line on stderr, exit status 2.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, List, Optional, Sequence

USAGE = """usage: python -m guard run [--mode warn|raise|record] [--report PATH | --no-report] [--checks SPEC]
                          [--every N] [--no-live] [--fail-on error|warning] (script.py | -m module) [args...]
       python -m guard report FILE.json [FILE.json ...] [--html OUT.html]
       python -m guard checks
"""

FAIL_ON = ("error", "warning", "info")


class UsageError(Exception):
    """Bad command-line input (printed as one line, exit status 2)."""


def _fail(message: str) -> int:
    sys.stderr.write(message.rstrip("\n") + "\n")
    sys.stderr.flush()
    return 2


# --------------------------------------------------------------------------- run

_RUN_VALUED = {"--mode": "mode", "--report": "report", "--checks": "checks", "--every": "every",
               "--fail-on": "fail_on"}


def _parse_run(argv: Sequence[str]) -> Dict[str, Any]:
    """Options up to the script (or ``-m module``); everything after belongs to the script."""
    opts: Dict[str, Any] = {"mode": "warn", "report": "guard-report.json", "checks": "default", "every": "1",
                            "live": None, "fail_on": None, "script": None, "module": None, "args": []}
    i = 0
    argv = list(argv)
    while i < len(argv):
        a = argv[i]
        name, eq, val = a.partition("=")
        if name in _RUN_VALUED:
            if not eq:
                if i + 1 >= len(argv):
                    raise UsageError(f"guard run: {name} needs a value")
                i += 1
                val = argv[i]
            opts[_RUN_VALUED[name]] = val
        elif a == "--no-live":
            opts["live"] = False
        elif a == "--live":
            opts["live"] = True
        elif a == "--no-report":
            opts["report"] = None
        elif a == "-m":
            if i + 1 >= len(argv):
                raise UsageError("guard run: -m needs a module name")
            opts["module"] = argv[i + 1]
            opts["args"] = argv[i + 2:]
            break
        elif a in ("-h", "--help"):
            raise UsageError("help")
        elif a.startswith("-") and a != "-":
            raise UsageError(f"guard run: unknown option {a!r}; allowed: {', '.join(sorted(_RUN_VALUED))}, "
                             f"--no-live, --no-report, -m")
        else:
            opts["script"] = a
            opts["args"] = argv[i + 1:]
            break
        i += 1
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


def cmd_run(argv: Sequence[str]) -> int:
    opts = _parse_run(argv)
    import runpy
    import traceback

    auto = sys.modules.get("_torch_guard_autostart")
    if auto is not None:  # TORCH_GUARD is set too: the command line's guard replaces the environment's
        auto.discard()
    from . import guard
    from .config import ConfigError
    from .findings import SEVERITY_RANK

    try:
        g = guard(checks=opts["checks"], mode=opts["mode"], report=opts["report"], live=opts["live"],
                  every=opts["every"], origin={"checks": "--checks", "mode": "--mode", "report": "--report",
                                               "every": "--every"})
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
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
                runpy.run_path(script, run_name="__main__")
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
    try:
        sys.stdout.flush()
    except Exception:
        pass
    if opts["fail_on"] is not None:
        limit = SEVERITY_RANK[opts["fail_on"]]
        bad = [f for f in g.findings if SEVERITY_RANK[f.severity] <= limit]
        if bad:
            sys.stderr.write(f"guard: {len(bad)} finding(s) of severity {opts['fail_on']} or worse "
                             f"({', '.join(sorted({f.kind for f in bad}))})\n")
            if code == 0:
                code = 1
    return code


# --------------------------------------------------------------------------- report

def _load_all(files: Sequence[str]) -> List[Dict[str, Any]]:
    import json

    from .report.model import load_report

    out = []
    for path in files:
        try:
            out.append(load_report(path))
        except FileNotFoundError:
            raise UsageError(f"guard report: {path}: no such file") from None
        except json.JSONDecodeError as exc:
            raise UsageError(f"guard report: {path} is not JSON ({exc.msg} at line {exc.lineno}); "
                             f"allowed: a guard-report/1 dump") from None
        except (ValueError, OSError) as exc:
            raise UsageError(str(exc).splitlines()[0]) from None
    return out


def cmd_report(argv: Sequence[str]) -> int:
    files: List[str] = []
    html_out: Optional[str] = None
    argv = list(argv)
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--html" or a.startswith("--html="):
            if "=" in a:
                html_out = a.split("=", 1)[1]
            elif i + 1 < len(argv):
                i += 1
                html_out = argv[i]
            if not html_out:
                raise UsageError("guard report: --html needs an output path")
        elif a.startswith("-"):
            raise UsageError(f"guard report: unknown option {a!r}; allowed: --html OUT.html")
        else:
            files.append(a)
        i += 1
    if not files:
        raise UsageError("guard report: no dump given; usage: python -m guard report FILE.json [...] [--html OUT.html]")
    from .report.terminal import merge_reports, render_terminal

    report = merge_reports(_load_all(files), files)
    if html_out:
        from .report import atomic_write
        from .report.html import render_html

        try:
            path = atomic_write(html_out, render_html(report))
        except OSError as exc:
            raise UsageError(f"guard report: cannot write {html_out!r}: {exc.strerror or exc}") from None
        print(f"guard: wrote {path}")
        return 0
    render_terminal(report, _console())
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
    if argv:
        raise UsageError(f"guard checks: takes no arguments (got {' '.join(argv)!r})")
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m guard`` and the ``torch-guard`` console script; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(USAGE)
        return 0 if args else 2
    cmd, rest = args[0], args[1:]
    if cmd not in COMMANDS:
        return _fail(f"guard: unknown command {cmd!r}; allowed: {', '.join(COMMANDS)}")
    try:
        return COMMANDS[cmd](rest)
    except BrokenPipeError:  # `python -m guard checks | head`: the reader left, not an error of ours
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
    except UsageError as exc:
        if str(exc) == "help":
            sys.stdout.write(USAGE)
            return 0
        return _fail(str(exc))


if __name__ == "__main__":
    sys.exit(main())
