"""The NaN check's handler for a root model call (the tiny MLP's input and output screened), with the
screening window reset after each call as the step's resolution does."""
import torch

import overhead
import sweep  # noqa: F401  (registers the tiny MLP)
from guard import guard


def setup():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, batch = overhead.MODELS["tiny-mlp"]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = overhead.step_fn(model, opt, batch)
    g = guard(model, opt, live=False, mode="record").start()
    for _ in range(20):
        step()
    nf = next(c for c in g.checks if c.name == "nonfinite")
    x = batch()[0]
    out = model(x)
    collectors = g.staging._collectors

    def f():
        nf.on_forward(model, "Sequential", (x,), {}, out, True)
        nf._new_window()
        collectors.clear()
    f.guard = g  # kept alive with the call
    return f
