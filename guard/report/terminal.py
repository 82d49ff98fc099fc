"""Terminal renderer of report dumps (``python -m guard report``) and merging of per-rank dumps."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

from ..findings import SEVERITY_RANK

_COLOURS = {"error": "red", "warning": "yellow", "info": "cyan"}
_BARS = "▁▂▃▄▅▆▇█"


def _num(v: Any) -> Optional[float]:
    """A finite float, or None (dumps store NaN/Inf as strings)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def merge_reports(reports: Sequence[Dict[str, Any]], names: Sequence[str] = ()) -> Dict[str, Any]:
    """One report from several (one per rank): findings of all, each tagged with its ``rank``.

    The timeline is the lowest rank's; modules are the union by path.
    """
    if len(reports) == 1:
        return reports[0]

    def rank_of(i: int) -> int:
        r = reports[i].get("environment", {}).get("rank")
        return r if isinstance(r, int) else i

    order = sorted(range(len(reports)), key=rank_of)
    first = reports[order[0]]
    findings: List[Dict[str, Any]] = []
    modules: Dict[str, Dict[str, Any]] = {}
    for i in order:
        rep = reports[i]
        for f in rep.get("findings", []):
            f = dict(f)
            f["details"] = {**f.get("details", {})}
            f["details"].setdefault("rank", rank_of(i))
            findings.append(f)
        for m in rep.get("modules", []):
            modules.setdefault(m.get("path"), m)
    env = dict(first.get("environment", {}))
    env["ranks"] = [rank_of(i) for i in order]
    env.pop("rank", None)
    return {
        **first,
        "environment": env,
        "steps": max(int(r.get("steps", 0) or 0) for r in reports),
        "findings": findings,
        "modules": list(modules.values()),
        "internal_errors": [e for r in reports for e in r.get("internal_errors", [])],
        "merged_from": list(names),
    }


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


def _series(timeline: List[Dict[str, Any]], key: str) -> List[Optional[float]]:
    return [_num(e.get(key)) for e in timeline if key in e]


def render_terminal(report: Dict[str, Any], console: Any) -> None:
    """Print summary, findings with hints, and timeline sparklines to a rich `console`."""
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    env = report.get("environment", {})
    findings = sorted(report.get("findings", []),
                      key=lambda f: (SEVERITY_RANK.get(f.get("severity"), 9), f.get("step", 0)))
    counts = {s: sum(1 for f in findings if f.get("severity") == s) for s in ("error", "warning", "info")}
    head = Text()
    head.append(f"{len(findings)} finding(s)", style="bold")
    head.append(f"  ({counts['error']} error, {counts['warning']} warning, {counts['info']} info)")
    head.append(f" in {report.get('steps', 0)} step(s)\n")
    head.append(f"created {report.get('created')} · torch {env.get('torch')} · python {env.get('python')}"
                f" · {env.get('platform')}")
    if env.get("ranks"):
        head.append(f"\nmerged ranks {env['ranks']}")
    elif "rank" in env:
        head.append(f"\nrank {env.get('rank')} of {env.get('world_size')}")
    if env.get("argv"):
        head.append(f"\nrun: {' '.join(map(str, env['argv']))}", style="dim")
    console.print(Panel(head, title="guard report", title_align="left", expand=False))
    merged = bool(env.get("ranks"))
    if findings:
        table = Table(title="findings", title_justify="left")
        for col in ("severity", "kind", "where", "steps", "count") + (("rank",) if merged else ()):
            table.add_column(col)
        for f in findings:
            colour = _COLOURS.get(f.get("severity"), "white")
            step = str(f.get("step"))
            if f.get("last_step") not in (None, f.get("step")):
                step += f"–{f['last_step']}"
            row = [f"[{colour}]{f.get('severity')}[/]", str(f.get("kind")), str(f.get("where")), step,
                   str(f.get("count", 1))]
            if merged:
                row.append(str(f.get("details", {}).get("rank", "")))
            table.add_row(*row)
        console.print(table)
        for f in findings:  # the full text, so nothing is cut to fit a column
            colour = _COLOURS.get(f.get("severity"), "white")
            body = Text()
            body.append(f"{f.get('severity', '').upper()} ", style=f"bold {colour}")
            body.append(f"{f.get('kind')} · {f.get('where')} · step {f.get('step')}")
            if merged and "rank" in f.get("details", {}):
                body.append(f" · rank {f['details']['rank']}")
            body.append(f"\n  {f.get('message', '')}\n")
            body.append("  fix: ", style="bold")
            body.append(str(f.get("hint", "")))
            if f.get("source"):
                body.append(f"\n  at {f['source']}", style="dim")
            console.print(body)
    else:
        console.print("[green]no findings[/green]")
    timeline = report.get("timeline", [])
    if timeline:
        steps = [e.get("step", 0) for e in timeline]
        console.print(f"timeline: steps {min(steps)}–{max(steps)}" + (" (lowest rank)" if merged else ""))
        for key, label in (("loss", "loss     "), ("grad_norm", "grad norm")):
            vals = _series(timeline, key)
            if vals:
                finite = [v for v in vals if v is not None]
                rng = f" {min(finite):.4g} … {max(finite):.4g}" if finite else " non-finite"
                console.print(f"  {label} {sparkline(vals)}{rng}", highlight=False)
        marks = sorted({f.get("step", 0) for f in findings})
        if marks:
            console.print(f"  findings at step(s): {', '.join(map(str, marks[:20]))}" + (" …" if len(marks) > 20 else ""))
    errors = report.get("internal_errors") or []
    for e in errors:
        console.print(f"[dim]guard internal error in {e.get('check')}: {e.get('error')}[/dim]")
