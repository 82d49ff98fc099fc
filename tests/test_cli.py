"""python -m guard run / report / checks, and the torch-guard console script."""
import json
import os
import subprocess
import sys
import sysconfig

import pytest

from guard.__main__ import main
from guard.checks import registry

SCRIPT = """\
import os, sys
import torch
from torch import nn

print("argv", sys.argv[1:], "name", __name__, "file", __file__.endswith("train.py"), "abs", os.path.isabs(__file__))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    x = torch.randn(16, 4)
    if "--dirty" in sys.argv and step == 1:
        x[0, 0] = float("nan")
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
if "--crash" in sys.argv:
    raise RuntimeError("boom")
sys.exit(int(sys.argv[sys.argv.index("--exit") + 1]) if "--exit" in sys.argv else 0)
"""


def _run(args, cwd, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_GUARD")}
    env.update(OMP_NUM_THREADS="1", **extra)
    return subprocess.run([sys.executable, "-m", "guard", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def proj(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    return tmp_path


def test_run_script_like_python_with_args_exit_status_and_dump(proj):
    r = _run(["run", "--mode", "record", "--report", "r.json", "train.py", "--dirty", "--exit", "3", "-x"], proj)
    assert r.returncode == 3, r.stderr
    assert "argv ['--dirty', '--exit', '3', '-x'] name __main__ file True abs True" in r.stdout  # as python does
    dump = json.loads((proj / "r.json").read_text())
    assert [(f["kind"], f["where"], f["step"]) for f in dump["findings"]] == [("nonfinite-input", "input", 1)]
    assert dump["findings"][0]["source"].endswith("train.py:13")
    assert dump["environment"]["argv"][0] == "train.py"


def test_run_fail_on_and_crash(proj):
    r = _run(["run", "--no-live", "--fail-on", "error", "train.py", "--dirty"], proj)
    assert r.returncode == 1
    assert "guard: 1 finding(s) of severity error or worse (nonfinite-input)" in r.stderr
    assert (proj / "guard-report.json").exists()  # the default dump
    clean = _run(["run", "--no-live", "--no-report", "--fail-on", "warning", "train.py"], proj)
    assert clean.returncode == 0, clean.stderr
    crash = _run(["run", "--no-live", "--report", "c.json", "train.py", "--crash"], proj)
    assert crash.returncode == 1
    assert "RuntimeError: boom" in crash.stderr and "Traceback" in crash.stderr
    assert "runpy" not in crash.stderr  # guard's own frames are not the user's problem
    assert json.loads((proj / "c.json").read_text())["steps"] == 3  # dumped on the exception path too


def test_run_replaces_the_environments_guard(proj):
    r = _run(["run", "--mode", "record", "--report", "cli.json", "train.py", "--dirty"], proj, TORCH_GUARD="1")
    assert r.returncode == 0, r.stderr
    assert len(json.loads((proj / "cli.json").read_text())["findings"]) == 1
    assert not (proj / "guard-report.json").exists()  # one guard, not two


def test_run_module_with_dash_m(proj):
    pkg = proj / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(SCRIPT)
    r = _run(["run", "--mode", "record", "--report", "m.json", "-m", "mypkg.train", "--dirty"], proj)
    assert r.returncode == 0, r.stderr
    assert "argv ['--dirty'] name __main__" in r.stdout
    assert json.loads((proj / "m.json").read_text())["findings"][0]["kind"] == "nonfinite-input"


@pytest.mark.parametrize("args,needle", [
    (["frobnicate"], "unknown command 'frobnicate'"),
    (["run"], "no script given"),
    (["run", "missing.py"], "cannot open script 'missing.py'"),
    (["run", "--mode", "loud", "x.py"], "--mode='loud' is not a mode; allowed: warn, raise, record"),
    (["run", "--every", "0", "x.py"], "--every='0' is not a step interval"),
    (["run", "--checks", "nope", "x.py"], "--checks has unknown check 'nope'"),
    (["run", "--fail-on", "fatal", "x.py"], "--fail-on='fatal' is not a severity"),
    (["run", "--wat", "x.py"], "unknown option '--wat'"),
    (["report"], "no dump given"),
    (["report", "missing.json"], "missing.json: no such file"),
    (["report", "notjson.json"], "is not JSON"),
    (["report", "other.json"], "is not a guard report"),
    (["checks", "extra"], "takes no arguments"),
])
def test_bad_input_is_one_line_and_status_2(tmp_path, monkeypatch, capsys, args, needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("print('ran')\n")
    (tmp_path / "notjson.json").write_text("{nope")
    (tmp_path / "other.json").write_text('{"schema": "something-else"}')
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and "ran" not in out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], err


def _dump(rank, findings, steps=5):
    return {"schema": "guard-report/1", "created": "2026-01-01T00:00:00+00:00",
            "environment": {"python": "3.11", "torch": "2.x", "platform": "linux", "rank": rank, "world_size": 2},
            "config": {"mode": "record", "checks": ["default"], "every": 1}, "steps": steps,
            "findings": findings,
            "timeline": [{"step": s, "loss": 1.0 / (s + 1), "grad_norm": 2.0 - s * 0.1} for s in range(steps)]
                        + [{"step": steps, "loss": "nan"}],
            "modules": [{"path": "fc", "type": "Linear", "output_shape": [2, 3], "dtype": "torch.float32",
                         "device": "cpu", "params": 9}], "internal_errors": []}


def _finding(kind, severity, where, step, rank):
    return {"kind": kind, "severity": severity, "message": f"{kind} happened", "hint": f"do X about {kind}",
            "where": where, "step": step, "count": 2, "source": "train.py:12", "details": {"rank": rank},
            "last_step": step + 1}


def test_report_renders_summary_findings_hints_sparkline(tmp_path, capsys):
    p = tmp_path / "r.json"
    p.write_text(json.dumps(_dump(0, [_finding("nonfinite-loss", "error", "loss", 3, 0)])))
    assert main(["report", str(p)]) == 0
    out = capsys.readouterr().out
    assert "1 finding(s)" in out and "1 error" in out and "in 5 step(s)" in out
    assert "nonfinite-loss" in out and "do X about nonfinite-loss" in out and "train.py:12" in out
    assert "3–4" in out  # first–last step
    loss_line = next(line for line in out.splitlines() if line.strip().startswith("loss"))
    assert "█" in loss_line and "▁" in loss_line and loss_line.count("!") == 1  # the NaN step
    assert "findings at step(s): 3" in out


def test_report_merges_ranks_and_writes_html(tmp_path, capsys):
    a, b = tmp_path / "report.rank0.json", tmp_path / "report.rank1.json"
    a.write_text(json.dumps(_dump(0, [_finding("grad-explosion", "warning", "fc", 2, 0)])))
    b.write_text(json.dumps(_dump(1, [_finding("nonfinite-output", "error", "body.1", 1, 1)])))
    assert main(["report", str(b), str(a)]) == 0
    out = capsys.readouterr().out
    assert "2 finding(s)" in out and "merged ranks [0, 1]" in out
    assert "nonfinite-output" in out and "grad-explosion" in out and "rank" in out
    html_path = tmp_path / "out.html"
    assert main(["report", str(a), str(b), "--html", str(html_path)]) == 0
    text = html_path.read_text()
    assert "rank 1" in text and "body.1" in text and "ranks (merged)" in text


def test_checks_lists_every_check_with_kinds_severities_and_default():
    r = _run(["checks"], ".")
    assert r.returncode == 0, r.stderr
    for name, cls in registry().items():
        assert name in r.stdout
        for kind in cls.kinds:
            assert kind in r.stdout
    assert "(error)" in r.stdout and "(warning)" in r.stdout and " on " in r.stdout


def test_console_script_torch_guard():
    exe = os.path.join(sysconfig.get_paths()["scripts"], "torch-guard")
    assert os.path.exists(exe)
    r = subprocess.run([exe, "frobnicate"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == "guard: unknown command 'frobnicate'; allowed: run, report, checks"


SPAWNING = """\
import torch
import torch.multiprocessing as mp
from torch import nn


def work(rank):
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(8, 4)
        if step == 1:
            x[0, 0] = float("nan")
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


if __name__ == "__main__":
    mp.spawn(work, nprocs=1)
    print("main done")
"""


def test_run_guards_the_processes_the_script_spawns(tmp_path):
    # As under TORCH_GUARD=1: a torch.multiprocessing.spawn child writes its own report next to the main one.
    (tmp_path / "spawning.py").write_text(SPAWNING)
    r = _run(["run", "--no-live", "--report", "r.json", "spawning.py"], tmp_path)
    assert r.returncode == 0 and "main done" in r.stdout, r.stderr
    children = sorted(tmp_path.glob("r.pid*.json"))
    assert len(children) == 1, sorted(p.name for p in tmp_path.iterdir())
    dump = json.loads(children[0].read_text())
    assert [(f["kind"], f["step"]) for f in dump["findings"]] == [("nonfinite-input", 1)]
    # --fail-on counts the findings the child processes reported: the training all ran there
    r = _run(["run", "--no-live", "--report", "r2.json", "--fail-on", "error", "spawning.py"], tmp_path)
    assert r.returncode == 1 and "main done" in r.stdout, r.stderr
    assert "finding(s) of severity error or worse (nonfinite-input)" in r.stderr


OWN_GUARD = """import torch
from torch import nn
from guard import guard

model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with guard(model, opt, live=True):
    for step in range(3):
        x = torch.randn(8, 4)
        x[0, 0] = float("nan")
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
"""


def test_run_steps_aside_for_the_scripts_own_guard_and_counts_its_findings(tmp_path):
    """As under TORCH_GUARD=1: one line per finding (the script's guard prints it), and --fail-on still sees it."""
    (tmp_path / "own.py").write_text(OWN_GUARD)
    r = _run(["run", "--report", "r.json", "--fail-on", "error", "own.py"], tmp_path)
    assert r.returncode == 1, r.stderr
    assert r.stderr.count("guard ERROR nonfinite-input") == 1, r.stderr
    assert "finding(s) of severity error or worse" in r.stderr


def test_report_html_refuses_to_replace_a_dump_it_reads_or_a_file_of_the_user(tmp_path, capsys):
    dump = tmp_path / "r.json"
    dump.write_text(json.dumps(_dump(0, [])))
    script = tmp_path / "train.py"
    script.write_text("print('mine')\n")
    for target in (dump, script):
        assert main(["report", str(dump), "--html", str(target)]) == 2
    err = capsys.readouterr().err
    assert "is one of the dumps read" in err and "a file that is not a guard report is there" in err
    assert script.read_text() == "print('mine')\n" and json.loads(dump.read_text())["schema"] == "guard-report/1"


def test_run_in_process_leaves_the_environment_as_it_was(proj, monkeypatch):
    # run exports TORCH_GUARD* for the processes a script starts; called in a longer-lived process (a
    # test, a tool) it must put the environment back, or every later guard and child would inherit it.
    for key in [k for k in os.environ if k.startswith("TORCH_GUARD") or k == "_TORCH_GUARD_MAIN_PID"]:
        monkeypatch.delenv(key)
    monkeypatch.chdir(proj)
    assert main(["run", "--no-live", "--report", "r.json", "train.py"]) == 0
    assert [k for k in os.environ if "TORCH_GUARD" in k] == []


def test_run_next_to_a_guard_py_of_the_users_own_keeps_it_theirs(tmp_path, monkeypatch, capfd):
    """The script's `import guard` gets the user's guard.py (run apart, under the environment's guard)."""
    (tmp_path / "guard.py").write_text("VALUE = 42\n")
    (tmp_path / "t.py").write_text(
        "import guard\nprint('VALUE', guard.VALUE)\n" + TRAIN_NAN + "import sys\nsys.exit(3 if '--three' in sys.argv else 0)\n")
    monkeypatch.chdir(tmp_path)
    for key in [k for k in os.environ if k.startswith(("TORCH_GUARD", "_TORCH_GUARD"))]:
        monkeypatch.delenv(key)
    assert main(["run", "--no-report", "t.py", "--three"]) == 3  # the script's own status
    out, err = capfd.readouterr()
    assert "VALUE 42" in out and "guard ERROR nonfinite-input" in err
    assert not list(tmp_path.glob("guard-report*.json"))  # --no-report: none left behind
    assert main(["run", "--report", "r.json", "--fail-on", "error", "t.py"]) == 1
    out, err = capfd.readouterr()
    # the NaN input is the step's root cause: its NaN gradients, read apart (no optimizer known at the first
    # backward of a global guard), are not a second error
    assert "VALUE 42" in out and "finding(s) of severity error or worse (nonfinite-input)" in err
    assert json.loads((tmp_path / "r.json").read_text())["findings"][0]["kind"] == "nonfinite-input"


TRAIN_NAN = """\
import torch
from torch import nn
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
opt.zero_grad()
model(torch.full((2, 4), float("nan"))).sum().backward()
opt.step()
"""
