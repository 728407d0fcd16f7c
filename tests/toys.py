"""Toy models and losses shared by the one-process tests (no transformers, exact arithmetic where it matters)."""

import torch


class Quadratic(torch.nn.Module):
    """f(w) = sum_k 0.5 a_k ||w_k - c_k||^2 in float64: the SPSA difference is exactly g . v."""

    def __init__(self, sizes=(3, 5, 2, 6), seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.ws = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(n, generator=gen, dtype=torch.float64)) for n in sizes])
        self.curv = [float(k + 1) ** 2 for k in range(len(sizes))]

    def forward(self):
        return sum(0.5 * a * (w**2).sum() for a, w in zip(self.curv, self.ws))

    def grad(self):
        return [a * w.detach().clone() for a, w in zip(self.curv, self.ws)]


def quad_loss(model, batch):
    return model(), 1


class TinyNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(8, 16)
        self.l2 = torch.nn.Linear(16, 2)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x):
        return self.l2(self.norm(torch.tanh(self.l1(x))))


def toy_task(n=256):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(n, 8, generator=gen)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return x, y


def ce_loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y, reduction="sum"), len(y)
