"""A model that computes its own loss (Hugging Face style): forward(x, labels) returns a dict with loss and logits."""
import torch
from torch import nn

from ._common import maybe_guard


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 16)
        self.out = nn.Linear(16, 30)
        self.out.weight = self.emb.weight  # tied input/output embeddings

    def forward(self, ids, labels=None):
        logits = self.out(self.emb(ids).mean(1))
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    model = Classifier()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        for _ in range(8):
            ids, labels = torch.randint(0, 30, (8, 5)), torch.randint(0, 30, (8,))
            out = model(ids, labels=labels)
            opt.zero_grad()
            out["loss"].backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            model(torch.randint(0, 30, (2, 5)))
    return g, model
