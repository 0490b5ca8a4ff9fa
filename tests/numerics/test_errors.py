"""Bad input gets a clear error naming the problem and the fix."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from steps import class_loss

from pipedp import BatchError, PartitionError, PipeDPError, PipelineDPTrainer, UnsupportedModelError
from pipedp.models import mlp


def trainer(model, loss_fn=class_loss, **kw):
    args = dict(stages=2, microbatches=2, noise_multiplier=0.0, expected_batch_size=4)
    args.update(kw)
    return PipelineDPTrainer(model, loss_fn, **args)


def test_batchnorm_is_named_with_the_fix():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    with pytest.raises(UnsupportedModelError, match=r"layer '1' is BatchNorm1d.*GroupNorm.*ModuleValidator.fix"):
        trainer(model)


def test_more_stages_than_blocks():
    with pytest.raises(PartitionError, match="cannot split 3 blocks into 5 stages"):
        trainer(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)), stages=5)


def test_unknown_schedule():
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'"):
        trainer(mlp(), schedule="pipedream")


def test_scalar_loss_is_refused():
    t = trainer(mlp(), loss_fn=lambda out, y: F.cross_entropy(out, y))
    with pytest.raises(BatchError, match=r"per-sample losses of shape \[2\].*reduction='none'"):
        t.step(torch.randn(4, 8), torch.randint(0, 4, (4,)))


def test_mismatched_inputs_and_targets():
    t = trainer(mlp())
    with pytest.raises(BatchError, match="5 inputs vs 4 targets"):
        t.step(torch.randn(5, 8), torch.randint(0, 4, (4,)))


def test_epsilon_without_sample_rate():
    # Poisson accounting needs its rate; undeclared batches need none (they are charged at rate 1)
    with pytest.raises(PipeDPError, match="sample_rate"):
        trainer(mlp(), sampling="poisson").epsilon(1e-5)


def test_in_place_activation_after_a_layer_is_refused():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 4))
    with pytest.raises(UnsupportedModelError, match="modified in place"):
        trainer(model, stages=1).step(torch.randn(4, 8), torch.randint(0, 4, (4,)))


def test_layer_input_without_batch_dimension_is_refused():
    class SharedBias(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(8, 8)

        def forward(self, x):
            return x + self.emb(torch.arange(8))  # no batch dimension

    model = nn.Sequential(nn.Linear(8, 8), SharedBias(), nn.Linear(8, 4))
    with pytest.raises(UnsupportedModelError, match="without the micro-batch dimension"):
        trainer(model, stages=1).step(torch.randn(4, 8), torch.randint(0, 4, (4,)))


def test_layer_called_with_keyword_arguments_is_refused():
    class KwargCall(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(input=x)

    model = nn.Sequential(KwargCall(), nn.Linear(8, 4))
    with pytest.raises(UnsupportedModelError, match=r"called with keyword arguments \['input'\]"):
        trainer(model, stages=1).step(torch.randn(4, 8), torch.randint(0, 4, (4,)))


class TiedFunctionally(torch.nn.Module):
    """A head that reads the embedding's weight functionally: the embedding module is called for the
    ids, but this second use of its weight happens outside any call of the module that owns it."""

    def __init__(self, embedding):
        super().__init__()
        self.embedding = embedding

    def forward(self, h):
        return torch.nn.functional.linear(h, self.embedding.weight)


def test_a_parameter_used_outside_its_module_is_refused_by_name():
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(10, 4)
    model = torch.nn.Sequential(embedding, torch.nn.Linear(4, 4), TiedFunctionally(embedding))
    trainer = PipelineDPTrainer(
        model,
        lambda out, y: (
            torch.nn.functional.cross_entropy(out.reshape(-1, 10), y.reshape(-1), reduction="none")
            .reshape(y.shape)
            .mean(1)
        ),
        stages=1,
        microbatches=2,
        expected_batch_size=4,
    )
    x, y = torch.randint(0, 10, (4, 3)), torch.randint(0, 10, (4, 3))
    with pytest.raises(UnsupportedModelError, match=r"gradient of 0\.weight is not all seen by per-sample clipping"):
        trainer.step(x, y)
