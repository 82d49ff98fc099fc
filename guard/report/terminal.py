"""Terminal renderer of a `Record` (``python -m guard report``): summary, findings with hints, sparklines.

Several dumps are merged before rendering (`guard.record.Record.merge`).

Every user-derived string (module paths, messages, argv, file names) goes to rich as `Text`, never as
markup: a module named ``[/inst]`` or ``[link=...]`` is shown as written.
"""
from __future__ import annotations

import math
from typing import Any, List, Optional, Sequence, Union

from ..record import Record

_COLOURS = {"error": "red", "warning": "yellow", "info": "cyan"}
_BARS = "▁▂▃▄▅▆▇█"


def _num(v: Any) -> Optional[float]:
    """A finite float, or None (dumps store NaN/Inf as strings)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def sparkline(values: Sequence[Optional[float]], width: int = 60) -> str:
    """Unicode bars for `values` (None: a gap shown as ``!``), squeezed to `width` by bucket means."""
    if not values:
        return ""
    if len(values) > width:
        size = len(values) / width
        buckets = [values[int(i * size):max(int((i + 1) * size), int(i * size) + 1)] for i in range(width)]
        values = [None if any(v is None for v in b) else sum(b) / len(b) for b in buckets]  # type: ignore[misc]
    finite = [v for v in values if v is not None]
    if not finite:
        return "!" * len(values)
    lo, hi = min(finite), max(finite)
    span = hi - lo or 1.0
    return "".join("!" if v is None else _BARS[min(len(_BARS) - 1, int((v - lo) / span * len(_BARS)))] for v in values)


def render_terminal(record: Union[Record, dict], console: Any) -> None:
    """Print summary, findings with hints, and timeline sparklines to a rich `console`."""
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    rec = Record.of(record)
    env = rec.environment
    findings = rec.sorted_findings()
    counts = rec.counts()
    by = rec.merged_by
    merged = by is not None
    unit = by[0] if by else "rank"
    head = Text()
    head.append(f"{len(findings)} finding(s)", style="bold")
    head.append(f"  ({counts['error']} error, {counts['warning']} warning, {counts['info']} info)")
    head.append(f" in {rec.steps} step(s)\n")
    head.append(f"created {rec.created} · torch {env.get('torch')} · python {env.get('python')}"
                f" · {env.get('platform')}")
    if merged:
        head.append(f"\nmerged {'processes' if unit == 'process' else 'ranks'} {by[1]}")
    elif "rank" in env:
        head.append(f"\nrank {env.get('rank')} of {env.get('world_size')}")
    if env.get("argv"):
        head.append(f"\nrun: {' '.join(map(str, env['argv']))}", style="dim")
    console.print(Panel(head, title="guard report", title_align="left", expand=False))
    if findings:
        table = Table(title="findings", title_justify="left")
        for col in ("severity", "kind", "where", "steps", "count") + ((unit,) if merged else ()):
            table.add_column(col)
        for f in findings:
            step = str(f.step)
            if f.last_step not in (None, f.step):
                step += f"–{f.last_step}"
            row = [Text(f.severity, style=_COLOURS.get(f.severity, "white")), Text(f.kind), Text(f.where),
                   Text(step), Text(str(f.count))]
            if merged:
                row.append(Text(str(f.details.get(unit, ""))))
            table.add_row(*row)
        console.print(table)
        for f in findings:  # the full text, so nothing is cut to fit a column
            body = Text()
            body.append(f"{f.severity.upper()} ", style=f"bold {_COLOURS.get(f.severity, 'white')}")
            body.append(f"{f.kind} · {f.where} · step {f.step}")
            if merged and unit in f.details:
                body.append(f" · {unit} {f.details[unit]}")
            body.append(f"\n  {f.message}\n")
            body.append("  fix: ", style="bold")
            body.append(f.hint)
            if f.source:
                body.append(f"\n  at {f.source}", style="dim")
            console.print(body)
    else:
        console.print(Text("no findings", style="green"))
    if rec.timeline:
        steps = [e["step"] for e in rec.timeline]
        console.print(Text(f"timeline: steps {min(steps)}–{max(steps)}" + (" (lowest rank)" if merged else "")))
        for key, label in (("loss", "loss     "), ("grad_norm", "grad norm")):
            vals: List[Optional[float]] = [_num(v) for _, v in rec.series(key)]
            if vals:
                finite = [v for v in vals if v is not None]
                rng = f" {min(finite):.4g} … {max(finite):.4g}" if finite else " non-finite"
                console.print(Text(f"  {label} {sparkline(vals)}{rng}"))
        marks = sorted({f.step for f in findings})
        if marks:
            console.print(Text(f"  findings at step(s): {', '.join(map(str, marks[:20]))}"
                               + (" …" if len(marks) > 20 else "")))
    for e in rec.internal_errors:
        console.print(Text(f"guard internal error in {e.get('check')}: {e.get('error')}", style="dim"))
    for n in rec.notices:
        console.print(Text(n, style="dim"))
