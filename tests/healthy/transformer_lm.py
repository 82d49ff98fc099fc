"""A tiny Transformer language model: embeddings, masks, log_softmax + nll_loss, ignore_index padding."""
import torch
from torch import nn

from ._common import maybe_guard


class LM(nn.Module):
    def __init__(self, vocab=20, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.out = nn.Linear(d, vocab)

    def forward(self, tokens):
        n = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        return self.out(self.enc(self.emb(tokens), mask=mask, is_causal=True))


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    model = LM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        for _ in range(5):
            tokens = torch.randint(1, 20, (4, 9))
            tokens[:, -2:] = 0  # padding
            logp = torch.log_softmax(model(tokens[:, :-1]), dim=-1)
            loss = nn.functional.nll_loss(logp.reshape(-1, 20), tokens[:, 1:].reshape(-1), ignore_index=0)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return g, model
