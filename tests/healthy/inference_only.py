"""Inference only: a pretrained-style model in eval mode under inference_mode, batched predictions, no optimizer."""
import torch
from torch import nn

from ._common import maybe_guard


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.3),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5)).eval()
    mean, std = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1), torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    preds = []
    with maybe_guard(use_guard, model, **guard_options) as g:
        with torch.inference_mode():
            for _ in range(4):
                images = (torch.rand(2, 3, 8, 8) - mean) / std
                preds.append(model(images).softmax(-1).argmax(-1))
        with torch.no_grad():
            model(torch.randn(1, 3, 8, 8))  # a single sample is fine in eval mode
    return g, model
