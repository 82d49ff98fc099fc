"""NLP-tutorial style: demo nn.LSTM(3, 3), nn.Embedding and nn.Linear called a few times to show their
outputs (never trained, no optimizer), then a model trained for real; under a global guard."""
import torch
from torch import nn

from ._common import maybe_guard


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    with maybe_guard(use_guard, **guard_options) as g:
        lstm = nn.LSTM(3, 3)  # "LSTM's expect all of its inputs to be 3D tensors"
        hidden = (torch.randn(1, 1, 3), torch.randn(1, 1, 3))
        shown = []
        for i in [torch.randn(1, 3) for _ in range(5)]:
            out, hidden = lstm(i.view(1, 1, -1), hidden)
            shown.append(out)
        embeds = nn.Embedding(2, 5)
        shown.append(embeds(torch.tensor([0], dtype=torch.long)))
        lin = nn.Linear(5, 3)
        shown.append(lin(torch.randn(2, 5)))

        model = nn.Sequential(nn.Embedding(20, 8), nn.Flatten(), nn.Linear(4 * 8, 20))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(8):
            ctx, tgt = torch.randint(0, 20, (16, 4)), torch.randint(0, 20, (16,))
            loss = nn.functional.cross_entropy(model(ctx), tgt)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return g, model
