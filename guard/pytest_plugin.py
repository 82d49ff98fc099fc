"""pytest plugin (entry point ``pytest11``): run tests under a guard.

* ``pytest --torch-guard``: every test runs under a global guard (mode ``record``); a test
  that produced a finding of severity ``error`` (or worse than ``--torch-guard-fail-on``)
  fails, with the findings in its report.
* ``@pytest.mark.torch_guard(checks=..., fail_on=...)``: the same for one test, with or
  without ``--torch-guard``.
* the ``torch_guard`` fixture: a started global guard of the test's own to assert on
  (``torch_guard.findings`` is current whenever it is read: no need to close it first).
  Tests using it are not also failed by the plugin.

Importing this module is cheap (torch and guard load only when a guard is made).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import pytest

FAIL_ON = ("error", "warning", "info")
_RANK = {"error": 0, "warning": 1, "info": 2}


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("torch-guard", "guard: runtime checks for PyTorch training code")
    group.addoption("--torch-guard", action="store_true", default=False,
                    help="run every test under a guard; fail tests that produce error findings")
    group.addoption("--torch-guard-fail-on", default="error", metavar="SEVERITY",
                    help="fail a test on findings of this severity or worse: error (default), warning, info")
    group.addoption("--torch-guard-checks", default="default", metavar="SPEC",
                    help="checks to run: default, all, names; -name removes (comma-separated)")


def pytest_configure(config: Any) -> None:
    config.addinivalue_line("markers", "torch_guard(checks='default', fail_on='error'): run this test under a guard "
                                       "and fail it on findings of severity fail_on or worse")
    fail_on = config.getoption("torch_guard_fail_on")
    if fail_on not in FAIL_ON:
        raise pytest.UsageError(f"guard: --torch-guard-fail-on={fail_on!r} is not a severity; allowed: {', '.join(FAIL_ON)}")
    checks = config.getoption("torch_guard_checks")
    if checks != "default":  # said once at start, naming the option, not once per guarded test
        from guard.checks import registry
        from guard.config import ConfigError, select_checks

        try:
            select_checks(checks, registry(), "--torch-guard-checks")
        except ConfigError as exc:
            raise pytest.UsageError(str(exc)) from None


def _settings(item: Any) -> Optional[Tuple[Any, str]]:
    """(checks, fail_on) when `item` runs under the plugin's guard, else None."""
    marker = item.get_closest_marker("torch_guard")
    if marker is None and not item.config.getoption("torch_guard"):
        return None
    kw: Dict[str, Any] = dict(marker.kwargs) if marker is not None else {}
    if marker is not None and marker.args:
        if len(marker.args) > 1 or "checks" in kw:
            raise pytest.UsageError(f"guard: @pytest.mark.torch_guard{marker.args!r}: one positional argument at most "
                                    f"(the checks); allowed: torch_guard('default,-x') or torch_guard(checks=..., "
                                    f"fail_on=...)")
        kw["checks"] = marker.args[0]  # torch_guard("default,-nonfinite"): the checks, as the keyword would
    unknown = set(kw) - {"checks", "fail_on"}
    if unknown:
        raise pytest.UsageError(f"guard: @pytest.mark.torch_guard got {sorted(unknown)}; allowed: checks, fail_on")
    checks = kw.get("checks", item.config.getoption("torch_guard_checks"))
    fail_on = kw.get("fail_on", item.config.getoption("torch_guard_fail_on"))
    if fail_on not in FAIL_ON:
        raise pytest.UsageError(f"guard: @pytest.mark.torch_guard(fail_on={fail_on!r}) is not a severity; "
                                f"allowed: {', '.join(FAIL_ON)}")
    return checks, fail_on


def _format(findings: List[Any]) -> str:
    lines = []
    for f in findings:
        src = f" ({f.source})" if f.source else ""
        lines.append(f"[{f.severity}] {f.kind} at {f.where}, step {f.step}, seen {f.count}x{src}: {f.message}\n"
                     f"    fix: {f.hint}")
    return "\n".join(lines)


@pytest.hookimpl(hookwrapper=True)  # old-style wrapper: works with pytest 7 as well as 8+
def pytest_runtest_call(item: Any):
    settings = _settings(item)
    if settings is None or "torch_guard" in getattr(item, "fixturenames", ()):
        yield
        return
    checks, fail_on = settings
    from guard import guard
    from guard.config import ConfigError

    try:
        g = guard(checks=checks, mode="record", live=False, origin={"checks": "@pytest.mark.torch_guard checks"})
    except ConfigError as exc:
        raise pytest.UsageError(str(exc)) from None
    g.start()
    try:
        outcome = yield
    finally:
        g.close()
    if g.findings:
        item.add_report_section("call", "torch-guard", _format(g.findings))
    bad = [f for f in g.findings if _RANK[f.severity] <= _RANK[fail_on]]
    if bad and outcome.excinfo is None:
        try:
            pytest.fail(f"guard: {len(bad)} finding(s) of severity {fail_on} or worse:\n{_format(bad)}", pytrace=False)
        except pytest.fail.Exception as exc:
            if hasattr(outcome, "force_exception"):
                outcome.force_exception(exc)
            else:  # pluggy < 1.1
                outcome._excinfo = (type(exc), exc, exc.__traceback__)


@pytest.fixture
def torch_guard(request: Any):
    """A started global guard (mode ``record``, not live) for this test; closed after it."""
    from guard import guard

    marker = request.node.get_closest_marker("torch_guard")
    mine = (marker.kwargs.get("checks") or (marker.args[0] if marker.args else None)) if marker is not None else None
    checks = mine or request.config.getoption("torch_guard_checks")
    g = guard(checks=checks, mode="record", live=False)
    g.start()
    try:
        yield g
    finally:
        g.close()
