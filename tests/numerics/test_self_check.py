"""The self-check verifies instead of guessing (issue #21): every class of model that pipedp used to get
silently wrong is refused, naming the layer and the cause; the models it refused though they were fine
are exact against the loop oracle; and a planted bug in pipedp's own per-sample arithmetic is caught."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from opacus.layers import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention
from oracles import loop_clipped_sum, max_relative_error
from steps import class_loss, pipedp_clipped_sum, seq_loss

from pipedp import PipelineDPTrainer, UnsupportedModelError
from pipedp.privacy import rules
from pipedp.privacy.rules import linear


def step(model, loss, x, y, clip=0.5, **kw):
    return pipedp_clipped_sum(model, loss, x, y, clip, **{"stages": 2, "microbatches": 1, **kw})


class Attention(nn.Module):
    """Opacus's DPMultiheadAttention; ``time_first``: fed [T, batch, d] as batch_first=False expects."""

    def __init__(self, d=8, time_first=False, bias=True):
        super().__init__()
        self.time_first = time_first
        self.att = DPMultiheadAttention(d, 2, bias=bias, batch_first=not time_first)

    def forward(self, x):
        h = x.transpose(0, 1) if self.time_first else x
        out = self.att(h, h, h, need_weights=False)[0]
        return out.transpose(0, 1) if self.time_first else out


class TransposedLinear(nn.Module):
    """A Linear that mixes positions: applied over the transposed [batch, d, T] view, its input's first
    dimension is the batch but its per-sample gradient is not what the capture sees along T."""

    def __init__(self, t):
        super().__init__()
        self.mix = nn.Linear(t, t)

    def forward(self, x):  # [n, T, d] -> mixes the T positions of each sample: fine
        return self.mix(x.transpose(1, 2)).transpose(1, 2)


class TimeMajorLinear(nn.Module):
    """A Linear over a [T, n, d] view: its input's first dimension is time."""

    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return self.fc(x.transpose(0, 1).contiguous()).transpose(0, 1)


class MixSamples(nn.Module):
    """No parameters, but it mixes samples (subtracts the batch mean): no per-sample gradient exists."""

    def forward(self, x):
        return x - x.mean(0, keepdim=True)


def time_first_model(kind, d=8):
    torch.manual_seed(0)
    middle = {"attention": Attention(d, time_first=True), "linear": TimeMajorLinear(d), "mix": MixSamples()}[kind]
    return nn.Sequential(nn.Linear(d, d), middle, nn.Linear(d, 5)).double()


@pytest.mark.parametrize("kind", ["attention", "linear", "mix"])
@pytest.mark.parametrize("stages", [1, 2])
def test_a_layer_that_does_not_see_the_batch_first_is_refused_when_its_time_equals_the_batch(kind, stages):
    """T == micro-batch size: the hook's shape check cannot see it (it refuses T != n); the self-check does
    (a parameter-free mixing already in the forward: each sample alone gives other outputs)."""
    x, y = torch.randn(4, 4, 8, dtype=torch.float64), torch.randint(0, 5, (4, 4))
    message = "its forward mixes samples" if kind == "mix" else "wrong though their sum over the micro-batch is right"
    with pytest.raises(UnsupportedModelError, match=message):
        step(time_first_model(kind), seq_loss, x, y, stages=stages)


def test_without_the_self_check_that_model_is_silently_wrong():
    """The check is what protects: switched off, the time-first model trains, off the loop oracle."""
    x, y = torch.randn(4, 4, 8, dtype=torch.float64), torch.randint(0, 5, (4, 4))
    model = time_first_model("attention")
    want = loop_clipped_sum(copy.deepcopy(model), seq_loss, x, y, 0.5)
    got = step(model, seq_loss, x, y, self_check=False)
    assert max_relative_error(got, want) > 1e-2


def test_a_time_first_layer_is_refused_by_name_when_its_time_differs_from_the_batch():
    x, y = torch.randn(4, 6, 8, dtype=torch.float64), torch.randint(0, 5, (4, 6))
    with pytest.raises(UnsupportedModelError, match=r"layer '1.fc' .*batch_first=True"):
        step(time_first_model("linear"), seq_loss, x, y)


def test_a_planted_bug_in_a_layer_rule_is_caught(monkeypatch):
    """pipedp's own per-sample gradients of Linear made 10% too large: the check refuses, naming them."""
    wrong = rules.LayerRule("linear", lambda *a: {p: 1.1 * g for p, g in linear.grads(*a).items()}, linear.weight)
    monkeypatch.setitem(rules.RULES, nn.Linear, wrong)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = torch.randn(6, 6, dtype=torch.float64), torch.randint(0, 3, (6,))
    with pytest.raises(UnsupportedModelError, match="per-sample norms of .*weight.* disagree"):
        step(model, class_loss, x, y, grad_mode="materialize")


def test_a_planted_bug_in_a_ghost_norm_is_caught(monkeypatch):
    wrong = rules.LayerRule(
        "linear",
        linear.grads,
        linear.weight,
        lambda *a: {p: 0.8 * v for p, v in (linear.norms(*a) or {}).items()},
        linear.keepable,
    )
    monkeypatch.setitem(rules.RULES, nn.Linear, wrong)
    torch.manual_seed(0)  # wide layers over 3 positions: ghost norms, not kept per-sample gradients
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)).double()
    x, y = torch.randn(5, 3, 32, dtype=torch.float64), torch.randint(0, 3, (5, 3))
    with pytest.raises(UnsupportedModelError, match="norm rule of layer"):
        step(model, seq_loss, x, y, grad_mode="ghost")


def test_a_buffer_the_forward_changes_is_refused_by_name():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.register_buffer("seen", torch.zeros(8))

        def forward(self, x):
            self.seen += x.detach().mean(0)  # a statistic of the private batch
            return self.fc(x)

    torch.manual_seed(0)
    model = nn.Sequential(Counter(), nn.Tanh(), nn.Linear(8, 4)).double()
    x, y = torch.randn(6, 8, dtype=torch.float64), torch.randint(0, 4, (6,))
    with pytest.raises(UnsupportedModelError, match=r"changes the buffers \['0.seen'\]"):
        step(model, class_loss, x, y)


def test_an_embedding_with_max_norm_is_refused_at_construction():
    model = nn.Sequential(nn.Embedding(6, 4, max_norm=0.5), nn.Flatten(), nn.Linear(12, 3)).double()
    with pytest.raises(UnsupportedModelError, match=r"layer '0' is Embedding\(max_norm=0.5\).*use max_norm=None"):
        step(model, class_loss, torch.zeros(4, 3, dtype=torch.long), torch.zeros(4, dtype=torch.long))


@pytest.mark.parametrize("bag", [False, True])
def test_an_embedding_scaling_gradients_by_batch_frequency_is_refused_at_construction(bag, monkeypatch):
    """The batch's id counts couple the samples. Planted away, the check lets a step run whose clipped
    sum is off the loop oracle with the self-check off."""
    torch.manual_seed(0)
    if bag:
        model = nn.Sequential(nn.EmbeddingBag(6, 4, mode="sum", scale_grad_by_freq=True), nn.Linear(4, 3))
    else:
        model = nn.Sequential(nn.Embedding(6, 4, scale_grad_by_freq=True), nn.Flatten(), nn.Linear(12, 3))
    model = model.double()
    x, y = torch.tensor([[0, 1, 1], [3, 0, 0], [4, 5, 1], [0, 0, 1]]), torch.tensor([0, 1, 2, 1])
    kind = "EmbeddingBag" if bag else "Embedding"
    with pytest.raises(UnsupportedModelError, match=rf"layer '0' is {kind}\(scale_grad_by_freq=True\)"):
        step(copy.deepcopy(model), class_loss, x, y)
    monkeypatch.setattr("pipedp.train.prepare.validate_model", lambda model: None)
    want = loop_clipped_sum(copy.deepcopy(model), class_loss, x, y, 0.5)
    got = step(model, class_loss, x, y, self_check=False)
    assert max_relative_error(got, want) > 1e-3


@pytest.mark.parametrize("self_check", [True, False])
def test_a_forward_that_changes_a_parameter_in_place_is_refused_by_name(self_check, monkeypatch):
    """max_norm renormalizes, in place and un-noised, the rows the private batch reads. With the
    construction check planted away, the forward's own check refuses it on every step's first
    micro-batch, self-check or not."""
    monkeypatch.setattr("pipedp.train.prepare.validate_model", lambda model: None)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(6, 4, max_norm=0.5), nn.Flatten(), nn.Linear(12, 3)).double()
    x, y = torch.tensor([[0, 1, 2], [3, 0, 0], [4, 5, 1], [0, 0, 0]]), torch.tensor([0, 1, 2, 1])
    with pytest.raises(UnsupportedModelError, match=r"changes the parameters \['0.weight'\] in place .*max_norm=None"):
        step(model, class_loss, x, y, self_check=self_check)


def test_a_parameter_changed_in_place_on_a_later_step_is_refused():
    class Drifting(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.calls = nn.Linear(4, 4), 0

        def forward(self, x):
            self.calls += self.training  # (the self-check's evaluations run in eval mode)
            if self.calls > 2:  # not on the first (self-checked) step's 2 micro-batches
                with torch.no_grad():
                    self.fc.weight.mul_(1.0 + x.detach().abs().mean())
            return self.fc(x)

    torch.manual_seed(0)
    model = nn.Sequential(Drifting(), nn.Tanh(), nn.Linear(4, 3)).double()
    trainer = PipelineDPTrainer(
        model,
        class_loss,
        lambda p: torch.optim.SGD(p, lr=0.1),
        stages=2,
        microbatches=2,
        noise_multiplier=0.0,
        max_grad_norm=1.0,
        expected_batch_size=4,
        sampling="poisson",
        sample_rate=0.1,
    )
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randint(0, 3, (4,))
    trainer.step(x, y)
    with pytest.raises(UnsupportedModelError, match=r"changes the parameters \['0.fc.weight'\]"):
        trainer.step(x, y)


def test_instance_norm_with_running_statistics_is_refused_at_construction():
    model = nn.Sequential(nn.Linear(4, 8), nn.InstanceNorm1d(8, track_running_stats=True), nn.Linear(8, 3))
    with pytest.raises(UnsupportedModelError, match=r"layer '1' is InstanceNorm1d\(track_running_stats=True\)"):
        PipelineDPTrainer(model, class_loss, stages=1, expected_batch_size=4)


def test_a_custom_autograd_function_is_refused_naming_the_layer():
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x * w

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g * w, (g * x).sum(0)

    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return Square.apply(x, self.w)

    model = nn.Sequential(Custom(), nn.Linear(4, 3)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    with pytest.raises(UnsupportedModelError, match=r"layer '0' \(Custom\).*custom torch.autograd.Function"):
        step(model, class_loss, x, y)


def test_the_check_runs_again_for_a_new_input_shape():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 5)).double()
    trainer = PipelineDPTrainer(model, seq_loss, stages=2, expected_batch_size=4, noise_multiplier=0.0)
    for t in (3, 3, 5):
        trainer.step(torch.randn(4, t, 8, dtype=torch.float64), torch.randint(0, 5, (4, t)))
    assert all(len(stage.check.checked) == 2 for stage in trainer.runtime.local_stages)


# ---- refused before, exact now ----------------------------------------------------------------------
def attention_model(bias):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), Attention(8, bias=bias), nn.Tanh(), nn.Linear(8, 5)).double()


class Recurrent(nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.rnn = cell(6, 5, batch_first=True)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        out, _ = self.rnn(torch.tanh(self.inp(x)))
        return self.head(out[:, -1])


class Bag(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 6, mode=mode, padding_idx=0)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.bag(ids))))


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_dp_multihead_attention_with_its_key_bias_matches_the_loop_oracle(mode, stages):
    """The key bias's gradient is zero in theory and ~1e-16 in practice: not a mismatch."""
    model = attention_model(bias=True)
    x, y = torch.randn(7, 5, 8, dtype=torch.float64), torch.randint(0, 5, (7, 5))
    want = loop_clipped_sum(copy.deepcopy(model), seq_loss, x, y, 0.5)
    got = step(model, seq_loss, x, y, stages=stages, microbatches=2, grad_mode=mode)
    assert max_relative_error(got, want) < 1e-10


@pytest.mark.parametrize("cell", [DPLSTM, DPGRU, DPRNN])
@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("mode", ["ghost", "materialize"])
def test_opacus_recurrent_layers_match_the_loop_oracle(cell, stages, mode):
    torch.manual_seed(0)
    model = Recurrent(cell).double()
    x, y = torch.randn(6, 7, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    want = loop_clipped_sum(copy.deepcopy(model), class_loss, x, y, 0.5)
    got = step(model, class_loss, x, y, stages=stages, microbatches=2, grad_mode=mode)
    assert max_relative_error(got, want) < 1e-10


@pytest.mark.parametrize("bag_mode", ["sum", "mean"])
@pytest.mark.parametrize("mode", ["ghost", "materialize"])
@pytest.mark.parametrize("stages", [1, 2])
def test_embedding_bag_over_rows_of_ids_matches_the_loop_oracle(bag_mode, mode, stages):
    torch.manual_seed(0)
    model = Bag(bag_mode).double()
    ids = torch.randint(0, 20, (7, 5))
    ids[0, :2] = 0  # padding ids count for nothing
    ids[1, :] = 3  # one id several times in a bag
    y = torch.randint(0, 3, (7,))
    want = loop_clipped_sum(copy.deepcopy(model), class_loss, ids, y, 0.5)
    got = step(model, class_loss, ids, y, stages=stages, microbatches=2, grad_mode=mode)
    assert max_relative_error(got, want) < 1e-10


def test_an_embedding_bag_with_offsets_is_refused_naming_the_way_out():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.bag = nn.EmbeddingBag(20, 6)
            self.head = nn.Linear(6, 3)

        def forward(self, ids):
            n = ids.shape[0]
            return self.head(self.bag(ids.reshape(-1), torch.arange(0, ids.numel(), ids.shape[1])[:n]))

    model = nn.Sequential(Flat()).double()
    ids, y = torch.randint(0, 20, (4, 4)), torch.randint(0, 3, (4,))
    with pytest.raises(UnsupportedModelError, match="EmbeddingBag|micro-batch dimension"):
        step(model, class_loss, ids, y, stages=1)


class WithDefaults(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x, scale=2.0, extra=None, unused_kwarg=None):
        h = torch.tanh(self.a(x)) * scale
        if extra is not None:
            h = h + extra
        return self.c(torch.tanh(self.b(h)))


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_forward_arguments_with_a_default_keep_it_in_the_automatic_split(stages):
    torch.manual_seed(0)
    model = WithDefaults().double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    want = loop_clipped_sum(copy.deepcopy(model), class_loss, x, y, 0.5)
    got = step(model, class_loss, x, y, stages=stages, microbatches=2)
    assert max_relative_error(got, want) < 1e-10


# ---- bf16 weights --------------------------------------------------------------------------------
def bf16_loop_error(model, loss, x, y, clip):
    """How far a single-device bf16 loop of batch-size-1 passes, its sum then applied to the bf16 weights
    (as SGD does), lands from the float64 clipped sum."""
    exact = loop_clipped_sum(copy.deepcopy(model).double(), loss, x, y, clip)
    rough_model = copy.deepcopy(model).bfloat16()
    rough = loop_clipped_sum(rough_model, loss, x, y, clip)
    weights = dict(rough_model.named_parameters())
    change = {k: weights[k].double() - (weights[k].float() - g.float()).bfloat16().double() for k, g in rough.items()}
    return max_relative_error(change, exact), exact


@pytest.mark.parametrize("precision", ["32", "bf16-true"])
def test_bf16_weights_are_accepted_and_as_close_as_a_bf16_loop(precision):
    """A model loaded in bf16 trains at the default precision (the check's tolerance follows the dtype)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(40, 32), nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 40))
    x, y = torch.randint(0, 40, (10, 6)), torch.randint(0, 40, (10, 6))
    loop_error, exact = bf16_loop_error(model, seq_loss, x, y, 0.5)
    got = step(model.bfloat16(), seq_loss, x, y, stages=2, microbatches=2, precision=precision)
    assert max_relative_error(got, exact) < 2 * loop_error


class PreNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.fc, self.out = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.out(F.gelu(self.fc(self.ln2(x + self.ln1(x)))))


def test_a_bf16_pre_norm_transformer_with_layer_norms_is_accepted():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 256), *[PreNorm(256) for _ in range(4)], nn.Linear(256, 5)).bfloat16()
    x, y = torch.randn(8, 12, 16).bfloat16(), torch.randint(0, 5, (8, 12))
    step(model, seq_loss, x, y, stages=2, microbatches=2, precision="bf16-true")  # the check passes


# ---- state_dict and load_stage are whole -----------------------------------------------------------
class Orphans(nn.Module):
    """A layer defined but never called, and a root buffer read before the first layer."""

    def __init__(self):
        super().__init__()
        self.a, self.never, self.b, self.c = nn.Linear(4, 8), nn.Linear(3, 3), nn.Linear(8, 8), nn.Linear(8, 3)
        self.register_buffer("offset", torch.linspace(-1, 1, 4))

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x + self.offset)))))


def test_state_dict_round_trips_a_model_with_an_unused_layer_and_a_root_buffer():
    torch.manual_seed(0)
    model = Orphans().double()
    trainer = PipelineDPTrainer(model, class_loss, stages=2, expected_batch_size=4, noise_multiplier=0.0)
    trainer.step(torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,)))
    state = trainer.state_dict()
    fresh = Orphans().double()
    fresh.load_state_dict(state)  # strict: every key, no extra
    assert torch.equal(fresh.a.weight, model.a.weight) and torch.equal(fresh.never.weight, model.never.weight)


@pytest.mark.parametrize("stage", [0, 1])
def test_load_stage_materializes_root_buffers_and_unused_layers(tmp_path, stage):
    from safetensors.torch import save_model

    import pipedp

    torch.manual_seed(0)
    whole = Orphans().double()
    save_model(whole, str(tmp_path / "w.safetensors"))
    model = Orphans().double().to("meta")  # (every tensor on meta, whatever device context a test left)
    pipedp.load_stage(model, str(tmp_path / "w.safetensors"), stages=2, stage=stage)
    assert not model.never.weight.is_meta  # held by no stage: loaded on every one
    assert model.offset.is_meta == (stage != 0)  # read by the first piece only
    if stage == 0:
        assert torch.equal(model.offset, whole.offset) and torch.equal(model.a.weight, whole.a.weight)
