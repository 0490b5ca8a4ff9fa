"""Independent oracles: Opacus on one device, and a loop of batch-size-1 backward passes.

Neither uses any pipedp code: they take the unsplit model and compute the DP-SGD update
the way a user of Opacus (or a textbook) would.
"""

from __future__ import annotations

import copy
import warnings
from typing import Callable, Dict

import torch
import torch.nn as nn
from opacus.accountants import create_accountant
from torch.utils.data import DataLoader, TensorDataset


def opacus_step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, token_model: bool, mode: str, max_grad_norm: float, lr: float
) -> Dict[str, torch.Tensor]:
    """State dict after one Opacus DP-SGD step (noise 0, flat clipping, loss_reduction='mean')."""
    from opacus import PrivacyEngine

    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
    criterion = nn.CrossEntropyLoss()
    engine = PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if mode == "ghost":
            m, opt, dp_criterion, _ = engine.make_private(
                module=m,
                optimizer=opt,
                data_loader=loader,
                criterion=criterion,
                noise_multiplier=0.0,
                max_grad_norm=max_grad_norm,
                poisson_sampling=False,
                grad_sample_mode="ghost",
            )
            out = m(x)
            if token_model:
                loss = dp_criterion(out.reshape(-1, out.shape[-1]), y.reshape(-1), shape=out.shape)
            else:
                loss = dp_criterion(out, y)
        else:
            m, opt, _ = engine.make_private(
                module=m,
                optimizer=opt,
                data_loader=loader,
                noise_multiplier=0.0,
                max_grad_norm=max_grad_norm,
                poisson_sampling=False,
                grad_sample_mode="hooks",
            )
            out = m(x)
            loss = criterion(out.reshape(-1, out.shape[-1]), y.reshape(-1)) if token_model else criterion(out, y)
        assert opt.expected_batch_size == len(x)
        loss.backward()
        opt.step()
    return {k.replace("_module.", ""): v.detach().clone() for k, v in m.state_dict().items()}


def loop_clipped_sum(
    model: nn.Module, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor, max_grad_norm: float, groups=None
) -> Dict[str, torch.Tensor]:
    """sum_i clip(grad of sample i alone), one batch-size-1 backward pass per sample.

    With ``groups`` ([(parameter-name prefixes, C_g), ...]) each group of parameters is clipped
    on its own to its C_g (group-wise clipping); otherwise the whole gradient to max_grad_norm.
    """
    params = dict(model.named_parameters())
    if groups is None:
        groups = [((""), max_grad_norm)]
    total = {k: torch.zeros_like(p) for k, p in params.items()}
    for i in range(len(y)):
        model.zero_grad(set_to_none=True)
        out = model(**{k: v[i : i + 1] for k, v in x.items()}) if isinstance(x, dict) else model(x[i : i + 1])
        loss = loss_fn(out, y[i : i + 1]).sum()
        loss.backward()
        for prefixes, clip in groups:
            members = [k for k in params if k.startswith(prefixes) and params[k].grad is not None]
            norm = torch.sqrt(sum((params[k].grad.double() ** 2).sum() for k in members))
            factor = min(1.0, clip / (float(norm) + 1e-6))
            for k in members:
                total[k] += factor * params[k].grad
    model.zero_grad(set_to_none=True)
    return total


def max_relative_error(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want), f"state dict keys differ: {set(got) ^ set(want)}"
    scale = max(float(v.abs().max()) for v in want.values())
    return max(float((got[k].to(want[k].dtype) - want[k]).abs().max()) for k in want) / scale


def loop_unit_clipped_sum(
    model: nn.Module, loss_fn: Callable, x, y: torch.Tensor, max_grad_norm: float, rows: int
) -> Dict[str, torch.Tensor]:
    """User-level DP: sum_u clip(grad of unit u alone), a unit being ``rows`` consecutive rows whose loss is
    the sum of theirs; one backward pass per unit, on its rows only."""
    params = dict(model.named_parameters())
    total = {k: torch.zeros_like(p) for k, p in params.items()}
    for u in range(len(y) // rows):
        span = slice(u * rows, (u + 1) * rows)
        model.zero_grad(set_to_none=True)
        out = model(**{k: v[span] for k, v in x.items()}) if isinstance(x, dict) else model(x[span])
        loss_fn(out, y[span]).sum().backward()
        members = [k for k in params if params[k].grad is not None]
        norm = torch.sqrt(sum((params[k].grad.double() ** 2).sum() for k in members))
        factor = min(1.0, max_grad_norm / (float(norm) + 1e-6))
        for k in members:
            total[k] += factor * params[k].grad
    model.zero_grad(set_to_none=True)
    return total


def opacus_epsilon(history, delta=1e-5, mechanism="prv"):
    """Opacus's accountant's epsilon for a history of (noise multiplier, sample rate, steps) charges."""
    accountant = create_accountant(mechanism=mechanism)
    accountant.history = history
    return accountant.get_epsilon(delta=delta)
