"""Faults: the dump survives a crashing check, a full disk, an unwritable path and NaN values; training is
unaffected; bad TORCH_GUARD values stop a real process with one line, no traceback."""
import errno
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from guard import GuardError, guard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def strict_json(text):
    def no_constants(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(text, parse_constant=no_constants)


def env_for_child(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_GUARD")}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **extra)
    return env


SCRIPT = textwrap.dedent("""
    import os, sys
    import torch
    from torch import nn
    from guard import guard
    how, report = sys.argv[1], sys.argv[2]
    if how == "full-disk":
        import guard.report as rep
        def full(fd):
            raise OSError(28, "No space left on device")
        rep.os.fsync = full
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, checks="all", report=report, live=False) as g:
        if how == "check-crash":
            check = next(c for c in g.checks if c.name == "nonfinite")
            def boom(*a, **k):
                raise RuntimeError("check bug")
            check.on_forward = boom
            g.router.rebuild()
        if how == "unwritable":
            os.mkdir(report)  # the path turns into a directory during the run (at start it is refused outright)
        for s in range(3):
            loss = model(torch.randn(2, 4)).sum()
            opt.zero_grad(); loss.backward(); opt.step()
    print("trained", g.step, [round(float(p.detach().sum()), 6) for p in model.parameters()], flush=True)
""")


def child(tmp_path, how, report):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, str(script), how, str(report)], env=env_for_child(),
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same script's output with a healthy disk (the parameters to compare against)."""
    tmp = tmp_path_factory.mktemp("ref")
    proc = child(tmp, "normal", tmp / "r.json")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_dump_survives_a_crashing_check(tmp_path, reference):
    report = tmp_path / "r.json"
    proc = child(tmp_path, "check-crash", report)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == reference  # training unaffected
    data = strict_json(report.read_text())
    assert data["steps"] == 3 and data["schema"] == "guard-report/1"
    (err,) = data["internal_errors"]
    assert err["check"] == "nonfinite" and "check bug" in err["error"]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("guard:")]
    assert len(lines) == 1 and "switched off" in lines[0]


@pytest.mark.parametrize("how", ["full-disk", "unwritable"])
def test_full_disk_or_unwritable_path_is_one_message_and_training_is_unaffected(tmp_path, reference, how):
    if how == "unwritable":
        folder = tmp_path / "ro"
        folder.mkdir()
        report = folder / "r.json"
    else:
        report = tmp_path / "r.json"
        report.write_text('{"schema": "guard-report/1", "old": true}')
    proc = child(tmp_path, how, report)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == reference
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]  # nothing else on stderr
    assert len(lines) == 1 and "could not write the report" in lines[0] and str(report.name) in lines[0], proc.stderr
    if how == "full-disk":
        assert "No space left" in lines[0]
        assert report.read_text() == '{"schema": "guard-report/1", "old": true}'  # the previous dump is intact (atomic)
    assert not list(report.parent.glob(".r.json.*.tmp"))


def test_full_disk_in_process_keeps_guard_usable(tmp_path, monkeypatch, capsys):
    import guard.report as rep

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rep.os, "fsync", full)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, report=tmp_path / "r.json", live=False) as g:
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    assert g.step == 1 and "No space left" in g.report_error
    assert capsys.readouterr().err.count("could not write the report") == 1
    monkeypatch.undo()
    with g:  # the next session writes normally
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    assert strict_json((tmp_path / "r.json").read_text())["steps"] == 1


def test_dump_with_nan_values_is_strict_json(tmp_path):
    from demos import nan_loss

    path = tmp_path / "r.json"
    g = nan_loss.train(fixed=False, report=path, live=False)
    data = strict_json(path.read_text())
    assert data["findings"] and data["findings"][0]["kind"] == g.findings[0].kind
    assert any(e.get("loss") is None or isinstance(e.get("loss"), (str, float)) for e in data["timeline"])


def test_raise_mode_still_writes_the_dump(tmp_path):
    model = nn.Linear(4, 1)
    path = tmp_path / "r.json"
    with pytest.raises(GuardError):
        with guard(model, mode="raise", report=path, live=False):
            x = torch.randn(2, 4)
            x[0, 0] = float("nan")
            model(x).sum().backward()
    data = strict_json(path.read_text())
    assert data["findings"][0]["kind"] == "nonfinite-input"


@pytest.mark.parametrize("env, needle", [
    ({"TORCH_GUARD": "bogus"}, "TORCH_GUARD='bogus'"),
    ({"TORCH_GUARD": "1", "TORCH_GUARD_EVERY": "0"}, "TORCH_GUARD_EVERY='0'"),
    ({"TORCH_GUARD": "1", "TORCH_GUARD_CHECKS": "nonfinite,nope"}, "unknown check 'nope'"),
])
def test_bad_environment_stops_the_process_with_one_line(env, needle):
    proc = subprocess.run([sys.executable, "-c", "import torch; print('ran')"], env=env_for_child(**env),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "ran" not in proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0] and "allowed" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_crashing_check_under_warnings_as_errors_leaves_training_alone():
    """pytest's `filterwarnings = error` or `python -W error`: guard's internal-error warning must not become
    the user's exception; the console line and the report still say it."""
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with guard(model, opt, checks="all", live=False) as g:
            check = next(c for c in g.checks if c.name == "missing-zero-grad")

            def boom(*a, **k):
                raise RuntimeError("check bug")
            check.on_backward = boom
            g.router.rebuild()
            for _ in range(3):
                loss = model(torch.randn(2, 4)).sum()
                opt.zero_grad()
                loss.backward()
                opt.step()
    assert g.step == 3
    assert [(e["check"], e["error"]) for e in g.internal_errors] == [("missing-zero-grad", "RuntimeError: check bug")]
