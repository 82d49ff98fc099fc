"""Overhead of guard per training step, side by side with an unguarded run and detect_anomaly.

All configurations run in one process, interleaved step by step (A B C A B C ...), each on its own
copy of the model under a guard kept for the whole run, so that machine noise hits them alike; each
cell is the median (and min-max) of per-repetition medians.

    python benchmarks/overhead.py                 # full run, writes benchmarks/results.md and .json
    python benchmarks/overhead.py --quick         # fewer steps, for a smoke test
    python benchmarks/overhead.py --models cnn    # a subset
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from guard import guard  # noqa: E402


# ------------------------------------------------------------------ models

def cnn():
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    return model, lambda: (torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,)))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1000, 128)
        layer = nn.TransformerEncoderLayer(128, 4, 256, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = nn.Linear(128, 1000)

    def forward(self, tokens):
        return self.head(self.encoder(self.emb(tokens)))


def transformer():
    return Transformer(), lambda: (torch.randint(0, 1000, (16, 64)), torch.randint(0, 1000, (16, 64)))


class LSTMLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1000, 64)
        self.lstm = nn.LSTM(64, 128, num_layers=2, batch_first=True)
        self.head = nn.Linear(128, 1000)

    def forward(self, tokens):
        out, _ = self.lstm(self.emb(tokens))
        return self.head(out)


def lstm():
    return LSTMLM(), lambda: (torch.randint(0, 1000, (16, 32)), torch.randint(0, 1000, (16, 32)))


def deep_mlp(depth: int = 120):
    layers = [nn.Linear(32, 32)]
    for _ in range(depth - 1):
        layers += [nn.ReLU(), nn.Linear(32, 32)]
    return nn.Sequential(*layers), lambda: (torch.randn(16, 32), torch.randint(0, 32, (16,)))


# Loops with many tiny steps (issue 19): pytorch/examples' reinforce and actor_critic (one forward per
# environment step, one update per episode, the loss summed over the episode) and the tutorials'
# dynamic_net (control flow: the model's graph changes on every forward). A model factory may return a
# third element: a step factory ``make(model, opt, batch) -> step`` used instead of `step_fn`.

EPISODE = 20  # environment steps per episode (fixed, so every configuration does the same work)


class _Policy(nn.Module):
    def __init__(self, critic: bool):
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.dropout = nn.Dropout(0.6) if not critic else nn.Identity()
        self.action_head = nn.Linear(128, 2)
        self.value_head = nn.Linear(128, 1) if critic else None

    def forward(self, x):
        x = torch.relu(self.dropout(self.affine1(x)))
        probs = torch.softmax(self.action_head(x), dim=-1)
        return probs if self.value_head is None else (probs, self.value_head(x))


def _episode_step(critic: bool):
    def make(model, opt, batch):
        def step():
            state = torch.randn(1, 4)
            log_probs, values = [], []
            for _ in range(EPISODE):  # one tiny forward per environment step
                out = model(state)
                probs, value = out if critic else (out, None)
                action = torch.multinomial(probs, 1)
                log_probs.append(torch.log(probs.gather(1, action)).reshape(()))
                if critic:
                    values.append(value.reshape(()))
                state = 0.9 * state + 0.3 * torch.randn(1, 4)
            returns, r = [], 0.0
            for _ in range(EPISODE):
                r = 1.0 + 0.99 * r
                returns.insert(0, r)
            returns = torch.tensor(returns)
            returns = (returns - returns.mean()) / (returns.std() + 1e-6)
            if critic:
                v = torch.stack(values)
                loss = (-torch.stack(log_probs) * (returns - v.detach())).sum() \
                    + nn.functional.smooth_l1_loss(v, returns, reduction="sum")
            else:
                loss = (-torch.stack(log_probs) * returns).sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss
        return step
    return make


def reinforce():
    return _Policy(critic=False), lambda: (torch.randn(1, 4), None), _episode_step(False)


def actor_critic():
    return _Policy(critic=True), lambda: (torch.randn(1, 4), None), _episode_step(True)


class _DynamicNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d, self.e = (nn.Parameter(torch.randn(())) for _ in range(5))

    def forward(self, x):
        import random

        y = self.a + self.b * x + self.c * x ** 2 + self.d * x ** 3
        for exp in range(4, random.randint(4, 6)):  # 0, 1 or 2 extra terms: the graph changes per forward
            y = y + self.e * x ** exp
        return y


def dynamic_net():
    x = torch.linspace(-3.14159, 3.14159, 2000)

    def make(model, opt, batch):
        y = torch.sin(x)

        def step():
            loss = (model(x) - y).pow(2).sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss
        return step
    return _DynamicNet(), lambda: (x, None), make


MODELS = {"cnn": cnn, "transformer": transformer, "lstm": lstm, "deep-mlp": deep_mlp,
          "reinforce": reinforce, "actor-critic": actor_critic, "dynamic-net": dynamic_net}


# ------------------------------------------------------------------ configurations

def _guarded(**opts):
    def ctx(model, opt):
        return guard(model, opt, live=False, mode="record", **opts)
    return ctx


def _anomaly(model, opt):
    return torch.autograd.detect_anomaly(check_nan=True)


def _snooper_available():
    try:
        import torchsnooper  # noqa: F401
        return True
    except Exception:
        return False


CONFIGS = {
    "unguarded": lambda model, opt: contextlib.nullcontext(),
    "guard default": _guarded(),
    "guard all": _guarded(checks="all"),
    "guard every=10": _guarded(every=10),
    "detect_anomaly": _anomaly,
}


def step_fn(model, opt, batch):
    def step():
        x, y = batch()
        out = model(x)
        loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss
    return step


def count_module_calls(model, batch):
    calls = [0]

    def hook(m, a):
        calls[0] += 1
    handles = [m.register_forward_pre_hook(hook) for m in model.modules()]
    with torch.no_grad():
        model(batch()[0])
    for h in handles:
        h.remove()
    return calls[0]


def _make(name):
    """(model, batch, step factory) of a benchmark model."""
    made = MODELS[name]()
    return made[0], made[1], made[2] if len(made) > 2 else step_fn


def bench_model(name, reps, steps, warmup, configs, settle=3):
    """Median step time per configuration, interleaved step by step.

    Each configuration trains its own copy of the same model (same weights) under its own guard.
    Steps alternate A B C A B C ... with the order rotated every round, so that this shared machine's
    slow drifts hit every configuration alike. Identical copies differ by a few percent among
    themselves (where their memory landed), so every repetition hands the configurations to the
    copies in a rotated way, and each configuration runs on each copy in turn. A repetition enters
    the guards, runs `settle` untimed rounds (first calls, saved-tensor tags of the first steps),
    then `steps` timed rounds. `detect_anomaly` is switched on around its own steps only. The guards
    of one repetition share torch's patched functions (backward, the loss functions, zero_grad): a
    call from another copy passes through them in a few microseconds, which adds slightly to every
    configuration's time, the unguarded one's included (ratios are, if anything, understated).
    """
    import copy

    torch.manual_seed(0)
    model0, batch, make_step = _make(name)
    copies = []
    for _ in configs:
        model = copy.deepcopy(model0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        copies.append((model, opt, make_step(model, opt, batch)))
    times = {c: [] for c in configs}
    n = len(configs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(warmup):
            for _, _, step in copies:
                step()
        for r in range(reps):
            runs = {}
            with contextlib.ExitStack() as stack:
                for i, cname in enumerate(configs):
                    model, opt, step = copies[(i + r) % n]
                    if cname == "detect_anomaly":
                        runs[cname] = (step, lambda m=model, o=opt: CONFIGS["detect_anomaly"](m, o))
                    else:
                        stack.enter_context(CONFIGS[cname](model, opt))
                        runs[cname] = (step, None)
                per = {c: [] for c in configs}
                for i in range(settle + steps):
                    k = (r * steps + i) % n
                    for cname in configs[k:] + configs[:k]:  # rotated: no configuration always runs first
                        step, ctx = runs[cname]
                        with (ctx() if ctx is not None else contextlib.nullcontext()):
                            t0 = time.perf_counter()
                            step()
                            dt = time.perf_counter() - t0
                        if i >= settle:
                            per[cname].append(dt)
            for c in configs:
                times[c].append(statistics.median(per[c]))
    return times, count_module_calls(model0, batch)


def snooper_time(name, steps=3):
    """torchsnooper on the model's forward: a few steps only (it is slow)."""
    if not _snooper_available():
        return None
    import torchsnooper

    torch.manual_seed(0)
    model, batch, make_step = _make(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    fwd = model.forward
    model.forward = torchsnooper.snoop(output=io.StringIO())(fwd)
    step = make_step(model, opt, batch)
    step()
    per = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        per.append(time.perf_counter() - t0)
    model.forward = fwd
    return statistics.median(per)


def peak_rss_kb(model_name, config, steps):
    """Peak RSS of a fresh process running `steps` steps of one configuration."""
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(HERE)!r}); sys.path.insert(0, {HERE!r});"
            f"import torch, resource; torch.set_num_threads(1); import overhead as o;"
            f"torch.manual_seed(0); m, b, mk = o._make({model_name!r}); opt = torch.optim.AdamW(m.parameters());"
            f"s = mk(m, opt, b)\n"
            f"with o.CONFIGS[{config!r}](m, opt):\n"
            f"    [s() for _ in range({steps})]\n"
            f"print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def cuda_syncs_per_step(name, steps=5):
    """Host-device synchronisations per step under the default guard (CUDA only)."""
    if not torch.cuda.is_available():
        return None
    torch.manual_seed(0)
    model, batch0, make_step = _make(name)
    if make_step is not step_fn:
        return None  # the episodic and dynamic loops build their tensors on the CPU
    model = model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def batch():
        x, y = batch0()
        return x.cuda(), y.cuda()
    step = step_fn(model, opt, batch)
    with guard(model, opt, live=False, mode="record"):
        step()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(steps):
                    step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    from_guard = [w for w in caught if "synchroniz" in str(w.message).lower()]
    return len(from_guard) / steps


def fmt_ms(xs):
    return f"{statistics.median(xs) * 1e3:.2f} ({min(xs) * 1e3:.2f}–{max(xs) * 1e3:.2f})"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="3 reps x 4 steps, no memory runs")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--per-check", action="store_true",
                    help="also time each check alone (on the models given), to say what each costs")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.steps, args.warmup, args.no_memory = 2, 4, 3, True
    torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"unknown model {unknown[0]!r}; allowed: {', '.join(MODELS)}")
    configs = list(CONFIGS)
    if args.per_check:
        from guard.checks import registry

        for cname in sorted(registry()):
            CONFIGS[f"only {cname}"] = _guarded(checks=[cname])
            configs.append(f"only {cname}")
    results = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                          f"{args.threads} torch thread(s), torch {torch.__version__}, python {platform.python_version()}",
               "reps": args.reps, "steps": args.steps, "models": {}}
    for name in names:
        times, calls = bench_model(name, args.reps, args.steps, args.warmup, configs)
        base = statistics.median(times["unguarded"])
        row = {c: {"ms": statistics.median(t) * 1e3, "min_ms": min(t) * 1e3, "max_ms": max(t) * 1e3,
                   "ratio": statistics.median(t) / base} for c, t in times.items()}
        snoop = snooper_time(name) if name != "deep-mlp" else None
        if snoop is not None:
            row["torchsnooper"] = {"ms": snoop * 1e3, "min_ms": snoop * 1e3, "max_ms": snoop * 1e3,
                                   "ratio": snoop / base}
        entry = {"configs": row, "module_calls_per_forward": calls}
        if name == "deep-mlp":
            extra = statistics.median(times["guard default"]) - base
            entry["per_module_call_us"] = extra / calls * 1e6
        if not args.no_memory and name == "cnn":
            un = peak_rss_kb(name, "unguarded", 20)
            gd = peak_rss_kb(name, "guard default", 20)
            entry["peak_rss_kb"] = {"unguarded": un, "guard default": gd, "overhead": gd / un - 1}
        syncs = cuda_syncs_per_step(name)
        if syncs is not None:
            entry["cuda_syncs_per_step"] = syncs
        results["models"][name] = entry
        print(f"{name}: " + ", ".join(f"{c} {v['ratio']:.3f}x" for c, v in row.items()), flush=True)
    md = render(results)
    print(md)
    with open(args.out + ".md", "w") as fh:
        fh.write(md)
    with open(args.out + ".json", "w") as fh:
        json.dump(results, fh, indent=2)


def render(results):
    lines = [f"Machine: {results['machine']}; {results['reps']} repetitions x {results['steps']} steps of each "
             f"configuration, interleaved step by step; cells are median ms/step (min–max of repetition medians) "
             f"and the ratio to unguarded.", ""]
    names = list(results["models"])
    configs = []
    for n in names:
        for c in results["models"][n]["configs"]:
            if c not in configs:
                configs.append(c)
    lines.append("| configuration | " + " | ".join(names) + " |")
    lines.append("|---|" + "---|" * len(names))
    for c in configs:
        cells = []
        for n in names:
            v = results["models"][n]["configs"].get(c)
            cells.append("n/a" if v is None else
                         f"{v['ms']:.2f} ms ({v['min_ms']:.2f}–{v['max_ms']:.2f}) **{v['ratio']:.3f}×**")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines.append("")
    for n in names:
        e = results["models"][n]
        if "per_module_call_us" in e:
            lines.append(f"- {n}: {e['module_calls_per_forward']} module calls per forward; default guard costs "
                         f"{e['per_module_call_us']:.1f} µs per module call (forward and backward of the step included).")
        if "peak_rss_kb" in e:
            m = e["peak_rss_kb"]
            lines.append(f"- {n}: peak RSS {m['unguarded'] / 1024:.0f} MiB unguarded, {m['guard default'] / 1024:.0f} MiB "
                         f"with the default guard ({m['overhead'] * 100:+.1f}%).")
        if "cuda_syncs_per_step" in e:
            lines.append(f"- {n}: {e['cuda_syncs_per_step']:.1f} host-device syncs per step (CUDA, default checks).")
    if not any("torchsnooper" in results["models"][n]["configs"] for n in names):
        lines.append("- torchsnooper: not importable here, not measured.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
