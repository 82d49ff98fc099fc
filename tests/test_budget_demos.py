"""Every demo's bug is still found while a budget samples the costly checks (pinned to one step in 3),
and every clean twin stays clean: sampling delays a report, it does not lose it or invent one."""
import importlib
import inspect
import os
import warnings

import pytest

from guard import GuardInternalWarning, meter

DEMOS = sorted(f[:-3] for f in os.listdir(os.path.join(os.path.dirname(os.path.dirname(__file__)), "demos"))
               if f.endswith(".py") and not f.startswith("_") and f != "tour.py")


def _run(name, fixed, **opts):
    demo = importlib.import_module(f"demos.{name}")
    params = inspect.signature(demo.train).parameters
    longer = {}
    if "steps" in params:  # sampled checks run every 3rd step: give them as many chances as the default run
        longer["steps"] = params["steps"].default * 3
    with warnings.catch_warnings():
        warnings.simplefilter("error", GuardInternalWarning)
        warnings.simplefilter("ignore", UserWarning)
        g = demo.train(fixed=fixed, live=False, **longer, **opts)  # demos of crashes catch them themselves
    return sorted({f.kind for f in g.findings if f.severity != "info"})


@pytest.mark.parametrize("name", DEMOS)
def test_demo_bug_found_and_twin_clean_while_costly_checks_sleep(name, monkeypatch):
    plain = _run(name, fixed=False)
    init = meter.Meter.__init__

    def pinned(self, budget):
        init(self, budget)
        if budget is not None:
            self.pin(3)

    monkeypatch.setattr(meter.Meter, "__init__", pinned)
    sampled = _run(name, fixed=False, budget=0.05)
    assert set(plain) <= set(sampled), (plain, sampled)
    assert _run(name, fixed=True, budget=0.05) == []
