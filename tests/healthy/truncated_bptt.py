"""Truncated back-propagation through time: the hidden state is detached between chunks."""
import torch
from torch import nn

from ._common import maybe_guard


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 8, batch_first=True)
        self.out = nn.Linear(8, 1)

    def forward(self, x, hidden=None):
        y, hidden = self.lstm(x, hidden)
        return self.out(y), hidden


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    seq = torch.randn(4, 40, 3)
    target = seq.sum(-1, keepdim=True).cumsum(1) * 0.1
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        hidden = None
        for t in range(0, 40, 8):
            out, hidden = model(seq[:, t:t + 8], hidden)
            hidden = tuple(h.detach() for h in hidden)
            loss = nn.functional.mse_loss(out, target[:, t:t + 8])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return g, model
