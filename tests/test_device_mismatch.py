"""device-mismatch: module inputs vs parameters, optimizer state vs parameters, loss operands.

No GPU here: the ``meta`` device and FakeTensorMode's fake ``cuda:0`` tensors stand in for it.
"""
import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from demos import device_mismatch
from guard import GuardError, guard
from guard.checks.device_mismatch import same_device


def kinds(g):
    return [f.kind for f in g.findings]


def fake_cuda_linear(i=4, o=3):
    """An nn.Linear whose weights are fake cuda:0 tensors (call inside FakeTensorMode and no_grad)."""
    lin = nn.Linear(i, o, device="meta")
    lin.weight = nn.Parameter(torch.empty(o, i, device="cuda"), requires_grad=False)
    lin.bias = nn.Parameter(torch.empty(o, device="cuda"), requires_grad=False)
    return lin


def test_demo_reports_unassigned_to_before_pytorch_error(capsys):
    g = device_mismatch.train(live=False)
    assert "training crashed" in capsys.readouterr().out  # the demo still crashes: guard reports first
    assert kinds(g) == ["device-mismatch"]
    f = g.findings[0]
    assert f.where == "0" and f.step == 0 and f.severity == "error"
    assert "0.weight" in f.message and "input (args[0])" in f.message
    assert "cpu" in f.message and "meta" in f.message
    assert "x = x.to(device)" in f.hint and "returns a copy" in f.hint
    assert f.source.startswith(os.path.join("demos", "device_mismatch.py") + ":")
    assert f.details["input_device"] == "cpu" and f.details["module_device"] == "meta"


def test_demo_clean_twin_has_no_findings():
    g = device_mismatch.train(fixed=True, checks="all", live=False)
    assert g.findings == []


def test_fake_cuda_model_cpu_input_is_caught_before_pytorch(capsys):
    with FakeTensorMode(), torch.no_grad():
        model = nn.Sequential(fake_cuda_linear(), nn.ReLU())
        with guard(model, mode="raise", live=False):
            with pytest.raises(GuardError) as err:
                model(torch.empty(2, 4))  # a CPU batch: x.cuda() was not assigned
    f = err.value.finding
    assert f.kind == "device-mismatch" and f.where == "0"
    assert "the input is on the CPU and the model is on an accelerator (cuda:0)" in f.message
    assert "x = x.to(device)" in f.hint and "model.to(device)" in f.hint


def test_fake_cuda_warn_mode_records_then_pytorch_raises():
    with FakeTensorMode(), torch.no_grad():
        model = fake_cuda_linear()
        with guard(model, live=False) as g:
            with pytest.raises(RuntimeError, match="same device"):
                model(torch.empty(2, 4))
    assert kinds(g) == ["device-mismatch"]
    assert g.findings[0].where == "Linear"


def test_fake_cuda_same_device_is_clean_cuda_vs_cuda0():
    with FakeTensorMode(), torch.no_grad():
        model = nn.Sequential(fake_cuda_linear(), nn.ReLU(), fake_cuda_linear(3, 2))
        with guard(model, checks="all", live=False) as g:
            x = torch.empty(2, 4, device=torch.device("cuda"))  # "cuda" without an index
            y = model(x)
            F.mse_loss(y, torch.empty(2, 2, device="cuda:0"))
    assert g.findings == []


def test_model_on_cpu_input_on_accelerator_says_model_not_moved():
    with FakeTensorMode(), torch.no_grad():
        model = nn.Linear(4, 3).requires_grad_(False)
        with guard(model, mode="raise", live=False):
            with pytest.raises(GuardError) as err:
                model(torch.empty(2, 4, device="cuda"))
    f = err.value.finding
    assert "the input is on an accelerator (cuda:0) and the model is on the CPU" in f.message
    assert "model.to(device)" in f.hint


def test_same_device_normalises_index():
    assert same_device(torch.device("cuda"), torch.device("cuda:0"))
    assert not same_device(torch.device("cuda:0"), torch.device("cuda:1"))
    assert not same_device(torch.device("cpu"), torch.device("meta"))
    assert same_device(torch.device("cpu"), torch.device("cpu"))


class Scale(nn.Module):
    """A custom module with a direct parameter that takes a dict of tensors and CPU lengths."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, batch, lengths=None):
        return batch["x"] * self.gain


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    mask: torch.Tensor


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, b: Batch):
        return b.x * self.w * b.mask


def test_nested_dict_input_names_the_argument():
    model = Scale().to("meta")
    with guard(model, mode="raise", live=False):
        with pytest.raises(GuardError) as err:
            model({"x": torch.randn(2, 4)})
    f = err.value.finding
    assert "got batch['x'] (args[0]['x']) on cpu" in f.message and "gain" in f.message


def test_dataclass_input_and_cpu_index_tensors_of_custom_modules():
    model = Masked().to("meta")
    with guard(model, mode="raise", live=False):
        with pytest.raises(GuardError) as err:
            model(Batch(x=torch.randn(2, 4), mask=torch.ones(2, 4, device="meta")))
    assert ".x" in err.value.finding.message
    # custom modules may take integer CPU tensors on purpose (lengths for pack_padded_sequence)
    model2 = Scale().to("meta")
    with guard(model2, mode="raise", live=False) as g:
        model2({"x": torch.empty(2, 4, device="meta")}, lengths=torch.tensor([2, 1]))
    assert g.findings == []


def test_builtin_embedding_with_cpu_indices_is_caught():
    emb = nn.Embedding(10, 4).to("meta")
    with guard(emb, mode="raise", live=False):
        with pytest.raises(GuardError) as err:
            emb(torch.tensor([1, 2, 3]))
    assert err.value.finding.where == "Embedding"


def test_packed_sequence_batch_sizes_on_cpu_is_not_a_mismatch():
    lstm = nn.LSTM(4, 5, batch_first=True).to("meta")
    data = torch.empty(3, 6, 4, device="meta")
    packed = nn.utils.rnn.pack_padded_sequence(data, torch.tensor([6, 4, 2]), batch_first=True)
    assert packed.batch_sizes.device.type == "cpu" and packed.data.device.type == "meta"
    with guard(lstm, mode="raise", live=False) as g:
        try:
            lstm(packed)
        except GuardError:
            raise
        except Exception:
            pass  # whether meta supports packed LSTM is PyTorch's business; guard must not object
    assert g.findings == []


def test_cpu_scalars_mix_with_any_device():
    class AddScalar(nn.Module):
        def __init__(self):
            super().__init__()
            self.b = nn.Parameter(torch.zeros(3))

        def forward(self, x, scale):
            return x * scale + self.b

    m = AddScalar().to("meta")
    with guard(m, mode="raise", live=False) as g:
        m(torch.empty(2, 3, device="meta"), torch.tensor(2.0))
    assert g.findings == []


def test_optimizer_state_left_on_another_device():
    model = nn.Sequential(nn.Linear(4, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()  # state on the CPU, like a checkpoint loaded before model.to(device)
    for st in opt.state.values():
        st["exp_avg"] = st["exp_avg"].to("meta")  # the parameters moved, the state did not
    with guard(model, opt, mode="raise", live=False):
        model(torch.randn(2, 4)).sum().backward()
        with pytest.raises(GuardError) as err:
            opt.step()
    f = err.value.finding
    assert f.kind == "device-mismatch" and f.where in ("0.weight", "0.bias")
    assert "'exp_avg'" in f.message and "Adam" in f.message
    assert "load_state_dict" in f.hint


def test_adam_cpu_step_counter_is_fine():
    model = nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with guard(model, opt, checks="all", live=False) as g:
        for _ in range(3):
            loss = model(torch.randn(4, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert g.findings == []


def test_loss_operands_on_different_devices():
    model = nn.Linear(4, 2)
    with FakeTensorMode(), torch.no_grad():
        out = torch.empty(3, 2, device="cuda")
        with guard(model, mode="raise", live=False):
            with pytest.raises(GuardError) as err:
                nn.MSELoss()(out, torch.empty(3, 2))  # the target was never moved
    f = err.value.finding
    assert f.where == "loss" and "mse_loss" in f.message
    assert "the target is on the CPU and the model is on an accelerator (cuda:0)" in f.message
    assert "y = y.to(device)" in f.hint


def test_patches_are_removed_on_exit():
    before = F.mse_loss, F.cross_entropy, torch.utils.data.DataLoader.__iter__
    with guard(nn.Linear(2, 2), live=False):
        assert F.mse_loss is not before[0]
    assert (F.mse_loss, F.cross_entropy, torch.utils.data.DataLoader.__iter__) == before


def test_meta_conv_that_pytorch_runs_silently_is_still_caught():
    conv = nn.Conv2d(3, 2, 3).to("meta")
    # The output is uninitialised memory, NaN now and then: the NaN check would rightly say so.
    with guard(conv, live=False, checks=["default", "-nonfinite"]) as g:
        out = conv(torch.randn(1, 3, 5, 5))  # no error from PyTorch: a CPU tensor of garbage
    assert out.device.type == "cpu"
    assert [f.kind for f in g.findings] == ["device-mismatch"] and g.findings[0].where == "Conv2d"


def test_dump_holds_the_finding(tmp_path):
    path = tmp_path / "report.json"
    device_mismatch.train(report=str(path), live=False)
    import json

    rep = json.loads(path.read_text())
    (f,) = [f for f in rep["findings"] if f["kind"] == "device-mismatch"]
    assert f["severity"] == "error" and f["where"] == "0"
    assert f["details"] == {"module": "Linear", "argument": "input (args[0])", "input_device": "cpu",
                            "parameter": "0.weight", "module_device": "meta"}


def test_pytorch_error_escaping_the_block_carries_the_finding_as_a_note():
    model = nn.Linear(4, 2).to("meta")
    with pytest.raises(RuntimeError) as err:
        with guard(model, checks="all", live=False) as g:
            model(torch.randn(2, 4))
    notes = getattr(err.value, "__notes__", [])
    assert any(n.startswith("guard: device-mismatch at Linear (step 0)") and "x = x.to(device)" in n for n in notes)
    assert [f.kind for f in g.findings] == ["device-mismatch"]  # explained once, not again as explained-error


class Tagged(nn.Module):
    """Adds a learned offset fed with a constant made in forward: `torch.ones(n, 1)` lands on the CPU."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.offset = nn.Linear(1, 3)

    def forward(self, x):
        return self.fc(x) + self.offset(torch.ones(len(x), 1))  # BUG: not device=x.device


class Wrapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x * 2)  # a tensor computed from the model's input, not made in forward


def _line_of(text):
    with open(__file__) as fh:
        return next(i for i, line in enumerate(fh, 1) if text in line)


def test_tensor_made_in_forward_on_the_default_device_names_that_line():
    model = Tagged().to("meta")  # meta stands in for the GPU: model and batch are there, the constant is not
    with pytest.raises(RuntimeError):
        with guard(model, live=False) as g:
            model(torch.empty(2, 4, device="meta"))
    (f,) = g.findings
    assert f.kind == "device-mismatch" and f.where == "offset"
    assert "got input (args[0]) on cpu (made inside forward: the model's inputs are on meta)" in f.message
    assert "device=x.device" in f.hint and "register_buffer" in f.hint and "returns a copy" not in f.hint
    assert f.source == f"{os.path.relpath(__file__)}:{_line_of('# BUG: not device=x.device')}"
    assert f.details["made_in_forward"] is True


def test_batch_not_moved_through_a_custom_forward_still_blames_the_batch():
    model = Wrapped().to("meta")
    with guard(model, live=False) as g:
        with pytest.raises(RuntimeError):
            model(torch.randn(2, 4))  # the line the fix belongs to (x.to(device) not assigned)
    (f,) = g.findings
    assert f.where == "fc" and "made inside forward" not in f.message and "made_in_forward" not in f.details
    assert "x = x.to(device)" in f.hint
    assert f.source == f"{os.path.relpath(__file__)}:{_line_of('# the line the fix belongs to')}"
