"""pytorch/examples' actor_critic pattern: one update per episode, the loss summed over the episode's
steps, episodes of very different length: gradient norms vary tenfold and more, routinely."""
import torch
from torch import nn

from ._common import maybe_guard


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, 64)
        self.action_head = nn.Linear(64, 2)
        self.value_head = nn.Linear(64, 1)

    def forward(self, x):
        x = torch.relu(self.affine1(x))
        return torch.softmax(self.action_head(x), dim=-1), self.value_head(x)


def train(use_guard=True, episodes=60, **guard_options):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model = Policy()
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    gamma, eps = 0.99, 1e-6
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        for _ in range(episodes):
            # CartPole-like episodes, one forward per environment step: mostly short (the pole falls),
            # now and then a long one; the summed loss's gradient norm follows the length
            long = torch.rand((), generator=gen).item() < 0.1
            length = int(torch.randint(250, 500, (), generator=gen)) if long else int(torch.randint(8, 20, (), generator=gen))
            # the environment's states do not depend on the actions here: one forward for the episode
            states = [torch.randn(4, generator=gen)]
            for _ in range(length - 1):
                states.append(0.9 * states[-1] + 0.3 * torch.randn(4, generator=gen))
            probs, values = model(torch.stack(states))
            actions = torch.multinomial(probs, 1, generator=gen)
            log_probs = torch.log(probs.gather(1, actions)).squeeze(1)
            returns, R = [], 0.0
            for _ in range(length):
                R = 1.0 + gamma * R
                returns.insert(0, R)
            returns = torch.tensor(returns)
            returns = (returns - returns.mean()) / (returns.std() + eps) if length > 1 else returns * 0
            advantage = returns - values.squeeze(1).detach()
            policy_losses = -log_probs * advantage
            value_losses = nn.functional.smooth_l1_loss(values.squeeze(1), returns, reduction="none")
            loss = policy_losses.sum() + value_losses.sum()  # summed over the episode, as the example does
            opt.zero_grad()
            loss.backward()
            opt.step()
    return g, model
