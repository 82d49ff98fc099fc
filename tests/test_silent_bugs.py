"""Issue 16 (second half) and issue 19 item 5: dropout-in-eval, unshuffled-labels, clip-before-unscale,
params-not-updating, vanishing-gradients, grads-all-zero, loss-constant. Each bug and each healthy pattern."""
import copy
import inspect
import os
import warnings

import pytest
import torch
import torch.utils.checkpoint
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

from demos import (clip_before_unscale, dropout_in_eval, grads_all_zero, loss_constant, params_not_updating,
                   unshuffled_labels, vanishing_gradients)
from guard import guard
from guard.findings import KINDS


def kinds(g):
    return [f.kind for f in g.findings]


def line_of(module, needle):
    lines, start = inspect.getsourcelines(module)
    start = 1 if inspect.ismodule(module) else start
    for i, text in enumerate(lines):
        if needle in text:
            return f"{os.path.relpath(inspect.getsourcefile(module))}:{start + i}"
    raise AssertionError(needle)


def only(g, kind):
    fs = [f for f in g.findings if f.kind == kind]
    assert len(fs) == 1, [(f.kind, f.where) for f in g.findings]
    return fs[0]


def test_kinds_and_severities_are_the_contracts():
    from guard.checks import registry

    want = {"dropout-in-eval": "warning", "unshuffled-labels": "warning", "clip-before-unscale": "error",
            "params-not-updating": "warning", "vanishing-gradients": "warning", "grads-all-zero": "warning",
            "loss-constant": "error"}
    declared = {k: v[0] for c in registry().values() if isinstance(c.kinds, dict) for k, v in c.kinds.items()}
    for kind, sev in want.items():
        assert declared[kind] == sev == KINDS[kind][0]


# --------------------------------------------------------------------------- dropout-in-eval

def test_dropout_in_eval_demo_names_module_and_line_and_twin_is_clean():
    g = dropout_in_eval.train(live=False)
    f = only(g, "dropout-in-eval")
    src = line_of(dropout_in_eval, "h = F.dropout(h, p=0.3)  #")
    assert f.severity == "warning" and f.where == "Net" and f.step == 0 and f.source == src
    assert "training=self.training" in f.hint and "nn.Dropout" in f.hint
    assert "training=True) (silent)" in f.hint  # deliberate Monte Carlo dropout says so
    assert f"Net.forward, {src}" in f.message and f.details["p"] == 0.3
    assert kinds(g) == ["dropout-in-eval"]
    assert dropout_in_eval.train(fixed=True, checks="all", live=False).findings == []


class Block(nn.Module):
    def __init__(self, functional):
        super().__init__()
        self.functional = functional
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.2)

    def helper(self, h):
        return F.dropout1d(h.unsqueeze(-1), 0.1).squeeze(-1)

    def forward(self, x):
        h = self.fc(x)
        if self.functional == "helper":
            return self.helper(h)
        if self.functional == "positional":
            return F.dropout(h, 0.2, self.training)
        return self.drop(h)


def _loop(model, g_opts, steps=3, mc=False):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, live=False, checks="all", **g_opts) as g:
        for _ in range(steps):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        if mc:  # Monte Carlo dropout on purpose: dropout modules switched back to train mode
            for m in model.modules():
                if isinstance(m, nn.Dropout):
                    m.train()
        with torch.no_grad():
            model(torch.randn(4, 8))
    return g


class _ShortSelf(nn.Module):
    def __init__(s):
        super().__init__()
        s.fc = nn.Linear(8, 8)

    def forward(s, x):  # noqa: N805 (the first parameter is not called self)
        return F.dropout(s.fc(x), 0.2)


def test_dropout_in_a_forward_whose_first_parameter_is_not_called_self_is_found():
    g = _loop(nn.Sequential(_ShortSelf()), {})
    f = only(g, "dropout-in-eval")
    assert f.where == "0" and "training=self.training" in f.hint


class _Branch(nn.Module):
    def __init__(s, how):
        super().__init__()
        s.fc, s.how = nn.Linear(8, 8), how

    def forward(s, x):  # noqa: N805
        h = s.fc(x)
        if s.how == "if":
            if s.training:
                h = F.dropout(h, 0.25)
        elif s.how == "expression":
            h = F.dropout(h, 0.25) if s.training else h
        elif s.how == "else":  # the bug: dropout in the branch that runs in eval mode
            if s.training:
                h = h * 1.0
            else:
                h = F.dropout(h, 0.25)
        return h


@pytest.mark.parametrize("how", ["if", "expression", "else"])
def test_dropout_only_under_if_self_training_is_silent(how):
    """`if self.training: h = F.dropout(h, p)` never runs in eval mode (an AlphaFold-style shared dropout): it was
    reported as dropout left on in eval. The else branch of that `if` does run in eval, and is found."""
    g = _loop(nn.Sequential(_Branch(how)), {})
    if how == "else":
        f = only(g, "dropout-in-eval")
        assert f.where == "0" and f.details["module_training"] is False
    else:
        assert g.findings == [] and g.internal_errors == []


class _SDPA(nn.Module):
    def __init__(s, tied):
        super().__init__()
        s.qkv, s.tied = nn.Linear(8, 24), tied

    def forward(s, x):  # noqa: N805
        q, k, v = s.qkv(x).view(len(x), -1, 3, 2, 4).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=(0.1 if s.training else 0.0) if s.tied else 0.1)
        return a.transpose(1, 2).reshape(len(x), -1, 8)


@pytest.mark.parametrize("tied", [False, True])
def test_attention_dropout_p_passed_as_is_stays_on_in_eval(tied):
    """F.scaled_dot_product_attention(q, k, v, dropout_p=0.1) has no training argument: passed as is, attention
    dropout stays on after model.eval() (a protein encoder's evaluation was random). Missed; tied to the mode, clean."""
    torch.manual_seed(0)
    model = nn.Sequential(_SDPA(tied))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, live=False, checks="all") as g:
        for _ in range(3):
            loss = model(torch.randn(2, 5, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            model(torch.randn(2, 5, 8))
    if tied:
        assert g.findings == [] and g.internal_errors == []
        return
    f = only(g, "dropout-in-eval")
    assert (f.where, f.step) == ("0", 3) and f.details["function"] == "F.scaled_dot_product_attention"
    assert "dropout_p=(0.1 if self.training else 0.0)" in f.hint and f.source == line_of(_SDPA, "dropout_p=(0.1")


def test_dropout_in_a_helper_called_from_forward_is_found_in_global_mode_too():
    model = nn.Sequential(Block("helper"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(live=False) as g:
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    f = only(g, "dropout-in-eval")
    assert f.where == "0" and "F.dropout1d" in f.message and f.source == line_of(Block, "F.dropout1d(")


@pytest.mark.parametrize("functional", ["module", "positional"])
def test_dropout_modules_and_training_passed_positionally_are_silent(functional):
    g = _loop(nn.Sequential(Block(functional)), {})
    assert "dropout-in-eval" not in kinds(g)


def test_monte_carlo_dropout_and_attention_dropout_in_eval_are_silent():
    g = _loop(nn.Sequential(Block("module")), {}, mc=True)
    assert "dropout-in-eval" not in kinds(g)
    mha = nn.MultiheadAttention(8, 2, dropout=0.1, batch_first=True)  # torch calls dropout() without training=
    opt = torch.optim.SGD(mha.parameters(), lr=0.01)
    with guard(mha, opt, live=False) as g:
        x = torch.randn(2, 5, 8)
        out, _ = mha(x, x, x, need_weights=True)
        out.sum().backward()
        opt.step()
    assert "dropout-in-eval" not in kinds(g)


def _block(lin, x, p, training=True):
    return F.dropout(F.relu(lin(x)), p, training=training)


class HelperNet(nn.Module):
    """Dropout through a helper whose `training` defaults to True."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x):
        if self.how == "forgot":
            return self.l2(_block(self.l1, x, 0.3))
        if self.how == "forgot-named":  # a word like `x_train` on the line is no mode passed
            x_train = x
            return self.l2(_block(self.l1, x_train, 0.3))
        if self.how == "mc":  # Monte Carlo dropout on purpose
            return self.l2(_block(self.l1, x, 0.3, training=True))
        return self.l2(_block(self.l1, x, 0.3, self.training))


@pytest.mark.parametrize("how", ["forgot", "forgot-named", "mc", "passed"])
@pytest.mark.parametrize("mode", ["model", "global"])
def test_dropout_on_through_a_helpers_default_in_eval_is_found(how, mode):
    """`def block(lin, x, p, training=True)` called from forward without the mode: dropout stays on in eval.
    A forward that passes its mode, or training=True on purpose (Monte Carlo dropout), is silent."""
    torch.manual_seed(0)
    model = HelperNet(how)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with guard(*([model, opt] if mode == "model" else []), live=False, checks="all") as g:
        for _ in range(3):
            model.train()
            opt.zero_grad()
            F.cross_entropy(model(torch.randn(16, 8)), torch.randint(0, 3, (16,))).backward()
            opt.step()
            model.eval()
            with torch.no_grad():
                model(torch.ones(1, 8))
    if not how.startswith("forgot"):
        assert g.findings == []
        return
    f = only(g, "dropout-in-eval")
    assert f.where == "HelperNet"
    line = "_block(self.l1, x, 0.3))" if how == "forgot" else "_block(self.l1, x_train, 0.3))"
    assert f.source == line_of(HelperNet, line) and f.step == 1
    assert "_block()" in f.message and "the helper's default" in f.message
    assert "training=self.training" in f.hint and f.details["helper"] == "_block"


def test_dropout_outside_a_forward_is_not_this_checks_pattern():
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, live=False) as g:
        F.dropout(model(torch.randn(4, 8)), 0.5).sum().backward()  # in the loop, not in a module's forward
        opt.step()
    assert "dropout-in-eval" not in kinds(g)


# --------------------------------------------------------------------------- unshuffled-labels

def test_unshuffled_labels_demo_names_loader_and_evidence_and_twin_is_clean():
    g = unshuffled_labels.train(live=False)
    f = only(g, "unshuffled-labels")
    src = line_of(unshuffled_labels, "for x, y in train_loader:")
    assert f.severity == "warning" and f.where == "train_loader" and f.step == 0 and f.source == src
    assert f.message.startswith(f"`train_loader` (iterated at {src}) gives training batches that each hold one class")
    assert "5 of the first 5 batches hold a single class" in f.message and "shuffle=False" in f.message
    assert f.details["classes_filling_batches"] == [0, 1] and "shuffle=True" in f.hint
    assert kinds(g) == ["unshuffled-labels"]
    assert unshuffled_labels.train(fixed=True, epochs=2, checks="all", live=False).findings == []


def _sorted(n_per=32, classes=4, dim=6):
    y = torch.arange(classes).repeat_interleave(n_per)
    return torch.randn(len(y), dim), y


def _fit(loader, steps=None, backward=True, target=lambda y: y, classes=4):
    model = nn.Linear(6, classes)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, live=False) as g:
        for i, (x, y, *_) in enumerate(loader):
            out = model(x)
            if backward:
                loss = F.cross_entropy(out, target(y)) if y.dtype == torch.int64 else F.mse_loss(out[:, 0], y)
                opt.zero_grad()
                loss.backward()
                opt.step()
    return g


def test_unshuffled_sorted_labels_found_through_a_dict_batch():
    x, y = _sorted()

    class DictData(torch.utils.data.Dataset):
        def __len__(self):
            return len(y)

        def __getitem__(self, i):
            return {"x": x[i], "label": y[i]}

    model = nn.Linear(6, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(live=False) as g:
        for batch in DataLoader(DictData(), batch_size=8):
            F.cross_entropy(model(batch["x"]), batch["label"]).backward()
            opt.step()
            opt.zero_grad()
    f = only(g, "unshuffled-labels")
    assert f.where == "DataLoader" and f.details["single_class_batches"] == f.details["batches"] == 5


def test_small_batches_of_data_in_random_order_are_not_taken_for_sorting():
    """Batches of 2 from two balanced classes in random order hold one class half of the time: 3 of the first
    4 doing so is chance (about a third of such runs), not a sorted dataset. Sorted, the same loader is found."""
    for seed in range(12):
        gen = torch.Generator().manual_seed(seed)
        y = torch.randint(0, 2, (200,), generator=gen)
        g = _fit(DataLoader(TensorDataset(torch.randn(200, 6, generator=gen), y), batch_size=2), classes=2)
        assert "unshuffled-labels" not in kinds(g), (seed, g.findings)
    y_sorted = torch.arange(2).repeat_interleave(100)
    f = only(_fit(DataLoader(TensorDataset(torch.randn(200, 6), y_sorted), batch_size=2), classes=2),
             "unshuffled-labels")
    # found once the second class has filled a few batches (the frequencies are those seen so far)
    assert f.step == 0 and 50 < f.details["batches"] <= 64 and 0.5 <= f.details["chance_single_class"] < 1


def test_a_small_sorted_dataset_with_some_two_class_batches_is_found():
    """128 samples of 4 classes (17/30/34/47) sorted, batch 16: 5 of 8 batches hold one class, the others two:
    impossible by chance, although not three quarters single-class."""
    y = torch.cat([torch.full((n,), c) for c, n in enumerate((17, 30, 34, 47))])
    g = _fit(DataLoader(TensorDataset(torch.randn(128, 6), y), batch_size=16))
    f = only(g, "unshuffled-labels")
    assert f.step == 0 and "shuffle=True" in f.hint


def test_sorted_labels_found_when_they_come_last_after_categorical_and_continuous_features():
    """Tabular (cat, cont, y) batches: the label is the tensor the loss takes as its target, wherever it sits."""
    torch.manual_seed(0)
    x, y = _sorted()
    cat = torch.randint(0, 5, (len(y),))
    model = nn.Linear(6, 4)
    emb = nn.Embedding(5, 6)
    opt = torch.optim.SGD(list(model.parameters()) + list(emb.parameters()), lr=0.01)
    with guard(model, opt, live=False) as g:
        for c, cont, target in DataLoader(TensorDataset(cat, x, y), batch_size=8):
            loss = F.cross_entropy(model(cont + emb(c)), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = only(g, "unshuffled-labels")
    assert f.step == 0 and "shuffle=True" in f.hint


@pytest.mark.parametrize("form", ["dataclass", "batch-encoding"])
def test_sorted_labels_found_in_a_dataclass_or_batchencoding_batch(form):
    import dataclasses

    x, y = _sorted()

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        labels: torch.Tensor

    if form == "dataclass":
        def collate(items):
            return Batch(torch.stack([a for a, _ in items]), torch.stack([b for _, b in items]))
    else:
        from transformers import BatchEncoding

        def collate(items):
            return BatchEncoding({"x": torch.stack([a for a, _ in items]), "labels": torch.stack([b for _, b in items])})

    model = nn.Linear(6, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, live=False) as g:
        for batch in DataLoader(TensorDataset(x, y), batch_size=8, collate_fn=collate):
            xb, yb = (batch.x, batch.labels) if form == "dataclass" else (batch["x"], batch["labels"])
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
    f = only(g, "unshuffled-labels")
    assert f.step == 0 and f.details["single_class_batches"] == f.details["batches"]


def test_a_binary_dataset_sorted_by_label_is_found_through_bce():
    x = torch.randn(64, 6)
    y = torch.cat([torch.zeros(32), torch.ones(32)]).long()  # all negatives, then all positives
    model = nn.Linear(6, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, live=False) as g:
        for xb, yb in DataLoader(TensorDataset(x, y), batch_size=8):
            opt.zero_grad()
            F.binary_cross_entropy_with_logits(model(xb).squeeze(1), yb.float()).backward()
            opt.step()
    assert only(g, "unshuffled-labels").details["classes_filling_batches"] == [0, 1]


@pytest.mark.parametrize("labels", ["sorted 0/1", "sorted, as indices", "soft", "time-ordered clicks"])
def test_float_binary_labels_of_a_sorted_dataset_are_found(labels):
    """positives.fa then negatives.fa, shuffle=False, float 0/1 targets for BCE (or turned into class indices with
    .long() for cross_entropy): missed, since only integer labels were looked at. Soft targets (probabilities) are
    no classes, and time-ordered clicks at a 3% rate are imbalance, not sorting."""
    torch.manual_seed(0)
    if labels == "soft":
        y = torch.cat([torch.full((96,), 0.9), torch.full((96,), 0.1)])
    elif labels == "time-ordered clicks":
        y = (torch.rand(192) < 0.03).float()
    else:
        y = torch.cat([torch.ones(96), torch.zeros(96)])
    model = nn.Linear(6, 2 if labels == "sorted, as indices" else 1)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with guard(model, opt, live=False) as g:
        for x, t in DataLoader(TensorDataset(torch.randn(192, 6), y), batch_size=16):
            out = model(x)
            if labels == "sorted, as indices":
                loss = F.cross_entropy(out, t.long())
            else:
                loss = F.binary_cross_entropy_with_logits(out.squeeze(1), t)
            opt.zero_grad()
            loss.backward()
            opt.step()
    if labels.startswith("sorted"):
        f = only(g, "unshuffled-labels")
        assert f.step == 0 and f.details["classes_filling_batches"] == [1, 0]
    else:
        assert g.findings == [], g.findings


def test_lengths_in_the_labels_place_of_a_length_sorted_ctc_loader_are_no_labels():
    # SortaGrad: the first epoch sorted by length; batches (x, input_lengths, targets, target_lengths).
    torch.manual_seed(0)
    lengths = torch.arange(40) // 8 + 6  # 8 sequences of each length
    xs = torch.randn(40, 10, 4)
    ds = TensorDataset(xs, lengths, torch.randint(1, 5, (40, 3)), torch.full((40,), 3))
    model = nn.Linear(4, 5)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, live=False) as g:
        for x, in_len, tgt, tgt_len in DataLoader(ds, batch_size=8):
            log_probs = model(x).log_softmax(-1).transpose(0, 1)  # [T, N, C]
            opt.zero_grad()
            F.ctc_loss(log_probs, tgt, in_len, tgt_len).backward()
            opt.step()
    assert "unshuffled-labels" not in kinds(g)


def test_unshuffled_sorted_labels_found_beside_a_third_tensor():
    x, y = _sorted()
    f = only(_fit(DataLoader(TensorDataset(x, y, torch.arange(len(y))), batch_size=8)), "unshuffled-labels")
    assert f.details["single_class_batches"] == f.details["batches"]


@pytest.mark.parametrize("case", ["shuffled", "sampler", "batch1", "validation", "imbalanced", "float-targets",
                                  "series-ids", "length-buckets"])
def test_unshuffled_labels_healthy_patterns_are_silent(case):
    x, y = _sorted()
    ds = TensorDataset(x, y)
    if case == "shuffled":
        loader = DataLoader(ds, batch_size=8, shuffle=True)
    elif case == "sampler":
        loader = DataLoader(ds, batch_size=8, sampler=WeightedRandomSampler(torch.ones(len(y)), len(y)))
    elif case == "batch1":
        loader = DataLoader(ds, batch_size=1)
    elif case == "validation":  # sorted and unshuffled, but no backward: evaluation
        assert "unshuffled-labels" not in kinds(_fit(DataLoader(ds, batch_size=8), backward=False))
        return
    elif case == "imbalanced":  # in random order, 97% one class: single-class batches of one class only
        y = (torch.rand(len(y)) < 0.03).long()
        loader = DataLoader(TensorDataset(x, y), batch_size=8)
    elif case == "float-targets":  # a time series in time order: float targets, not classes
        loader = DataLoader(TensorDataset(x, torch.linspace(0, 1, len(y))), batch_size=8)
    elif case == "series-ids":  # windows of 4 series in time order: the series id is no label
        loader = DataLoader(TensorDataset(x, torch.linspace(0, 1, len(y)), y.clone()), batch_size=8)
    else:  # a tagger's batches bucketed by length: (tokens, per-token tags, lengths); the tags are 2-d
        tags = torch.randint(0, 4, (len(y), 5))
        loader = DataLoader(TensorDataset(x, tags, y.clone()), batch_size=8)
        model = nn.Linear(6, 20)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with guard(live=False) as g:
            for xb, tb, _ in loader:
                F.cross_entropy(model(xb).view(-1, 4, 5), tb).backward()
                opt.step()
                opt.zero_grad()
        assert "unshuffled-labels" not in kinds(g)
        return
    assert "unshuffled-labels" not in kinds(_fit(loader))


# --------------------------------------------------------------------------- clip-before-unscale

def test_clip_before_unscale_demo_and_twin():
    g = clip_before_unscale.train(live=False)
    f = only(g, "clip-before-unscale")
    src = line_of(clip_before_unscale, "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)")
    assert f.severity == "error" and f.where == "clip_grad_norm_" and f.step == 0 and f.source == src
    assert f.details["scale"] == 65536.0 and f.details["max_norm"] == 1.0
    assert "scaler.unscale_(optimizer)" in f.hint and f.count == 6
    assert kinds(g) == ["clip-before-unscale"]
    assert clip_before_unscale.train(fixed=True, checks="all", live=False).findings == []


def _amp(clip, unscale=True, enabled=True, steps=3, mode="warn"):
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    head = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    opt2 = torch.optim.SGD(head.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", enabled=enabled)
    with guard(live=False, mode=mode) as g:
        for _ in range(steps):
            loss = head(model(torch.randn(4, 8))).pow(2).mean()
            opt.zero_grad()
            opt2.zero_grad()
            scaler.scale(loss).backward()
            if unscale:
                scaler.unscale_(opt)
            clip(model, head)
            scaler.step(opt)
            scaler.step(opt2)
            scaler.update()
    return g


def test_clip_value_of_a_list_with_a_parameter_of_an_optimizer_not_unscaled():
    g = _amp(lambda m, h: nn.utils.clip_grad_value_(list(m.parameters()) + list(h.parameters()), 0.5))
    f = only(g, "clip-before-unscale")
    assert f.where == "clip_grad_value_" and f.details["clip_value"] == 0.5
    assert f.details["parameters"] == ["weight", "bias"]  # the head's (global mode: its own root)


def test_clip_before_unscale_raises_in_raise_mode():
    from guard import GuardError

    with pytest.raises(GuardError, match="clip-before-unscale"):
        _amp(lambda m, h: nn.utils.clip_grad_norm_(m.parameters(), 1.0), unscale=False, mode="raise")


@pytest.mark.parametrize("case", ["documented-order", "no-scaler", "disabled-scaler"])
def test_clip_before_unscale_healthy_patterns_are_silent(case):
    clip = lambda m, h: nn.utils.clip_grad_norm_(m.parameters(), 1.0)  # noqa: E731
    if case == "documented-order":
        g = _amp(clip)
    elif case == "disabled-scaler":
        g = _amp(clip, unscale=False, enabled=False)
    else:
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with guard(model, opt, live=False) as g:
            model(torch.randn(3, 4)).sum().backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    assert g.findings == []


# --------------------------------------------------------------------------- params-not-updating

def test_params_not_updating_demo_names_lr_and_step_and_twin_is_clean():
    g = params_not_updating.train(live=False)
    f = only(g, "params-not-updating")
    assert f.severity == "warning" and f.where == "Sequential" and f.step == 10
    assert "lr=0" in f.message and "since step 10" in f.message and "scheduler" in f.message
    assert f.source == line_of(params_not_updating, "optimizer.step()")
    assert f.details["lr"] == 0.0 and f.details["steps"] == 20
    assert kinds(g) == ["params-not-updating"]
    assert params_not_updating.train(fixed=True, checks="all", live=False).findings == []


def _steps(model, opt, n, sched=None, scaler=None, skip=None):
    with guard(model, opt, live=False, checks="all") as g:
        for i in range(n):
            x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            if scaler is not None:
                scaler.scale(loss).backward()
                if skip(i):  # an fp16 overflow: the scaler skips this step
                    next(model.parameters()).grad[0, 0] = float("inf")
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            if sched is not None:
                sched.step()
    return g


def test_lr_zero_typo_names_the_group():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.Adam([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0}],
                           lr=1e-3)
    g = _steps(model, opt, 25)
    f = only(g, "params-not-updating")
    assert f.where == "2" and f.step == 0 and f.details["group"] == 1 and "param group 1 of Adam" in f.message
    # a group set to 0 by hand beside one that trains is told as the run ends, still at 0
    assert f.details["whole_run"] is True and f.details["steps"] == 25 and "to the end of the run" in f.message


def test_a_group_frozen_by_hand_then_given_its_lr_is_a_staged_start():
    """LSQ step sizes (or a backbone) held at lr=0 by hand while the rest warms up, then given a rate by
    setting param_groups[1]["lr"]: no lr=0 typo, nothing to tell."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.0}],
                          lr=0.05, momentum=0.9)
    with guard(model, opt, live=False, checks="all") as g:
        for i in range(60):
            if i == 40:
                opt.param_groups[1]["lr"] = 0.01
            x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    assert g.findings == [] and g.internal_errors == []


@pytest.mark.parametrize("comes_back", [True, False])
def test_a_group_a_lambdalr_holds_at_zero_for_a_while_is_a_delayed_start(comes_back):
    """A backbone group whose LambdaLR factor is 0 for its first 30 steps (the head warms up first) is no
    lr=0 bug; a factor that stays 0 is one."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[2].parameters()}], lr=0.05)
    later = (lambda s: 0.0 if s < 30 else 1.0) if comes_back else (lambda s: 0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [later, lambda s: 1.0])
    g = _steps(model, opt, 45, sched=sched)
    if comes_back:
        assert g.findings == [] and g.internal_errors == []
    else:
        f = only(g, "params-not-updating")
        assert f.where == "0" and f.details["group"] == 0 and "lr=0" in f.message


def test_optimizer_over_another_copy_of_the_model():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(copy.deepcopy(model).parameters(), lr=0.1)
    before = [p.clone() for p in model.parameters()]
    g = _steps(model, opt, 22)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    f = only(g, "params-not-updating")
    assert f.where == "Sequential" and "another copy" in f.message and f.details["with_grad"] == 4
    assert "param-not-in-optimizer" in kinds(g)  # that check names the parameters


def test_per_epoch_scheduler_stepped_every_batch_drives_lr_below_float_resolution():
    """StepLR(step_size=10, gamma=0.1) meant per epoch, stepped per batch: after 120 batches lr is 1e-13, the
    gradients are non-zero and nothing moves; the finding says so from the first step below TINY_LR on."""
    from guard.checks.params_not_updating import TINY_LR

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 10, 0.1)
    g = _steps(model, opt, 160, sched=sched)
    f = only(g, "params-not-updating")
    first_tiny = next(s for s in range(160) if 0.01 * 0.1 ** (s // 10) <= TINY_LR)
    assert f.where == "Sequential" and f.step == first_tiny and f.details["steps"] >= 20
    assert 0 < f.details["lr"] <= TINY_LR and "down from 1.0e-02" in f.message
    assert "below float32's resolution" in f.message and "once per batch" in f.hint


@pytest.mark.parametrize("case", ["warmup-from-0", "cosine-end", "frozen", "scaler-skipped"])
def test_params_not_updating_healthy_patterns_are_silent(case):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if case == "warmup-from-0":
        g = _steps(model, opt, 30, sched=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 5)))
    elif case == "cosine-end":
        g = _steps(model, opt, 30, sched=torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=29))
    elif case == "frozen":
        model[0].requires_grad_(False)
        opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.0}, {"params": model[2].parameters()}],
                              lr=0.1)
        g = _steps(model, opt, 30)
    else:
        g = _steps(model, opt, 30, scaler=torch.amp.GradScaler("cpu"),
                   skip=lambda i: i % 3 == 0)
    assert [f for f in g.findings if f.severity != "info"] == []


# --------------------------------------------------------------------------- vanishing-gradients

def test_vanishing_gradients_demo_names_first_and_last_layer_and_twin_is_clean():
    g = vanishing_gradients.train(live=False)
    f = only(g, "vanishing-gradients")
    assert f.severity == "warning" and f.where == "0" and f.step == 0
    assert f.details["last"] == "17" and f.details["ratio"] < 1e-5 and f.details["sampled_every"] == 5
    assert "first layer 0" in f.message and "last layer 17" in f.message and "residual" in f.hint
    assert f.source == line_of(vanishing_gradients, "optimizer.step()")
    assert kinds(g) == ["vanishing-gradients"]
    assert vanishing_gradients.train(fixed=True, checks="all", live=False).findings == []


def test_first_layers_cut_off_by_round_get_the_straight_through_fix():
    """torch.round between encoder and decoder without a straight-through estimator: the encoder's gradients are
    exactly 0 (no saturating layer anywhere). Told as a cut path, with the straight-through fix."""
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
    dec = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 20))
    model = nn.Sequential(enc, dec)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    with guard(model, opt, live=False) as g:
        for _ in range(40):
            x = torch.randn(50, 20)
            q = torch.round(enc(x) * 2)  # the bug: z + (torch.round(z) - z).detach()
            loss = F.mse_loss(dec(q), x)
            opt.zero_grad(); loss.backward(); opt.step()
    f = only(g, "vanishing-gradients")
    assert (f.where, f.step) == ("0.0", 0) and f.details["cut"] and f.details["ratio"] == 0.0
    assert "exactly 0" in f.message and "torch.round" in f.message
    assert "z + (torch.round(z) - z).detach()" in f.hint and "sigmoid" not in f.hint


def test_a_first_layer_applied_to_zeros_is_no_cut_path():
    """Unrolled ISTA (LISTA) starts from x0 = 0: the first S layer's weight gradient is exactly 0 by construction,
    while the next layer's is not. No cut, no vanishing: silent (the layers after it are paired instead)."""

    class Unrolled(nn.Module):
        def __init__(self, k=4, n=16, m=8):
            super().__init__()
            self.We = nn.ModuleList([nn.Linear(m, n, bias=False) for _ in range(k)])
            self.S = nn.ModuleList([nn.Linear(n, n, bias=False) for _ in range(k)])
            self.n = n

        def forward(self, y):
            x = torch.zeros(y.shape[0], self.n)
            for We, S in zip(self.We, self.S):
                x = F.softshrink(S(x) + We(y), 0.05)
            return x

    torch.manual_seed(0)
    model = Unrolled()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    A = torch.randn(8, 16) / 8 ** 0.5
    with guard(model, opt, live=False) as g:
        for _ in range(60):
            x = torch.randn(32, 16) * (torch.rand(32, 16) < 0.2)
            loss = F.mse_loss(model(x @ A.t()), x)
            opt.zero_grad(); loss.backward(); opt.step()
    assert g.findings == []


class EmbedNet(nn.Module):
    """A pretrained embedding with tiny gradients (scaled down on the way back) before a healthy MLP."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 16)
        self.mlp = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(16, 16), nn.ReLU())], nn.Linear(16, 2))

    def forward(self, idx):
        e = self.emb(idx).mean(1)
        return self.mlp(e.detach() + (e - e.detach()) * 1e-7)  # same values; the embedding's gradient x 1e-7


def test_two_models_under_one_grad_scaler_are_not_one_stack_of_layers():
    # The AMP docs' recipe for several models: model0's first layer was paired with model1's last, whose
    # gradients were still scaled (x65536) when model0's were unscaled: "5.6e-06x", on a healthy run.
    torch.manual_seed(0)
    model0, model1 = (nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4)) for _ in range(2))
    opt0, opt1 = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (model0, model1))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=10 ** 6)
    with guard([model0, model1], [opt0, opt1], live=False) as g:
        for _ in range(25):
            x, y = torch.randn(16, 10), torch.randint(0, 4, (16,))
            opt0.zero_grad()
            opt1.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model0(x) + model1(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt0)
            torch.nn.utils.clip_grad_norm_(model0.parameters(), 1.0)
            scaler.step(opt0)
            scaler.step(opt1)
            scaler.update()
    assert g.findings == [] and g.internal_errors == []


@pytest.mark.parametrize("case", ["frozen-early", "embedding"])
def test_vanishing_gradients_healthy_patterns_are_silent(case):
    if case == "frozen-early":  # a sigmoid stack whose early (vanishing) layers are frozen on purpose
        layers = [m for _ in range(14) for m in (nn.Linear(16, 16), nn.Sigmoid())]
        model = nn.Sequential(nn.Linear(4, 16), *layers, nn.Linear(16, 2))
        for m in model[:-4]:
            m.requires_grad_(False)
        make = lambda: torch.randn(8, 4)  # noqa: E731
    else:
        model = EmbedNet()
        make = lambda: torch.randint(0, 100, (8, 5))  # noqa: E731
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with guard(model, opt, live=False) as g:
        for _ in range(25):
            loss = F.cross_entropy(model(make()), torch.randint(0, 2, (8,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert "vanishing-gradients" not in kinds(g)


# --------------------------------------------------------------------------- grads-all-zero, loss-constant

def test_loss_constant_demo_at_the_loss_line_and_grads_all_zero_names_the_cause():
    g = loss_constant.train(live=False)
    assert kinds(g) == ["loss-constant", "grads-all-zero"]
    lc, gz = g.findings
    src = line_of(loss_constant, "loss = F.cross_entropy(out, y)")
    assert lc.severity == "error" and lc.where == "loss" and lc.step == 0 and lc.source == src
    assert "single class (C = 1)" in lc.message and lc.details["input_shape"] == [32, 1]
    assert "binary_cross_entropy_with_logits" in lc.hint
    assert gz.severity == "warning" and gz.details["cause"] == "loss-constant" and src in gz.message
    assert loss_constant.train(fixed=True, checks="all", live=False).findings == []


def test_in_batch_negatives_with_a_last_batch_of_one_are_no_constant_loss():
    # CLIP-style: logits [N, N] against arange(N). 65 samples in batches of 16 leave a last batch of one:
    # cross_entropy over [1, 1] once, which is no head built with a single class.
    torch.manual_seed(0)
    enc = nn.Linear(6, 4)
    opt = torch.optim.Adam(enc.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(65, 6), torch.randn(65, 6))
    with guard(enc, opt, live=False) as g:
        for a, b in DataLoader(data, batch_size=16):
            logits = F.normalize(enc(a), dim=1) @ F.normalize(enc(b), dim=1).T / 0.1
            target = torch.arange(len(a))
            opt.zero_grad()
            ((F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2).backward()
            opt.step()
    assert "loss-constant" not in kinds(g), g.findings


def test_grads_all_zero_demo_and_twin():
    g = grads_all_zero.train(live=False)
    f = only(g, "grads-all-zero")
    assert f.severity == "warning" and f.where == "loss" and f.step == 0 and f.details["steps"] == 5
    assert f.last_step == g.step - 1 and f.count == g.step - 4  # since step 0, seen again at every later step
    assert f.source == line_of(grads_all_zero, "optimizer.step()") and "round" in f.hint
    assert kinds(g) == ["grads-all-zero"]
    assert grads_all_zero.train(fixed=True, checks="all", live=False).findings == []


def test_episodes_without_reward_are_no_stopped_training():
    # Vanilla REINFORCE: an unrewarded episode's loss is exactly 0, and so is every gradient; learning
    # resumes with the next reward. Zero gradients of a zero loss are no sign that training stopped.
    from torch.distributions import Categorical

    torch.manual_seed(0)
    policy = nn.Linear(4, 3)
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)
    with guard(policy, opt, live=False) as g:
        for reward in [1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 1]:
            dist = Categorical(logits=policy(torch.randn(4)))
            loss = -(dist.log_prob(dist.sample()) * reward)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert g.findings == []


def test_grads_all_zero_is_no_longer_a_grad_explosion_and_interrupted_runs_are_silent():
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, live=False) as g:
        for i in range(12):
            out = model(torch.randn(8, 4))
            loss = (out * (i % 4 == 3)).mean()  # zero gradients 3 steps in 4: training goes on
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert g.findings == []


def test_loss_constant_raises_in_raise_mode_before_the_step():
    from guard import GuardError

    model = nn.Linear(4, 1)
    with guard(model, live=False, mode="raise"):
        with pytest.raises(GuardError, match="loss-constant"):
            nn.CrossEntropyLoss()(model(torch.randn(8, 4)), torch.zeros(8, dtype=torch.long))


def test_an_optimizer_over_an_input_image_is_no_copy_of_the_model():
    """Style transfer with the feature net left trainable (older tutorial): param-not-in-optimizer says so; no
    'optimizer built over another copy of the model', since the optimizer holds a plain image tensor."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    image = torch.rand(1, 3, 16, 16, requires_grad=True)
    opt = torch.optim.Adam([image], lr=0.01)
    target = torch.rand(1, 4, 14, 14)
    with guard(net, opt, live=False) as g:
        for _ in range(30):
            loss = F.mse_loss(net(image), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert "params-not-updating" not in kinds(g), g.findings
    f = only(g, "param-not-in-optimizer")  # (and input-not-normalized: [0, 1] images into a conv)
    assert "requires_grad=False" in f.hint


class _FunctionalDropoutBlock(nn.Module):
    """Dropout as HF's BART/OPT/Whisper write it: F.dropout(x, p, training=self.training), no nn.Dropout."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.p = nn.Linear(8, 32), nn.Linear(32, 3), 0.3

    def forward(self, x):
        return self.l2(nn.functional.dropout(torch.relu(self.l1(x)), p=self.p, training=self.training))


def _functional_dropout_run(bug):
    torch.manual_seed(0)
    m = _FunctionalDropoutBlock()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    with guard(m, opt, live=False, checks="all") as g:
        for step in range(12):
            if step == 3:
                if bug == "train-mode-eval":
                    with torch.no_grad():
                        m(x[:8])  # evaluation with the model still in training mode
                else:
                    m.eval()
                    with torch.no_grad():
                        m(x[:8])
                    if bug != "eval-mode-train":
                        m.train()
            loss = nn.functional.cross_entropy(m(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return g


@pytest.mark.parametrize("bug, kind, step", [("eval-mode-train", "train-in-eval-mode", 3),
                                             ("train-mode-eval", "eval-in-train-mode", 3)])
def test_functional_dropout_that_follows_the_module_mode_counts_for_the_mode_checks(bug, kind, step):
    g = _functional_dropout_run(bug)
    assert [(f.kind, f.where, f.step) for f in g.findings] == [(kind, "_FunctionalDropoutBlock", step)]
    f = g.findings[0]
    assert f.details["types"] == ["functional Dropout"]
    assert "(F.dropout at " in f.details["modules"][0] and "test_silent_bugs.py:" in f.details["modules"][0]
    assert "dropout" in f.message


def test_functional_dropout_with_the_modes_switched_properly_is_clean():
    g = _functional_dropout_run("none")
    assert g.findings == [] and g.internal_errors == []


def test_gradients_shrunk_below_float32_squares_are_told_apart_from_exact_zeros():
    """A scaling hook registered inside the loop: hooks pile up and the gradients shrink by 2x per step, until
    their norms underflow (the values themselves are still ~1e-23, not 0)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
    with guard(model, opt, live=False) as g:
        for _ in range(90):
            for p in model.parameters():
                p.register_hook(lambda gr: gr * 0.5)  # the bug: one more hook every step
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = only(g, "grads-all-zero")
    assert f.details["underflow"] is True and "not all 0" in f.message and "register hooks once" in f.hint


@pytest.mark.parametrize("main_trains", [True, False])
def test_grads_all_zero_is_the_whole_training_stopping_not_a_finished_phase(main_trains):
    """A domain head trained for its first phase keeps being stepped over zeroed gradients (set_to_none=False)
    while the main model's optimizer trains: no stop. When every optimizer's gradients are zero, it is one."""
    torch.manual_seed(0)
    net, head = nn.Linear(10, 3), nn.Linear(10, 1)
    opt = torch.optim.Adam(net.parameters(), 1e-2)
    opt_h = torch.optim.SGD(head.parameters(), 1e-2)
    x, y, d = torch.randn(64, 10), torch.randint(0, 3, (64,)), torch.rand(64, 1).round()
    with guard([net, head], [opt, opt_h], live=False) as g:
        for it in range(30):
            out = net(x)
            loss = F.cross_entropy(out if main_trains or it < 10 else out.detach().requires_grad_(), y)
            if it < 10:
                loss = loss + F.binary_cross_entropy_with_logits(head(x), d)
            opt.zero_grad(set_to_none=False)
            opt_h.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
            opt_h.step()
    if main_trains:
        assert "grads-all-zero" not in kinds(g), g.findings
    else:
        f = only(g, "grads-all-zero")
        assert f.step == 10 and "training has stopped" in f.message


@pytest.mark.parametrize("case", ["warm-up", "dead"])
def test_zero_gradients_a_backward_reaches_beside_a_training_optimizer_are_judged_when_they_end(case):
    """Center loss weighted 0 for a warm-up: the centers' own optimizer gets exact zeros for 8 steps, then signal:
    it was waiting. A decoder behind a clamp its output has passed gets zeros to the end while the codes' optimizer
    trains: that part stopped learning, told as the run ends."""
    torch.manual_seed(0)
    net = nn.Linear(8, 3)
    centers = nn.Parameter(torch.randn(3, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    opt_c = torch.optim.SGD([centers], lr=0.5)
    with guard([net], [opt, opt_c], live=False) as g:
        for step in range(16):
            y = torch.randint(0, 3, (16,))
            f = net(torch.randn(16, 8))
            if case == "warm-up":
                lam = 0.0 if step < 8 else 0.01
                loss = F.cross_entropy(f, y) + lam * (f - centers[y]).pow(2).sum(1).mean()
            else:
                loss = F.cross_entropy(f, y) + (centers[y] + 5.0).clamp(max=0.1).sum() * 0.0 + \
                    (centers[y] * 0 + 1).clamp(max=0.5).sum()  # the clamp passes no gradient
            opt.zero_grad()
            opt_c.zero_grad()
            loss.backward()
            opt.step()
            opt_c.step()
    if case == "warm-up":
        assert "grads-all-zero" not in kinds(g), g.findings
    else:
        f = only(g, "grads-all-zero")
        assert f.step == 0 and f.details["beside_training"] is True and "to the end of the run" in f.message


@pytest.mark.parametrize("steps", [20, 45])
def test_a_lambdalr_warm_up_held_at_the_integer_zero_is_told(steps):
    """`LambdaLR(opt, lambda s: min(1.0, s // 30))`: an integer division keeps the factor 0 until step 30, so the
    warm-up trains nothing and the full rate then starts at once. Told at the 20th step, whether or not the run gets
    past step 30 (until stop 40 a run that did was silent), with the `s / warmup` fix."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s // 30))
    g = _steps(model, opt, steps, sched=sched)
    f = only(g, "params-not-updating")
    assert f.step == 0 and f.details["integer_division_until"] == 30 and not f.details["whole_run"]
    assert "held at lr=0 by its LambdaLR" in f.message and "integer 0 until the scheduler's step 30" in f.message
    assert "s / warmup" in f.hint


@pytest.mark.parametrize("steps", [20, 45])
def test_a_lambdalr_delayed_start_written_as_floats_waits_for_the_run_s_end(steps):
    """`0.0 if s < 30 else 1.0`: a delayed start written on purpose. A run of 20 steps ends before it: told when it
    ends, for the whole run. A run of 45 steps gets its start and is silent."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.0 if s < 30 else 1.0)
    g = _steps(model, opt, steps, sched=sched)
    if steps == 45:
        assert g.findings == [], g.findings
        return
    f = only(g, "params-not-updating")
    assert f.step == 0 and f.details["whole_run"] is True and "held at lr=0 by its LambdaLR" in f.message


class _Gated(nn.Module):
    """A generator's hard mask in front of an encoder: `(gen(x) > 0).float()` leaves the graph."""

    def __init__(self):
        super().__init__()
        self.gen1, self.gen2 = nn.Linear(16, 32), nn.Linear(32, 16)
        self.enc1, self.enc2 = nn.Linear(16, 32), nn.Linear(32, 2)

    def forward(self, x, gate=True):
        z = (self.gen2(torch.tanh(self.gen1(x))) > 0).float() if gate else 1.0
        return self.enc2(torch.tanh(self.enc1(x * z)))


def test_first_layers_behind_a_comparison_get_no_gradient_at_all():
    """The generator's layers sit before a comparison: their gradients are None, not 0 (the graph left there).
    Told as the cut, from step 0, `details.no_gradient`."""
    torch.manual_seed(0)
    model = _Gated()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    with guard(model, opt, live=False) as g:
        for _ in range(40):
            x = torch.randn(32, 16)
            loss = F.cross_entropy(model(x), (x[:, 0] > 0).long())
            opt.zero_grad(); loss.backward(); opt.step()
    f = only(g, "vanishing-gradients")
    assert (f.where, f.step) == ("gen1", 0) and f.details["no_gradient"] is True and "None" in f.message
    assert "a comparison" in f.message


class _Checkpointed(nn.Module):
    """Blocks run through torch.utils.checkpoint after a frozen embedding."""

    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.wte = nn.Embedding(20, 16).requires_grad_(False)
        self.h = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
        self.score = nn.Linear(16, 2)

    def forward(self, ids):
        x = self.wte(ids)
        for b in self.h:
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=self.reentrant)
        return self.score(x.mean(1))


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_reentrant_checkpoint_after_a_frozen_embedding_is_named_as_the_cut(reentrant):
    """checkpoint(block, x, use_reentrant=True) with x from a frozen embedding: the blocks' parameters get no gradient
    (torch only warns). Told as the checkpoint, with use_reentrant=False as the fix, not as round/argmax."""
    torch.manual_seed(0)
    model = _Checkpointed(reentrant)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    with guard(model, opt, live=False) as g, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own "None of the inputs have requires_grad=True"
        for _ in range(30):
            ids = torch.randint(0, 20, (8, 5))
            loss = F.cross_entropy(model(ids), (ids[:, 0] < 10).long())
            opt.zero_grad(); loss.backward(); opt.step()
    if not reentrant:
        assert g.findings == []
        return
    f = only(g, "vanishing-gradients")
    assert (f.where, f.step) == ("h.0.0", 0) and "use_reentrant=True" in f.message and "use_reentrant=False" in f.hint
    assert f.details["reentrant_checkpoint"].startswith("tests/test_silent_bugs.py:")


def test_a_first_layer_used_on_some_batches_only_is_no_cut():
    """A stem trained on some batches only (its branch chosen per batch, soft so that it passes gradient): at the
    sampled steps it may have no gradient, yet its weights move in between. Silent."""
    torch.manual_seed(0)

    class Soft(_Gated):
        def forward(self, x, gate=True):
            z = torch.sigmoid(self.gen2(torch.tanh(self.gen1(x)))) if gate else 1.0
            return self.enc2(torch.tanh(self.enc1(x * z)))

    model = Soft()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    with guard(model, opt, live=False) as g:
        for step in range(80):
            x = torch.randn(32, 16)
            gate = step % 5 != 0  # the sampled steps (every 5th) happen to run without the gate
            loss = F.cross_entropy(model(x, gate), (x[:, 0] > 0).long())
            opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
    assert g.findings == [], g.findings


@pytest.mark.parametrize("per_sample", [False, True])
def test_a_weighted_sampler_given_one_weight_per_class(per_sample):
    """`WeightedRandomSampler(class_w, num_samples=len(y))` with class_w of C entries draws indices from range(C)
    only: every batch is the dataset's first C samples (class 0 of a sorted dataset). Told at the loader's first
    iteration; one weight per sample (`class_w[y]`) is silent."""
    from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

    torch.manual_seed(0)
    counts = [120, 40, 10]
    x = torch.cat([torch.randn(n, 4) + k for k, n in enumerate(counts)])
    y = torch.cat([torch.full((n,), k, dtype=torch.long) for k, n in enumerate(counts)])
    class_w = 1.0 / torch.tensor(counts, dtype=torch.float)
    sampler = WeightedRandomSampler(class_w[y] if per_sample else class_w, num_samples=len(y), replacement=True)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, sampler=sampler, drop_last=True)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with guard(model, opt, live=False) as g:
        for xb, yb in loader:
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
    found = [f for f in g.findings if f.kind == "unshuffled-labels"]
    if per_sample:
        assert found == []
        return
    (f,) = found
    assert f.step == 0 and f.details == {"sampler": "WeightedRandomSampler", "weights": 3, "dataset": 170}
    assert "class_weights[labels]" in f.hint


@pytest.mark.parametrize("clip", ["norm", "value"])
def test_grads_all_zero_from_a_clip_to_zero_names_the_clip(clip):
    """A config's `clip=0.0`, meant as "no clipping", passed straight to clip_grad_norm_ (or clip_grad_value_):
    every gradient is scaled to 0 after backward(). The finding names the clip's line and argument, not the loss
    path; with clipping skipped when it is 0 nothing is told."""
    def run(skip_zero):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(20, 8), nn.ReLU(), nn.Linear(8, 20))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        cfg_clip = 0.0
        with guard(model, opt, live=False) as g:
            for _ in range(12):
                x = torch.rand(16, 20)
                loss = nn.functional.mse_loss(model(x), x)
                opt.zero_grad()
                loss.backward()
                if not skip_zero or cfg_clip > 0:
                    if clip == "norm":
                        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg_clip)
                    else:
                        torch.nn.utils.clip_grad_value_(model.parameters(), cfg_clip)
                opt.step()
        return g

    g = run(False)
    (f,) = g.findings
    assert (f.kind, f.where, f.step) == ("grads-all-zero", "loss", 0)
    fn = "clip_grad_norm_(max_norm=0)" if clip == "norm" else "clip_grad_value_(clip_value=0)"
    assert fn in f.message and f.details["cause"] == "clip_to_zero"
    assert f.details["cause_source"].endswith(str(_line_of_clip(clip)))
    assert "no clipping" in f.hint and "loss path" not in f.hint
    assert run(True).findings == []


def _line_of_clip(clip):
    import inspect
    src, start = inspect.getsourcelines(test_grads_all_zero_from_a_clip_to_zero_names_the_clip)
    needle = "clip_grad_norm_(model" if clip == "norm" else "clip_grad_value_(model"
    return start + next(i for i, line in enumerate(src) if needle in line)


# --------------------------------------------------------------------------- methods named, not called (stop 39)

def _beginner_loop(bug, scope="models", steps=12, full_batch=False):
    """A classic minibatch loop whose `loss.backward` or `opt.step` lost its parentheses (or neither did)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(256, 10), torch.randint(0, 3, (256,))
    before = [p.detach().clone() for p in model.parameters()]
    with guard(*((model, opt) if scope == "models" else ()), live=False) as g:
        for i in range(steps):
            s = slice(0, 256) if full_batch else slice(32 * (i % 8), 32 * (i % 8) + 32)
            opt.zero_grad()
            loss = F.cross_entropy(model(x[s]), y[s])
            loss.backward() if bug != "backward" else loss.backward  # noqa: B018
            opt.step() if bug != "step" else opt.step  # noqa: B018
    moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return g, moved


@pytest.mark.parametrize("scope", ["models", "global"])
def test_loss_backward_without_parentheses_is_told_as_nothing_trained(scope):
    g, moved = _beginner_loop("backward", scope)
    assert not moved
    (f,) = g.findings
    assert (f.kind, f.where, f.step) == ("grads-all-zero", "loss", 0) and f.details["no_backward"] is True
    assert "loss.backward()" in f.hint and "without parentheses" in f.hint
    assert _beginner_loop(None, scope)[0].findings == []


def test_an_lr_schedule_stepped_with_no_model_call_is_no_missing_backward():
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=50)
    lrs = []
    with guard(model, opt, live=False) as g:
        for _ in range(50):  # plotting the schedule: the optimizer steps over no gradient on purpose
            opt.step()
            sched.step()
            lrs.append(sched.get_last_lr()[0])
    assert g.findings == [] and max(lrs) > 0.09


@pytest.mark.parametrize("scope", ["models", "global"])
def test_optimizer_step_without_parentheses_is_told_when_no_optimizer_ever_steps(scope):
    g, moved = _beginner_loop("step", scope)
    assert not moved
    f = only(g, "params-not-updating")
    assert f.details["never_stepped"] is True and f.details["variable"] == "opt"
    assert "opt.step()" in f.hint and "`opt.step` without parentheses" in f.hint


def test_a_constant_loss_whose_weights_never_move_is_not_blamed_on_thresholds():
    g, moved = _beginner_loop("step", "global", steps=110, full_batch=True)
    assert not moved
    f = only(g, "loss-constant")
    assert f.details["why"] == "identical loss, outputs and weights" and "nothing updates the weights" in f.message
    assert "spiking" not in f.message and "p -= lr * p.grad" in f.hint


def test_a_transformer_s_first_attention_query_at_its_usual_init_is_not_taken_for_vanishing_gradients():
    """At HF's init (weights ~ N(0, 0.02)) the attention logits are near 0, and so are the query and key projections'
    gradients: layer 0's query was paired with the classifier and told as vanishing (6.7e-06x) until stop 41."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64,
        num_labels=2, max_position_embeddings=64))
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    ids = torch.randint(1, 100, (96, 16))
    y = ids[:, 3] % 2
    with guard(model, opt, live=False) as g:
        for _ in range(30):
            b = torch.randint(0, 96, (16,))
            model(input_ids=ids[b], labels=y[b]).loss.backward()
            opt.step()
            opt.zero_grad()
    assert [f for f in g.findings if f.kind == "vanishing-gradients"] == []


def test_layers_frozen_mid_run_with_their_zero_gradients_left_are_no_cut():
    """`requires_grad_(False)` at step 20 with zero_grad(set_to_none=False): the first layer keeps a zero gradient,
    which is no operation cutting the path (told as one, with the round/argmax hint, until stop 41)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(256, 8)
    y = (x[:, 0] > 0).long()
    with guard(model, opt, live=False) as g:
        for step in range(60):
            if step == 20:
                model[:6].requires_grad_(False)
            b = torch.randint(0, 256, (32,))
            loss = F.cross_entropy(model(x[b]), y[b])
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
    assert g.findings == []


@pytest.mark.parametrize("detach", [False, True])
def test_a_straight_through_round_without_detach_in_a_three_layer_net_is_a_cut(detach):
    """`x + (torch.round(x) - x)` has a zero derivative: no gradient reaches the first layers. A net of fewer than 4
    weight layers is looked at for such exact cuts (silent until stop 41); its small ratios are still not told."""
    class Q(nn.Module):
        def forward(self, x):
            return x + (torch.round(x) - x).detach() if detach else x + (torch.round(x) - x)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), Q(), nn.Linear(64, 64), nn.ReLU(), Q(), nn.Linear(64, 3))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    x = torch.randn(512, 16)
    y = x[:, :3].argmax(1)
    with guard(model, opt, live=False) as g:
        for _ in range(110):  # a shallow net is sampled every 25 steps: 4 samples
            i = torch.randint(0, 512, (64,))
            loss = F.cross_entropy(model(x[i]), y[i])
            opt.zero_grad()
            loss.backward()
            opt.step()
    found = [f for f in g.findings if f.kind == "vanishing-gradients"]
    if detach:
        assert g.findings == []
    else:
        [f] = found
        assert f.where == "0" and f.details["cut"] is True and f.details["layers"] == 3 and f.step == 0


class _Wrapper(nn.Module):
    """A DDP-like wrapper: the trained model is its `.module`."""

    def __init__(self, inner):
        super().__init__()
        self.module = inner

    def forward(self, x):
        return self.module(x)


@pytest.mark.parametrize("back_to_train", [False, True])
def test_a_wrapped_model_left_in_eval_mode_by_module_eval_is_trained_in_eval_mode(back_to_train):
    """DDP's idiom `model.module.eval()` for validation leaves the wrapper in training mode and the model in eval
    mode: training goes on with Dropout off (silent until stop 41: only the wrapper's mode was read)."""
    torch.manual_seed(0)
    model = _Wrapper(nn.Sequential(nn.Linear(5, 32), nn.Dropout(0.3), nn.ReLU(), nn.Linear(32, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(64, 5)
    y = (x[:, 0] > 0).long()
    with guard(model, opt, live=False) as g:
        for _ in range(3):
            if back_to_train:
                model.module.train()
            for i in range(0, 64, 16):
                opt.zero_grad()
                F.cross_entropy(model(x[i:i + 16]), y[i:i + 16]).backward()
                opt.step()
            model.module.eval()
            with torch.no_grad():
                model.module(x)
    if back_to_train:
        assert g.findings == []
    else:
        [f] = g.findings
        assert (f.kind, f.where, f.step) == ("train-in-eval-mode", "module", 4) and "1 (Dropout)" in f.message


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_label_sorted_dataset_behind_a_distributed_sampler_without_shuffle_is_unshuffled(shuffle):
    """`DistributedSampler(ds, shuffle=False)` (the validation sampler's setting copied into training) is a strided
    SequentialSampler: each rank's batches of a label-sorted dataset hold one class (silent until stop 41)."""
    from torch.utils.data.distributed import DistributedSampler

    torch.manual_seed(0)
    y = torch.arange(4).repeat_interleave(80)
    x = torch.randn(320, 6) + 2 * F.one_hot(y, 6).float()
    ds = TensorDataset(x, y)
    model = nn.Linear(6, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=shuffle)
    loader = DataLoader(ds, batch_size=16, sampler=sampler)
    with guard(model, opt, live=False) as g:
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for xb, yb in loader:
                loss = F.cross_entropy(model(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
    if shuffle:
        assert g.findings == []
    else:
        [f] = g.findings
        assert f.kind == "unshuffled-labels" and f.where == "loader" and f.details["sampler"] == "DistributedSampler"
        assert "DistributedSampler(dataset, shuffle=True)" in f.hint and "set_epoch" in f.hint


def test_all_zero_gradients_under_gradient_hooks_name_the_hooks():
    """Clipping by parameter hook, `torch.clamp(g, -c, c)` with c = 0 from a config: every gradient is 0. The hint
    blamed detach/argmax in the loss path until stop 41; the hooks are named."""
    torch.manual_seed(0)
    clip_value = 0.0
    model = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 3))
    handles = [p.register_hook(lambda g: torch.clamp(g, -clip_value, clip_value)) for p in model.parameters()]
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    try:
        with guard(model, opt, live=False) as g:
            for _ in range(8):
                x = torch.randn(50, 12)
                loss = F.cross_entropy(model(x), x[:, :3].argmax(1))
                opt.zero_grad()
                loss.backward()
                opt.step()
    finally:
        for h in handles:
            h.remove()
    f = [f for f in g.findings if f.kind == "grads-all-zero"][0]
    assert f.details["cause"] == "gradient_hooks" and "register_hook" in f.message and "torch.clamp" in f.hint


class _NoWeightGrad(torch.autograd.Function):
    """A linear layer by hand whose backward returns None for the weight."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(w)
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        return g @ w, None, g.sum(0)


class _HandLinear(nn.Linear):
    def forward(self, x):
        return _NoWeightGrad.apply(x, self.weight, self.bias)


def test_a_first_weight_without_gradient_beside_a_learning_bias_is_no_cut_between_layers():
    """A custom Function returning None for the weight: the bias of the same layer learns, so the path is not cut
    (it was told as a round/argmax between the layers until stop 41)."""
    torch.manual_seed(0)
    net = nn.Sequential(_HandLinear(10, 32), nn.ReLU(), _HandLinear(32, 32), nn.ReLU(), _HandLinear(32, 32), nn.ReLU(),
                        nn.Linear(32, 3))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    with guard(net, opt, live=False) as g:
        for _ in range(25):
            x = torch.randn(32, 10)
            loss = F.cross_entropy(net(x), x[:, :3].argmax(1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    [f] = [f for f in g.findings if f.kind == "vanishing-gradients"]
    assert f.where == "0" and "while the same layer's bias does" in f.message and "autograd.Function" in f.hint


def test_gradient_hooks_registered_again_every_epoch_are_named_in_a_vanishing_finding():
    """`p.register_hook(lambda g: g * 0.1)` at every epoch, handles dropped: the backbone's gradients shrink by 10x
    per epoch. The ReLU net got the sigmoid/init hint only until stop 41; the piled-up hooks are named."""
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
    model = nn.Sequential(backbone, nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(640, 20)
    y = (x @ torch.randn(20, 4)).argmax(1)
    with guard(model, opt, live=False) as g:
        for _ in range(12):
            for p in backbone.parameters():
                p.register_hook(lambda grad: grad * 0.1)
            for k in range(0, 640, 32):
                loss = F.cross_entropy(model(x[k:k + 32]), y[k:k + 32])
                opt.zero_grad()
                loss.backward()
                opt.step()
    [f] = [f for f in g.findings if f.kind == "vanishing-gradients"]
    assert f.details["gradient_hooks"] >= 5 and "Register gradient hooks once" in f.hint


def test_grads_all_zero_from_two_zero_initialised_factors_names_them():
    """LoRA with both A and B initialised to zeros (the base frozen): each factor's gradient is the other one times
    the output's, 0 at every step. The finding names the zero matrices and says to start one factor non-zero, not
    to look for a detach or dead ReLUs."""
    torch.manual_seed(0)

    class LoRA(nn.Module):
        def __init__(self, d, r=4):
            super().__init__()
            self.base = nn.Linear(d, d).requires_grad_(False)
            self.A, self.B = nn.Parameter(torch.zeros(d, r)), nn.Parameter(torch.zeros(r, d))

        def forward(self, x):
            return self.base(x) + x @ self.A @ self.B

    model = nn.Sequential(LoRA(8), nn.ReLU(), nn.Linear(8, 1).requires_grad_(False))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with guard(model, opt, live=False) as g:
        for _ in range(8):
            loss = F.mse_loss(model(torch.randn(16, 8)), torch.randn(16, 1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = [f for f in g.findings if f.kind == "grads-all-zero"]
    assert len(f) == 1 and f[0].details["cause"] == "zero_factors", g.findings
    assert "0.A, 0.B" in f[0].message and "Initialise one factor" in f[0].hint
