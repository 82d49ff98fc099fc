"""Two losses: one trains the whole model, one only the head (on detached features); a partial zero_grad on
purpose; gradients merged by hand after zero_grad (gradient surgery); an input optimised directly."""
import torch
import torch.nn.functional as F
from torch import nn

from ._common import maybe_guard


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
    head = nn.Linear(32, 3)
    model = nn.Sequential(body, head)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    image = torch.zeros(2, 8, requires_grad=True)
    opt_image = torch.optim.Adam([image], lr=0.1)  # like style transfer / adversarial inputs
    with maybe_guard(use_guard, model, [opt, opt_image], **guard_options) as g:
        for i in range(6):
            x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
            opt.zero_grad()
            feats = body(x)
            F.cross_entropy(head(feats), y).backward(retain_graph=True)
            F.cross_entropy(head(feats.detach()), y).backward()  # trains only the head
            if i % 3 == 2:
                body.zero_grad()  # skip the body's update this step, on purpose
            opt.step()
        for _ in range(3):  # gradient surgery: per-task gradients averaged by hand after zero_grad()
            grads = []
            for task in range(2):
                opt.zero_grad()
                F.cross_entropy(model(torch.randn(16, 8)), torch.randint(0, 3, (16,))).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
            opt.zero_grad()
            for p, g0, g1 in zip(model.parameters(), *grads):
                p.grad = (g0 + g1) / 2
            opt.step()
        model.requires_grad_(False)
        for _ in range(3):
            opt_image.zero_grad()
            (-model(image).logsumexp(dim=1).mean()).backward()
            opt_image.step()
        model.requires_grad_(True)
    return g, model
