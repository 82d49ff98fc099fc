"""Unnormalized image inputs: raw 0-255 pixels, or [0, 1] images far from zero mean into a conv net.

Looks only at the guarded model's (root) inputs during the first `STEPS`
steps, and reports at most once. Per looked-at call: a handful of reductions
on the input's device, staged as one flag (no sync); the per-channel numbers
are read only when the flag fired.
"""
from __future__ import annotations

import re
import weakref
from typing import Any, Optional

import torch
from torch import nn
from torch.nn.modules.conv import _ConvNd

from .base import Check
from .._frames import source_text

STEPS = 3
CHANNELS = (1, 3)
RAW_MAX = 20.0  # normalized images stay within a few std of 0; 0-255 pixels do not
PIXELS_MIN = 100.0  # a batch of 8-bit images reaches at least this; above RAW_MAX but below it: not pixels
MEAN_01 = 0.2  # [0, 1] images with a mean above this are far from centred (MNIST's 0.13 is not flagged)
IMAGENET = "Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))"


def _image(x: Any) -> bool:
    return (type(x) in (torch.Tensor, nn.Parameter) and x.dim() == 4 and x.is_floating_point()
            and x.shape[1] in CHANNELS and x.shape[2] >= 8 and x.shape[3] >= 8 and x.device.type != "meta"
            and x.layout is torch.strided)


_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm)


def _per_channel(name: str, t: Any) -> bool:
    """A per-channel constant for images: named mean/std, or shaped ``[C, 1, 1]`` / ``[1, C, 1, 1]``."""
    if not isinstance(t, torch.Tensor) or t.numel() not in CHANNELS:
        return False
    low = name.rsplit(".", 1)[-1].lower()
    if low.startswith("running_"):
        return False
    return "mean" in low or "std" in low or (t.dim() >= 3 and tuple(t.shape[-2:]) == (1, 1))


# `x / 255`, `(x - 0.45) / 0.225`, `2 * (x / 255.0) - 1.0`, `x = x - 0.5` (centred, as robustness code keeps its
# attacks on [0, 1] pixels): a forward that scales its own input with literals
_SCALES_ITSELF = re.compile(r"/\s*255\b|-\s*0?\.\d+\s*\)\s*/\s*0?\.\d+|\*\s*2(?:\.0*)?\s*-\s*1\b"
                            r"|=\s*[A-Za-z_]\w*\s*-\s*0?\.5\b(?!\d)")


def _scales_itself(model: nn.Module) -> bool:
    """Whether the model's own forward scales its input with numbers written in it (RAFT's `2 * (image1 / 255.0) -
    1.0`, monodepth2's `(x - 0.45) / 0.225`): read once per model."""
    src = source_text(type(model).forward)
    return src is not None and bool(_SCALES_ITSELF.search(src))


def _first_layer(model: nn.Module) -> str:
    """``"conv"``, ``"norm"`` (the model normalizes its own input) or ``"other"``."""
    if _scales_itself(model):
        return "norm"
    for name, b in model.named_buffers():
        if _per_channel(name, b):
            return "norm"  # e.g. register_buffer("mean", ...) and (x - mean) / std inside forward
    for m in model.modules():
        low = type(m).__name__.lower()
        if isinstance(m, _NORMS) or "normaliz" in low or (
                m is not model and "norm" in low and not any(True for _ in m.parameters())):
            # (a parameter-free `Norm()`/`InputNorm()` before the first conv: `(x - mean) / std` in its forward)
            return "norm"
        # plain tensor attributes (the PyTorch style-transfer tutorial's Normalization keeps mean and std so)
        if any(_per_channel(k, v) for k, v in vars(m).items()):
            return "norm"
        if m._parameters and any(p is not None for p in m._parameters.values()):
            return "conv" if isinstance(m, _ConvNd) else "other"
    return "other"


def _same_image(t: Any, x: torch.Tensor) -> bool:
    """Whether `t` is an image batch of `x`'s channels, at its size or larger."""
    return (isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[1] == x.shape[1]
            and t.shape[2] >= x.shape[2] and t.shape[3] >= x.shape[3])


class InputStats(Check):
    name = "input-stats"
    costly = True  # sampled under a budget
    kinds = {
        "input-not-normalized": ("info", "image-like input far from normalized"),
    }
    description = "image-like model inputs far from normalized (0-255 pixels, or [0, 1] into a conv net)"

    def watches(self, module) -> bool:
        return False  # model inputs only: root calls

    def __init__(self, guard):
        super().__init__(guard)
        self._off = False
        self._first: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()

    # After the call, not before it: a global guard's pre-hooks (torch's module-wide ones) get no keyword
    # arguments, and HF models take their images as `pixel_values=`.
    def on_forward(self, module, path, args, kwargs, output, is_root):
        if not is_root or self._off:
            return
        if self.g.step >= STEPS:
            self._off = True
            return
        if not self.sampling:
            return
        x = args[0] if args else next(iter(kwargs.values()), None) if kwargs else None
        if not _image(x):
            return
        if any(_same_image(t, x) for t in ([output] if isinstance(output, torch.Tensor) else
                                            output if isinstance(output, (tuple, list)) else ())):
            # image to image (super-resolution, denoising): its output lives in the input's range; one of several
            # outputs too (LapSRN's x2 and x4 levels, CBDNet's noise map and image)
            return
        first = self._first.get(module)
        if first is None:
            first = self._first[module] = _first_layer(module)
        if first == "norm":
            return
        conv = first == "conv"
        d = x.detach()
        if d.dtype in (torch.float16, torch.bfloat16):
            d = d.float()
        mn, mx, mean = d.amin(), d.amax(), d.mean()
        # (an inf in the input, a range sensor's "no return" the model masks itself, says nothing of its scale)
        raw = (mn >= 0) & (mx > RAW_MAX) & torch.isfinite(mx)
        if conv:  # (a binary mask, a silhouette's 0s and 1s, is no photo to normalize)
            binary = (d - d * d).amax() <= 0  # (within [0, 1], d - d^2 is 0 at 0 and 1 only)
            bad = raw | ((mn >= 0) & (mx <= 1) & (mean > MEAN_01) & ~binary)
        else:
            bad = raw
        # per-channel numbers for the report, kept tiny on the device; read only if the flag fires
        stats = torch.stack([d.mean(dim=(0, 2, 3)), d.std(dim=(0, 2, 3)), d.amin(dim=(0, 2, 3)),
                             d.amax(dim=(0, 2, 3))])
        info = (path, type(module).__name__, list(x.shape), str(x.dtype), conv, stats, self.g.step, self.g.root_source)
        self.g.stage_flag(~bad, lambda info=info: self._report(*info))

    def _report(self, path: str, mtype: str, shape: list, dtype: str, conv: bool, stats: torch.Tensor,
                step: int, source: Optional[str]) -> None:
        if self._off:
            return
        self._off = True
        mean, std, lo, hi = (list(map(float, r)) for r in stats.float().cpu().tolist())
        fmt = lambda v: "(" + ", ".join(f"{a:.3g}" for a in v) + ")"  # noqa: E731
        rng = f"[{min(lo):.3g}, {max(hi):.3g}]"
        # ImageNet's statistics fit RGB images only; other channel counts get their own dataset's.
        example = (f"e.g. torchvision.transforms.{IMAGENET} for ImageNet-style models, or your dataset's own mean/std"
                   if len(mean) == 3 else
                   f"with your dataset's own per-channel mean/std (Normalize(mean={fmt(mean)}, std={fmt(std)}) from "
                   f"this batch)")
        if RAW_MAX < max(hi) <= PIXELS_MIN:
            # too large for normalized data, too small for 8-bit pixels: a spectrogram's magnitudes, raw measurements
            why = f"values span {rng}, far beyond the few units of a normalized input"
            fix = ("Standardize per channel with your data's own mean and std (for spectrograms or other non-pixel "
                   "data, often after a log scale: torch.log1p(x)), so inputs are centred near 0 with unit spread.")
        elif max(hi) > RAW_MAX:
            why = f"values span {rng}: raw 0-255 pixels"
            fix = (f"Scale to [0, 1] (divide by 255, or torchvision's ToTensor()) and then normalize per channel, "
                   f"{example}.")
        else:
            why = f"values lie in {rng} with mean {fmt(mean)}, far from 0, and the model starts with a convolution"
            fix = (f"Normalize per channel after ToTensor(), {example}, so inputs are centred near 0 with unit "
                   f"spread.")
        self.emit("input-not-normalized", "input",
                  f"the input to {path if path == mtype else f'{path} ({mtype})'} looks unnormalized: {shape} {dtype} images whose {why}; "
                  f"per-channel mean {fmt(mean)}, std {fmt(std)}",
                  fix, step=step, source=source,
                  details={"shape": shape, "dtype": dtype, "mean": mean, "std": std, "min": lo, "max": hi,
                           "starts_with_conv": conv,
                           "example": {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}})
