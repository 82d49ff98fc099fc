"""benchmarks/gpu.sh on a machine without a GPU: one line, exit status 0."""
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: gpu.sh would run for real")
def test_gpu_script_says_no_gpu_and_exits_0():
    env = {**os.environ, "PYTHON": sys.executable}
    out = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu.sh")], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0]
