"""`guard.tensors.screenable` on one tensor (asked for every tensor the NaN check screens)."""
import torch

from guard.tensors import screenable


def setup():
    x = torch.randn(32, 8)

    def f():
        screenable(x)
    return f
