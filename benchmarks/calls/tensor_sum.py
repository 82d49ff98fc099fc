"""One tensor operation from Python: the sum of a 32x8 batch (the NaN screen of a tiny model's input)."""
import torch


def setup():
    torch.set_num_threads(1)
    x = torch.randn(32, 8)

    def f():
        x.sum()
    return f
