"""Weight decay shrinks a block that gets no gradient in this phase (zero_grad(set_to_none=False) keeps zero grads)."""
import torch
from torch import nn

from guard import guard


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.layer2 = nn.Sequential(nn.Linear(32, 32), nn.ReLU())
        self.layer3 = nn.Sequential(nn.Linear(32, 32), nn.ReLU())
        self.layer4 = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))  # refinement, phase 2 only
        self.fc = nn.Linear(32, 4)

    def forward(self, x, deep=True):
        h = self.layer3(self.layer2(self.layer1(x)))
        if deep:
            h = h + self.layer4(h)
        return self.fc(h)


def train(fixed: bool = False, steps: int = 24, **guard_options):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    loss_fn = nn.CrossEntropyLoss()
    with guard(model, optimizer, **guard_options) as g:
        for step in range(steps):
            x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
            deep = step < 2  # a short deep warm-up, then a shallow phase without layer4
            # Bug: set_to_none=False turns layer4's old gradients into zeros, and AdamW decays it every step.
            optimizer.zero_grad(set_to_none=fixed)
            loss = loss_fn(model(x, deep=deep), y)
            loss.backward()
            optimizer.step()
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
