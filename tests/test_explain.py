"""explained-error: real failing snippets get a note (cause, module, step, fix); the exception is unchanged."""
import contextlib
import gc
import os
import signal
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from guard import guard


def _notes(exc):
    return "\n".join(getattr(exc, "__notes__", []))


def _explained(g):
    return [f for f in g.findings if f.kind == "explained-error"]


class InplaceNet(nn.Module):
    def __init__(self, fixed=False):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.Sigmoid()  # saves its output for backward
        self.out = nn.Linear(4, 1)
        self.fixed = fixed

    def forward(self, x):
        h = self.act(self.fc(x))
        if self.fixed:
            h = h + 1
        else:
            h += 1  # modifies the tensor Sigmoid saved
        return self.out(h)


def test_inplace_on_saved_tensor_names_the_module():
    model = InplaceNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError) as ei:
        with guard(model, opt, checks="all", live=False) as g:
            for _ in range(2):
                opt.zero_grad()
                model(torch.randn(3, 4)).sum().backward()
                opt.step()
    exc = ei.value
    assert type(exc) is RuntimeError and "modified by an inplace operation" in str(exc)
    # PyTorch's own words kept (the op that made the tensor), the module that saved it added
    assert "which is output 0 of SigmoidBackward0, saved by module `act`" in str(exc)
    note = _notes(exc)
    assert "`act` (Sigmoid)" in note and "step 0" in note and ".clone()" in note
    (f,) = _explained(g)
    assert f.where == "act" and f.step == 0 and f.details["saved_version"] == 0 and f.details["version"] == 1
    assert f.source and "test_explain.py" in f.source
    # without a guard PyTorch raises the same kind of error (the hooks kept its check)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        InplaceNet()(torch.randn(3, 4)).sum().backward()


def test_in_place_change_of_a_parameter_outside_no_grad_is_explained():
    """A max-norm helper that rescales weights with p.div_() while autograd records."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def max_norm(m, limit=1.0):
        for p in m.parameters():
            if p.dim() > 1:
                p.div_(p.norm(dim=1, keepdim=True).clamp(min=limit))

    with pytest.raises(RuntimeError, match="leaf Variable that requires grad") as ei:
        with guard(model, opt, live=False) as g:
            for step in range(3):
                opt.zero_grad()
                model(torch.randn(5, 4)).pow(2).mean().backward()
                opt.step()
                if step == 1:
                    max_norm(model)
    assert "with torch.no_grad()" in _notes(ei.value)
    (f,) = _explained(g)
    assert f.where == "parameter" and f.step == 2 and "test_explain.py" in f.source  # after step 1's update


def test_backward_on_an_unreduced_loss_is_explained():
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="only for scalar outputs") as ei:
        with guard(model, opt, live=False) as g:
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(torch.randn(5, 4)), torch.randn(5, 1), reduction="none")
            loss.backward()
    assert "loss.mean()" in _notes(ei.value)
    (f,) = _explained(g)
    assert f.where == "loss" and f.step == 0 and "reduction='none'" in f.message


class PosEmb(nn.Module):
    def __init__(self, maxlen=8):
        super().__init__()
        self.tok = nn.Embedding(10, 4)
        self.pos = nn.Embedding(maxlen, 4)
        self.out = nn.Linear(4, 10)

    def forward(self, ids):
        return self.out(self.tok(ids) + self.pos(torch.arange(ids.shape[1])))


@pytest.mark.parametrize("mode", ["model", "global"])
def test_an_embedding_index_out_of_range_names_the_layer_the_index_and_its_size(mode):
    """A curriculum grows the sequence past the position table: PyTorch says only 'index out of range in self'."""
    model = PosEmb()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(IndexError, match="index out of range in self") as ei:
        with guard(*([model, opt] if mode == "model" else []), live=False) as g:
            for length in (4, 8, 12):
                opt.zero_grad()
                ids = torch.randint(0, 10, (2, length))
                nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
                opt.step()
    (f,) = _explained(g)
    assert f.where == "pos" and f.step == 2
    assert "Embedding(8, 4)" in f.message and "index 11, outside [0, 8)" in f.message
    assert f.details["index_max"] == 11 and f.details["num_embeddings"] == 8 and "at least 12" in f.hint
    assert "index 11" in _notes(ei.value)


@pytest.mark.parametrize("dtype, word", [(torch.int32, "Int"), (torch.float32, "Float")])
def test_class_targets_of_the_wrong_dtype_are_explained(dtype, word):
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="expected target dtype") as ei:
        with guard(model, opt, live=False) as g:
            nn.functional.cross_entropy(model(torch.randn(5, 4)), torch.tensor([0, 1, 2, 1, 0], dtype=dtype)).backward()
    (f,) = _explained(g)
    assert f.where == "loss" and f.details["target_dtype"] == word and "y.long()" in f.hint
    assert "y.long()" in _notes(ei.value)


def test_inplace_clean_twin_same_grads_double_backward_and_no_leak():
    torch.manual_seed(0)
    model = InplaceNet(fixed=True)
    x = torch.randn(3, 4, requires_grad=True)

    def grads():
        model.zero_grad()
        x.grad = None
        y = model(x).sum()
        (gx,) = torch.autograd.grad(y, x, create_graph=True)  # gradient penalty style
        (gx.pow(2).sum() + y).backward()
        return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]

    plain = grads()
    with guard(model, checks="all", live=False) as g:
        guarded = grads()
    assert all(torch.allclose(a, b) for a, b in zip(plain, guarded))
    assert g.findings == []
    with guard(model, checks=["explain"], live=False):
        out = model(x)
        ref = weakref.ref(out)
        del out
        gc.collect()
        assert ref() is None  # saved outputs do not form cycles with their grad_fn


def test_backward_twice_through_carried_hidden_state():
    cell = nn.RNNCell(4, 4)
    opt = torch.optim.SGD(cell.parameters(), lr=0.01)
    with pytest.raises(RuntimeError) as ei:
        with guard(cell, opt, checks="all", live=False) as g:
            h = torch.zeros(2, 4)
            for _ in range(3):
                h = cell(torch.randn(2, 4), h)  # not detached: step 1 backprops into step 0's freed graph
                opt.zero_grad()
                h.sum().backward()
                opt.step()
    assert "backward through the graph a second time" in str(ei.value)
    note = _notes(ei.value)
    assert "`h` is carried from one iteration into the next" in note
    assert "`h = cell(torch.randn(2, 4), h)`" in note and "h = h.detach()" in note
    (f,) = _explained(g)
    assert f.where == "h" and f.step == 1
    assert f.details["carried_at"].startswith("tests/test_explain.py:")


def _second_backward(run):
    """The explained-error of `run(g)`, which must raise autograd's backward-a-second-time error."""
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        with guard(checks=["explain"], live=False) as g:
            run(g)
    (f,) = _explained(g)
    return f


def test_second_backward_names_a_cached_attribute():
    class Cached(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.cache = nn.Linear(4, 4), None

        def forward(self, x):
            if self.cache is None:  # computed once, with the graph of step 0
                self.cache = self.fc(torch.ones(1, 4))
            return self.fc(x) + self.cache

    def run(g):
        model = Cached()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            loss = model(torch.randn(3, 4)).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()

    f = _second_backward(run)
    assert f.where == "model.cache" and f.step == 1
    assert "computed from `model.cache`, a tensor made before the last backward()" in f.message
    assert "model.cache = ....detach()" in f.hint


def test_second_backward_through_a_prompt_made_as_a_result_of_a_leaf_says_make_it_a_parameter():
    """A soft prompt written `torch.randn(P, D, requires_grad=True) * 0.5`: a result computed once, not a leaf. The
    second backward() fails through its freed graph; detaching it (the cache fix) would stop it from ever training."""
    class Soft(nn.Module):
        def __init__(self):
            super().__init__()
            self.prompt = torch.randn(3, 4, requires_grad=True) * 0.5
            self.gate = nn.Parameter(torch.ones(1))

        def forward(self, x):
            return x + self.prompt * self.gate

    def run(g):
        soft = Soft()
        opt = torch.optim.Adam(soft.parameters(), lr=0.05)
        for _ in range(3):
            loss = soft(torch.randn(3, 4)).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()

    f = _second_backward(run)
    assert f.where == "soft.prompt" and f.step == 1
    assert "computed once from a tensor made with requires_grad=True" in f.message and "not a leaf" in f.message
    assert f.hint.startswith("Make it an nn.Parameter where it is created") and "soft.prompt = nn.Parameter(" in f.hint


def test_second_backward_names_a_gan_batch_shared_by_two_losses():
    G, D = nn.Linear(4, 2), nn.Linear(2, 1)
    og, od = torch.optim.Adam(G.parameters()), torch.optim.Adam(D.parameters())

    def run(g):
        for _ in range(2):
            fake = G(torch.randn(8, 4))
            d_loss = D(torch.randn(8, 2)).mean() - D(fake).mean()  # fake not detached for D
            od.zero_grad(); d_loss.backward(); od.step()
            g_loss = D(fake).mean()
            og.zero_grad(); g_loss.backward(); og.step()

    f = _second_backward(run)
    assert f.where == "fake" and "D(fake.detach())" in f.hint


def test_second_backward_names_a_hidden_state_kept_in_the_module():
    class Stateful(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell, self.hidden = nn.GRUCell(4, 8), None

        def forward(self, x):
            if self.hidden is None:
                self.hidden = torch.zeros(x.shape[0], 8)
            self.hidden = self.cell(x, self.hidden)
            return self.hidden.sum()

    def run(g):
        model = Stateful()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            loss = model(torch.randn(2, 4))
            opt.zero_grad(); loss.backward(); opt.step()

    f = _second_backward(run)
    assert f.where == "model.hidden"
    assert "`self.hidden = self.cell(x, self.hidden)`" in f.message
    assert "self.hidden = self.hidden.detach()" in f.hint


def test_second_backward_names_an_lstm_state_pair_and_a_running_total():
    lstm = nn.LSTM(4, 8)
    opt = torch.optim.SGD(lstm.parameters(), lr=0.1)

    def pair(g):
        hidden = (torch.zeros(1, 2, 8), torch.zeros(1, 2, 8))
        for _ in range(3):
            out, hidden = lstm(torch.randn(3, 2, 4), hidden)
            opt.zero_grad(); out.pow(2).mean().backward(); opt.step()

    f = _second_backward(pair)
    assert f.where == "hidden" and "hidden = tuple(s.detach() for s in hidden)" in f.hint

    model = nn.Linear(4, 1)
    opt2 = torch.optim.SGD(model.parameters(), lr=0.1)

    def total_loss(g):
        total = 0
        for _ in range(3):
            total += model(torch.randn(8, 4)).pow(2).mean()
            opt2.zero_grad(); total.backward(); opt2.step()

    f = _second_backward(total_loss)
    assert f.where == "total" and "adds up tensors across iterations" in f.message
    assert "total += loss.item()" in f.hint


def test_second_backward_names_a_buffer_written_with_live_outputs_not_the_loss_reading_it():
    net = nn.Linear(4, 3)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    class Replay:
        def __init__(self):
            self.logits = torch.zeros(8, 3)

        def add(self, i, z):
            self.logits[i] = z  # not detached: each row keeps its step's graph

    def run(g):
        buf, mem = torch.zeros(8, 3), Replay()
        for step in range(3):
            x = torch.randn(8, 4)
            out = net(x)
            loss = out.pow(2).mean()
            if step > 0:
                loss = loss + (net(x) - buf).pow(2).mean()  # `loss` is rebuilt here: not what carries the graph
            opt.zero_grad(); loss.backward(); opt.step()
            buf[:] = out

    f = _second_backward(run)
    assert f.where == "buf" and "`buf[:] = out`" in f.message and "write out.detach() into buf" in f.hint

    def run_method(g):
        mem = Replay()
        for step in range(3):
            out = net(torch.randn(8, 4))
            loss = out.pow(2).mean() + (out[0] - mem.logits[0]).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
            mem.add(0, out[0])

    f = _second_backward(run_method)
    assert f.where == "mem.logits" and "`self.logits[i] = z`" in f.message and "write z.detach()" in f.hint


def test_second_backward_on_the_same_loss():
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def run(g):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        loss.backward()

    f = _second_backward(run)
    assert f.where == "backward" and "backward() called twice on one loss" in f.message
    assert "retain_graph=True" in f.hint


def test_device_mismatch_explained_with_module():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(RuntimeError) as ei:
        with guard(model, checks=["explain"], live=False) as g:
            model(torch.randn(2, 4, device="meta"))  # the weights stay on the CPU
    note = _notes(ei.value)
    assert "`0` (Linear)" in note and "x = x.to(device)" in note
    (f,) = _explained(g)
    assert f.where == "0" and set(f.details["devices"]) == {"cpu", "meta"}


def test_fake_cuda_device_mismatch_message():
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = nn.Linear(4, 4)
    with pytest.raises(RuntimeError) as ei:
        with guard(model, checks=["explain"], live=False) as g:
            with FakeTensorMode(allow_non_fake_inputs=True):
                model(torch.empty(2, 4, device="cuda:0"))
    assert "Expected all tensors to be on the same device" in str(ei.value)
    assert "(cuda:0 and cpu)" in _notes(ei.value)
    assert _explained(g)[0].where == "Linear"


def test_numpy_float64_input_names_the_input_and_the_dtypes():
    import numpy as np

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(RuntimeError) as ei:
        with guard(model, checks=["explain"], live=False) as g:
            model(torch.from_numpy(np.random.randn(2, 4)))  # float64, as NumPy makes it
    note = _notes(ei.value)
    assert "`0` (Linear) has float32 parameters but got a float64 input (args[0])" in note
    assert "x = x.float()" in note
    (f,) = _explained(g)
    assert f.where == "0" and f.details["input_dtypes"] == {"args[0]": "float64"}


def test_a_float64_weight_among_float32_ones_is_named():
    import numpy as np

    model = nn.Sequential(nn.Linear(4, 2))
    model[0].weight = nn.Parameter(torch.from_numpy(np.random.randn(2, 4)))  # initialised from NumPy
    with pytest.raises(RuntimeError) as ei:
        with guard(model, checks=["explain"], live=False):
            model(torch.randn(3, 4))
    assert "holds parameters of different dtypes (weight: float64, bias: float32)" in _notes(ei.value)


@pytest.mark.parametrize("form", ["module", "functional", "global"])
def test_float64_class_weights_of_a_loss_are_named_not_the_model(form):
    import numpy as np

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    counts = np.array([5.0, 3.0, 2.0])
    cw = torch.from_numpy(counts.sum() / (3 * counts))  # float64, as NumPy makes it
    crit = nn.CrossEntropyLoss(weight=cw)
    loss_fn = crit if form != "functional" else (lambda out, y: nn.functional.cross_entropy(out, y, weight=cw))
    with pytest.raises(RuntimeError) as ei:
        with guard(*((model,) if form != "global" else ()), checks=["explain"], live=False) as g:
            loss_fn(model(torch.randn(6, 4)), torch.randint(0, 3, (6,))).backward()
    note = _notes(ei.value)
    assert "the weight= tensor given to cross_entropy is float64 while its input is float32" in note
    assert "weight=w.float()" in note and "x = x.float()" not in note
    (f,) = _explained(g)
    assert f.where == "loss" and f.details["weight_dtype"] == "float64"


def test_optimizer_state_loaded_into_parameters_of_another_order_is_explained_as_such():
    """A layer inserted in front, a new Adam built and the old state loaded: load_state_dict matches state by
    position, so the first parameter gets moments of another's shape. Not a resize: the note says why."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 24), nn.ReLU(), nn.Linear(24, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(RuntimeError) as ei:
        with guard(model, opt, checks=["explain"], live=False) as g:
            for step in range(4):
                if step == 2:
                    saved = opt.state_dict()
                    model.insert(0, nn.Linear(10, 10))
                    opt = torch.optim.Adam(list(model.parameters())[:4], lr=1e-2)
                    opt.load_state_dict(saved)
                    opt.add_param_group({"params": list(model.parameters())[4:]})
                opt.zero_grad()
                model(torch.randn(8, 10)).sum().backward()
                opt.step()
    note = _notes(ei.value)
    assert "matches the saved state to the parameters by their position" in note and "resized" not in note
    (f,) = _explained(g)
    assert f.details["loaded_by_position"] is True and f.details["param_shape"] == [10, 10]


def test_optimizer_state_saved_before_pruning_and_loaded_after_names_prune_s_reordering():
    """The optimizer built before pruning, its state saved after; the resumed model is pruned (prune.identity) before
    its optimizer: prune re-registers `weight` as `weight_orig` last, so the state lands one parameter off and
    Adam raises "output with shape [16] doesn't match the broadcast shape [16, 16]"."""
    import io

    import torch.nn.utils.prune as prune

    def build(pruned):
        m = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
        if pruned:
            prune.identity(m[2], "weight")
        return m

    torch.manual_seed(0)
    model = build(False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 4), torch.randn(32, 2)
    with pytest.raises(RuntimeError) as ei:
        with guard(checks=["explain"], live=False) as g:
            for step in range(6):
                if step == 2:
                    prune.l1_unstructured(model[2], "weight", 0.5)
                if step == 4:
                    buf = io.BytesIO()
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
                    buf.seek(0)
                    ck = torch.load(buf)
                    model = build(True)
                    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
                    model.load_state_dict(ck["model"])
                    opt.load_state_dict(ck["opt"])
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
    assert "doesn't match the broadcast shape" in str(ei.value)
    (f,) = _explained(g)
    assert f.details["loaded_by_position"] is True and f.details["pruned"] == ["2.weight_orig"]
    assert "re-registers a pruned tensor as `<name>_orig`" in f.message and "prune.identity" in f.hint


def test_a_model_converted_to_another_dtype_with_its_optimizer_kept_is_explained():
    """`model.double()` mid-run with Adam's float32 moments kept: torch's error names `end` of a lerp."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(RuntimeError) as ei:
        with guard(model, opt, checks=["explain"], live=False) as g:
            for step in range(4):
                if step == 2:
                    model.double()
                x = torch.randn(8, 6, dtype=torch.float64 if step >= 2 else torch.float32)
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()
    note = _notes(ei.value)
    assert "is torch.float32 but the parameter is now torch.float64" in note and "model.double()" in note
    (f,) = _explained(g)
    assert f.step == 2 and f.details["param_dtype"] == "torch.float64"


def test_a_parameter_resized_while_an_old_graph_is_alive_is_explained():
    """An embedding's .data swapped for a larger tensor mid-run (what resize_token_embeddings does) while the last
    step's loss is still held: the next backward fails with "returned an invalid gradient ... got [44, 8] but
    expected shape compatible with [40, 8]", which names neither the parameter nor the resize."""
    torch.manual_seed(0)
    emb = nn.Embedding(40, 8)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    ids = torch.randint(0, 40, (4, 5))
    with pytest.raises(RuntimeError, match="invalid gradient") as ei:
        with guard(emb, opt, live=False) as g:
            for step in range(4):
                if step == 2:
                    grown = torch.zeros(44, 8)
                    grown[:40] = emb.weight.data
                    emb.weight.data = grown
                opt.zero_grad()
                loss = F.linear(emb(ids), emb.weight).logsumexp(-1).mean()
                loss.backward()
                opt.step()
    note = _notes(ei.value)
    assert "`weight` was resized after a graph over its old shape was built" in note and "del loss" in note
    (f,) = _explained(g)
    assert (f.where, f.step) == ("weight", 2) and f.details["recorded_shape"] == [40, 8]


def test_a_parameter_resized_after_the_optimizer_made_its_state_is_explained():
    """What resize_token_embeddings does mid-run: the Parameter stays, its .data grows; Adam's moments do not."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(RuntimeError) as ei:
        with guard(model, opt, checks=["explain"], live=False) as g:
            for step in range(3):
                if step == 2:
                    model[0].weight.data = torch.randn(13, 4)  # three tokens added
                opt.zero_grad()
                model(torch.randint(0, 10, (5, 3))).sum().backward()
                opt.step()
    note = _notes(ei.value)
    assert "Adam's state for `0.weight` (exp_avg: [10, 4]) no longer matches the parameter ([13, 4])" in note
    assert "build a new one after resizing" in note
    (f,) = _explained(g)
    assert f.where == "0.weight" and f.details["param_shape"] == [13, 4]


@pytest.mark.parametrize("scope", ["model", "global"])
@pytest.mark.parametrize("case", ["frozen", "force-term"])
def test_backward_on_a_tensor_without_a_graph_is_explained(case, scope):
    """"element 0 of tensors does not require grad and does not have a grad_fn": the model frozen whole, or a
    force loss made from torch.autograd.grad without create_graph=True."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    if case == "frozen":
        model.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError) as ei:
        with guard(*((model, opt) if scope == "model" else ()), checks=["explain"], live=False) as g:
            x = torch.randn(4, 3)
            if case == "frozen":
                loss = model(x).pow(2).mean()
            else:
                x.requires_grad_(True)
                force = -torch.autograd.grad(model(x).sum(), x)[0]  # the bug: no create_graph=True
                loss = force.pow(2).mean()
            loss.backward()
    note = _notes(ei.value)
    (f,) = _explained(g)
    assert f.where == "loss" and "got a tensor with no autograd graph" in note
    if case == "frozen":
        assert "every parameter of the model has requires_grad=False" in note and f.details["model_frozen"] is True
    else:
        assert "create_graph=True" in note and f.details["model_frozen"] is False


def test_a_second_derivative_of_a_first_one_taken_without_create_graph_is_explained_at_autograd_grad():
    """A PINN residual helper passing create_graph=False to the first derivative: u_x carries no graph, and the
    second torch.autograd.grad raises. Told at `torch.autograd.grad` with the create_graph fix, not at `loss` with
    the list of ways a loss loses its graph."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(RuntimeError) as ei:
        with guard(model, opt, checks=["explain"], live=False) as g:
            x = torch.rand(16, 1, requires_grad=True)
            u = model(x)
            u_x = torch.autograd.grad(u, x, torch.ones_like(u))[0]  # the bug: no create_graph=True
            torch.autograd.grad(u_x, x, torch.ones_like(u_x))
    note = _notes(ei.value)
    (f,) = _explained(g)
    assert f.where == "torch.autograd.grad" and f.details["autograd_grad"] is True
    assert "without create_graph=True" in note and "create_graph=True)[0], then u_xx" in f.hint


@pytest.mark.parametrize("scope", ["model", "global"])
def test_a_loss_from_a_no_grad_helper_names_the_model_call_made_without_gradients(scope):
    """An inference helper decorated @torch.no_grad() reused in the training loop: the model call inside it is named
    with its line, and the fix is to call the model with gradients on, not the generic list of ways to cut a graph."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @torch.no_grad()
    def forecast(x):
        return model(x)  # the call named

    line = forecast.__wrapped__.__code__.co_firstlineno + 2  # (the first line is the decorator's)
    with pytest.raises(RuntimeError) as ei:
        with guard(*((model, opt) if scope == "model" else ()), checks=["explain"], live=False) as g:
            loss = F.mse_loss(forecast(torch.randn(4, 3)), torch.randn(4, 1))
            loss.backward()
    note = _notes(ei.value)
    (f,) = _explained(g)
    assert f.where == "loss" and f.details["model_call_without_grad"].endswith(f"test_explain.py:{line}")
    assert "ran with gradient recording off" in note and "torch.enable_grad()" in f.hint


def test_a_weight_renormalised_between_forward_and_backward_is_named():
    """DistMult scores against `E.weight.t()` (saved for backward); the entity renormalisation under no_grad sits
    between the loss and backward(): the weight is named, and the fix moves the block below optimizer.step()."""

    class DistMult(nn.Module):
        def __init__(self):
            super().__init__()
            self.E, self.R = nn.Embedding(30, 8), nn.Embedding(4, 8)

        def forward(self, h, r):
            return (self.E(h) * self.R(r)) @ self.E.weight.t()

    torch.manual_seed(0)
    model = DistMult()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(RuntimeError):
        with guard(model, opt, checks=["explain"], live=False) as g:
            h, r = torch.randint(0, 30, (16,)), torch.randint(0, 4, (16,))
            loss = F.cross_entropy(model(h, r), (h + 1) % 30)
            with torch.no_grad():
                model.E.weight.div_(model.E.weight.norm(dim=1, keepdim=True))  # the bug: before backward()
            opt.zero_grad(); loss.backward(); opt.step()
    (f,) = _explained(g)
    assert f.details["parameter"] == "E.weight" and "it is the weight `E.weight`" in f.message
    assert "below optimizer.step()" in f.hint


@pytest.mark.parametrize("scope", ["model", "global"])
def test_backward_inside_no_grad_is_told_as_recording_off_although_explained_after_the_block(scope):
    """`with torch.no_grad(): loss = ...; loss.backward()`: explained once the exception has left the block, where
    recording is on again; the mode backward() ran under is the one told."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError) as ei:
        with guard(*((model, opt) if scope == "model" else ()), checks=["explain"], live=False) as g:
            with torch.no_grad():
                loss = F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 2, (8,)))
                loss.backward()
    (f,) = _explained(g)
    assert f.details["grad_enabled"] is False and "gradient recording is off where it ran" in _notes(ei.value)


@pytest.mark.parametrize("case", ["negative-scale", "nan-loc"])
def test_a_distribution_argument_out_of_its_range_is_explained(case):
    """A DeepAR-style head whose sigma is the raw output (no softplus), or a NaN mean from upstream."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError) as ei:
        with guard(model, checks=["explain"], live=False) as g:
            out = model(torch.randn(8, 3) * 10)
            loc = out[:, 0] * float("nan") if case == "nan-loc" else out[:, 0]
            scale = out[:, 1].abs() + 1 if case == "nan-loc" else out[:, 1]
            torch.distributions.Normal(loc, scale, validate_args=True).log_prob(torch.zeros(8)).mean().backward()
    note = _notes(ei.value)
    (f,) = _explained(g)
    assert f.where == "loss" and f.details["distribution"] == "Normal"
    if case == "negative-scale":
        assert "Normal's scale must satisfy GreaterThan" in note and "F.softplus(raw) + 1e-6" in note
    else:
        assert "Normal's loc holds NaN" in note and f.details["nan"] is True


class _Raises(nn.Module):
    def __init__(self, text):
        super().__init__()
        self.fc, self.text = nn.Linear(2, 2), text

    def forward(self, x):
        raise RuntimeError(self.text)


def test_a_conv_input_on_the_cpu_with_cuda_weights_is_a_device_mismatch_not_a_dtype_one():
    model = nn.Sequential(_Raises("Input type (torch.FloatTensor) and weight type (torch.cuda.FloatTensor) should "
                                  "be the same or input should be a MKLDNN tensor and weight is a dense tensor"))
    with pytest.raises(RuntimeError) as ei:
        with guard(model, checks=["explain"], live=False) as g:
            model(torch.randn(2, 2))
    assert "tensors on different devices" in _notes(ei.value) and "dtype" not in _notes(ei.value)
    assert _explained(g)[0].details["devices"] == ["cpu", "cuda"]


@pytest.mark.parametrize("shape,channels_last", [((32, 24, 3), True), ((2, 24, 24, 3), True), ((2, 1, 24, 24), False)])
def test_conv_channel_errors_say_channels_last_or_wrong_count(shape, channels_last):
    model = nn.Sequential(nn.Conv2d(3, 4, 3))
    with pytest.raises(RuntimeError) as ei:
        with guard(model, checks=["explain"], live=False) as g:
            model(torch.randn(*shape))  # an (H, W, C) image from OpenCV / NumPy; a grayscale batch
    note = _notes(ei.value)
    (f,) = _explained(g)
    assert f.where == "0" and f.details["channels_last"] is channels_last
    assert ("permute(0, 3, 1, 2)" in note and "permute(2, 0, 1).unsqueeze(0)" in note) if channels_last else (
        "has 3 input channels but its input [2, 1, 24, 24] has 1" in note)


@pytest.mark.parametrize("target,says,fix", [
    (lambda y: y.float(), "looks like class indices", "F.one_hot(target.long(), 5).float()"),
    (lambda y: torch.nn.functional.one_hot(y % 3).float(), "3 target columns for 5 outputs", "num_classes=5"),
    # a real-valued target of another width (a VAE's latent mean passed for the input): no one_hot fix (stop 41)
    (lambda y: torch.randn(16, 3), "holds values other than 0 and 1", "mse_loss(recon, x)"),
])
def test_elementwise_loss_with_class_indices_or_a_narrow_one_hot(target, says, fix):
    model = nn.Sequential(nn.Linear(8, 5))
    y = torch.arange(16) % 5
    with pytest.raises(RuntimeError) as ei:
        with guard(model, live=False) as g:
            nn.MSELoss()(model(torch.randn(16, 8)), target(y))
    note = _notes(ei.value)
    assert says in note and fix in note
    (f,) = _explained(g)
    assert f.where == "loss" and f.details["loss"] == "mse_loss" and f.details["input_shape"] == [16, 5]


def test_a_prediction_with_a_trailing_one_against_a_regression_target_is_not_called_class_indices():
    model = nn.Linear(24, 6)  # a forecaster of 6 horizons, its output unsqueezed to [B, H, 1]
    with pytest.raises(RuntimeError) as ei:
        with guard(model, live=False) as g:
            nn.functional.mse_loss(model(torch.randn(32, 24)).unsqueeze(-1), torch.randn(32, 6))
    note = _notes(ei.value)
    assert "trailing dimension of 1" in note and "squeeze(-1)" in note and "class indices" not in note
    assert _explained(g)[0].details["input_shape"] == [32, 6, 1]


def test_batchnorm_single_sample_value_error_type_kept():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.raises(ValueError) as ei:
        with guard(model, checks=["explain"], mode="raise", live=False) as g:
            model(torch.randn(1, 4))
    assert type(ei.value) is ValueError
    note = _notes(ei.value)
    assert "`1` (BatchNorm1d)" in note and "drop_last=True" in note
    assert _explained(g)[0].where == "1"


def test_cpu_out_of_memory_names_batch_and_largest_tensors():
    """A real allocation failure on the CPU: a layer asks for far more memory than the machine has."""
    class Tile(nn.Module):
        def forward(self, x):
            return x.repeat(2 ** 36, 1)  # 2**36 * 32 rows of 4096 floats

    model = nn.Sequential(nn.Linear(64, 4096), Tile())
    with pytest.raises(RuntimeError) as ei:
        with guard(model, checks="all", live=False) as g:
            model(torch.randn(32, 64))
    assert "can't allocate memory" in str(ei.value)
    note = _notes(ei.value)
    assert "`1` (Tile)" in note and "batch size 32" in note and "0.weight" in note and "torch.autocast" in note
    (f,) = _explained(g)
    assert f.where == "1" and "0.weight" in [t["name"] for t in f.details["largest_tensors"]]
    # the failed allocation's size, read from PyTorch's message, next to what is alive: one op asked for it all
    assert f.details["requested_bytes"] == 2 ** 36 * 32 * 4096 * 4 and f.details["live_bytes"] < 2 ** 30
    assert "asked for 32768.00 TiB" in note and f.hint.startswith("One operation asked for more than everything")


def test_cuda_oom_error_type_simulated():
    """Simulated: a module raises torch.OutOfMemoryError as the CUDA allocator would (no GPU here)."""
    class Alloc(nn.Module):
        def forward(self, x):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    model = nn.Sequential(nn.Linear(4, 4), Alloc())
    with pytest.raises(torch.OutOfMemoryError) as ei:
        with guard(model, checks=["explain"], live=False) as g:
            model(torch.randn(16, 4))
    assert "batch size 16" in _notes(ei.value)
    assert _explained(g)[0].where == "1" and _explained(g)[0].details["requested_bytes"] == 20 * 2 ** 30


class _BusErrorData(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        os.kill(os.getpid(), signal.SIGBUS)  # what a worker gets when /dev/shm is full (simulated cause)
        return torch.zeros(2)


@pytest.mark.skipif(not hasattr(signal, "SIGBUS"), reason="POSIX only")
def test_dataloader_worker_bus_error_shm():
    loader = torch.utils.data.DataLoader(_BusErrorData(), batch_size=2, num_workers=1, timeout=20)
    # PyTorch's own error, or (on a loaded machine) the closed connection the dead worker sent through
    with pytest.raises((RuntimeError, ConnectionError, EOFError)) as ei:
        with guard(checks=["explain"], live=False) as g:
            for _ in loader:
                pass
    note = _notes(ei.value)
    assert "/dev/shm" in note and "num_workers" in note, str(ei.value)
    assert _explained(g)[0].where == "DataLoader"


@pytest.mark.skipif(not hasattr(signal, "SIGBUS"), reason="POSIX only")
@pytest.mark.parametrize("error", [ConnectionResetError(104, "Connection reset by peer"), EOFError()])
def test_dataloader_worker_death_seen_as_a_closed_connection(monkeypatch, error):
    """The worker's death reaches the main process as the connection closing, before its exit code is read:
    still explained, with the signal read once the worker is reaped."""
    from torch.utils.data import dataloader

    def closed(self, timeout=None):
        raise error  # what receiving a batch from the dead worker raises when the pipe race goes this way

    monkeypatch.setattr(dataloader._MultiProcessingDataLoaderIter, "_try_get_data", closed)
    loader = torch.utils.data.DataLoader(_BusErrorData(), batch_size=2, num_workers=1, timeout=20)
    with pytest.raises(type(error)) as ei:
        with guard(checks=["explain"], live=False) as g:
            for _ in loader:
                pass
    assert "bus error" in _notes(ei.value) and "/dev/shm" in _notes(ei.value)
    (f,) = _explained(g)
    assert f.where == "DataLoader" and f.details["worker_signals"] == [signal.SIGBUS]


def test_dataparallel_attribute_error_hints_module():
    net = nn.Sequential()
    net.add_module("head", nn.Linear(4, 2))
    dp = nn.DataParallel(net)
    with pytest.raises(AttributeError) as ei:
        with guard(dp, checks="all", live=False) as g:
            dp.head.weight  # noqa: B018
    assert "model.module.head" in _notes(ei.value)
    (f,) = _explained(g)
    assert f.where == "DataParallel" and f.details["found_on_module"] is True


def test_wrapped_model_call_is_explained_once():
    import guard as gp

    wrapped = gp.wrap(nn.BatchNorm1d(3), checks=["explain"], live=False)
    with pytest.raises(ValueError) as ei:
        wrapped(torch.randn(1, 3))
    wrapped.guard.close()
    assert _notes(ei.value).count("guard:") == 1
    assert len(_explained(wrapped.guard)) == 1


def test_unknown_errors_untouched_and_hooks_removed():
    model = nn.Linear(4, 4)
    with pytest.raises(KeyError) as ei:
        with guard(model, checks="all", live=False) as g:
            model(torch.randn(2, 4))
            raise KeyError("mine")
    assert not getattr(ei.value, "__notes__", None) and g.findings == []
    # the saved-tensor hooks are gone: PyTorch's own check works again
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


# ---------------------------------------------------------------------- torchsnooper traces on demand
class LogLayer(nn.Module):
    def forward(self, x):
        y = x * 2
        z = torch.log(y)  # NaN for negative inputs
        return z


class LoopLayer(nn.Module):
    def forward(self, x):
        for _ in range(300):
            x = x + 0
        return torch.log(x)


def _train_log_model(steps=3, layer=None, **opts):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), layer or LogLayer(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with guard(model, opt, **opts) as g:
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
    return g, model


def _nonfinite_output(g):
    (f,) = [f for f in g.findings if f.kind == "nonfinite-output"]
    return f


def test_snoop_traces_the_module_line_that_made_nan(capsys):
    pytest.importorskip("torchsnooper")
    g, model = _train_log_model(snoop=True, live=True)
    f = _nonfinite_output(g)
    assert f.where == "1" and f.step == 0 and f.details["trace_step"] == 1
    trace = "\n".join(f.details["trace"])
    assert "z = torch.log(y)" in trace and "has_nan" in trace
    assert f.details["trace_first_nonfinite"].startswith("line ")
    assert "torch.log(y)" in f.details["trace_first_nonfinite"]
    err = capsys.readouterr().err
    assert err.count("torchsnooper trace of `1`") == 1 and "first NaN/Inf: line" in err
    assert "forward" not in vars(model[1])  # the one-call instance attribute is gone


def test_snoop_env_var_and_cap(monkeypatch):
    pytest.importorskip("torchsnooper")
    from guard.checks import snoop

    monkeypatch.setenv("TORCH_GUARD_SNOOP", "1")
    g, model = _train_log_model(layer=LoopLayer(), live=False)
    trace = _nonfinite_output(g).details["trace"]
    assert len(trace) == snoop.MAX_LINES + 1 and "capped" in trace[-1]


def test_snoop_off_by_default_no_trace():
    g, model = _train_log_model(live=False)
    assert "trace" not in _nonfinite_output(g).details


def test_snoop_without_torchsnooper_says_so_once_and_carries_on(monkeypatch, capsys):
    import sys

    from guard.checks import snoop

    monkeypatch.setitem(sys.modules, "torchsnooper", None)  # simulated: the import fails
    monkeypatch.setattr(snoop, "_said", set())
    for _ in range(2):
        g, _m = _train_log_model(snoop=True, live=False)
        assert "trace" not in _nonfinite_output(g).details and g.step == 3
    err = capsys.readouterr().err
    assert err.count("torchsnooper cannot be imported") == 1
    assert len([ln for ln in err.splitlines() if "torchsnooper" in ln]) == 1


# ---------------------------------------------------------------------- demos
@pytest.mark.parametrize("name, kind, where", [
    ("inplace_saved", "explained-error", "0.gate"),
    ("state_dict_prefix", "state-dict-mismatch", "Sequential"),
])
def test_demos_buggy_and_clean_twin(name, kind, where, capsys):
    import importlib

    demo = importlib.import_module(f"demos.{name}")
    g = demo.train(checks="all", live=False)
    assert [(f.kind, f.where) for f in g.findings] == [(kind, where)]
    assert "guard: " in capsys.readouterr().out  # the note is shown with the crash
    assert demo.train(fixed=True, checks="all", live=False).findings == []


def test_torch_func_transforms_still_work_under_the_guard():
    """torch.func refuses saved-tensor hooks: guard pushes them only around model calls, never inside a transform."""
    from torch.func import functional_call, grad

    model = nn.Linear(3, 1)
    params = dict(model.named_parameters())
    x = torch.randn(4, 3)
    with guard(model, checks="all", live=False) as g:
        g1 = grad(lambda p: functional_call(model, p, (x,)).sum())(params)
        g2 = torch.func.grad(lambda t: t.sin().pow(2).sum())(x)
    assert torch.allclose(g1["weight"], x.sum(0, keepdim=True)) and g2.shape == x.shape
    assert g.findings == []


def test_torch_func_inside_the_models_forward_runs_under_the_default_guard():
    class UsesFunc(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, x):
            g = torch.func.grad(lambda z: (z.sin() * z).sum())(x)
            jac = torch.func.jacrev(lambda z: z.cos())(x[0])
            return self.lin(x + g) + jac.sum()

    torch.manual_seed(0)
    model = UsesFunc()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, live=False) as g:
        for _ in range(3):
            loss = model(torch.randn(2, 3)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # nothing left pushed
    assert g.findings == [] and g.internal_errors == [] and g.step == 3


def test_a_plain_tensor_attribute_left_behind_by_a_move_is_named_with_register_buffer():
    class PosEncoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.pos = torch.linspace(0, 1, 8)  # a plain attribute: module moves leave it behind

        def forward(self, x):
            return self.proj(x + self.pos)

    with torch.device("meta"):
        model = nn.Sequential(PosEncoder(), nn.ReLU())
    model.to_empty(device="cpu")  # parameters to the CPU; `pos` stays on meta
    with pytest.raises(RuntimeError) as info:
        with guard(model, live=False) as g:
            model(torch.randn(2, 8))
    [f] = [f for f in g.findings if f.kind == "explained-error"]
    assert f.where == "0" and "`0.pos` (meta) is a plain tensor attribute" in f.message
    assert "self.register_buffer('pos', tensor, persistent=False)" in f.hint
    assert f.details["plain_attributes"] == ["0.pos"]
    assert any("register_buffer" in n for n in info.value.__notes__)


def test_an_unassigned_tensor_conversion_is_named_in_the_dtype_fix():
    model = nn.Linear(4, 1).double()
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError) as ei:
        with guard(model, live=False) as g:
            x.double()  # the bug: the float64 copy is thrown away
            model(x)
    (f,) = _explained(g)
    assert "float64 parameters" in f.message and "a bare `x.double()` changes nothing" in f.hint
    assert "x = x.double()" in _notes(ei.value)


def test_an_earlier_steps_graph_reached_through_a_carried_hidden_state_is_told_to_detach_it():
    """TBPTT without detach, 'fixed' with retain_graph=True: the second backward runs through step 0's graph,
    whose saved LSTM weight optimizer.step() changed. The fix is detaching the state, not an out-of-place op."""
    torch.manual_seed(0)
    rnn = nn.LSTM(4, 8, batch_first=True)
    opt = torch.optim.SGD(rnn.parameters(), 0.1)
    state = None
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
        with guard(rnn, opt, live=False) as g:
            for _ in range(3):
                y, state = rnn(torch.randn(2, 5, 4), state)
                loss = y.pow(2).mean()
                opt.zero_grad()
                loss.backward(retain_graph=True)
                opt.step()
    f = [f for f in g.findings if f.kind == "explained-error"]
    assert len(f) == 1 and f[0].step == 1 and f[0].where == "LSTM"
    assert "saved by step 0's forward" in f[0].message and "state.detach()" in f[0].hint
    assert "retain_graph=True" in f[0].hint and "out-of-place" not in f[0].hint
    assert any("state.detach()" in n for n in info.value.__notes__)


def test_a_memory_carried_without_detach_reaches_a_transposed_weight_of_an_earlier_step():
    """An external memory written each step and read at the next, not detached: the backward reaches the previous
    step's graph, where Linear saved ``weight.t()`` (a view of the weight, not the Parameter) that the update changed."""
    torch.manual_seed(0)

    class Memory(nn.Module):
        def __init__(self):
            super().__init__()
            self.read, self.write = nn.Linear(8, 1), nn.Linear(8, 8)

        def forward(self, x, mem):
            return self.read(mem + x), torch.tanh(self.write(mem + x))

    model = Memory()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        with guard(model, opt, live=False) as g:
            mem = torch.zeros(4, 8)
            for _ in range(3):
                out, mem = model(torch.randn(4, 8), mem)  # the bug: mem = mem.detach() is missing
                opt.zero_grad()
                out.pow(2).mean().backward()
                opt.step()
    (f,) = [f for f in g.findings if f.kind == "explained-error"]
    assert f.where == "write" and "saved by step 1's forward" in f.message and "external memory" in f.message
    assert "state = state.detach()" in f.hint and "out-of-place" not in f.hint


def test_torch_func_nested_in_another_transform_inside_a_model_call_still_runs():
    """A Hamiltonian network's forward takes vmap(grad(H)): the saved-tensor hooks guard puts around the first
    steps' model calls must be lifted for the inner grad too (torch.func refuses any), though a transform is on."""
    from torch.func import grad, vmap

    class HNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.H = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))

        def forward(self, x):
            return vmap(grad(lambda xi: self.H(xi).squeeze()))(x)

    def run(guarded):
        torch.manual_seed(0)
        m = HNN()
        opt = torch.optim.Adam(m.parameters(), 1e-2)
        with (guard(m, opt, live=False) if guarded else contextlib.nullcontext()) as g:
            for _ in range(4):
                loss = (m(torch.randn(8, 2)) - 1).pow(2).mean()  # raised "don't yet support saved tensor hooks"
                opt.zero_grad()
                loss.backward()
                opt.step()
        return [p.detach().clone() for p in m.parameters()], g

    plain, _ = run(False)
    guarded, g = run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, guarded)) and g.findings == [] and g.internal_errors == []


def test_the_users_own_saved_tensor_hooks_around_a_model_call_run_from_the_first_step():
    """Hooks entered around `model(x)` (fp16 activation packing, save_on_cpu offload) must not be shadowed by
    guard's own for the first steps (the innermost hooks win): the numbers would change, the offload be off."""
    packs = []

    def pack(t):
        packs.append(1)
        return t.to(torch.float16), t.dtype

    def unpack(p):
        return p[0].to(p[1])

    def run(guarded):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        counts = []
        with (guard(m, opt, live=False) if guarded else contextlib.nullcontext()):
            for _ in range(3):
                del packs[:]
                with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                    loss = m(torch.randn(16, 8)).pow(2).mean()
                counts.append(len(packs))
                opt.zero_grad()
                loss.backward()
                opt.step()
        return [p.detach().clone() for p in m.parameters()], counts

    plain, plain_counts = run(False)
    guarded, counts = run(True)
    assert counts == plain_counts and counts[0] > 0
    assert all(torch.equal(a, b) for a, b in zip(plain, guarded))


@pytest.mark.parametrize("scope", ["model", "global"])
def test_a_detached_optimised_input_through_a_frozen_model_is_a_cut_graph_not_a_frozen_model(scope):
    """An adversarial patch optimised against a classifier frozen on purpose, pasted with .detach(): the optimizer
    trains the patch, so the fix is not to unfreeze the model but to keep the patch in the graph."""
    torch.manual_seed(0)
    clf = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3)).eval().requires_grad_(False)
    patch = torch.rand(4, requires_grad=True)
    opt = torch.optim.Adam([patch], lr=0.05)
    with pytest.raises(RuntimeError) as ei:
        with guard(*((clf, opt) if scope == "model" else ()), checks=["explain"], live=False) as g:
            x = torch.rand(8, 16)
            x[:, :4] = patch.detach()  # the bug
            loss = F.cross_entropy(clf(x), torch.full((8,), 2))
            opt.zero_grad()
            loss.backward()
    note = _notes(ei.value)
    (f,) = _explained(g)
    assert f.details["model_frozen"] is False and "cut from the model's graph" in note
    assert "requires_grad=False (frozen)" not in note


def test_a_running_ensemble_of_this_epochs_outputs_is_detached_as_a_whole():
    """Temporal ensembling: `ep[b] = out.softmax(1)` keeps each batch's graph, and `Z = 0.6 * Z + 0.4 * ep` carries it
    into the next epoch's targets. Detaching the old Z alone still leaves `ep`'s graphs in the new one: the fix
    detaches the carried value as it is computed."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.Adam(net.parameters(), 2e-3)
    x = torch.randn(40, 8)
    Z, zt = torch.zeros(40, 3), torch.zeros(40, 3)
    with pytest.raises(RuntimeError) as ei:
        with guard(net, opt, checks=["explain"], live=False) as g:
            for epoch in range(3):
                ep = torch.zeros(40, 3)
                for i in range(0, 40, 20):
                    out = net(x[i:i + 20])
                    loss = F.mse_loss(out.softmax(1), zt[i:i + 20])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    ep[i:i + 20] = out.softmax(1)
                Z = 0.6 * Z + 0.4 * ep
                zt = Z / (1 - 0.6 ** (epoch + 1))
    (f,) = _explained(g)
    assert f.where == "Z" and "Z = (0.6 * Z + 0.4 * ep).detach()" in f.hint and "`ep`" in f.hint, f.hint
    assert "Z = (0.6 * Z + 0.4 * ep).detach()" in _notes(ei.value)


def test_an_optimised_input_saved_by_an_earlier_steps_graph_is_told_as_a_carried_graph():
    """A forward hook keeps a term of every step in a list never cleared, and backward(retain_graph=True) runs
    through them again: the graph of step 0 saved the optimised input, which Adam has changed since."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).requires_grad_(False)
    feats = []
    net[0].register_forward_hook(lambda m, i, o: feats.append(i[0].pow(2).mean()))
    x = torch.randn(4, 8, requires_grad=True)
    opt = torch.optim.Adam([x], lr=0.05)
    with pytest.raises(RuntimeError) as ei:
        with guard(net, opt, checks=["explain"], live=False) as g:
            for _ in range(3):
                loss = F.cross_entropy(net(x), torch.tensor([0, 1, 2, 0])) + 0.1 * sum(feats)
                opt.zero_grad()
                loss.backward(retain_graph=True)
                opt.step()
    (f,) = _explained(g)
    assert f.details["saved_at_step"] == 0 and f.details["weight"] is False
    assert "an input the optimizer updates" in f.message and "retain_graph" in f.hint and ".clone()" not in f.hint
    assert "earlier step" in _notes(ei.value)


def test_mixed_class_indices_as_float_targets_are_not_told_to_be_cast_to_long():
    """Mixup applied to the class indices (`lam * y + (1 - lam) * y[perm]`): float targets holding fractions.
    `.long()` would truncate them without a word; the fix mixes one-hot targets (or the losses)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    y, perm = torch.tensor([0, 1, 2, 1, 0]), torch.tensor([1, 2, 0, 4, 3])
    with pytest.raises(RuntimeError, match="expected target dtype") as ei:
        with guard(model, opt, live=False) as g:
            mixed = 0.7 * y.float() + 0.3 * y[perm].float()
            nn.functional.cross_entropy(model(torch.randn(5, 4)), mixed).backward()
    (f,) = _explained(g)
    assert f.details["target_dtype"] == "Float" and f.details["fractional_targets"] is True
    assert "y.long()" not in f.hint and "F.one_hot(y, C)" in f.hint and "0.3, 1.3" in f.message
    assert "F.one_hot(y, C)" in _notes(ei.value)


def _carried(kind):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    W = nn.Parameter(torch.randn(3, 3) * 0.1)
    opt.add_param_group({"params": [W]})
    q, h = torch.ones(3) / 3, torch.zeros(3)
    with pytest.raises(RuntimeError, match="backward through the graph a second time") as ei:
        with guard(model, opt, live=False) as g:
            for _ in range(3):
                out = model(torch.randn(8, 4))
                if kind == "dro":
                    gloss = out.pow(2).mean(0)
                    q = q * torch.exp(0.01 * gloss)  # carried: group DRO's weights
                    q = q / q.sum()
                    loss = gloss @ q
                else:
                    for t in range(4):
                        h = torch.tanh(h @ W + out[t])  # carried: a hand-written RNN over the batches
                    loss = h.pow(2).sum()
                opt.zero_grad()
                loss.backward()
                opt.step()
    (f,) = _explained(g)
    return f, _notes(ei.value)


def test_a_carried_value_updated_with_torch_math_is_detached_as_computed_unless_it_is_a_recurrence():
    """Group DRO's `q = q * torch.exp(eta * gloss)` mixes this step's loss into the carried weights: the fix detaches
    the update as it is computed, naming `gloss` (detaching `q` alone would leave gloss's graph in it). A recurrence
    written by hand, `h = torch.tanh(h @ W + x)` with W a weight, keeps its graph within a step: the fix is truncated
    backpropagation through time, `h = h.detach()` between steps."""
    f, notes = _carried("dro")
    assert f.where == "q" and "q = (q * torch.exp(0.01 * gloss)).detach()" in f.hint and "`gloss`" in f.hint
    f, notes = _carried("rnn")
    assert f.where == "h" and "h = h.detach()" in f.hint and "truncated backpropagation" in f.hint


def test_a_list_of_cached_outputs_gets_the_append_a_detached_value_fix():
    """Hidden states appended to a list attribute with their graphs and read back by a later step's loss: the fix
    stores detached values in the list, not an assignment to an element that the code never makes."""
    torch.manual_seed(0)

    class Cached(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.cache_h = []

        def forward(self, x):
            h = self.lin(x)
            if self.cache_h:
                h = h + self.cache_h[-1]
            self.cache_h.append(h[0])
            return h

    m = Cached()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        with guard(m, opt, live=False) as g:
            for _ in range(3):
                opt.zero_grad()
                m(torch.randn(2, 4)).pow(2).sum().backward()
                opt.step()
    (f,) = _explained(g)
    assert f.where.endswith("cache_h[...]") and "cache_h.append(x.detach())" in f.hint and "= ....detach()" not in f.hint


def test_integer_targets_of_a_binary_cross_entropy_are_explained():
    """Ordinal levels built with a comparison and .long(), given to BCEWithLogitsLoss: PyTorch says only that the
    result type Float cannot be cast to Long. Explained at the loss, with the .float() fix."""
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    y = torch.randint(0, 5, (16,))
    with pytest.raises(RuntimeError, match="can't be cast to the desired output type") as ei:
        with guard(model, opt, live=False) as g:
            levels = (y.unsqueeze(1) > torch.arange(4)).long()
            nn.functional.binary_cross_entropy_with_logits(model(torch.randn(16, 6)), levels).backward()
    (f,) = _explained(g)
    assert f.where == "loss" and f.details["target_dtype"] == "int64" and "y.float()" in f.hint
    assert "y.float()" in _notes(ei.value)


@pytest.mark.parametrize("form", ["local", "reduced local"])
def test_a_module_memory_carried_through_a_local_is_named_at_its_assignment(form):
    """`mem = self.memory + f(x); self.memory = mem` (or `self.memory = mem.mean(0)` after a loop over `mem`): the
    second backward runs through the previous batch's graph. The one-line form `self.memory = self.memory + ...`
    was named; through a local it got the generic "something from an earlier step" message at `backward`."""
    torch.manual_seed(0)

    class Mem(nn.Module):
        def __init__(self):
            super().__init__()
            self.write, self.out = nn.Linear(8, 8), nn.Linear(8, 2)
            self.memory = torch.zeros(1, 8)

        def forward(self, x):
            mem = self.memory + torch.tanh(self.write(x)).mean(0, keepdim=True)
            self.memory = mem
            return self.out(x * torch.sigmoid(mem))

    class Reduced(Mem):
        def forward(self, x):
            mem = self.memory.expand(len(x), -1)
            mem = mem + torch.tanh(self.write(x))
            self.memory = mem.mean(0, keepdim=True)
            return self.out(x * torch.sigmoid(self.memory))

    net = Mem() if form == "local" else Reduced()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(RuntimeError):
        with guard(net, opt, live=False) as g:
            for _ in range(3):
                loss = F.cross_entropy(net(torch.randn(16, 8)), torch.randint(0, 2, (16,)))
                opt.zero_grad()
                loss.backward()
                opt.step()
    (f,) = [f for f in g.findings if f.kind == "explained-error"]
    assert (f.where, f.step) == ("net.memory", 1) and f.details["holder"] == "net.memory"
    want = "`self.memory = mem`" if form == "local" else "`self.memory = mem.mean(0, keepdim=True)`"
    assert want in f.message and "self.memory = " in f.hint and ".detach()" in f.hint


def test_the_tensor_the_loss_reads_is_named_not_the_one_it_was_stacked_from():
    """An echo-state network run once with autograd on: `H = torch.stack(states)` keeps the reservoir's graph, and
    the readout's second backward runs through it. `h` (the loop's last state) was named, and detaching it as the
    fix said left the error; `H`, which the loss reads and whose graph reaches `h`'s, is the one to detach."""
    torch.manual_seed(0)
    res = nn.Linear(8, 8)
    h, states = torch.zeros(8), []
    for _ in range(20):
        h = torch.tanh(res(h) + 0.1)
        states.append(h)
    H = torch.stack(states)
    readout = nn.Linear(8, 1)
    opt = torch.optim.Adam(readout.parameters(), lr=1e-2)
    with pytest.raises(RuntimeError):
        with guard(readout, opt, live=False) as g:
            for _ in range(3):
                loss = readout(H[:10]).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    (f,) = [f for f in g.findings if f.kind == "explained-error"]
    assert (f.where, f.step) == ("H", 1) and "`H`, a tensor made before the last backward()" in f.message
    assert "H = ....detach()" in f.hint


def test_points_pruned_with_their_adam_state_left_unmasked_are_explained_by_the_group_name():
    """3D Gaussian splatting's pruning: the points' parameter is replaced by its kept rows and the Adam state moved
    onto it without masking the moments. The param group is named ("xyz"), as the 3DGS code names them."""
    torch.manual_seed(0)
    xyz = nn.Parameter(torch.randn(40, 2))
    opt = torch.optim.Adam([{"params": [xyz], "lr": 1e-2, "name": "xyz"}])
    target = torch.randn(40, 2)
    with pytest.raises(RuntimeError) as ei:
        with guard(live=False) as g:
            for step in range(4):
                if step == 2:  # prune: keep 13 points, move the state without masking it
                    keep = torch.arange(13)
                    new = nn.Parameter(xyz.detach()[keep])
                    state = opt.state.pop(xyz)
                    opt.param_groups[0]["params"][0] = new
                    opt.state[new] = state
                    xyz, target = new, target[keep]
                loss = (xyz - target).pow(2).sum()
                opt.zero_grad()
                loss.backward()
                opt.step()
    note = _notes(ei.value)
    assert "Adam's state for `xyz` (exp_avg: [40, 2]) no longer matches the parameter ([13, 2])" in note
    assert "pruned or added" in note and "state[k][keep]" in note
    (f,) = _explained(g)
    assert f.where == "xyz" and f.details["rows_changed"] is True


def test_an_optimised_leaf_whose_name_is_rebound_to_a_value_made_from_it_is_explained():
    """Camera rotation as a plain quaternion leaf, "normalised" each iteration by re-binding its name,
    `q = F.normalize(q)`: the next iteration builds on the last one's graph, whose saved leaf Adam has updated since.
    No module saved it, so the error was explained with the generic make-it-out-of-place fix."""
    torch.manual_seed(0)
    x = torch.randn(20, 4)
    target = torch.randn(20)
    q = torch.tensor([1.0, 0.0, 0.0, 0.0], requires_grad=True)
    opt = torch.optim.Adam([q], lr=1e-2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as ei:
        with guard(live=False) as g:
            for _ in range(5):
                q = F.normalize(q, dim=0)
                loss = F.mse_loss(x @ q, target)
                opt.zero_grad()
                loss.backward(retain_graph=True)
                opt.step()
    note = _notes(ei.value)
    assert "it is `q`, the tensor Adam optimises" in note and "qn = F.normalize(q)" in note
    (f,) = _explained(g)
    assert f.where == "q" and f.step == 1 and f.details["optimised_tensor"] == "q"


# --------------------------------------------------------------------------- beginners' loss errors (stop 39)

def _classifier_step(loss_fn, x, y, model=None):
    torch.manual_seed(0)
    model = model or nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises((RuntimeError, ValueError)) as ei:
        with guard(model, opt, live=False) as g:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
    return _explained(g)[0], ei.value


def test_bceloss_on_logits_is_told_to_use_bce_with_logits():
    f, exc = _classifier_step(nn.BCELoss(), torch.randn(16, 5) * 10, torch.rand(16, 1).round())
    assert f.where == "loss" and f.details["logits_given"] is True
    assert "BCEWithLogitsLoss" in f.hint and "BCEWithLogitsLoss" in _notes(exc)


@pytest.mark.parametrize("bug", ["no_update", "step_twice"])
def test_a_grad_scaler_without_update_is_told_to_call_update(bug):
    """GradScaler's record of each optimizer (unscaled, stepped) is reset only by update(): without it the next
    iteration's unscale_() raises "unscale_() is being called after step()", and a second scaler.step() "step() has
    already been called since the last update()", neither naming the missing call."""
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(RuntimeError) as ei:
        with guard(model, opt, live=False) as g:
            for _ in range(3):
                opt.zero_grad()
                scaler.scale(model(torch.randn(8, 4)).pow(2).mean()).backward()
                if bug == "no_update":
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                if bug == "step_twice":
                    scaler.step(opt)
    [f] = _explained(g)
    assert f.where == "GradScaler" and f.details["missing_update"] is True
    assert f.details["call"] == ("unscale_" if bug == "no_update" else "step") and f.step == 1
    assert "scaler.update()" in f.hint and "scaler.update()" in _notes(ei.value)


def test_integer_one_hot_targets_into_cross_entropy_are_told_as_such():
    model = nn.Sequential(nn.Linear(5, 3))
    f, _ = _classifier_step(nn.CrossEntropyLoss(), torch.randn(16, 5), F.one_hot(torch.randint(0, 3, (16,)), 3),
                            model)
    assert f.details["one_hot_integers"] is True and f.details["target_dtype"] == "Long"
    assert "argmax(1)" in f.hint and ".float()" in f.hint


def test_a_reshape_that_merges_samples_is_told_by_the_batch_sizes():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(x.view(-1, 4))  # the bug: [32, 16] -> [128, 4], four rows per sample

    f, _ = _classifier_step(nn.CrossEntropyLoss(), torch.randn(32, 16), torch.randint(0, 3, (32,)), Net())
    assert (f.details["input_batch"], f.details["target_batch"]) == (128, 32)
    assert "4 rows per sample" in f.message and "x.view(x.size(0), -1)" in f.hint


def test_a_bare_squeeze_on_a_batch_of_one_is_named():
    model = nn.Sequential(nn.Linear(5, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError):
        with guard(model, opt, live=False) as g:
            for n in (8, 8, 1):  # the last batch holds one sample
                opt.zero_grad()
                F.binary_cross_entropy_with_logits(model(torch.randn(n, 5)).squeeze(), torch.rand(n)).backward()
                opt.step()
    (f,) = _explained(g)
    assert f.step == 2 and f.details["batch_of_one"] is True and "squeeze(-1)" in f.hint


def test_adam_state_after_columns_were_added_names_the_variable_and_the_columns():
    """A sparse autoencoder's dictionary doubled mid-run by replacing `.data` (plain parameters, no module): the
    moments keep the old width. Named by the variable, told as columns added, not as resize_token_embeddings."""
    torch.manual_seed(0)
    W_enc, b_enc = nn.Parameter(torch.randn(8, 16) * 0.1), nn.Parameter(torch.zeros(16))
    W_dec = nn.Parameter(torch.randn(16, 8) * 0.1)
    opt = torch.optim.Adam([W_enc, b_enc, W_dec], lr=1e-3)
    with pytest.raises(RuntimeError) as ei:
        with guard(None, opt, live=False) as g:
            for step in range(6):
                x = torch.randn(32, 8)
                f = torch.relu(x @ W_enc + b_enc)
                loss = (f @ W_dec - x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                if step == 2:
                    del f, loss  # no graph over the old shapes left (else backward fails first)
                    with torch.no_grad():
                        W_enc.data = torch.cat([W_enc.data, torch.randn(8, 16) * 0.1], 1)
                        b_enc.data = torch.cat([b_enc.data, torch.zeros(16)])
                        W_dec.data = torch.cat([W_dec.data, torch.randn(16, 8) * 0.1])
    (f,) = _explained(g)
    assert f.where == "W_enc" and f.details["columns_changed"] is True
    assert "resize_token_embeddings" not in f.message and "dim=1" in f.hint and "W_enc" in _notes(ei.value)


def test_a_one_cycle_schedule_sized_per_epoch_and_stepped_per_batch_is_told_to_size_it_from_the_loop():
    """OneCycleLR raises "Tried to step 21 times. The specified number of total steps is 20" once stepped past
    its total_steps: the usual cause is total_steps set to the number of epochs while step() runs per batch."""
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=5)
    with pytest.raises(ValueError) as ei:
        with guard(model, opt, live=False) as g:
            for _epoch in range(5):
                for _batch in range(4):
                    x = torch.randn(8, 4)
                    loss = F.cross_entropy(model(x), (x[:, 0] > 0).long())
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    sched.step()
    [f] = _explained(g)
    assert f.where == "OneCycleLR" and f.details["total_steps"] == 5 and f.details["stepped"] == 6
    assert "steps_per_epoch=len(train_loader)" in f.hint and "steps_per_epoch" in _notes(ei.value)
    path, line = f.source.rsplit(":", 1)
    assert open(path).read().splitlines()[int(line) - 1].strip() == "sched.step()"


def test_autograd_grad_inside_a_function_decorated_no_grad_is_told_at_the_decorator_not_the_loss():
    """A Langevin sampler decorated @torch.no_grad() (copied from a sampling helper): the exception leaves the
    decorated function with recording back on, so the mode is taken where torch.autograd.grad raised. It was told
    at `loss` as a graph cut by .detach()/.item() until stop 41."""
    energy = nn.Sequential(nn.Linear(2, 16), nn.SiLU(), nn.Linear(16, 1))
    opt = torch.optim.Adam(energy.parameters(), lr=1e-4)

    @torch.no_grad()
    def sample(x):
        x = x.clone().requires_grad_(True)
        g, = torch.autograd.grad(energy(x).sum(), x)
        return (x - 0.05 * g).detach()

    with pytest.raises(RuntimeError) as ei:
        with guard(energy, opt, live=False) as g:
            neg = sample(torch.randn(8, 2))
            loss = energy(torch.randn(8, 2)).mean() - energy(neg).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    (f,) = _explained(g)
    assert f.where == "torch.autograd.grad" and f.details["grad_enabled"] is False
    assert "@torch.no_grad()" in f.hint and "torch.enable_grad()" in _notes(ei.value)


def test_autograd_grad_of_a_non_scalar_model_output_gets_grad_outputs_not_mean():
    """`torch.autograd.grad(H(x), x)` with H(x) of shape [N, 1]: the derivative of each sample's output. The fix was
    the unreduced-loss one, `.mean()`, which divides every derivative by N (until stop 41)."""
    energy = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))
    x = torch.randn(64, 2, requires_grad=True)
    with pytest.raises(RuntimeError) as ei:
        with guard(energy, live=False) as g:
            torch.autograd.grad(energy(x), x, create_graph=True)
    (f,) = _explained(g)
    assert f.where == "torch.autograd.grad" and "grad_outputs=torch.ones_like(out)" in f.hint
    assert "not out.mean()" in _notes(ei.value)


def test_a_custom_function_returning_too_few_gradients_is_named_with_the_none_fix():
    """A gradient reversal Function whose backward returns only the input's gradient, not None for its lambda:
    "function RevBackward returned an incorrect number of gradients (expected 2, got 1)"."""
    class Rev(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, lam):
            ctx.lam = lam
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return -ctx.lam * g

    model = nn.Linear(4, 2)
    with pytest.raises(RuntimeError) as ei:
        with guard(model, live=False) as g:
            Rev.apply(model(torch.randn(3, 4)), 0.5).sum().backward()
    (f,) = _explained(g)
    assert f.where == "Rev" and f.details == {**f.details, "expected": 2, "returned": 1}
    assert "return grad_x, None" in f.hint and "Rev" in _notes(ei.value)


@pytest.mark.parametrize("layer", [nn.Embedding, nn.EmbeddingBag])
def test_hashed_ids_far_past_an_embedding_table_get_the_modulo_fix(layer):
    """Hashed ids with no `% num_embeddings`: the EmbeddingBag's own errors ("... not in the valid range [0, 4096)",
    "Expected i < index_size") got no note until stop 41, and a table of 31M rows was the fix for both."""
    torch.manual_seed(0)
    emb = layer(4096, 1) if layer is nn.Embedding else layer(4096, 1, mode="sum")
    ids = (torch.randint(0, 10 ** 6, (24,)) * 31).view(8, 3)
    with pytest.raises((IndexError, RuntimeError)) as ei:
        with guard(emb, live=False) as g:
            emb(ids).sum().backward()
    (f,) = _explained(g)
    assert f.details["hashed_ids"] is True and "`ids % 4096`" in f.hint and "ids % 4096" in _notes(ei.value)


@pytest.mark.parametrize("given", [True, False])
def test_a_max_norm_embedding_used_before_its_lookup_is_named_as_renormalising_itself(given):
    """`proj(emb.weight)` then `emb(ids)` with max_norm: the lookup renormalises the rows in place inside its own
    forward. The message said a `torch.no_grad()` block sat between the loss and backward(), with a move-it fix; no
    such block exists (stop 45: the max_norm renormalisation and the documented `.clone()`)."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(30, 8, max_norm=1.0)
            self.proj = nn.Linear(8, 8)

        def forward(self, ids):
            return self.proj(self.emb.weight).sum() + self.emb(ids).sum()

    model = Net()
    with torch.no_grad():
        model.emb.weight.mul_(5)  # rows above the max norm: the lookup renormalises them
    with pytest.raises(RuntimeError) as ei:
        with guard(model if given else None, live=False) as g:
            model(torch.arange(10)).backward()
    (f,) = _explained(g)
    assert "max_norm=1" in f.message and "`emb.weight`" in f.message and "emb.weight.clone()" in f.hint
    assert "no_grad" not in f.hint and f.details["max_norm"] == 1.0
    assert "emb.weight.clone()" in _notes(ei.value)


def test_ids_numbered_from_one_get_the_shift_not_a_bigger_table():
    """User ids 1..N into `nn.Embedding(N, d)`: the fix was a table of N + 1 rows, which turns the crash into a silent
    row 0 that never trains (stop 45: the shift `ids - 1`)."""
    emb = nn.Embedding(50, 4)
    ids = torch.cat([torch.randint(1, 50, (15,)), torch.tensor([50])])
    with pytest.raises((IndexError, RuntimeError)) as ei:
        with guard(emb, live=False) as g:
            emb(ids).sum().backward()
    (f,) = _explained(g)
    assert "numbered from 1" in f.message and "`ids - 1`" in f.hint and "at least 51" not in f.hint
    assert "`ids - 1`" in _notes(ei.value)


def test_embedding_bag_lengths_passed_as_offsets_are_named_as_offsets():
    """Bag lengths passed as EmbeddingBag offsets ("Expected i < index_size"): every index fits the table, yet the
    message said "got index 4,
    outside [0, 1000) ...: a negative index" with a bigger table as the fix (stop 45: the offsets, with the cumsum fix)."""
    bag = nn.EmbeddingBag(100, 4, mode="mean")
    lengths = torch.tensor([5, 3, 7, 2])
    flat = torch.randint(0, 100, (int(lengths.sum()),))
    offsets = torch.cat([lengths.new_zeros(1), lengths[:-1]])  # the lengths shifted, not summed: 0, 5, 3, 7
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # (with one thread the CPU kernel reads the bags silently; with more it raises)
    try:
        with pytest.raises((IndexError, RuntimeError)) as ei:
            with guard(bag, live=False) as g:
                bag(flat, offsets).sum().backward()
    finally:
        torch.set_num_threads(threads)
    (f,) = _explained(g)
    assert "offsets" in f.message and "lengths.cumsum(0)" in f.hint and "num_embeddings" not in f.hint
    assert f.details["offsets_first"] == 0 and f.details["offsets_rising"] is False
    assert "lengths.cumsum(0)" in _notes(ei.value)


@pytest.mark.parametrize("arg", ["pos_weight", "weight"])
def test_a_bce_weight_of_the_wrong_shape_is_named(arg):
    """`pos_weight` (or `weight`) shaped [N, 1] for [N] logits: "output with shape [8] doesn't match the broadcast
    shape [8, 8]" names neither; no note until stop 41."""
    model = nn.Linear(4, 1)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,)).float()
    with pytest.raises(RuntimeError) as ei:
        with guard(model, live=False) as g:
            F.binary_cross_entropy_with_logits(model(x).squeeze(1), y, **{arg: torch.full((8, 1), 3.0)})
    (f,) = _explained(g)
    assert f.where == "loss" and f.details["argument"] == arg and f.details["argument_shape"] == [8, 1]
    assert f"{arg}.view(-1)" in f.hint and arg in _notes(ei.value)


def test_a_tied_weight_in_two_param_groups_is_named_with_both_names():
    """`head.weight = emb.weight`, then one group for emb's parameters and one for head's: PyTorch's ValueError
    "some parameters appear in more than one parameter group" names none; no note until stop 41."""
    emb = nn.Embedding(50, 16)
    head = nn.Linear(16, 50, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    with pytest.raises(ValueError) as ei:
        with guard(model, live=False) as g:
            torch.optim.AdamW([{"params": emb.parameters(), "weight_decay": 0.0},
                               {"params": head.parameters(), "lr": 1e-2}])
    (f,) = _explained(g)
    assert f.where == "optimizer" and f.details["tied"] is True and f.details["shared"] == ["0.weight = 1.weight"]
    assert "one tied weight" in _notes(ei.value)


@pytest.mark.parametrize("case", ["classes_last", "mask_with_channel"])
def test_dense_cross_entropy_target_errors_name_the_layout(case):
    """"Expected target size [8, 5], got [8, 30]" (logits with the classes moved last) and "only batches of spatial
    targets supported (3D tensors)" (a mask kept (N, 1, H, W)) got no note until stop 41."""
    model = nn.Conv1d(4, 5, 1) if case == "classes_last" else nn.Conv2d(3, 2, 1)
    with pytest.raises(RuntimeError) as ei:
        with guard(model, live=False) as g:
            if case == "classes_last":
                F.cross_entropy(model(torch.randn(8, 4, 30)).permute(0, 2, 1), torch.randint(0, 5, (8, 30)))
            else:
                F.cross_entropy(model(torch.randn(4, 3, 8, 8)), torch.randint(0, 2, (4, 1, 8, 8)))
    (f,) = _explained(g)
    assert f.where == "loss"
    assert ("permute(0, 2, 1)" if case == "classes_last" else "mask.squeeze(1).long()") in _notes(ei.value)


def test_optimizer_state_loaded_from_a_model_of_other_sizes_says_so_beside_resizing():
    """AdamW state saved for a Linear(8, 32) loaded into one over a Linear(8, 16): the explanation said only that rows
    were pruned or added after the optimizer made its state (until stop 41); a loaded checkpoint is named too, with
    loading the matching state or a fresh optimizer as the first fix."""
    a = nn.Linear(8, 32)
    oa = torch.optim.AdamW(a.parameters(), amsgrad=True)
    a(torch.randn(4, 8)).sum().backward()
    oa.step()
    b = nn.Linear(8, 16)
    ob = torch.optim.AdamW(b.parameters(), amsgrad=True)
    ob.load_state_dict(oa.state_dict())
    with pytest.raises(RuntimeError):
        with guard(b, ob, live=False) as g:
            ob.zero_grad()
            b(torch.randn(4, 8)).sum().backward()
            ob.step()
    (f,) = _explained(g)
    assert f.details["rows_changed"] is True and "loaded from the checkpoint" in f.message
    assert f.hint.startswith("If the state was loaded, load the optimizer state saved with this model")


def test_a_fully_convolutional_net_whose_batch_doubles_is_told_to_concatenate_on_the_channels():
    """A UNet skip joined on the batch dimension (`torch.cat([up, skip], 0)`): "8 predictions for 4 targets" was told
    as a reshape before a Linear (the model has none) until stop 41."""
    class U(nn.Module):
        def __init__(self):
            super().__init__()
            self.e = nn.Conv2d(1, 8, 3, padding=1)
            self.o = nn.Conv2d(8, 2, 1)

        def forward(self, x):
            e = self.e(x)
            u = F.interpolate(F.max_pool2d(e, 2), scale_factor=2.0)
            return self.o(torch.cat([u, e], 0))

    model = U()
    with pytest.raises(ValueError) as ei:
        with guard(model, live=False) as g:
            F.cross_entropy(model(torch.randn(4, 1, 8, 8)), torch.randint(0, 2, (4, 8, 8))).backward()
    (f,) = _explained(g)
    assert "torch.cat([up, skip], dim=1)" in f.hint and "no Linear" in _notes(ei.value)


@pytest.mark.parametrize("shape,unbatched", [((16, 28, 28), True), ((1, 3, 28, 28), False)])
def test_a_grayscale_batch_without_its_channel_dimension_is_told_to_unsqueeze(shape, unbatched):
    """`Conv2d(1, ...)` given [16, 28, 28]: torch reads it as one unbatched image of 16 channels and reports the
    input as [1, 16, 28, 28]. Told as in_channels or grayscale vs RGB until stop 41; a real batch of one RGB image
    keeps that explanation."""
    model = nn.Sequential(nn.Conv2d(1, 8, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
    with pytest.raises(RuntimeError) as ei:
        with guard(model, live=False) as g:
            model(torch.randn(*shape))
    (f,) = _explained(g)
    assert f.where == "0" and bool(f.details.get("unbatched")) is unbatched
    assert ("x.unsqueeze(1)" in _notes(ei.value)) is unbatched


def test_a_one_cycle_schedule_built_once_before_the_folds_is_told_to_be_built_per_fold():
    """OneCycleLR made before a k-fold loop that builds a new model and optimizer per fold: it schedules an optimizer
    that never steps and runs out at the second fold. "Size it from the loop" (already done) was the fix until stop
    41."""
    torch.manual_seed(0)
    x = torch.randn(40, 4)
    y = x.argmax(1)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, epochs=2, steps_per_epoch=5)
    with pytest.raises(ValueError) as ei:
        with guard(live=False) as g:
            for _fold in range(2):
                model = nn.Linear(4, 4)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                for _epoch in range(2):
                    for b in torch.randperm(40).split(8):
                        opt.zero_grad()
                        F.cross_entropy(model(x[b]), y[b]).backward()
                        opt.step()
                        sched.step()
    (f,) = _explained(g)
    assert f.details["stale_optimizer"] is True and "inside the loop" in _notes(ei.value)


@pytest.mark.parametrize("bug", ["optimizer_step_directly", "zero_grad_before_scaler_step"])
def test_grad_scaler_assertions_name_the_missing_or_misplaced_call(bug):
    """"No inf checks were recorded prior to update" (optimizer.step() called directly, scaled gradients applied) and
    "No inf checks were recorded for this optimizer" (zero_grad() between backward and scaler.step) got no note until
    stop 41."""
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(AssertionError) as ei:
        with guard(model, opt, live=False, checks=["explain"]) as g:
            for _ in range(3):
                x = torch.randn(16, 8)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = F.mse_loss(model(x).float(), x[:, :1])
                scaler.scale(loss).backward()
                if bug == "optimizer_step_directly":
                    opt.step()
                    scaler.update()
                    opt.zero_grad()
                else:
                    opt.zero_grad()
                    scaler.step(opt)
                    scaler.update()
    (f,) = _explained(g)
    assert f.where == "GradScaler" and "scaler.step(optimizer)" in _notes(ei.value)
    assert f.details == {**f.details, ("missing_scaler_step" if bug == "optimizer_step_directly"
                                       else "no_gradients_at_step"): True}


@pytest.mark.parametrize("labels, says, fix", [
    (lambda y: y + 1, "labels numbered from 1", "y - 1"),  # a margin head's one-hot of 1-based labels
    (lambda y: torch.where(y == 0, -1, y), "negative class index", "y.clamp_min(0)"),  # an ignore label kept
])
def test_one_hot_of_labels_outside_the_classes_is_explained(labels, says, fix):
    """`F.one_hot(labels, C)` in a margin head raises 'Class values must be smaller than num_classes.' (or
    '... non-negative.') with nothing about why: the note says which labels do that and how to fix them."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="Class values must be") as ei:
        with guard(model, opt, live=False) as g:
            for _ in range(2):
                y = labels(torch.arange(8) % 4)
                logits = model(torch.randn(8, 8)) - 0.3 * F.one_hot(y, 4)
                loss = F.cross_entropy(logits, y.clamp(0, 3))
                opt.zero_grad()
                loss.backward()
                opt.step()
    (f,) = _explained(g)
    assert f.where == "one_hot" and f.step == 0 and says in f.message and fix in f.hint
    assert fix in _notes(ei.value)


def test_a_regulariser_computed_once_before_the_loop_is_told_to_be_computed_in_it():
    """Bayes-by-backprop with the KL term computed once before the loop: the second step's backward runs through its
    freed graph. It is made of parameters the optimizer trains, so detaching it (the usual fix for a cached tensor)
    would take their KL gradient away: the fix is to compute it inside the loop."""
    from torch.distributions import Normal, kl_divergence

    torch.manual_seed(0)
    mu, rho = nn.Parameter(torch.zeros(5)), nn.Parameter(torch.full((5,), -3.0))
    x = torch.randn(64, 5)
    y = x @ torch.tensor([1.0, -1.0, 0.5, 0.0, 2.0])
    opt = torch.optim.Adam([mu, rho], lr=1e-2)
    with pytest.raises(RuntimeError, match="second time") as ei:
        with guard(live=False) as g:
            kl = kl_divergence(Normal(mu, F.softplus(rho)), Normal(0.0, 1.0)).sum()
            for _ in range(3):
                w = mu + F.softplus(rho) * torch.randn(5)
                loss = F.mse_loss(x @ w, y) + kl / 64
                opt.zero_grad()
                loss.backward()
                opt.step()
    (f,) = _explained(g)
    assert f.where == "kl" and f.step == 1
    assert f.hint.startswith("Compute `kl` again inside the loop") and "Compute `kl` again" in _notes(ei.value)
