"""Training-loop pitfalls: retained loss graphs, eval without no_grad, eval in train mode, missing zero_grad."""
import contextlib
import inspect
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from demos import eval_in_train_mode, eval_without_no_grad, loss_graph_retained, missing_zero_grad
from guard import guard


def kinds(g):
    return [f.kind for f in g.findings]


def line_of(fn_or_module, needle):
    """``file:line`` of the first source line of `fn_or_module` containing `needle`."""
    lines, start = inspect.getsourcelines(fn_or_module)
    if inspect.ismodule(fn_or_module):
        start = 1
    for i, text in enumerate(lines):
        if needle in text:
            return f"{os.path.relpath(inspect.getsourcefile(fn_or_module))}:{start + i}"
    raise AssertionError(needle)


def mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def batches(n=4):
    return [(torch.randn(8, 8), torch.randn(8, 1)) for _ in range(n)]


def _bn_model():
    """A small regression model with a BatchNorm, its SGD and one batch."""
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01), batches(1)[0]


def _train(model, opt, x, y, steps):
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


# --------------------------------------------------------------------------- loss-graph-retained

def test_loss_graph_demo_names_total_loss_and_twin_is_clean():
    g = loss_graph_retained.train(live=False)
    assert kinds(g) == ["loss-graph-retained"]
    f = g.findings[0]
    src = line_of(loss_graph_retained, "total_loss += loss  #")
    assert f.severity == "error" and f.where == "total_loss" and f.step == 0
    assert f.message.startswith(f"`total_loss` ({src}) holds the autograd graphs of 5 steps")
    assert "loss.item()" in f.message and "loss.item()" in f.hint
    assert f.details["holder"] == "total_loss" and f.details["holder_source"] == src
    assert f.details["steps"] == 5 and f.details["detected_at_step"] <= 10
    assert loss_graph_retained.train(fixed=True, checks="all", live=False).findings == []


class Meter:
    def __init__(self):
        self.sum, self.n = 0.0, 0

    def update(self, value):
        self.sum += value
        self.n += 1


def accumulate(stats, loss):
    stats["loss"] += loss


def _loop(form, steps=12):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = batches()
    with guard(model, opt, live=False) as g:
        history, avg, meter, stats = [], 0.0, Meter(), {"loss": 0.0}
        for step in range(steps):
            x, y = data[step % 4]
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if form == "append":
                history.append(loss)
            elif form == "ema":
                avg = 0.9 * avg + 0.1 * loss
            elif form == "meter":
                meter.update(loss)
            elif form == "dict":
                accumulate(stats, loss)
    return g


@pytest.mark.parametrize("form,where,name,needle,where_fn", [
    ("append", "history", "history[...]", "history.append(loss)", _loop),
    ("ema", "avg", "avg", "avg = 0.9 * avg + 0.1 * loss", _loop),
    ("meter", "meter.sum", "meter.sum", "self.sum += value", Meter),
    ("dict", "stats['loss']", "stats['loss']", 'stats["loss"] += loss', accumulate),
])
def test_loss_graph_variants_name_the_holder(form, where, name, needle, where_fn):
    g = _loop(form)
    assert kinds(g) == ["loss-graph-retained"], g.findings
    f = g.findings[0]
    assert f.where == where and f.details["holder"] == name
    src = line_of(where_fn, needle)
    assert f.message.startswith(f"`{name}` ({src}) holds the autograd graphs of ")
    assert f.source == src and f.details["detected_at_step"] <= 10 and f.details["steps"] >= 3


SCRIPT_QUOTING_THE_BUG = '''"""Training notes: total += loss would keep every graph; we do it on purpose below."""
import torch
from torch import nn
model = nn.Linear(10, 3)  # total += loss, said again in a comment
opt = torch.optim.SGD(model.parameters(), lr=0.1)
total = 0.0
for step in range(8):
    loss = nn.functional.cross_entropy(model(torch.randn(16, 10)), torch.randint(0, 3, (16,)))
    opt.zero_grad(); loss.backward(); opt.step()
    msg = "total += loss"
    total += loss
'''


def test_loss_graph_source_is_the_update_not_a_string_or_comment_quoting_it(tmp_path):
    import runpy
    path = tmp_path / "train_quoting.py"
    path.write_text(SCRIPT_QUOTING_THE_BUG)
    with guard(live=False) as g:
        runpy.run_path(str(path), run_name="__main__")
    f = [f for f in g.findings if f.kind == "loss-graph-retained"][0]
    assert f.where == "total" and f.source.endswith("train_quoting.py:11")


def test_loss_graph_clean_patterns():
    torch.manual_seed(0)
    # truncated BPTT with hidden.detach()
    rnn, head = nn.GRU(4, 8, batch_first=True), nn.Linear(8, 1)
    model = nn.ModuleList([rnn, head])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, checks="all", live=False) as g:
        hidden = torch.zeros(1, 2, 8)
        for _ in range(12):
            out, hidden = rnn(torch.randn(2, 5, 4), hidden)
            loss = head(out).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            hidden = hidden.detach()
    assert g.findings == []
    # gradient accumulation over micro-batches, retain_graph for two backwards, logging with .item()/.detach()
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = batches()
    with guard(model, opt, checks="all", live=False) as g:
        logged, detached, total = [], [], 0.0
        for step in range(12):
            for x, y in data[:2]:
                loss = F.mse_loss(model(x), y) / 2
                loss.backward()
            out = model(data[2][0])
            a, b = out.pow(2).mean(), out.abs().mean()
            a.backward(retain_graph=True)
            b.backward()
            opt.step()
            opt.zero_grad()
            total += loss.item()
            logged.append(loss.item())
            detached.append(loss.detach())
    assert g.findings == []


def test_graphs_freed_only_by_the_cyclic_collector_are_not_retained():
    """A SAC actor's squashed Gaussian (TanhTransform(cache_size=1)) keeps each step's action in a reference
    cycle: its graph waits for Python's cyclic garbage collector, nothing in the loop holds it."""
    import gc

    from torch.distributions import Normal, TanhTransform, TransformedDistribution

    torch.manual_seed(0)
    actor = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 2))
    critic = nn.Linear(3, 1)
    aopt, copt = torch.optim.Adam(actor.parameters(), 1e-3), torch.optim.Adam(critic.parameters(), 1e-3)
    gc.disable()  # the cycles stay until guard collects them, whatever this process's collection thresholds
    try:
        with guard([actor, critic], [aopt, copt], live=False, checks="all") as g:
            for _ in range(40):
                o, a, y = torch.randn(8, 2), torch.rand(8, 1) * 2 - 1, torch.randn(8, 1)
                critic_loss = F.mse_loss(critic(torch.cat([o, a], 1)), y)
                copt.zero_grad()
                critic_loss.backward()
                copt.step()
                mu, log_std = actor(o).chunk(2, -1)
                dist = TransformedDistribution(Normal(mu, log_std.clamp(-5, 2).exp()), [TanhTransform(cache_size=1)])
                act = dist.rsample()
                actor_loss = (0.1 * dist.log_prob(act).sum(-1, keepdim=True) - critic(torch.cat([o, act], 1))).mean()
                aopt.zero_grad()
                actor_loss.backward()
                aopt.step()
    finally:
        gc.enable()
    assert [f for f in g.findings if f.kind == "loss-graph-retained"] == [] and g.internal_errors == []


def test_a_total_kept_in_a_reference_cycle_is_still_retained():
    class Meter:
        def __init__(self):
            self.me, self.total = self, 0.0  # a cycle, but the loop still holds the meter

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    meter = Meter()
    with guard(model, opt, live=False) as g:
        for _ in range(12):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            meter.total += loss
    f = [f for f in g.findings if f.kind == "loss-graph-retained"]
    assert f and f[0].where == "meter.total"


def test_loss_graph_clean_gan_with_detach():
    G, D = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6)), nn.Sequential(nn.Linear(6, 8), nn.ReLU(),
                                                                                    nn.Linear(8, 1))
    og, od = torch.optim.Adam(G.parameters(), 1e-3), torch.optim.Adam(D.parameters(), 1e-3)
    bce = nn.BCEWithLogitsLoss()
    with guard([G, D], [od, og], checks="all", live=False) as g:
        d_losses, g_losses = [], []
        for _ in range(12):
            real, fake = torch.randn(8, 6), G(torch.randn(8, 4))
            od.zero_grad()
            d_loss = bce(D(real), torch.ones(8, 1)) + bce(D(fake.detach()), torch.zeros(8, 1))
            d_loss.backward()
            od.step()
            og.zero_grad()
            g_loss = bce(D(fake), torch.ones(8, 1))
            g_loss.backward()
            og.step()
            d_losses.append(d_loss.item())
            g_losses.append(g_loss.detach())
    assert g.findings == []


def _rss():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rss_growth(fixed, steps=3000, warm=300):
    """(RSS growth of the demo's loop, unguarded, between step `warm` and the end; the final `total_loss`)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    total_loss, base = 0.0, 0
    for step in range(steps):
        if step == warm:
            base = _rss()
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total_loss += loss.item() if fixed else loss
    return _rss() - base, total_loss


def _graph_nodes(t):
    seen, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(n for n, _ in node.next_functions)
    return len(seen)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc for RSS")
def test_retained_graph_memory_grows_and_item_keeps_it_flat():
    _rss_growth(True, steps=400)  # warm up allocator and kernels
    flat, kept_float = _rss_growth(True)
    grows, kept_graph = _rss_growth(False)
    assert isinstance(kept_float, float)
    # every step's graph stays alive through total_loss (RSS alone varies: the allocator reuses freed memory)
    assert _graph_nodes(kept_graph) >= 3000
    assert flat < 2 ** 20 and flat <= max(grows, 2 ** 20), (flat, grows)


# --------------------------------------------------------------------------- missing-zero-grad

def test_missing_zero_grad_demo_and_twin():
    g = missing_zero_grad.train(live=False)
    assert kinds(g) == ["missing-zero-grad"]
    f = g.findings[0]
    assert f.where == "SGD" and f.step == 1 and f.severity == "warning"
    assert f.source == line_of(missing_zero_grad, "optimizer.step()")
    assert "no zero_grad() after step 0" in f.message and "0.weight" in f.message
    assert f.details["parameters"] == 4 and "optimizer.zero_grad()" in f.hint
    assert missing_zero_grad.train(fixed=True, checks="all", live=False).findings == []


def test_missing_zero_grad_only_once_before_the_loop():
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    data = batches()
    with guard(model, opt, live=False) as g:
        opt.zero_grad()
        for step in range(6):
            x, y = data[step % 4]
            F.mse_loss(model(x), y).backward()
            opt.step()
    assert kinds(g) == ["missing-zero-grad"]
    assert g.findings[0].step == 1 and g.findings[0].count == 5


def test_missing_zero_grad_for_the_generator_of_a_gan():
    G, D = nn.Linear(4, 6), nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
    od, og = torch.optim.Adam(D.parameters(), 1e-3), torch.optim.Adam(G.parameters(), 1e-3)
    with guard([D, G], [od, og], live=False) as g:
        for _ in range(5):
            fake = G(torch.randn(8, 4))
            D.zero_grad()  # Module.zero_grad
            (D(torch.randn(8, 6)).mean() - D(fake.detach()).mean()).backward()
            od.step()
            D(fake).mean().backward()  # the bug: G's gradients are never zeroed
            og.step()
    assert kinds(g) == ["missing-zero-grad"]
    f = g.findings[0]
    assert f.where == "Adam[1]" and f.step >= 1 and "weight" in f.message


def test_missing_zero_grad_names_the_backward_that_added_onto_the_old_gradients():
    """An actor-critic step: the critic's backward() runs first and reaches no actor parameter; the actor's, two
    lines later, is the one that piles onto the actor's uncleared gradients."""
    import inspect

    torch.manual_seed(0)
    actor = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))
    critic = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))
    aopt, copt = torch.optim.Adam(actor.parameters(), 1e-3), torch.optim.Adam(critic.parameters(), 1e-3)
    with guard([actor, critic], [aopt, copt], live=False) as g:
        for _ in range(4):
            s, a, y = torch.randn(8, 2), torch.rand(8, 1), torch.randn(8, 1)
            copt.zero_grad()
            F.mse_loss(critic(torch.cat([s, a], 1)), y).backward()  # critic line
            copt.step()
            critic.requires_grad_(False)
            (-critic(torch.cat([s, actor(s)], 1)).mean()).backward()  # actor line
            aopt.step()  # the bug: aopt.zero_grad() is never called
            critic.requires_grad_(True)
    f = [f for f in g.findings if f.kind == "missing-zero-grad"][0]
    lines = inspect.getsource(test_missing_zero_grad_names_the_backward_that_added_onto_the_old_gradients).splitlines()
    first = inspect.getsourcelines(test_missing_zero_grad_names_the_backward_that_added_onto_the_old_gradients)[1]
    actor_line = first + next(i for i, t in enumerate(lines) if t.endswith("# actor line"))
    assert f.details["backward_source"].endswith(f"test_loop_checks.py:{actor_line}")
    assert f"test_loop_checks.py:{actor_line}" in f.message


def _accumulate(zero, micro=3, steps=5):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = batches()
    with guard(model, opt, checks="all", live=False) as g:
        for step in range(steps):
            if zero == "before":
                opt.zero_grad()
            for x, y in data[:micro]:
                (F.mse_loss(model(x), y) / micro).backward()
            opt.step()
            if zero == "after":
                opt.zero_grad(set_to_none=False)
            elif zero == "model":
                model.zero_grad()
            elif zero == "none":
                for p in model.parameters():
                    p.grad = None
            elif zero == "inplace":
                for p in model.parameters():
                    p.grad.zero_()
            elif zero == "data":
                for p in model.parameters():
                    p.grad.data.zero_()
    return g


@pytest.mark.parametrize("zero", ["before", "after", "model", "none", "inplace", "data"])
def test_zeroing_and_deliberate_accumulation_are_clean(zero):
    assert _accumulate(zero).findings == []


def test_lbfgs_closure_is_clean():
    model = mlp()
    opt = torch.optim.LBFGS(model.parameters(), max_iter=3)
    x, y = batches(1)[0]

    def closure():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    with guard(model, opt, checks="all", live=False) as g:
        for _ in range(3):
            opt.step(closure)
    assert g.findings == []


def test_lbfgs_closure_without_zero_grad_in_one_long_step_is_found():
    """The usual PINN form: one step(closure) with many iterations; the closure never zeroes the gradients, so
    each re-evaluation adds onto the last. A closure with two backward() calls after its zero_grad() is fine."""
    model = mlp()
    opt = torch.optim.LBFGS(model.parameters(), max_iter=20)
    x, y = batches(1)[0]

    def closure():
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    with guard(model, opt, checks="all", live=False) as g:
        opt.step(closure)
    # (the running sums may then blow the weights up: the NaN findings that follow are its effects)
    (f,) = [f for f in g.findings if f.kind == "missing-zero-grad"]
    assert f.kind == "missing-zero-grad" and f.where == "LBFGS" and f.step == 0
    assert f.details["closure_backwards"] >= 2 and "zero_grad() at the start of the closure" in f.hint

    model = mlp()  # a fresh one: the first may be NaN by now
    opt = torch.optim.LBFGS(model.parameters(), max_iter=20)

    def two_losses():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        penalty = 1e-3 * sum(p.pow(2).sum() for p in model.parameters())
        penalty.backward()  # accumulated onto the loss's gradients on purpose
        return loss.detach() + penalty.detach()

    with guard(model, opt, checks="all", live=False) as g:
        for _ in range(2):
            opt.step(two_losses)
    assert g.findings == []


# --------------------------------------------------------------------------- eval-without-no-grad

def test_forward_only_batchnorm_recalibration_is_not_an_evaluation():
    """Lightning's StochasticWeightAveraging adds an epoch that runs training_step forward only, grad on, with
    every BatchNorm's momentum set to None, to recompute their statistics: no eval-without-no-grad. The same
    forwards with the momentum left alone are reported."""
    def run(recalibrate):
        model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        data = batches()
        with guard(model, opt, checks="all", live=False) as g:
            for x, y in data:
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
            if recalibrate:
                model[1].reset_running_stats()
                model[1].momentum = None
            for x, y in data:  # forward only, grad on (Lightning skips backward in that epoch)
                F.mse_loss(model(x), y)
            model[1].momentum = 0.1
            for x, y in data:
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
        return g

    assert run(recalibrate=True).findings == []
    assert [f.kind for f in run(recalibrate=False).findings] == ["eval-without-no-grad"]


def test_eval_without_no_grad_demo_and_twin():
    g = eval_without_no_grad.train(live=False)
    assert kinds(g) == ["eval-without-no-grad"]
    f = g.findings[0]
    assert f.where == "Sequential" and f.severity == "warning" and f.step == 4
    assert f.source == line_of(eval_without_no_grad, "correct += (model(x)")
    assert f.message.startswith(f"3 forward passes of Sequential at {f.source}")
    assert "torch.no_grad()" in f.hint and "inference_mode" in f.hint
    assert eval_without_no_grad.train(fixed=True, checks="all", live=False).findings == []


def test_eval_without_no_grad_reports_memory_held_by_accumulated_val_loss():
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = batches()
    with guard(model, opt, live=False) as g:
        for epoch in range(2):
            for x, y in data:
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
            val_loss = 0
            for x, y in data:
                val_loss = val_loss + F.mse_loss(model(x), y)  # graphs stay alive
    assert kinds(g) == ["eval-without-no-grad"]
    f = g.findings[0]
    assert f.details["graphs_alive"] == 4 and f.details["saved_bytes"] > 4 * 8 * 64 * 4
    assert "saved activations" in f.message


def test_evaluation_from_the_training_steps_own_line_is_still_found():
    """A call site whose forwards were back-propagated for many steps is then sampled (1 forward in 8 tagged):
    evaluation run later from that same line (a shared `run(batch)` helper, model left in train mode, grad on)
    is still reported, at the step it ran, with the sampled forwards counted."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = batches()

    def run(x):
        return model(x)  # the one line both loops call the model from

    with guard(model, opt, live=False) as g:
        for epoch in range(6):
            for x, y in data:
                opt.zero_grad()
                F.mse_loss(run(x), y).backward()
                opt.step()
        assert g.findings == []  # 24 training steps: the site is trusted, nothing reported
        val = [F.mse_loss(run(x), y) for x, y in data * 4]  # 16 evaluation forwards, graphs kept
        for x, y in data:
            opt.zero_grad()
            F.mse_loss(run(x), y).backward()
            opt.step()
    assert kinds(g) == ["eval-without-no-grad"]
    f = g.findings[0]
    assert f.step == 24 and f.source == line_of(sys.modules[__name__], "return model(x)  # the one line")
    assert 1 <= f.details["forwards"] < 16 and f.details["graphs_alive"] >= 1  # sampled: not all 16 tagged
    del val


def test_eval_without_no_grad_at_the_end_of_training():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = batches()
    with guard(model, opt, live=False) as g:
        for x, y in data:
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        preds = [model(x) for x, _ in data]  # final evaluation, graphs never used
    assert kinds(g) == ["eval-without-no-grad"] and g.findings[0].details["forwards"] == 4


def test_eval_without_no_grad_clean_patterns():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = batches()
    with guard(model, opt, checks="all", live=False) as g:
        for step in range(4):
            opt.zero_grad()
            a, b = model(data[0][0]), model(data[1][0])  # two forwards ...
            b.pow(2).mean().backward()  # ... back-propagated one after the other in the same step
            a.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            z1, z2 = model(data[2][0]), model(data[3][0])  # several forwards, one loss
            (F.mse_loss(z1, z2.detach() * 0) + z2.pow(2).mean()).backward()
            opt.step()
    assert g.findings == []
    # inference only (no backward anywhere): not judged
    with guard(model, live=False) as g:
        for x, _ in data:
            model(x)
    assert g.findings == []


class _ForceField(nn.Module):
    """Forces as -dE/dx inside forward (SchNetPack, NequIP, MACE): validation has to run with grad on."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 16), nn.SiLU(), nn.Linear(16, 1))

    def forward(self, x):
        x = x.requires_grad_(True)
        energy = self.net(x).sum(1)
        return energy, -torch.autograd.grad(energy.sum(), x, create_graph=self.training)[0]


def test_a_force_field_validated_with_grad_on_is_no_evaluation_outside_no_grad():
    torch.manual_seed(0)
    model = _ForceField()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(64, 3)
    with guard(model, opt, live=False, checks="all") as g:
        for _ in range(3):
            model.train()
            for i in range(0, 48, 16):
                opt.zero_grad()
                _, forces = model(x[i:i + 16].clone())
                ((forces + x[i:i + 16]) ** 2).mean().backward()
                opt.step()
            model.eval()
            for i in range(48, 64, 4):
                model(x[i:i + 4].clone())  # the graph is consumed by autograd.grad inside forward
    assert g.findings == [] and g.internal_errors == []


def test_an_adaptive_solvers_rejected_trial_steps_are_no_evaluation():
    """An adaptive ODE solver computes a trial step with grad on and learns only from its error estimate whether
    to keep it (torchdiffeq does the same): the rejected trials' forwards are dropped, from the same line whose
    accepted forwards are back-propagated. A forward of that line whose output is never used still is reported."""

    def run(tol, evaluate):
        torch.manual_seed(0)
        f = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 2))
        opt = torch.optim.Adam(f.parameters(), 1e-2)
        rejected = 0

        def heun(y, h):
            k1 = f(y)
            k2 = f(y + h * k1)
            return y + h / 2 * (k1 + k2), (h / 2 * (k2 - k1)).abs().max().item()

        with guard(f, opt, live=False) as g:
            for it in range(10):
                y0 = y = torch.randn(16, 2)
                t, h = 0.0, 0.5
                while t < 1.0 - 1e-9:
                    h = min(h, 1.0 - t)
                    ynew, err = heun(y, h)
                    if err < tol:
                        y, t = ynew, t + h  # accepted
                    else:
                        rejected += 1  # rejected: ynew and its graph dropped, retried with a smaller h
                    h *= 0.9 * (tol / max(err, 1e-12)) ** 0.5
                loss = (y - y0.flip(1)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                if evaluate and it == 5:
                    scores = [heun(torch.randn(16, 2), 0.1)[1] for _ in range(40)]  # evaluation, grad on
        return g, rejected

    g, rejected = run(1e-3, evaluate=False)
    assert rejected >= 5 and g.findings == []
    g, _ = run(1e-3, evaluate=True)
    assert kinds(g) == ["eval-without-no-grad"] and g.findings[0].step == 6


@pytest.mark.parametrize("period,offset", [(5, 0), (10, 9), (3, 1)])
def test_batches_skipped_after_their_forward_are_no_evaluation(period, offset):
    """A loop that skips the update of some batches (a loss spike, a bad batch: known only after the forward),
    the last one included; the site is sampled by then, so the used forwards around a skipped one are mostly not
    tagged. An evaluation run inside that loop (graphs kept in a list) is still found."""

    def run(evaluate):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        with guard(model, opt, live=False) as g:
            for i in range(200):
                x, y = torch.randn(16, 10), torch.randint(0, 3, (16,))
                loss = F.cross_entropy(model(x), y)
                if evaluate and i == 150:
                    val = [loss] + [F.cross_entropy(model(torch.randn(16, 10)), y) for _ in range(24)]
                if i % period == offset:  # `if loss.item() > 3 * running_mean: continue`
                    continue
                opt.zero_grad()
                loss.backward()
                opt.step()
        return g

    assert run(evaluate=False).findings == []
    assert kinds(run(evaluate=True)) == ["eval-without-no-grad"]


def test_eval_without_no_grad_clean_gradient_penalty_via_autograd_grad():
    D = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.Adam(D.parameters(), 1e-3)
    with guard(D, opt, checks="all", live=False) as g:
        for _ in range(4):
            real = torch.randn(8, 6)
            interp = real.clone().requires_grad_(True)
            out = D(interp)
            grad, = torch.autograd.grad(out.sum(), interp, create_graph=True)
            loss = -D(real).mean() + ((grad.norm(dim=1) - 1) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert g.findings == []


# --------------------------------------------------------------------------- eval-in-train-mode

def test_eval_in_train_mode_demo_and_twin():
    g = eval_in_train_mode.train(live=False)
    assert kinds(g) == ["eval-in-train-mode"]
    f = g.findings[0]
    assert f.where == "Sequential" and f.step == 4
    assert f.source == line_of(eval_in_train_mode, "val_loss = sum(")
    assert "1 (BatchNorm1d), 3 (Dropout)" in f.message and "torch.no_grad()" in f.message
    assert "running statistics" in f.message and "model.eval()" in f.hint
    assert f.details["modules"] == ["1", "3"]
    assert eval_in_train_mode.train(fixed=True, checks="all", live=False).findings == []


def test_eval_in_train_mode_under_inference_mode_before_training():
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = batches(1)[0]
    with guard(model, opt, live=False) as g:
        with torch.inference_mode():
            model(x)  # baseline evaluation before training, still in train mode
        for _ in range(2):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    assert kinds(g) == ["eval-in-train-mode"]
    f = g.findings[0]
    assert f.step == 0 and "torch.inference_mode()" in f.message and "1 (Dropout)" in f.message


def test_a_lazy_models_dry_run_under_no_grad_is_no_evaluation_in_train_mode():
    """The documented lazy-module recipe: `with torch.no_grad(): model(dummy)` sizes the lazy layers, then the
    optimizer is built. A later evaluation from the same model in train mode is still found."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(16), nn.LazyBatchNorm1d(), nn.ReLU(), nn.Linear(16, 1))
    with guard(model, live=False) as g:
        with torch.no_grad():
            model(torch.randn(4, 8))  # the dry run
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(16, 8)).pow(2).mean().backward()
            opt.step()
    assert [f for f in g.findings if f.severity != "info"] == []
    with guard(model, opt, live=False) as g:
        with torch.no_grad():
            model(torch.randn(16, 8))  # evaluation, the model left in train mode
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(16, 8)).pow(2).mean().backward()
            opt.step()
    assert kinds(g) == ["eval-in-train-mode"]


@pytest.mark.parametrize("switched_back", ["dropout", "batchnorm"])
def test_layers_switched_back_to_train_after_model_eval_are_deliberate(switched_back):
    """Monte Carlo dropout: model.eval(), then a layer's train() on purpose; the same forwards with the model
    itself left in training mode are the bug."""
    for forgot_eval in (False, True):
        model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = batches(1)[0]
        with guard(model, opt, live=False) as g:
            for _ in range(2):
                model.train()
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
            if not forgot_eval:
                model.eval()
                (model[2] if switched_back == "dropout" else model[1]).train()
            with torch.no_grad():
                torch.stack([model(x) for _ in range(4)]).std(0)
        assert kinds(g) == (["eval-in-train-mode"] if forgot_eval else []), (forgot_eval, g.findings)


@pytest.mark.parametrize("samples, indexed", [(10, False), (3, False), (10, True)])
def test_monte_carlo_dropout_on_the_train_mode_left_from_training_is_deliberate(samples, indexed):
    """MC dropout validation inside the training loop: the model (Dropout only) left in train mode on purpose, one
    validation input forwarded T times under no_grad and averaged. T = 10 samples is sampling, silent, also when each
    sample indexes the pool anew (`model(X[pool])`, BALD: a new tensor with the same values); an evaluation computed
    three times on one batch is no sampling and still told."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y, xv = torch.randn(64, 10), torch.randint(0, 5, (64,)), torch.randn(40, 10)
    with guard(model, opt, live=False) as g:
        for epoch in range(3):
            for _ in range(4):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            with torch.no_grad():
                if indexed:
                    pool = torch.arange(0, 40, 2)
                    torch.stack([F.softmax(model(xv[pool]), -1) for _ in range(samples)]).mean(0)
                else:
                    torch.stack([F.softmax(model(xv), -1) for _ in range(samples)]).mean(0)
    assert kinds(g) == ([] if samples == 10 else ["eval-in-train-mode"]), g.findings


class _Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.src, self.tok, self.drop, self.out = nn.Linear(10, 16), nn.Embedding(5, 16), nn.Dropout(0.3), nn.Linear(16, 5)

    def forward(self, src, tok):
        return self.out(self.drop(torch.tanh(self.src(src) + self.tok(tok))))


def test_a_greedy_decode_feeding_one_source_with_new_tokens_is_no_monte_carlo_sampling():
    """`model(src, tok)` under no_grad, in train mode, 8 times from one line with the same source and the token just
    decoded: Dropout is on while decoding. Taken as MC dropout sampling (the same first argument) until stop 44."""
    torch.manual_seed(0)
    model = _Decoder()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    src, tgt = torch.randn(32, 10), torch.randint(0, 5, (32,))
    with guard(model, opt, live=False) as g:
        for step in range(8):
            loss = F.cross_entropy(model(src, tgt), tgt)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == 3:
                with torch.no_grad():
                    hyp = [torch.zeros(32, dtype=torch.long)]
                    for i in range(8):
                        model(src, hyp[-1]).argmax(-1)
                        hyp.append(torch.full((32,), (i + 1) % 5))  # (the decoded token: a new one each time)
    [f] = g.findings
    assert (f.kind, f.step) == ("eval-in-train-mode", 4) and "mc_sampling" not in f.details


def _mc_scores_after_train(model, xv):
    model.train()  # "enable dropout for the MC samples"
    with torch.no_grad():
        return torch.stack([F.softmax(model(xv), -1) for _ in range(10)]).mean(0)


@pytest.mark.parametrize("train_first", [False, True])
def test_monte_carlo_dropout_over_batchnorm_in_train_mode_is_told_with_a_fix_that_keeps_the_sampling(train_first):
    """MC dropout sampling (one input forwarded 10 times under no_grad) on the train mode left from training, with
    BatchNorm in the model: told (each sample normalises with batch statistics and moves them), but the fix is not a
    bare model.eval(), which would switch the sampling off too: eval, then only the Dropout layers back to train.
    An explicit `model.train()` to switch dropout on for the sampling (BALD scoring) switches BatchNorm on too:
    told as well (silent before stop 44: a pass right after model.train() was taken as deliberate)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y, xv = torch.randn(64, 10), torch.randint(0, 5, (64,)), torch.randn(40, 10)
    with guard(model, opt, live=False) as g:
        for _ in range(4):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if train_first:
            _mc_scores_after_train(model, xv)
        else:
            with torch.no_grad():
                torch.stack([F.softmax(model(xv), -1) for _ in range(10)]).mean(0)
    (f,) = g.findings
    assert f.kind == "eval-in-train-mode" and f.details["mc_sampling"] is True
    assert "isinstance(m, nn.Dropout): m.train()" in f.hint and "Monte Carlo dropout" in f.message


def test_batchnorm_statistics_recomputed_by_hand_are_deliberate():
    # Precise BN: reset the statistics, momentum=None (a cumulative average), forwards in train mode
    # under no_grad, as swa_utils.update_bn does. A BatchNorm with its usual momentum is the bug.
    for momentum in (None, 0.1):
        model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = batches(1)[0]
        with guard(model, opt, live=False) as g:
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            model[1].reset_running_stats()
            model[1].momentum = momentum
            with torch.no_grad():
                for _ in range(3):
                    model(x)
        assert kinds(g) == ([] if momentum is None else ["eval-in-train-mode"]), momentum
        if momentum is not None:  # told as the re-estimation it is, not as an evaluation in train mode
            f = g.findings[0]
            assert f.details["reestimation"] is True and f.details["batches"] == 3 and f.details["modules"] == ["1"]
            assert f.details["reset_left"] == pytest.approx(0.9 ** 3, abs=1e-3) and "73%" in f.message
            assert "momentum = None" in f.hint and f.step == 1


@pytest.mark.parametrize("said", [False, True])
@pytest.mark.parametrize("n", [10, 60])
def test_batchnorm_reestimation_with_the_usual_momentum_is_judged_by_what_it_leaves(n, said):
    """BN re-estimation after training (reset_running_stats(), forwards in train mode under no_grad) with
    momentum 0.1: over 10 batches 35% of the reset values (mean 0, variance 1) stay in the statistics; over 60,
    0.2%: nothing to tell. Judged when training resumes; the same with `model.train()` said right before it."""
    model, opt, (x, y) = _bn_model()
    with guard(model, opt, live=False) as g:
        _train(model, opt, x, y, 4)
        model[1].reset_running_stats()
        model.train() if said else None
        with torch.no_grad():
            for _ in range(n):
                model(x)
        assert g.findings == []  # not judged while it runs
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        found = list(g.findings)
    if n == 60:
        assert found == []
    else:
        assert [f.kind for f in found] == ["eval-in-train-mode"]
        f = found[0]
        assert f.where == "Sequential" and f.step == 4 and f.details["batches"] == 10
        assert "35%" in f.message and "1 (BatchNorm1d)" in f.message and "reset_running_stats()" in f.message


def test_an_evaluation_in_train_mode_after_a_proper_reestimation_is_still_told_as_one():
    """Reset, re-estimated with momentum=None (the recipe), momentum restored, then evaluated without .eval():
    that last call is the evaluation bug, not part of the re-estimation."""
    model, opt, (x, y) = _bn_model()
    with guard(model, opt, live=False) as g:
        _train(model, opt, x, y, 4)
        model[1].reset_running_stats()
        model[1].momentum = None
        with torch.no_grad():
            for _ in range(5):
                model(x)
        model[1].momentum = 0.1
        with torch.no_grad():
            model(x)  # the bug: model.eval() missing
    assert kinds(g) == ["eval-in-train-mode"]
    assert "reestimation" not in g.findings[0].details and g.findings[0].details["types"] == ["BatchNorm1d"]


def test_eval_in_train_mode_clean_patterns():
    x, y = batches(1)[0]
    # no dropout/BN: train mode makes no difference
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, checks="all", live=False) as g:
        for _ in range(2):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            with torch.no_grad():
                model(x)
    assert g.findings == []
    # an EMA teacher with BatchNorm kept in train mode, only ever run under no_grad; a silenced module
    student = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 1))
    teacher = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 1))
    noisy = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.Linear(16, 1))
    noisy[1].guard_train_mode_ok = True  # MC dropout on purpose
    opt = torch.optim.SGD(list(student.parameters()) + list(noisy.parameters()), lr=0.01)
    with guard(None, opt, checks="all", live=False) as g:
        for _ in range(3):
            with torch.no_grad():
                target = teacher(x)
                mc = torch.stack([noisy(x) for _ in range(3)]).mean(0)
            opt.zero_grad()
            (F.mse_loss(student(x), target) + F.mse_loss(noisy(x), mc)).backward()
            opt.step()
    assert g.findings == []


# --------------------------------------------------------------------------- cost and nesting

LOOP = ["loss-graph", "eval-without-no-grad", "eval-in-train-mode", "missing-zero-grad"]


def test_loop_checks_do_not_sync_per_module_or_loss_call():
    from tests.test_model_data_nosync import SYNCING, Record

    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.1), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = batches(1)[0]
    with guard(model, opt, checks=LOOP, live=False):
        for _ in range(3):
            with Record() as rec:
                out = model(x)
                loss = F.mse_loss(out, y)
                with torch.no_grad():
                    model(x)
            assert not SYNCING & set(rec.names), rec.names
            opt.zero_grad()
            loss.backward()
            opt.step()


def test_nested_guards_each_see_the_retained_graph():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = batches()
    with guard(model, opt, checks=["loss-graph"], live=False) as outer:
        with guard(model, opt, checks=["loss-graph"], live=False) as inner:
            running = 0
            for step in range(8):
                x, y = data[step % 4]
                loss = F.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                running = running + loss
    assert [f.where for f in outer.findings] == ["running"] and [f.where for f in inner.findings] == ["running"]


def test_global_guard_without_optimizer_catches_all_three():
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 1))
    crit = nn.MSELoss()
    data = batches()
    with guard(live=False) as g:  # no model, no optimizer: every backward() is a step
        total = 0
        for step in range(8):
            x, y = data[step % 4]
            loss = crit(model(x), y)
            model.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
            total = total + loss
        with torch.no_grad():
            model(x)
        val = [crit(model(x), y).item() for x, y in data[:3]]
    by_kind = {f.kind: f for f in g.findings}
    assert sorted(by_kind) == ["eval-in-train-mode", "eval-without-no-grad", "loss-graph-retained"]
    assert by_kind["loss-graph-retained"].where == "total"
    ev = by_kind["eval-without-no-grad"]
    assert ev.where == "Sequential" and ev.message.startswith("3 forward passes of Sequential")


@pytest.mark.parametrize("every", [1, 2])
def test_a_no_grad_pass_inside_each_training_step_is_no_evaluation(every):
    """Two-pass scheduled sampling: a no_grad pass in training mode feeds the step's own forward (at every step,
    or at every other one); an evaluation loop in training mode between epochs is still found."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.Linear(16, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 8), torch.randn(32, 8)
    with guard(model, opt, live=False, checks="all") as g:
        for step in range(12):
            if step % every == 0:
                with torch.no_grad():
                    own = model(x)  # the model's own predictions, mixed into its input
                x_in = torch.where(torch.rand_like(x) < 0.5, x, own)
            else:
                x_in = x
            loss = F.mse_loss(model(x_in), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert g.findings == [] and g.internal_errors == []
        with torch.no_grad():
            for _ in range(3):
                model(x)  # evaluation at the end, still in training mode: the bug
    assert [(f.kind, f.step) for f in g.findings] == [("eval-in-train-mode", 12)]


@pytest.mark.parametrize("bug", [False, True])
def test_batchnorm_adaptation_switching_each_batchnorm_on_inside_an_eval_model_is_deliberate(bug):
    """The 'Norm' baseline of test-time adaptation (the tent repository): `model.eval()`, then `m.train()` for each
    BatchNorm, in a wrapper module (new, so in training mode) called under no_grad on test batches. BatchNorm
    layers in training mode inside a block in eval mode were switched on by themselves: no `model.train()` does
    that. It was told as an evaluation in train mode (stop 45). The wrapper over a model left training is."""
    torch.manual_seed(0)

    class Norm(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model
            for m in model.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.train()

        def forward(self, x):
            return self.model(x)

    base = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 4))
    opt = torch.optim.SGD(base.parameters(), lr=0.05)
    x, y = torch.randn(32, 3, 8, 8), torch.randint(0, 4, (32,))
    with guard(live=False) as g:
        for _ in range(5):
            opt.zero_grad()
            F.cross_entropy(base(x), y).backward()
            opt.step()
        if not bug:
            base.eval()
        model = Norm(base)
        with torch.no_grad():
            for _ in range(4):
                model(torch.randn(16, 3, 8, 8) * 2 + 1)
    if bug:
        f = next(f for f in g.findings if f.kind == "eval-in-train-mode")
        assert f.details["modules"] == ["model.1"], f.details
    else:
        assert g.findings == [], g.findings


def test_eval_in_train_mode_leaves_swa_update_bn_alone():
    from torch.optim.swa_utils import update_bn

    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = batches()
    with guard(model, opt, checks="all", live=False) as g:
        for x, y in data:
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        update_bn([x for x, _ in data], model)  # recomputes BatchNorm statistics under no_grad, in train mode
    assert g.findings == []


class _ScheduleFreeSGD(torch.optim.SGD):
    """The part of schedulefree.SGDScheduleFree guard can see: ``train()``/``eval()`` flip each group's
    ``train_mode`` (the real one also swaps the weights for their average)."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        for grp in self.param_groups:
            grp["train_mode"] = True

    def train(self):
        for grp in self.param_groups:
            grp["train_mode"] = True

    def eval(self):
        for grp in self.param_groups:
            grp["train_mode"] = False


@pytest.mark.parametrize("switch", [True, False])
def test_schedule_free_batchnorm_recalibration_is_not_an_evaluation(switch):
    """facebookresearch/schedule_free's recipe: model.train(); optimizer.eval(); under no_grad, forwards of
    training batches recompute BatchNorm statistics at the averaged weights. Without optimizer.eval() the same
    forwards are an evaluation in train mode."""
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    opt = _ScheduleFreeSGD(model.parameters(), lr=0.01)
    data = batches()
    with guard(model, opt, checks="all", live=False) as g:
        for epoch in range(2):
            model.train()
            opt.train()
            for x, y in data:
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
            if switch:
                opt.eval()
            with torch.no_grad():
                for x, _ in data[:2]:
                    model(x)
            model.eval()
            with torch.no_grad():
                model(data[0][0])
    if switch:
        assert g.findings == []
    else:
        assert kinds(g) == ["eval-in-train-mode"]


def test_eval_in_train_mode_leaves_precise_bn_with_momentum_one_alone():
    """fvcore/detectron2's update_bn_stats: BatchNorm momentum set to 1.0, the model in train mode under no_grad,
    the batch statistics averaged by hand. A Dropout that runs in that statistics pass means nothing there (its
    outputs are thrown away, as in swa_utils.update_bn); a Dropout model evaluated in train mode is still told."""
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = batches()
    with guard(model, opt, checks="all", live=False) as g:
        for x, y in data:
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        bn = model[1]
        mean, var = torch.zeros_like(bn.running_mean), torch.zeros_like(bn.running_var)
        bn.momentum = 1.0
        with torch.no_grad():
            model.train()
            for x, _ in data:
                model(x)
                mean += bn.running_mean / len(data)
                var += bn.running_var / len(data)
        bn.running_mean.copy_(mean)
        bn.running_var.copy_(var)
        bn.momentum = 0.1
    assert g.findings == []
    dropped = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 1))
    opt = torch.optim.SGD(dropped.parameters(), lr=0.01)
    with guard(dropped, opt, checks="all", live=False) as g:
        for x, y in data:
            opt.zero_grad()
            F.mse_loss(dropped(x), y).backward()
            opt.step()
        dropped[1].momentum = 1.0
        with torch.no_grad():
            dropped(data[0][0])
        dropped[1].momentum = 0.1
    assert g.findings == []
    with guard(dropped, opt, checks="all", live=False) as g:
        for x, y in data:
            opt.zero_grad()
            F.mse_loss(dropped(x), y).backward()
            opt.step()
        with torch.no_grad():
            dropped(data[0][0])  # an evaluation, model.eval() forgotten
    assert [(f.kind, f.details.get("modules")) for f in g.findings] == [("eval-in-train-mode", ["1", "2"])]


def test_loss_graph_raise_mode_stops_at_backward_and_bounded_window_is_reported():
    from collections import deque

    from guard import GuardError

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = batches()
    window = deque(maxlen=50)
    with pytest.raises(GuardError) as info:
        with guard(model, opt, mode="raise", live=False):
            for step in range(20):
                x, y = data[step % 4]
                loss = F.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                window.append(loss)
    f = info.value.finding
    assert f.kind == "loss-graph-retained" and f.where == "window" and f.details["detected_at_step"] == 5


def test_eval_without_no_grad_counts_only_the_reported_models_calls():
    """Throwaway modules are left alone; a trained model evaluated with grad is reported with its own count."""
    import torch
    from torch import nn

    from guard import guard

    torch.manual_seed(0)
    with guard(live=False) as g:
        demo = nn.LSTM(3, 3)
        for _ in range(5):
            demo(torch.randn(1, 1, 3))  # shown, never trained: not an evaluation
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(4):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            for _ in range(3):
                model(torch.randn(8, 4))  # evaluation with grad on
    found = [f for f in g.findings if f.kind == "eval-without-no-grad"]
    assert len(found) == 1 and found[0].where == "Linear"
    f = found[0]
    n = f.details["forwards"]
    assert f.message.startswith(f"{n} forward passes of Linear")
    assert sum(f.details["sources"].values()) == n  # the sources count that model's calls, no other's


def test_a_critic_steps_detached_generator_outputs_are_graphs_built_for_nothing_not_kept_memory():
    # WGAN style: `fake = G(z).detach()` for every critic step. G's graphs die at once: the finding says
    # so (and how to avoid building them) instead of "evaluation keeps every activation".
    import torch
    from torch import nn

    from guard import guard

    torch.manual_seed(0)
    G, D = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6)), nn.Sequential(nn.Linear(6, 1))
    og, od = torch.optim.Adam(G.parameters(), 1e-3), torch.optim.Adam(D.parameters(), 1e-3)
    with guard([G, D], [og, od], live=False) as g:
        for _ in range(3):
            for _ in range(3):
                fake = G(torch.randn(8, 4)).detach()
                od.zero_grad()
                (D(fake).mean() - D(torch.randn(8, 6)).mean()).backward()
                od.step()
            og.zero_grad()
            (-D(G(torch.randn(8, 4))).mean()).backward()
            og.step()
    (f,) = g.findings
    assert (f.kind, f.where) == ("eval-without-no-grad", "G") and f.details["dropped_at_once"] is True
    assert "dropped at once" in f.message and "keeps every activation" not in f.message
    assert "with torch.no_grad(): fake = G(z)" in f.hint


def test_a_part_detached_by_a_helper_is_told_it_never_trains():
    """`features()` returns `backbone(x).detach()`: the backbone is trainable and in the optimizer, yet never
    gets a gradient. The finding says the detach cuts it off (not "run it under no_grad", which would hide the
    symptom); a backbone frozen on purpose (requires_grad=False, out of the optimizer) is silent."""
    import torch
    from torch import nn

    from guard import guard

    def run(frozen):
        torch.manual_seed(0)
        model = nn.ModuleDict({"backbone": nn.Sequential(nn.Linear(8, 16), nn.ReLU()), "head": nn.Linear(16, 3)})
        if frozen:
            model["backbone"].requires_grad_(False)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

        def features(x):
            return model["backbone"](x).detach()

        with guard(model, opt, live=False) as g:
            for _ in range(6):
                opt.zero_grad()
                nn.functional.cross_entropy(model["head"](features(torch.randn(8, 8))),
                                            torch.randint(0, 3, (8,))).backward()
                opt.step()
        return g

    (f,) = run(frozen=False).findings
    assert (f.kind, f.where) == ("eval-without-no-grad", "backbone")
    assert "never trains" in f.message and f.details["parameters_without_gradient"] == 2
    assert "remove the .detach()" in f.hint and "requires_grad=False" in f.hint
    assert run(frozen=True).findings == []


def test_one_dry_run_of_a_model_is_no_evaluation():
    import torch
    from torch import nn

    from guard import guard

    model = nn.Sequential(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, live=False) as g:
        model(torch.randn(1, 4))  # a shape check, result thrown away
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
    assert g.findings == []


def test_eval_without_no_grad_at_exit_after_the_optimizer_is_gone():
    # A global guard closing after the training function returned: the optimizer is collected. A model
    # with trainable parameters evaluated with grad is still reported; a parameterless module (a
    # quantization observer that convert() calls) is not taken for a trained model.
    import gc

    import torch
    from torch import nn

    from guard import guard

    model, observer = nn.Sequential(nn.Linear(4, 4)), nn.ReLU()

    def train():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()

    g = guard(live=False).start()
    train()
    gc.collect()
    seen = observer(torch.randn(2, 4, requires_grad=True) * 2)  # noqa: F841  (graphs alive at exit)
    kept = [model(torch.randn(2, 4)) for _ in range(3)]  # noqa: F841
    g.close()
    assert [(f.kind, f.where) for f in g.findings] == [("eval-without-no-grad", "Sequential")]


def test_a_forward_with_many_outputs_whose_last_one_is_trained_is_no_evaluation():
    """Ten auxiliary values before the output the loss uses: the backward runs through the forward."""
    class ManyOutputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            return [h.sum() for _ in range(10)], h

    torch.manual_seed(0)
    model = ManyOutputs()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, checks="all", live=False) as g:
        for _ in range(4):
            _, h = model(torch.randn(3, 4))
            opt.zero_grad()
            h.pow(2).mean().backward()
            opt.step()
    assert g.findings == []


@pytest.mark.parametrize("bug", [True, False])
def test_a_generator_whose_every_output_is_detached_is_told_as_cut_off(bug):
    """The generator loss computed on `fake.detach()`: optG steps but G never gets a gradient. Told at the end as the
    detach cutting G off (not with a no_grad fix, which would keep it so). A WGAN whose G trains every 5th step,
    its critic steps on `G(z).detach()`, is told as graphs built for nothing, from the same step."""
    torch.manual_seed(0)
    G, D = nn.Linear(4, 4), nn.Linear(4, 1)
    oG, oD = torch.optim.Adam(G.parameters()), torch.optim.Adam(D.parameters())
    with guard(live=False) as g:
        for i in range(20):
            fake = G(torch.randn(8, 4)).detach()
            oD.zero_grad()
            (D(fake).mean() - D(torch.randn(8, 4)).mean()).backward()
            oD.step()
            if bug:
                oG.zero_grad()
                (-D(fake).mean()).backward()
                oG.step()
            elif i % 5 == 4:
                oG.zero_grad()
                (-D(G(torch.randn(8, 4))).mean()).backward()
                oG.step()
    [f] = [f for f in g.findings if f.kind == "eval-without-no-grad"]
    assert f.where == "Linear" and f.step == 0  # (G: the first model seen; a function's variables are not read)
    if bug:
        assert f.details["parameters_without_gradient"] == 2 and "cuts Linear off from the loss" in f.message
        assert "remove the .detach()" in f.hint
    else:
        assert "parameters_without_gradient" not in f.details and "for nothing" in f.message


def test_a_train_mode_forward_thrown_away_once_per_epoch_is_told_when_it_recurs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    X, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    with guard(model, opt, live=False) as g:
        for epoch in range(6):
            for i in range(0, 64, 16):
                loss = F.cross_entropy(model(X[i:i + 16]), y[i:i + 16])
                opt.zero_grad()
                loss.backward()
                opt.step()
            model(X)  # the epoch-end look at the outputs, outside no_grad, its result thrown away
    [f] = g.findings
    assert f.kind == "eval-without-no-grad" and f.details["dropped_at_once"] is True
    assert f.details["forwards"] == 3 and "dropped at once" in f.message and "torch.no_grad()" in f.hint
    assert f.step == 4  # told at the third epoch's end, from the first: after epoch 0's four steps


@pytest.mark.parametrize("opt_cls", [torch.optim.SparseAdam, torch.optim.SGD])
def test_missing_zero_grad_on_sparse_embedding_gradients(opt_cls):
    """nn.Embedding(sparse=True): its sparse gradients pile up over steps as dense ones do."""
    torch.manual_seed(0)
    emb, head = nn.Embedding(50, 8, sparse=True), nn.Linear(8, 1)
    sparse_opt = opt_cls(emb.parameters(), lr=0.01)
    dense_opt = torch.optim.Adam(head.parameters(), lr=0.01)
    with guard([emb, head], [dense_opt, sparse_opt], checks="all", live=False) as g:
        for _ in range(4):
            idx = torch.randint(0, 50, (16, 3))
            F.mse_loss(head(emb(idx).mean(1)), torch.randn(16, 1)).backward()
            dense_opt.step()
            dense_opt.zero_grad()
            sparse_opt.step()  # no sparse_opt.zero_grad()
    (f,) = g.findings
    assert f.kind == "missing-zero-grad" and f.where == type(sparse_opt).__name__ and f.step == 1


class _PartTrainer:
    """A Trainer holding a body and a separate head; `partial` zeroes only the body's gradients."""

    def __init__(self, partial):
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 3)
        self.opt = torch.optim.SGD(list(self.model.parameters()) + list(self.head.parameters()), lr=0.05)
        self.partial = partial

    def step(self, x, y):
        if self.partial:
            self.model.zero_grad()  # the bug: the head's gradients pile up
        else:
            self.opt.zero_grad()
        F.cross_entropy(self.head(self.model(x)), y).backward()
        self.opt.step()


@pytest.mark.parametrize("partial", [True, False])
def test_a_zero_grad_over_part_of_the_parameters_is_named_under_a_global_guard(partial):
    """Under a global guard a Trainer's `self.head` (a single layer) is named `head`, not a bare `weight`; the
    message says the other gradients were cleared and the hint names model.zero_grad()'s reach."""
    t = _PartTrainer(partial)
    with guard(live=False) as g:
        for _ in range(4):
            t.step(torch.randn(16, 8), torch.randint(0, 3, (16,)))
    if not partial:
        assert g.findings == []
        return
    (f,) = g.findings
    assert (f.kind, f.step) == ("missing-zero-grad", 1)
    assert f.details["names"] == ["head.weight", "head.bias"]
    assert "the other 2 were cleared or new" in f.message and "model.zero_grad() clears only" in f.hint


_PARTS_SCRIPT = """
torch.manual_seed(0)
model = nn.ModuleDict({"backbone": nn.Sequential(nn.Linear(8, 16), nn.ReLU()), "head": nn.Linear(16, 3)})
opt = torch.optim.SGD(model.parameters(), lr=0.05)
with guard(live=False) as g:
    for i in range(4):
        out = model["head"](model["backbone"](torch.randn(8, 8)))
        F.cross_entropy(out, torch.randint(0, 3, (8,))).backward()  # no zero_grad: found, named by path
        opt.step()
"""


def test_a_scripts_loop_calling_a_models_parts_names_them_by_their_path_under_a_global_guard():
    """A script's top-level loop (its variables are its globals): the parts are named by their path in `model`."""
    scope = {"torch": torch, "nn": nn, "F": F, "guard": guard}
    exec(compile(_PARTS_SCRIPT, __file__, "exec"), scope)
    (f,) = scope["g"].findings
    assert f.kind == "missing-zero-grad"
    assert set(f.details["names"]) == {"backbone.0.weight", "backbone.0.bias", "head.weight", "head.bias"}


def test_naming_a_model_first_called_late_in_a_loop_keeps_none_of_the_loops_tensors_alive():
    """StyleGAN's lazy regulariser: `reg` is back-propagated every 4th step and kept until replaced. A second model
    first called at step 5, from the same function, must not make guard keep that step's `reg` (and its graph)
    alive: a function's f_locals is a snapshot its frame keeps (Python < 3.13), so guard does not read it there."""
    torch.manual_seed(0)
    a, b = nn.Linear(4, 1), nn.Linear(4, 1)
    opt = torch.optim.SGD(a.parameters(), lr=0.01)
    x = torch.randn(8, 4)
    with guard(live=False) as g:
        reg = None
        for i in range(24):
            opt.zero_grad()
            loss = a(x).pow(2).mean()
            if i % 4 == 0:
                reg = a(x).abs().mean()
                loss = loss + reg
            loss.backward()
            opt.step()
            if i == 5:
                with torch.no_grad():
                    b(x)  # a second model, first called now
    assert g.findings == [], g.findings
    del reg


class _Bank(nn.Module):
    """An NNCLR-style support set: features of earlier steps kept in a registered buffer (or a plain attribute)."""

    def __init__(self, as_buffer, detach):
        super().__init__()
        self.net = nn.Linear(8, 8)
        self.detach = detach
        if as_buffer:
            self.register_buffer("bank", torch.zeros(32, 8))
        else:
            self.bank = torch.zeros(32, 8)

    def forward(self, x):
        z = self.net(x)
        out = z @ self.bank.detach().T
        self.bank = torch.cat([z.detach() if self.detach else z, self.bank[:-4]])  # the bug: no z.detach()
        return out


@pytest.mark.parametrize("as_buffer", [True, False])
def test_features_kept_across_steps_in_a_buffer_are_named_with_a_detach_fix(as_buffer):
    def run(detach):
        torch.manual_seed(0)
        m = _Bank(as_buffer, detach)
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        with guard(m, opt, live=False) as g:
            for _ in range(40):
                loss = m(torch.randn(4, 8)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        return g

    (f,) = run(detach=False).findings
    assert (f.kind, f.where, f.step) == ("loss-graph-retained", "m.bank", 0)
    assert "features kept across steps without .detach()" in f.message and f.details["held_shapes"] == ["[32, 8]"]
    assert "z.detach()" in f.hint and "loss.item()" not in f.hint
    assert run(detach=True).findings == []


class _HandBN(nn.Module):
    """A hand-written BatchNorm whose running statistics are updated with autograd on (the bug)."""

    def __init__(self, c):
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(c))
        self.register_buffer("running_var", torch.ones(c))

    def forward(self, x):
        mean, var = x.mean(0), x.var(0, unbiased=False)
        self.running_mean = 0.9 * self.running_mean + 0.1 * mean
        self.running_var = 0.9 * self.running_var + 0.1 * var
        return (x - mean) / torch.sqrt(var + 1e-5)


def test_running_statistics_updated_with_autograd_on_get_the_running_average_fix_and_both_names():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), _HandBN(16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with guard(m, opt, live=False) as g:
        for _ in range(40):
            loss = F.cross_entropy(m(torch.randn(16, 8)), torch.randint(0, 3, (16,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    (f,) = g.findings
    assert f.kind == "loss-graph-retained" and f.where in ("m.1.running_mean", "m.1.running_var")
    other = "m.1.running_var" if f.where.endswith("mean") else "m.1.running_mean"
    assert f"also held by `{other}`" in f.message
    assert "(1 - momentum) * x.detach()" in f.hint and "torch.cat" not in f.hint


class _History:
    def __init__(self):
        self.losses = []

    def add(self, loss):
        self.losses.append(loss)  # the holder's update: keeps every step's graph


def test_a_list_attribute_updated_in_its_class_is_traced_to_that_line_with_self_in_the_fix():
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    history = _History()
    with guard(model, opt, live=False) as g:
        for x, y in batches(4) * 8:
            loss = F.mse_loss(model(x), y)
            history.add(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    (f,) = g.findings
    assert (f.kind, f.where) == ("loss-graph-retained", "history.losses")
    assert f.source == line_of(_History, "self.losses.append(loss)")
    assert "`self.losses.append(loss.item())`" in f.hint


class _Trainer:
    pass


def test_a_holder_two_attributes_deep_is_traced_to_its_class_line_in_another_file():
    """CycleGAN's layout: the loop reaches the pool as `cy.pool`, whose class (in util/image_pool.py there) keeps
    the graphs."""
    from tests.healthy._pool import Pool

    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cy = _Trainer()
    cy.pool = Pool()
    with guard(model, opt, live=False) as g:
        for x, y in batches(4) * 8:
            out = cy.pool.add(model(x))
            loss = F.mse_loss(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    (f,) = g.findings
    assert (f.kind, f.where) == ("loss-graph-retained", "cy.pool.items")
    assert f.source == line_of(Pool, "self.items.append(x)")


def test_per_parameter_optimizers_without_zero_grad_give_one_finding():
    """Optimizer in backward: one SGD per parameter, stepped from a post-accumulate-grad hook that never zeroes
    the gradient. One finding for all of them, naming the parameters, not one per optimizer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opts = {p: torch.optim.SGD([p], lr=0.01) for p in model.parameters()}
    handles = [p.register_post_accumulate_grad_hook(lambda p: opts[p].step()) for p in model.parameters()]
    try:
        with guard(model, list(opts.values()), live=False) as g:
            for _ in range(4):
                F.mse_loss(model(torch.randn(8, 8)), torch.randn(8, 1)).backward()
    finally:
        for h in handles:
            h.remove()
    (f,) = g.findings
    assert (f.kind, f.where) == ("missing-zero-grad", "SGD (per-parameter)")
    assert f.message.startswith("the 4 per-parameter SGD optimizers (one per parameter) apply gradients")
    assert sorted(f.details["names"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]


# --------------------------------------------------------------------------- missing-zero-grad, updates by hand

def manual_loop(update, clear, steps=8, every=1, model_guard=True, **opts):
    """A loop with no optimizer: `update(p)` under no_grad every `every` backwards, then `clear(p)` (None: nothing)."""
    torch.manual_seed(0)
    model = mlp()
    data = batches()
    with guard(model if model_guard else None, live=False, **opts) as g:
        for s in range(steps):
            x, y = data[s % len(data)]
            F.mse_loss(model(x), y).backward()
            if (s + 1) % every == 0:
                with torch.no_grad():
                    for p in model.parameters():
                        update(p)
                        if clear is not None:
                            clear(p)
    return g


def sub(p):
    p -= 0.01 * p.grad


def sub_data(p):
    p.data.sub_(0.01 * p.grad.data)


def none(p):
    p.grad = None


def zero(p):
    p.grad.zero_()


def zero_data(p):
    p.grad.data.zero_()  # keeps the gradient's version counter: the values tell


@pytest.mark.parametrize("model_guard", [True, False])
@pytest.mark.parametrize("update", [sub, sub_data])
def test_updates_by_hand_that_never_clear_the_gradients_are_found(update, model_guard):
    g = manual_loop(update, None, model_guard=model_guard)
    f = [f for f in g.findings if f.kind == "missing-zero-grad"]
    assert len(f) == 1, g.findings
    f = f[0]
    assert f.where == "parameters (no optimizer)" and f.step == 1
    assert "p.grad = None" in f.hint and "0.weight" in f.message
    assert f.source == line_of(manual_loop, ".backward()")
    assert g.internal_errors == []


@pytest.mark.parametrize("clear", [None, none])
def test_sparse_updates_by_hand_that_never_clear_the_gradients_are_found(clear):
    """word2vec with `nn.Embedding(sparse=True)` tables updated by hand (`p.add_(p.grad, alpha=-lr)`) and `.grad`
    never cleared: each update adds every earlier gradient. Sparse gradients were left out of the comparison
    (stop 45), so only the weights' blow-up 100 steps later was told, with a lower-the-learning-rate fix."""
    torch.manual_seed(0)

    class W2V(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Embedding(50, 8, sparse=True)
            self.out = nn.Embedding(50, 8, sparse=True)

        def forward(self, c, o):
            return (self.inp(c) * self.out(o)).sum(-1)

    model = W2V()
    with guard(model, live=False) as g:
        for _ in range(6):
            c, o = torch.randint(0, 50, (32,)), torch.randint(0, 50, (32,))
            F.binary_cross_entropy_with_logits(model(c, o), torch.ones(32)).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.grad, alpha=-0.1)
                    if clear is not None:
                        clear(p)
    found = [f for f in g.findings if f.kind == "missing-zero-grad"]
    if clear is None:
        assert len(found) == 1 and found[0].where == "parameters (no optimizer)" and found[0].step == 1, g.findings
        assert "inp.weight" in found[0].message and "p.grad = None" in found[0].hint
    else:
        assert g.findings == [], g.findings


@pytest.mark.parametrize("clear", [none, zero, zero_data])
@pytest.mark.parametrize("update", [sub, sub_data])
def test_updates_by_hand_that_clear_the_gradients_are_silent(update, clear):
    g = manual_loop(update, clear)
    assert g.findings == [] and g.internal_errors == []



def clip_then_sub(p):
    p.grad.clamp_(-1e9, 1e9)  # clipping in place before the update (clip_grad_value_, clamp_): not a clear
    sub(p)


def clip_norm_then_sub(p):
    torch.nn.utils.clip_grad_norm_([p], 1e9)
    sub(p)


@pytest.mark.parametrize("update", [clip_then_sub, clip_norm_then_sub])
def test_updates_by_hand_behind_gradient_clipping_that_never_clear_are_found(update):
    """Clipping changes the gradients in place before the update: they are still the piled-up ones (a clip
    between backward() and the update used to hide the missing clear)."""
    g = manual_loop(update, None)
    assert [(f.kind, f.where, f.step) for f in g.findings] == [("missing-zero-grad", "parameters (no optimizer)", 1)]
    assert manual_loop(update, zero).findings == [] and manual_loop(update, none).findings == []

def test_accumulation_by_hand_is_silent_and_its_missing_clear_is_found():
    """Several backwards before one update change no parameter in between: accumulation, not the bug."""
    g = manual_loop(sub, none, steps=12, every=3)
    assert g.findings == [] and g.internal_errors == []
    g = manual_loop(sub, None, steps=12, every=3)
    assert kinds(g) == ["missing-zero-grad"] and g.findings[0].step == 3


def test_a_model_guard_without_optimizer_counts_every_backward_as_a_step():
    """Each backward() is a step of its own (the step's end used to reset the next forward's count, so every
    other backward went unseen and the steps were counted at half speed)."""
    model = mlp()
    with guard(model, live=False) as g:
        for s in range(6):
            x = torch.randn(8, 8)
            if s == 3:
                x[0, 0] = float("nan")
            model(x).pow(2).mean().backward()
            model.zero_grad()
    assert g.step == 6
    f = [f for f in g.findings if f.kind == "nonfinite-input"]
    assert len(f) == 1 and f[0].step == 3


@pytest.mark.parametrize("fixed", [False, True])
def test_a_target_network_updated_in_place_with_autograd_on_is_a_growing_graph(fixed):
    """Polyak averaging written without torch.no_grad() on a frozen target: its weights join the graph (and guard
    itself must not make torch warn about reading .grad of the non-leaf weights)."""
    import copy
    import warnings

    torch.manual_seed(0)
    q = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    target = copy.deepcopy(q).requires_grad_(False)
    opt = torch.optim.Adam(q.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with guard([q, target], opt, live=False, checks="all") as g:
            for _ in range(40):
                o, a, r, o2 = torch.randn(8, 4), torch.randint(0, 2, (8,)), torch.randn(8), torch.randn(8, 4)
                with torch.no_grad():
                    y = r + 0.99 * target(o2).max(1).values
                loss = F.smooth_l1_loss(q(o).gather(1, a[:, None]).squeeze(1), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                with (torch.no_grad() if fixed else contextlib.nullcontext()):
                    for p, tp in zip(q.parameters(), target.parameters()):
                        tp.mul_(0.995).add_(0.005 * p)
    assert [str(w.message) for w in caught if "guard" in w.filename] == []
    assert g.internal_errors == []
    if fixed:
        assert g.findings == []
        return
    assert [(f.kind, f.where) for f in g.findings] == [("loss-graph-retained", "target")]
    f = g.findings[0]
    assert f.details["parameters_with_history"] is True and f.details["count"] == 4 and f.step == 16
    assert "torch.no_grad()" in f.hint and "lerp_" in f.hint


def test_pseudo_labels_computed_in_training_mode_with_batchnorm_are_part_of_training():
    """A no_grad pass at every step is part of training, BatchNorm included: FixMatch's weak view as USB computes
    it (use_cat=False), MixMatch's label guessing. The unlabeled batch is training data, fed to the statistics
    by the forward with grad anyway. Evaluated once between epochs without .eval(), it is the bug."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, live=False) as g:
        for step in range(8):
            x, y, unlabeled = torch.randn(16, 8), torch.randint(0, 3, (16,)), torch.randn(16, 8) + 2
            with torch.no_grad():
                pseudo = model(unlabeled).argmax(1)  # the bug: in training mode
            loss = F.cross_entropy(model(x), y) + F.cross_entropy(model(unlabeled), pseudo)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == 5:
                with torch.no_grad():
                    model(torch.randn(64, 8))  # a validation pass, model.eval() forgotten
    f = [f for f in g.findings if f.kind == "eval-in-train-mode"]
    assert len(f) == 1 and f[0].step == 6 and "BatchNorm" in f[0].message, g.findings


def test_a_statistics_pass_with_dropout_in_the_model_is_no_evaluation():
    """AdaBN / precise BN by hand: momentum=None, reset_running_stats(), forwards in train mode under no_grad,
    outputs thrown away, as swa_utils.update_bn does; the model's Dropout runs too, and means nothing there."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = batches(1)[0]
    with guard(model, opt, live=False) as g:
        for _ in range(6):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        model[1].momentum = None
        model[1].reset_running_stats()
        with torch.no_grad():
            for _ in range(5):
                model(torch.randn(8, 8))
        model[1].momentum = 0.1
    assert g.findings == [] and g.internal_errors == []


class _Replay(nn.Module):
    """An energy model with a replay buffer of Langevin samples (drawn with autograd.grad on the input)."""

    def __init__(self, detach):
        super().__init__()
        self.energy = nn.Sequential(nn.Linear(4, 16), nn.SiLU(), nn.Linear(16, 1))
        self.register_buffer("replay", torch.randn(32, 4))
        self.detach = detach

    def sample(self, idx):
        x = self.replay[idx].clone().requires_grad_(True)
        for _ in range(3):
            g, = torch.autograd.grad(self.energy(x).sum(), x, create_graph=not self.detach)
            x = x - 0.1 * g
        self.replay[idx] = x.detach() if self.detach else x  # the bug: the sample keeps its graph
        return x.detach()


def test_a_registered_buffer_that_keeps_every_steps_graph_is_named():
    def run(detach):
        torch.manual_seed(0)
        m = _Replay(detach)
        opt = torch.optim.Adam(m.energy.parameters(), lr=1e-3)
        with guard(m, opt, live=False) as g:
            for _ in range(40):
                neg = m.sample(torch.randint(0, 32, (8,)))
                loss = m.energy(torch.randn(8, 4)).mean() - m.energy(neg).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        return g

    (f,) = run(detach=False).findings
    assert (f.kind, f.where, f.step) == ("loss-graph-retained", "replay", 0)
    assert "buffer `replay` holds an autograd graph that reaches back to step 0" in f.message
    assert "x.detach()" in f.hint and f.details["buffer_with_history"] is True
    assert run(detach=True).findings == []


class _PlainReplay:
    """A replay buffer in a plain Python object (no module, no registered buffer)."""

    def __init__(self, detach):
        self.x = torch.randn(64, 2)
        self.detach = detach

    def push(self, x, idx):
        if self.detach:
            x = x.detach()
        self.x[idx] = x  # the bug (without the line above): the samples keep their graph


def _langevin(energy, x):
    x = x.clone().requires_grad_(True)
    for _ in range(3):
        g, = torch.autograd.grad(energy(x).sum(), x, create_graph=True)
        x = x - 0.05 * g
    return x


def test_a_plain_object_that_keeps_every_steps_graph_is_named_at_its_update():
    def run(detach):
        torch.manual_seed(0)
        energy = nn.Sequential(nn.Linear(2, 16), nn.SiLU(), nn.Linear(16, 1))
        opt = torch.optim.Adam(energy.parameters(), lr=1e-3)
        buf = _PlainReplay(detach)
        with guard(energy, opt, live=False) as g:
            for _ in range(80):
                idx = torch.randint(0, 64, (8,))
                neg = _langevin(energy, buf.x[idx])
                buf.push(neg, idx)
                loss = energy(torch.randn(8, 2)).mean() - energy(neg.detach()).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        return g

    (f,) = run(detach=False).findings
    # judged at the fourth look (steps 16, 32, 48, 64), the graph reaching back before the first
    assert (f.kind, f.where, f.step) == ("loss-graph-retained", "buf.x", 16)
    assert f.message.startswith("`buf.x` (") and "whose autograd graph reaches back to step 16 or earlier" in f.message
    line = _PlainReplay.push.__code__.co_firstlineno + 3
    assert f.source.endswith(f"test_loop_checks.py:{line}")  # the update in the buffer's class, not the loop
    assert "`self.x[idx] = x.detach()`" in f.hint and f.details["held_with_history"] is True
    assert run(detach=True).findings == []


def test_a_dict_cache_written_in_forward_is_traced_to_that_write():
    class Knn(nn.Module):
        def __init__(self):
            super().__init__()
            self.f, self.head, self.cache = nn.Sequential(nn.Linear(3, 32), nn.ReLU(), nn.Linear(32, 16)), \
                nn.Linear(16, 2), {}

        def forward(self, pos, sid):
            h = self.f(pos)
            d = torch.cdist(h, h)  # used for its kNN indices only: its graph is never back-propagated
            self.cache[sid] = d  # the bug: d.detach()
            return self.head(h[d.topk(8, largest=False).indices].max(1).values)

    torch.manual_seed(0)
    model = Knn()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    with guard(model, opt, live=False) as g:
        for step in range(20):
            pos = torch.rand(50, 3)
            loss = F.cross_entropy(model(pos, step), (pos[:, 2] > 0.5).long())  # a new key every step
            opt.zero_grad(); loss.backward(); opt.step()
    f = [f for f in g.findings if f.kind == "loss-graph-retained"][0]
    assert f.where.startswith("model.cache[")
    assert _line_text(f.source).strip().startswith("self.cache[sid] = d")
    assert "`self.cache[sid] = d.detach()`" in f.hint  # the key and the value as the writing line names them
    # each entry holds one step's graph: said as such (not "the autograd graphs of 1 steps")
    assert f"carry the autograd graph of step {f.step} (" in f.message and "1 steps" not in f.message


def test_a_dict_updated_from_itself_under_a_variable_key_is_named_at_that_line():
    """Synaptic intelligence's path integral `W[n] = W[n] - g * (p - prev[n])` outside no_grad: `p` is the live
    leaf, so W chains every step's graph. Its line is found through the container's writes (`W[n] = ...`)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    named = dict(model.named_parameters())
    W = {n: torch.zeros_like(p) for n, p in named.items()}
    prev = {n: p.detach().clone() for n, p in named.items()}
    with guard(model, opt, live=False) as g:
        for _ in range(70):
            loss = F.cross_entropy(model(torch.randn(16, 6)), torch.randint(0, 2, (16,)))
            opt.zero_grad(); loss.backward()
            grads = {n: p.grad.clone() for n, p in named.items()}
            opt.step()
            for n, p in named.items():
                W[n] = W[n] - grads[n] * (p - prev[n])  # the update line
                prev[n] = p.detach().clone()
    (f,) = g.findings
    assert f.kind == "loss-graph-retained" and f.where.startswith("W[")
    assert _line_text(f.source).strip().startswith("W[n] = W[n] - grads[n]")
    assert "with torch.no_grad(): W[n] = ..." in f.hint


def _line_text(source):
    import linecache
    path, _, no = source.rpartition(":")
    return linecache.getline(os.path.abspath(path), int(no))


def test_a_graph_built_once_and_reused_every_step_is_not_a_growing_one():
    """A prior computed once from a parameter and back-propagated at every step (retain_graph=True), rebuilt every
    20 steps: the tensor holds nodes older than the last look, but of one interval only."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    base = nn.Parameter(torch.randn(4))
    opt = torch.optim.SGD(list(model.parameters()) + [base], lr=0.01)
    with guard(model, opt, live=False) as g:
        for step in range(100):
            if step % 20 == 0:
                prior = torch.tanh(base * 2).unsqueeze(0)
            loss = (model(torch.randn(8, 4) + prior) ** 2).mean()
            opt.zero_grad()
            loss.backward(retain_graph=True)
            opt.step()
    assert [f for f in g.findings if f.severity != "info"] == []


def test_a_bank_written_row_by_row_without_detach_gets_the_row_write_fix():
    """`self.cache[i] = e` in a registered buffer (hard-negative mining cache): the holder's update is the row
    write, and the fix writes `e.detach()` there (not a torch.cat of the whole bank)."""

    class Cached(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(40, 8)
            self.register_buffer("cache", torch.zeros(40, 8))

        def forward(self, i):
            e = self.emb(i)
            self.cache[i] = e  # the bug: e.detach()
            return e

    torch.manual_seed(0)
    m = Cached()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with guard(m, opt, live=False) as g:
        for _ in range(12):
            loss = m(torch.randint(0, 40, (6,))).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = [f for f in g.findings if f.kind == "loss-graph-retained"][0]
    assert f.where == "m.cache" and f.source.endswith(f"test_loop_checks.py:{Cached.forward.__code__.co_firstlineno + 2}")
    assert "`self.cache[i] = e.detach()`" in f.hint


def test_a_matrix_of_evaluation_losses_is_named_by_its_outer_list():
    """Continual learning's accuracy matrix: each row holds one evaluation's loss tensors (graphs kept, no
    no_grad); the rows together hold every evaluation's graph. The outer list is the holder, not `logits`
    (which holds the last evaluation only)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    acc_matrix = []
    with guard(model, opt, live=False) as g:
        for t in range(4):
            x, y = torch.randn(64, 8), torch.randint(0, 2, (64,))
            for _ in range(10):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad(); loss.backward(); opt.step()
            row = []
            for _ in range(t + 1):
                logits = model(x)  # the bug: no torch.no_grad()
                row.append(F.cross_entropy(logits, y))
            acc_matrix.append(row)
    f = [f for f in g.findings if f.kind == "loss-graph-retained"][0]
    assert f.where == "acc_matrix" and f.step == 10
    assert _line_text(f.source).strip() == "acc_matrix.append(row)"
    assert "`row.append(loss.item())` for the rows of `acc_matrix`" in f.hint


def test_a_parameter_outside_the_model_is_named_by_its_variable():
    """GradNorm's task weights in their own optimizer, never zeroed: named `weights` (the script's variable),
    not `param_groups[0].params[0]`; a stacked ensemble's parameters by their dict entries."""
    torch.manual_seed(0)
    model = mlp()
    weights = nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    w_opt = torch.optim.SGD([weights], lr=0.01)
    with guard(model, [opt, w_opt], live=False) as g:
        for x, y in batches(4):
            opt.zero_grad()  # the bug: w_opt.zero_grad() is never called
            out = model(x)
            (weights[0] * F.mse_loss(out, y) + weights[1] * out.abs().mean()).backward()
            opt.step(); w_opt.step()
    f = [f for f in g.findings if f.kind == "missing-zero-grad"][0]
    assert f.where == "SGD" and "(weights)" in f.message

    members = [mlp() for _ in range(2)]
    params, _ = torch.func.stack_module_state(members)
    ens_opt = torch.optim.SGD(params.values(), lr=1e-2)
    with guard(None, live=False) as g:
        for x, y in batches(3):
            out = torch.vmap(lambda w, x: torch.func.functional_call(members[0], w, (x,)), in_dims=(0, None))(params, x)
            F.mse_loss(out, y.expand(2, -1, -1)).backward()  # the bug: no ens_opt.zero_grad()
            ens_opt.step()
    f = [f for f in g.findings if f.kind == "missing-zero-grad"][0]
    assert "params['0.weight']" in f.message


def test_a_learn2learn_clone_with_non_leaf_parameters_is_no_retained_graph_and_no_torch_warning():
    """learn2learn/MAML's clone: a deep copy whose module `_parameters` are replaced by differentiable clones and
    adapted as `p - lr * g`, rebuilt every step. Its plain-tensor "parameters" carry this step's graph on purpose
    (not an EMA updated in place), and guard reads no `.grad` of them (torch warns about non-leaf `.grad`)."""
    import copy
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with guard(live=False) as g:
            for _ in range(20):
                learner = copy.deepcopy(model)
                for mod, src in zip(learner.modules(), model.modules()):
                    for k, p in src._parameters.items():
                        mod._parameters[k] = p.clone()
                xs = torch.randn(10, 1)
                grads = torch.autograd.grad(F.mse_loss(learner(xs), torch.sin(xs)), list(learner.parameters()),
                                            create_graph=True)
                it = iter(grads)
                for mod in learner.modules():
                    for k in list(mod._parameters):
                        mod._parameters[k] = mod._parameters[k] - 0.01 * next(it)
                opt.zero_grad()
                F.mse_loss(learner(xs + 0.1), torch.sin(xs + 0.1)).backward()
                opt.step()
    assert [f.kind for f in g.findings if f.severity != "info"] == [] and g.internal_errors == []


@pytest.mark.parametrize("kind", ["swa", "ema"])
def test_the_averaged_model_evaluated_in_train_mode_is_told(kind):
    """SWA's AveragedModel after update_bn (which leaves it in train mode), or an EMA deep copy updated under
    no_grad, evaluated under no_grad without .eval(): the delivered network normalises with batch statistics and
    overwrites the running statistics. It is never trained with autograd, yet it is the run's model."""
    import copy

    from torch.optim.swa_utils import AveragedModel, update_bn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    avg = AveragedModel(model) if kind == "swa" else copy.deepcopy(model)
    x, y = torch.randn(128, 12), torch.randint(0, 2, (128,))
    with guard(live=False) as g:
        for _ in range(3):
            for i in range(0, 128, 32):
                opt.zero_grad(); F.cross_entropy(model(x[i:i + 32]), y[i:i + 32]).backward(); opt.step()
                if kind == "ema":
                    with torch.no_grad():
                        for pe, p in zip(avg.parameters(), model.parameters()):
                            pe.lerp_(p, 0.1)
            if kind == "swa":
                avg.update_parameters(model)
        if kind == "swa":
            update_bn([(x[i:i + 32], y[i:i + 32]) for i in range(0, 128, 32)], avg)
        with torch.no_grad():  # the bug: avg.eval() missing
            acc = (avg(x).argmax(1) == y).float().mean().item()
    f = [f for f in g.findings if f.kind == "eval-in-train-mode"]
    assert len(f) == 1 and f[0].details["types"] == ["BatchNorm1d"] and acc >= 0
    assert f[0].where == ("AveragedModel" if kind == "swa" else "Sequential#2")


def test_sam_without_zero_grad_at_the_first_iteration_is_told_live_at_the_step_the_summary_gives(capsys):
    """Under a global guard the optimizer is known from its first step: until then each backward() counts a step, and
    that first step makes both of SAM's backwards step 0. The live line said step 1 (the summary 0) until stop 44."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with guard(live=True) as g:
        for x, y in batches(3):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * p.grad)
            F.mse_loss(model(x), y).backward()  # the bug: no zero_grad() before it
            opt.step()
    err = capsys.readouterr().err
    assert [(f.kind, f.step) for f in g.findings] == [("missing-zero-grad", 0)]
    assert "guard WARNING missing-zero-grad at SGD, step 0 " in err


@pytest.mark.parametrize("scope, sam_from", [("global", 0), ("global", 4), ("model", 0), ("model", 4)])
def test_sam_without_zero_grad_between_its_two_passes_names_the_optimizer(scope, sam_from):
    """SAM written inline, no zero_grad() before the second backward: the step applies g(w) + g(w + e). The
    perturbation between the backwards is no update by hand: the optimizer is named (it is known to guard only
    from its first step, so the frames' optimizers are looked at). With the optimizer known (given to guard, or
    SAM switched on after warm-up steps) it was silent until stop 44: backwards within one step are now compared
    from the step after the first that applied several."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with guard(*((model, opt) if scope == "model" else ()), live=False) as g:
        for i, (x, y) in enumerate(batches(12)):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            if i < sam_from:
                opt.step()
                continue
            with torch.no_grad():
                gn = torch.norm(torch.stack([p.grad.norm() for p in model.parameters()]))
                eps = [p.grad * (0.05 / (gn + 1e-12)) for p in model.parameters()]
                for p, e in zip(model.parameters(), eps):
                    p.add_(e)
            F.mse_loss(model(x), y).backward()  # the bug: opt.zero_grad() missing before it
            with torch.no_grad():
                for p, e in zip(model.parameters(), eps):
                    p.sub_(e)
            opt.step()
    [f] = g.findings
    assert f.kind == "missing-zero-grad" and f.where == "SGD" and f.details["changed_in_between"]
    assert f.step == (sam_from + 1 if scope == "model" or sam_from else 0)
    assert "g(w) + g(w + e)" in f.message and "before the second backward()" in f.hint


@pytest.mark.parametrize("loop", ["sam with zero_grad", "accumulation with a pruning mask", "awp summing"])
def test_backwards_within_one_step_that_change_weights_deliberately_are_silent(loop):
    """The clean twins of SAM without zero_grad under a model guard: SAM that clears the first pass's gradients,
    and gradient accumulation whose pruning mask is multiplied into the weights again before each micro-batch (the
    weights' version moves, their values do not); adversarial weight perturbation of the weight matrices only (not
    the biases) that sums the adversarial gradient onto the clean one, as Kaggle's AWP does on purpose."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    mask = (torch.rand(16, 8) > 0.5).float()
    with guard(model, opt, live=False) as g:
        for x, y in batches(10):
            opt.zero_grad()
            if loop == "sam with zero_grad":
                F.mse_loss(model(x), y).backward()
                with torch.no_grad():
                    eps = [p.grad * 0.05 for p in model.parameters()]
                    for p, e in zip(model.parameters(), eps):
                        p.add_(e)
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                with torch.no_grad():
                    for p, e in zip(model.parameters(), eps):
                        p.sub_(e)
            elif loop == "awp summing":
                F.mse_loss(model(x), y).backward()
                weights = [p for n, p in model.named_parameters() if "weight" in n]
                with torch.no_grad():
                    eps = [0.01 * p.grad / (p.grad.norm() + 1e-12) * p.norm() for p in weights]
                    for p, e in zip(weights, eps):
                        p.add_(e)
                F.mse_loss(model(x), y).backward()  # added onto the clean gradient on purpose
                with torch.no_grad():
                    for p, e in zip(weights, eps):
                        p.sub_(e)
            else:
                for xb, yb in zip(x.chunk(2), y.chunk(2)):
                    with torch.no_grad():
                        model[0].weight.mul_(mask)
                    (F.mse_loss(model(xb), yb) / 2).backward()
            opt.step()
    assert g.findings == []


def test_gradient_accumulation_through_an_embedding_with_max_norm_is_no_perturbation():
    """nn.Embedding(max_norm=1.0) renormalises the rows it looks up in place, in its forward: between two accumulated
    backward()s the weight changed, but by the model call, not by a SAM-style perturbation. Silent (a false alarm
    until stop 40)."""
    torch.manual_seed(0)
    ent = nn.Embedding(50, 8, max_norm=1.0)
    opt = torch.optim.SGD(ent.parameters(), lr=0.1)
    with guard(live=False) as g:
        for step in range(12):
            loss = ent(torch.randint(0, 50, (16,))).pow(2).sum() / 2
            loss.backward()
            if step % 2 == 1:
                opt.step()
                opt.zero_grad()
    assert g.findings == []


@pytest.mark.parametrize("perturbed", ["embedding", "every weight"])
def test_fgm_sums_clean_and_adversarial_gradients_on_purpose(perturbed):
    """FGM: the embedding table perturbed along its gradient between the clean and the adversarial backward, whose
    gradients are summed on purpose, then restored before the step: silent (a false alarm as SAM until stop 40).
    Perturbing every weight that way is SAM without its zero_grad(): still told."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 16), nn.Flatten(), nn.Linear(64, 2))
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    with guard(live=False) as g:
        for _ in range(8):
            x = torch.randint(0, 20, (32, 4))
            y = (x[:, 0] > 9).long()
            F.cross_entropy(model(x), y).backward()
            ps = [model[0].weight] if perturbed == "embedding" else list(model.parameters())
            backup = [p.data.clone() for p in ps]
            for p in ps:
                p.data.add_(p.grad / p.grad.norm())
            F.cross_entropy(model(x), y).backward()
            for p, b in zip(ps, backup):
                p.data = b
            opt.step()
            opt.zero_grad()
    found = [f for f in g.findings if f.kind == "missing-zero-grad"]
    assert (found == []) is (perturbed == "embedding"), g.findings


def test_an_ema_updated_with_autograd_on_is_one_finding_under_a_global_guard():
    """`for e, p in zip(ema.parameters(), model.parameters()): e.mul_(d).add_((1 - d) * p)` with autograd on:
    told once, at the EMA copy's weights. The loop variable `e` still bound to one of them is no second holder."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2))
    ema = copy.deepcopy(model).requires_grad_(False).eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with guard(live=False) as g:
        for _ in range(80):
            x, y = torch.randn(16, 16), torch.randint(0, 2, (16,))
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
            for e, p in zip(ema.parameters(), model.parameters()):
                e.mul_(0.99).add_(0.01 * p)  # the bug: outside torch.no_grad()
            with torch.no_grad():
                ema(x)
    found = [f for f in g.findings if f.kind == "loss-graph-retained"]
    assert len(found) == 1 and found[0].details["parameters_with_history"] is True


def test_lbfgs_closure_without_zero_grad_that_diverges_inside_its_first_step_is_told():
    """A GP's marginal likelihood under L-BFGS whose closure never zeroes: the summed gradients send the line search
    to a NaN covariance inside the first step(), which raises. That step never ends; the missing zero_grad() is told
    as the run ends, beside the explained error."""
    torch.manual_seed(0)
    x = torch.rand(50, 1) * 5
    y = torch.sin(x).squeeze() + 0.1 * torch.randn(50)

    class GP(nn.Module):
        def __init__(self):
            super().__init__()
            self.raw = nn.Parameter(torch.tensor([0.0, 0.0, -2.0]))

        def forward(self, x, y):
            ls, scale, noise = F.softplus(self.raw)
            k = scale * torch.exp(-0.5 * torch.cdist(x, x).pow(2) / ls ** 2) + (noise + 1e-5) * torch.eye(len(x))
            mvn = torch.distributions.MultivariateNormal(torch.zeros(len(x)), covariance_matrix=k)
            return -mvn.log_prob(y) / len(x)

    gp = GP()
    opt = torch.optim.LBFGS(gp.parameters(), lr=0.5, max_iter=10)

    def closure():
        loss = gp(x, y)  # the bug: no opt.zero_grad() first
        loss.backward()
        return loss

    # (a NaN covariance or one not positive-definite, depending on the thread count's rounding)
    with pytest.raises((ValueError, RuntimeError)):
        with guard(gp, opt, live=False) as g:
            for _ in range(5):
                opt.step(closure)
    f = [f for f in g.findings if f.kind == "missing-zero-grad"]
    assert len(f) == 1 and f[0].where == "LBFGS" and "LBFGS.step(closure) ran backward()" in f[0].message
    assert _line_text(f[0].source).strip() == "opt.step(closure)"  # the step's line, kept as it began


def test_a_learned_optimizer_unroll_whose_last_update_is_never_evaluated_is_no_evaluation():
    """Meta-training a learned optimizer: each unroll step calls it once per weight, and the update after the last
    loss is computed but never evaluated (kept alive by the loop's variable until the next episode). Those few
    forwards are part of the algorithm: the optimizer's site is sampled once trusted, and its used forwards,
    mostly untagged, count for the ones they stand for."""
    from torch.func import functional_call

    torch.manual_seed(0)
    lopt = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))
    meta_opt = torch.optim.Adam(lopt.parameters(), lr=1e-3)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    w = torch.randn(4, 1)
    with guard(None, live=False) as g:
        for _ in range(8):
            params = {n: (torch.randn_like(p) * 0.3).requires_grad_() for n, p in net.named_parameters()}
            total = 0.0
            for _ in range(5):
                x = torch.randn(16, 4)
                loss = F.mse_loss(functional_call(net, params, (x,)), x @ w)
                total = total + loss
                grads = torch.autograd.grad(loss, list(params.values()), retain_graph=True)
                params = {n: p + 0.01 * lopt(gr.detach().reshape(-1, 1)).reshape(p.shape)
                          for (n, p), gr in zip(params.items(), grads)}
            meta_opt.zero_grad()
            total.backward()
            meta_opt.step()
    assert [f for f in g.findings if f.kind == "eval-without-no-grad"] == []


@pytest.mark.parametrize("selection", [True, False])
def test_test_time_adaptation_that_skips_unreliable_batches_is_no_evaluation(selection):
    """EATA/SAR-style adaptation: only the BatchNorm affine trains, each test batch is forwarded with grad (its
    output is the prediction) and adapted only when it holds low-entropy samples; under a strong shift the first
    batches are all skipped. Without the selection, the same frozen model evaluated with grad from a line that
    is never back-propagated is still told."""
    import math

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10))
    net.train()
    net.requires_grad_(False)
    net[1].requires_grad_(True)
    opt = torch.optim.SGD([net[1].weight, net[1].bias], lr=1e-3, momentum=0.9)
    src = torch.randn(400, 16)
    with guard(net, opt, live=False) as g:
        for i in range(12):
            x = src[torch.randint(0, 400, (32,))] + torch.randn(32, 16) * (4.0 if i < 8 else 0.1)
            if selection:
                out = net(x)
                ent = -(out.softmax(1) * out.log_softmax(1)).sum(1)
                ent = ent[ent < (0.1 * math.log(10) if i < 8 else 10.0)]
                if ent.numel() == 0:
                    continue
            else:
                net(x).argmax(1)  # an evaluation with grad: no backward ever uses this line
                out = net(x + 0.01)
                ent = -(out.softmax(1) * out.log_softmax(1)).sum(1)
            ent.mean().backward()
            opt.step()
            opt.zero_grad()
    if selection:
        assert g.findings == [] and g.internal_errors == []
    else:
        assert kinds(g) == ["eval-without-no-grad"]


class _PriorBN(nn.BatchNorm1d):
    """MEMO's prior BatchNorm: the running statistics mixed with the batch's, in either mode."""

    def forward(self, x):
        mean = 0.9 * self.running_mean + 0.1 * x.mean(0)
        var = 0.9 * self.running_var + 0.1 * x.var(0, unbiased=False)
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias


class _CastBN(nn.BatchNorm1d):
    """A BatchNorm run in float32 under mixed precision: torch's forward, through super()."""

    def forward(self, x):
        return super().forward(x.float()).type_as(x)


@pytest.mark.parametrize("bn", ["prior", "cast"])
def test_training_in_eval_mode_over_a_batchnorm_whose_own_forward_ignores_the_mode_is_not_told(bn):
    """MEMO adapts at test time in eval mode on purpose, its BatchNorm replaced by one mixing the running statistics
    with the test batch's (a subclass, or `nn.BatchNorm2d.forward = ...` as its repository does): nothing there
    depends on the mode, yet it was told as training in eval mode with "frozen running statistics" (stop 45). A
    subclass that hands over to torch's forward (`super().forward(x.float())`) is still told."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), (_PriorBN if bn == "prior" else _CastBN)(32), nn.ReLU(),
                          nn.Linear(32, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with guard(model, opt, live=False) as g:
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(model(torch.randn(8, 10)), torch.randint(0, 3, (8,))).backward()
            opt.step()
        model.eval()
        for _ in range(6):
            opt.zero_grad()
            F.cross_entropy(model(torch.randn(8, 10)), torch.randint(0, 3, (8,))).backward()
            opt.step()
    assert kinds(g) == ([] if bn == "prior" else ["train-in-eval-mode"]), g.findings


@pytest.mark.parametrize("frozen", [True, False])
def test_last_layer_retraining_of_a_frozen_model_kept_in_eval_mode_is_deliberate(frozen):
    """Deep feature reweighting: the model frozen and in eval mode (its BatchNorm statistics fixed), only the last
    Linear trained. The same eval mode with the whole model training is the forgotten model.train()."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3))
    if frozen:
        model.requires_grad_(False)
        model[3].requires_grad_(True)
    model.eval()
    opt = torch.optim.SGD(model[3].parameters() if frozen else model.parameters(), lr=0.05)
    with guard(model, opt, live=False) as g:
        for _ in range(6):
            opt.zero_grad()
            F.cross_entropy(model(torch.randn(8, 10)), torch.randint(0, 3, (8,))).backward()
            opt.step()
    assert kinds(g) == ([] if frozen else ["train-in-eval-mode"]), g.findings


class _LoRA(nn.Module):
    def __init__(self, base):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.A = nn.Parameter(torch.randn(2, base.in_features) * 0.1)
        self.B = nn.Parameter(torch.zeros(base.out_features, 2))

    def forward(self, x):
        return self.base(x) + x @ self.A.t() @ self.B.t()


@pytest.mark.parametrize("fixed", [False, True])
def test_lora_fine_tuning_left_in_eval_mode_after_validation_is_told(fixed):
    """LoRA on a frozen network: the trained parts (A, B) sit in wrappers around frozen Linears, and a validation's
    model.eval() is never undone. That is fine-tuning with its dropout off, not a head retrained on fixed features
    (silent until stop 40, which took the frozen weights for deep feature reweighting's frozen backbone)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8).requires_grad_(False), nn.Dropout(0.3), _LoRA(nn.Linear(8, 8)),
                          _LoRA(nn.Linear(8, 1)))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with guard(model, opt, live=False) as g:
        for step in range(16):
            if step == 10:
                model.eval()  # validation
                if fixed:
                    model.train()
            x = torch.randn(16, 8)
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    if fixed:
        assert g.findings == []
    else:
        [f] = g.findings
        assert (f.kind, f.where, f.step) == ("train-in-eval-mode", "Sequential", 10) and "1 (Dropout)" in f.message


@pytest.mark.parametrize("fixed", [False, True])
def test_an_ema_teacher_guard_does_not_watch_updated_with_autograd_on_is_named_by_its_variable(fixed):
    """guard(student, opt): the teacher, a deep copy frozen and updated in place without torch.no_grad(), carries a
    graph that grows at every update. It is no watched model: found among the user's variables, named `teacher`."""
    import copy

    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))
    teacher = copy.deepcopy(student).requires_grad_(False)
    opt = torch.optim.SGD(student.parameters(), lr=0.05)
    x, y = torch.randn(64, 10), torch.randint(0, 3, (64,))
    with guard(student, opt, live=False) as g:
        for _ in range(40):
            with torch.no_grad():
                t = teacher(x).softmax(1)
            s = student(x)
            loss = F.cross_entropy(s, y) + F.mse_loss(s.softmax(1), t)
            opt.zero_grad()
            loss.backward()
            opt.step()
            with (torch.no_grad() if fixed else contextlib.nullcontext()):
                for tp, sp in zip(teacher.parameters(), student.parameters()):
                    tp.mul_(0.99).add_(0.01 * sp)
    if fixed:
        assert g.findings == []
    else:
        assert [(f.kind, f.where) for f in g.findings] == [("loss-graph-retained", "teacher")]
        assert g.findings[0].details["parameters_with_history"] is True
        assert g.findings[0].details["parameters"][0] == "teacher.0.weight"


@pytest.mark.parametrize("fixed", [False, True])
def test_validation_through_a_frozen_backbone_before_a_trained_prompt_is_an_evaluation(fixed):
    """Prompt tuning: no optimizer trains the backbone, but every training step back-propagates through it to the
    prompt. Validation forwards of it outside no_grad build (and a list keeps) that graph for nothing."""
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2)).requires_grad_(False)
    prompt = nn.Parameter(torch.zeros(8))
    opt = torch.optim.Adam([prompt], lr=1e-2)
    x, y = torch.randn(64, 8), torch.randint(0, 2, (64,))
    with guard(backbone, opt, live=False) as g:
        for _ in range(4):
            for i in range(0, 64, 16):
                loss = F.cross_entropy(backbone(x[i:i + 16] + prompt), y[i:i + 16])
                opt.zero_grad()
                loss.backward()
                opt.step()
            with (torch.no_grad() if fixed else contextlib.nullcontext()):
                val = [F.cross_entropy(backbone(x[j:j + 8] + prompt), y[j:j + 8]) for j in range(0, 64, 8)]
            torch.stack(val).mean().item()
    assert kinds(g) == ([] if fixed else ["eval-without-no-grad"]), g.findings


class _Seq2Seq(nn.Module):
    """A decoder model whose inference goes through its own methods, not through ``model(...)``."""

    def __init__(self):
        super().__init__()
        self.emb, self.drop = nn.Embedding(12, 16), nn.Dropout(0.3)
        self.enc, self.dec, self.out = nn.GRU(16, 16, batch_first=True), nn.GRU(16, 16, batch_first=True), nn.Linear(16, 12)

    def encode(self, src):
        return self.enc(self.drop(self.emb(src)))[1]

    def step(self, tok, h):
        o, h = self.dec(self.drop(self.emb(tok)), h)
        return self.out(o[:, -1]), h

    def forward(self, src, tgt):
        o, _ = self.dec(self.drop(self.emb(tgt)), self.encode(src))
        return self.out(o)


@torch.no_grad()
def _greedy(m, src):
    h = m.encode(src)  # the decoding starts here
    tok = torch.zeros(src.size(0), 1, dtype=torch.long)
    for _ in range(3):
        logits, h = m.step(tok, h)
        tok = logits.argmax(-1, keepdim=True)
    return tok


@pytest.mark.parametrize("every", [6, 1])
@pytest.mark.parametrize("with_eval", [False, True])
def test_decoding_through_the_models_own_methods_in_training_mode(with_eval, every):
    """A greedy decoder under no_grad calls `m.encode`, `m.step`, never `m(...)`: with `m.eval()` forgotten its
    Dropout runs in training mode; told at the model, at the decoder's line. `m.eval()` first, or a decode at every
    training step (part of the training algorithm, as scheduled sampling), stays silent."""
    torch.manual_seed(0)
    m = _Seq2Seq()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    with guard(m, opt, live=False) as g:
        for i in range(14):
            src = torch.randint(1, 12, (8, 4))
            loss = F.cross_entropy(m(src, src).reshape(-1, 12), src.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if i % every == every - 1:
                if with_eval:
                    m.eval()
                _greedy(m, src)
                m.train()
    if with_eval or every == 1:
        assert g.findings == []
        return
    (f,) = g.findings
    assert (f.kind, f.where, f.step) == ("eval-in-train-mode", "_Seq2Seq", 6)
    assert f.source == line_of(_greedy.__wrapped__, "h = m.encode(src)") and f.details["modules"] == ["drop"]


class _Cap(nn.Module):
    """A captioner whose encoder (with BatchNorm) is called by the model's own `greedy` method."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16))
        self.cell, self.drop, self.out = nn.GRUCell(16, 16), nn.Dropout(0.3), nn.Linear(16, 5)

    def forward(self, x):
        return self.out(self.drop(self.cell(self.enc(x), None)))

    def greedy(self, x):
        h = self.enc(x)
        return self.out(self.drop(self.cell(h, h))).argmax(-1)


@pytest.mark.parametrize("scope", ["model", "global"])
def test_a_part_called_by_the_models_own_method_is_one_evaluation_of_the_model(scope):
    """`m.greedy(x)` under no_grad with `m.eval()` forgotten: its `self.enc(x)` is a model call of its own under a
    global guard. One finding, at the model, at the user's line, naming the encoder's BatchNorm by its full path;
    not a second one at `enc` with a line inside `greedy` and the BatchNorm called `1`."""
    torch.manual_seed(0)
    m = _Cap()
    opt = torch.optim.SGD(m.parameters(), 0.1)
    with guard(m if scope == "model" else None, opt if scope == "model" else None, live=False) as g:
        for step in range(8):
            loss = F.cross_entropy(m(torch.randn(8, 8)), torch.randint(0, 5, (8,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == 3:
                with torch.no_grad():
                    m.greedy(torch.randn(8, 8))  # the evaluation
    (f,) = g.findings
    assert (f.kind, f.where, f.step) == ("eval-in-train-mode", "_Cap", 4)
    assert f.source == line_of(test_a_part_called_by_the_models_own_method_is_one_evaluation_of_the_model,
                               "m.greedy(torch.randn(8, 8))  # the evaluation")
    assert sorted(f.details["modules"]) == ["drop", "enc.1"]

def _mining(evaluate):
    """Threshold hard-example mining: the forward shows which samples are hard, and a batch with none is skipped
    (its graph dropped) in runs scattered over the epoch. With `evaluate`, a validation pass outside no_grad from
    its own line follows."""
    torch.manual_seed(0)
    x = torch.randn(800, 10)
    y = x[:, :3].argmax(1)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    skipped = 0
    with guard(model, opt, live=False) as g:
        for epoch in range(2):
            for i in range(0, 800, 8):
                per = F.cross_entropy(model(x[i:i + 8]), y[i:i + 8], reduction="none")
                hard = per > 1.2
                if not hard.any():
                    skipped += 1
                    continue
                opt.zero_grad()
                per[hard].mean().backward()
                opt.step()
            if evaluate:
                sum(F.cross_entropy(model(x[i:i + 8]), y[i:i + 8]).item() for i in range(0, 64, 8))  # the bug
    return g, skipped


@pytest.mark.parametrize("adapts", [True, False])
def test_a_wrapper_whose_forward_adapts_is_no_evaluation_when_its_filter_rejects_every_sample(adapts):
    """SAR under a strong shift: its wrapper's forward runs the model with grad (`@torch.enable_grad()`), keeps the
    confident samples and back-propagates their entropy, but here no sample passes, so no backward ever comes. It
    was told as an evaluation outside no_grad, whose fix would switch the method off (stop 45). A wrapper whose
    forward never back-propagates anything, called the same way, is still told."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    class Adapt(nn.Module):
        def __init__(self, model, optimizer):
            super().__init__()
            self.model, self.optimizer = model, optimizer

        @torch.enable_grad()
        def forward(self, x):
            out = self.model(x)
            ent = -(out.softmax(1) * out.log_softmax(1)).sum(1)
            kept = ent[ent < -1.0]  # (an impossible margin: the filter rejects every sample)
            if kept.numel():
                kept.mean().backward()
                self.optimizer.step()
                self.optimizer.zero_grad()
            return out

    class Predict(nn.Module):  # an evaluation wrapper: its forward only predicts
        def __init__(self, model, optimizer):
            super().__init__()
            self.model = model

        def forward(self, x):
            return self.model(x)

    with guard(live=False) as g:
        for _ in range(10):
            opt.zero_grad()
            F.cross_entropy(net(torch.randn(16, 8)), torch.randint(0, 4, (16,))).backward()
            opt.step()
        adapt = (Adapt if adapts else Predict)(net, opt)
        for _ in range(25):
            adapt(torch.randn(16, 8) * 3)
    found = [f for f in g.findings if f.kind == "eval-without-no-grad"]
    assert (found == []) == adapts, g.findings


def test_batches_skipped_after_the_forward_are_no_evaluation():
    """Runs of batches skipped on what their forward showed, between backwards of the same line: silent. An
    evaluation outside no_grad elsewhere in the loop is still told."""
    g, skipped = _mining(False)
    assert skipped >= 10 and g.findings == []
    g, _ = _mining(True)
    (f,) = g.findings
    assert f.kind == "eval-without-no-grad" and f.source == line_of(_mining, "# the bug")


@pytest.mark.parametrize("to_none", [True, False])
def test_a_batch_the_miner_found_empty_given_a_constant_loss_is_no_evaluation(to_none):
    """Batch-all triplet mining returns `torch.zeros((), requires_grad=True)` when a batch holds no active triplet, so
    that the loop stays the same (backward and step do nothing). Whether it has any is known only after the forward,
    so its graph is dropped on those steps, in runs scattered between the trained ones: silent (it was told as a
    detach that keeps the model from ever training, while it trained at the other steps)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def mined_loss(emb, step):
        if step in (7, 12, 13, 16) or (step >= 18 and step not in (22, 25, 29)):  # no active triplet
            return torch.zeros((), requires_grad=True)
        return emb.pow(2).mean()

    with guard(model, opt, live=False) as g:
        for step in range(40):
            loss = mined_loss(model(torch.randn(16, 8)), step)
            opt.zero_grad(set_to_none=to_none)
            loss.backward()
            opt.step()
    assert g.findings == [] and g.internal_errors == []


def _recalibrate(model):
    model.train()
    with torch.no_grad():
        for _ in range(10):
            model(torch.randn(16, 8) * 2 + 1)


def _evaluate(model):
    with torch.no_grad():
        for _ in range(10):
            model(torch.randn(16, 8) * 2 + 1)


@pytest.mark.parametrize("layer", ["batchnorm", "dropout"])
def test_a_no_grad_pass_right_after_model_train_is_deliberate(layer):
    """`model.train()` just before a no_grad loop: BatchNorm statistics re-estimated on a new domain with the default
    momentum (AdaBN, recalibration after pruning), or Monte Carlo dropout sampling. Silent. The same loop with no
    `.train()` above it (an evaluation that forgot `model.eval()`) is told."""
    for after in (_recalibrate, _evaluate):
        torch.manual_seed(0)
        norm = nn.BatchNorm1d(16) if layer == "batchnorm" else nn.Dropout(0.2)
        model = nn.Sequential(nn.Linear(8, 16), norm, nn.ReLU(), nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with guard(model, opt, live=False) as g:
            for x, y in batches(4):
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
            after(model)
        assert kinds(g) == ([] if after is _recalibrate else ["eval-in-train-mode"]), (after, g.findings)


@pytest.mark.parametrize("reset", [False, True])
def test_forces_from_backward_with_create_graph_keep_a_reference_cycle(reset):
    """`E.sum().backward(inputs=[pos], create_graph=True); F = -pos.grad`: pos.grad carries a graph that holds pos,
    a cycle that keeps every step's graph alive until the garbage collector runs. Told at `pos`, with the
    torch.autograd.grad fix, not as a `loss` variable to turn into `loss.item()`. `pos.grad = None` after use is
    silent."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    x = torch.randn(64, 4, 3)
    gc_was = __import__("gc").isenabled()
    __import__("gc").disable()  # the cycle collector would free them at its own pace: the leak is what it leaves
    try:
        with guard(net, opt, live=False) as g:
            for step in range(40):
                pos = x[(step % 4) * 16:(step % 4 + 1) * 16].clone().requires_grad_(True)
                e = net(pos).sum((1, 2))
                e.sum().backward(inputs=[pos], create_graph=True)
                force = -pos.grad
                loss = (force + 2 * pos.detach()).pow(2).mean() + 0.01 * (e - pos.detach().pow(2).sum((1, 2))).pow(2).mean()
                opt.zero_grad()
                loss.backward(inputs=list(net.parameters()))
                opt.step()
                if reset:
                    pos.grad = None
    finally:
        if gc_was:
            __import__("gc").enable()
    found = [f for f in g.findings if f.kind == "loss-graph-retained"]
    if reset:
        assert found == [], found
        return
    (f,) = found
    assert f.where == "pos" and f.details["grad_cycle"] is True and "reference cycle" in f.message
    assert "torch.autograd.grad(E.sum(), pos, create_graph=True)[0]" in f.hint


def test_a_forward_dropped_at_every_step_beside_a_used_one_on_its_line_is_still_told():
    """FixMatch written `logits_w = net(xw); logits_s = net(xs)` on one line: the weak view's graph is dropped (it is
    read detached) at every step, next to the strong view's, which is back-propagated. Not a skipped batch: a graph
    built for nothing each step."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    with guard(net, opt, live=False) as g:
        for _ in range(20):
            xu = torch.randn(16, 12)
            logits_w = net(xu + 0.05 * torch.randn_like(xu)); logits_s = net(xu + 0.4 * torch.randn_like(xu))  # noqa: E702
            pl = logits_w.detach().argmax(-1)
            loss = F.cross_entropy(logits_s, pl)
            opt.zero_grad()
            loss.backward()
            opt.step()
    (f,) = g.findings
    assert f.kind == "eval-without-no-grad" and f.details["dropped_at_once"] is True


def test_a_containers_train_at_the_top_of_the_step_does_not_excuse_another_models_no_grad_pass():
    """`models.train()` at the top of each step (a ModuleDict holding a frozen classifier too), then the frozen
    classifier's pseudo-labels under no_grad: the `.train()` above is not that model's, so it is no word about it."""
    torch.manual_seed(0)
    clf = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    models = nn.ModuleDict({"clf": clf, "net": net})
    opt = torch.optim.SGD(list(net.parameters()) + list(clf.parameters()), lr=0.05)
    with guard(models, opt, live=False) as g:
        for step in range(12):
            models.train()
            x = torch.randn(16, 8)
            if step % 6 == 5:
                with torch.no_grad():
                    pl = clf(x).argmax(1)  # an evaluation in train mode
            else:
                pl = torch.randint(0, 3, (16,))
            loss = F.cross_entropy(net(x), pl) + F.cross_entropy(clf(x), pl)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert "eval-in-train-mode" in kinds(g), g.findings


@pytest.mark.parametrize("order", ["zero-then-write", "write-then-zero", "write-step-zero"])
def test_gradients_written_by_hand_then_wiped_by_zero_grad_before_the_step(order):
    """DP-SGD with torch.func: per-sample gradients, clipped and noised, are written into `p.grad` by hand (no
    backward()). A `zero_grad()` between that and `step()` wipes them: the model never trains, and with no
    backward() the check used to stay silent. Zeroing before writing, or after the step, is fine."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = torch.randn(64, 10), torch.randint(0, 2, (64,))

    def loss(params, xi, yi):
        return nn.functional.cross_entropy(torch.func.functional_call(model, params, (xi[None],)), yi[None])

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))
    before = [p.detach().clone() for p in model.parameters()]
    with guard(live=False) as g:
        for step in range(6):
            if order == "zero-then-write":
                opt.zero_grad()
            grads = per_sample({n: p.detach() for n, p in model.named_parameters()}, x[:16], y[:16])
            for n, p in model.named_parameters():
                p.grad = grads[n].mean(0)
            if order == "write-then-zero":
                opt.zero_grad()  # wipes them
            opt.step()
            if order == "write-step-zero":
                opt.zero_grad()
    moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    if order == "write-then-zero":
        assert not moved
        assert [(f.kind, f.where, f.step) for f in g.findings] == [("zero-grad-before-step", "SGD", 0)]
        f = g.findings[0]
        assert "written by hand" in f.message and f.details["written_by_hand"] is True
        assert "p.grad = ..." in f.hint
    else:
        assert moved and g.findings == []


@pytest.mark.parametrize("detach", [False, True])
def test_a_state_carried_across_iterations_under_retain_graph_is_named(detach):
    """A diagonal linear RNN streamed over chunks: `pred, h = model(x, h)` without `h.detach()`, and
    backward(retain_graph=True) to silence the error. `h` reaches the earlier steps only through this step's graph:
    it was the generic "something keeps the loss tensors" with the `loss.item()` fix, which changes nothing."""

    class DiagRNN(nn.Module):
        def __init__(self, n=8):
            super().__init__()
            self.a = nn.Parameter(torch.randn(n) + 2.0)
            self.B, self.C = nn.Linear(1, n, bias=False), nn.Linear(n, 1)

        def forward(self, x, h):
            a, u, out = torch.sigmoid(self.a), self.B(x), []
            for t in range(x.shape[1]):
                h = a * h + (1 - a) * u[:, t]
                out.append(h)
            return self.C(torch.stack(out, 1)), h

    torch.manual_seed(0)
    model = DiagRNN()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    stream = torch.sin(torch.linspace(0, 30, 401))[None, :, None].repeat(2, 1, 1)
    h = torch.zeros(2, 8)
    with guard(model, opt, live=False) as g:
        for s in range(0, 380, 10):
            x, y = stream[:, s:s + 10], stream[:, s + 1:s + 11]
            if detach:
                h = h.detach()
            pred, h = model(x, h)
            loss = F.mse_loss(pred, y)
            opt.zero_grad()
            loss.backward(retain_graph=True)
            opt.step()
    if detach:
        assert g.findings == []
        return
    assert [(x.kind, x.where) for x in g.findings] == [("loss-graph-retained", "h")]
    f = g.findings[0]
    assert f.details["carried"] is True and f.step == 0
    line = next(i for i, t in enumerate(open(__file__).read().split("\n"), 1) if t.strip() == "pred, h = model(x, h)")
    assert f.details["holder_source"].endswith(f":{line}")
    assert "carried from one iteration into the next" in f.message and "h = h.detach()" in f.hint


@pytest.mark.parametrize("case", ["densified", "detached"])
def test_a_leaf_recreated_with_more_rows_and_left_out_of_the_optimizer_is_named_so(case):
    """3D Gaussian splatting on plain leaves: the points are re-created with 3 more rows (densification) and the
    optimizer still holds the old tensor. It was told as a graph cut by .detach() with the keep-autograd fix. A
    tensor really restarted from a detached value, that only shares a trailing size with a weight, still is."""
    torch.manual_seed(0)
    x = torch.randn(10, 2).requires_grad_()
    opt = torch.optim.Adam([x], lr=1e-2)
    with guard(live=False) as g:
        for it in range(12):
            if case == "densified":
                loss = (x ** 2).sum()
            else:
                h = (x * 3).detach()[:4].mul(2).requires_grad_() if it >= 6 else x
                loss = (h ** 2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if it == 5 and case == "densified":
                with torch.no_grad():
                    x = torch.cat([x, x[:3] + 0.1]).requires_grad_()
    assert [(f.kind, f.step) for f in g.findings] == [("loss-disconnected", 6)]
    f = g.findings[0]
    if case == "densified":
        assert f.details["resized"] is True and "grown or pruned" in f.message and "state" in f.hint
    else:
        assert "resized" not in f.details and ".detach()" in f.message


@pytest.mark.parametrize("clear", [False, True])
def test_plain_tensors_updated_by_hand_with_no_model_keep_their_gradients(clear):
    """Camera pose fitting with no nn.Module and no optimizer: a translation and a quaternion as plain leaves,
    `t -= lr * t.grad` under no_grad, .grad never cleared. With no model there was nothing to stand for the
    parameters, and guard said nothing."""
    torch.manual_seed(0)
    pts = torch.randn(50, 3)
    target = pts + torch.tensor([1.0, 2.0, 3.0])
    t = torch.zeros(3, requires_grad=True)
    q = torch.tensor([1.0, 0.0, 0.0, 0.0], requires_grad=True)
    with guard(live=False) as g:
        for _ in range(12):
            scale = q.norm()
            loss = ((pts * scale + t - target) ** 2).sum(-1).mean()
            loss.backward()
            with torch.no_grad():
                t -= 0.05 * t.grad
                q -= 0.01 * q.grad
                if clear:
                    t.grad = None
                    q.grad = None
    if clear:
        assert g.findings == []
        return
    assert [(f.kind, f.step) for f in g.findings] == [("missing-zero-grad", 1)]
    f = g.findings[0]
    assert f.where in ("t", "q") and set(f.details["parameters"]) == {"t", "q"}
    assert f.details["plain_tensors"] is True and ".grad = None" in f.hint


# --------------------------------------------------------------------------- backwards restricted to latents (stop 39)

def _predictive_coding(how, scope="models", evaluate=False, steps=10):
    """Predictive-coding inference: the energy holds a layer's prediction of a latent from the data, and is
    differentiated with respect to the latent only (the layer's own node is off that way); then the weights learn.
    `evaluate`: a validation forward with grad on, never back-propagated, at every step (the real bug)."""
    torch.manual_seed(0)
    enc = nn.Linear(4, 8)
    opt = torch.optim.SGD(enc.parameters(), lr=0.002)
    x, target = torch.randn(16, 4), torch.randn(16, 8)
    with guard(*((enc, opt) if scope == "models" else ()), live=False) as g:
        for _ in range(steps):
            h = target.clone().requires_grad_()
            for _ in range(5):
                energy = ((h - enc(x)) ** 2).sum() + ((h - target) ** 2).sum()
                if how == "grad":
                    (gh,) = torch.autograd.grad(energy, [h])
                else:
                    energy.backward(inputs=[h])
                    gh = h.grad
                with torch.no_grad():
                    h -= 0.05 * gh
                h.grad = None
            if evaluate:
                enc(torch.randn(16, 4)).sum().item()
            loss = ((h.detach() - enc(x)) ** 2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return g


@pytest.mark.parametrize("how", ["grad", "backward_inputs"])
@pytest.mark.parametrize("scope", ["models", "global"])
def test_a_layer_differentiated_around_in_latent_inference_is_no_evaluation(how, scope):
    assert _predictive_coding(how, scope).findings == []


def test_an_evaluation_beside_latent_inference_is_still_told():
    g = _predictive_coding("grad", evaluate=True)
    assert kinds(g) == ["eval-without-no-grad"]


def test_a_hook_statistic_kept_in_a_dict_gets_the_entry_write_fix():
    """K-FAC's running input covariance written from a forward hook, `A[m] = ...` without detach: the fix writes
    the dict entry, not `A.append(...)`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    A = {}

    def stat(m, inp, out):
        a = inp[0]
        A[m] = a.t() @ a / len(a) if m not in A else 0.95 * A[m] + 0.05 * (a.t() @ a / len(a))

    for m in model:
        if isinstance(m, nn.Linear):
            m.register_forward_hook(stat)
    with guard(model, opt, live=False) as g:
        for _ in range(20):
            loss = model(torch.randn(16, 6)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = [f for f in g.findings if f.kind == "loss-graph-retained"][0]
    assert "`A[m] = z.detach()`" in f.hint and ".append(" not in f.hint


def test_outputs_kept_in_a_list_get_the_fix_with_the_appended_variable():
    """`all_outputs.append(outputs)` for an epoch-level metric: the fix names `outputs`, not a made-up `z`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(96, 10), torch.rand(96, 1)
    with guard(model, opt, live=False) as g:
        all_outputs = []
        for i in range(0, 96, 8):
            opt.zero_grad()
            outputs = model(x[i:i + 8])
            loss = F.binary_cross_entropy_with_logits(outputs, y[i:i + 8])
            loss.backward()
            opt.step()
            all_outputs.append(outputs)
    f = [f for f in g.findings if f.kind == "loss-graph-retained"][0]
    assert f.where == "all_outputs" and "`all_outputs.append(outputs.detach())`" in f.hint


def test_a_state_carried_by_a_rebinding_is_named_at_that_line():
    """A latent warm-started from the last batch's result: `h_prev = h` at the loop's end, fed back as
    `h = 0.5 * h_prev + ...`, kept alive by retain_graph=True. The carried variable is `h_prev`, and the fix detaches
    it where it is carried over."""
    torch.manual_seed(0)
    enc = nn.Linear(4, 8)
    opt = torch.optim.SGD(enc.parameters(), lr=0.01)
    x, t = torch.randn(16, 4), torch.randn(16, 8)
    with guard(enc, opt, live=False) as g:
        h_prev = torch.zeros(16, 8)
        for _ in range(12):
            h = 0.5 * h_prev + 0.5 * enc(x)
            for _ in range(3):
                h = h - 0.1 * (h - t)
            loss = ((h - t) ** 2).mean()
            opt.zero_grad()
            loss.backward(retain_graph=True)
            opt.step()
            h_prev = h
    f = [f for f in g.findings if f.kind == "loss-graph-retained"][0]
    assert f.where == "h_prev" and f.details["carried"] is True and f.details["carried_from"] == "h"
    assert "`h_prev = h.detach()`" in f.hint and _line_text(f.source).strip() == "h_prev = h"


def test_unused_forwards_from_two_lines_are_both_said_in_the_message():
    """A validation forward with grad on at one line and sharpness probes at another: the message counts the first
    line's forwards and says the other line's too (they were only in `details.sources`)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    with guard(model, opt, live=False) as g:
        for step in range(6):
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == 3:
                for _ in range(3):
                    val = F.mse_loss(model(x), y).item()  # validation without no_grad
                for _ in range(4):
                    probe = F.mse_loss(model(x + 0.01 * torch.randn_like(x)), y).item()  # sharpness probes
    (f,) = [f for f in g.findings if f.kind == "eval-without-no-grad"]
    assert len(f.details["sources"]) == 2 and f.message.startswith("3 forward passes") and "; also 4 at " in f.message


def test_maml_fast_weights_made_from_detached_copies_get_the_inner_loop_fix():
    """MAML whose inner loop starts from `v.detach().clone().requires_grad_(True)`: the meta-loss reaches only the
    copies, rebuilt for every task, so building the optimizer over them (the copies fix) is wrong; the fix is to
    start from the parameters themselves (told with that fix first since stop 41)."""
    from torch.func import functional_call

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 16), nn.ReLU(), nn.Linear(16, 1))
    meta_opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    with guard(net, meta_opt, live=False) as g:
        for _ in range(3):
            meta_opt.zero_grad()
            meta_loss = 0.0
            for _ in range(2):
                x = torch.rand(20, 1) * 10 - 5
                y = torch.sin(x)
                fast = {k: v.detach().clone().requires_grad_(True) for k, v in net.named_parameters()}
                grads = torch.autograd.grad(F.mse_loss(functional_call(net, fast, (x[:10],)), y[:10]),
                                            list(fast.values()), create_graph=True)
                fast = {k: w - 0.01 * gi for (k, w), gi in zip(fast.items(), grads)}
                meta_loss = meta_loss + F.mse_loss(functional_call(net, fast, (x[10:],)), y[10:]) / 2
            meta_loss.backward()
            meta_opt.step()
    f = [f for f in g.findings if f.kind == "loss-disconnected"][0]
    assert f.step == 0 and f.details["inner_loop"] is True
    assert f.hint.startswith("Start the inner loop from the parameters themselves") and "params.values()" not in f.hint


@pytest.mark.parametrize("who", ["teacher", "generator"])
def test_a_teacher_queried_with_detach_in_train_mode_is_told_its_dropout_runs_but_a_gan_generator_is_not(who):
    """`teacher(x).detach()` with the teacher trained earlier and left in train mode: beyond the wasted graph, its
    Dropout makes the soft targets noisy (stop 41). A GAN's `G(z).detach()` for the critic step is trained at every
    step (its weights move): only the wasted graph is told."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 8))
    other = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1 if who == "generator" else 8))
    opt_net = torch.optim.Adam(net.parameters(), lr=1e-3)
    opt_other = torch.optim.Adam(other.parameters(), lr=1e-3)
    with guard(None, live=False) as g:
        if who == "teacher":
            for _ in range(20):  # the teacher's own training, then distillation into `other`
                x = torch.randn(32, 8)
                opt_net.zero_grad()
                F.mse_loss(net(x), x).backward()
                opt_net.step()
        for _ in range(40):
            x = torch.randn(32, 8)
            out = net(x).detach()
            if who == "teacher":
                loss = F.mse_loss(other(x), out)
            else:  # critic step on the detached fakes, then the generator's step
                loss = other(out).mean() - other(x).mean()
            opt_other.zero_grad()
            loss.backward()
            opt_other.step()
            if who == "generator":
                opt_net.zero_grad()
                (-other(net(x)).mean()).backward()
                opt_net.step()
    found = [f for f in g.findings if f.kind == "eval-without-no-grad"]
    if who == "teacher":
        [f] = found
        assert f.details["train_mode_modules"] == ["2 (Dropout)"] and "dropout noise" in f.message
        assert ".eval()" in f.hint and "torch.no_grad()" in f.hint
    else:
        assert found and all("train_mode_modules" not in f.details for f in found)


HOOK_HIST: list = []


def test_a_statistic_appended_by_a_forward_hook_gets_its_own_expression_in_the_fix():
    """A forward hook keeps `o.abs().mean()` (an activation statistic with its graph) in a list: the fix said
    `hist.append(loss.item())` until stop 41; it is the appended expression's `.item()`."""
    torch.manual_seed(0)
    HOOK_HIST.clear()
    model = nn.Sequential(nn.Linear(30, 64), nn.ReLU(), nn.Linear(64, 2))
    handle = model[1].register_forward_hook(lambda m, i, o: HOOK_HIST.append(o.abs().mean()))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    try:
        with guard(model, opt, live=False) as g:
            for _ in range(40):
                x = torch.randn(50, 30)
                loss = F.cross_entropy(model(x), (x[:, 0] > 0).long())
                opt.zero_grad()
                loss.backward()
                opt.step()
    finally:
        handle.remove()
        HOOK_HIST.clear()
    f = [f for f in g.findings if f.kind == "loss-graph-retained"][0]
    assert f.where == "HOOK_HIST" and "`HOOK_HIST.append(o.abs().mean().item())`" in f.hint


class _Priorities:
    """A prioritized replay's priorities, written row by row."""

    def __init__(self):
        self.prio = [1.0] * 64

    def update(self, idx, td):
        for i, e in zip(idx, td.abs() + 1e-3):
            self.prio[i] = e


def test_pcgrad_gradients_written_by_hand_then_wiped_are_told_once_not_also_as_never_back_propagated():
    """PCGrad by hand: task gradients with torch.autograd.grad, projected, written to p.grad, then a zero_grad() moved
    before step(). zero-grad-before-step tells it; grads-all-zero's "no loss was back-propagated" (the gradients were
    there) contradicted it until stop 44."""
    torch.manual_seed(0)
    model = mlp()
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=1e-3)
    with guard(live=False) as g:
        for x, y in batches(8):
            out = model(x)
            la, lb = F.mse_loss(out, y), out.abs().mean()
            ga = torch.autograd.grad(la, params, retain_graph=True)
            gb = torch.autograd.grad(lb, params)
            for p, a, b in zip(params, ga, gb):
                p.grad = a + b
            opt.zero_grad()  # the bug: wipes them
            opt.step()
    assert [(f.kind, f.step) for f in g.findings] == [("zero-grad-before-step", 0)]


def test_a_list_row_written_with_a_live_tensor_gets_the_row_write_fix():
    """`self.prio[i] = e` keeps each step's graph in a prioritized replay's list: the fix said
    `self.prio.append(loss.item())` until stop 41; it is the row write's own `.item()`."""
    torch.manual_seed(0)
    q = nn.Linear(4, 1)
    opt = torch.optim.SGD(q.parameters(), lr=0.01)
    rb = _Priorities()
    x, y = torch.randn(64, 4), torch.randn(64)
    with guard(q, opt, live=False) as g:
        for _ in range(40):
            idx = torch.randint(0, 64, (8,)).tolist()
            td = y[idx] - q(x[idx]).squeeze(1)
            loss = (td ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            rb.update(idx, td)
    f = [f for f in g.findings if f.kind == "loss-graph-retained"][0]
    assert f.where == "rb.prio" and "`self.prio[i] = e.item()`" in f.hint


@pytest.mark.parametrize("case", ["snip", "teacher-saliency", "two-losses-each-step", "zeroed-first"])
def test_a_backward_before_the_loop_never_cleared_is_carried_into_the_first_update(case):
    """SNIP scores its connections with one backward() before training and never clears the gradients; the loop
    zeroes after each step, so the first update applies that backward's gradients too. Told at that backward's line.
    A saliency backward through another, frozen model before the loop, two losses back-propagated at every step, and
    a zero_grad() after the earlier backward are silent."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    teacher = nn.Sequential(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(256, 4), torch.randint(0, 2, (256,))
    with guard(live=False) as g:
        if case == "teacher-saliency":
            F.cross_entropy(teacher(x), y).backward()  # a saliency pass
        elif case != "two-losses-each-step":
            F.cross_entropy(model(x), y).backward()  # the earlier backward
            if case == "zeroed-first":
                opt.zero_grad()
        for s in range(12):
            xb, yb = x[s * 16:(s + 1) * 16], y[s * 16:(s + 1) * 16]
            out = model(xb)
            if case == "two-losses-each-step":
                F.cross_entropy(out, yb).backward(retain_graph=True)
                (0.1 * out.pow(2).mean()).backward()
            else:
                F.cross_entropy(out, yb).backward()
            opt.step()
            opt.zero_grad()
    if case != "snip":
        assert g.findings == [], g.findings
        return
    (f,) = g.findings
    assert (f.kind, f.where, f.step) == ("missing-zero-grad", "SGD", 0)
    assert f.source == line_of(test_a_backward_before_the_loop_never_cleared_is_carried_into_the_first_update,
                               "# the earlier backward")
    assert f.details["backwards_before_first_step"] == 2 and "right after that earlier backward()" in f.hint


def test_a_deep_ensembles_zero_grad_before_step_is_one_finding_for_its_members():
    """A deep ensemble stepped by one loop line, `for m, o in zip(models, opts)`, with zero_grad() moved between
    backward() and step(): one bug, told once at its lines (it was told four times under a global guard: `Adam` at
    step 0, then `Adam[0]`, `Adam[1]` and `Adam[2]` as the guard met the other members' optimizers)."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1)) for _ in range(3)]
    opts = [torch.optim.Adam(m.parameters(), lr=3e-3) for m in models]
    x = torch.rand(64, 1)
    with guard(live=False) as g:
        for _ in range(5):
            for m, o in zip(models, opts):
                loss = F.mse_loss(m(x), x ** 2)
                loss.backward()
                o.zero_grad()
                o.step()
    (f,) = g.findings
    assert (f.kind, f.step) == ("zero-grad-before-step", 0) and f.count >= 5 * 3 - 1


def test_deepdream_through_a_hooked_inner_layer_of_a_frozen_net_is_no_evaluation():
    """DeepDream: the whole frozen net is called, the loss is read from an inner layer through a forward hook, and
    the image is updated by hand (no optimizer). The layers after the hooked one build a graph no backward uses:
    told as an evaluation outside no_grad, whose fix would take the image's gradient away. A model whose every
    parameter is frozen is not trained by hand: not judged."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU()).eval().requires_grad_(False)
    acts = {}
    net[1].register_forward_hook(lambda m, i, o: acts.__setitem__("a", o))
    img = torch.randn(1, 3, 16, 16, requires_grad=True)
    with guard(live=False) as g:
        for _ in range(20):
            net(img)
            acts["a"].pow(2).mean().backward()
            with torch.no_grad():
                img += 0.01 * img.grad / (img.grad.abs().mean() + 1e-8)
            img.grad = None
    assert g.findings == [] and g.internal_errors == []


def test_an_optimised_input_cut_off_by_an_augmentation_under_no_grad_is_told_as_such():
    """Model inversion: Adam optimises an image; a jitter applied under torch.no_grad() cuts it off, so the loss
    reaches only the (not frozen) classifier's parameters. It was told as parameters left out of the optimizer, with
    "hand them to the optimizer", which would fine-tune the classifier the image is inverted against."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    x = torch.randn(1, 3, 8, 8, requires_grad=True)
    opt = torch.optim.Adam([x], lr=0.05)
    with guard(live=False) as g:
        for _ in range(3):
            with torch.no_grad():
                xj = torch.roll(x, 1, -1)  # the jitter, under no_grad
            loss = -net(xj)[0, 2]
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = next(f for f in g.findings if f.kind == "loss-disconnected")
    assert "optimises tensors that belong to no model" in f.message and "left out when" not in f.message
    assert "no torch.no_grad() around what is computed from it" in f.hint and "Hand them" not in f.hint


@pytest.mark.parametrize("solver", ["by-hand", "fresh-sgd"])
def test_cagrad_per_task_backwards_and_an_inner_solver_are_silent(solver):
    """CAGrad/MGDA under a global guard: three per-task backward()s (retain_graph) into .grad, then task weights
    solved in 20 steps, then the merged gradient written back and the model's optimizer steps. The solver is written
    by hand (its backward()s touch only its weights) or, as the MTRL code writes it, a fresh `SGD([w])` over a plain
    tensor each iteration. A global guard counted the backwards (or the solver's steps) as steps until the model's
    optimizer stepped, so the task losses' list "held graphs of 3 steps": an ERROR on healthy code, fatal in raise
    mode; and the solver's backward was blamed for the per-task gradients already in the model's parameters (a
    missing-zero-grad leak). Both silent."""
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    y1, y2 = (x[:, 0] > 0).long(), x[:, 1:2]
    trunk = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
    heads = nn.ModuleList([nn.Linear(32, 2), nn.Linear(32, 1), nn.Linear(32, 2)])
    opt = torch.optim.Adam([*trunk.parameters(), *heads.parameters()], lr=1e-3)
    sp = list(trunk.parameters())
    with guard(live=False, mode="raise") as g:
        for _ in range(6):
            idx = torch.randint(0, 256, (32,))
            h = trunk(x[idx])
            losses = [F.cross_entropy(heads[0](h), y1[idx]), F.mse_loss(heads[1](h), y2[idx]),
                      F.cross_entropy(heads[2](h), y1[idx])]
            opt.zero_grad()
            rows = []
            for t, loss in enumerate(losses):
                for p in sp:
                    p.grad = None
                loss.backward(retain_graph=t < 2)
                rows.append(torch.cat([p.grad.reshape(-1) for p in sp]))
            grads = torch.stack(rows)
            gram = grads @ grads.t()
            w = torch.zeros(3, requires_grad=True)
            w_opt = torch.optim.SGD([w], lr=1.0) if solver == "fresh-sgd" else None
            for _ in range(20):  # min-norm task weights
                if w_opt is not None:
                    w_opt.zero_grad()
                (torch.softmax(w, 0) @ gram @ torch.softmax(w, 0)).backward()
                if w_opt is not None:
                    w_opt.step()
                else:
                    with torch.no_grad():
                        w -= w.grad
                    w.grad = None
            merged, off = torch.softmax(w.detach(), 0) @ grads, 0
            for p in sp:
                p.grad = merged[off:off + p.numel()].view_as(p).clone()
                off += p.numel()
            opt.step()
    assert g.findings == [] and g.internal_errors == []


def _second_view_run(use, steps=40):
    """Each step: a labelled forward that trains, then a second forward of the same model at another line, kept in
    a variable (not detached); `use(step, out)` returns the loss term it makes, or None (not used this step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with guard(model, opt, live=False) as g:
        for step in range(steps):
            x, y, u = torch.randn(16, 8), torch.randint(3, (16,)), torch.randn(16, 8)
            loss = F.cross_entropy(model(x), y)
            out_u = model(u)
            extra = use(step, out_u)
            if extra is not None:
                loss = loss + extra
            opt.zero_grad()
            loss.backward()
            opt.step()
    return g


@pytest.mark.parametrize("case", ["warm-up", "threshold"])
def test_a_second_forward_used_only_once_a_condition_holds_is_no_evaluation(case):
    """FixMatch's strong view before any pseudo-label passes the threshold, an unsupervised term added after a
    supervised warm-up: the line's forwards are dropped for the first steps, then back-propagated. They were told as
    graphs built for nothing after 3 steps, with a no_grad fix that would switch the term off for good (stop 43)."""
    if case == "warm-up":
        use = lambda step, out: out.softmax(1).var() if step >= 20 else None  # noqa: E731
    else:
        use = lambda step, out: out.pow(2).mean() if step >= 20 and step % 4 else None  # noqa: E731
    g = _second_view_run(use)
    assert g.findings == [], g.findings


def test_a_second_forward_never_back_propagated_is_told_at_the_end_as_dropped_from_its_first_step():
    """The same line never used all run (a Pi-model's second pass `.detach()`ed into the target, written as a held
    variable): told when the run ends, as graphs dropped at once from step 0, not as a model that never trains."""
    g = _second_view_run(lambda step, out: None)
    [f] = g.findings
    assert (f.kind, f.where, f.step) == ("eval-without-no-grad", "Sequential", 0), f
    assert f.details["dropped_at_once"] and "parameters_without_gradient" not in f.details, f.details
    assert "out_u = model(u)" in open(f.source.rsplit(":", 1)[0]).read().splitlines()[int(f.source.rsplit(":", 1)[1]) - 1]


@pytest.mark.parametrize("skip", [{4, 5, 6, 15, 22, 23, 31}, set(range(4, 14))])
def test_a_first_run_of_batches_skipped_after_the_forward_waits_for_a_second_run(skip):
    """A silhouette loss defined on foreground rays only: batches without one are skipped after the forward
    (`if not fg.any(): continue`), three in a row early on, among batches that train. Told at that first run until
    stop 43, with a no_grad fix that would stop the line training; a second run among many trained batches shows
    skips. An evaluation from a training line that recurs (runs of 8 or more, or a second run) is still told."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with guard(model, opt, live=False) as g:
        for it in range(40):
            out = model(torch.randn(16, 3))
            if it in skip:
                continue
            loss = out.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    if len(skip) < 8:
        assert g.findings == [], g.findings
    else:  # ten forwards in a row that no backward uses: told
        assert [(f.kind, f.step) for f in g.findings] == [("eval-without-no-grad", 4)], g.findings


@pytest.mark.parametrize("nested", [True, False])
def test_frames_rendered_with_grad_and_kept_get_a_fix_that_detaches_what_the_line_appends(nested):
    """`videos.append(render_video())` each epoch, a helper rendering frames for monitoring without no_grad: the
    fix detached a placeholder `z` (a variable of the script's own, unrelated) until stop 43; it now detaches what
    the line appends, each tensor of a returned list."""
    model = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def render_video():
        return [model(torch.randn(32, 3)) for _ in range(2)]

    videos = []
    with guard(model, opt, live=False) as g:
        for epoch in range(4):
            for _ in range(5):
                loss = model(torch.randn(8, 3)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            videos.append(render_video() if nested else model(torch.randn(32, 3)) * 2)
    f = next(f for f in g.findings if f.kind == "loss-graph-retained")
    appended = "render_video() if nested else model(torch.randn(32, 3)) * 2"  # what the line appends, as written
    assert f.where == "videos" and "z.detach()" not in f.hint, f
    assert (f"[t.detach() for t in {appended}]" if nested else f"({appended}).detach()") in f.hint, f.hint


def test_a_left_over_gradient_that_is_exactly_zero_is_not_taken_for_a_partial_zero_grad():
    """No zero_grad() at all, in an online loop whose GRUCell starts from a zero hidden state: `weight_hh`'s first
    gradient is exactly 0 (it multiplies h = 0), so nothing was added onto it. The finding names the other five and
    does not say a zero_grad() covered part of the parameters."""
    torch.manual_seed(0)
    cell, fc = nn.GRUCell(1, 8), nn.Linear(8, 1)
    opt = torch.optim.SGD(list(cell.parameters()) + list(fc.parameters()), lr=0.01)
    stream = torch.sin(torch.arange(40.0) / 4)
    with guard(live=False) as g:
        h, pending = torch.zeros(1, 8), None
        for i in range(39):
            x = stream[i].view(1, 1)
            if pending is not None:
                (pending - x).pow(2).mean().backward()
                opt.step()
                h = h.detach()
            h = cell(x, h)
            pending = fc(h)
    (f,) = g.findings
    assert (f.kind, f.step) == ("missing-zero-grad", 1)
    assert "cell.weight_hh" not in f.details["names"] and "cleared or new" not in f.message
    assert f.hint.startswith("Call optimizer.zero_grad() once per optimizer step")


def test_the_carried_state_is_named_rather_than_a_shorter_output_that_also_holds_the_graph():
    """ES-RNN's smoothing level fed back, `pred, level = model(chunk, level)`, with backward(retain_graph=True):
    `pred` holds the same steps and has the shorter name, but the line passes `level` back in, so `level` is the
    state to detach (the fix `pred = pred.detach()` changed nothing)."""

    class Smoother(nn.Module):
        def __init__(self):
            super().__init__()
            self.alpha = nn.Parameter(torch.zeros(4, 1))
            self.fc = nn.Linear(1, 1)

        def forward(self, chunk, level):
            a, levels = torch.sigmoid(self.alpha), []
            for k in range(chunk.shape[1]):
                level = a * chunk[:, k:k + 1] + (1 - a) * level
                levels.append(level)
            levels = torch.cat(levels, 1)
            return self.fc((chunk / levels).unsqueeze(-1)).squeeze(-1) * levels, level

    torch.manual_seed(0)
    model = Smoother()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    y = 10 + torch.sin(torch.arange(400.0) / 5).repeat(4, 1)
    level = y[:, :1].clone()
    with guard(model, opt, live=False) as g:
        for i in range(0, 380, 10):
            chunk, target = y[:, i:i + 10], y[:, i + 1:i + 11]
            pred, level = model(chunk, level)
            loss = F.mse_loss(pred, target)
            opt.zero_grad()
            loss.backward(retain_graph=True)
            opt.step()
    (f,) = g.findings
    assert (f.kind, f.where, f.step) == ("loss-graph-retained", "level", 0)
    assert f.details["carried"] is True and "`level = level.detach()`" in f.hint


@pytest.mark.parametrize("flush", [False, True])
def test_a_last_partial_tbptt_window_never_back_propagated_is_told_as_such(flush):
    """An LSTMCell unrolled by hand, back-propagated every K steps: the run's last 19 steps (T - 1 = 159 = 7 * 20 + 19)
    are never back-propagated. That is told as the loop's leftover window, not as an evaluation to put under no_grad;
    flushing the remainder is clean."""
    torch.manual_seed(0)
    T, K = 160, 20

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell, self.head = nn.LSTMCell(1, 8), nn.Linear(8, 1)

        def forward(self, x, hc):
            h, c = self.cell(x, hc)
            return self.head(h).squeeze(-1), (h, c)

    net = Step()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    y = torch.sin(torch.arange(T * 1.0) / 4).repeat(4, 1)
    with guard(live=False) as g:
        h = c = torch.zeros(4, 8)
        losses = []
        for i in range(1, T):
            pred, (h, c) = net(y[:, i - 1:i], (h, c))
            losses.append(F.mse_loss(pred, y[:, i]))
            if len(losses) == K or (flush and i == T - 1):
                opt.zero_grad()
                torch.stack(losses).mean().backward()
                opt.step()
                h, c, losses = h.detach(), c.detach(), []
    if flush:
        assert g.findings == []
        return
    (f,) = g.findings
    assert (f.kind, f.where) == ("eval-without-no-grad", "Step")
    assert f.details["last_window"] is True and f.message.startswith("the run ended with")
    assert "last partial window" in f.message and "i == T - 1" in f.hint and "model.eval()" not in f.hint


def test_a_loss_built_from_a_forward_mode_tangent_is_no_evaluation_outside_no_grad():
    """A PINN's derivative by forward-mode AD (dual numbers): the loss is built from the output's tangent, whose
    backward reaches the weights, while the primal output's own graph goes unused. That is no evaluation to put
    under no_grad (which would leave the tangent without a graph)."""
    import torch.autograd.forward_ad as fwAD

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with guard(model, opt, live=False) as g:
        for _ in range(12):
            x = torch.rand(32, 2)
            with fwAD.dual_level():
                _, du = fwAD.unpack_dual(model(fwAD.make_dual(x, torch.ones_like(x))))
            loss = (du - 1).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert model[0].weight.grad.abs().sum() > 0  # trained through the tangent
    assert g.findings == []


@pytest.mark.parametrize("second", ["lbfgs", "adam"])
def test_an_lbfgs_refinement_in_eval_mode_is_no_forgotten_train_call(second):
    """A PINN trained with dropout under Adam, then put in eval mode on purpose for an L-BFGS refinement (its closure,
    evaluated again and again by the line search, must be deterministic): silent. The same eval() followed by more
    Adam steps is the forgotten model.train() and is still told."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Dropout(0.05), nn.Linear(16, 1))
    x = torch.linspace(0, 1, 64).unsqueeze(1)

    def loss_fn():
        return (model(x) - torch.sin(3 * x)).pow(2).mean()

    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    with guard(model, adam, live=False) as g:
        for _ in range(20):
            adam.zero_grad()
            loss_fn().backward()
            adam.step()
        model.eval()
        if second == "lbfgs":
            lbfgs = torch.optim.LBFGS(model.parameters(), max_iter=5, line_search_fn="strong_wolfe")

            def closure():
                lbfgs.zero_grad()
                loss = loss_fn()
                loss.backward()
                return loss

            for _ in range(3):
                lbfgs.step(closure)
        else:
            for _ in range(5):
                adam.zero_grad()
                loss_fn().backward()
                adam.step()
    kinds = [f.kind for f in g.findings]
    assert kinds == ([] if second == "lbfgs" else ["train-in-eval-mode"])


@pytest.mark.parametrize("kept", ["tensor", "item"])
def test_losses_kept_inside_an_optimizer_closure_are_found_under_a_global_guard(kept):
    """`opt.step(closure)` with `hist.append(loss)` inside the closure, under a global guard: the optimizer's first
    step comes before the model's first call (inside that step), so it was taken for a stand-in over plain tensors
    and the leak was never told. `loss.item()` is clean."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    hist = []

    def closure():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        hist.append(loss if kept == "tensor" else loss.item())
        return loss

    with guard(live=False) as g:
        for _ in range(20):
            opt.step(closure)
    if kept == "item":
        assert g.findings == []
        return
    (f,) = g.findings
    assert (f.kind, f.where, f.step) == ("loss-graph-retained", "hist", 0)
    assert "`hist.append(loss.item())`" in f.hint


@pytest.mark.parametrize("restored_first", [False, True])
def test_gradients_written_by_hand_after_zero_grad_are_no_wiped_backward(restored_first):
    """Reptile with an outer optimizer: the inner SGD adapts the model in place (backward, step), then
    `outer.zero_grad()` and a pseudo-gradient written by hand, `p.grad = before - after`, before `outer.step()`. The
    zero_grad() wiped nothing the step needed, whatever the pseudo-gradient's value: with the weights restored before
    the difference is taken it is exactly 0 (a bug of its own), which was told as zero_grad() between backward() and
    step(), a fix that changes nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
    outer = torch.optim.Adam(model.parameters(), lr=1e-3)
    with guard(live=False) as g:
        for _ in range(12):
            x = torch.rand(16, 1) * 4 - 2
            y = torch.sin(x + torch.rand(1))
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            inner = torch.optim.SGD(model.parameters(), lr=0.02)
            for _ in range(3):
                inner.zero_grad()
                F.mse_loss(model(x), y).backward()
                inner.step()
            after = {n: p.detach().clone() for n, p in model.named_parameters()}
            if restored_first:
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        p.copy_(before[n])
            outer.zero_grad()
            for n, p in model.named_parameters():
                p.grad = before[n] - (p.detach() if restored_first else after[n])
            if not restored_first:
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        p.copy_(before[n])
            outer.step()
    assert not [f for f in g.findings if f.kind == "zero-grad-before-step"]


def test_nan_gradients_written_by_hand_with_no_backward_point_at_that_arithmetic():
    """DP-SGD by hand: per-sample gradients from torch.func (vmap(grad)) "clipped" as g / ||g||, written into .grad;
    a padding row's gradient is exactly 0, so 0/0 is NaN. No backward() ran: the hint is about the hand-written
    arithmetic, not "NaN made by the backward"."""
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    x = torch.randn(64, 6)
    y = x @ torch.randn(6, 1)
    x[::16], y[::16] = 0.0, 0.0  # padding rows: all-zero per-sample gradients (no bias)
    model = nn.Sequential(nn.Linear(6, 8, bias=False), nn.ReLU(), nn.Linear(8, 1, bias=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def loss_of(p, xi, yi):
        return F.mse_loss(functional_call(model, p, (xi[None],)), yi[None])

    per_sample = vmap(grad(loss_of), in_dims=(None, 0, 0))
    with guard(live=False) as g:
        for step in range(2):
            idx = torch.arange(step * 32, step * 32 + 32)
            gs = per_sample({n: p.detach() for n, p in model.named_parameters()}, x[idx], y[idx])
            norm = torch.cat([t.flatten(1) for t in gs.values()], 1).norm(dim=1)
            opt.zero_grad()
            for n, p in model.named_parameters():
                p.grad = (gs[n] * (1.0 / norm).view(-1, *[1] * (gs[n].dim() - 1))).sum(0) / 32
            opt.step()
    (f,) = [f for f in g.findings if f.kind == "nonfinite-grad"]
    assert f.step == 0 and f.hint.startswith("No backward() ran at this step")
    assert "0/0" in f.hint and "NaN made by the backward" not in f.hint


def test_a_list_of_fast_weight_dicts_is_named_as_the_list_with_a_dict_detach_fix():
    """MAML keeping each task's adapted fast weights, `adapted.append(p)` with `p` a dict of tensors that carry the
    inner loop's graph: named `adapted` (not one entry, `adapted[0]['0.bias']`), with a fix that detaches each value
    of the dict rather than a template for a tensor."""
    from torch.func import functional_call

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 8), nn.ReLU(), nn.Linear(8, 1))
    meta_opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    adapted = []
    with guard(model, meta_opt, live=False) as g:
        for _ in range(12):
            x = torch.rand(20, 1) * 4 - 2
            y = torch.sin(x + torch.rand(1))
            p = dict(model.named_parameters())
            grads = torch.autograd.grad(F.mse_loss(functional_call(model, p, (x[:10],)), y[:10]), p.values(),
                                        create_graph=True)
            p = {n: w - 0.01 * gi for (n, w), gi in zip(p.items(), grads)}
            adapted.append(p)
            loss = F.mse_loss(functional_call(model, p, (x[10:],)), y[10:])
            meta_opt.zero_grad()
            loss.backward()
            meta_opt.step()
    (f,) = g.findings
    assert (f.kind, f.where, f.step) == ("loss-graph-retained", "adapted", 0)
    assert "`adapted.append({k: v.detach() for k, v in p.items()})`" in f.hint and "also held by" not in f.message


@pytest.mark.parametrize("zeroed", [True, False])
def test_a_model_updated_by_hand_then_another_trained_is_judged_by_its_own_backwards(zeroed):
    """A logistic regression updated by hand (`a.zero_grad()` before each backward: correct) leaves its last
    gradients in place; a second model then trained with SGD runs backwards that never reach them. Nothing adds onto
    them: silent (a false alarm at the second model's backward until stop 47). Without the zero_grad(), the hand loop
    itself sums every gradient so far, told at its second backward."""
    torch.manual_seed(0)
    X, y = torch.randn(200, 5), torch.randn(200)
    a = nn.Linear(5, 1)
    with guard(live=False) as g:
        for _ in range(20):
            if zeroed:
                a.zero_grad()
            F.mse_loss(a(X).squeeze(1), y).backward()
            with torch.no_grad():
                for p in a.parameters():
                    p -= 0.1 * p.grad
        b = nn.Linear(5, 1)
        opt = torch.optim.SGD(b.parameters(), lr=0.1)
        for _ in range(5):
            opt.zero_grad(); F.mse_loss(b(X).squeeze(1), y).backward(); opt.step()
    found = [f for f in g.findings if f.kind == "missing-zero-grad"]
    if zeroed:
        assert found == []
    else:
        (f,) = found
        assert f.step == 0 and "updated by hand" in f.message


def test_data_free_distillation_samples_a_new_generator_under_no_grad_after_a_teacher_was_trained():
    """A teacher with BatchNorm trained first (its own optimizer), then a generator built: its samples for each of 5
    student steps come from `G(z)` under no_grad in train mode, and G trains at every 6th step. The passes recur at
    the student's steps (counted by the student's optimizer only after it takes the count over), and G's BatchNorm
    was reset only by being built: silent. Told until stop 47 as statistics reset and re-estimated over 1 batch, then
    as an evaluation in train mode."""
    torch.manual_seed(0)
    T = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    with guard(live=False) as g:
        oT = torch.optim.Adam(T.parameters(), 1e-3)
        for _ in range(20):
            loss = F.cross_entropy(T(torch.randn(32, 4)), torch.randint(0, 3, (32,)))
            oT.zero_grad(); loss.backward(); oT.step()
        T.eval().requires_grad_(False)
        G = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
        S = nn.Linear(4, 3)
        oS, oG = torch.optim.SGD(S.parameters(), lr=0.1), torch.optim.Adam(G.parameters(), 1e-3)
        for _ in range(30):
            for _ in range(5):
                with torch.no_grad():
                    fake = G(torch.randn(32, 8))
                loss = F.l1_loss(S(fake), T(fake)); oS.zero_grad(); loss.backward(); oS.step()
            fake = G(torch.randn(32, 8))
            lg = -F.l1_loss(S(fake), T(fake)); oG.zero_grad(); lg.backward(); oG.step()
    assert [f for f in g.findings if f.kind == "eval-in-train-mode"] == []


class _Coupling(nn.Module):
    def __init__(self, flip):
        super().__init__()
        self.flip = flip
        self.net = nn.Sequential(nn.Linear(1, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2))

    def forward(self, x, reverse=False):
        a, b = (x[:, 1:], x[:, :1]) if self.flip else (x[:, :1], x[:, 1:])
        s, t = self.net(a).chunk(2, 1)
        s = torch.tanh(s)
        b = (b - t) * torch.exp(-s) if reverse else b * s.exp() + t
        return (torch.cat([b, a], 1) if self.flip else torch.cat([a, b], 1)), s.squeeze(1)


class _Flow(nn.Module):
    """A RealNVP-style flow whose `sample()` runs its couplings in reverse (the model's own method)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Coupling(i % 2 == 1) for i in range(4))

    def forward(self, x):
        ld = 0
        for layer in self.layers:
            x, d = layer(x)
            ld = ld + d
        return (-0.5 * x ** 2).sum(1) + ld

    def sample(self, n):
        z = torch.randn(n, 2)
        for layer in reversed(self.layers):
            z, _ = layer(z, reverse=True)
        return z


def test_a_flow_sampled_in_train_mode_twice_is_one_finding_at_the_model():
    """`flow.sample()` under no_grad with the flow left in train mode, every 20 steps: one finding at the flow, at the
    user's line; the later samplings add no finding per coupling at a line inside `sample()` (six more until stop 47)."""
    torch.manual_seed(0)
    flow = _Flow()
    opt = torch.optim.Adam(flow.parameters(), lr=1e-3)
    data = torch.randn(512, 2)
    with guard(live=False) as g:  # (a global guard sees the couplings' calls from `sample()`)
        for step in range(60):
            loss = -flow(data[torch.randint(0, 512, (64,))]).mean()
            opt.zero_grad(); loss.backward(); opt.step()
            if step % 20 == 19:
                with torch.no_grad():
                    flow.sample(128)
    (f,) = [f for f in g.findings if f.kind == "eval-in-train-mode"]
    assert f.where == "_Flow" and f.step == 20 and "test_loop_checks.py" in f.source


def test_a_flow_sampled_outside_no_grad_is_told_at_the_model():
    """`flow.sample(n)` with grad on (its couplings run in reverse outside the flow's forward): one finding at the
    flow, naming the coupling as its part and the no_grad fix for the call (told at the coupling until stop 47)."""
    torch.manual_seed(0)
    flow = _Flow()
    opt = torch.optim.Adam(flow.parameters(), lr=1e-3)
    data = torch.randn(512, 2)
    kept = []
    with guard(live=False) as g:
        for step in range(30):
            loss = -flow(data[torch.randint(0, 512, (64,))]).mean()
            opt.zero_grad(); loss.backward(); opt.step()
            if step % 10 == 0:
                kept.append(flow.sample(64).std())
    (f,) = [f for f in g.findings if f.kind == "eval-without-no-grad"]
    assert f.where == "_Flow" and f.details["part_of"] == "_Flow" and "a part of _Flow" in f.message
    assert "torch.no_grad()" in f.hint


@pytest.mark.parametrize("momentum", [0.0, 0.1])
def test_a_no_grad_pass_with_batchnorm_momentum_set_to_zero_keeps_its_statistics_on_purpose(momentum):
    """TRADES' natural pass in train mode with `bn.momentum = 0` around it: the running statistics are left as
    training made them, on purpose, so it is no evaluation in train mode (told until stop 47 as overwriting them).
    Left at 0.1, the same pass is told."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    bn = model[1]
    with guard(model, opt, live=False) as g:
        for step in range(12):
            x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
            if step == 5:
                bn.momentum = momentum
                with torch.no_grad():
                    model(x)
                bn.momentum = 0.1
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
    kinds = [f.kind for f in g.findings]
    assert kinds == ([] if momentum == 0.0 else ["eval-in-train-mode"])
