"""The same planted pitfalls under a plain loop, a closure loop, Lightning and the Hugging Face Trainer.

Each stack must give the same kind at the same `where`, with a `source` in this file; the healthy
twins must give no finding and exactly the losses of the unguarded run. CPU, tiny synthetic data.
"""
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from guard import guard

L = pytest.importorskip("lightning.pytorch")
transformers = pytest.importorskip("transformers")
from guard.integrations.lightning import GuardCallback as LightningGuard  # noqa: E402
from guard.integrations.transformers import GuardCallback as HFGuard  # noqa: E402

HERE = os.path.relpath(__file__)
N, BATCH, BAD = 96, 8, 40  # row BAD carries the planted fault
# The device the user's forward hard-codes for a tensor it makes (`torch.ones(..., device=STALE)`). The
# frameworks put the model and the batch on the CPU; `meta` stands in for the other device (on a GPU
# machine: the model on CUDA and a tensor made with the CPU default inside forward).
STALE = torch.device("meta")
warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*has no logger configured.*")


class Data(Dataset):
    def __init__(self, fault=None, seed=0):
        g = torch.Generator().manual_seed(seed)
        n = N + 1 if fault == "bn-last" else N  # a last batch of one
        self.x = torch.randn(n, 4, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)
        if fault == "nan-input":
            self.x[BAD, 0] = float("nan")
        elif fault == "nan-module":
            self.x[BAD, 0] = 7.0  # Gate divides by zero on it
        elif fault == "target":
            self.y[BAD] = 5

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class Gate(nn.Module):
    """Divides by zero on rows whose first feature is 7 (the planted NaN/Inf of a module)."""

    def forward(self, x):
        return x / (x[:, :1] != 7.0).float()


class Net(nn.Module):
    def __init__(self, fault=None):
        super().__init__()
        self.gate = Gate()
        self.body = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16) if fault == "bn-last" else nn.Identity(),
                                  nn.ReLU(), nn.Linear(16, 3))
        self.stale = fault == "device"
        if self.stale:
            self.offset = nn.Linear(1, 3)  # a learned offset per class, fed with a constant made in forward

    def forward(self, x, labels=None):
        logits = self.body(self.gate(x))
        if self.stale:
            logits = logits + self.offset(torch.ones(len(x), 1, device=STALE))  # BUG: not device=x.device
        if labels is None:
            return {"logits": logits}
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


class Holder:
    total = 0.0


def loader(fault):
    return DataLoader(Data(fault), batch_size=BATCH, shuffle=False)


# --------------------------------------------------------------------------- the four stacks

def run_loop(fault, closure=False):
    torch.manual_seed(0)
    model = Net(fault)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    keep = Holder()
    try:
        with guard(model, opt, live=False) as g:
            for _ in range(2):
                for batch in loader(fault):
                    def step():
                        if fault != "no-zero-grad":
                            opt.zero_grad()
                        loss = model(**batch)["loss"]
                        if fault == "retained":
                            keep.total = keep.total + loss
                        loss.backward()
                        return loss
                    if closure:
                        opt.step(step)
                    else:
                        step()
                        opt.step()
    except (IndexError, RuntimeError, ValueError):
        assert fault in ("target", "bn-last", "device")
    return g


class Lit(L.LightningModule):
    def __init__(self, fault=None, manual=False):
        super().__init__()
        self.net, self.fault, self.total = Net(fault), fault, 0.0
        self.automatic_optimization = not manual
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = self.net(**batch)["loss"]
        if self.fault == "retained":
            self.total = self.total + loss
        self.losses.append(loss.item())
        if not self.automatic_optimization:
            opt = self.optimizers()
            self.manual_backward(loss / 2)
            if batch_idx % 2 == 1:  # accumulate two batches by hand
                opt.step()
                if self.fault != "no-zero-grad":
                    opt.zero_grad()
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.net(**batch)["loss"], batch_size=BATCH)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)}


def trainer(callbacks, **kw):
    return L.Trainer(max_epochs=2, callbacks=callbacks, accelerator="cpu", devices=1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, **kw)


def run_lightning(fault, manual=False, cb=True, val=False, **kw):
    L.seed_everything(0, verbose=False)
    lit = Lit(fault, manual)
    cbk = LightningGuard(live=False)
    try:
        trainer([cbk] if cb else [], **kw).fit(lit, loader(fault), loader(None) if val else None)
    except (IndexError, RuntimeError, ValueError):
        assert fault in ("target", "bn-last", "device")
    return cbk.guard, lit


class HFTrainer(transformers.Trainer):
    fault = None
    total = 0.0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(**inputs)
        loss = out["loss"]
        if self.fault == "retained":
            self.total = self.total + loss
        return (loss, out) if return_outputs else loss


def hf_args(tmp, **kw):
    base = dict(output_dir=str(tmp), per_device_train_batch_size=BATCH, gradient_accumulation_steps=2,
                num_train_epochs=2, learning_rate=0.05, logging_steps=1, report_to=[], save_strategy="no",
                use_cpu=True, disable_tqdm=True, dataloader_pin_memory=False, seed=0)
    base.update(kw)
    return transformers.TrainingArguments(**base)


def run_hf(fault, tmp, cb=True, **kw):
    torch.manual_seed(0)
    cbk = HFGuard(live=False)
    tr = HFTrainer(model=Net(fault), args=hf_args(tmp, **kw), train_dataset=Data(fault),
                   eval_dataset=Data(None, seed=1) if kw.get("eval_strategy") else None, callbacks=[cbk] if cb else [])
    tr.fault = fault
    try:
        tr.train()
    except (IndexError, RuntimeError, ValueError):
        assert fault in ("target", "bn-last", "device")
    finally:
        cbk.close()
    return cbk.guard, tr


# --------------------------------------------------------------------------- the matrix

EXPECTED = {"nan-input": ("nonfinite-input", "input"), "nan-module": ("nonfinite-output", "gate"),
            "target": ("target-out-of-range", "loss"), "retained": ("loss-graph-retained", "total"),
            "no-zero-grad": ("missing-zero-grad", "SGD"), "bn-last": ("batchnorm-last-batch", "input"),
            "device": ("device-mismatch", "offset")}
STACKS = ["loop", "closure", "lightning", "lightning-manual", "hf"]


@pytest.fixture(scope="module")
def hf_tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("hf")


@pytest.mark.parametrize("fault", list(EXPECTED))
@pytest.mark.parametrize("stack", STACKS)
def test_planted_pitfall(stack, fault, hf_tmp):
    if fault == "no-zero-grad" and stack in ("lightning", "hf"):
        pytest.skip("automatic optimization zeroes the gradients itself")
    if stack == "loop":
        g = run_loop(fault)
    elif stack == "closure":
        g = run_loop(fault, closure=True)
    elif stack == "lightning":
        g, _ = run_lightning(fault)
    elif stack == "lightning-manual":
        g, _ = run_lightning(fault, manual=True)
    else:
        g, _ = run_hf(fault, hf_tmp)
    kind, where = EXPECTED[fault]
    first = g.findings[0]
    assert first.kind == kind, g.findings
    assert first.where.endswith(where)  # the holder may be `total`, `keep.total`, `lit.total`
    assert first.source and first.source.startswith(HERE + ":"), first.source
    assert not [f for f in g.findings if f.kind in ("eval-without-no-grad", "nonfinite-param")]
    if fault == "device":  # the line in forward that made the tensor, whichever stack ran it; no follow-on finding
        with open(__file__) as fh:
            line = next(i for i, text in enumerate(fh, 1) if "# BUG: not device=x.device" in text)
        assert first.source == f"{HERE}:{line}" and "device=x.device" in first.hint, first
        assert [f.kind for f in g.findings] == ["device-mismatch"] and not g.active


@pytest.mark.parametrize("fault", ["target", "bn-last", "device"])
def test_a_crash_in_the_hf_trainer_is_explained_and_closes_the_guard(fault, hf_tmp):
    # The Trainer has no exception event: the callback wraps the Trainer's training_step while it runs.
    torch.manual_seed(0)
    cbk = HFGuard(live=False)
    tr = HFTrainer(model=Net(fault), args=hf_args(hf_tmp), train_dataset=Data(fault), callbacks=[cbk])
    with pytest.raises((IndexError, RuntimeError, ValueError)) as info:
        tr.train()
    kind, _ = EXPECTED[fault]
    note = {"target": "target-out-of-range at loss", "bn-last": "batchnorm-single-sample at body.1",
            "device": "device-mismatch at offset"}[fault]
    notes = getattr(info.value, "__notes__", [])
    assert any(n.startswith(f"guard: {note} ") for n in notes), notes
    g = cbk.guard
    assert not g.active and g.findings[0].kind == kind  # closed by the crash, as a with block would be
    assert "training_step" not in vars(tr)  # the Trainer is as it was
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in tr.model.modules())


# --------------------------------------------------------------------------- healthy twins

def test_lightning_healthy_twin_is_silent_and_bit_identical():
    kw = dict(accumulate_grad_batches=2, gradient_clip_val=1.0, precision="bf16-mixed", val=True)
    g, guarded = run_lightning(None, **kw)
    _, plain = run_lightning(None, cb=False, **kw)
    assert g.findings == []
    assert guarded.losses == plain.losses and len(plain.losses) == 2 * N // BATCH
    assert not g.active and g.step == 2 * N // BATCH // 2  # Lightning's global_step


def test_hf_healthy_twin_is_silent_and_bit_identical(hf_tmp):
    kw = dict(max_grad_norm=1.0, eval_strategy="epoch", warmup_steps=2, weight_decay=0.01, prediction_loss_only=True)
    g, guarded = run_hf(None, hf_tmp, **kw)
    _, plain = run_hf(None, hf_tmp, cb=False, **kw)
    assert g.findings == []
    losses = [e["loss"] for e in guarded.state.log_history if "loss" in e]
    assert losses == [e["loss"] for e in plain.state.log_history if "loss" in e] and losses
    assert all(e["guard/errors"] == 0 for e in guarded.state.log_history if "loss" in e)


# --------------------------------------------------------------------------- under a budget's sampling

@pytest.fixture
def sleeping(monkeypatch):
    """The costly checks sampled out of 2 steps in 3 (the period pinned, as a budget would set it)."""
    from guard import meter

    init = meter.Meter.__init__

    def pinned(self, budget):
        init(self, budget)
        self.pin(3)

    monkeypatch.setattr(meter.Meter, "__init__", pinned)


@pytest.mark.parametrize("fault", ["retained", "no-zero-grad"])
@pytest.mark.parametrize("stack", STACKS)
def test_code_property_pitfalls_found_while_their_checks_sleep(stack, fault, hf_tmp, sleeping):
    if fault == "no-zero-grad" and stack in ("lightning", "hf"):
        pytest.skip("automatic optimization zeroes the gradients itself")
    runs = {"loop": lambda: run_loop(fault), "closure": lambda: run_loop(fault, closure=True),
            "lightning": lambda: run_lightning(fault)[0], "lightning-manual": lambda: run_lightning(fault, manual=True)[0],
            "hf": lambda: run_hf(fault, hf_tmp)[0]}
    g = runs[stack]()
    kind, where = EXPECTED[fault]
    found = [f for f in g.findings if f.kind == kind]
    assert found and found[0].where.endswith(where), g.findings
    assert g.meter.period == 3


def test_healthy_twins_silent_while_costly_checks_sleep(sleeping, hf_tmp):
    g, _ = run_lightning(None, accumulate_grad_batches=2, gradient_clip_val=1.0, val=True)
    assert g.findings == [] and g.meter.period == 3
    g, _ = run_hf(None, hf_tmp, max_grad_norm=1.0, eval_strategy="epoch", warmup_steps=2, weight_decay=0.01)
    assert g.findings == [] and g.meter.period == 3


def test_accelerate_prepared_optimizer_is_guarded_through_its_wrapper():
    # accelerate's AcceleratedOptimizer subclasses Optimizer without its hook machinery: guard(model, opt)
    # after prepare() failed with AttributeError. The real optimizer inside is watched now.
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    acc = accelerate.Accelerator(cpu=True)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with guard(model, opt, live=False) as g:
        for step in range(4):
            x = torch.randn(8, 4)
            if step == 2:
                x[0, 0] = float("nan")
            opt.zero_grad()
            acc.backward(nn.functional.cross_entropy(model(x), torch.randint(0, 2, (8,))))
            opt.step()
    assert g.step == 4 and g.internal_errors == []
    assert [(f.kind, f.step) for f in g.findings][:1] == [("nonfinite-input", 2)]


def test_a_graph_held_on_a_lightning_module_built_inline_is_named():
    """`trainer.fit(Lit(...), ...)`: no variable of the user's names the module; its attribute holds the graphs."""
    L.seed_everything(0, verbose=False)
    cbk = LightningGuard(live=False)
    trainer([cbk]).fit(Lit("retained", False), loader("retained"))
    f = cbk.guard.findings[0]
    assert f.kind == "loss-graph-retained" and f.where == "Lit.total", f
    with open(__file__) as fh:
        line = next(i for i, text in enumerate(fh, 1) if "self.total = self.total + loss" in text)
    assert f"{HERE}:{line}" in f.message and "`self.total += loss.item()`" in f.hint


def test_fabric_setup_optimizer_given_to_guard_counts_its_steps():
    """fabric.setup returns FabricSGD, a subclass of SGD sharing the wrapped one's hook tables: guard follows the
    wrapped optimizer, so steps count from 0 (no 'replaced' notice) and a NaN at step 10 is reported at step 10."""
    from lightning.fabric import Fabric

    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1)
    raw = nn.Linear(4, 2)
    model, opt = fabric.setup(raw, torch.optim.SGD(raw.parameters(), 0.1))
    with guard(model, opt, live=False) as g:
        for i in range(20):
            x = torch.randn(8, 4)
            if i == 10:
                x[0, 0] = float("nan")
            opt.zero_grad()
            fabric.backward(F.cross_entropy(model(x), torch.randint(0, 2, (8,))))
            opt.step()
    assert [(f.kind, f.step) for f in g.findings] == [("nonfinite-input", 10)]
    assert g.notices == [] and g.step == 20


@pytest.mark.parametrize("scope", ["model", "global"])
def test_fabric_wrapped_module_is_named_as_the_model_it_wraps(scope):
    """_FabricModule is unwrapped as DDP is: parameter names have no `_forward_module.` and the model call is
    the model's (Sequential), not Fabric's wrapper."""
    from lightning.fabric import Fabric

    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1)
    raw = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model, opt = fabric.setup(raw, torch.optim.SGD(raw.parameters(), 0.1))
    with guard(model if scope == "model" else None, live=False) as g:
        for i in range(4):
            x = torch.randn(8, 4)
            if i == 2:
                x[0, 0] = float("nan")
            fabric.backward(F.cross_entropy(model(x), torch.randint(0, 2, (8,))))
            opt.step()  # no zero_grad()
    by_kind = {f.kind: f for f in g.findings}
    assert "the input to Sequential" in by_kind["nonfinite-input"].message
    assert by_kind["missing-zero-grad"].details["names"][:2] == ["0.weight", "0.bias"]


class LitLogOfNegative(L.LightningModule):
    """A hand-written loss that takes the log of a negative value at its first step."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        out = self.net(batch["x"]).mean()  # the model call guard names
        return torch.log(out * 0 - 1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_a_finding_of_a_lightning_backward_names_the_training_step_not_the_fit_line():
    """Lightning calls backward() and step() from dozens of frames inside `trainer.fit(...)`: the user's line on
    the stack was the `fit` call; the model call in training_step is named instead (stop 41)."""
    L.seed_everything(0, verbose=False)
    with guard(live=False) as g:  # as TORCH_GUARD=1 runs it: no callback, the LightningModule's own layers are called
        trainer([], max_steps=2).fit(LitLogOfNegative(), loader(None))
    f = next(f for f in g.findings if f.kind == "nonfinite-loss")
    with open(__file__) as fh:
        line = next(i for i, text in enumerate(fh, 1) if "# the model call guard names" in text)
    assert f.source == f"{HERE}:{line}" and f.step == 0


class LitKeepsLosses(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
        self.step_losses = []

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self.net(batch["x"]), batch["labels"])
        self.step_losses.append(loss)  # the holder guard names
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_a_graph_held_by_the_lightning_module_around_the_watched_net_is_named_under_a_global_guard():
    """TORCH_GUARD=1 on `trainer.fit(Lit(), ...)`: training_step is no module call, so the watched model is the
    LightningModule's `self.net`, and the list holding the losses is an attribute of its parent (named since stop 41:
    "guard could not find which variable" before)."""
    L.seed_everything(0, verbose=False)
    with guard(live=False) as g:
        trainer([], max_steps=40).fit(LitKeepsLosses(), loader(None))
    f = next(f for f in g.findings if f.kind == "loss-graph-retained")
    with open(__file__) as fh:
        line = next(i for i, text in enumerate(fh, 1) if "# the holder guard names" in text)
    assert f.where == "LitKeepsLosses.step_losses" and f.source == f"{HERE}:{line}"
    assert "`self.step_losses.append(loss.item())`" in f.hint
