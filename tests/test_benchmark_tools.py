"""The instruction-count sweep's arithmetic: the depth fit and the table it writes."""
import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import instructions_sweep as sweep  # noqa: E402


def test_depth_fit_recovers_fixed_cost_and_cost_per_call():
    points = [(2 * d, 900_000 + 3_500 * 2 * d) for d in sweep.DEPTHS]
    fixed, per_call = sweep.fit(points)
    assert round(fixed) == 900_000 and round(per_call) == 3_500


def test_table_shows_ratios_and_the_fit_in_microseconds():
    counts = {"tiny-mlp": {"unguarded": 2_000_000, "default": 3_000_000}}
    res = {"machine": "test box", "counts": counts,
           "fit": {"fixed_instructions": 800_000, "per_call_instructions": 4_000, "instructions_per_us": 4_000,
                   "fixed_us": 200.0, "per_call_us": 1.0, "points": [{"module_calls": 2, "extra": 808_000}]}}
    text = sweep.render(res)
    assert "| tiny-mlp | default | 3.00 M | **1.500×** |" in text
    assert "**800 k instructions per step** (≈ **200 µs** here)" in text
    assert "**4.0 k instructions per module call** (≈ **1.00 µs**)" in text


def test_ablation_rows_become_the_marginal_cost_table():
    counts = {"tiny-mlp": {"unguarded": 2_000_000, "default": 3_000_000,
                           "checks=default,-nonfinite": 2_850_000, "checks=default,-explain": 2_990_000}}
    text = sweep.render({"machine": "test box", "counts": counts})
    assert "checks=default,-" not in text.split("What each default check adds")[0]  # not in the main table
    rows = [ln for ln in text.splitlines() if ln.startswith("| `")]
    assert rows == ["| `nonfinite` | +150.0 k | 15% |", "| `explain` | +10.0 k | 1% |"]
    jobs = sweep.jobs(type("A", (), {"huge": False, "frameworks": False, "ablate": True})())
    ablated = {c[len(sweep.WITHOUT):] for m, c, _ in jobs if c.startswith(sweep.WITHOUT)}
    assert {"nonfinite", "weight-decay-without-grad", "explain"} <= ablated and "snoop" not in ablated


def test_depth_sweep_models_train_without_findings():
    """The depth sweep times healthy models: a finding (reported once) must not be timed as per-step cost."""
    import torch

    import overhead
    import sweep as wall_sweep
    from guard import guard

    torch.manual_seed(0)
    model, batch = wall_sweep.mlp_of_depth(32)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = overhead.step_fn(model, opt, batch)
    with guard(model, opt, live=False) as g:
        for _ in range(25):
            step()
    assert g.findings == [] and g.step == 25


def test_handler_timer_names_each_checks_handlers(capsys):
    import handlers

    handlers.main(["tiny-mlp", "--steps", "3", "--top", "60"])
    out = capsys.readouterr().out
    assert "all handlers," in out.splitlines()[-1]
    for event, check in [("forward", "nonfinite"), ("step_pre", "grad-explosion"), ("backward", "loss-graph")]:
        assert any(line.split()[1:] == [event, check] for line in out.splitlines()[1:-1]), (event, check, out)


def test_every_call_snippet_runs_in_the_harness():
    """`benchmarks/instructions_call.sh` counts each snippet's call; the same harness runs it directly."""
    import subprocess

    calls = os.path.join(BENCH, "calls")
    snippets = sorted(f for f in os.listdir(calls) if f.endswith(".py"))
    assert {"empty.py", "nonfinite_root_call.py", "tensor_sum.py", "screenable.py"} <= set(snippets)
    for name in snippets:  # each in its own process: a snippet may leave a guard started
        out = subprocess.run([sys.executable, os.path.join(BENCH, "instructions_call.py"), os.path.join(calls, name),
                              "--direct", "20"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "µs per call" in out.stdout


def test_floor_screens_what_the_contract_screens_and_takes_itself_back():
    """The floor of the per-step cost (benchmarks/floor.py) must do the screens it stands for, or it is no floor."""
    import torch

    import floor

    torch.manual_seed(0)
    backward = torch.Tensor.backward
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    installed = floor.Floor(model, opt)
    try:
        for bad in (False, True, False):
            x = torch.randn(5, 4)
            if bad:
                x[0, 0] = float("nan")
            loss = torch.nn.functional.cross_entropy(model(x), torch.zeros(5, dtype=torch.long))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if bad:
                break
    finally:
        installed.remove()
    assert installed.bad == 1 and installed.staged == []
    assert torch.Tensor.backward is backward
    model(torch.randn(1, 4)).sum().backward()  # its hooks are gone: nothing staged any more
    assert installed.staged == []
