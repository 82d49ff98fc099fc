"""DataLoaders with shuffle=False that are fine: a time series in time order (float targets), language-model
windows (2-d token targets), a label-sorted validation set (no backward), a label-sorted training set drawn
through a sampler, and batch size 1."""
import torch
from torch import nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

from ._common import maybe_guard


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    t = torch.linspace(0, 6, 97)
    series = DataLoader(TensorDataset(torch.stack([t.sin(), t.cos()], 1), (2 * t).sin()), batch_size=16)
    tokens = torch.randint(0, 20, (40, 9))
    lm = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)
    labels = torch.arange(3).repeat_interleave(24)
    feats = torch.randn(len(labels), 2) + labels[:, None]
    sorted_ds = TensorDataset(feats, labels)
    val = DataLoader(sorted_ds, batch_size=8)
    weighted = DataLoader(sorted_ds, batch_size=8, sampler=WeightedRandomSampler(torch.ones(len(labels)), 32))
    single = DataLoader(sorted_ds, batch_size=1)
    reg, clf, emb = nn.Linear(2, 1), nn.Linear(2, 3), nn.Embedding(20, 20)
    opt = torch.optim.SGD(list(reg.parameters()) + list(clf.parameters()) + list(emb.parameters()), lr=0.05)
    with maybe_guard(use_guard, None, opt, **guard_options) as g:
        for x, y in series:
            loss = F.mse_loss(reg(x).squeeze(1), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        for x, y in lm:
            loss = F.cross_entropy(emb(x).flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
        for loader in (weighted, single):
            for i, (x, y) in enumerate(loader):
                if i == 12:
                    break
                loss = F.cross_entropy(clf(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
        with torch.no_grad():
            for x, y in val:
                F.cross_entropy(clf(x), y)
    return g, clf
