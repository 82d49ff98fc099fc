"""Loss misuse: softmax before CrossEntropy, NLL without log, sigmoid before BCE, targets outside [0, C)."""
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from demos import sigmoid_bce, softmax_cross_entropy, target_out_of_range
from guard import GuardError, guard
from guard.checks import loss_fn


def kinds(g):
    return [f.kind for f in g.findings]


def one_step(model, loss, opt):
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_softmax_demo_and_clean_twin():
    g = softmax_cross_entropy.train(live=False)
    assert kinds(g) == ["softmax-before-cross-entropy"]
    f = g.findings[0]
    assert f.where == "loss" and f.step == 0 and f.severity == "warning"
    assert "already probabilities" in f.message and "SoftmaxBackward0" in f.message
    assert "raw logits" in f.hint
    assert f.source.startswith(os.path.join("demos", "softmax_cross_entropy.py") + ":")
    assert softmax_cross_entropy.train(fixed=True, checks="all", live=False).findings == []


def test_cross_entropy_on_segmentation_logits_is_clean():
    model = nn.Conv2d(3, 4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, checks="all", live=False) as g:
        for _ in range(3):
            out = model(torch.randn(2, 3, 8, 8))
            one_step(model, F.cross_entropy(out, torch.randint(0, 4, (2, 8, 8))), opt)
    assert g.findings == []


@pytest.mark.parametrize("log_probs", [lambda z: z.log_softmax(1), lambda z: nn.LogSoftmax(dim=1)(z),
                                       lambda z: torch.log(torch.softmax(z, 1))])
def test_double_log_softmax_is_named_with_both_fixes(log_probs):
    """The contract's "double log-softmax": harmless to the numbers, but the model does not return logits."""
    model = nn.Conv2d(3, 4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, checks="all", live=False) as g:
        for _ in range(3):
            loss = F.cross_entropy(log_probs(model(torch.randn(2, 3, 8, 8))), torch.randint(0, 4, (2, 8, 8)))
            one_step(model, loss, opt)
    [f] = g.findings
    assert (f.kind, f.severity, f.where, f.step) == ("softmax-before-cross-entropy", "warning", "loss", 0)
    assert "already log-probabilities" in f.message and "log_softmax is applied twice" in f.message
    assert "NLLLoss" in f.hint and "return logits" in f.hint
    assert f.details["looks_like"] == "log-probabilities"


@pytest.mark.parametrize("bug", [True, False])
def test_a_loss_call_that_starts_after_training_is_probed_on_its_first_calls(bug):
    """Test-time pseudo-labelling after 60 steps of training through `nll_loss(log(p))`: the model returns
    probabilities, and the adaptation phase feeds them to `cross_entropy`. The probe ran on steps 0-4 and every
    50th only, so a 20-step phase from step 60 was never looked at (stop 45); a loss function on an input made by
    an op not probed there before is now probed on its first calls. The clean twin takes the log first."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.f = nn.Linear(8, 4)

        def forward(self, x):
            return self.f(x).softmax(-1)

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, live=False) as g:
        for _ in range(60):
            one_step(model, F.nll_loss(model(torch.randn(32, 8)).clamp_min(1e-8).log(), torch.randint(0, 4, (32,))),
                     opt)
        for _ in range(20):
            p = model(torch.randn(64, 8) + 1)
            conf, pl = p.max(1)
            mask = conf > 0.0
            x = p[mask] if bug else p[mask].clamp_min(1e-8).log()
            one_step(model, F.cross_entropy(x, pl[mask]) if bug else F.nll_loss(x, pl[mask]), opt)
    if bug:
        f = g.findings[0]
        assert (f.kind, f.step) == ("softmax-before-cross-entropy", 60), g.findings
    else:
        assert g.findings == [], g.findings


def test_a_single_class_log_softmax_is_not_double_log_softmax():
    """C = 1: log_softmax gives zeros (loss-constant's case), not a second log_softmax."""
    model = nn.Linear(3, 1)
    with guard(model, checks=["loss-fn"], live=False) as g:
        F.cross_entropy(model(torch.randn(8, 3)), torch.zeros(8, dtype=torch.long)).backward()
    assert g.findings == []


def test_segmentation_probabilities_are_caught():
    model = nn.Conv2d(3, 4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, live=False) as g:
        out = model(torch.randn(2, 3, 8, 8)).softmax(dim=1)
        one_step(model, nn.CrossEntropyLoss()(out, torch.randint(0, 4, (2, 8, 8))), opt)
    assert kinds(g) == ["softmax-before-cross-entropy"]


@pytest.mark.parametrize("make,looks", [(lambda z: z.softmax(1), "probabilities (softmax without log)"),
                                        (lambda z: z, "raw scores")])
def test_nll_loss_fed_non_log_probabilities(make, looks):
    model = nn.Linear(5, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, live=False) as g:
        x = torch.randn(8, 5)
        one_step(model, nn.NLLLoss()(make(model(x)), torch.randint(0, 3, (8,))), opt)
    assert kinds(g) == ["softmax-before-cross-entropy"]
    assert looks in g.findings[0].message and "log_softmax" in g.findings[0].hint


@pytest.mark.parametrize("student", ["softmax", "log_softmax", "log_softmax, log target"])
def test_kl_div_fed_probabilities_is_found_and_log_probabilities_are_clean(student):
    """Soft-label distillation with KLDivLoss given the student's softmax (probabilities) as its input: the loss is
    not the KL divergence. It was missed; the log_softmax input (with either form of target) is clean."""
    torch.manual_seed(0)
    teacher, model = nn.Linear(5, 4), nn.Linear(5, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, checks="all", live=False) as g:
        for _ in range(3):
            x = torch.randn(8, 5)
            with torch.no_grad():
                soft = teacher(x).softmax(1)
            z = model(x)
            if student == "softmax":
                loss = nn.KLDivLoss(reduction="batchmean")(z.softmax(1), soft)
            elif student == "log_softmax":
                loss = F.kl_div(z.log_softmax(1), soft, reduction="batchmean")
            else:
                loss = F.kl_div(z.log_softmax(1), soft.log(), reduction="batchmean", log_target=True)
            one_step(model, loss, opt)
    if student != "softmax":
        assert g.findings == []
        return
    [f] = g.findings
    assert (f.kind, f.where, f.step) == ("softmax-before-cross-entropy", "loss", 0)
    assert f.details["loss"] == "kl_div" and "SoftmaxBackward0" in f.message and "log_softmax(1)" in f.hint


def test_nll_loss_on_log_softmax_is_clean_also_in_half():
    model = nn.Linear(5, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, checks="all", live=False) as g:
        one_step(model, F.nll_loss(F.log_softmax(model(torch.randn(8, 5)), dim=1), torch.randint(0, 3, (8,))), opt)
        with torch.no_grad():
            lp = torch.randn(16, 100).log_softmax(1).half()
            F.nll_loss(lp.float(), torch.randint(0, 100, (16,)))
    assert g.findings == []


class _NaiveLogSoftmax(nn.Module):
    def forward(self, z):
        return z - torch.log(torch.exp(z).sum(1, keepdim=True))  # exp overflows for logits in the hundreds


def test_an_overflowed_log_softmax_is_a_nan_finding_not_raw_scores():
    # The rows are -inf/NaN, not scores: the NaN check names the module; the NLL probe says nothing.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), _NaiveLogSoftmax())
    with torch.no_grad():
        model[0].weight.mul_(400)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with guard(model, opt, checks="all", live=False) as g:
        one_step(model, F.nll_loss(model(torch.randn(16, 8)), torch.randint(0, 4, (16,))), opt)
    assert kinds(g) == ["nonfinite-output"] and g.findings[0].where == "1"


def test_raw_scores_into_nll_are_still_caught_beside_a_nan_row():
    model = nn.Linear(5, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, checks=["loss-fn"], live=False) as g:
        scores = model(torch.randn(8, 5))
        scores = torch.cat([scores[:7], torch.full((1, 3), float("nan"))])
        one_step(model, F.nll_loss(scores, torch.randint(0, 3, (8,))), opt)
    assert kinds(g) == ["softmax-before-cross-entropy"] and "raw scores" in g.findings[0].message


def test_focal_loss_through_nll_loss_is_no_misuse():
    # The widely copied focal loss: nll_loss((1 - p) ** gamma * log_p, y). nll_loss only gathers and
    # negates, so reweighted log-probabilities (all <= 0, logsumexp != 0) are fine.
    model = nn.Linear(5, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, checks="all", live=False) as g:
        for _ in range(3):
            log_p = F.log_softmax(model(torch.randn(8, 5)), dim=1)
            one_step(model, F.nll_loss((1 - log_p.exp()) ** 2 * log_p, torch.randint(0, 3, (8,))), opt)
    assert g.findings == []


def test_sigmoid_demo_and_clean_twin():
    g = sigmoid_bce.train(live=False)
    assert kinds(g) == ["sigmoid-before-bce"]
    f = g.findings[0]
    assert f.severity == "info" and f.where == "loss" and f.step == 0
    assert "BCEWithLogitsLoss" in f.hint
    assert sigmoid_bce.train(fixed=True, checks="all", live=False).findings == []


def test_sigmoid_through_views_and_under_no_grad():
    model = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())
    with guard(model, live=False) as g:
        F.binary_cross_entropy(torch.sigmoid(torch.randn(6, 1, requires_grad=True)).squeeze(1).clamp(1e-6, 1 - 1e-6),
                               torch.rand(6))
    assert kinds(g) == ["sigmoid-before-bce"]
    with guard(model, live=False) as g2:
        with torch.no_grad():
            F.binary_cross_entropy(model(torch.randn(6, 4)), torch.rand(6, 1))
    assert kinds(g2) == ["sigmoid-before-bce"] and "nn.Sigmoid module" in g2.findings[0].message


def test_bce_on_probabilities_not_from_sigmoid_is_clean():
    logits = torch.randn(6, 2, requires_grad=True)
    with guard(nn.Linear(2, 2), checks="all", live=False) as g:
        F.binary_cross_entropy(logits.softmax(1)[:, 1], torch.rand(6))
    assert g.findings == []


def test_target_demo_reports_values_and_classes(capsys):
    g = target_out_of_range.train(live=False)
    assert "Target 10 is out of bounds" in capsys.readouterr().out
    assert kinds(g) == ["target-out-of-range"]
    f = g.findings[0]
    assert f.where == "loss" and f.step == 0 and f.severity == "error"
    assert f.details["bad_values"] == [10] and f.details["classes"] == 10
    assert "[0, 10)" in f.message and "y - 1" in f.hint
    assert f.source.startswith(os.path.join("demos", "target_out_of_range.py") + ":")
    assert target_out_of_range.train(fixed=True, checks="all", live=False).findings == []


def test_a_segmentation_mask_s_void_label_255_is_told_to_use_ignore_index_255():
    """A mask with the void label 255 into cross_entropy without ignore_index: the hint names ignore_index=255 (the
    value found), not only the default -100; a label 5 out of range gets no such sentence."""
    for bad, void in ((255, True), (5, False)):
        logits = torch.randn(2, 3, 4, 4)
        target = torch.randint(0, 3, (2, 4, 4))
        target[0, 0, 0] = bad
        with guard(nn.Linear(2, 2), live=False) as g:
            with pytest.raises(IndexError):
                F.cross_entropy(logits, target)
        f = g.findings[0]
        assert f.kind == "target-out-of-range" and f.details["bad_values"] == [bad]
        assert ("ignore_index=255" in f.hint) is void


def test_target_raise_mode_explains_on_the_error_path():
    logits = torch.randn(4, 3)
    with guard(nn.Linear(2, 2), mode="raise", live=False) as g:
        with pytest.raises(IndexError):  # on the error path PyTorch's own exception is the one raised
            F.cross_entropy(logits, torch.tensor([0, 2, -1, 5]))
    assert g.findings[0].kind == "target-out-of-range"
    assert g.findings[0].details["bad_values"] == [-1, 5] and g.findings[0].details["bad_count"] == 2


def test_ignore_index_is_respected():
    logits = torch.randn(2, 3, 4, 4)
    t = torch.randint(0, 3, (2, 4, 4))
    t[0, 0] = 255  # void pixels in segmentation
    with guard(nn.Linear(2, 2), checks="all", live=False) as g:
        F.cross_entropy(logits, t, ignore_index=255)
        F.cross_entropy(logits, torch.where(t == 255, -100, t))
    assert g.findings == []
    with guard(nn.Linear(2, 2), live=False) as g2:
        with pytest.raises(IndexError):
            F.cross_entropy(logits, t)  # ignore_index forgotten
    assert g2.findings[0].details["bad_values"] == [255]


def test_accelerator_path_host_copy(monkeypatch):
    """Where the loss cannot raise synchronously, bad targets are found from a non-blocking host copy."""
    monkeypatch.setattr(loss_fn, "SYNC_RAISING", ())
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, checks="all", live=False) as g:
        for _ in range(2):
            one_step(model, F.cross_entropy(model(torch.randn(4, 4)), torch.tensor([0, 1, 2, 1])), opt)
    assert g.findings == []
    with guard(model, opt, live=False) as g2:
        with pytest.raises(IndexError):
            F.nll_loss(model(torch.randn(4, 4)).log_softmax(1), torch.tensor([0, 1, 3, 1]))
    assert kinds(g2) == ["target-out-of-range"] and g2.findings[0].details["bad_values"] == [3]


def test_silenced_target_check_leaves_the_error_alone():
    with guard(nn.Linear(2, 2), checks=["default", "-target-out-of-range"], live=False) as g:
        with pytest.raises(IndexError):
            F.cross_entropy(torch.randn(2, 3), torch.tensor([0, 3]))
    assert g.findings == []


def test_indexerror_carries_the_explanation_as_a_note():
    with pytest.raises(IndexError) as err:
        with guard(nn.Linear(2, 2), checks="all", live=False) as g:
            F.cross_entropy(torch.randn(3, 4), torch.tensor([1, 4, 0]))
    notes = getattr(err.value, "__notes__", [])
    assert any(n.startswith("guard: target-out-of-range at loss (step 0)") and "[0, 4): [4]" in n for n in notes)
    assert [f.kind for f in g.findings] == ["target-out-of-range"]


def _ctc_batch(labels_from=1, pad=-1):
    """log-prob-ready logits [T=12, N=3, C=6], padded targets [3, 4] (padding `pad` past each length)."""
    torch.manual_seed(0)
    targets = torch.randint(labels_from, 6, (3, 4))
    lengths = torch.tensor([4, 2, 3])
    targets[torch.arange(4) >= lengths.reshape(-1, 1)] = pad
    return torch.randn(12, 3, 6, requires_grad=True), targets, torch.full((3,), 12), lengths


def test_ctc_healthy_padded_targets_are_silent_and_its_contract_is_checked():
    logits, targets, in_len, tgt_len = _ctc_batch()
    with guard(checks="all", live=False) as g:
        loss = nn.CTCLoss()(logits.log_softmax(-1), targets, in_len, tgt_len)  # padding -1 lies past the lengths
        loss.backward()
    assert g.findings == []
    with guard(checks="all", live=False) as g:
        nn.CTCLoss()(logits.softmax(-1), targets, in_len, tgt_len).backward()  # probabilities, not log
    (f,) = g.findings
    assert f.kind == "softmax-before-cross-entropy" and "ctc_loss() (CTCLoss) got probabilities" in f.message
    assert "log_softmax(-1)" in f.hint
    with guard(checks="all", live=False) as g:
        nn.CTCLoss()(logits.log_softmax(1), targets, in_len, tgt_len).backward()  # over the batch dimension
    assert [f.details["looks_like"] for f in g.findings] == ["scores"]


def test_ctc_log_probs_padded_with_zeros_past_each_input_length_are_silent():
    """Per-utterance log_softmax, then pad_sequence (zeros past each utterance's length, which ctc_loss never reads):
    told as not log-probabilities until stop 44 (an all-zero row has logsumexp log C). Probabilities padded the same
    way are still told."""
    from torch.nn.utils.rnn import pad_sequence
    torch.manual_seed(0)
    lens = [12, 5, 7, 9]
    logits = [torch.randn(t, 6, requires_grad=True) for t in lens]
    targets, tgt_len = torch.randint(1, 6, (4, 3)), torch.full((4,), 3)
    for norm, told in ((lambda z: z.log_softmax(-1), []), (lambda z: z.softmax(-1), ["softmax-before-cross-entropy"])):
        with guard(checks="all", live=False) as g:
            lp = pad_sequence([norm(z) for z in logits])  # [T, N, C], zeros past each length
            F.ctc_loss(lp, targets, torch.tensor(lens), tgt_len).backward()
        assert [f.kind for f in g.findings] == told


def test_ctc_targets_past_the_classes_or_on_the_blank():
    logits, targets, in_len, tgt_len = _ctc_batch()
    targets[0, 1] = 6  # C = 6: one label too many for the output layer
    with pytest.raises(GuardError):  # raised before ctc_loss reads past the class dimension (not checked on CPU)
        with guard(mode="raise", live=False) as g:
            F.ctc_loss(logits.log_softmax(-1), targets, in_len, tgt_len)
    f = g.findings[0]
    assert f.kind == "target-out-of-range" and f.details["bad_values"] == [6] and "C must be at least 7" in f.hint
    logits, targets, in_len, tgt_len = _ctc_batch(labels_from=0)  # 0-based labels with blank=0
    with guard(live=False) as g:
        F.ctc_loss(logits.log_softmax(-1), targets, in_len, tgt_len, zero_infinity=True).backward()
    (f,) = g.findings
    assert f.kind == "target-out-of-range" and f.details["blank_targets"] and "1..C-1" in f.hint


@pytest.mark.parametrize("sigmoid_end", [True, False])
def test_bce_with_logits_fed_a_sigmoids_output(sigmoid_end):
    """A model ending in nn.Sigmoid, trained with BCEWithLogitsLoss: the sigmoid twice, probabilities squeezed into
    (0.5, 0.73). Told as cross-entropy fed probabilities, with the drop-the-sigmoid fix; the logits model is silent,
    and so is a sigmoid of the teacher's logits given as the target."""
    torch.manual_seed(0)
    layers = [nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1)] + ([nn.Sigmoid()] if sigmoid_end else [])
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.BCEWithLogitsLoss()
    x, y = torch.randn(32, 6), (torch.rand(32, 1) < 0.5).float()
    with guard(model, opt, live=False) as g:
        for _ in range(3):
            opt.zero_grad()
            loss = crit(model(x), y) + F.binary_cross_entropy_with_logits(model(x).detach() * 0 + 0.1, torch.sigmoid(y))
            loss.backward()
            opt.step()
    if not sigmoid_end:
        assert g.findings == []
        return
    (f,) = g.findings
    assert (f.kind, f.severity, f.where, f.step) == ("softmax-before-cross-entropy", "warning", "loss", 0)
    assert f.details["double_sigmoid"] is True and "Remove the final sigmoid" in f.hint


@pytest.mark.parametrize("softmax", [False, True])
def test_a_single_row_from_a_linear_that_sums_to_one_by_chance_is_not_probabilities(softmax):
    """DP-SGD's microbatches of one: raw logits [1, 3] straight from a Linear that happen to be non-negative and sum
    to 1 were taken for a softmax's output. One row says too little unless a softmax made it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.GroupNorm(4, 16), nn.ReLU(), nn.Linear(16, 3))
    with torch.no_grad():
        model[3].weight.mul_(0.02)
        model[3].bias.copy_(torch.tensor([0.3, 0.4, 0.3]))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
    with guard(model, opt, live=False) as g:
        for step in range(8):
            for j in range(4 * step, 4 * step + 4):
                out = model(x[j:j + 1])
                F.cross_entropy(out.softmax(1) if softmax else out, y[j:j + 1]).backward()
            opt.step()
            opt.zero_grad()
    assert [(f.kind, f.step) for f in g.findings] == ([("softmax-before-cross-entropy", 0)] if softmax else [])
    if softmax:
        assert g.findings[0].details["grad_fn"] == "SoftmaxBackward0"
