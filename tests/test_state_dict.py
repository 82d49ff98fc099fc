"""state-dict-mismatch: real failing loads get a note and a finding; the exception is unchanged."""
import collections
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import guard as guard_pkg
from guard import explain_state_dict, guard
from guard.hooks import active_patches


class Net(nn.Module):
    def __init__(self, classes=4):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, classes)

    def forward(self, x):
        return self.fc(self.bn(self.conv(x)).mean((2, 3)))


def _notes(exc):
    return "\n".join(getattr(exc, "__notes__", []))


def test_module_prefix_explained_and_fix_loads():
    src = nn.DataParallel(Net())  # runs on CPU without GPUs; keys get the module. prefix
    sd = src.state_dict()
    assert all(k.startswith("module.") for k in sd)
    model = Net()
    with guard(model, checks="all", live=False) as g:
        with pytest.raises(RuntimeError) as ei:
            model.load_state_dict(sd)
        assert type(ei.value) is RuntimeError and "Error(s) in loading state_dict" in str(ei.value)
        note = _notes(ei.value)
        assert "module." in note and "DataParallel" in note and "removeprefix" in note
        # the hint, applied, loads
        model.load_state_dict({k.removeprefix("module."): v for k, v in sd.items()})
    f = [f for f in g.findings if f.kind == "state-dict-mismatch"]
    assert len(f) == 1 and f[0].where == "Net" and f[0].severity == "error"
    assert f[0].details["prefix"] == "module." and f[0].details["direction"] == "checkpoint"
    assert torch.equal(model.fc.weight, src.module.fc.weight)


def test_pruning_reparametrization_on_one_side_is_named_and_its_fixes_load():
    """torch.nn.utils.prune replaces `weight` by `weight_orig` and `weight_mask`: a pruned checkpoint loaded into a
    plain model, or a lottery-ticket rewind loading the plain init snapshot into the pruned model. Not "another
    architecture" with strict=False (which would leave the weights as they were): the hints, applied, load."""
    import torch.nn.utils.prune as prune

    def make():
        return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))

    pruned = make()
    init = copy.deepcopy(pruned.state_dict())
    for m in (pruned[0], pruned[2]):
        prune.l1_unstructured(m, "weight", 0.5)
    plain = make()
    with guard(checks="all", live=False) as g:
        with pytest.raises(RuntimeError) as ei:
            plain.load_state_dict(pruned.state_dict())
        assert "saved from a pruned model" in _notes(ei.value)
        for m in (plain[0], plain[2]):
            prune.identity(m, "weight")
        plain.load_state_dict(pruned.state_dict())  # the fix: the same reparametrization first
    with guard(checks="all", live=False) as g2:
        with pytest.raises(RuntimeError):
            pruned.load_state_dict(init)  # the rewind
        state = pruned.state_dict()
        state.update({(k + "_orig" if k + "_orig" in state else k): v for k, v in init.items()})
        pruned.load_state_dict(state)
    found = [f for f in g.findings + g2.findings if f.kind == "state-dict-mismatch"]
    assert [f.details["pruning"]["direction"] for f in found] == ["checkpoint", "model"]
    assert found[0].details["pruning"]["tensors"] == ["0.weight", "2.weight"] and "prune.remove" in found[0].hint
    assert "'_orig'" in found[1].hint and "lottery-ticket" in found[1].hint
    assert torch.equal(plain[0].weight_mask, pruned[0].weight_mask)
    assert torch.equal(pruned[0].weight_orig, init["0.weight"]) and pruned[0].weight_mask.sum() == 24


def test_model_wrapped_checkpoint_plain_hints_model_module():
    sd = Net().state_dict()
    dp = nn.DataParallel(Net())
    with guard(dp, checks="all", live=False) as g:
        with pytest.raises(RuntimeError) as ei:
            dp.load_state_dict(sd)
        assert "model.module.load_state_dict" in _notes(ei.value)
        dp.module.load_state_dict(sd)
    assert [f.details["direction"] for f in g.findings] == ["model"]


def test_strict_false_with_prefix_is_reported_nothing_loaded():
    sd = nn.DataParallel(Net()).state_dict()
    model = Net()
    with guard(model, checks="all", live=False) as g:
        res = model.load_state_dict(sd, strict=False)
    assert res.missing_keys  # PyTorch silently loaded nothing
    (f,) = g.findings
    assert f.kind == "state-dict-mismatch" and "nothing was loaded" in f.message


def test_prefix_is_named_when_the_head_keys_were_dropped_for_a_new_head():
    """A DataParallel checkpoint whose head keys were filtered out (a new head), loaded with strict=False: the
    prefix is why nothing loaded, not the BatchNorm's running statistics."""
    sd = {k: v for k, v in nn.DataParallel(Net()).state_dict().items() if not k.startswith("module.fc.")}
    model = Net(classes=7)
    with guard(model, live=False) as g:
        model.load_state_dict(sd, strict=False)
    (f,) = g.findings
    assert f.kind == "state-dict-mismatch" and "every checkpoint key starts with 'module.'" in f.message
    assert "stripped, it still lacks 2 key(s) the model has (fc.* (2: fc.bias, fc.weight))" in f.message
    assert "track_running_stats" not in f.message + f.hint
    assert "k.removeprefix('module.')" in f.hint and "strict=False" in f.hint
    assert f.details["missing_after_strip"][0]["prefix"] == "fc"
    fixed = Net(classes=7)
    fixed.load_state_dict({k.removeprefix("module."): v for k, v in sd.items()}, strict=False)  # the hint works
    assert torch.equal(fixed.conv.weight, sd["module.conv.weight"])


def test_strict_false_partial_load_is_not_reported():
    sd = {k: v for k, v in Net().state_dict().items() if not k.startswith("fc.")}
    model = Net()
    with guard(model, checks="all", live=False) as g:
        model.load_state_dict(sd, strict=False)  # a deliberate new head
    assert g.findings == []


def test_num_batches_tracked_only_names_keys():
    sd = Net().state_dict()  # keeps _metadata (version 2), so PyTorch does not fill the buffer itself
    del sd["bn.num_batches_tracked"]
    model = Net()
    with guard(model, checks="all", live=False) as g:
        with pytest.raises(RuntimeError) as ei:
            model.load_state_dict(sd)
        note = _notes(ei.value)
        assert "0.4.1" in note and "bn.num_batches_tracked" in note and "strict=False" in note
        sd["bn.num_batches_tracked"] = torch.tensor(0)  # the hint: safe to add
        model.load_state_dict(sd)
    assert g.findings[0].details["num_batches_tracked_only"] is True


def test_shape_mismatch_lists_param_and_shapes():
    sd = Net(classes=10).state_dict()
    model = Net(classes=4)
    with guard(model, checks="all", live=False) as g:
        with pytest.raises(RuntimeError) as ei:
            model.load_state_dict(sd)
    note = _notes(ei.value)
    assert "fc.weight: checkpoint [10, 4] vs model [4, 4]" in note and "fc.bias" in note
    (f,) = g.findings
    assert {s["key"] for s in f.details["shape_mismatches"]} == {"fc.weight", "fc.bias"}


def test_other_keys_grouped_by_module_and_rename_detected():
    class Big(nn.Module):
        def __init__(self, head="fc"):
            super().__init__()
            self.body = nn.Sequential(*[nn.Linear(4, 4) for _ in range(30)])
            setattr(self, head, nn.Linear(4, 2))

    sd = Big(head="classifier").state_dict()
    sd = {k: v for k, v in sd.items() if not k.startswith("body.2")}
    model = Big()
    with guard(model, checks="all", live=False) as g:
        with pytest.raises(RuntimeError) as ei:
            model.load_state_dict(sd)
    note = _notes(ei.value)
    assert "body.*" in note and "fc.*" in note and "classifier.*" in note
    assert "classifier -> fc" in note
    assert len(note) < 1500  # grouped, not 60 names dumped
    groups = g.findings[0].details["missing_groups"]
    assert {gr["prefix"]: gr["whole_module"] for gr in groups} == {"body": False, "fc": True}


def test_explain_state_dict_public_and_none_when_fine():
    assert guard_pkg.explain_state_dict is explain_state_dict
    model = Net()
    assert explain_state_dict(model, Net().state_dict()) is None
    f = explain_state_dict(model, nn.DataParallel(Net()).state_dict())
    assert f.kind == "state-dict-mismatch" and "removeprefix" in f.hint and f.step == 0


@pytest.mark.parametrize("source", ["path", "buffer"])
def test_gpu_checkpoint_on_cpu_machine_explains_map_location(tmp_path, source):
    """A real CUDA-tagged checkpoint (the location tag forced at save time), loaded by the real torch.load."""
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    from torch import serialization

    entry = (1, lambda obj: "cuda:0", lambda obj, loc: None)
    serialization._package_registry.append(entry)
    serialization._package_registry.sort(key=lambda e: e[0])
    try:
        path = tmp_path / "ckpt.pt"
        torch.save(Net().state_dict(), path)
    finally:
        serialization._package_registry.remove(entry)
    import io

    def src():
        return path if source == "path" else io.BytesIO(path.read_bytes())  # a buffer has no name

    with guard(checks="all", live=False) as g:
        with pytest.raises(RuntimeError) as ei:
            torch.load(src())
        shown = repr(str(path)) if source == "path" else "f"
        assert f"torch.load({shown}, map_location='cpu')" in _notes(ei.value)
        assert "is_available() is False" in str(ei.value)
        torch.load(src(), map_location="cpu")  # the fix works
    (f,) = g.findings
    assert f.kind == "state-dict-mismatch" and f.where == (str(path) if source == "path" else "torch.load")
    assert f"torch.load({shown}, map_location='cpu')" in f.hint


def test_patches_removed_and_clean_load_has_no_findings():
    model = Net()
    sd = Net().state_dict()
    before = nn.Module.load_state_dict, torch.load
    with guard(model, checks="all", live=False) as g:
        assert any("load_state_dict" in p for p in active_patches())
        model.load_state_dict(sd)
    assert (nn.Module.load_state_dict, torch.load) == before
    assert g.findings == []


def test_mode_raise_keeps_the_original_exception():
    model = Net()
    with pytest.raises(RuntimeError) as ei:
        with guard(model, checks="all", mode="raise", live=False):
            model.load_state_dict(Net(classes=3).state_dict())
    assert type(ei.value) is RuntimeError and "size mismatch" in str(ei.value)
    assert "guard:" in _notes(ei.value)


class NetNoStats(Net):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(4, track_running_stats=False)


def test_batchnorm_without_running_stats_named_with_its_setting_and_the_fix_loads():
    sd = Net().state_dict()
    model = NetNoStats()
    with guard(model, checks="all", live=False) as g:
        with pytest.raises(RuntimeError) as ei:
            model.load_state_dict(sd)
        note = _notes(ei.value)
        assert "'bn' (BatchNorm2d)" in note and "track_running_stats=False" in note
        assert "different architecture" not in note
        (f,) = g.findings
        assert f.kind == "state-dict-mismatch" and f.details["running_stats_unexpected"] == ["bn"]
        assert "track_running_stats=True" in f.hint
        # the hint's second fix, as written: drop those keys
        ns = {"state_dict": sd}
        exec(f.hint.split("statistics: ", 1)[1].rstrip("."), {}, ns)
        assert model.load_state_dict(ns["state_dict"]) is not None
    assert len(g.findings) == 1


def test_checkpoint_without_running_stats_into_tracking_batchnorm():
    f = explain_state_dict(Net(), NetNoStats().state_dict())
    assert f.details["running_stats_missing"] == ["bn"]
    assert "'bn' (BatchNorm2d)" in f.message and "track_running_stats=True" in f.message
    assert "track_running_stats=False" in f.hint


def test_running_stats_mismatch_next_to_another_difference_explains_both():
    sd = Net(classes=10).state_dict()
    f = explain_state_dict(NetNoStats(), sd)
    assert "track_running_stats=False" in f.message and "fc.weight: checkpoint [10, 4] vs model [4, 4]" in f.message
    assert "different architecture" not in f.hint


@pytest.mark.parametrize("strict", [True, False])
def test_a_whole_checkpoint_passed_for_its_state_dict_is_told_to_pass_its_model_entry(strict):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoint = {"epoch": 3, "model": model.state_dict(), "opt": opt.state_dict()}
    with guard(model, opt, live=False) as g:
        try:
            model.load_state_dict(checkpoint, strict=strict)
        except RuntimeError:
            assert strict
    f = [f for f in g.findings if f.kind == "state-dict-mismatch"]
    assert len(f) == 1 and "checkpoint['model']" in f[0].hint and "'model' entry holds the model's keys" in f[0].message
    assert f[0].details["nested_state_dict"] == "model"


def _early_stopping(copy_snapshot, into_fresh=False, cpu=False):
    """Early stopping that restores the best epoch's state_dict into the model (or, `into_fresh`, into a fresh one)."""
    torch.manual_seed(0)

    def net():
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, live=False) as g:
        best = None
        for epoch in range(4):
            for _ in range(3):
                loss = model(torch.randn(8, 4)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            if epoch == 1:
                best = ({k: v.clone() for k, v in model.state_dict().items()} if copy_snapshot else
                        {k: v.cpu() for k, v in model.state_dict().items()} if cpu else model.state_dict())
                kept = {k: v.clone() for k, v in best.items()}
        if into_fresh:
            final = net()
            final.load_state_dict(best)  # "the best model" for evaluation
        else:
            model.load_state_dict(best)  # "restore the best epoch"
    return g, model, kept


def test_restoring_a_state_dict_snapshot_taken_without_a_copy_is_reported():
    g, model, kept = _early_stopping(copy_snapshot=False)
    [f] = g.findings
    assert (f.kind, f.where, f.step) == ("state-dict-mismatch", "Sequential", 12)
    assert "are the model's own" in f.message and "loading it changes nothing" in f.message
    assert "copy.deepcopy(model.state_dict())" in f.hint and f.details["aliased"] is True
    assert not torch.equal(model[0].weight, kept["0.weight"])  # indeed: the best epoch's weights are gone


def test_an_ema_swap_whose_backup_is_no_copy_is_told_with_the_swap_as_what_changed_it():
    """Validate with EMA weights: `backup = model.state_dict(); model.load_state_dict(ema); ...;
    model.load_state_dict(backup)`. The backup's tensors are the model's own, so loading the EMA weights changed
    them: the message said "training since it was taken changed them", which is not what happened here."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = {k: v.clone() for k, v in model.state_dict().items()}
    with guard(model, opt, live=False) as g:
        for _ in range(3):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        backup = model.state_dict()
        model.load_state_dict(ema)
        model.load_state_dict(backup)
    [f] = g.findings
    assert (f.kind, f.where) == ("state-dict-mismatch", "Sequential")
    assert "a load_state_dict() of other weights, as in an EMA swap" in f.message
    assert "training since it was taken" not in f.message


def test_a_snapshot_built_with_cpu_on_a_cpu_run_is_reported_with_the_explicit_copy():
    """`{k: v.cpu() for ...}` copies only from a GPU: on a CPU run it holds the model's own tensors. The message
    says why the dict was no copy, and the fix copies explicitly."""
    g, model, kept = _early_stopping(copy_snapshot=False, cpu=True)
    [f] = g.findings
    assert (f.kind, f.where, f.step) == ("state-dict-mismatch", "Sequential", 12)
    assert ".cpu() / .to(device)" in f.message and f.details["rebuilt_dict"] is True
    assert "v.detach().clone().cpu()" in f.hint
    assert not torch.equal(model[0].weight, kept["0.weight"])

def test_restoring_a_copied_snapshot_and_syncing_another_model_are_silent():
    g, model, kept = _early_stopping(copy_snapshot=True)
    assert g.findings == [] and torch.equal(model[0].weight, kept["0.weight"])
    torch.manual_seed(0)
    online, target = nn.Linear(4, 2), nn.Linear(4, 2)
    opt = torch.optim.SGD(online.parameters(), lr=0.1)
    with guard(online, opt, live=False) as g:
        for _ in range(3):
            loss = online(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            target.load_state_dict(online.state_dict())  # a target network synced from the online one
    assert g.findings == []


def test_an_uncopied_snapshot_loaded_back_before_any_change_is_silent():
    """Early stopping whose best epoch was the last: `best = model.state_dict()` taken after the last step and
    loaded right away restores exactly what it should (nothing changed the tensors since). Taken inside the
    guarded block, the snapshot's version counters tell."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, live=False) as g:
        for _ in range(6):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        best = model.state_dict()
        model.load_state_dict(best)
    assert g.findings == []


def test_a_sparse_parameter_in_a_loaded_state_dict_is_no_internal_error():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            i = torch.tensor([[0, 1, 2], [1, 2, 0]])
            self.W = nn.Parameter(torch.sparse_coo_tensor(i, torch.ones(3), (3, 3)).coalesce())
            self.lin = nn.Linear(3, 1)

        def forward(self, x):
            return self.lin(torch.sparse.mm(self.W, x).t())

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, live=False) as g:
        for _ in range(2):
            loss = model(torch.randn(3, 4)).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})  # restore a snapshot
        model.load_state_dict(model.state_dict())  # the model's own tensors: a sparse one has no data pointer
    assert g.internal_errors == [] and g.findings == []


@pytest.mark.parametrize("copy_snapshot", [False, True])
def test_an_uncopied_snapshot_loaded_into_a_fresh_model_is_reported(copy_snapshot):
    """`best = model.state_dict()` (references) at the best epoch; at the end `final = Net();
    final.load_state_dict(best)`: `final` silently gets the last epoch's weights. Told at that load, naming both
    variables; a copied snapshot is silent."""
    g, _, _ = _early_stopping(copy_snapshot, into_fresh=True)
    if copy_snapshot:
        assert g.findings == []
        return
    (f,) = g.findings
    assert f.kind == "state-dict-mismatch" and f.details["aliased_to"] == "`model`"
    assert "`final` gets `model`'s latest weights" in f.message and "copy.deepcopy" in f.hint


@pytest.mark.parametrize("copied", [False, True])
def test_averaging_snapshots_taken_without_a_copy_is_found(copied):
    """Checkpoint averaging of the last 3 epochs with `snaps.append(model.state_dict())`: each snapshot is the live
    weights, so the average loaded at the end is the last weights. Missed (the averaged dict holds new tensors);
    with deep-copied snapshots the average is a real one, and silent."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    snaps = []
    with guard(model, opt, live=False) as g:
        for epoch in range(5):
            for _ in range(3):
                loss = model(torch.randn(8, 4)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            snaps.append(copy.deepcopy(model.state_dict()) if copied else model.state_dict())
            snaps = snaps[-3:]
        avg = {k: sum(s[k] for s in snaps) / len(snaps) for k in snaps[0]}
        model.load_state_dict(avg)
    if copied:
        assert g.findings == [] and g.internal_errors == []
        return
    [f] = g.findings
    assert (f.kind, f.where, f.step) == ("state-dict-mismatch", "Sequential", 15)
    assert f.details["averaged_snapshots"] == 3 and f.details["snapshot_steps"] == [9, 12, 15]
    assert "an average of them" in f.message and "copy.deepcopy(model.state_dict())" in f.hint


@pytest.mark.parametrize("into", ["global", "client", "copied"])
def test_fedavg_over_client_snapshots_taken_without_a_copy_is_found(into):
    """FedAvg simulated with one client object, reset from the global model each round (`client.load_state_dict(
    glob.state_dict())`), `states.append(client.state_dict())` after its local steps: every snapshot is the client's
    live weights, so the "average" is the last client's. Missed when the client had been loaded into, or when the
    average went into the global model; told once for the run. Deep-copied snapshots are silent."""
    torch.manual_seed(0)
    glob = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    client = copy.deepcopy(glob)
    x = torch.randn(64, 4)
    with guard(live=False) as g:
        for _ in range(3):
            states = []
            for c in range(3):
                client.load_state_dict(glob.state_dict())
                opt = torch.optim.SGD(client.parameters(), lr=0.05)
                for _ in range(4):
                    xb = x[c * 16:(c + 1) * 16]
                    loss = F.mse_loss(client(xb), xb.sum(1, keepdim=True) * (c + 1))
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                states.append(copy.deepcopy(client.state_dict()) if into == "copied" else client.state_dict())
            avg = {k: torch.stack([s[k] for s in states]).mean(0) for k in states[0]}
            (client if into == "client" else glob).load_state_dict(avg)
    if into == "copied":
        assert g.findings == [] and g.internal_errors == []
        return
    [f] = g.findings
    assert f.kind == "state-dict-mismatch" and f.details["averaged_snapshots"] == 3
    assert "an average of them" in f.message and "copy.deepcopy(model.state_dict())" in f.hint
    if into == "global":
        assert "equal to `client`'s current weights" in f.message


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.encoder(x))


@pytest.mark.parametrize("case", ["lightning_prefix", "whole_into_part", "part_into_whole"])
def test_a_checkpoint_keyed_under_another_prefix_gets_the_prefix_fix(case):
    """A Lightning checkpoint's `model.` keys into the bare model, a whole model's checkpoint into its submodule, and a
    submodule's into the whole model, all with strict=False: told as "a different architecture" or as a rename of
    `head` to `0` until stop 41."""
    src, net = _Net(), _Net()
    with guard(net, live=False) as g:
        if case == "lightning_prefix":
            net.encoder.load_state_dict({"model." + k: v for k, v in src.encoder.state_dict().items()}, strict=False)
        elif case == "whole_into_part":
            net.encoder.load_state_dict(src.state_dict(), strict=False)
        else:
            net.load_state_dict(src.encoder.state_dict(), strict=False)
    [f] = g.findings
    assert f.kind == "state-dict-mismatch" and "renamed" not in f.hint and "different architecture" not in f.hint
    want = {"lightning_prefix": "k.removeprefix('model.')", "whole_into_part": "if k.startswith('encoder.')",
            "part_into_whole": "model.encoder.load_state_dict(state_dict)"}[case]
    assert want in f.hint


@pytest.mark.parametrize("copied", [False, True])
def test_a_best_state_dict_kept_without_a_copy_and_saved_after_training_is_told(copied, tmp_path):
    """`best_state = model.state_dict()` at the best epoch, `torch.save(best_state, ...)` after the run: the file
    holds the last weights (silent until stop 41: only load_state_dict of such a snapshot was looked at)."""
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = x.sum(1, keepdim=True)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    best, best_state = 1e9, None
    with guard(model, opt, live=False) as g:
        for epoch in range(20):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if loss.item() < best and epoch < 5:
                best = loss.item()
                best_state = copy.deepcopy(model.state_dict()) if copied else model.state_dict()
        torch.save(best_state, tmp_path / "best.pt")
    if copied:
        assert g.findings == []
    else:
        [f] = g.findings
        assert f.kind == "state-dict-mismatch" and f.where == "torch.save" and f.details["saved"] is True
        assert "copy.deepcopy(model.state_dict())" in f.hint
