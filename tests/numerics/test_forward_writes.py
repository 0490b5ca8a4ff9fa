"""No write of a training forward escapes the check: through ``.data`` (no version bump), by replacing a
buffer's storage, or on a later micro-batch than the first. Each would put an un-noised function of the
private batch into state_dict(); each planted case shows the write that the check stops."""

import pytest
import torch
import torch.nn as nn
from steps import class_loss

from pipedp import PipelineDPTrainer, UnsupportedModelError
from pipedp.runtime import stage as stage_module


class Writer(nn.Module):
    """A linear layer whose forward writes ``stat`` (a buffer) or its own weight in one of several ways,
    from the micro-batch's ``calls``-th call on."""

    def __init__(self, how: str, start: int = 1):
        super().__init__()
        self.fc, self.how, self.start, self.calls = nn.Linear(4, 4), how, start, 0
        self.register_buffer("stat", torch.zeros(4))

    def forward(self, x):
        self.calls += self.training  # writes in training mode, as running statistics do
        if self.training and self.calls >= self.start:
            batch = x.detach().mean(0)
            if self.how == "data in place":
                self.stat.data.mul_(0.9).add_(0.1 * batch)
            elif self.how == "data assigned":
                self.stat.data = 0.9 * self.stat + 0.1 * batch
            elif self.how == "in place":
                self.stat.mul_(0.9).add_(0.1 * batch)
            elif self.how == "weight through data":
                self.fc.weight.data.div_(1.0 + batch.abs().sum())
        return self.fc(x)


def trainer(how, start=1, self_check=True):
    torch.manual_seed(0)
    model = nn.Sequential(Writer(how, start), nn.Tanh(), nn.Linear(4, 3)).double()
    t = PipelineDPTrainer(
        model,
        class_loss,
        lambda p: torch.optim.SGD(p, lr=0.0),
        stages=2,
        microbatches=2,
        noise_multiplier=0.0,
        max_grad_norm=1.0,
        expected_batch_size=4,
        sampling="poisson",
        sample_rate=0.1,
        self_check=self_check,
    )
    return t, model


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (4,), generator=g)


@pytest.mark.parametrize("self_check", [True, False])
@pytest.mark.parametrize("how", ["data in place", "weight through data"])
def test_a_write_through_data_is_refused_at_the_first_step(how, self_check):
    t, _ = trainer(how, self_check=self_check)
    what = "parameters \\['0.fc.weight'\\]" if how.startswith("weight") else "buffers \\['0.stat'\\]"
    with pytest.raises(UnsupportedModelError, match=f"the training pass changes the {what}"):
        t.step(*batch())


@pytest.mark.parametrize("how", ["data assigned", "in place"])
def test_a_write_on_a_later_micro_batch_of_a_later_step_is_refused(how):
    """Micro-batch 2 of step 2 (the checks' cheap half: identity, storage and version, every micro-batch)."""
    t, _ = trainer(how, start=4)
    t.step(*batch())  # calls 1 and 2
    with pytest.raises(UnsupportedModelError, match="the training forward changes the buffers \\['0.stat'\\]"):
        t.step(*batch())  # calls 3 and 4: the write on the second micro-batch


def test_planted_without_the_value_digest_a_data_write_trains_and_leaks_an_unnoised_statistic(monkeypatch):
    monkeypatch.setattr(stage_module.Stage, "refuse_changed_values", lambda self, before, parameters: None)
    t, model = trainer("data in place")
    t.step(*batch())
    assert float(model[0].stat.abs().sum()) > 1e-3  # a statistic of the private batch, in state_dict()
    assert "0.stat" in t.state_dict()


def test_planted_with_the_old_first_micro_batch_rule_a_later_write_trains(monkeypatch):
    from pipedp.runtime import executor

    forward = stage_module.Stage.forward

    def first_only(self, mb, *args, check_state=False, **kwargs):
        return forward(self, mb, *args, check_state=check_state and mb == 0, **kwargs)

    monkeypatch.setattr(executor.Stage, "forward", first_only)
    monkeypatch.setattr(stage_module.Stage, "refuse_changed_values", lambda self, before, parameters: None)
    t, model = trainer("in place", start=4)
    t.step(*batch())
    t.step(*batch())
    assert float(model[0].stat.abs().sum()) > 1e-3


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.uint8])
def test_the_digest_sees_one_changed_value_and_two_swapped_ones(dtype):
    from pipedp.runtime.state_watch import digests

    def sums(u):  # the digest's value part (its identity part differs between tensors anyway)
        return digests([("t", False, u)])["t"][2:]

    t = (torch.arange(1001) % 7).to(dtype)
    assert sums(t.clone()) == sums(t)
    one = t.clone()
    one[500] += 1
    swapped = t.clone()
    swapped[[10, 11]] = t[[11, 10]]  # two different values swapped: the plain sum stays, the weighted one moves
    assert not torch.equal(swapped, t)
    assert sums(one) != sums(t) and sums(swapped)[0] == sums(t)[0] and sums(swapped)[1] != sums(t)[1]


def test_a_write_in_a_backward_hook_is_refused():
    class Hooked(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("stat", torch.zeros(4))
            self.fc.register_full_backward_hook(self.record)

        def record(self, module, grad_input, grad_output):
            self.stat.add_(grad_output[0].detach().mean(0))  # a statistic of the private batch's gradients

        def forward(self, x):
            return self.fc(x)

    torch.manual_seed(0)
    model = nn.Sequential(Hooked(), nn.Tanh(), nn.Linear(4, 3)).double()
    t = PipelineDPTrainer(model, class_loss, stages=2, noise_multiplier=0.0, expected_batch_size=4, self_check=False)
    with pytest.raises(UnsupportedModelError, match="the training pass changes the buffers \\['0.stat'\\]"):
        t.step(*batch())


def test_a_data_write_to_a_buffer_at_a_later_unchecked_step_is_refused():
    t, _ = trainer("data in place", start=5)  # from step 3 (2 micro-batches a step), unchecked
    t.step(*batch())
    t.step(*batch())
    with pytest.raises(UnsupportedModelError, match="the training pass changes the buffers \\['0.stat'\\]"):
        t.step(*batch())


def test_the_digest_sees_two_float32_values_swapped_2_to_the_15_apart():
    from pipedp.runtime.state_watch import digests

    t = torch.arange(70000, dtype=torch.float32)
    swapped = t.clone()
    swapped[[10, 10 + 32768]] = t[[10 + 32768, 10]]  # 2**16 int16 words apart: the mod-2**16 weights agree
    assert digests([("t", False, swapped)])["t"][2:] != digests([("t", False, t)])["t"][2:]
