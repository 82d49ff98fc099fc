"""`g.findings` (and `g.report()`) are current when read: what is staged mid-step is resolved first, with
one batched read, only when asked; the step's loss and gradient norms still land in its timeline entry."""
import torch
from torch import nn

from guard import guard


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))


def test_nan_input_is_in_findings_right_after_the_forward_model_mode():
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with guard(m, opt, live=False) as g:
        m(torch.randn(2, 3))
        assert g.findings == []
        m(torch.full((1, 3), float("inf")))
        assert [(f.kind, f.where, f.step) for f in g.findings] == [("nonfinite-input", "input", 0)]
        assert g.step == 0  # read mid-step: the step did not end
        assert g.report()["findings"][0]["kind"] == "nonfinite-input"


def test_nan_input_is_in_findings_right_after_the_forward_global_mode():
    m = _model()
    with guard(live=False) as g:
        m(torch.full((1, 3), float("nan")))
        assert [(f.kind, f.where) for f in g.findings] == [("nonfinite-input", "input")]


def test_mid_step_reads_leave_the_timeline_as_without_them():
    def run(read):
        m = _model()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with guard(m, opt, live=False) as g:
            for step in range(4):
                opt.zero_grad()
                for _ in range(2):  # gradient accumulation: two losses per step
                    loss = m(torch.randn(4, 3)).pow(2).mean()
                    if read:
                        assert g.findings == []
                    loss.backward()
                    if read:
                        assert g.findings == []
                opt.step()
                if read:
                    assert g.findings == []
        return g.timeline, g.step

    with torch.random.fork_rng():
        torch.manual_seed(1)
        plain = run(False)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        read = run(True)
    assert read == plain
    assert [sorted(e) for e in plain[0]] == [["grad_norm", "loss", "lr", "step"]] * 4


def test_nan_later_in_the_same_step_is_still_found_after_a_read():
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with guard(m, opt, live=False) as g:
        opt.zero_grad()
        m(torch.randn(2, 3)).sum().backward()
        assert g.findings == []
        m[0].weight.data[0, 0] = float("nan")  # breaks after the read, within the step
        m(torch.randn(2, 3)).sum().backward()
        opt.step()
        assert {f.kind for f in g.findings} & {"nonfinite-output", "nonfinite-param", "nonfinite-grad"}
