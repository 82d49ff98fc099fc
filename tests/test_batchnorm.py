"""BatchNorm and batches of one: caught before PyTorch's error, and predicted from the DataLoader at step 0."""
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from demos import batchnorm_last_batch
from guard import GuardError, guard


def by_kind(g, kind):
    return [f for f in g.findings if f.kind == kind]


def mlp_bn():
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))


def run_epochs(model, loader, opt, epochs=1):
    for _ in range(epochs):
        for xb, yb in loader:
            loss = nn.functional.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()


def data(n, d=6):
    return TensorDataset(torch.randn(n, d), torch.randint(0, 2, (n,)))


def test_demo_predicts_at_step_0_then_catches_the_crash(capsys):
    g = batchnorm_last_batch.train(live=False)
    assert "Expected more than 1 value per channel" in capsys.readouterr().out  # the crash still happens
    assert [f.kind for f in g.findings] == ["batchnorm-last-batch", "batchnorm-single-sample"]
    warn, err = g.findings
    assert warn.step == 0 and warn.severity == "warning" and warn.where == "input"
    assert warn.details["dataset_size"] == 161 and warn.details["batch_size"] == 32
    assert warn.details["last_batch_size"] == 1 and warn.details["batchnorm_modules"] == ["1"]
    assert "drop_last=True" in warn.hint and "GroupNorm/LayerNorm" in warn.hint and "batch size" in warn.hint
    assert "161 samples, batch_size=32" in warn.message
    assert warn.source.startswith(os.path.join("demos", "batchnorm_last_batch.py") + ":")
    assert err.where == "1" and err.step == 5 and err.severity == "error"  # 5 full batches, then the batch of 1
    assert "(1, 32)" in err.message and "drop_last=True" in err.hint


def test_demo_clean_twin_drop_last_has_no_findings():
    g = batchnorm_last_batch.train(fixed=True, checks="all", live=False)
    assert g.findings == []
    assert g.step == 10


def test_reactive_raise_mode_before_pytorch_valueerror():
    model = mlp_bn()
    with guard(model, mode="raise", live=False):
        with pytest.raises(GuardError) as err:
            model(torch.randn(1, 6))
    assert err.value.finding.kind == "batchnorm-single-sample" and err.value.finding.where == "1"


def test_eval_mode_single_sample_is_fine():
    model = mlp_bn().eval()
    with guard(model, checks="all", live=False) as g:
        with torch.no_grad():
            model(torch.randn(1, 6))
    assert g.findings == []


def test_sampler_sets_the_length():
    model = mlp_bn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ds = data(100)
    loader = DataLoader(ds, batch_size=8, sampler=RandomSampler(ds, num_samples=33))
    with guard(model, opt, live=False) as g:
        with pytest.raises(ValueError):
            run_epochs(model, loader, opt)
    (w,) = by_kind(g, "batchnorm-last-batch")
    assert w.step == 0
    assert w.details["samples_per_epoch"] == 33 and w.details["dataset_size"] == 100
    assert w.details["sampler"] == "RandomSampler"
    assert "33 samples from its RandomSampler (dataset of 100)" in w.message
    assert w.details["suggested_batch_size"] not in (None, 8) and 33 % w.details["suggested_batch_size"] != 1


def test_a_loader_given_a_batch_sampler_is_told_to_drop_last_there():
    """DataLoader(batch_sampler=BatchSampler(...)) refuses DataLoader's drop_last: the fix names BatchSampler's."""
    from torch.utils.data import BatchSampler

    model = mlp_bn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ds = data(65)
    loader = DataLoader(ds, batch_sampler=BatchSampler(RandomSampler(ds), 16, drop_last=False))
    with guard(model, opt, live=False) as g:
        with pytest.raises(ValueError):
            run_epochs(model, loader, opt)
    (w,) = by_kind(g, "batchnorm-last-batch")
    assert "BatchSampler(batch_size=16, drop_last=False) given as batch_sampler=" in w.message
    assert "BatchSampler(..., drop_last=True)" in w.hint and "DataLoader(..., drop_last=True)" not in w.hint
    (e,) = by_kind(g, "batchnorm-single-sample")
    assert "BatchSampler(..., drop_last=True)" in e.hint
    with pytest.raises(ValueError, match="mutually exclusive"):  # what the plain fix would have done
        DataLoader(ds, batch_sampler=BatchSampler(RandomSampler(ds), 16, drop_last=False), drop_last=True)
    fixed = DataLoader(ds, batch_sampler=BatchSampler(RandomSampler(ds), 16, drop_last=True))
    with guard(model, opt, live=False, checks="all") as g:
        run_epochs(model, fixed, opt, epochs=2)
    assert g.findings == []


def test_distributed_sampler_per_rank_length():
    from torch.utils.data.distributed import DistributedSampler

    model = mlp_bn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ds = data(66)  # 2 ranks: 33 samples each, batches of 8 leave 1
    loader = DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds, num_replicas=2, rank=0))
    with guard(model, opt, live=False) as g:
        with pytest.raises(ValueError):
            run_epochs(model, loader, opt)
    (w,) = by_kind(g, "batchnorm-last-batch")
    assert w.details["samples_per_epoch"] == 33 and w.details["sampler"] == "DistributedSampler"


def test_conv_batchnorm2d_survives_a_batch_of_one_so_no_warning():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ds = TensorDataset(torch.randn(9, 3, 8, 8), torch.randint(0, 2, (9,)))
    with guard(model, opt, checks="all", live=False) as g:
        run_epochs(model, DataLoader(ds, batch_size=4), opt)  # last batch: 1 x 4 x 8 x 8, fine
    assert g.findings == [] and g.step == 3


def test_validation_loader_in_eval_mode_is_not_warned():
    model = mlp_bn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train = DataLoader(data(32), batch_size=8, shuffle=True)
    val = DataLoader(data(17), batch_size=8)
    with guard(model, opt, checks="all", live=False) as g:
        run_epochs(model, train, opt)
        model.eval()
        with torch.no_grad():
            for xb, _ in val:
                model(xb)
        model.train()
    assert g.findings == []


def test_model_without_batchnorm_is_not_warned():
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, checks="all", live=False) as g:
        run_epochs(model, DataLoader(data(33), batch_size=8), opt)
    assert g.findings == []


def test_global_guard_predicts_after_first_forward():
    model = mlp_bn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(live=False) as g:
        with pytest.raises(ValueError):
            run_epochs(model, DataLoader(data(17), batch_size=8), opt)
    w = by_kind(g, "batchnorm-last-batch")
    assert len(w) == 1 and w[0].step == 0
    assert by_kind(g, "batchnorm-single-sample")[0].step == 2


def test_small_batches_are_info_and_do_not_hide_the_error():
    model = mlp_bn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, live=False) as g:
        with pytest.raises(ValueError):
            run_epochs(model, DataLoader(data(7), batch_size=2), opt)  # 2, 2, 2, 1
    infos = [f for f in g.findings if f.severity == "info"]
    assert len(infos) == 1 and infos[0].kind == "batchnorm-single-sample" and infos[0].where == "input"
    assert infos[0].step == 0 and "batches of 2" in infos[0].message
    errors = [f for f in g.findings if f.severity == "error"]
    assert [(f.kind, f.where, f.step) for f in errors] == [("batchnorm-single-sample", "1", 3)]


def test_silenced_by_check_name():
    model = mlp_bn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, checks=["default", "-batchnorm"], live=False) as g:
        with pytest.raises(ValueError):
            run_epochs(model, DataLoader(data(17), batch_size=8), opt)
    assert g.findings == []


def test_global_guard_keeps_seeing_model_calls_after_a_caught_crash():
    """A forward that raised must not leave guard thinking it is still inside a module call."""
    model = mlp_bn()
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    with guard(live=False) as g:
        with pytest.raises(ValueError):
            model(torch.randn(1, 6))  # BatchNorm1d with a batch of 1
        conv(torch.rand(2, 3, 8, 8) * 255)  # a root call again: input-stats looks at roots only
    assert [f.kind for f in g.findings] == ["batchnorm-single-sample", "input-not-normalized"]


def test_escaping_valueerror_carries_the_finding_as_a_note():
    model = mlp_bn()
    with pytest.raises(ValueError) as err:
        with guard(model, checks="all", live=False) as g:
            model(torch.randn(1, 6))
    notes = getattr(err.value, "__notes__", [])
    assert any(n.startswith("guard: batchnorm-single-sample at 1 (step 0)") and "drop_last=True" in n for n in notes)
    assert [f.kind for f in g.findings] == ["batchnorm-single-sample"]


def test_graph_batches_whose_batchnorm_sees_nodes_are_not_warned():
    # PyG-style: the collate concatenates sets of nodes, so BatchNorm's batch dimension is the nodes of
    # all graphs in the batch. A last batch of one graph still has several nodes: no crash to predict.
    torch.manual_seed(0)
    graphs = [torch.randn(int(torch.randint(5, 12, ())), 4) for _ in range(9)]  # 9 = 2 * 4 + 1
    loader = DataLoader(graphs, batch_size=4, collate_fn=lambda b: torch.cat(b))
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, live=False) as g:
        for _ in range(2):
            for nodes in loader:
                opt.zero_grad()
                model(nodes).pow(2).mean().backward()
                opt.step()
    assert g.findings == [] and g.internal_errors == []


def _skip_small(model, loader, opt):
    for xb, yb in loader:
        if xb.size(0) < 2:  # the loop drops the batch of one itself
            continue
        loss = nn.functional.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _stop_before_last(model, loader, opt):
    import itertools

    for xb, yb in itertools.islice(loader, len(loader) - 1):
        loss = nn.functional.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _counted(model, loader, opt):
    for _, (xb, yb) in zip(range(len(loader) - 1), loader):
        loss = nn.functional.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("loop", [_skip_small, _stop_before_last, _counted])
def test_a_loop_that_handles_the_last_batch_of_one_itself_is_not_warned(loop):
    torch.manual_seed(0)
    model = mlp_bn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(data(49), batch_size=16, shuffle=True)
    with guard(model, opt, live=False) as g:
        for _ in range(2):
            loop(model, loader, opt)
    assert g.findings == [] and g.step == 6


def test_a_batch_pooled_away_inside_the_model_gets_the_pooling_hint_not_drop_last():
    class Pooled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.bn = nn.Linear(6, 16), nn.BatchNorm1d(16)

        def forward(self, x):
            return self.bn(self.lin(x).mean(0, keepdim=True))  # meant mean(1)? it pools over the samples

    model = Pooled()
    with pytest.raises(ValueError) as ei:
        with guard(model, live=False) as g:
            model(torch.randn(16, 6))
    [f] = by_kind(g, "batchnorm-single-sample")
    assert f.where == "bn" and f.details["model_batch"] == 16
    assert "batch of 16 samples" in f.hint and "mean(0, keepdim=True)" in f.hint and "drop_last" not in f.hint
    # the note under PyTorch's own error says the same, not the DataLoader's drop_last
    note = "\n".join(getattr(ei.value, "__notes__", []))
    assert "reduced the batch dimension" in note and "drop_last" not in note


def test_a_batch_of_one_image_says_how_many_values_each_channel_still_has():
    """pix2pix-style batch size 1 with BatchNorm2d: an info that counts the values per channel (8 x 8 = 64)."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
    opt = torch.optim.Adam(model.parameters())
    with guard(model, opt, live=False) as g:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(1, 3, 8, 8)).pow(2).mean().backward()
            opt.step()
    (f,) = g.findings
    assert f.severity == "info" and f.kind == "batchnorm-single-sample" and f.where == "input"
    assert "(input (1, 8, 8, 8), 64 values per channel)" in f.message and "very noisy" not in f.message


def test_a_loader_feeding_part_of_the_model_in_eval_under_no_grad_is_no_training_loader():
    """k-NN evaluation: features from `model.backbone(x)` in eval mode under no_grad over a loader with a last
    batch of one. The next training forward (its own batches) used to be taken for that loader's."""
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU())
            self.head = nn.Linear(64, 4)

        def forward(self, x):
            return self.head(self.backbone(x))

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(256, 16), torch.randint(0, 4, (256,))
    feature_loader = DataLoader(TensorDataset(torch.randn(65, 16)), batch_size=32)
    with guard(model, opt, live=False) as g:
        for _ in range(2):
            for i in range(0, 256, 32):
                loss = F.cross_entropy(model(x[i:i + 32]), y[i:i + 32])
                opt.zero_grad()
                loss.backward()
                opt.step()
            model.eval()
            with torch.no_grad():
                feats = [model.backbone(b) for (b,) in feature_loader]
            model.train()
    assert len(feats) == 3 and g.findings == [] and g.internal_errors == []


@pytest.mark.parametrize("samples", [256, 257])
def test_a_batch_of_one_the_loader_never_yields_is_told_as_the_codes_own(samples):
    """A per-sample FGSM loop over each loader batch (`x[i:i + 1]`) in train mode: the loader's batches hold 32 of 256
    samples, none of one, so the hint is the per-sample pass (the whole batch, or eval mode), not drop_last, in the
    finding and in the note on PyTorch's error. With 257 samples the loader's last batch is of one: drop_last's fix."""
    torch.manual_seed(0)
    X, Y = torch.randn(samples, 16), torch.randint(0, 3, (samples,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=32)
    model = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(ValueError) as err:
        with guard(model, opt, live=False) as g:
            for x, y in loader:
                for i in range(len(x)):
                    xi = x[i:i + 1].clone().requires_grad_(True)
                    torch.autograd.grad(F.cross_entropy(model(xi), y[i:i + 1]), xi)
    (f,) = [f for f in g.findings if f.kind == "batchnorm-single-sample"]
    notes = "\n".join(getattr(err.value, "__notes__", []))
    if samples == 256:
        assert f.details["loader_batch"] == 32 and "per-sample loop" in f.hint and "drop_last" not in f.hint
        assert "your code made it" in notes
    else:
        assert "loader_batch" not in f.details and "drop_last=True" in f.hint and "drop_last=True" in notes


def test_a_per_sample_loop_over_2d_batchnorm_gets_the_whole_batch_hint():
    """BatchNorm2d fed one image at a time by a per-sample attack loop (64 values per channel: no crash, the info
    finding): the loader's batches hold 32, so the hint is the whole-batch or eval() pass, not a larger batch size."""
    torch.manual_seed(0)
    X, Y = torch.randn(64, 2, 8, 8), torch.randint(0, 3, (64,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=32)
    model = nn.Sequential(nn.Conv2d(2, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with guard(model, opt, live=False) as g:
        for x, y in loader:
            adv = []
            for i in range(4):
                xi = x[i:i + 1].clone().requires_grad_(True)
                (gx,) = torch.autograd.grad(F.cross_entropy(model(xi), y[i:i + 1]), xi)
                adv.append((xi + 0.1 * gx.sign()).detach())
            loss = F.cross_entropy(model(torch.cat(adv)), y[:4])
            opt.zero_grad(); loss.backward(); opt.step()
    (f,) = [f for f in g.findings if f.kind == "batchnorm-single-sample"]
    assert f.severity == "info" and "loader's batches hold 32" in f.hint and "larger batch" not in f.hint
