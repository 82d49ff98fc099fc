"""DistributedDataParallel: 2 CPU ranks (gloo, torch.multiprocessing.spawn), one dump per rank.

The ranks run in a subprocess (a small script that spawns them), so pytest's process stays
single-process and the dumps can be merged with ``python -m guard report``.
"""
import json
import os
import subprocess
import sys

import pytest

SCRIPT = r'''
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from guard import guard


class Poison(nn.Module):
    """Identity, or log() when armed: NaN from finite (negative) inputs."""

    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x):
        return x.log() if self.armed else x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(4, 8)
        self.act = Poison()
        self.branch = nn.Linear(8, 8)  # used in a first phase only
        self.head = nn.Linear(8, 1)
        self.use_branch = True

    def forward(self, x):
        h = self.act(self.enc(x))
        if self.use_branch:
            h = self.branch(h)
        return self.head(h)


def worker(rank, world, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + os.path.join(out, "store"), rank=rank, world_size=world)
    # 1. a NaN planted on rank 1 only (its module 'act' at step 2)
    torch.manual_seed(0)
    net = Net()
    net.use_branch = False
    del net.branch  # every parameter is used: plain DDP
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, mode="record", live=True, report=os.path.join(out, "report.json")) as g:
        for step in range(4):
            net.act.armed = rank == 1 and step == 2
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    # 2. weight decay keeps shrinking a branch that stopped getting gradients (DDP, unused parameters)
    torch.manual_seed(0)
    net = Net()
    model = DDP(net, find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1)
    with guard(model, opt, mode="record", live=False, report=os.path.join(out, "wd.json")):
        for step in range(24):
            net.use_branch = step < 2
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
    # 3. a global guard (no model given, as TORCH_GUARD / python -m guard run use): same paths
    torch.manual_seed(0)
    net = Net()
    net.use_branch = False
    del net.branch
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(mode="record", live=False, report=os.path.join(out, "global.json")):
        for step in range(3):
            net.act.armed = rank == 1 and step == 1
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(2, sys.argv[1]), nprocs=2)
'''


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_GUARD")}
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    (out / "train_ddp.py").write_text(SCRIPT)
    r = subprocess.run([sys.executable, str(out / "train_ddp.py"), str(out)], cwd=out, env=_env(),
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    return out, r


def _load(path):
    return json.loads(path.read_text())


def test_one_dump_per_rank_with_rank_in_environment(ranks):
    out, _ = ranks
    assert not (out / "report.json").exists()
    for rank in (0, 1):
        dump = _load(out / f"report.rank{rank}.json")
        assert dump["environment"]["rank"] == rank and dump["environment"]["world_size"] == 2
        assert dump["steps"] == 4


def test_nan_on_rank_1_only_is_reported_by_rank_1_at_its_module(ranks):
    out, _ = ranks
    r1 = _load(out / "report.rank1.json")["findings"]
    origin = [f for f in r1 if f["kind"] == "nonfinite-output"]
    assert [(f["where"], f["step"], f["details"]["rank"]) for f in origin] == [("act", 2, 1)]
    # rank 0 computed nothing non-finite itself; it only received NaN gradients through all-reduce
    r0 = _load(out / "report.rank0.json")["findings"]
    assert not [f for f in r0 if f["kind"] in ("nonfinite-output", "nonfinite-input", "nonfinite-loss")]
    assert all(f["details"]["rank"] == 0 for f in r0)
    # module paths are the user's, without DDP's "module." prefix
    for rep in (out / "report.rank0.json", out / "report.rank1.json"):
        paths = [m["path"] for m in _load(rep)["modules"]]
        assert "enc" in paths and "act" in paths and not any(p.startswith("module") for p in paths)


def test_only_rank_0_prints_live(ranks):
    _, r = ranks
    assert "nonfinite-grad" in r.stderr  # rank 0's own finding, printed live
    assert "nonfinite-output" not in r.stderr  # rank 1's stays in its dump


def test_weight_decay_on_parameters_ddp_left_without_gradient(ranks):
    out, _ = ranks
    for rank in (0, 1):
        findings = _load(out / f"wd.rank{rank}.json")["findings"]
        wd = [f for f in findings if f["kind"] == "weight-decay-without-grad"]
        assert len(wd) == 1, findings
        assert wd[0]["where"].startswith("branch") and wd[0]["details"]["rank"] == rank


def test_global_guard_under_ddp_uses_the_models_paths(ranks):
    out, _ = ranks
    r1 = _load(out / "global.rank1.json")
    origin = [f for f in r1["findings"] if f["kind"] == "nonfinite-output"]
    assert [(f["where"], f["step"], f["details"]["rank"]) for f in origin] == [("act", 1, 1)]
    paths = {m["path"] for m in r1["modules"]}
    assert {"enc", "act", "head"} <= paths and not any(p.startswith("module") for p in paths)


def test_cli_report_merges_the_ranks(ranks):
    out, _ = ranks
    files = sorted(str(p) for p in out.glob("report.rank*.json"))
    r = subprocess.run([sys.executable, "-m", "guard", "report", *files], cwd=out, env=_env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "merged ranks [0, 1]" in r.stdout
    assert "nonfinite-output · act · step 2 · rank 1" in r.stdout
    assert "rank 0" in r.stdout


PLAIN = r'''
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def worker(rank, world, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + os.path.join(out, "store2"), rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(3):
        x = torch.randn(8, 4)
        if rank == 1 and step == 1:
            x[0, 0] = float("nan")
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()  # before exit, when the dumps are written


if __name__ == "__main__":
    mp.spawn(worker, args=(2, sys.argv[1]), nprocs=2)
'''


def _run_plain(tmp_path, env):
    """Run plain.py once more if a rank aborted in gloo's teardown ("terminate called without an active exception",
    SIGABRT, seen once on a loaded machine; pytorch/pytorch#190489, #179291): that is gloo's worker threads at exit,
    not guard's doing. Any other failure is returned as is."""
    for _ in range(2):
        for name in os.listdir(tmp_path):
            if name.startswith(("store", "auto.")):
                os.remove(tmp_path / name)
        r = subprocess.run([sys.executable, "plain.py", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=240)
        if r.returncode == 0 or "terminate called without an active exception" not in r.stderr:
            return r
    return r


def _summaries(stderr):
    return [ln for ln in stderr.splitlines() if ln.startswith("guard: ") and " finding(s) in " in ln]


def test_torch_guard_env_with_spawned_ranks(tmp_path):
    (tmp_path / "plain.py").write_text(PLAIN)
    env = _env()
    env.update(TORCH_GUARD="record", TORCH_GUARD_REPORT=str(tmp_path / "auto.json"), TORCH_GUARD_LIVE="1")
    r = _run_plain(tmp_path, env)
    assert r.returncode == 0, r.stderr[-4000:]
    # the dumps are written at exit, after destroy_process_group(): still only rank 0 prints its summary
    assert len(_summaries(r.stderr)) == 1, r.stderr
    assert "auto.rank0.json" in r.stderr and "auto.rank1.json" not in r.stderr
    assert "nonfinite-input" not in r.stderr  # rank 1's finding stays in its dump
    r1 = _load(tmp_path / "auto.rank1.json")
    assert (r1["environment"]["rank"], r1["environment"]["world_size"]) == (1, 2)
    assert r1["findings"][0]["details"]["rank"] == 1
    assert [(f["kind"], f["where"], f["step"]) for f in r1["findings"]][:1] == [("nonfinite-input", "input", 1)]
    r0 = _load(tmp_path / "auto.rank0.json")
    assert not [f for f in r0["findings"] if f["kind"] == "nonfinite-input"]
    assert not (tmp_path / "auto.json").exists()  # the launcher process ran no model: no dump of its own


def test_live_all_prints_every_ranks_summary(tmp_path):
    (tmp_path / "plain.py").write_text(PLAIN)
    env = _env()
    env.update(TORCH_GUARD="1", TORCH_GUARD_REPORT=str(tmp_path / "auto.json"), TORCH_GUARD_LIVE="all")
    r = _run_plain(tmp_path, env)
    assert r.returncode == 0, r.stderr[-4000:]
    assert len(_summaries(r.stderr)) == 2, r.stderr
    assert "auto.rank0.json" in r.stderr and "auto.rank1.json" in r.stderr
    assert "nonfinite-input" in r.stderr  # rank 1's finding, printed live as asked


def test_healthy_spawned_ranks_that_destroy_their_group_still_write_rank_dumps(tmp_path):
    """No finding on any rank, so nothing read the rank while the group lived: the patched
    destroy_process_group() reads it before the group goes (the dumps were guard-report.pid<N>.json)."""
    (tmp_path / "plain.py").write_text(PLAIN.replace('x[0, 0] = float("nan")', "pass"))
    env = _env()
    env.update(TORCH_GUARD="1", TORCH_GUARD_REPORT=str(tmp_path / "auto.json"), TORCH_GUARD_LIVE="1")
    r = _run_plain(tmp_path, env)
    assert r.returncode == 0, r.stderr[-4000:]
    assert sorted(p.name for p in tmp_path.glob("auto*.json")) == ["auto.rank0.json", "auto.rank1.json"]
    assert len(_summaries(r.stderr)) == 1, r.stderr
    r1 = _load(tmp_path / "auto.rank1.json")
    assert (r1["environment"]["rank"], r1["environment"]["world_size"]) == (1, 2) and r1["findings"] == []
