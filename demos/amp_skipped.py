"""Mixed precision with a GradScaler hides NaN gradients: every step is skipped and the scale collapses."""
import torch
from torch import nn

from guard import guard


class PairNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.head = nn.Linear(1, 1)

    def forward(self, a, b, fixed=False):
        sq = ((self.emb(a) - self.emb(b)) ** 2).sum(dim=1, keepdim=True)
        dist = torch.sqrt(sq + 1e-12) if fixed else torch.sqrt(sq)  # sqrt'(0) = inf when a == b
        return self.head(dist)


def train(fixed: bool = False, steps: int = 24, **guard_options):
    torch.manual_seed(0)
    model = PairNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    with guard(model, optimizer, **guard_options) as g:
        for _ in range(steps):
            a = torch.randint(0, 10, (16,))
            b = a.clone()
            b[8:] = torch.randint(0, 10, (8,))  # half the pairs are identical: distance 0
            y = (a == b).float().unsqueeze(1)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(model(a, b, fixed).float(), y)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)  # silently skipped when any gradient is NaN/Inf
            scaler.update()
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
