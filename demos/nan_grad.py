"""A finite forward whose backward is NaN: the gradient of sqrt at 0 (a distance of a point to itself)."""
import torch
from torch import nn

from guard import guard


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)

    def forward(self, a, b):
        return self.emb(a), self.emb(b)


def distance(u, v, fixed):
    sq = ((u - v) ** 2).sum(dim=1)
    return torch.sqrt(sq + 1e-12) if fixed else torch.sqrt(sq)  # d/dx sqrt(x) at 0 is inf -> 0*inf = NaN


def train(fixed: bool = False, steps: int = 6, **guard_options):
    torch.manual_seed(0)
    model = Embed()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, optimizer, **guard_options) as g:
        for step in range(steps):
            a = torch.randint(0, 10, (16,))
            b = a.clone() if step == 3 else (a + torch.randint(1, 10, (16,))) % 10  # step 3: identical pairs
            u, v = model(a, b)
            loss = distance(u, v, fixed).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
