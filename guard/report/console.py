"""Live console renderer: one panel per new finding, a summary table at exit.

On a TTY it uses rich; elsewhere (CI logs, ``nohup``, ``| tee``) it prints plain lines
with no ANSI codes. User-derived strings (module paths, messages, file names) reach
rich only as `Text`, never as markup.
"""
from __future__ import annotations

import sys
from typing import Any, Iterable, Optional, Union

from ..findings import Finding
from ..record import Record

_COLOURS = {"error": "red", "warning": "yellow", "info": "cyan"}


def _rank() -> int:
    """This process's rank; after ``destroy_process_group()`` the rank it had (summaries print at exit)."""
    try:
        from .._dist import rank_info

        info = rank_info()
        return info[0] if info is not None else 0
    except Exception:
        return 0


class LiveConsole:
    """Prints findings as they happen to stderr (or `stream`); under torch.distributed rank 0 only unless
    ``live="all"``."""

    def __init__(self, live: Union[bool, str], stream: Any = None):
        self.live = live
        self._stream = stream

    @property
    def stream(self) -> Any:
        return self._stream if self._stream is not None else sys.stderr

    @property
    def enabled(self) -> bool:
        if not self.live:
            return False
        return self.live == "all" or _rank() == 0

    def _tty(self) -> bool:
        try:
            return bool(self.stream.isatty())
        except Exception:
            return False

    def _rich(self):
        from rich.console import Console

        return Console(file=self.stream, stderr=self._stream is None, highlight=False)

    def finding(self, f: Finding) -> None:
        if not self.enabled:
            return
        try:
            if self._tty():
                self._rich().print(render_panel(f))
            else:
                self.stream.write(render_plain(f) + "\n")
                self.stream.flush()
        except Exception:
            pass  # printing must never break training

    def internal(self, message: str) -> None:
        try:
            self.stream.write(message + "\n")
            self.stream.flush()
        except Exception:
            pass

    def summary(self, record: Any, path: Optional[str] = None) -> None:
        """The exit summary of `record` (a `Record`; a live guard is still accepted) and the dump's `path`."""
        if not self.enabled:
            return
        if isinstance(record, dict):
            record = Record.of(record)
        elif not isinstance(record, Record):  # compatibility: a live guard, which knows its report path
            from .model import build_record

            path = path if path is not None else getattr(record, "report_path", None)
            record = build_record(record)
        findings = record.sorted_findings()
        if not findings and not path and not _over_budget(record):
            return
        head = f"guard: {len(findings)} finding(s) in {record.steps} step(s)"
        if self._tty():
            from rich.text import Text

            con = self._rich()
            con.print(render_table(findings, title=head))
            cost = _cost_line(record)
            if cost:
                con.print(Text(cost, style="dim"))
            if path:
                con.print(Text(f"guard report: {path}", style="dim"))
        else:
            lines = [head]
            for f in findings:
                lines.append(f"  {f.severity:<7} {f.kind:<28} {f.where:<30} step {f.step:<6} x{f.count}")
            cost = _cost_line(record)
            if cost:
                lines.append(cost)
            if path:
                lines.append(f"guard report: {path}")
            self.stream.write("\n".join(lines) + "\n")
            self.stream.flush()


MIN_COST_STEPS = 20


def _cost_line(record: Any) -> str:
    """``guard cost 3.1% of step time`` (and what a budget sampled), or "" before two steps."""
    cost = getattr(record, "cost", None)  # a Record's field, or a live guard's method
    cost = (cost() if callable(cost) else cost) or {}
    ov = cost.get("overhead")
    if ov is None:
        return ""
    line = f"guard cost {ov * 100:.1f}% of step time"
    n = cost.get("steps_measured", 0) or 0
    if n < MIN_COST_STEPS and cost.get("budget") is None:
        # a few steps of a toy model: said, with why it says little about a real run
        line += f" (over {n} step(s); a run's first steps cost guard the most)"
    if cost.get("sampled_checks"):
        line += (f" (budget {cost['budget'] * 100:g}%: {', '.join(cost['sampled_checks'])} sampled, "
                 f"every {cost['max_period']} steps at most)")
    if _over_budget(record):
        rest = (cost["step_seconds"] - cost["guard_seconds"]) / n * 1e3
        line += (f"; over the budget of {cost['budget'] * 100:g}%: the checks that never skip a step (NaN/Inf, AMP, "
                 f"the one-time events) cost more than that next to this model's {rest:.2g} ms steps")
    return line


def _over_budget(record: Any) -> bool:
    """Whether a budget was set and the run's measured overhead stayed above it (over enough steps to say)."""
    cost = getattr(record, "cost", None)
    cost = (cost() if callable(cost) else cost) or {}
    ov, budget = cost.get("overhead"), cost.get("budget")
    return (ov is not None and budget is not None and ov > budget
            and (cost.get("steps_measured", 0) or 0) >= MIN_COST_STEPS and bool(cost.get("step_seconds")))


def render_plain(f: Finding) -> str:
    src = f" ({f.source})" if f.source else ""
    return (f"guard {f.severity.upper()} {f.kind} at {f.where}, step {f.step}{src}: {f.message}\n"
            f"  fix: {f.hint}")


def render_panel(f: Finding):
    from rich.panel import Panel
    from rich.text import Text

    colour = _COLOURS.get(f.severity, "white")
    body = Text()
    body.append(f.message + "\n")
    body.append("fix: ", style="bold")
    body.append(f.hint)
    if f.source:
        body.append(f"\nat {f.source}", style="dim")
    title = Text()
    title.append(f.severity.upper(), style=f"bold {colour}")
    title.append(f" {f.kind} · {f.where} · step {f.step}")
    return Panel(body, title=title, title_align="left", border_style=colour, expand=False)


def render_table(findings: Iterable[Finding], title: Optional[str] = None):
    from rich.table import Table
    from rich.text import Text

    table = Table(title=Text(title) if title is not None else None, title_justify="left")
    for col in ("severity", "kind", "where", "first step", "count"):
        table.add_column(col, overflow="fold")  # a long module path is wrapped, never cut
    for f in findings:
        table.add_row(Text(f.severity, style=_COLOURS.get(f.severity, "white")), Text(f.kind), Text(f.where),
                      str(f.step), str(f.count))
    return table
