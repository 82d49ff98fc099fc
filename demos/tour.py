"""A tour of guard: runs every demo's buggy training with the live report on.

    python demos/tour.py            # all demos
    python demos/tour.py nan_loss   # some of them
"""
import importlib
import os
import pkgutil
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def demo_names():
    """Modules under demos/ that define ``train(fixed=False, **guard_options)``."""
    names = []
    for info in sorted(pkgutil.iter_modules([HERE]), key=lambda i: i.name):
        if info.name in ("tour", "__init__") or info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"demos.{info.name}")
        if callable(getattr(mod, "train", None)):
            names.append(info.name)
    return names


def main(argv):
    import torch

    torch.set_num_threads(1)
    names = argv or demo_names()
    for name in names:
        mod = importlib.import_module(f"demos.{name}")
        doc = (mod.__doc__ or "").strip().splitlines()[0] if mod.__doc__ else ""
        print(f"\n=== {name}: {doc}", file=sys.stderr, flush=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                mod.train(live=True)
            except Exception as exc:  # a demo that crashes shows its explained error and the tour goes on
                print(f"{name} raised {type(exc).__name__}: {exc}", file=sys.stderr)
                for note in getattr(exc, "__notes__", []):
                    print(note, file=sys.stderr)
    print(f"\n{len(names)} demos shown.", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
