"""A module at several positions of a model (``nn.Sequential(lin, *[block] * 3, head)``, the weight-sharing
idiom, or one module called several times) trains as the model runs: its per-sample gradient is the sum over
its calls, against the loop oracle; its calls stay on one stage, and a split that cannot keep them together
is refused by name."""

import copy

import pytest
import torch
import torch.nn as nn
from oracles import loop_clipped_sum, max_relative_error
from steps import class_data, class_loss

import pipedp.train.prepare as prepare_module
from pipedp import PartitionError, PipelineDPTrainer
from pipedp.split import partition as partition_module
from pipedp.split.adapters import model_blocks
from pipedp.split.blocks import Block
from pipedp.split.partition import partition


def sgd(p):
    return torch.optim.SGD(p, lr=1.0)


def repeated_model():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
    return nn.Sequential(nn.Linear(4, 6), *[block] * 3, nn.Linear(6, 3)).double()


def data(n=8, seed=1):
    return class_data(n, 4, 3, seed)


def own_loss(model, x, y):
    with torch.no_grad():
        return float(class_loss(model(x), y).mean())


def trainer_for(model, **options):
    settings = dict(noise_multiplier=0.0, max_grad_norm=0.1, expected_batch_size=1, microbatches=2)
    settings.update(options)
    return PipelineDPTrainer(model, class_loss, sgd, **settings)


def step_error(model, trainer, x, y, clip=0.1):
    want = loop_clipped_sum(copy.deepcopy(model), class_loss, x, y, clip)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    trainer.step(x, y)
    got = {k: before[k] - p.detach() for k, p in model.named_parameters()}
    return max_relative_error(got, want)


def test_every_position_of_a_sequential_is_a_block():
    model = repeated_model()
    blocks = model_blocks(model)
    assert [b.name for b in blocks] == ["0", "1", "2", "3", "4"]
    assert blocks[1].module is blocks[2].module is blocks[3].module


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("mode", ["auto", "materialize", "ghost"])
def test_a_repeated_module_is_trained_as_the_model_runs(stages, mode):
    model = repeated_model()
    trainer = trainer_for(model, stages=stages, grad_mode=mode)
    x, y = data()
    # evaluate() runs the model's own network (the blocks once ran block a single time: 4.677 vs 4.655)
    assert abs(trainer.evaluate(x, y) - own_loss(model, x, y)) < 1e-12
    for seed in (1, 2):  # two steps: the shared weights moved once per step, by the summed gradient
        x, y = data(seed=seed)
        assert step_error(model, trainer, x, y) < 1e-10
    assert list(trainer.state_dict()) == list(model.state_dict())  # every position's keys, as the model has them
    held = [i for i, s in enumerate(trainer.runtime.local_stages) if any(p is model[1][0].weight for p in s.parameters)]
    assert len(held) == 1  # one stage steps the shared weights: noised once, stepped once


def test_the_noise_of_a_repeated_module_is_drawn_once_under_its_first_name():
    model = repeated_model()
    trainer = trainer_for(model, stages=2, noise_multiplier=1.0)
    names = [n for s in trainer.runtime.local_stages for n in s.parameter_names()]
    assert names == [n for n, _ in model.named_parameters()]  # 1.0.weight once; no 2.0.weight, 3.0.weight


def test_a_repeated_module_inside_a_block_and_a_pipeline_blocks_model_are_exact():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
    nested = nn.Sequential(nn.Linear(4, 6), nn.Sequential(*[block] * 3), nn.Linear(6, 3)).double()
    x, y = data()
    assert step_error(nested, trainer_for(nested, stages=2), x, y) < 1e-10

    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.mid, self.out = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 3)

        def forward(self, x):
            return self.out(self.mid(torch.tanh(self.mid(self.inp(x)))))

        def pipeline_blocks(self):
            return [("inp", self.inp), ("mid", self.mid), ("act", nn.Tanh()), ("mid", self.mid), ("out", self.out)]

    model = Blocks().double()
    trainer = trainer_for(model, stages=2)
    assert abs(trainer.evaluate(x, y) - own_loss(model, x, y)) < 1e-12
    assert step_error(model, trainer, x, y) < 1e-10


def test_a_repeated_module_in_a_traced_model_is_exact():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            block = nn.Linear(6, 6)
            self.inp, self.body, self.out = nn.Linear(4, 6), nn.Sequential(*[block, nn.Tanh()] * 3), nn.Linear(6, 3)

        def forward(self, x):
            return self.out(self.body(self.inp(x)))

    torch.manual_seed(0)
    model = Net().double()
    trainer = trainer_for(model, stages=2)
    x, y = data()
    assert abs(trainer.evaluate(x, y) - own_loss(model, x, y)) < 1e-12
    assert step_error(model, trainer, x, y) < 1e-10


def test_the_split_keeps_a_repeated_module_on_one_stage_whatever_the_costs():
    blocks = model_blocks(repeated_model())
    # unconstrained, these costs cut between the repeats ([0, 1 | 2, 3, 4]: largest part 102, not 103)
    stages = partition(blocks, 2, [100, 1, 1, 1, 100])
    assert [[b.name for b in s] for s in stages] in (
        [["0"], ["1", "2", "3", "4"]],
        [["0", "1", "2", "3"], ["4"]],
    )
    assert [[b.name for b in s] for s in partition(blocks, 3, "uniform")] == [["0"], ["1", "2", "3"], ["4"]]


def test_a_split_that_would_separate_the_repeats_is_refused_by_name():
    model = repeated_model()
    with pytest.raises(PartitionError, match=r"'1' at block positions \[1, 2, 3\].*at most 3 stages.*copy.deepcopy"):
        trainer_for(model, stages=4)


def test_a_repeated_frozen_or_stateful_module_stays_on_one_stage_too():
    # no gradient to tie, but multi-process runs move every other stage's blocks to the meta device: a module
    # on two stages would lose its weights on one; a module with no tensors (an activation) may go anywhere
    frozen = nn.Linear(6, 6).requires_grad_(False)
    act = nn.Tanh()
    blocks = [Block(str(i), m) for i, m in enumerate([nn.Linear(4, 6), frozen, act, frozen, act, nn.Linear(6, 3)])]
    stages = partition(blocks, 3, "uniform")
    assert sum(any(b.module is frozen for b in s) for s in stages) == 1
    assert partition_module.repeated_modules(blocks) == [("1", [1, 3])]


def test_planted_the_old_blocks_train_another_network(monkeypatch):
    """The planted bug: blocks from named_children(), which yields the repeated module once."""

    def deduplicated(model, untie_weights=False):
        return [Block(name, module) for name, module in model.named_children()]

    monkeypatch.setattr(prepare_module, "model_blocks", deduplicated)
    model = repeated_model()
    trainer = trainer_for(model)
    x, y = data()
    assert abs(trainer.evaluate(x, y) - own_loss(model, x, y)) > 1e-4
    assert step_error(model, trainer, x, y) > 0.1


def test_planted_without_the_constraint_the_split_cuts_between_the_repeats(monkeypatch):
    monkeypatch.setattr(partition_module, "_uncut", lambda blocks, stages: set())
    with pytest.raises(PartitionError, match="one tensor used on several stages"):
        partition(model_blocks(repeated_model()), 2, [100, 1, 1, 1, 100])


def test_a_checkpoint_of_a_repeated_module_restores_it(tmp_path):
    model, other = repeated_model(), repeated_model()
    trainer = trainer_for(model, stages=2, noise_multiplier=1.0)
    x, y = data()
    trainer.step(x, y)
    trainer.save_checkpoint(str(tmp_path))
    restored = trainer_for(other, stages=2, noise_multiplier=1.0)
    restored.load_checkpoint(str(tmp_path))
    trainer.step(x, y)
    restored.step(x, y)  # the same noise, drawn once per parameter under its first name
    assert max_relative_error(dict(other.named_parameters()), dict(model.named_parameters())) == 0
