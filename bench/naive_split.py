"""The naive split users hack today, written the way they write it (the Opacus issue thread in
shared/seeds): each stage's layers on their own device (here: process), Opacus's
GradSampleModule hooks on each part, the whole logical batch as one micro-batch (so only one
stage works at a time), per-parameter norms gathered across the parts, then Opacus-style
clip-and-accumulate over the materialized per-sample gradients, noise, step. No pipedp code.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

LR = 1e-3


def _send(t: torch.Tensor, dst: int) -> None:
    dist.send(torch.tensor([t.dim()], dtype=torch.int64), dst)
    dist.send(torch.tensor(t.shape, dtype=torch.int64), dst)
    dist.send(t.detach().contiguous(), dst)


def _recv(src: int, dtype: torch.dtype) -> torch.Tensor:
    ndim = torch.zeros(1, dtype=torch.int64)
    dist.recv(ndim, src)
    shape = torch.zeros(int(ndim), dtype=torch.int64)
    dist.recv(shape, src)
    out = torch.empty([int(s) for s in shape], dtype=dtype)
    dist.recv(out, src)
    return out


def naive_split_step_fn(
    part: torch.nn.Module, preset, batch: int, stages: int, noise_multiplier=1.0, max_grad_norm=1.0
):
    """A function doing one DP-SGD step of this rank's ``part`` on the whole batch (the caller cuts
    the model: the harness cuts it where pipedp does, so both train the same parts)."""
    from opacus import GradSampleModule

    warnings.filterwarnings("ignore")
    rank = dist.get_rank()
    x, y = preset.make_batch(batch, 0)
    gsm = GradSampleModule(part, loss_reduction="sum")  # backward of the summed per-sample losses
    params = [p for p in part.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=LR)
    first, last = rank == 0, rank == stages - 1
    generator = torch.Generator().manual_seed(rank)

    def step():
        inp = x if first else _recv(rank - 1, torch.float32).requires_grad_(True)
        out = gsm(inp)
        if last:
            preset.loss(out, y).sum().backward()
        else:
            _send(out, rank + 1)
            out.backward(_recv(rank + 1, out.dtype))
        if not first:
            _send(inp.grad, rank - 1)
        # per-sample squared norms of this part, summed over all parts (the hack's cross-device step)
        squared = sum(p.grad_sample.reshape(batch, -1).pow(2).sum(1) for p in params)
        dist.all_reduce(squared)
        factor = (max_grad_norm / (squared.sqrt() + 1e-6)).clamp(max=1.0)
        for p in params:
            clipped = torch.einsum("i,i...", factor, p.grad_sample)
            noise = torch.normal(0.0, noise_multiplier * max_grad_norm, p.shape, generator=generator)
            p.grad = (clipped + noise) / batch
            p.grad_sample = None
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step
