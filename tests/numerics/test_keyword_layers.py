"""Layers owning parameters, called with keyword arguments and returning tuples (an attention owning its sinks, a
decoder layer owning its residual scales): their rule replays them per sample with the call's keyword arguments
(runtime/capture.py ``Keywords``), against the loop oracle; what it cannot replay exactly is refused by name."""

import copy

import pytest
import torch
import torch.nn as nn
from oracles import loop_clipped_sum, loop_unit_clipped_sum, max_relative_error
from steps import class_loss, pipedp_clipped_sum

from pipedp import PipelineDPTrainer, UnsupportedModelError


class Gate(nn.Module):
    """Owns a parameter besides its child Linear; takes a per-sample mask, a tensor shared by the batch, a pair
    (one per-sample tensor, one shared), None and a flag by keyword; returns (output, a second tensor)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, dtype=torch.float64))
        self.inner = nn.Linear(8, 8, dtype=torch.float64)

    def forward(self, x, *, mask, scale, pair, nothing=None, flag=True):
        a, b = pair
        h = self.inner(x) * self.w * scale + (a * b if flag else 0) + (0 if nothing is None else nothing)
        h = h * mask[:, None]
        return torch.tanh(h), h.sum(-1)


class GateBlock(nn.Module):
    """Calls its Gate with keyword arguments: ``computed``, a tensor shared by the batch computed in the forward
    (else a buffer), its entries all equal with ``constant``; ``second``, the Gate's second output reaches the loss
    too."""

    def __init__(self, computed: bool = False, second: bool = False, constant: bool = False):
        super().__init__()
        self.gate = Gate()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8, dtype=torch.float64))
        self.register_buffer("cos", self.scale.cos())
        self.computed, self.second, self.constant = computed, second, constant

    def forward(self, h):
        mask = (h[:, 0] > -0.5).double() + 0.5
        shared = self.scale.cos() if self.computed else self.cos
        shared = shared * 0 + 0.7 if self.constant else shared
        out, total = self.gate(h, mask=mask, scale=self.scale, pair=(h.sin(), shared), nothing=None)
        return out + total[:, None] if self.second else out


def model(computed: bool = False, second: bool = False, constant: bool = False):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), GateBlock(computed, second, constant), nn.Linear(8, 4)).double()


def data(rows: int):
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, 8, generator=g, dtype=torch.float64), torch.randint(0, 4, (rows,), generator=g)


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
@pytest.mark.parametrize("stages", [1, 2])
def test_a_layer_called_with_keyword_arguments_matches_the_loop(stages, mode):
    x, y = data(6)
    net = model()
    want = loop_clipped_sum(copy.deepcopy(net), class_loss, x, y, 0.3)
    got = pipedp_clipped_sum(net, class_loss, x, y, 0.3, stages=stages, microbatches=2, grad_mode=mode)
    assert max_relative_error(got, want) < 1e-12
    assert float(got["1.gate.w"].abs().max()) > 0


def test_keyword_layers_with_units_of_two_rows():
    x, y = data(8)
    net = model()
    want = loop_unit_clipped_sum(copy.deepcopy(net), class_loss, x, y, 0.3, rows=2)
    got = pipedp_clipped_sum(net, class_loss, x, y, 0.3, stages=2, microbatches=2, unit_rows=2)
    assert max_relative_error(got, want) < 1e-12


@pytest.mark.parametrize("self_check", [True, False])
def test_planted_a_shared_keyword_tensor_the_size_of_the_micro_batch_is_refused_at_its_first_call(self_check):
    """A shared tensor computed in the forward with 8 entries: with micro-batches of 8 rows it looks per-sample and
    would be replayed one entry per sample, a wrong per-sample gradient whose sum is right. Where it is first taken
    as per-sample, the layer replayed on a sample's rows alone is compared with the whole call's rows, and refused
    naming the argument, whether or not the self-check runs; a buffer of the model with 8 entries is shared whatever
    the micro-batch's size (exact)."""
    x, y = data(16)
    with pytest.raises(
        UnsupportedModelError, match=r"was given argument\(s\) .*'pair'\]\[1\]\"\] with the micro-batch's size \(8\)"
    ):
        pipedp_clipped_sum(model(computed=True), class_loss, x, y, 0.3, stages=1, microbatches=2, self_check=self_check)
    for computed, rows in ((False, 16), (True, 12)):  # a buffer; the computed one without the coincidence
        x, y = data(rows)
        net = model(computed)
        want = loop_clipped_sum(copy.deepcopy(net), class_loss, x, y, 0.3)
        got = pipedp_clipped_sum(net, class_loss, x, y, 0.3, stages=1, microbatches=2)
        assert max_relative_error(got, want) < 1e-12, computed


class Mix(nn.Module):
    """Owns a scale; multiplies its input by a matrix passed by keyword."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(8, dtype=torch.float64))

    def forward(self, x, *, m):
        return (x @ m) * self.w


class MixBlock(nn.Module):
    """Passes its Mix an [8, 8] matrix computed in the forward: shared by the batch, 8 rows like its micro-batch."""

    def __init__(self):
        super().__init__()
        self.mix = Mix()
        self.register_buffer("base", torch.linspace(0.5, 1.5, 64, dtype=torch.float64).reshape(8, 8))

    def forward(self, h):
        return self.mix(h, m=self.base.cos())


def test_planted_a_shared_keyword_matrix_the_size_of_the_micro_batch_is_refused_by_name_not_a_shape_error():
    """Sliced to one row per sample, the shared matrix no longer fits the product it enters: the replay's own
    error becomes the named refusal."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), MixBlock(), nn.Linear(8, 4)).double()
    with pytest.raises(UnsupportedModelError, match=r"was given argument\(s\) \[\"\['m'\]\"\] with the micro-batch"):
        pipedp_clipped_sum(net, class_loss, *data(16), 0.3, stages=1, microbatches=2, self_check=False)


def test_a_keyword_tensor_taken_per_sample_then_shared_is_refused_by_name():
    """A shared tensor of 8 equal entries with micro-batches of 8 rows: taken as per-sample, which replays each
    sample exactly (its one entry equals all of them), so the first step passes its check; a later call where that
    tensor is not the micro-batch's size shows it was shared, and is refused naming the argument."""
    trainer = PipelineDPTrainer(
        model(computed=True, constant=True), class_loss, stages=1, microbatches=2, expected_batch_size=8,
        self_check=False,
    )  # fmt: skip
    trainer.step(*data(16))
    with pytest.raises(UnsupportedModelError, match=r"keyword argument \['pair'\]\[1\] with the micro-batch's size"):
        trainer.step(*data(12))


def test_dropped_rows_keep_their_keyword_masks():
    """A padding row (clip factor 0) has its positional inputs zeroed in W; its keyword tensors keep their values
    (only non-finite ones zeroed): a 0/1 mask read through its logarithm stays finite where it was."""

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, dtype=torch.float64))

        def forward(self, x, *, keep):
            return (x * self.w + keep.log()).softmax(-1)

    class MaskedBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.masked = Masked()

        def forward(self, h):
            keep = torch.ones_like(h)
            keep[:, 4:] = 0
            return self.masked(h, keep=keep)

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), MaskedBlock(), nn.Linear(8, 4)).double()
    x, y = data(5)  # micro-batches of 3 and 2: one padding row
    want = loop_clipped_sum(copy.deepcopy(net), class_loss, x, y, 0.3)
    got = pipedp_clipped_sum(net, class_loss, x, y, 0.3, stages=1, microbatches=2)
    assert max_relative_error(got, want) < 1e-12


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
def test_a_second_output_reaching_the_loss_is_joined_to_the_first_and_matches_the_loop(mode):
    """The Gate's second output reaches the loss: the capture joins it to the first (both flattened per sample,
    side by side, their gradients alike), so the replay gives the Gate's parameters the gradient of both."""
    x, y = data(6)
    net = model(second=True)
    want = loop_clipped_sum(copy.deepcopy(net), class_loss, x, y, 0.3)
    got = pipedp_clipped_sum(net, class_loss, x, y, 0.3, stages=2, microbatches=2, grad_mode=mode)
    assert max_relative_error(got, want) < 1e-12
    alone = pipedp_clipped_sum(model(), class_loss, x, y, 0.3, stages=2, microbatches=2, grad_mode=mode)
    assert max_relative_error(alone, got) > 1e-3  # (the second output's share is seen)


def test_planted_a_joined_output_s_gradient_misread_is_caught_by_the_self_check(monkeypatch):
    """The joined outputs' gradient scaled (planted in the capture's join): each sample's gradient wrong, refused by
    the self-check at the first step."""
    from pipedp.runtime.capture import LayerCall

    real = LayerCall.backprop
    monkeypatch.setattr(LayerCall, "backprop", lambda self, g, more=(): real(self, g, tuple(2 * m for m in more)))
    with pytest.raises(UnsupportedModelError, match=r"the gradient of 1.gate.w is not all seen by per-sample clipping"):
        pipedp_clipped_sum(model(second=True), class_loss, *data(6), 0.3, stages=1)


class Pair(nn.Module):
    """Returns (out, (aux,)): ``use`` adds aux into the output, ``scale`` halves it in place first, ``whole`` sums it
    over the batch (one value for all samples)."""

    def __init__(self, use: bool, scale: bool, whole: bool = False):
        super().__init__()
        self.pair = Gate()
        self.use, self.scale, self.whole = use, scale, whole

    def forward(self, h):
        out, aux = self.pair(h, mask=torch.ones_like(h[:, 0]), scale=1.0, pair=(h, h))
        nested = (out, (aux.sum(0, keepdim=True) if self.whole else aux,))
        if self.scale:
            nested[1][0].mul_(0.5)
        return nested[0] + nested[1][0][:, None] if self.use else nested[0]


class Whole(nn.Module):
    """Returns (out, its rows summed over the batch)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, dtype=torch.float64))

    def forward(self, x, *, shift):
        out = x * self.w + shift
        return out, out.sum(0)


class WholeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.whole = Whole()

    def forward(self, h):
        out, total = self.whole(h, shift=torch.zeros_like(h))
        return out + total


@pytest.mark.parametrize("use", [False, True], ids=["unused", "used"])
def test_a_nested_second_output_is_joined_where_used_and_refused_where_changed_in_place(use):
    x, y = data(6)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), Pair(use=use, scale=False), nn.Linear(8, 4)).double()
    want = loop_clipped_sum(copy.deepcopy(net), class_loss, x, y, 0.3)
    got = pipedp_clipped_sum(net, class_loss, x, y, 0.3, stages=1)
    assert max_relative_error(got, want) < 1e-12
    torch.manual_seed(0)  # planted: its values before the change may have reached the loss (unseen by its gradient)
    changed = nn.Sequential(nn.Linear(8, 8), Pair(use=use, scale=True), nn.Linear(8, 4)).double()
    with pytest.raises(UnsupportedModelError, match=r"layer '1.pair' returns a tuple whose element 1 was changed in"):
        pipedp_clipped_sum(changed, class_loss, x, y, 0.3, stages=1)


@pytest.mark.parametrize("self_check", [True, False])
def test_planted_a_second_output_summed_over_the_batch_reaching_the_loss_is_refused_by_name(self_check):
    """A second output that is one value for the whole batch (it mixes the samples) cannot be split per sample:
    refused by name (the self-check's forward comparison, when on, sees the mixing first)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), WholeBlock(), nn.Linear(8, 4)).double()
    named = r"layer '1.whole' returns a tuple whose element 1 reaches the loss and is not batch-first \(\(8,\)"
    with pytest.raises(UnsupportedModelError, match="its forward mixes samples" if self_check else named):
        pipedp_clipped_sum(net, class_loss, *data(6), 0.3, stages=1, self_check=self_check)


class Late(nn.Module):
    """Gives its Gate a keyword tensor and then changes it in place (``write``), or gives it one carrying a gradient
    shared by the batch (``trained``)."""

    def __init__(self, write: bool):
        super().__init__()
        self.gate = Gate()
        self.bias = nn.Parameter(torch.ones(8, dtype=torch.float64))
        self.write = write

    def forward(self, h):
        shift = torch.zeros(8, dtype=torch.float64)  # (added: autograd saves nothing of it)
        scale = torch.ones(8, dtype=torch.float64) if self.write else self.bias * 2
        out, _ = self.gate(h, mask=torch.ones_like(h[:, 0]), scale=scale, pair=(h, h), nothing=shift)
        if self.write:
            shift.add_(2.0)
        return out


@pytest.mark.parametrize(
    "write, match",
    [
        (True, r"was given argument \['nothing'\] and it was changed in place after the call"),
        (False, r"shared by the batch that carries a gradient \(\['scale'\]\)"),
    ],
)
def test_a_keyword_tensor_written_after_the_call_or_carrying_a_gradient_is_refused_by_name(write, match):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), Late(write), nn.Linear(8, 4)).double()
    with pytest.raises(UnsupportedModelError, match=match):
        pipedp_clipped_sum(net, class_loss, *data(6), 0.3, stages=1)


def test_a_keyword_argument_holding_an_object_is_refused_by_name():
    class Box:
        def __init__(self, t):
            self.t = t

    class Boxed(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(8, dtype=torch.float64))

        def forward(self, x, *, box):
            return x * self.w * box.t

    class BoxBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.boxed = Boxed()

        def forward(self, h):
            return self.boxed(h, box=Box(h))

    x, y = data(6)
    with pytest.raises(UnsupportedModelError, match=r"layer '1.boxed' \(Boxed\) was given an argument holding a Box"):
        net = nn.Sequential(nn.Linear(8, 8), BoxBlock(), nn.Linear(8, 4)).double()
        pipedp_clipped_sum(net, class_loss, x, y, 0.3, stages=1)


def test_a_keyword_tensor_seen_shared_then_with_the_micro_batch_first_is_refused_by_name():
    """Positions given as [1, T] at one call and as [batch, T] at a later one: shared once, it cannot become
    per-sample (nor be broadcast against one sample's row), so the later call is refused, naming the argument."""

    class Switching(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = Gate()
            self.per_row = False

        def forward(self, h):
            scale = torch.ones(h.shape[0] if self.per_row else 1, 8, dtype=torch.float64)
            out, _ = self.gate(h, mask=torch.ones_like(h[:, 0]), scale=scale, pair=(h, h))
            return out

    torch.manual_seed(0)
    block = Switching()
    trainer = PipelineDPTrainer(
        nn.Sequential(nn.Linear(8, 8), block, nn.Linear(8, 4)).double(), class_loss, stages=1, expected_batch_size=6
    )
    trainer.step(*data(6))
    block.per_row = True
    with pytest.raises(UnsupportedModelError, match=r"keyword argument \['scale'\] shared by the batch at an earlier"):
        trainer.step(*data(6))


class Window(nn.Module):
    """Owns a scale; called positionally as a compressor is, ``(x, positions, cache, index, gate)``: positions
    shared by the batch ([1, 8], or [8] with ``flat``), None, a number, then a per-sample gate."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, dtype=torch.float64))

    def forward(self, x, positions, cache, index, gate):
        assert cache is None and index == 3
        return torch.tanh(x * self.w + positions.cos()) * gate


class WindowBlock(nn.Module):
    def __init__(self, flat: bool = False):
        super().__init__()
        self.window = Window()
        self.flat = flat

    def forward(self, h):
        positions = torch.arange(8, dtype=torch.float64)
        return self.window(h, positions if self.flat else positions[None], None, 3, h.sigmoid())


def test_a_layer_called_with_shared_and_plain_positional_arguments_matches_the_loop():
    """Positional arguments after the batch-first inputs (shared positions, None, a number, a per-sample tensor)
    are kept for the replay as keyword arguments are."""
    x, y = data(6)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), WindowBlock(), nn.Linear(8, 4)).double()
    want = loop_clipped_sum(copy.deepcopy(net), class_loss, x, y, 0.3)
    got = pipedp_clipped_sum(net, class_loss, x, y, 0.3, stages=2, microbatches=2)
    assert max_relative_error(got, want) < 1e-12
    assert float(got["1.window.w"].abs().max()) > 0


def test_planted_a_shared_positional_tensor_the_size_of_the_micro_batch_is_refused_by_name():
    """Positions [8] with micro-batches of 8 rows look per-sample: refused where first taken so, as for keywords."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), WindowBlock(flat=True), nn.Linear(8, 4)).double()
    with pytest.raises(
        UnsupportedModelError,
        match=r"was given argument\(s\) \['positional argument 1', 'positional argument 4'\] with the",
    ):
        pipedp_clipped_sum(net, class_loss, *data(16), 0.3, stages=1, microbatches=2, self_check=False)


class Twice(nn.Module):
    """Returns (out, 2 out): its second output computed from its first (``dead``: a first output that carries no
    gradient, the second one does)."""

    def __init__(self, dead: bool = False):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, dtype=torch.float64))
        self.dead = dead

    def forward(self, x, *, shift):
        out = torch.tanh(x * self.w + shift)
        return (out.argmax(-1) if self.dead else out), 2 * out


class TwiceBlock(nn.Module):
    def __init__(self, dead: bool = False):
        super().__init__()
        self.twice = Twice(dead)

    def forward(self, h):
        out, double = self.twice(h, shift=torch.zeros_like(h))
        return double * 0.5 if self.twice.dead else out.cos() + double.sin()


@pytest.mark.parametrize("self_check", [True, False])
def test_a_second_output_computed_from_the_first_is_joined_without_counting_it_twice(self_check):
    """The first output is passed on as a view too, so its gradient is the model's use of it alone: the second
    output's share reaches the parameters once, through the join (the total gradient at the first output would
    hold it already)."""
    x, y = data(6)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), TwiceBlock(), nn.Linear(8, 4)).double()
    want = loop_clipped_sum(copy.deepcopy(net), class_loss, x, y, 0.3)
    got = pipedp_clipped_sum(net, class_loss, x, y, 0.3, stages=1, microbatches=2, self_check=self_check)
    assert max_relative_error(got, want) < 1e-12


def test_a_first_output_without_gradient_beside_a_used_second_is_refused_by_name():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), TwiceBlock(dead=True), nn.Linear(8, 4)).double()
    with pytest.raises(UnsupportedModelError, match=r"layer '1.twice' \(Twice\) returns a tuple whose first element"):
        pipedp_clipped_sum(net, class_loss, *data(6), 0.3, stages=1, self_check=False)
