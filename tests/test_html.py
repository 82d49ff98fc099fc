"""The HTML report: self-contained, findings by severity, SVG plots with findings marked, module table.

The browser tests render the page in headless chromium (skipped where it is not installed).
"""
import html.parser
import os
import re
import shutil
import subprocess

import pytest
import torch
from torch import nn

from guard import guard
from guard.report.html import render_html


def _session(tmp_path, bad_step=8, steps=12):
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with guard(model, opt, mode="record", live=False, report=str(tmp_path / "report.html")) as g:
        for step in range(steps):
            x = torch.randn(32, 4)
            if step == bad_step:
                x[3, 1] = float("inf")
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == bad_step:
                break
    return g


class _Collect(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def _tags(text):
    p = _Collect()
    p.feed(text)
    return p.tags


@pytest.fixture
def page(tmp_path):
    g = _session(tmp_path)
    assert [(f.kind, f.step) for f in g.findings] == [("nonfinite-input", 8)]
    return tmp_path / "report.html", g


def test_report_html_suffix_writes_the_page(page):
    path, g = page
    assert g.report_path == str(path)
    text = path.read_text()
    assert text.startswith("<!doctype html>") and text.rstrip().endswith("</html>")
    assert "nonfinite-input" in text and "fix:" in text and "test_html.py:" in text


def test_plots_mark_the_findings_step_and_modules_table(page):
    text = page[0].read_text()
    tags = _tags(text)
    svgs = {a.get("id") for t, a in tags if t == "svg"}
    assert {"plot-loss", "plot-grad-norm"} <= svgs
    marks = [a for t, a in tags if t == "g" and a.get("class") == "finding-mark"]
    assert [m["data-step"] for m in marks] == ["8", "8"]  # one per plot
    assert sum(1 for t, a in tags if t == "polyline" and a.get("class") == "series") == 2
    assert sum(1 for t, a in tags if t == "g" and a.get("class") == "nonfinite") == 2  # the Inf step's loss/norm
    assert ("section", {"class": "severity-group", "id": "sev-error"}) in tags
    modules = text[text.index("id='modules'"):]
    for path, typ in (("0", "Linear"), ("1", "ReLU"), ("2", "Linear")):
        assert f"<td><code>{path}</code></td><td>{typ}</td>" in modules


def test_self_contained_no_script_no_network(page):
    text = page[0].read_text()
    assert "<script" not in text.lower() and "<link" not in text.lower()
    assert not re.search(r"(src|href)\s*=\s*['\"]?\s*(https?:)?//", text, re.I)
    assert "@import" not in text and "url(" not in text


def test_escapes_user_text_and_groups_by_severity():
    f = lambda sev, kind, step: {"kind": kind, "severity": sev, "message": "<script>alert(1)</script>",
                                 "hint": "use a & b", "where": "m<1>", "step": step, "count": 1, "details": {}}
    rep = {"schema": "guard-report/1", "steps": 3, "environment": {}, "config": {},
           "findings": [f("info", "sigmoid-before-bce", 2), f("error", "nonfinite-loss", 1),
                        f("warning", "grad-explosion", 0)],
           "timeline": [], "modules": []}
    text = render_html(rep)
    assert "<script>" not in text and "&lt;script&gt;" in text and "m&lt;1&gt;" in text
    order = [text.index(f"id='sev-{s}'") for s in ("error", "warning", "info")]
    assert order == sorted(order)
    assert "no finite values" in text  # no timeline: the findings are still marked on empty axes
    assert "No loss or gradient norm was measured" in render_html({**rep, "findings": []})


def test_clean_run_says_no_findings(tmp_path):
    g = _session(tmp_path, bad_step=-1, steps=4)
    assert g.findings == []
    text = (tmp_path / "report.html").read_text()
    assert "No findings" in text and "id='plot-loss'" in text and "finding-mark" not in text


# --------------------------------------------------------------------------- real browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install chromium)")


def _chromium(tmp_path, url, *action):
    """Run headless chromium on `url`; returns (stdout, console messages of the page)."""
    r = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'chromium-profile'}", "--enable-logging=stderr", "--v=0",
         "--window-size=1100,1500", *action, url],
        capture_output=True, text=True, timeout=120)
    console = [line for line in r.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]
    return r.stdout, console


@needs_chromium
def test_console_detector_sees_page_errors(tmp_path):
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><script>console.error('boom'); nope();</script></body></html>")
    _, console = _chromium(tmp_path, bad.as_uri(), "--dump-dom")
    assert any("boom" in line for line in console) and any("nope" in line for line in console)


@needs_chromium
def test_renders_in_headless_chromium_without_console_errors(page, tmp_path):
    path = page[0]
    dom, console = _chromium(tmp_path, path.as_uri(), "--dump-dom")
    assert console == []
    tags = _tags(dom)
    ids = {a.get("id") for _, a in tags}
    assert {"plot-loss", "plot-grad-norm", "findings", "modules", "summary"} <= ids
    assert sum(1 for t, a in tags if t == "g" and a.get("class") == "finding-mark") == 2
    png = tmp_path / "report.png"
    _, console = _chromium(tmp_path, path.as_uri(), f"--screenshot={png}")
    assert console == []
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20000  # a real page, not a blank one
    if os.environ.get("GUARD_HTML_PNG"):  # keep a copy to look at
        shutil.copy(png, os.environ["GUARD_HTML_PNG"])
