"""PyTorch's own warnings and errors look as they do without guard: the user's line, not guard's frames."""
import io
import os
import traceback
import warnings

import pytest
import torch
from torch import nn

import guard

HERE = os.path.abspath(__file__)
GUARD_DIR = os.path.dirname(os.path.abspath(guard.__file__)) + os.sep


def _warnings_of(fn, use_guard, **opts):
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if use_guard:
            with guard.guard(model if opts.get("mode") != "global" else None,
                             opt if opts.get("mode") != "global" else None, live=False):
                fn(model)
        else:
            fn(model)
    return [(w.filename, w.lineno, w.category, str(w.message)) for w in caught if "target size" in str(w.message)]


def _functional(model):
    nn.functional.mse_loss(model(torch.randn(4, 3)), torch.randn(4)).backward()  # [4, 1] vs [4]: broadcast


def _module_loss(model):
    nn.MSELoss()(model(torch.randn(4, 3)), torch.randn(4)).backward()


@pytest.mark.parametrize("mode", ["model", "global"])
@pytest.mark.parametrize("fn", [_functional, _module_loss])
def test_torch_warning_inside_a_loss_names_the_same_line_as_without_guard(fn, mode):
    plain = _warnings_of(fn, False)
    guarded = _warnings_of(fn, True, mode=mode)
    assert len(plain) == 1 and guarded == plain
    if fn is _functional:
        assert plain[0][0] == HERE  # the user's line: this file


def test_guard_frames_are_kept_out_of_a_torch_error_traceback():
    with guard.guard(live=False):
        try:
            nn.functional.cross_entropy(torch.randn(4, 3), torch.tensor([0, 1, 2, 7]))
        except IndexError as exc:
            frames = traceback.extract_tb(exc.__traceback__)
        else:
            pytest.fail("no error")
    ours = [f for f in frames if f.filename.startswith(GUARD_DIR)]
    assert len(ours) <= 1  # the patched function's one wrapper; its middlewares are left out
    assert frames[0].filename == HERE and frames[-1].filename.endswith("functional.py")


def test_warning_filters_of_the_user_still_apply_to_reissued_warnings():
    model = nn.Linear(3, 1)
    with guard.guard(model, live=False):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(UserWarning, match="target size"):
                nn.functional.mse_loss(model(torch.randn(4, 3)), torch.randn(4))


def _train_warning_each_step(use_guard):
    """A loop whose own code warns at every step (shown once per line by Python's default filter)."""
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shown = []

    def loop():
        for _ in range(5):
            warnings.warn("user's own deprecation, every step")
            loss = nn.functional.mse_loss(model(torch.randn(4, 3)), torch.randn(4, 1))
            opt.zero_grad()
            loss.backward()
            opt.step()

    with warnings.catch_warnings():
        warnings.resetwarnings()
        warnings.simplefilter("default")  # once per line, as for a plain `python train.py`
        warnings.showwarning = lambda message, *a, **k: shown.append(str(message))
        if use_guard:
            with guard.guard(model, opt, live=False):
                loop()
        else:
            loop()
    return [m for m in shown if "user's own" in m]


def test_a_once_per_line_warning_of_the_user_is_still_shown_once():
    # guard's losses wrappers used to change the warning filters at every call, which reset every
    # module's record of warnings already shown: the user's warning came back at every step.
    assert len(_train_warning_each_step(False)) == 1
    assert len(_train_warning_each_step(True)) == 1


def test_the_source_line_names_the_right_file_when_two_files_hold_the_same_code(tmp_path, monkeypatch):
    # user_source caches the text per call site; code objects of identical source compare equal whatever
    # their file (pytest's inner test files, copies of a training script), so the cache is keyed by identity.
    import runpy

    monkeypatch.chdir(tmp_path)
    src = "from guard._frames import user_source\ndef where():\n    return user_source(1)\nLINE = where()\n"
    for name in ("first.py", "second.py"):
        (tmp_path / name).write_text(src)
    got = [runpy.run_path(str(tmp_path / name))["LINE"] for name in ("first.py", "second.py")]
    assert got == ["first.py:3", "second.py:3"]  # the line in `where`, of each file


def test_a_loss_warning_names_its_own_file_when_two_files_hold_the_same_code(tmp_path, monkeypatch):
    # The patched losses call the original from a trampoline made per call site; two scripts of the same
    # source have equal code objects, and each warning must still name its own file and line.
    import runpy

    monkeypatch.chdir(tmp_path)
    src = ("import torch\nfrom torch import nn\n"
           "def run(model):\n"
           "    return nn.functional.mse_loss(model(torch.randn(4, 3)), torch.randn(4))\n")
    for name in ("first.py", "second.py"):
        (tmp_path / name).write_text(src)
    model = nn.Linear(3, 1)
    with guard.guard(model, live=False):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for name in ("first.py", "second.py"):
                runpy.run_path(str(tmp_path / name))["run"](model)
    got = [(os.path.basename(w.filename), w.lineno) for w in caught if "target size" in str(w.message)]
    assert got == [("first.py", 4), ("second.py", 4)]


def test_code_typed_on_stdin_is_the_users_code():
    import subprocess
    import sys

    src = ("import torch, torch.nn as nn\nfrom guard import guard\nm = nn.Linear(4, 1)\n"
           "with guard(m, live=False) as g:\n    x = torch.randn(2, 4)\n    x[0, 0] = float('nan')\n"
           "    m(x).sum().backward()\nprint([(f.kind, f.source) for f in g.findings])\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_GUARD")}
    r = subprocess.run([sys.executable, "-"], input=src, capture_output=True, text=True, timeout=120, env=env)
    assert "[('nonfinite-input', '<stdin>:7')]" in r.stdout, r.stdout + r.stderr
