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


class MaskedBlock(torch.nn.Module):
    """A residual block reading a padding mask: positions mix through a masked mean."""

    def __init__(self, d):
        super().__init__()
        self.ln, self.fc, self.mix = torch.nn.LayerNorm(d), torch.nn.Linear(d, d), torch.nn.Linear(d, d)

    def forward(self, h, mask):
        m = mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
        return h + torch.tanh(self.fc(self.ln(h)) + self.mix(pooled))


class MaskedNet(torch.nn.Module):
    """Token ids and a padding mask in (two forward inputs); every block reads the mask, the embedding
    output comes back at the end (a long skip connection) and the ids feed a bias table there: a float
    stream, the embedding output, the mask and the ids cross every cut."""

    def __init__(self, vocab=11, d=8, layers=4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList([MaskedBlock(d) for _ in range(layers)])
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab)
        self.token_bias = torch.nn.Embedding(vocab, vocab)

    def forward(self, ids, mask):
        e = self.embed(ids)
        h = e
        for block in self.blocks:
            h = block(h, mask)
        return self.head(self.norm(h + e)) + self.token_bias(ids)


class TiedLM(torch.nn.Module):
    """A plain language model whose output head shares the input embedding's weight; ``shift``: the
    embedding reads other ids than the inputs (which the cross-stage tie cannot handle)."""

    def __init__(self, vocab=11, d=8, shift=0):
        super().__init__()
        self.shift, self.vocab = shift, vocab
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList([MaskedBlock(d) for _ in range(3)])
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids, mask):
        h = self.embed((input_ids + self.shift) % self.vocab)
        for block in self.blocks:
            h = block(h, mask)
        return self.head(h)


class GatedBlock(torch.nn.Module):
    """A residual MLP written two common ways: GELU between two Linears, and a gated (SwiGLU) one; a ``gate``
    column scaling the hidden features (``scaled``) mixes them with a value every rank holds whole."""

    def __init__(self, d, hidden, scaled=False):
        super().__init__()
        self.ln, self.up, self.down = torch.nn.LayerNorm(d), torch.nn.Linear(d, hidden), torch.nn.Linear(hidden, d)
        self.w1, self.w3 = torch.nn.Linear(d, hidden, bias=False), torch.nn.Linear(d, hidden, bias=False)
        self.w2 = torch.nn.Linear(hidden, d, bias=False)
        self.gate = torch.nn.Linear(d, 1) if scaled else None

    def forward(self, h):
        x = self.ln(h)
        hidden = torch.nn.functional.gelu(self.up(x))
        if self.gate is not None:
            hidden = hidden * self.gate(x)
        h = h + self.down(hidden)
        return h + self.w2(torch.nn.functional.silu(self.w1(h)) * self.w3(h) * 0.5)


class GatedNet(torch.nn.Module):
    """Token ids in, logits out, written the common way (a ModuleList and a loop; traced to split): an embedding,
    gated residual MLPs, a norm and a head."""

    def __init__(self, vocab=12, d=8, hidden=16, layers=2, scaled=False):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList([GatedBlock(d, hidden, scaled) for _ in range(layers)])
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))
