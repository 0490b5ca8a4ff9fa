"""pipedp.models.token_loss: each sequence's mean next-token cross-entropy, against a direct
computation, and its backward makes no second logits-sized copy."""

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from pipedp.models import token_loss


def _direct(logits, targets):
    """Per sequence: the mean of -log p(target) over its targets that are not -100 (0 if none)."""
    out = []
    for row, want in zip(logits, targets):
        terms = [-torch.log_softmax(row[t], dim=0)[int(w)] for t, w in enumerate(want) if int(w) != -100]
        out.append(torch.stack(terms).mean() if terms else torch.zeros((), dtype=logits.dtype))
    return torch.stack(out)


def test_token_loss_is_each_sequences_mean_over_its_targets():
    torch.manual_seed(0)
    logits = torch.randn(4, 5, 7, dtype=torch.float64)
    targets = torch.randint(0, 7, (4, 5))
    targets[1, :2] = -100
    targets[3] = -100  # a sequence with no target: 0, not NaN
    assert torch.allclose(token_loss(logits, targets), _direct(logits, targets), rtol=1e-14, atol=1e-15)


class _Copies(TorchDispatchMode):
    """The operators that write a tensor of ``size`` elements from another (copies, not compute)."""

    def __init__(self, size):
        super().__init__()
        self.size, self.copies = size, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.copy_.default, torch.ops.aten.clone.default) and out.numel() == self.size:
            self.copies.append(str(func))
        return out


def _backward_copies(loss_fn, dtype):
    logits = torch.randn(2, 16, 100, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 100, (2, 16))
    with _Copies(logits.numel()) as spy:
        loss_fn(logits, targets).sum().backward()
    return spy.copies


def test_token_loss_backward_makes_no_logits_sized_copy():
    """At 2048 tokens x 32000 a copy is 125 MiB in bf16; the planted transposed form (the old code) makes it."""

    def transposed(logits, targets):
        losses = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        return losses.sum(dim=1) / (targets != -100).sum(dim=1).clamp(min=1)

    for dtype in (torch.float32, torch.bfloat16):
        assert _backward_copies(token_loss, dtype) == []
        assert _backward_copies(transposed, dtype) != []
