"""HTML renderer of the report model: one self-contained file (inline CSS and SVG, no script, no network).

Header (run, environment, steps), findings grouped by severity, plots of loss and total
gradient norm over steps with the steps of findings marked, and the module table.
"""
from __future__ import annotations

import html
import json
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from ..findings import SEVERITIES, SEVERITY_RANK, Finding, printable
from ..record import Record

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2em auto;max-width:1100px;color:#222;padding:0 1em}
h1{margin-bottom:.2em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.6em 0;font-size:.92em}td,th{border:1px solid #ccc;padding:.3em .6em;text-align:left;vertical-align:top}
th{background:#f4f4f4}.meta td:first-child{font-weight:600;white-space:nowrap}
.badge{display:inline-block;border-radius:3px;padding:.1em .5em;color:#fff;font-size:.85em;font-weight:600}
.b-error{background:#c62828}.b-warning{background:#d98200}.b-info{background:#1565c0}
.finding{border:1px solid #ddd;border-left:5px solid #999;border-radius:4px;padding:.6em .9em;margin:.6em 0}
.finding.error{border-left-color:#c62828}.finding.warning{border-left-color:#d98200}.finding.info{border-left-color:#1565c0}
.finding .head{font-weight:600}.finding .where{font-family:ui-monospace,monospace}.finding .hint{margin-top:.3em}
.finding .src,.small{color:#666;font-size:.88em}code,pre{font-family:ui-monospace,monospace;font-size:.9em}
pre{background:#f7f7f7;padding:.5em;overflow-x:auto}.plot{margin:.5em 0 1em}.none{color:#2e7d32}
"""

_PLOT_W, _PLOT_H = 900, 220
_PAD_L, _PAD_R, _PAD_T, _PAD_B = 64, 16, 22, 34
_SEV_COLOUR = {"error": "#c62828", "warning": "#d98200", "info": "#1565c0"}


def _e(v: Any) -> str:
    return html.escape(printable("" if v is None else str(v)))  # no control characters or lone surrogates


def _num(v: Any) -> Optional[float]:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def _plot(report_id: str, title: str, points: Sequence[Tuple[int, Any]], marks: Dict[int, List[Finding]],
          steps_max: int) -> str:
    """An inline SVG line plot of `points` (step, value); non-finite values as red ticks; findings as lines."""
    finite = [(s, _num(v)) for s, v in points]
    vals = [v for _, v in finite if v is not None]
    x_hi = max([s for s, _ in points] + list(marks) + [steps_max - 1, 1])
    x_lo = min([s for s, _ in points] + list(marks) + [0])
    log = bool(vals) and min(vals) > 0 and max(vals) / min(vals) > 1e3
    tr = (lambda v: math.log10(v)) if log else (lambda v: v)
    if vals:
        lo, hi = min(map(tr, vals)), max(map(tr, vals))
    else:
        lo, hi = 0.0, 1.0
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5 * (abs(lo) or 1), hi + 0.5 * (abs(hi) or 1)
    iw, ih = _PLOT_W - _PAD_L - _PAD_R, _PLOT_H - _PAD_T - _PAD_B

    def X(s: float) -> float:
        return _PAD_L + (s - x_lo) / ((x_hi - x_lo) or 1) * iw

    def Y(v: float) -> float:
        return _PAD_T + (1 - (tr(v) - lo) / (hi - lo)) * ih

    out = [f"<svg id='{report_id}' class='plot' xmlns='http://www.w3.org/2000/svg' width='{_PLOT_W}' height='{_PLOT_H}'"
           f" viewBox='0 0 {_PLOT_W} {_PLOT_H}' role='img' aria-label='{_e(title)}'>",
           f"<title>{_e(title)}</title>",
           f"<rect x='{_PAD_L}' y='{_PAD_T}' width='{iw}' height='{ih}' fill='#fafafa' stroke='#ccc'/>",
           f"<text x='{_PAD_L}' y='14' font-size='13' font-weight='600'>{_e(title)}{' (log scale)' if log else ''}</text>"]
    for i in range(5):  # y grid and labels
        tv = lo + (hi - lo) * i / 4
        y = _PAD_T + (1 - i / 4) * ih
        label = _fmt(10 ** tv if log else tv)
        out.append(f"<line x1='{_PAD_L}' x2='{_PAD_L + iw}' y1='{y:.1f}' y2='{y:.1f}' stroke='#eee'/>"
                   f"<text x='{_PAD_L - 6}' y='{y + 4:.1f}' font-size='11' text-anchor='end' fill='#555'>{label}</text>")
    n_ticks = min(10, max(1, x_hi - x_lo))
    for i in range(n_ticks + 1):
        s = x_lo + round((x_hi - x_lo) * i / n_ticks)
        out.append(f"<text x='{X(s):.1f}' y='{_PLOT_H - _PAD_B + 16}' font-size='11' text-anchor='middle' fill='#555'>{s}</text>")
    out.append(f"<text x='{_PAD_L + iw / 2:.1f}' y='{_PLOT_H - 4}' font-size='11' text-anchor='middle' fill='#555'>step</text>")
    for s, fs in sorted(marks.items()):  # findings on the step axis
        sev = min((f.severity for f in fs), key=lambda v: SEVERITY_RANK.get(v, 9))
        tip = "; ".join(f"{f.kind} at {f.where}" for f in fs)
        out.append(f"<g class='finding-mark' data-step='{s}'><title>step {s}: {_e(tip)}</title>"
                   f"<line x1='{X(s):.1f}' x2='{X(s):.1f}' y1='{_PAD_T}' y2='{_PAD_T + ih}' stroke='{_SEV_COLOUR.get(sev, '#999')}'"
                   f" stroke-dasharray='4 3' stroke-width='1.5'/>"
                   f"<path d='M{X(s) - 5:.1f},{_PAD_T + ih + 8} L{X(s) + 5:.1f},{_PAD_T + ih + 8} L{X(s):.1f},{_PAD_T + ih}Z'"
                   f" fill='{_SEV_COLOUR.get(sev, '#999')}'/></g>")
    segs: List[List[str]] = [[]]
    for s, v in finite:
        if v is None:
            segs.append([])
            out.append(f"<g class='nonfinite'><title>step {s}: {_e(dict(points).get(s))}</title>"
                       f"<line x1='{X(s):.1f}' x2='{X(s):.1f}' y1='{_PAD_T}' y2='{_PAD_T + 10}' stroke='#c62828' stroke-width='3'/></g>")
        else:
            segs[-1].append(f"{X(s):.1f},{Y(v):.1f}")
    for seg in segs:
        if len(seg) > 1:
            out.append(f"<polyline class='series' fill='none' stroke='#333' stroke-width='1.5' points='{' '.join(seg)}'/>")
        elif len(seg) == 1:
            x, y = seg[0].split(",")
            out.append(f"<circle class='series' cx='{x}' cy='{y}' r='2.5' fill='#333'/>")
    if not vals:
        out.append(f"<text x='{_PAD_L + iw / 2:.1f}' y='{_PAD_T + ih / 2:.1f}' text-anchor='middle' fill='#888'>no finite values</text>")
    out.append("</svg>")
    return "".join(out)


def _finding_html(f: Finding) -> str:
    sev = _e(f.severity)
    rank = f.details.get("rank")
    process = f.details.get("process")
    steps = f"step {_e(f.step)}"
    if f.last_step not in (None, f.step):
        steps += f"–{_e(f.last_step)}"
    parts = [f"<div class='finding {sev}' data-kind='{_e(f.kind)}'>",
             f"<div class='head'><span class='badge b-{sev}'>{sev}</span> {_e(f.kind)} · "
             f"<span class='where'>{_e(f.where)}</span> · {steps} · seen {_e(f.count)}×"
             + (f" · rank {_e(rank)}" if rank is not None else "")
             + (f" · process {_e(process)}" if process is not None else "") + "</div>",
             f"<div class='message'>{_e(f.message)}</div>",
             f"<div class='hint'><b>fix:</b> {_e(f.hint)}</div>"]
    if f.source:
        parts.append(f"<div class='src'>at <code>{_e(f.source)}</code></div>")
    if f.details:
        parts.append(f"<details><summary class='small'>details</summary>"
                     f"<pre>{_e(json.dumps(f.details, indent=2, default=str))}</pre></details>")
    parts.append("</div>")
    return "".join(parts)


def render_html(record: Union[Record, dict]) -> str:
    """The record as a self-contained HTML page (every user-derived string escaped)."""
    rec = Record.of(record)
    env, cfg = rec.environment, rec.config
    findings = rec.sorted_findings()
    steps = rec.steps
    counts = rec.counts()
    run = " ".join(map(str, env.get("argv") or [])) or "?"
    meta = [("run", f"<code>{_e(run)}</code>"), ("created", _e(rec.created)), ("steps", _e(steps)),
            ("torch / python", f"{_e(env.get('torch'))} / {_e(env.get('python'))}"),
            ("platform", _e(env.get("platform"))), ("devices", _e(", ".join(map(str, env.get("devices") or []))))]
    if rec.merged_by is not None:
        unit, labels = rec.merged_by
        meta.append((f"{unit}es (merged)" if unit == "process" else f"{unit}s (merged)", _e(", ".join(map(str, labels)))))
    elif "rank" in env:
        meta.append(("rank", f"{_e(env.get('rank'))} of {_e(env.get('world_size'))}"))
    meta.append(("guard config", f"mode {_e(cfg.get('mode'))} · checks {_e(', '.join(map(str, cfg.get('checks') or [])))}"
                                 f" · every {_e(cfg.get('every'))}"))
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'><title>guard report</title>",
        "<meta name='viewport' content='width=device-width,initial-scale=1'>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>guard report</h1>",
        f"<p id='summary'><b>{len(findings)} finding(s)</b>: "
        + " ".join(f"<span class='badge b-{s}'>{counts[s]} {s}</span>" for s in SEVERITIES)
        + f" in {_e(steps)} step(s)</p>",
        "<table class='meta' id='header'>" + "".join(f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in meta) + "</table>",
        f"<h2>Findings ({len(findings)})</h2><div id='findings'>",
    ]
    if not findings:
        parts.append("<p class='none'>No findings: guard saw none of the pitfalls it checks for.</p>")
    for sev in SEVERITIES:
        group = [f for f in findings if f.severity == sev]
        if group:
            parts.append(f"<section class='severity-group' id='sev-{sev}'><h3>{sev} ({len(group)})</h3>")
            parts.extend(_finding_html(f) for f in group)
            parts.append("</section>")
    parts.append("</div>")
    marks: Dict[int, List[Finding]] = {}
    for f in findings:
        marks.setdefault(f.step, []).append(f)
    parts.append("<h2>Timeline</h2>")
    loss, gnorm = rec.series("loss"), rec.series("grad_norm")
    if loss or gnorm or marks:
        parts.append("<p class='small'>Dashed lines and triangles on the step axis: the first step of each finding"
                     " (hover for what). Red ticks at the top: non-finite values.</p>")
        parts.append(_plot("plot-loss", "loss", loss, marks, steps))
        parts.append(_plot("plot-grad-norm", "total gradient norm", gnorm, marks, steps))
        skipped = [s for s, v in rec.series("skipped") if v]
        if skipped:
            parts.append(f"<p class='small'>steps skipped by the AMP GradScaler: {_e(', '.join(map(str, skipped[:50])))}</p>")
    else:
        parts.append("<p class='small'>No loss or gradient norm was measured (no backward/optimizer step seen).</p>")
    parts.append(f"<h2>Modules ({len(rec.modules)})</h2><table id='modules'><tr><th>path</th><th>type</th>"
                 "<th>output shape</th><th>dtype</th><th>device</th><th>parameters</th></tr>")
    for m in rec.modules:
        shape = m.get("output_shape")
        shape = "×".join(map(str, shape)) if isinstance(shape, list) else shape
        parts.append("<tr>" + f"<td><code>{_e(m['path'])}</code></td>"
                     + "".join(f"<td>{_e(v)}</td>" for v in (m.get("type"), shape, m.get("dtype"), m.get("device"),
                                                              m.get("params"))) + "</tr>")
    parts.append("</table>")
    if rec.internal_errors:
        parts.append("<h2>guard's own errors</h2><ul>" + "".join(
            f"<li>check <code>{_e(e.get('check'))}</code>: {_e(e.get('error'))} at {_e(e.get('at'))}"
            f" (step {_e(e.get('step'))}); the check was switched off</li>" for e in rec.internal_errors) + "</ul>")
    if rec.notices:
        parts.append("<h2>Notices</h2><ul>" + "".join(f"<li>{_e(n)}</li>" for n in rec.notices) + "</ul>")
    parts.append("<p class='small'>written by guard (torch-runtime-guard)</p></body></html>\n")
    return "".join(parts)
