"""Guard's cost outside the big models: tiny and deep MLPs, a 5,000-module model, compiled models, budget.

    python benchmarks/sweep.py                  # everything; writes benchmarks/results-sweep.md and .json
    python benchmarks/sweep.py --quick          # fewer repetitions, for a smoke test
    python benchmarks/sweep.py --only depth     # one part: tiny, depth, huge, compiled, budget

Every part runs its configurations in one process, interleaved step by step, each on its own copy of
the model (see `overhead.bench_model`); cells are medians of per-repetition medians.

- `depth`: MLPs of width 32 and growing depth; guard's extra time per step is fitted as
  `fixed + per_call * module_calls` (least squares), which gives the fixed cost per step and the
  cost per module call of the default checks.
- `huge`: a model of 5,000 modules (1,250 blocks of Linear, LayerNorm, ReLU, Identity).
- `compiled`: `torch.compile`d MLP, guard started after the compile, against the compiled model unguarded.
- `budget`: the tiny MLP under `checks="all"` with and without `budget=0.05`.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from torch import nn  # noqa: E402

import overhead  # noqa: E402
from instructions_sweep import fit  # noqa: E402  (the same least-squares fit of the depth sweep)


def tiny_mlp():
    """8 -> 32 -> 32 -> 1 regression-sized MLP as classifier over 2 classes, batch 32."""
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
    return model, lambda: (torch.randn(32, 8), torch.randint(0, 2, (32,)))


def mlp_of_depth(depth):
    def make():
        layers = [nn.Linear(32, 32)]
        for _ in range(depth - 1):
            layers += [nn.ReLU(), nn.Linear(32, 32)]
        for m in layers:
            if isinstance(m, nn.Linear):
                # He init: with PyTorch's default init a plain ReLU stack of 16+ layers has truly vanishing
                # gradients, and guard's report of them (once) would be timed as if it were per-step cost.
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                nn.init.zeros_(m.bias)
        return nn.Sequential(*layers), lambda: (torch.randn(32, 32), torch.randint(0, 32, (32,)))
    return make


def huge():
    blocks = []
    for _ in range(1250):
        blocks += [nn.Linear(16, 16), nn.LayerNorm(16), nn.ReLU(), nn.Identity()]
    return nn.Sequential(*blocks), lambda: (torch.randn(8, 16), torch.randint(0, 16, (8,)))


DEPTHS = (1, 4, 8, 16, 32)
SWEEP_MODELS = {"tiny-mlp": tiny_mlp, "huge-5000": huge}
for _d in DEPTHS:
    SWEEP_MODELS[f"mlp-depth-{_d}"] = mlp_of_depth(_d)
overhead.MODELS.update(SWEEP_MODELS)
overhead.CONFIGS["guard all budget=0.05"] = overhead._guarded(checks="all", budget=0.05)
overhead.CONFIGS["guard budget=0.05"] = overhead._guarded(budget=0.05)


def row(times):
    base = statistics.median(times["unguarded"])
    return {c: {"ms": statistics.median(t) * 1e3, "min_ms": min(t) * 1e3, "max_ms": max(t) * 1e3,
                "ratio": statistics.median(t) / base} for c, t in times.items()}


def part_tiny(args):
    times, _ = overhead.bench_model("tiny-mlp", args.reps, args.steps, args.warmup,
                                    ["unguarded", "guard default", "guard all", "detect_anomaly"])
    return {"tiny-mlp": {"configs": row(times)}}


def part_depth(args):
    out, pts = {}, []
    for d in DEPTHS:
        name = f"mlp-depth-{d}"
        times, calls = overhead.bench_model(name, args.reps, args.steps, args.warmup, ["unguarded", "guard default"])
        r = row(times)
        out[name] = {"configs": r, "module_calls_per_forward": calls}
        pts.append((calls, (r["guard default"]["ms"] - r["unguarded"]["ms"]) * 1e3))  # µs
    fixed, slope = fit(pts)
    out["fit"] = {"fixed_us_per_step": fixed, "us_per_module_call": slope,
                  "points": [{"module_calls": c, "extra_us": e} for c, e in pts]}
    return out


def part_huge(args):
    times, calls = overhead.bench_model("huge-5000", max(3, args.reps // 2), max(3, args.steps // 2), 3,
                                        ["unguarded", "guard default"])
    return {"huge-5000": {"configs": row(times), "module_calls_per_forward": calls}}


def part_budget(args):
    times, _ = overhead.bench_model("tiny-mlp", args.reps, args.steps, args.warmup,
                                    ["unguarded", "guard all", "guard all budget=0.05", "guard default",
                                     "guard budget=0.05"])
    return {"tiny-mlp (budget)": {"configs": row(times)}}


def part_compiled(args):
    """Compiled unguarded vs compiled guarded (guard started after the compile), interleaved."""
    import copy
    import time

    torch.manual_seed(0)
    model0, batch = mlp_of_depth(4)()
    runs = {}
    for cname in ("compiled unguarded", "compiled guard default"):
        m = copy.deepcopy(model0)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        cm = torch.compile(m, backend=args.backend)
        runs[cname] = (cm, opt, overhead.step_fn(cm, opt, batch))
    from guard import guard

    g = guard(runs["compiled guard default"][0], runs["compiled guard default"][1], live=False, mode="record")
    times = {c: [] for c in runs}
    g.start()
    try:
        for _ in range(args.warmup):
            for _, _, step in runs.values():
                step()
        names = list(runs)
        for r in range(args.reps):
            per = {c: [] for c in runs}
            for i in range(args.steps):
                order = names if (r + i) % 2 == 0 else names[::-1]
                for c in order:
                    t0 = time.perf_counter()
                    runs[c][2]()
                    per[c].append(time.perf_counter() - t0)
            for c in runs:
                times[c].append(statistics.median(per[c]))
    finally:
        g.close()
    times["unguarded"] = times.pop("compiled unguarded")
    return {f"compiled mlp-depth-4 ({args.backend})": {"configs": row(times)}}


PARTS = {"tiny": part_tiny, "depth": part_depth, "huge": part_huge, "compiled": part_compiled,
         "budget": part_budget}


def render(results):
    lines = [f"Machine: {results['machine']}; {results['reps']} repetitions x {results['steps']} steps, "
             "interleaved step by step; median ms/step and the ratio to unguarded.", "",
             "| workload | configuration | ms/step | ratio |", "|---|---|---|---|"]
    fit = None
    for name, entry in results["models"].items():
        if name == "fit":
            fit = entry
            continue
        for c, v in entry["configs"].items():
            lines.append(f"| {name} | {c} | {v['ms']:.3f} | **{v['ratio']:.3f}×** |")
    if fit:
        lines += ["", f"Depth sweep fit: guard default costs **{fit['fixed_us_per_step']:.0f} µs per step** plus "
                      f"**{fit['us_per_module_call']:.2f} µs per module call** "
                      f"(points: " + ", ".join(f"{p['module_calls']} calls → {p['extra_us']:.0f} µs"
                                               for p in fit["points"]) + ")."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(PARTS), help=f"parts, comma-separated: {', '.join(PARTS)}")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled part")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(HERE, "results-sweep"))
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.steps, args.warmup = 2, 5, 3
    torch.set_num_threads(1)
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"unknown part {bad[0]!r}; allowed: {', '.join(PARTS)}")
    results = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, 1 torch thread, torch {torch.__version__}, "
                          f"python {platform.python_version()}",
               "reps": args.reps, "steps": args.steps, "models": {}}
    for p in parts:
        results["models"].update(PARTS[p](args))
        print(render(results), flush=True)
    with open(args.out + ".md", "w") as fh:
        fh.write(render(results))
    with open(args.out + ".json", "w") as fh:
        json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
