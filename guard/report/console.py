"""Live console renderer: one panel per new finding, a summary table at exit.

On a TTY it uses rich; elsewhere (CI logs) it prints plain lines with no ANSI codes.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Iterable, Optional, Union

from ..findings import SEVERITY_RANK, Finding

if TYPE_CHECKING:  # pragma: no cover
    from ..session import Guard

_COLOURS = {"error": "red", "warning": "yellow", "info": "cyan"}


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:
        pass
    return 0


class LiveConsole:
    """Prints findings as they happen to stderr (or `stream`)."""

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

    def summary(self, g: "Guard") -> None:
        if not self.enabled:
            return
        findings = g.findings
        path = g.report_path
        if not findings and not path:
            return
        if self._tty():
            con = self._rich()
            con.print(render_table(findings, title=f"guard: {len(findings)} finding(s) in {g.step} step(s)"))
            cost = _cost_line(g)
            if cost:
                con.print(f"[dim]{cost}[/dim]")
            if path:
                con.print(f"[dim]guard report: {path}[/dim]")
        else:
            lines = [f"guard: {len(findings)} finding(s) in {g.step} step(s)"]
            for f in sorted(findings, key=lambda f: (SEVERITY_RANK[f.severity], f.step)):
                lines.append(f"  {f.severity:<7} {f.kind:<28} {f.where:<30} step {f.step:<6} x{f.count}")
            cost = _cost_line(g)
            if cost:
                lines.append(cost)
            if path:
                lines.append(f"guard report: {path}")
            self.stream.write("\n".join(lines) + "\n")
            self.stream.flush()


def _cost_line(g: Any) -> str:
    """``guard cost 3.1% of step time`` (and what a budget sampled), or "" before two steps."""
    try:
        cost = g.cost()
    except Exception:
        return ""
    ov = cost.get("overhead")
    if ov is None:
        return ""
    line = f"guard cost {ov * 100:.1f}% of step time"
    if cost.get("sampled_checks"):
        line += (f" (budget {cost['budget'] * 100:g}%: {', '.join(cost['sampled_checks'])} sampled, "
                 f"every {cost['max_period']} steps at most)")
    return line


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
    title = f"[bold {colour}]{f.severity.upper()}[/] {f.kind} · {f.where} · step {f.step}"
    return Panel(body, title=title, title_align="left", border_style=colour, expand=False)


def render_table(findings: Iterable[Finding], title: Optional[str] = None):
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for col in ("severity", "kind", "where", "first step", "count"):
        table.add_column(col)
    for f in sorted(findings, key=lambda f: (SEVERITY_RANK[f.severity], f.step)):
        colour = _COLOURS.get(f.severity, "white")
        table.add_row(f"[{colour}]{f.severity}[/]", f.kind, f.where, str(f.step), str(f.count))
    return table
