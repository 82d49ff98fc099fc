"""A compiled optimizer step (inductor, the compiled-optimizer recipe): unguarded vs guard default, in one
process, interleaved, medians of 15 repetitions of 20 steps.

    python benchmarks/compiled_step.py
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from guard import guard  # noqa: E402



def make():
    """A fresh MLP, Adam with a tensor learning rate (no recompile as it changes) and its step, `opt.step` compiled."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                            torch.nn.Linear(256, 1))
    o = torch.optim.Adam(m.parameters(), lr=torch.tensor(1e-3))

    @torch.compile
    def step_fn():
        o.step()

    x, y = torch.randn(64, 64), torch.randn(64, 1)

    def step():
        loss = torch.nn.functional.mse_loss(m(x), y)
        o.zero_grad()
        loss.backward()
        step_fn()

    return m, o, step


def main():
    torch.set_num_threads(1)
    plain, guarded = make(), make()
    g = guard(guarded[0], guarded[1], live=False).start()
    for _ in range(20):  # compile both
        plain[2]()
        guarded[2]()
    times = ([], [])
    for _ in range(15):
        for (_, _, step), out in zip((plain, guarded), times):
            t0 = time.perf_counter()
            for _ in range(20):
                step()
            out.append((time.perf_counter() - t0) / 20 * 1e3)
    g.close()
    a, b = statistics.median(times[0]), statistics.median(times[1])
    print(f"compiled opt.step (inductor), MLP 64-256-256-1, batch 64: unguarded {a:.3f} ms/step, guard default "
          f"{b:.3f} ms/step, {b / a:.3f}x; findings: {len(g.findings)}")


if __name__ == "__main__":
    main()
