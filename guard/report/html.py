"""HTML renderer of the report model: one self-contained file, no network."""
from __future__ import annotations

import html
from typing import Any, Dict, List

from ..findings import SEVERITY_RANK

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.3em .6em;text-align:left}
.error{color:#b00}.warning{color:#a60}.info{color:#06a}.hint{color:#333;font-style:italic}
"""


def _e(v: Any) -> str:
    return html.escape("" if v is None else str(v))


def render_html(report: Dict[str, Any]) -> str:
    """The report as an HTML page (header, findings by severity, timeline, modules)."""
    env = report.get("environment", {})
    findings: List[Dict[str, Any]] = sorted(report.get("findings", []),
                                            key=lambda f: (SEVERITY_RANK.get(f.get("severity"), 9), f.get("step", 0)))
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>guard report</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>guard report</h1>",
        f"<p>created {_e(report.get('created'))} · {_e(report.get('steps'))} steps · torch {_e(env.get('torch'))}"
        f" · python {_e(env.get('python'))} · {_e(env.get('platform'))}</p>",
        f"<h2>Findings ({len(findings)})</h2>",
        "<table id='findings'><tr><th>severity</th><th>kind</th><th>where</th><th>step</th><th>count</th>"
        "<th>message / fix</th><th>source</th></tr>",
    ]
    for f in findings:
        sev = _e(f.get("severity"))
        parts.append(
            f"<tr class='finding {sev}'><td class='{sev}'>{sev}</td><td>{_e(f.get('kind'))}</td>"
            f"<td>{_e(f.get('where'))}</td><td>{_e(f.get('step'))}</td><td>{_e(f.get('count'))}</td>"
            f"<td>{_e(f.get('message'))}<div class='hint'>fix: {_e(f.get('hint'))}</div></td>"
            f"<td>{_e(f.get('source'))}</td></tr>")
    parts.append("</table>")
    timeline = report.get("timeline", [])
    if timeline:
        parts.append("<h2>Timeline</h2><table id='timeline'><tr><th>step</th><th>loss</th><th>grad norm</th></tr>")
        for e in timeline[-200:]:
            parts.append(f"<tr><td>{_e(e.get('step'))}</td><td>{_e(e.get('loss'))}</td><td>{_e(e.get('grad_norm'))}</td></tr>")
        parts.append("</table>")
    parts.append("<h2>Modules</h2><table id='modules'><tr><th>path</th><th>type</th><th>output shape</th>"
                 "<th>dtype</th><th>device</th><th>parameters</th></tr>")
    for m in report.get("modules", []):
        parts.append(f"<tr><td>{_e(m.get('path'))}</td><td>{_e(m.get('type'))}</td><td>{_e(m.get('output_shape'))}</td>"
                     f"<td>{_e(m.get('dtype'))}</td><td>{_e(m.get('device'))}</td><td>{_e(m.get('params'))}</td></tr>")
    parts.append("</table></body></html>\n")
    return "".join(parts)
