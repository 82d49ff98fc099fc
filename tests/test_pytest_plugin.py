"""The pytest plugin: --torch-guard, --torch-guard-fail-on, the torch_guard fixture and marker."""
import importlib.metadata

import pytest

pytest_plugins = ["pytester"]

INNER = """\
import pytest
import torch
from torch import nn


def train(nan=False, zero_grad=True, steps=4):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        x = torch.randn(8, 4)
        if nan and step == 1:
            x[0, 0] = float("nan")
        loss = model(x).pow(2).mean()
        if zero_grad:
            opt.zero_grad()
        loss.backward()
        opt.step()


def test_nan():
    train(nan=True)


def test_clean():
    train()


def test_no_zero_grad():
    train(zero_grad=False)
"""


@pytest.fixture(scope="module", autouse=True)
def _warm_imports():
    """Import what a guarded run imports lazily, before pytester snapshots sys.modules.

    pytester drops modules first imported by an inline run; torch modules that register
    operator libraries cannot be imported twice in one process.
    """
    ns = {}
    exec(compile(INNER, "warm", "exec"), ns)
    from guard import guard

    with guard(mode="record", live=False, checks="all"):
        ns["train"](nan=True, zero_grad=False)


def _args(*args):
    # The entry point loads the plugin when the package is installed; otherwise load it by name.
    eps = importlib.metadata.entry_points(group="pytest11")
    loaded = any(ep.name == "torch_guard" for ep in eps)
    return (() if loaded else ("-p", "guard.pytest_plugin")) + ("-p", "no:cacheprovider") + args


def test_entry_point_is_declared():
    eps = importlib.metadata.entry_points(group="pytest11")
    assert [ep.value for ep in eps if ep.name == "torch_guard"] == ["guard.pytest_plugin"]


def test_off_by_default(pytester):
    pytester.makepyfile(test_inner=INNER)
    pytester.runpytest(*_args()).assert_outcomes(passed=3)


def test_flag_fails_the_test_with_an_error_finding_and_prints_it(pytester):
    pytester.makepyfile(test_inner=INNER)
    r = pytester.runpytest(*_args("--torch-guard"))
    r.assert_outcomes(failed=1, passed=2)
    out = r.stdout.str()
    assert "FAILED test_inner.py::test_nan" in out
    assert "guard: 1 finding(s) of severity error or worse" in out
    assert "[error] nonfinite-input at input, step 1" in out and "fix: " in out
    assert "test_inner.py:14" in out  # the user's line


def test_fail_on_warning_is_stricter(pytester):
    pytester.makepyfile(test_inner=INNER)
    r = pytester.runpytest(*_args("--torch-guard", "--torch-guard-fail-on=warning"))
    r.assert_outcomes(failed=2, passed=1)
    out = r.stdout.str()
    assert "FAILED test_inner.py::test_no_zero_grad" in out and "missing-zero-grad" in out


def test_bad_fail_on_is_a_usage_error(pytester):
    pytester.makepyfile(test_inner=INNER)
    r = pytester.runpytest(*_args("--torch-guard", "--torch-guard-fail-on=fatal"))
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    assert "--torch-guard-fail-on='fatal' is not a severity; allowed: error, warning, info" in r.stderr.str()


def test_bad_checks_option_is_a_usage_error_at_start_naming_the_option(pytester):
    pytester.makepyfile(test_inner=INNER)
    r = pytester.runpytest(*_args("--torch-guard", "--torch-guard-checks=nonfinit"))
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    err = r.stderr.str()
    assert "--torch-guard-checks has unknown check 'nonfinit'; did you mean 'nonfinite'?" in err
    assert err.count("unknown check") == 1  # once, not once per test


def test_marker_takes_the_checks_as_its_one_positional_argument(pytester):
    pytester.makepyfile(test_inner=INNER + """

@pytest.mark.torch_guard("default,-nonfinite")
def test_marked_nan_check_off_positional():
    train(nan=True)


@pytest.mark.torch_guard("default")
def test_marked_nan_positional():
    train(nan=True)
""")
    r = pytester.runpytest(*_args())
    r.assert_outcomes(failed=1, passed=4)
    assert "FAILED test_inner.py::test_marked_nan_positional" in r.stdout.str()


def test_marker_turns_it_on_per_test_with_checks_and_fail_on(pytester):
    pytester.makepyfile(test_inner=INNER + """

@pytest.mark.torch_guard
def test_marked_nan():
    train(nan=True)


@pytest.mark.torch_guard(checks=["default", "-nonfinite"])
def test_marked_nan_check_off():
    train(nan=True)


@pytest.mark.torch_guard(fail_on="warning")
def test_marked_strict():
    train(zero_grad=False)
""")
    r = pytester.runpytest(*_args())
    r.assert_outcomes(failed=2, passed=4)
    out = r.stdout.str()
    assert "FAILED test_inner.py::test_marked_nan " in out and "FAILED test_inner.py::test_marked_strict" in out


def test_fixture_gives_the_test_its_own_guard(pytester):
    pytester.makepyfile(test_inner=INNER + """

def test_with_fixture(torch_guard):
    train(nan=True)
    torch_guard.close()
    assert [(f.kind, f.where, f.step) for f in torch_guard.findings] == [("nonfinite-input", "input", 1)]


def test_fixture_findings_current_mid_test(torch_guard):
    import torch
    from torch import nn
    m = nn.Linear(3, 1)
    m(torch.full((1, 3), float("inf")))  # no step, no close: read right away
    assert any(f.kind == "nonfinite-input" for f in torch_guard.findings)


def test_fixture_clean(torch_guard):
    train()
    torch_guard.close()
    assert torch_guard.findings == []
""")
    # With --torch-guard too: a test using the fixture asserts on its own guard and is not failed for it.
    r = pytester.runpytest(*_args("--torch-guard", "-k", "fixture"))
    r.assert_outcomes(passed=3)


def test_torch_guard_env_under_pytest_with_warnings_as_errors(tmp_path):
    """`TORCH_GUARD=1 pytest -W error`: the autostart hook, imported before pytest, must not make pytest warn
    that it cannot rewrite it (an error under `filterwarnings = error`)."""
    import os
    import subprocess
    import sys

    (tmp_path / "test_one.py").write_text("import torch\n\ndef test_one():\n    assert torch.ones(1).item() == 1\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_GUARD")}
    env.update(TORCH_GUARD="1", TORCH_GUARD_REPORT=str(tmp_path / "r.json"))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-W", "error", "-p", "no:cacheprovider", "test_one.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PytestAssertRewriteWarning" not in r.stdout + r.stderr
