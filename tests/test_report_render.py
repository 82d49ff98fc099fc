"""Renderers over a Record: dumps validated field by field, user strings shown as written (rich and HTML),
the CLI's own help and one-line errors, and findings printed off a terminal."""
import io
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from guard import guard
from guard.__main__ import main
from guard.findings import Finding
from guard.record import Record
from guard.report.console import LiveConsole
from guard.report.html import render_html
from guard.report.terminal import render_terminal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOSTILE = ["[/inst]", "[cls]", "[link=https://evil/x]click"]


class _TTY(io.StringIO):
    def isatty(self):
        return True


class Log(nn.Module):
    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x):
        return x.log() if self.armed else x


def _hostile_session(tmp_path, live=False, stream=None):
    """Three modules named by ModuleDict keys that are rich markup; each makes NaN once."""
    model = nn.Sequential(nn.Linear(3, 3), nn.ModuleDict({k: Log() for k in HOSTILE}))
    blocks = model[1]

    def forward(x):
        x = model[0](x)
        for k in HOSTILE:
            x = blocks[k](x)
        return x

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = guard(model, opt, mode="record", live=live, report=str(tmp_path / "h.json"))
    if stream is not None:
        g.console()._stream = stream
    with g:
        for k in HOSTILE:  # one step each: the first NaN origin of each step is reported
            for b in blocks.values():
                b.armed = False
            blocks[k].armed = True
            forward(-torch.ones(2, 3) - 5)  # finite input; log of negatives: NaN
            opt.step()
    return g


# --------------------------------------------------------------------------- Record and schema

def test_live_dump_validates_and_round_trips(tmp_path):
    from guard.record import validate

    g = _hostile_session(tmp_path)
    data = json.loads((tmp_path / "h.json").read_text())
    validate(data)
    rec = Record.load(str(tmp_path / "h.json"))
    assert [f.where for f in rec.findings] == [f"1.{k}" for k in HOSTILE] == [f.where for f in g.findings]
    assert all(isinstance(f, Finding) for f in rec.findings)
    assert rec.to_json()["findings"] == data["findings"]
    assert {m["path"] for m in rec.modules} >= {f"1.{k}" for k in HOSTILE}


def test_merge_tags_findings_with_their_rank():
    def rec(rank, where):
        return Record(findings=[Finding("grad-explosion", "warning", "m", "h", where, 1)], steps=3 + rank,
                      environment={"rank": rank, "world_size": 2}, modules=[{"path": where}])

    merged = Record.merge([rec(1, "b"), rec(0, "a")], ["r1.json", "r0.json"])
    assert [(f.where, f.details["rank"]) for f in merged.findings] == [("a", 0), ("b", 1)]
    assert merged.ranks == [0, 1] and merged.steps == 4 and merged.extra["merged_from"] == ["r1.json", "r0.json"]


def test_merge_of_one_runs_processes_tags_findings_with_their_process_not_a_rank(tmp_path, capsys):
    """TORCH_GUARD's main dump and a child's (no torch.distributed): shown as processes."""
    from guard.__main__ import main as cli
    from guard.report import write_report

    main_rec = Record(findings=[Finding("grad-explosion", "warning", "m", "h", "a", 1)], steps=3,
                      environment={"pid": 10}, modules=[{"path": "a"}])
    child = Record(findings=[Finding("nonfinite-input", "error", "m", "h", "input", 0)], steps=2,
                   environment={"pid": 11, "process": "pid11", "main_pid": 10}, modules=[{"path": "a"}])
    merged = Record.merge([child, main_rec], ["r.pid11.json", "r.json"])
    assert merged.merged_by == ("process", ["main", "pid11"]) and merged.ranks == []
    assert [(f.where, f.details["process"]) for f in merged.findings] == [("a", "main"), ("input", "pid11")]
    assert all("rank" not in f.details for f in merged.findings)
    write_report(main_rec, str(tmp_path / "r.json"))
    write_report(child, str(tmp_path / "r.pid11.json"))
    assert cli(["report", str(tmp_path / "r.json"), str(tmp_path / "r.pid11.json")]) == 0
    out = capsys.readouterr().out
    assert "merged processes ['main', 'pid11']" in out and "merged ranks" not in out


BAD_DUMPS = {
    "findings-int": ('{"schema": "guard-report/1", "findings": [1]}', "findings[0]: expected an object"),
    "timeline-ints": ('{"schema": "guard-report/1", "timeline": [1, 2, 3]}', "timeline[0]: expected an object"),
    "step-string": ('{"schema": "guard-report/1", "findings": [{"kind": "nonfinite-loss", "severity": "error", "message": "m",'
                    ' "hint": "h", "where": "w", "step": "3"}]}', "findings[0].step: expected an integer"),
    "no-hint": ('{"schema": "guard-report/1", "findings": [{"kind": "nonfinite-loss", "severity": "error", "message": "m",'
                ' "where": "w", "step": 3}]}', "findings[0].hint: missing"),
    "bad-severity": ('{"schema": "guard-report/1", "findings": [{"kind": "nonfinite-loss", "severity": "fatal", "message": "m",'
                     ' "hint": "h", "where": "w", "step": 3}]}', "findings[0].severity: expected one of error"),
    "timeline-step": ('{"schema": "guard-report/1", "timeline": [{"step": 0}, {"loss": 1.0}]}',
                      "timeline[1].step: missing"),
    "module-path": ('{"schema": "guard-report/1", "modules": [{"path": 3}]}', "modules[0].path: expected a string"),
    "env-list": ('{"schema": "guard-report/1", "environment": []}', "environment: expected an object"),
    "nested": ("[" * 100_000 + "]" * 100_000, "is not a guard report"),
    "deep-details": ('{"schema": "guard-report/1", "config": {"x": ' + "[" * 500 + "]" * 500 + "}}",
                     "is not a guard report (nested deeper"),
    "list": ("[]", "is not a guard report"),
    "kind-unknown": ('{"schema": "guard-report/1", "findings": [{"kind": "not-a-kind", "severity": "error", '
                     '"message": "m", "hint": "h", "where": "w", "step": 3}]}',
                     "findings[0].kind: expected a finding kind of the vocabulary"),
    "step-negative": ('{"schema": "guard-report/1", "findings": [{"kind": "nonfinite-loss", "severity": "error", '
                      '"message": "m", "hint": "h", "where": "w", "step": -5}]}', "findings[0].step: expected an integer >= 0"),
    "last-step-first": ('{"schema": "guard-report/1", "findings": [{"kind": "nonfinite-loss", "severity": "error", '
                        '"message": "m", "hint": "h", "where": "w", "step": 7, "last_step": 2}]}',
                        "findings[0].last_step: expected an integer >= step (7)"),
    "cost-list": ('{"schema": "guard-report/1", "cost": [1, 2]}', "cost: expected an object"),
    "cost-budget": ('{"schema": "guard-report/1", "cost": {"budget": "x"}}', "cost.budget: expected a number or null"),
    "created-word": ('{"schema": "guard-report/1", "created": "yesterday"}', "created: expected an ISO 8601 time"),
    "params-negative": ('{"schema": "guard-report/1", "modules": [{"path": "fc", "params": -3}]}',
                        "modules[0].params: expected an integer >= 0"),
}


@pytest.mark.parametrize("name", sorted(BAD_DUMPS))
@pytest.mark.parametrize("html", [False, True])
def test_bad_dump_is_one_line_naming_file_and_field(tmp_path, monkeypatch, capsys, name, html):
    text, needle = BAD_DUMPS[name]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.json").write_text(text)
    assert main(["report", "d.json"] + (["--html", "o.html"] if html else [])) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("guard report: d.json") and needle in lines[0], err
    assert not (tmp_path / "o.html").exists()


def test_binary_file_error_names_the_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "weights.pt").write_bytes(bytes(range(256)) * 8)
    assert main(["report", "weights.pt"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "guard report: weights.pt is not a text file (a guard-report/1 JSON dump expected)"


def test_schema_error_is_a_value_error_with_the_path():
    from guard.record import SchemaError

    with pytest.raises(SchemaError, match=r"^findings\[0\]: expected an object, got 1$"):
        Record.from_json({"schema": "guard-report/1", "findings": [1]})


def test_renderers_still_take_a_dict():
    d = {"schema": "guard-report/1", "steps": 2, "findings": [Finding("nonfinite-loss", "error", "m", "h", "loss", 1).to_dict()]}
    assert "nonfinite-loss" in render_html(d)
    con = _console()
    render_terminal(d, con)
    assert "1 finding(s)" in con.export_text()


# --------------------------------------------------------------------------- rich markup from user strings

def _console():
    from rich.console import Console

    return Console(file=_TTY(), force_terminal=True, width=200, record=True)


def _assert_shown_as_written(text, raw):
    for k in HOSTILE:
        assert k in text, text
    assert "\x1b]8;" not in raw  # no terminal hyperlink


def test_live_panels_and_exit_summary_show_markup_names_as_written(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    stream = _TTY()
    g = _hostile_session(tmp_path, live=True, stream=stream)
    assert [f.where for f in g.findings] == [f"1.{k}" for k in HOSTILE]
    raw = stream.getvalue()
    panels, summary = raw.split("guard: 3 finding(s) in 3 step(s)")
    _assert_shown_as_written(panels, panels)
    _assert_shown_as_written(summary, summary)
    assert "guard report:" in summary and "h.json" in summary


def test_exit_summary_of_a_record_with_a_markup_path(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    stream = _TTY()
    rec = Record(findings=[Finding("nonfinite-output", "error", "m [bold]x", "h", k, 0) for k in HOSTILE], steps=2)
    LiveConsole(True, stream=stream).summary(rec, path="/tmp/[/dim]r.json")
    raw = stream.getvalue()
    _assert_shown_as_written(raw, raw)
    assert "/tmp/[/dim]r.json" in raw


def test_cli_report_shows_markup_names_as_written(tmp_path, capsys):
    _hostile_session(tmp_path)
    assert main(["report", str(tmp_path / "h.json")]) == 0
    out = capsys.readouterr().out
    _assert_shown_as_written(out, out)
    assert out.count("[/inst]") >= 3  # table, finding text, nothing eaten
    con = _console()
    render_terminal(Record.load(str(tmp_path / "h.json")), con)
    _assert_shown_as_written(con.export_text(), con.file.getvalue())


def test_html_escapes_module_names_and_notices(tmp_path):
    names = ["<img src=x onerror=alert(1)>", "[link=https://evil/x]click", "a&b"]
    rec = Record(findings=[Finding("nonfinite-output", "error", "<b>m</b>", "h", n, 0) for n in names],
                 modules=[{"path": n, "type": "<T>"} for n in names], notices=["<script>x</script>"], steps=1)
    text = render_html(rec)
    assert "<img" not in text and "&lt;img src=x onerror=alert(1)&gt;" in text and "<b>m</b>" not in text
    assert "<script>x" not in text and "&lt;T&gt;" in text and "a&amp;b" in text
    assert "[link=https://evil/x]click" in text  # not markup in HTML: shown as is


# --------------------------------------------------------------------------- CLI

@pytest.mark.parametrize("cmd,own", [
    ([], ["run", "report", "checks"]),
    (["help", "report"], ["FILE.json", "--html"]),
    (["run"], ["--mode", "--report", "--no-live", "--fail-on", "-m MODULE"]),
    (["report"], ["FILE.json", "--html"]),
    (["checks"], ["python -m guard checks"]),
])
def test_each_command_has_its_own_help(capsys, cmd, own):
    assert main(cmd + ["--help"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.startswith("usage: python -m guard")
    for word in own:
        assert word in out


def test_run_options_after_the_script_are_the_scripts(tmp_path, monkeypatch):
    from guard.__main__ import _parse_run

    (tmp_path / "t.py").write_text("")
    monkeypatch.chdir(tmp_path)
    o = _parse_run(["--mode", "record", "--no-live", "t.py", "--mode", "x", "-m", "y", "--help"])
    assert (o["mode"], o["live"], o["script"], o["args"]) == ("record", False, "t.py", ["--mode", "x", "-m", "y", "--help"])
    o = _parse_run(["--checks=all", "-m", "pkg.mod", "--report", "r", "-h"])
    assert (o["checks"], o["module"], o["script"], o["args"]) == ("all", "pkg.mod", None, ["--report", "r", "-h"])


def test_unknown_check_answers_the_closest_in_one_short_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("print('ran')\n")
    assert main(["run", "--checks", "nonfinte", "x.py"]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and len(lines[0]) < 160, err
    assert "unknown check 'nonfinte'" in lines[0] and "did you mean 'nonfinite'?" in lines[0]
    assert "python -m guard checks" in lines[0]
    with pytest.raises(ValueError, match="did you mean 'grad-explosion'"):
        guard(checks=["default", "-grad-explosoin"])


def test_report_html_also_prints_the_one_line_summary(tmp_path, capsys):
    _hostile_session(tmp_path)
    assert main(["report", str(tmp_path / "h.json"), "--html", str(tmp_path / "o.html")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["guard: 3 finding(s) (3 error, 0 warning, 0 info) in 3 step(s)", f"guard: wrote {tmp_path / 'o.html'}"]


# --------------------------------------------------------------------------- off a terminal

def test_live_default_off_a_terminal_follows_the_contract(monkeypatch):
    """In code, live is on when stderr is a terminal (the contract); the environment's guard prints always."""
    monkeypatch.delenv("TORCH_GUARD_LIVE", raising=False)
    assert not sys.stderr.isatty()  # pytest captures it, as CI would
    model = nn.Linear(2, 2)
    assert guard(model).config.live is False
    assert guard(model, background=True).config.live is True
    assert guard(model, mode="record", background=True).config.live is False
    assert guard(model, mode="record", live=True).config.live is True
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert guard(model).config.live is True
    monkeypatch.setenv("TORCH_GUARD_LIVE", "0")
    assert guard(model).config.live is False


TRAIN = """\
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    x = torch.randn(16, 4)
    if step == 1:
        x[0, 0] = float("nan")
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print("trained")
"""


def _piped(args, cwd, **env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_GUARD")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **env_extra)
    r = subprocess.run([sys.executable, *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, timeout=120)  # pipes: stderr is not a TTY, as in CI or `| tee`
    assert r.returncode == 0 and "trained" in r.stdout, r.stderr
    return r.stderr


@pytest.mark.parametrize("how", ["run", "env"])
def test_off_a_terminal_findings_and_summary_are_plain_lines(tmp_path, how):
    (tmp_path / "train.py").write_text(TRAIN)
    args = ["-m", "guard", "run", "train.py"] if how == "run" else ["train.py"]
    err = _piped(args, tmp_path, **({"TORCH_GUARD": "1"} if how == "env" else {}))
    lines = err.splitlines()
    assert "\x1b[" not in err  # no ANSI codes in a log
    assert any(ln.startswith("guard ERROR nonfinite-input at input, step 1 (") and "train.py:10" in ln for ln in lines), err
    assert "guard: 1 finding(s) in 3 step(s)" in lines, err
    assert any(ln.startswith("guard report: ") and ln.endswith("guard-report.json") for ln in lines), err


@pytest.mark.parametrize("how", ["--no-live", "TORCH_GUARD_LIVE=0"])
def test_off_a_terminal_no_live_is_silent(tmp_path, how):
    (tmp_path / "train.py").write_text(TRAIN)
    if how == "--no-live":
        err = _piped(["-m", "guard", "run", "--no-live", "train.py"], tmp_path)
    else:
        err = _piped(["train.py"], tmp_path, TORCH_GUARD="1", TORCH_GUARD_LIVE="0")
    assert err == ""
    assert json.loads((tmp_path / "guard-report.json").read_text())["findings"][0]["kind"] == "nonfinite-input"
