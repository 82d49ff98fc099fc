"""Overhead of guard's framework callbacks per training step: Lightning and the Hugging Face Trainer.

Each repetition fits the same model twice, unguarded and with the GuardCallback (default checks),
alternating the order; a step's time is measured between consecutive batch starts (framework
bookkeeping included; the thread's CPU time unless --clock wall), and each cell is the median over repetitions of the per-fit median step.

    python benchmarks/frameworks.py              # both, 5 repetitions
    python benchmarks/frameworks.py --quick      # 2 repetitions, fewer steps
    python benchmarks/frameworks.py --only hf
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

warnings.filterwarnings("ignore")
# The thread's CPU time by default: the fit runs in one thread (no DataLoader workers), and other processes
# on a shared machine do not inflate it as they do wall-clock time (--clock wall to compare).
CLOCK = [time.thread_time]


class Data(Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.GELU(), nn.Dropout(0.1),
                                  nn.Linear(256, 256), nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 10))

    def forward(self, x, labels=None):
        logits = self.body(x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def lightning_fit(guarded: bool, steps: int) -> list:
    import lightning.pytorch as L
    from guard.integrations.lightning import GuardCallback

    times = []

    class Timer(L.Callback):
        def on_train_batch_start(self, *a):
            times.append(CLOCK[0]())

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Net()

        def training_step(self, batch, idx):
            return self.net(**batch)["loss"]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    L.seed_everything(0, verbose=False)
    cbs = [Timer()] + ([GuardCallback(live=False)] if guarded else [])
    L.Trainer(max_steps=steps, callbacks=cbs, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=1,
              gradient_clip_val=1.0).fit(Lit(), DataLoader(Data(64 * (steps + 1)), batch_size=64))
    return [b - a for a, b in zip(times[5:], times[6:])]


def hf_fit(guarded: bool, steps: int) -> list:
    import transformers
    from guard.integrations.transformers import GuardCallback

    times = []

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            times.append(CLOCK[0]())

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        args = transformers.TrainingArguments(output_dir=tmp, per_device_train_batch_size=64, max_steps=steps,
                                              gradient_accumulation_steps=2, max_grad_norm=1.0, logging_steps=10,
                                              report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
        cbs = [Timer()] + ([GuardCallback(live=False)] if guarded else [])
        transformers.Trainer(model=Net(), args=args, train_dataset=Data(128 * (steps + 1)), callbacks=cbs).train()
    return [b - a for a, b in zip(times[5:], times[6:])]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=["lightning", "hf"])
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    a = ap.parse_args()
    CLOCK[0] = time.thread_time if a.clock == "cpu" else time.perf_counter
    reps, steps = (2, 30) if a.quick else (5, 80)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, {a.clock} clock, {reps} repetitions x {steps} steps; "
          f"median ms/step (ratio)")
    for name, fit in (("lightning", lightning_fit), ("hf-trainer", hf_fit)):
        if a.only and not name.startswith(a.only):
            continue
        cells = {False: [], True: []}
        for r in range(reps):
            for guarded in ((False, True) if r % 2 == 0 else (True, False)):
                cells[guarded].append(statistics.median(fit(guarded, steps)) * 1e3)
        base, g = statistics.median(cells[False]), statistics.median(cells[True])
        print(f"| {name} | unguarded {base:.2f} ms | guard default {g:.2f} ms | **{g / base:.3f}x** |")


if __name__ == "__main__":
    main()
