"""Processes, signals and the environment's guard (issue 14 item 4, issue 15 items 2, 5, 9 and "Also").

Every test runs a real program in a subprocess with the installed ``.pth`` line (``TORCH_GUARD=...``)
or an explicit guard, as a user would.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_GUARD", "_TORCH_GUARD"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **extra)
    return env


def _run(args, cwd, timeout=180, **env):
    return subprocess.run([sys.executable, *args], cwd=cwd, env=_env(**env), capture_output=True, text=True,
                          timeout=timeout)


def _load(path):
    return json.loads(open(path).read())


def _kinds(dump):
    return [(f["kind"], f["where"]) for f in dump["findings"]]


TRAIN = """\
import torch
from torch import nn
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


# ---------------------------------------------------------------- issue 14.4: the .pth hook and a local guard.py

def test_import_guard_does_not_import_torch(tmp_path):
    r = _run(["-c", "import sys, guard; print('torch' in sys.modules); from guard import guard as g; "
                    "print('torch' in sys.modules); g.wrap; print('torch' in sys.modules)"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False", "True"]


@pytest.mark.parametrize("local", ["guard.py", "guard/__init__.py"])
def test_torch_guard_next_to_a_local_guard_module(tmp_path, local):
    (tmp_path / local).parent.mkdir(exist_ok=True)
    (tmp_path / local).write_text("def helper():\n    return 'mine'\n")
    (tmp_path / "train.py").write_text("import guard\nassert guard.helper() == 'mine'\n" + TRAIN)
    env = _env(TORCH_GUARD="record")
    env.pop("PYTHONPATH")  # the installed package, as a user has it
    r = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stderr
    assert "trained" in r.stdout
    dump = _load(tmp_path / "guard-report.json")
    assert _kinds(dump) == [("nonfinite-input", "input")]


def test_guard_submodule_imported_before_torch_still_starts_the_environment_guard(tmp_path):
    (tmp_path / "train.py").write_text("from guard.session import Guard\n" + TRAIN)
    r = _run(["train.py"], tmp_path, TORCH_GUARD="record")
    assert r.returncode == 0, r.stderr
    assert _kinds(_load(tmp_path / "guard-report.json")) == [("nonfinite-input", "input")]


# ---------------------------------------------------------------- issue 15.9: explicit guard takes precedence

def test_explicit_guard_takes_precedence_over_the_environment(tmp_path):
    script = TRAIN.replace("for step in range(3):", "from guard import guard\n"
                           "with guard(model, opt, report='guard-report.json', live=True):\n  for step in range(3):")
    script = script.replace("\n    ", "\n      ")
    (tmp_path / "train.py").write_text(script + "model(torch.full((2, 4), float('inf')))\n")
    r = _run(["train.py"], tmp_path, TORCH_GUARD="warn", TORCH_GUARD_LIVE="1")
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("guard ERROR nonfinite-input at input, step 1")]
    assert len(lines) == 1, r.stderr  # one line per finding, not one per guard
    mine = _load(tmp_path / "guard-report.json")
    assert mine["config"]["mode"] == "warn" and mine["steps"] == 3 and _kinds(mine) == [("nonfinite-input", "input")]
    # the environment's guard saw the call after the block: its own dump, beside the user's, says why
    env_dump = _load(tmp_path / "guard-report.env.json")
    assert any("guard from the code" in n for n in env_dump["notices"])
    assert [f["kind"] for f in env_dump["findings"]] == ["nonfinite-input"]


def test_explicit_guard_only_leaves_no_environment_dump(tmp_path):
    script = TRAIN.replace("for step in range(3):", "from guard import guard\n"
                           "with guard(model, opt, report='mine.json', live=False):\n  for step in range(3):")
    (tmp_path / "train.py").write_text(script.replace("\n    ", "\n      "))
    r = _run(["train.py"], tmp_path, TORCH_GUARD="record")
    assert r.returncode == 0, r.stderr
    assert _kinds(_load(tmp_path / "mine.json")) == [("nonfinite-input", "input")]
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["mine.json"]



@pytest.mark.parametrize("live", ["default", "0"])
def test_a_guard_from_the_code_without_report_or_live_is_heard_under_torch_guard(tmp_path, live):
    """`with guard(model, opt):` (no report=, no live=) in a script run with TORCH_GUARD=1 off a terminal (CI):
    its findings are printed as the environment's guard would print them, and go into the environment's report
    (before, the environment's guard stepped aside and nothing was printed or written)."""
    script = TRAIN.replace("for step in range(3):", "from guard import guard\n"
                           "with guard(model, opt):\n  for step in range(3):")
    (tmp_path / "train.py").write_text(script.replace("\n    ", "\n      "))
    env = {"TORCH_GUARD": "1"} if live == "default" else {"TORCH_GUARD": "1", "TORCH_GUARD_LIVE": live}
    r = _run(["train.py"], tmp_path, **env)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("guard ERROR nonfinite-input at input, step 1")]
    assert len(lines) == (1 if live == "default" else 0), r.stderr
    dump = _load(tmp_path / "guard-report.json")
    assert _kinds(dump) == [("nonfinite-input", "input")] and dump["findings"][0]["step"] == 1
    assert any("no report of its own" in n for n in dump["notices"])

@pytest.mark.parametrize("how", ["with", "wrap"])
def test_the_run_report_is_written_for_a_clean_guard_from_the_code_and_for_a_wrap_never_closed(tmp_path, how):
    """Under TORCH_GUARD=1, a guard from the code without a report of its own: the run's report (what CI reads) is
    written even when that guard found nothing, with its steps (before: no file at all, and "1 finding(s) in 0
    step(s)" when it found something); a `guard.wrap(...)` never closed (as the README shows it) is closed at exit
    before the environment's guard, whose report then holds its findings (before: no report was written)."""
    if how == "with":
        script = TRAIN.replace("x[0, 0] = float(\"nan\")", "pass").replace(
            "for step in range(3):", "from guard import guard\nwith guard(model, opt):\n  for step in range(3):")
        script = script.replace("\n    ", "\n      ")
    else:
        script = TRAIN.replace("opt = torch.optim", "from guard import guard\nopt = torch.optim").replace(
            "loss = model(x)", "loss = wrapped(x)").replace("for step in range(3):",
                                                           "wrapped = guard.wrap(model, opt)\nfor step in range(3):")
    (tmp_path / "train.py").write_text(script)
    r = _run(["train.py"], tmp_path, TORCH_GUARD="1", TORCH_GUARD_REPORT="run.json")
    assert r.returncode == 0 and "trained" in r.stdout, r.stderr
    dump = _load(tmp_path / "run.json")
    assert dump["steps"] == 3
    assert _kinds(dump) == ([] if how == "with" else [("nonfinite-input", "input")])
    assert any("no report of its own" in n for n in dump["notices"])
    assert f"guard: {len(dump['findings'])} finding(s) in 3 step(s)" in r.stderr and "in 0 step(s)" not in r.stderr


# ---------------------------------------------------------------- issue 15.5: several processes, one report path

FORKED = """\
import multiprocessing as mp
import torch
from torch import nn

def work(k):
    model = nn.Linear(4, 1)
    x = torch.randn(2, 4)
    if k == 1:
        x[0, 0] = float("nan")
    model(x).sum().backward()

if __name__ == "__main__":
    ctx = mp.get_context("{method}")
    model = nn.Linear(4, 1)
    model(torch.full((2, 4), float("inf"))).sum().backward()   # the main process's own finding
    ps = [ctx.Process(target=work, args=(k,)) for k in range(3)]
    for p in ps: p.start()
    for p in ps: p.join()
    assert all(p.exitcode == 0 for p in ps)
"""


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_each_process_that_saw_something_writes_its_own_dump(tmp_path, method):
    (tmp_path / "run.py").write_text(FORKED.format(method=method))
    r = _run(["run.py"], tmp_path, TORCH_GUARD="record")
    assert r.returncode == 0, r.stderr
    main = _load(tmp_path / "guard-report.json")
    assert [f["details"].get("value", f["kind"]) for f in main["findings"]][:1] and "process" not in main["environment"]
    others = sorted(tmp_path.glob("guard-report.pid*.json"))
    assert len(others) == 3  # every worker ran a model: three dumps, none overwritten
    dumps = [_load(p) for p in others]
    assert all(d["environment"]["main_pid"] == main["environment"]["pid"] for d in dumps)
    nan = [d for d in dumps if d["findings"]]
    assert len(nan) == 1 and _kinds(nan[0]) == [("nonfinite-input", "input")]
    # the forked children do not inherit the main process's finding
    assert all(d["findings"] == [] or d is nan[0] for d in dumps)
    assert sorted(p["file"] for p in main["processes"]) == sorted(p.name for p in others)
    merged = subprocess.run([sys.executable, "-m", "guard", "report", *map(str, [tmp_path / "guard-report.json", *others])],
                            env=_env(), capture_output=True, text=True, timeout=120)
    assert merged.returncode == 0, merged.stderr


POOL = """\
import multiprocessing as mp
import torch
from torch import nn

def trial(k):
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    x = torch.randn(4, 3)
    x[0, 0] = float("nan")
    for _ in range(3):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return k

if __name__ == "__main__":
    with mp.get_context("fork").Pool(2) as pool:   # __exit__ terminates the workers (SIGTERM)
        pool.map(trial, range(4))
"""


def test_pool_workers_terminated_by_the_with_block_still_write_their_dumps(tmp_path):
    """`with Pool() as pool:` ends with terminate(): a SIGTERM that can reach a worker while it leaves on its own and
    writes its report. The close used to restore the default SIGTERM before the write, which the signal then
    killed: 0, 1 or 2 dumps at random, and `--fail-on error` passed."""
    (tmp_path / "run.py").write_text(POOL)
    for attempt in range(4):
        for p in tmp_path.glob("guard-report*.json"):
            p.unlink()
        r = _run(["run.py"], tmp_path, timeout=400, TORCH_GUARD="record")  # (spawned workers import torch: slow under load)
        assert r.returncode == 0, r.stderr
        dumps = [_load(p) for p in tmp_path.glob("guard-report.pid*.json")]
        assert len(dumps) == 2, (attempt, r.stderr[-2000:])
        assert all(("nonfinite-input", "input") in _kinds(d) for d in dumps)


def test_processes_that_saw_nothing_write_nothing(tmp_path):
    (tmp_path / "run.py").write_text(textwrap.dedent("""\
        import multiprocessing as mp
        import torch
        def idle():
            torch.zeros(1)
        if __name__ == "__main__":
            ps = [mp.get_context("spawn").Process(target=idle) for _ in range(2)]
            for p in ps: p.start()
            for p in ps: p.join()
    """))
    r = _run(["run.py"], tmp_path, TORCH_GUARD="record")
    assert r.returncode == 0, r.stderr
    assert list(tmp_path.glob("*.json")) == []


DATALOADER = """\
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

class Augment(Dataset):
    def __init__(self):
        self.net = nn.Linear(4, 4)
    def __len__(self):
        return 8
    def __getitem__(self, i):
        x = torch.randn(4)
        if i == 3:
            x[0] = float("nan")
        with torch.no_grad():
            return self.net(x)

if __name__ == "__main__":
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for xb in DataLoader(Augment(), batch_size=4, num_workers=2, multiprocessing_context="{method}"):
        model(torch.nan_to_num(xb)).sum().backward()
        opt.step()
        opt.zero_grad()
"""


def test_spawned_dataloader_workers_write_their_own_dumps(tmp_path):
    (tmp_path / "run.py").write_text(DATALOADER.format(method="spawn"))
    r = _run(["run.py"], tmp_path, timeout=240, TORCH_GUARD="record")
    assert r.returncode == 0, r.stderr
    main = _load(tmp_path / "guard-report.json")
    assert main["steps"] == 2 and "process" not in main["environment"]
    workers = sorted(tmp_path.glob("guard-report.worker*-pid*.json"))
    assert len(workers) == 2, sorted(p.name for p in tmp_path.iterdir())
    found = [f for p in workers for f in _load(p)["findings"]]
    assert [(f["kind"], f["where"]) for f in found] == [("nonfinite-input", "input")]
    assert sorted(p["file"] for p in main["processes"]) == sorted(p.name for p in workers)


# ---------------------------------------------------------------- issue 15.2: SIGTERM to the process group

SIGTERM_SCRIPT = """\
import sys, time
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
{handler}
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = TensorDataset(torch.randn(4096, 4))
step = 0
{guard_open}
for epoch in range(1000):
    for (xb,) in DataLoader(data, batch_size=8, num_workers=2):
        if step == 1:
            xb[0, 0] = float("nan")
        model(xb).sum().backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if step == 3:
            print("ready", flush=True)
        {stop}
        time.sleep(0.01)
print("stopped at", step, flush=True)
"""


def _sigterm_trial(tmp_path, handler="", stop="", explicit=False, group=True):
    guard_open = ""
    script = SIGTERM_SCRIPT
    if explicit:
        guard_open = "from guard import guard\ng = guard(model, opt, report='guard-report.json', live=False).start()"
    (tmp_path / "run.py").write_text(script.format(handler=handler, stop=stop, guard_open=guard_open))
    for p in tmp_path.glob("*.json"):
        p.unlink()
    env = _env() if explicit else _env(TORCH_GUARD="record")
    proc = subprocess.Popen([sys.executable, "run.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        if group:
            os.killpg(proc.pid, signal.SIGTERM)  # like scancel / docker stop: the whole group
        else:
            proc.send_signal(signal.SIGTERM)  # like `kill PID`: the trainer shuts down gracefully
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out, err


@pytest.mark.parametrize("explicit", [False, True], ids=["TORCH_GUARD", "explicit"])
def test_sigterm_to_the_group_with_dataloader_workers_keeps_the_report(tmp_path, explicit):
    for trial in range(3):
        code, out, err = _sigterm_trial(tmp_path, explicit=explicit)
        assert code == -signal.SIGTERM, err
        dump = _load(tmp_path / "guard-report.json")
        assert _kinds(dump)[:1] == [("nonfinite-input", "input")], (trial, dump["findings"])
        assert dump["steps"] >= 3


def test_programs_own_sigterm_handler_keeps_the_guard_active_until_exit(tmp_path):
    handler = ("import signal\nSTOP = []\n"
               "signal.signal(signal.SIGTERM, lambda s, f: STOP.append(s))\n")
    stop = ("if STOP:\n            STOP.append(0)\n"
            "            if len(STOP) == 4:\n"
            "                model(torch.full((2, 4), float('inf')))\n"  # a finding after the signal
            "            if len(STOP) > 5:\n                sys.exit(0)")
    # the program's handler is installed before torch: guard chains to it
    code, out, err = _sigterm_trial(tmp_path, handler=handler, stop=stop, group=False)
    assert code == 0, err
    dump = _load(tmp_path / "guard-report.json")
    nan = [f for f in dump["findings"] if f["kind"] == "nonfinite-input"]
    assert len(nan) == 1 and nan[0]["count"] == 2  # the second bad input, after SIGTERM, was still seen


# ---------------------------------------------------------------- issue 15 "Also": environment and report paths

def test_unknown_torch_guard_variables_are_named_with_the_closest_known_one(tmp_path):
    (tmp_path / "s.py").write_text("print('ran')\n")
    r = _run(["s.py"], tmp_path, TORCH_GUARD="1", TORCH_GUARD_CHEKCS="all", TORCH_GUARD_MODE="raise")
    assert r.returncode == 0 and "ran" in r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2, r.stderr
    assert "TORCH_GUARD_CHEKCS" in lines[0] and "did you mean TORCH_GUARD_CHECKS?" in lines[0]
    assert "TORCH_GUARD_MODE" in lines[1] and "did you mean TORCH_GUARD=<mode>?" in lines[1]


@pytest.mark.parametrize("value", ["", ",,,", " , "])
def test_empty_checks_variable_is_refused(tmp_path, value):
    (tmp_path / "s.py").write_text("print('ran')\n")
    r = _run(["s.py"], tmp_path, TORCH_GUARD="1", TORCH_GUARD_CHECKS=value)
    assert r.returncode == 2 and "ran" not in r.stdout
    assert r.stderr.strip().count("\n") == 0 and "TORCH_GUARD_CHECKS" in r.stderr and "selects nothing" in r.stderr


@pytest.mark.parametrize("where", ["missing", "file"])
def test_report_in_a_directory_that_cannot_be_written_is_refused_at_start(tmp_path, where):
    (tmp_path / "afile").write_text("")
    bad = tmp_path / ("no/such" if where == "missing" else "afile") / "r.json"
    (tmp_path / "s.py").write_text("print('ran')\nimport torch\n")
    r = _run(["s.py"], tmp_path, TORCH_GUARD="1", TORCH_GUARD_REPORT=str(bad))
    assert r.returncode == 2 and "ran" not in r.stdout
    line = r.stderr.strip()
    assert "\n" not in line and line.startswith("guard: TORCH_GUARD_REPORT=") and str(bad) in line
    assert ("does not exist" if where == "missing" else "is not a directory") in line


def test_guard_arguments_refused_at_start(tmp_path):
    import torch
    from torch import nn

    from guard import ConfigError, guard

    model = nn.Linear(2, 1)
    for checks in ("", ",,,", [], {"all": 1}):
        with pytest.raises(ConfigError) as e:
            guard(model, checks=checks)
        assert "\n" not in str(e.value) and "checks" in str(e.value)
    with pytest.raises(ConfigError, match="does not exist"):
        guard(model, report=tmp_path / "missing" / "r.json")
    # a relative report path is resolved when the guard is made, not after the program's chdir
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        g = guard(model, report="r.json", live=False)
        (tmp_path / "elsewhere").mkdir()
        os.chdir(tmp_path / "elsewhere")
        with g:
            model(torch.randn(2, 2)).sum().backward()
    finally:
        os.chdir(old)
    assert (tmp_path / "r.json").exists() and not (tmp_path / "elsewhere" / "r.json").exists()


def test_two_runs_started_at_once_in_one_folder_keep_their_own_reports(tmp_path):
    """Two TORCH_GUARD=1 jobs in one folder: the one that ends second does not replace the other's report."""
    (tmp_path / "train.py").write_text(TRAIN.replace('print("trained")', 'print("trained", flush=True)')
                                       + "import sys, time\ntime.sleep(float(sys.argv[1]))\n")
    slow = subprocess.Popen([sys.executable, "train.py", "12"], cwd=tmp_path, env=_env(TORCH_GUARD="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert slow.stdout.readline().strip() == "trained"  # its guard runs; it now sleeps while the other runs
    fast = _run(["train.py", "0"], tmp_path, TORCH_GUARD="1")
    assert fast.returncode == 0 and "guard report: " + str(tmp_path / "guard-report.json") in fast.stderr
    out, err = slow.communicate(timeout=180)
    mine = tmp_path / f"guard-report.pid{slow.pid}.json"
    assert slow.returncode == 0 and f"guard report: {mine}" in err, err
    assert _load(mine)["environment"]["pid"] == slow.pid
    assert _load(tmp_path / "guard-report.json")["environment"]["pid"] != slow.pid
