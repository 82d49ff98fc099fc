"""Guard's cost in instructions per training step (callgrind), for the small-model rows of issue 17.

    python benchmarks/instructions_sweep.py               # tiny MLP, depth sweep, budget; ~15 min on 2 cores
    python benchmarks/instructions_sweep.py --huge --frameworks   # also 5,000 modules, Lightning, HF Trainer
    python benchmarks/instructions_sweep.py --keep --only tiny-mlp  # rerun one model, keep the other counts
    python benchmarks/instructions_sweep.py --keep --only tiny-mlp --ablate   # + each check's marginal cost

Wall-clock time on a shared machine moves by 10-20% from run to run; the number of instructions a step
executes does not. Each (model, configuration) runs under `benchmarks/instructions.sh` (only the
measured steps are counted), two at a time. The depth sweep (MLPs of width 32, 1 to 32 layers) is
fitted as ``extra = fixed + per_call * module_calls``: guard's fixed cost per step and its cost per
module call, in instructions, and in µs at the rate this machine runs the unguarded step of the
same model (its native median step time over its instruction count). With ``--ablate`` the tiny MLP
also runs the default checks without each one in turn (``checks=default,-NAME``): what each check adds
to a step (shared work, such as the gradient norms, stays with the checks left). Writes
``benchmarks/results-instructions.md`` and ``.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

DEPTHS = (1, 4, 8, 16, 32)
TINY = ("unguarded", "default", "all", "bare", "nonfinite", "budget-pin16", "all-budget-pin16")
WITHOUT = "checks=default,-"  # an ablation configuration: the default checks without one


def default_checks():
    from guard.checks import registry

    return sorted(name for name, cls in registry().items() if cls.default)


def jobs(args):
    out = [("tiny-mlp", c, 32) for c in TINY]
    if getattr(args, "ablate", False):
        out += [("tiny-mlp", WITHOUT + name, 32) for name in default_checks()]
    out += [(f"mlp-depth-{d}", c, 16) for d in DEPTHS for c in ("unguarded", "default")]
    if args.huge:
        out += [("huge-5000", c, 3) for c in ("unguarded", "default")]
    if args.frameworks:
        out += [(f, c, 10) for f in ("lightning", "hf-trainer") for c in ("unguarded", "default")]
    return out


def count(job):
    model, conf, steps = job
    env = {**os.environ, "STEPS": str(steps)}
    out = subprocess.run(["bash", os.path.join(HERE, "instructions.sh"), model, conf], capture_output=True,
                         text=True, env=env, cwd=ROOT)
    line = [ln for ln in out.stdout.splitlines() if "instructions per step" in ln]
    if out.returncode or not line:
        raise SystemExit(f"instructions.sh {model} {conf} failed:\n{out.stdout}\n{out.stderr}")
    n = int(line[-1].split(": ")[1].split()[0])
    print(f"{model} {conf}: {n:,} instructions per step", flush=True)
    return job, n


def native_step_us(model, steps=200, reps=5):
    """Median wall time of the unguarded step, natively (for the instructions -> µs rate)."""
    import torch

    import overhead
    import sweep  # noqa: F401  (registers the sweep's models)

    torch.set_num_threads(1)
    torch.manual_seed(0)
    m, batch = overhead.MODELS[model]()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    step = overhead.step_fn(m, opt, batch)
    for _ in range(20):
        step()
    per = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        per.append((time.perf_counter() - t0) / steps * 1e6)
    return statistics.median(per)


def fit(points):
    n = len(points)
    mx = sum(c for c, _ in points) / n
    my = sum(e for _, e in points) / n
    sxx = sum((c - mx) ** 2 for c, _ in points)
    slope = sum((c - mx) * (e - my) for c, e in points) / sxx if sxx else 0.0
    return my - slope * mx, slope


def render(res):
    counts = res["counts"]
    lines = [f"Machine: {res['machine']}. Instructions per training step under callgrind "
             f"(`python benchmarks/instructions_sweep.py`); µs at this machine's native rate for the "
             f"same unguarded step.", "",
             "| model | configuration | instructions per step | ratio to unguarded |", "|---|---|---|---|"]
    for model, confs in counts.items():
        base = confs.get("unguarded")
        for conf, n in confs.items():
            if conf.startswith(WITHOUT):
                continue
            ratio = f"**{n / base:.3f}×**" if base and conf != "unguarded" else "1"
            lines.append(f"| {model} | {conf} | {n / 1e6:,.2f} M | {ratio} |")
    f = res.get("fit")
    if f:
        lines += ["", f"Depth sweep (MLP width 32, depths {', '.join(map(str, DEPTHS))}; module calls per forward = "
                      f"2 x depth): guard default costs **{f['fixed_instructions'] / 1e3:,.0f} k instructions per step** "
                      f"(≈ **{f['fixed_us']:.0f} µs** here) plus **{f['per_call_instructions'] / 1e3:,.1f} k "
                      f"instructions per module call** (≈ **{f['per_call_us']:.2f} µs**). Points: "
                      + ", ".join(f"{p['module_calls']} calls → +{p['extra'] / 1e3:,.0f} k" for p in f["points"])
                      + f". Rate: {f['instructions_per_us']:,.0f} instructions/µs (depth-8 unguarded step, native)."]
    tiny = counts.get("tiny-mlp", {})
    marginal = sorted(((tiny["default"] - n, conf[len(WITHOUT):]) for conf, n in tiny.items()
                       if conf.startswith(WITHOUT)), reverse=True) if "default" in tiny else []
    if marginal:
        lines += ["", "What each default check adds to a tiny-MLP step (the default checks with and without it; "
                      "shared work such as the gradient norms stays with the checks left; a few k either way is "
                      "the counts' run-to-run spread):", "",
                  "| check | instructions per step | share of guard's cost |", "|---|---|---|"]
        extra = tiny["default"] - tiny.get("unguarded", tiny["default"])
        for d, name in marginal:
            share = f"{max(d, 0) / extra:.0%}" if extra > 0 else "n/a"
            lines.append(f"| `{name}` | {d / 1e3:+,.1f} k | {share} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--huge", action="store_true", help="also the 5,000-module model (slow under callgrind)")
    ap.add_argument("--frameworks", action="store_true", help="also Lightning and HF Trainer fits")
    ap.add_argument("--ablate", action="store_true", help="also the tiny MLP without each default check in turn")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--keep", action="store_true", help="keep the counts of models not rerun from the last results")
    ap.add_argument("--only", default="", help="models to run, comma-separated (with --keep: update just those)")
    ap.add_argument("--out", default=os.path.join(HERE, "results-instructions"))
    args = ap.parse_args(argv)
    todo = jobs(args)
    if args.only:
        todo = [j for j in todo if j[0] in args.only.split(",")]
    with ThreadPoolExecutor(args.jobs) as pool:
        done = list(pool.map(count, todo))
    counts, kept_rate = {}, None
    if args.keep and os.path.exists(args.out + ".json"):
        with open(args.out + ".json") as fh:
            last = json.load(fh)
        counts = last["counts"]
        if not any(j[0] == "mlp-depth-8" for j in todo):  # the rate's model was not rerun: keep its rate
            kept_rate = last.get("fit", {}).get("instructions_per_us")
    for (model, conf, _), n in done:
        counts.setdefault(model, {})[conf] = n
    if not args.ablate and any(j[:2] == ("tiny-mlp", "default") for j in todo):
        # kept ablation counts come from another run of the code: against this default they would measure the
        # code's change, not the checks' cost
        tiny = counts.get("tiny-mlp", {})
        for conf in [c for c in tiny if c.startswith(WITHOUT)]:
            del tiny[conf]
    points = [(2 * d, counts[f"mlp-depth-{d}"]["default"] - counts[f"mlp-depth-{d}"]["unguarded"]) for d in DEPTHS]
    fixed, per_call = fit(points)
    rate = kept_rate or counts["mlp-depth-8"]["unguarded"] / native_step_us("mlp-depth-8")
    import torch

    res = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
                      f"Python {platform.python_version()}",
           "counts": counts,
           "fit": {"fixed_instructions": fixed, "per_call_instructions": per_call, "instructions_per_us": rate,
                   "fixed_us": fixed / rate, "per_call_us": per_call / rate,
                   "points": [{"module_calls": c, "extra": e} for c, e in points]}}
    with open(args.out + ".json", "w") as fh:
        json.dump(res, fh, indent=2)
    with open(args.out + ".md", "w") as fh:
        fh.write(render(res))
    print(render(res))


if __name__ == "__main__":
    main()
