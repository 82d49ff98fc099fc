"""TORCH_GUARD=...: the installed .pth line starts a global guard in an unmodified script."""
import json
import os
import subprocess
import sys
import sysconfig

import pytest

BUGGY = """\
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    x = torch.randn(16, 4)
    if step == 2:
        x[0, 0] = float("nan")  # dirty data
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print("trained", step + 1, "steps")
"""


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_GUARD")}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def _run(args, cwd, **env):
    return subprocess.run([sys.executable, *args], cwd=cwd, env=_env(**env), capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def buggy(tmp_path):
    (tmp_path / "train.py").write_text(BUGGY)
    return tmp_path


def test_pth_is_installed_next_to_the_package():
    site = sysconfig.get_paths()["purelib"]
    line = open(os.path.join(site, "torch_guard_autostart.pth")).read()
    assert line.startswith("import ") and line.count("\n") <= 1
    assert "TORCH_GUARD" in line  # does nothing unless the variable is set


def test_unmodified_script_gets_a_dump_with_the_finding(buggy):
    r = _run(["train.py"], buggy, TORCH_GUARD="record")
    assert r.returncode == 0, r.stderr
    assert "trained 4 steps" in r.stdout
    assert r.stderr == ""  # record mode is silent
    # default report path: guard-report.json in the working directory
    dump = json.loads((buggy / "guard-report.json").read_text())
    assert dump["schema"] == "guard-report/1"
    assert dump["config"]["mode"] == "record"
    assert dump["steps"] == 4
    first = dump["findings"][0]
    assert (first["kind"], first["where"], first["step"]) == ("nonfinite-input", "input", 2)
    assert first["source"].endswith("train.py:11")


def test_report_path_from_the_environment(buggy):
    r = _run(["train.py"], buggy, TORCH_GUARD="warn", TORCH_GUARD_REPORT=str(buggy / "out.html"), TORCH_GUARD_LIVE="1")
    assert r.returncode == 0, r.stderr
    assert "nonfinite-input" in r.stderr  # live
    assert "<svg" in (buggy / "out.html").read_text()
    assert not (buggy / "guard-report.json").exists()


def test_guard_imported_before_torch(buggy):
    # `import guard` imports torch itself: the environment's guard starts once guard is complete.
    (buggy / "first.py").write_text("import guard\n" + BUGGY)
    r = _run(["first.py"], buggy, TORCH_GUARD="record")
    assert r.returncode == 0, r.stderr
    dump = json.loads((buggy / "guard-report.json").read_text())
    assert [f["kind"] for f in dump["findings"]] == ["nonfinite-input"]


def test_raise_mode_stops_the_script_at_the_first_error(buggy):
    r = _run(["train.py"], buggy, TORCH_GUARD="raise", TORCH_GUARD_LIVE="0")
    assert r.returncode == 1
    assert "GuardError" in r.stderr and "nonfinite-input" in r.stderr
    assert "trained" not in r.stdout


CHECK_IMPORTS = ("import sys, torch; "
                 "print(sorted(m for m in sys.modules if m == 'guard' or m.startswith(('guard.', '_torch_guard'))))")


def test_without_the_variable_guard_is_not_imported(tmp_path):
    r = _run(["-c", CHECK_IMPORTS], tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
    r = _run(["-c", CHECK_IMPORTS], tmp_path, TORCH_GUARD="0")
    assert r.stdout.strip() == "[]"
    assert not (tmp_path / "guard-report.json").exists()


def test_with_the_variable_nothing_heavy_until_torch_is_imported(tmp_path):
    code = ("import sys; print('torch' in sys.modules, 'guard' in sys.modules, "
            "sorted(m for m in sys.modules if m.startswith('_torch_guard')))")
    r = _run(["-c", code], tmp_path, TORCH_GUARD="1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False False ['_torch_guard_autostart', '_torch_guard_config']"
    # A process that imports torch but runs nothing (a compile worker, a helper) leaves no empty dump.
    r = _run(["-c", "import torch, sys; print(sys.modules['_torch_guard_autostart'].active() is not None)"],
             tmp_path, TORCH_GUARD="1")
    assert r.stdout.strip() == "True", r.stderr
    assert not (tmp_path / "guard-report.json").exists()


def test_runs_once_even_if_the_pth_line_is_processed_twice(tmp_path):
    site = sysconfig.get_paths()["purelib"]
    code = (f"line = open({os.path.join(site, 'torch_guard_autostart.pth')!r}).read(); exec(line); exec(line)\n"
            "import sys\n"
            "print(sum(type(f).__name__ == '_TorchFinder' for f in sys.meta_path))\n"
            "import torch\n"
            "from guard.hooks import _exit_callbacks\n"
            "print(sum(type(f).__name__ == '_TorchFinder' for f in sys.meta_path), len(_exit_callbacks))\n")
    r = _run(["-c", code], tmp_path, TORCH_GUARD="record")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "0", "1"]


@pytest.mark.parametrize("var,value,needs_torch", [
    ("TORCH_GUARD", "bogus", False),
    ("TORCH_GUARD_REPORT", " ", False),
    ("TORCH_GUARD_LIVE", "maybe", False),
    ("TORCH_GUARD_EVERY", "0", False),
    ("TORCH_GUARD_SNOOP", "perhaps", False),
    ("TORCH_GUARD_CHECKS", "no-such-check", True),
])
def test_bad_value_stops_at_start_with_one_line(tmp_path, var, value, needs_torch):
    env = {"TORCH_GUARD": "1", var: value}
    script = "import torch\nprint('ran')\n" if needs_torch else "print('ran')\n"
    (tmp_path / "s.py").write_text(script)
    r = _run(["s.py"], tmp_path, **env)
    assert r.returncode == 2
    assert "ran" not in r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"guard: {var}") and repr(value) in lines[0] and "allowed" in lines[0]
    assert "Traceback" not in r.stderr


def test_sigterm_still_writes_the_dump(buggy):
    import signal

    (buggy / "long.py").write_text(BUGGY + "import time\nprint('waiting', flush=True)\ntime.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "long.py"], cwd=buggy, env=_env(TORCH_GUARD="record"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in p.stdout:
            if "waiting" in line:
                break
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == -signal.SIGTERM  # still "killed by SIGTERM" for the caller
    dump = json.loads((buggy / "guard-report.json").read_text())
    assert [f["kind"] for f in dump["findings"]] == ["nonfinite-input"] and dump["steps"] == 4


UNCAUGHT = """
import sys
import torch
from torch import nn

class Gate(nn.Module):
    def forward(self, x):
        y = torch.sigmoid(x)
        y.mul_(2)  # in place on what sigmoid saved for backward
        return y

def main():
    model = nn.Sequential(nn.Linear(8, 8), Gate(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

if __name__ == "__main__":
    if len(sys.argv) > 1:  # a hook of the program's own, set after torch's import
        sys.excepthook = lambda t, e, tb: print("own hook:", t.__name__, file=sys.stderr)
    main()
"""


def test_an_uncaught_cryptic_error_is_explained_by_the_environments_guard(tmp_path):
    """No `with` block sees the exception: the guard explains it as the traceback is printed."""
    (tmp_path / "train.py").write_text(UNCAUGHT)
    r = _run(["train.py"], tmp_path, TORCH_GUARD="1")
    assert r.returncode == 1 and "modified by an inplace operation" in r.stderr
    note = r.stderr.index("guard: a tensor that `1` (Gate) saved for backward")
    assert note > r.stderr.index("RuntimeError: one of the variables")  # a note under PyTorch's message
    dump = json.loads((tmp_path / "guard-report.json").read_text())
    assert [(f["kind"], f["where"], f["step"]) for f in dump["findings"]] == [("explained-error", "1", 0)]


def test_the_programs_own_excepthook_is_left_alone(tmp_path):
    (tmp_path / "train.py").write_text(UNCAUGHT)
    r = _run(["train.py", "own"], tmp_path, TORCH_GUARD="1")
    assert r.returncode == 1 and "own hook: RuntimeError" in r.stderr and "Traceback" not in r.stderr


def _recorded(tmp_path, script: str) -> dict:
    """The dump of `script` run as train.py under TORCH_GUARD=record (it must exit 0)."""
    (tmp_path / "train.py").write_text(script)
    r = _run(["train.py"], tmp_path, TORCH_GUARD="record")
    assert r.returncode == 0, r.stderr
    return json.loads((tmp_path / "guard-report.json").read_text())


TWO_HEADS = """
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
phi = nn.Sequential(nn.Linear(5, 8), nn.ReLU()); h0 = nn.Linear(8, 1); h1 = nn.Linear(8, 1)
opt = torch.optim.Adam(list(phi.parameters()) + list(h0.parameters()), lr=3e-3)  # h1 left out
X = torch.randn(64, 5); T = torch.rand(64) < 0.5; Y = X[:, 0] + T
for it in range(6):
    r = phi(X)
    pred = torch.where(T, h1(r).squeeze(1), h0(r).squeeze(1))
    loss = F.mse_loss(pred, Y); opt.zero_grad(); loss.backward(); opt.step()
"""


def test_a_single_layer_held_by_a_scripts_variable_is_named_by_it(tmp_path):
    """TARNet-style heads h0, h1 (each one nn.Linear) under TORCH_GUARD=1: the head left out of the optimizer is
    `h1`, not a bare `weight` that any single layer's parameters would be called."""
    dump = _recorded(tmp_path, TWO_HEADS)
    found = [(f["kind"], f["where"]) for f in dump["findings"]]
    assert found == [("param-not-in-optimizer", "h1")], found


EMA_TEACHER = """
import copy, torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
student = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))
teacher = copy.deepcopy(student).requires_grad_(False)
opt = torch.optim.SGD(student.parameters(), lr=0.05)
x, y = torch.randn(64, 10), torch.randint(0, 3, (64,))
for it in range(20):
    with torch.no_grad():
        t = teacher(x).softmax(1)
    s = student(x)
    loss = F.cross_entropy(s, y) + F.mse_loss(s.softmax(1), t)
    opt.zero_grad(); loss.backward(); opt.step()
    for tp, sp in zip(teacher.parameters(), student.parameters()):
        tp.mul_(0.99).add_(0.01 * sp)  # no torch.no_grad()
"""


def test_an_ema_teacher_called_first_under_a_global_guard_is_named_by_its_variable(tmp_path):
    """The teacher is the first model called, so its paths are `0`, `2`: read alone they look like the student's
    layers. The finding names the variable, `teacher`."""
    dump = _recorded(tmp_path, EMA_TEACHER)
    found = [(f["kind"], f["where"]) for f in dump["findings"]]
    assert found == [("loss-graph-retained", "teacher")], found
    assert dump["findings"][0]["details"]["parameters"][0] == "teacher.0.weight"


SLOW_SECOND_OPTIMIZER = """
import torch, torch.nn as nn
torch.manual_seed(0)
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.k = nn.Parameter(torch.tensor(1.0))
        self.net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
    def forward(self, x):
        return -self.k * x + self.net(x)
x = torch.randn(64, 1); a = -2.0 * x - 0.5 * x ** 3
m = Model()
opt_nn = torch.optim.Adam(m.net.parameters(), lr=3e-3)
opt_phys = torch.optim.SGD([m.k], lr=0.05)  # PHYS
for it in range(LAST):
    loss = ((m(x) - a) ** 2).mean()
    opt_nn.zero_grad(); opt_phys.zero_grad(); loss.backward()
    opt_nn.step()
    if it % 20 == 19:
        opt_phys.step()
"""


@pytest.mark.parametrize("phys", ["held", "left out"])
def test_a_second_optimizer_that_steps_every_20_steps_holds_its_parameters(tmp_path, phys):
    """A hybrid physics + network fit: the physical constant `k` has its own optimizer, built before the loop and
    stepped every 20 steps. A global guard knows that optimizer only at its first step; the parameter is not "in no
    optimizer" before it. Left out of every optimizer, it is still told."""
    script = SLOW_SECOND_OPTIMIZER.replace("LAST", "40")
    if phys == "left out":
        script = script.replace("opt_phys = torch.optim.SGD([m.k], lr=0.05)  # PHYS", "opt_phys = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.05)")
    found = [(f["kind"], f["where"]) for f in _recorded(tmp_path, script)["findings"]]
    assert found == ([] if phys == "held" else [("param-not-in-optimizer", "k")]), found


TWO_SEQUENTIALS = """
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
depth_net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
pose_net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.Adam(depth_net.parameters(), lr=1e-3)  # pose_net left out
for it in range(12):
    x = torch.randn(16, 6)
    loss = (depth_net(x) * pose_net(x)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""


def test_a_second_model_of_the_same_class_is_named_by_the_scripts_variable(tmp_path):
    """Two nn.Sequential models of a script under TORCH_GUARD=1: the second one's paths collide with the first's, so
    they get a label; the script's variable (`pose_net`), not `Sequential#2`."""
    found = [(f["kind"], f["where"]) for f in _recorded(tmp_path, TWO_SEQUENTIALS)["findings"]]
    assert found == [("param-not-in-optimizer", "pose_net")], found
