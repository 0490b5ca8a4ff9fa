"""The automatic split (no marks, no wrapper) where several tensors cross a cut, against the loop oracle;
the graph-level refusals; and the forward's inputs as a dict."""

import copy

import pytest
import torch
import torch.nn.functional as F
from loop_models import LoopNet, MaskedNet
from oracles import loop_clipped_sum, max_relative_error

from pipedp import BatchError, PipelineDPTrainer, UnsupportedModelError, measured_costs
from pipedp.models import token_loss
from pipedp.split.adapters import model_blocks

seq_loss = token_loss  # per-sample mean over positions


def masked_data(n, t, generator):
    ids = torch.randint(0, 11, (n, t), generator=generator)
    lengths = torch.randint(1, t + 1, (n,), generator=generator)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    return {"ids": ids, "mask": mask}, torch.randint(0, 11, (n, t), generator=generator)


def sgd(p):
    return torch.optim.SGD(p, lr=1.0)


def step_update(model, trainer, x, y):
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    trainer.step(x, y)
    return {k: before[k] - p.detach() for k, p in model.named_parameters()}


def class_step_error(model, x, y, clip=0.1):
    """One noise-free step on 2 stages (a classifier) against the loop oracle: the max relative error."""

    def ce(o, t):
        return F.cross_entropy(o, t, reduction="none")

    want = loop_clipped_sum(copy.deepcopy(model), ce, x, y, clip)
    trainer = PipelineDPTrainer(
        model, ce, sgd, stages=2, microbatches=2, noise_multiplier=0.0, max_grad_norm=clip, expected_batch_size=1
    )
    return max_relative_error(step_update(model, trainer, x, y), want)


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("mode", ["ghost", "materialize"])
def test_a_long_skip_connection_crosses_the_split(stages, mode):
    torch.manual_seed(0)
    model = LoopNet(skip=True).double()  # the input reaches the output: two tensors cross every cut
    trainer = PipelineDPTrainer(
        model,
        seq_loss,
        sgd,
        stages=stages,
        microbatches=3,
        noise_multiplier=0.0,
        max_grad_norm=0.05,
        expected_batch_size=1,
        grad_mode=mode,
    )
    g = torch.Generator().manual_seed(1)
    for n, t in ((9, 6), (4, 3)):  # one trainer, other batch sizes and sequence lengths (padding included)
        x, y = torch.randn(n, t, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (n, t), generator=g)
        want = loop_clipped_sum(copy.deepcopy(model), seq_loss, x, y, 0.05)
        assert max_relative_error(step_update(model, trainer, x, y), want) < 1e-10


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("mode", ["ghost", "materialize"])
def test_two_inputs_a_mask_and_the_embedding_reused_at_the_end(stages, mode):
    torch.manual_seed(0)
    model = MaskedNet().double()
    trainer = PipelineDPTrainer(
        model,
        seq_loss,
        sgd,
        stages=stages,
        microbatches=2,
        noise_multiplier=0.0,
        max_grad_norm=0.1,
        expected_batch_size=1,
        grad_mode=mode,
    )
    assert list(trainer.state_dict()) == list(model.state_dict())  # the model's own names
    g = torch.Generator().manual_seed(2)
    for n, t in ((7, 5), (3, 9)):
        x, y = masked_data(n, t, g)
        want = loop_clipped_sum(copy.deepcopy(model), seq_loss, x, y, 0.1)
        assert max_relative_error(step_update(model, trainer, x, y), want) < 1e-10


def test_the_automatic_split_of_a_skip_model_equals_the_hand_made_one():
    def hand_made(model):
        class Inp(torch.nn.Module):  # the same computation, written as blocks passing tuples
            def __init__(self):
                super().__init__()
                self.inp = model.inp

            def forward(self, x):
                return self.inp(x), x

        class Layer(torch.nn.Module):
            """layers.{i}, under the model's own names (the noise is drawn per parameter name)."""

            def __init__(self, index, layer):
                super().__init__()
                self.index = str(index)
                self.add_module(self.index, layer)

            def forward(self, h, x):
                return getattr(self, self.index)(h), x

        class Out(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.out = model.out

            def forward(self, h, x):
                return self.out(h) + x.mean(-1, keepdim=True)

        blocks = [("", Inp())] + [("layers", Layer(i, layer)) for i, layer in enumerate(model.layers)] + [("", Out())]
        model.pipeline_blocks = lambda: blocks
        return model

    torch.manual_seed(0)
    auto = LoopNet(skip=True).double()
    by_hand = hand_made(copy.deepcopy(auto))
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 4, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (8, 4), generator=g)
    for model in (auto, by_hand):
        PipelineDPTrainer(
            model,
            seq_loss,
            sgd,
            stages=2,
            microbatches=2,
            noise_multiplier=1.0,
            max_grad_norm=0.05,
            expected_batch_size=8,
            seed=3,
        ).step(x, y)
    assert max_relative_error(auto.state_dict(), by_hand.state_dict()) < 1e-12


def test_measured_costs_balance_a_model_with_dict_inputs():
    torch.manual_seed(0)
    model = MaskedNet().double()
    x, _ = masked_data(4, 6, torch.Generator().manual_seed(3))
    trainer = PipelineDPTrainer(
        model, seq_loss, stages=2, microbatches=2, expected_batch_size=4, balance=measured_costs(x, repeats=1)
    )
    report = trainer.partition_report
    assert report.unit == "seconds" and len(report.stage_costs) == 2 and min(report.stage_costs) > 0
    assert sum(report.blocks_per_stage) == len(model_blocks(model))
    trainer.close()


class TwoLayers(torch.nn.Module):
    """Two small layers; each refusal test below gives it the forward it is about."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)


class SharedTwice(torch.nn.Module):
    """One layer called at the start and at the end: its two uses must land on one stage."""

    def __init__(self):
        super().__init__()
        self.shared = torch.nn.Linear(6, 6)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(6, 6) for _ in range(3)])
        self.tail = torch.nn.Linear(6, 6)

    def forward(self, x):
        h = self.shared(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.tail(self.shared(h))


def test_a_module_called_twice_stays_on_one_stage_and_is_exact():
    torch.manual_seed(0)
    model = SharedTwice().double()
    blocks = model_blocks(model)
    holding = [k for k, b in enumerate(blocks) if any(p is model.shared.weight for p in b.module.parameters())]
    assert holding == [0]  # both calls in one block: no cut between them
    g = torch.Generator().manual_seed(4)
    assert (
        class_step_error(
            model, torch.randn(6, 6, generator=g, dtype=torch.float64), torch.randint(0, 6, (6,), generator=g)
        )
        < 1e-10
    )


class LastStep(torch.nn.Module):
    """A recurrent classifier written the usual way: nothing before the LSTM, whose (out, (h, c)) is
    unpacked, so the only cut that sends tensors is after an index into that tuple."""

    def __init__(self, with_state):
        super().__init__()
        from opacus.layers import DPLSTM

        self.with_state = with_state
        self.rnn = DPLSTM(4, 5, batch_first=True)
        self.head = torch.nn.Linear(5, 3)

    def forward(self, x):
        out, (h, c) = self.rnn(x)
        last = out[:, -1]
        return self.head(last + h[0] * c[0] if self.with_state else last)


@pytest.mark.parametrize("with_state", [False, True])
def test_a_cut_after_the_index_into_an_lstm_tuple_is_exact(with_state, monkeypatch):
    from pipedp.split import traced

    torch.manual_seed(0)
    model = LastStep(with_state).double()
    blocks = model_blocks(model)
    assert len(blocks) == 2 and "rnn" in dict(blocks[0].module.named_children())  # the tuple stays on stage 0
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(6, 7, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)
    assert class_step_error(model, x, y) < 1e-10
    # planted: cuts after module calls only (the old rule) find none here: one block, refused on 2 stages
    monkeypatch.setattr(traced, "_ends_indexing_of_a_call", lambda n: False)
    assert len(model_blocks(LastStep(with_state))) == 1
    with pytest.raises(UnsupportedModelError, match="don't know how to split LastStep"):
        PipelineDPTrainer(LastStep(with_state), F.cross_entropy, stages=2, expected_batch_size=2)


def test_what_the_graph_shows_cannot_be_clipped_is_refused_by_name():
    class Functional(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.mid = torch.nn.Embedding(7, 4), torch.nn.Linear(4, 4)

        def forward(self, ids):
            return F.linear(self.mid(self.embed(ids)), self.embed.weight)  # a tied head, read functionally

    with pytest.raises(UnsupportedModelError, match="reads the trainable parameter 'embed.weight' directly"):
        PipelineDPTrainer(Functional(), seq_loss, stages=2, expected_batch_size=2)

    class InPlace(TwoLayers):
        def forward(self, x):
            h = self.a(x)
            h.add_(1.0)  # changes a's captured output (a traced `h += 1` is out of place)
            return self.b(h)

    with pytest.raises(UnsupportedModelError, match="updates the output of layer 'a' in place"):
        PipelineDPTrainer(InPlace(), seq_loss, stages=2, expected_batch_size=2)

    class SizeAtTheEnd(TwoLayers):
        def forward(self, x):
            n = x.shape[-1]  # a Python number made at the start, used at the end: crosses every cut
            return self.b(self.a(x)) / n

    with pytest.raises(UnsupportedModelError, match="tried: pipeline_blocks.*only tensors cross, e.g. a size"):
        PipelineDPTrainer(SizeAtTheEnd(), seq_loss, stages=2, expected_batch_size=2)


def test_a_model_no_cut_can_split_trains_exactly_on_one_stage():
    """A size read at the start and used at the end crosses every cut: one block, the whole forward,
    which one stage runs (it was refused on any stage count)."""

    class SizeAtTheEnd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 6), torch.nn.Linear(6, 3)

        def forward(self, x):
            steps = x.shape[1]
            return self.b(torch.tanh(self.a(x))).sum(1) / steps

    torch.manual_seed(0)
    model = SizeAtTheEnd().double()
    assert len(model_blocks(model)) == 1
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(6, 5, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)

    def ce(o, t):
        return F.cross_entropy(o, t, reduction="none")

    want = loop_clipped_sum(copy.deepcopy(model), ce, x, y, 0.1)
    for mode in ("ghost", "keep"):
        trial = copy.deepcopy(model)
        trainer = PipelineDPTrainer(
            trial,
            ce,
            sgd,
            stages=1,
            microbatches=2,
            grad_mode=mode,
            noise_multiplier=0.0,
            max_grad_norm=0.1,
            expected_batch_size=1,
        )
        assert max_relative_error(step_update(trial, trainer, x, y), want) < 1e-10


def test_the_inputs_of_a_two_input_model_must_be_a_dict_with_its_argument_names():
    torch.manual_seed(0)
    trainer = PipelineDPTrainer(MaskedNet().double(), seq_loss, stages=2, microbatches=2, expected_batch_size=2)
    x, y = masked_data(4, 3, torch.Generator().manual_seed(0))
    with pytest.raises(BatchError, match=r"forward takes \['ids', 'mask'\].*got \['ids'\]"):
        trainer.step({"ids": x["ids"]}, y)
    with pytest.raises(BatchError, match=r"forward takes \['ids', 'mask'\].*got Tensor"):
        trainer.step(x["ids"], y)


class MarkedSkip(torch.nn.Module):
    """pipe_split() marks in a plain module: the cuts go there and nowhere else; x crosses next to h."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)

    def forward(self, x):
        from torch.distributed.pipelining import pipe_split

        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h))
        pipe_split()
        return self.c(h + x)


def test_pipe_split_marks_in_a_plain_module_choose_the_cut_and_several_tensors_cross():
    torch.manual_seed(0)
    model = MarkedSkip().double()
    blocks = model_blocks(model)
    assert len(blocks) == 2  # only the mark: no cut between a and b although one tensor crosses there
    assert {n for n, _ in blocks[0].module.named_parameters()} == {"a.weight", "a.bias", "b.weight", "b.bias"}
    g = torch.Generator().manual_seed(7)
    assert (
        class_step_error(
            model, torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)
        )
        < 1e-10
    )
    import torch.distributed.pipelining._IR as ir

    assert torch.ops.pippy._pipe_split is not None and ir.pipe_split() is None  # the op is restored after tracing


def test_a_mark_that_cannot_be_a_stage_boundary_is_refused_by_name():
    from torch.distributed.pipelining import pipe_split

    class SizeAcross(TwoLayers):
        def forward(self, x):
            n = x.shape[-1]
            h = self.a(x)
            pipe_split()
            return self.b(h) / n

    with pytest.raises(UnsupportedModelError, match="pipe_split\\(\\) mark 1: a non-tensor value"):
        PipelineDPTrainer(SizeAcross(), seq_loss, stages=2, expected_batch_size=2)

    class SharedAcross(TwoLayers):
        def forward(self, x):
            h = self.a(x)
            pipe_split()
            return self.a(self.b(h))

    with pytest.raises(UnsupportedModelError, match="mark 1 falls between two uses of one layer's weights"):
        PipelineDPTrainer(SharedAcross(), seq_loss, stages=2, expected_batch_size=2)


def tied_batch(generator):
    ids = torch.randint(0, 11, (5, 6), generator=generator)
    return {"input_ids": ids, "mask": torch.ones_like(ids)}, torch.randint(0, 11, (5, 6), generator=generator)


@pytest.mark.parametrize("stages", [2, 3])
def test_a_plain_model_with_its_head_tied_to_its_embedding_is_exact_across_stages(stages):
    from loop_models import TiedLM

    torch.manual_seed(0)
    model = TiedLM().double()
    x, y = tied_batch(torch.Generator().manual_seed(1))
    want = loop_clipped_sum(copy.deepcopy(model), seq_loss, x, y, 0.1)
    trainer = PipelineDPTrainer(
        model,
        seq_loss,
        sgd,
        stages=stages,
        microbatches=2,
        noise_multiplier=0.0,
        max_grad_norm=0.1,
        expected_batch_size=1,
    )
    assert max_relative_error(step_update(model, trainer, x, y), want) < 1e-10


def test_a_tie_the_cross_term_cannot_follow_is_refused_by_name():
    from loop_models import TiedLM

    x, y = tied_batch(torch.Generator().manual_seed(1))
    shifted = PipelineDPTrainer(TiedLM(shift=3).double(), seq_loss, stages=2, microbatches=2, expected_batch_size=5)
    with pytest.raises(UnsupportedModelError, match="tied embedding 'embed' must read the micro-batch's token ids"):
        shifted.step(x, y)

    class TiedByIds(TiedLM):
        def forward(self, ids, mask):  # the ids under another name than input_ids
            return super().forward(ids, mask)

    renamed = PipelineDPTrainer(TiedByIds().double(), seq_loss, stages=2, microbatches=2, expected_batch_size=5)
    with pytest.raises(UnsupportedModelError, match=r"needs the token ids as inputs\['input_ids'\]"):
        renamed.step({"ids": x["input_ids"], "mask": x["mask"]}, y)
