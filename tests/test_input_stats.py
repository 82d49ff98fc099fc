"""input-not-normalized: raw 0-255 pixels, or [0, 1] images into a conv net; first steps only, once."""
import pytest
import os

import torch
import torch.nn.functional as F
from torch import nn

from demos import unnormalized_input
from guard import guard


def convnet(c=3):
    return nn.Sequential(nn.Conv2d(c, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 2))


def train(model, batches, **opts):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, live=False, **opts) as g:
        for x in batches:
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return g


def test_demo_raw_pixels_and_clean_twin():
    g = unnormalized_input.train(live=False)
    assert [f.kind for f in g.findings] == ["input-not-normalized"]
    f = g.findings[0]
    assert f.severity == "info" and f.where == "input" and f.step == 0 and f.count == 1
    assert "raw 0-255 pixels" in f.message and "per-channel mean (" in f.message and "std (" in f.message
    assert "0.485, 0.456, 0.406" in f.hint and "255" in f.hint
    assert len(f.details["mean"]) == 3 and max(f.details["max"]) > 200
    assert f.source.startswith(os.path.join("demos", "unnormalized_input.py") + ":")
    assert unnormalized_input.train(fixed=True, checks="all", live=False).findings == []


def test_unit_range_images_into_conv_net():
    g = train(convnet(), [torch.rand(4, 3, 16, 16) for _ in range(3)])
    assert [f.kind for f in g.findings] == ["input-not-normalized"]
    assert "starts with a convolution" in g.findings[0].message
    assert g.findings[0].count == 1  # once, not per step


def test_a_one_channel_input_is_not_told_to_use_imagenets_three_channel_statistics():
    g = train(convnet(1), [torch.rand(4, 1, 16, 16) for _ in range(3)])  # grey images in [0, 1]
    hint = g.findings[0].hint
    assert "0.485" not in hint and "ImageNet" not in hint and "your dataset's own per-channel mean/std" in hint


class _ScalesItself(nn.Module):
    """RAFT / monodepth2 style: the model takes raw images and scales them itself, with numbers in its forward."""
    def __init__(self, raw):
        super().__init__()
        self.raw, self.net = raw, convnet()

    def forward(self, x):
        if self.raw:
            x = 2 * (x / 255.0) - 1.0
        else:
            x = (x - 0.45) / 0.225
        return self.net(x)


@pytest.mark.parametrize("case", ["binary mask", "forward scales 0-255", "forward normalizes [0, 1]"])
def test_binary_masks_and_models_that_scale_their_own_input_are_not_reported(case):
    """A silhouette's 0/1 mask into a conv net is no photo to normalize; a model whose forward scales its raw input
    with literals (RAFT's `2 * (image1 / 255.0) - 1.0`, monodepth2's `(x - 0.45) / 0.225`) would be normalized
    twice by the fix (both told until stop 44)."""
    torch.manual_seed(0)
    if case == "binary mask":
        model, batches = convnet(1), [(torch.rand(4, 1, 16, 16) < 0.3).float() for _ in range(3)]
    elif case == "forward scales 0-255":
        model, batches = _ScalesItself(raw=True), [torch.rand(4, 3, 16, 16) * 255 for _ in range(3)]
    else:
        model, batches = _ScalesItself(raw=False), [torch.rand(4, 3, 16, 16) for _ in range(3)]
    assert train(model, batches).findings == []


def test_unit_range_into_mlp_and_mnist_like_are_not_reported():
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 2))
    assert train(mlp, [torch.rand(4, 3, 16, 16)], checks="all").findings == []
    sparse = (torch.rand(4, 1, 28, 28) > 0.87).float()  # MNIST-like: mean ~0.13
    assert train(convnet(1), [sparse], checks="all").findings == []


def test_only_the_first_steps_are_looked_at():
    batches = [torch.randn(4, 3, 16, 16) for _ in range(4)] + [torch.rand(4, 3, 16, 16) * 255]
    g = train(convnet(), batches)
    assert g.findings == [] and g.step == 5


def test_silenced_by_check_name():
    g = train(convnet(), [torch.rand(4, 3, 16, 16) * 255], checks=["default", "-input-stats"])
    assert g.findings == []


class Normalizing(nn.Module):
    """Normalizes inside forward with registered mean/std buffers (a common pattern)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))
        self.net = convnet()

    def forward(self, x):
        return self.net((x / 255 - self.mean) / self.std)


def test_models_that_normalize_their_own_input_are_not_reported():
    assert train(Normalizing(), [torch.rand(4, 3, 16, 16) * 255], checks="all").findings == []
    data_bn = nn.Sequential(nn.BatchNorm2d(3), convnet())
    assert train(data_bn, [torch.rand(4, 3, 16, 16) * 255], checks="all").findings == []


class _TutorialNormalization(nn.Module):
    """The PyTorch style-transfer tutorial's first module: mean and std kept as plain tensor attributes."""

    def __init__(self):
        super().__init__()
        self.mean = torch.tensor([0.485, 0.456, 0.406]).view(-1, 1, 1)
        self.std = torch.tensor([0.229, 0.224, 0.225]).view(-1, 1, 1)

    def forward(self, x):
        return (x - self.mean) / self.std


class _ShortNames(nn.Module):
    """Per-channel constants under names that say nothing, shaped [C, 1, 1] for images."""

    def __init__(self):
        super().__init__()
        self.register_buffer("m", torch.tensor([0.485, 0.456, 0.406]).view(-1, 1, 1))
        self.register_buffer("s", torch.tensor([0.229, 0.224, 0.225]).view(-1, 1, 1))

    def forward(self, x):
        return (x - self.m) / self.s


def test_a_first_module_that_normalizes_with_plain_tensors_or_short_buffer_names_is_not_reported():
    for first in (_TutorialNormalization(), _ShortNames()):
        g = train(nn.Sequential(first, *convnet()), [torch.rand(4, 3, 16, 16) for _ in range(3)])
        assert g.findings == [], (type(first).__name__, g.findings)


def test_values_too_large_for_normalized_data_but_no_pixels_are_not_called_pixels():
    """Raw spectrogram magnitudes (up to ~40): unnormalized, but dividing by 255 is the wrong fix."""
    g = train(convnet(1), [torch.rand(4, 1, 16, 16) * 40 for _ in range(3)])
    f = [f for f in g.findings if f.kind == "input-not-normalized"]
    assert len(f) == 1
    assert "0-255" not in f[0].message and "far beyond" in f[0].message
    assert "255" not in f[0].hint and "log1p" in f[0].hint


class _ByKeyword(nn.Module):
    """Images passed by keyword, as Hugging Face models take them (`model(pixel_values=x)`)."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(4, 2)

    def forward(self, pixel_values):
        return self.fc(self.conv(pixel_values).mean((2, 3)))


@pytest.mark.parametrize("scope", ["model", "global"])
def test_images_passed_by_keyword_are_looked_at_under_either_guard(scope):
    torch.manual_seed(0)
    model = _ByKeyword()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    with guard(*((model, opt) if scope == "model" else ()), live=False) as g:
        for _ in range(2):
            loss = model(pixel_values=torch.randint(0, 256, (4, 3, 8, 8)).float()).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert [(f.kind, f.where, f.step) for f in g.findings] == [("input-not-normalized", "input", 0)]
    assert "raw 0-255 pixels" in g.findings[0].message


@pytest.mark.parametrize("scale", [1, 2])
def test_an_image_to_image_model_in_unit_range_is_not_reported(scale):
    """Super-resolution and denoising nets map [0, 1] images to [0, 1] images of the same channels: the
    ImageNet normalisation advice does not fit them. A classifier on the same input still gets it."""
    torch.manual_seed(0)
    sr = nn.Sequential(nn.Conv2d(3, 12, 3, padding=1), nn.ReLU(), nn.Conv2d(12, 3 * scale * scale, 3, padding=1),
                       nn.PixelShuffle(scale))
    assert train(sr, [torch.rand(4, 3, 8, 8) for _ in range(3)]).findings == []
    assert [f.kind for f in train(convnet(), [torch.rand(4, 3, 8, 8) for _ in range(3)]).findings] == [
        "input-not-normalized"]


def test_an_inf_marking_no_return_in_a_range_image_says_nothing_of_its_scale():
    class RangeNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = convnet(1)

        def forward(self, x):
            return self.net(torch.where(torch.isfinite(x), x / 50, 0.0))  # +inf: no laser return, masked here

    x = torch.rand(4, 1, 16, 16) * 45
    x[:, :, :2] = float("inf")
    assert train(RangeNet(), [x, x], checks=["input-stats"]).findings == []
    assert [f.kind for f in train(RangeNet(), [x.nan_to_num(posinf=300.0)], checks=["input-stats"]).findings] == [
        "input-not-normalized"]  # the same scale check on a finite input


def test_a_parameter_free_norm_module_before_the_first_conv_normalizes_the_input():
    """Robustness code keeps the attack in [0, 1] pixel space and normalizes inside the model with a parameter-free
    `Norm()` first: told as "the model starts with a convolution" until stop 41."""
    class Norm(nn.Module):
        def forward(self, x):
            return (x - 0.5) / 0.3

    torch.manual_seed(0)
    model = nn.Sequential(Norm(), nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with guard(model, opt, live=False) as g:
        for _ in range(3):
            x = torch.rand(16, 1, 12, 12)
            loss = F.cross_entropy(model(x), torch.randint(0, 3, (16,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert g.findings == []


class _TwoLevels(nn.Module):
    """LapSRN-style deep supervision: the 2x and the 4x image, returned together."""

    def __init__(self):
        super().__init__()
        self.up1 = nn.Sequential(nn.Conv2d(3, 12, 3, padding=1), nn.PixelShuffle(2))
        self.up2 = nn.Sequential(nn.Conv2d(3, 12, 3, padding=1), nn.PixelShuffle(2))

    def forward(self, x):
        x2 = self.up1(x)
        return x2, self.up2(x2)


def test_an_image_to_image_model_returning_several_levels_is_not_reported():
    """Deep supervision (LapSRN's x2 and x4) or CBDNet's (noise map, image): one output of the tuple is an image of
    the input's channels, so the model maps [0, 1] to [0, 1]. Told with the ImageNet Normalize fix until stop 43."""
    torch.manual_seed(0)
    model = _TwoLevels()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, live=False) as g:
        for _ in range(3):
            x = torch.rand(4, 3, 8, 8)
            x2, x4 = model(x)
            loss = F.l1_loss(x2, F.interpolate(x, scale_factor=2)) + F.l1_loss(x4, F.interpolate(x, scale_factor=4))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert g.findings == [], g.findings


class _Centres(nn.Module):
    """Madry-style robustness code: [0, 1] pixels in (attacks stay in pixel space), centred in the forward."""
    def __init__(self):
        super().__init__()
        self.net = convnet()

    def forward(self, x):
        x = x - 0.5
        return self.net(x)


class _Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = convnet()

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize("centre", [True, False])
def test_a_forward_that_centres_unit_range_pixels_is_not_reported(centre):
    """`x = x - 0.5` as the forward's first line centres [0, 1] pixels: silent (told until stop 47); the same model
    without it gets the info finding."""
    torch.manual_seed(0)
    g = train(_Centres() if centre else _Plain(), [torch.rand(4, 3, 16, 16) for _ in range(3)])
    assert [f.kind for f in g.findings] == ([] if centre else ["input-not-normalized"])
