"""`snoop=True` works with any setuptools: torchsnooper 0.8 imports `pkg_resources`, which setuptools >= 82
no longer has. Run where that import fails (as on a plain `pip install` with the newest setuptools)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r'''
import sys

class NoPkgResources:
    """setuptools >= 82: there is no pkg_resources to import."""
    def find_spec(self, name, path=None, target=None):
        if name == "pkg_resources" or name.startswith("pkg_resources."):
            raise ModuleNotFoundError("No module named 'pkg_resources'", name="pkg_resources")
        return None

sys.meta_path.insert(0, NoPkgResources())
try:
    import pkg_resources
    raise SystemExit("the blocker did not work")
except ModuleNotFoundError:
    pass

import torch
from torch import nn
from guard import guard

class LogLayer(nn.Module):
    def forward(self, x):
        y = x * 2
        z = torch.log(y)  # NaN for negative inputs
        return z

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 4), LogLayer(), nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.0)
with guard(model, opt, snoop=True, live=False) as g:
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
(f,) = [f for f in g.findings if f.kind == "nonfinite-output"]
print("TRACE", f.details["trace_first_nonfinite"])
print("LINES", len(f.details["trace"]))
print("LEFT", "pkg_resources" in sys.modules)
import torchsnooper
print("VERSION", torchsnooper.__version__)
'''


def test_snoop_traces_the_offending_line_without_pkg_resources(tmp_path):
    pytest.importorskip("torchsnooper")
    script = tmp_path / "train.py"  # a file: the trace shows its source lines
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "cannot be imported" not in out.stderr
    lines = dict(ln.split(" ", 1) for ln in out.stdout.splitlines() if ln[:5] in ("TRACE", "LINES", "LEFT ", "VERSI"))
    assert "torch.log(y)" in lines["TRACE"]
    assert int(lines["LINES"]) > 2
    assert lines["LEFT"] == "False"  # the stand-in is gone once torchsnooper is imported
    assert lines["VERSION"] == "0.8"
