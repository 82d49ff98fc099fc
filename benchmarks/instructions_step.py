"""Helper of instructions.sh: set up one model and configuration, then run steps on cue.

It warms up, writes <tag>.ready, waits for <tag>.go (callgrind's instrumentation is switched on
meanwhile), runs the measured steps, writes <tag>.done and waits for <tag>.stop (the counts are
dumped meanwhile). Import, setup and shutdown are thus not counted.
"""
import contextlib
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# Steps run before the count starts (WARM=2100: the steady state, past the looks of a run's first steps and
# between two powers of two, where some looks fall; the default 4 counts a run's start, those looks included)
WARM = int(os.environ.get("WARM", "4"))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import overhead  # noqa: E402
import sweep  # noqa: E402,F401  (registers the tiny, depth and 5,000-module models)
from guard import guard  # noqa: E402


def framework(name, conf, steps, prefix):
    """A Lightning or HF Trainer fit (benchmarks/frameworks.py): the count runs from batch 10 to 10 + steps."""
    import frameworks

    batches = [0]

    def tick():  # called at every batch start, in place of the clock
        batches[0] += 1
        if batches[0] == 10:
            open(prefix + ".ready", "w").close()
            _wait(prefix + ".go")
        elif batches[0] == 10 + steps:
            open(prefix + ".done", "w").close()
            _wait(prefix + ".stop")
        return 0.0

    frameworks.CLOCK[0] = tick
    fit = frameworks.lightning_fit if name == "lightning" else frameworks.hf_fit
    fit(conf != "unguarded", steps + 20)


@contextlib.contextmanager
def _floor(model, opt):
    import floor

    installed = floor.Floor(model, opt)
    try:
        yield installed
    finally:
        installed.remove()


def _wait(path):
    while not os.path.exists(path):
        time.sleep(0.05)


def main():
    name, conf, steps, prefix = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    if name in ("lightning", "hf-trainer"):
        return framework(name, conf, steps, prefix)
    torch.manual_seed(0)
    model, batch = overhead.MODELS[name]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = overhead.step_fn(model, opt, batch)
    pin = None
    if conf.endswith("-pin16"):  # a budget whose period is pinned at 16 (the count then averages whole periods)
        conf, pin = conf[:-len("-pin16")], 16
    opts = {"unguarded": None, "default": {}, "all": {"checks": "all"}, "every10": {"every": 10}, "bare": {"checks": ["state-dict"]}, "nonfinite": {"checks": ["nonfinite"]},
            "budget": {"budget": 0.05}, "all-budget": {"checks": "all", "budget": 0.05}}.get(conf)
    if conf.startswith("checks="):  # e.g. checks=default,-eval-without-no-grad
        opts = {"checks": conf[len("checks="):].split(",")}
    elif opts is None and conf not in ("unguarded", "floor"):
        raise SystemExit(f"unknown configuration {conf!r}")
    ctx = contextlib.nullcontext() if opts is None else guard(model, opt, live=False, mode="record", **opts)
    if conf == "floor":  # the least any tool must do per step for the exact screens (benchmarks/floor.py)
        ctx = _floor(model, opt)

    def wait(suffix):
        while not os.path.exists(prefix + suffix):
            time.sleep(0.05)

    with ctx:
        if pin is not None:
            ctx.meter.pin(pin)
        for _ in range(WARM):
            step()
        open(prefix + ".ready", "w").close()
        wait(".go")
        for _ in range(steps):
            step()
        open(prefix + ".done", "w").close()
        wait(".stop")


if __name__ == "__main__":
    main()
