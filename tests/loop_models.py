"""Small models written the common way (a ModuleList and a loop in forward, no marks), shared by the
in-process and the multi-process tests of the automatic split."""
import torch


class Residual(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc, self.ln = torch.nn.Linear(d, d), torch.nn.LayerNorm(d)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.ln(x)))


class LoopNet(torch.nn.Module):
    """``skip``: the input itself also reaches the output, so no single tensor crosses any cut."""

    def __init__(self, skip=False):
        super().__init__()
        self.skip = skip
        self.inp = torch.nn.Linear(5, 8)
        self.layers = torch.nn.ModuleList([Residual(8) for _ in range(4)])
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        out = self.out(h)
        return out + x.mean(-1, keepdim=True) if self.skip else out
