"""Two optimizers over disjoint parts of one model (embeddings with Adagrad, the rest with SGD + plateau schedule)."""
import torch
from torch import nn

from ._common import maybe_guard


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    emb = nn.Embedding(20, 8)
    body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    model = nn.ModuleDict({"emb": emb, "body": body})
    opt_emb = torch.optim.Adagrad(emb.parameters(), lr=0.1)
    opt_body = torch.optim.SGD(body.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt_body, patience=1)
    with maybe_guard(use_guard, model, [opt_body, opt_emb], **guard_options) as g:
        for _ in range(8):
            ids, y = torch.randint(0, 20, (16, 3)), torch.randint(0, 2, (16,))
            loss = nn.functional.cross_entropy(body(emb(ids).mean(1)), y)
            opt_emb.zero_grad()
            opt_body.zero_grad()
            loss.backward()
            opt_emb.step()
            opt_body.step()
            sched.step(loss.item())
    return g, model
