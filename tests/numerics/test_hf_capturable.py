"""How pipedp makes a Hugging Face layer's calls capturable (pipedp/split/hf_capturable.py), where the families
matrix alone would not show why: a module reading its child's weight without calling it made one layer with it,
and a norm called on each head's tokens flattened ([batch T heads, d]) called on [batch, T heads, d]."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("transformers")
from hf_families import CLIP, build, family, hf_loss, padded_batch  # noqa: E402
from oracles import loop_clipped_sum, max_relative_error  # noqa: E402
from steps import pipedp_clipped_sum  # noqa: E402

from pipedp import PipelineDPTrainer, UnsupportedModelError  # noqa: E402
from pipedp.models import token_loss  # noqa: E402
from pipedp.privacy.rules.registry import read_children  # noqa: E402
from pipedp.runtime.capture import block_layers  # noqa: E402
from pipedp.split import hf_capturable  # noqa: E402
from pipedp.split.adapters import model_blocks  # noqa: E402


def test_a_module_reading_its_convolution_s_weight_is_one_layer_with_it():
    """LFM2's short convolution reads ``self.conv.weight`` in F.conv1d without calling ``self.conv``: it is one
    layer with it (replayed whole per sample), ``conv`` is no layer of its own; exact against the loop oracle."""
    model = build(family("lfm2"))
    blocks = model_blocks(model)
    conv = model.model.layers[0].conv
    assert read_children(conv) == ("conv",)
    layers = block_layers(blocks)
    assert "model.layers.0.conv" in layers and "model.layers.0.conv.conv" not in layers
    inputs, labels = padded_batch("left")
    want = loop_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP)
    got = pipedp_clipped_sum(model, token_loss, inputs, labels, CLIP, stages=2, microbatches=2)
    assert max_relative_error(got, want) < 1e-12
    assert float(got["model.layers.0.conv.conv.weight"].abs().max()) > 0


def test_without_a_reader_the_weight_read_outside_its_call_is_refused(monkeypatch):
    """The refusal the reader replaces, still given where no module above can replay the read (a router, whose
    rule knows its own tensors only: tests/numerics/test_moe.py plants one)."""
    monkeypatch.setattr(hf_capturable, "_readers", lambda layer, seen: ())
    with pytest.raises(UnsupportedModelError, match=r"layers.0: conv.conv.weight \(in a Conv1d\) is read outside"):
        PipelineDPTrainer(build(family("lfm2")), token_loss, stages=2, expected_batch_size=4)


def test_planted_heads_flattened_sequence_first_are_caught_by_the_self_check(monkeypatch):
    """Qwen3.5's gated norm runs on [batch T heads, d]: its calls are made on [batch, T heads, d], batch-major as
    the model flattens. A planted grouping by another order gives each sample other rows (and, reshaped back, the
    model other values): refused at the first step, where the layer's replay on a sample's rows alone is first
    compared with the whole call (its keyword arguments taken as per-sample), or by the self-check."""
    real = hf_capturable._unflatten

    def sequence_first(rows, length, flat):
        hook = real(rows, length, flat)

        def planted(module, args):
            out = hook(module, args)
            if out is None:
                return None
            first = out[0]
            return tuple(a.transpose(0, 1).reshape(first.shape) if a is not None and a.dim() > 1 else a for a in out)

        return planted

    monkeypatch.setattr(hf_capturable, "_unflatten", sequence_first)
    model = build(family("qwen3_5_text"))
    inputs, labels = padded_batch("right")
    with pytest.raises(
        UnsupportedModelError,
        match=r"stage 0: its forward mixes samples|linear_attn.norm.weight are wrong|linear_attn.*replayed alone do not",
    ):
        pipedp_clipped_sum(model, token_loss, inputs, labels, CLIP, stages=2, microbatches=2)


class Mixer(nn.Module):
    """Owns a scale and holds ``conv``, a Linear it never calls; ``reads``: its forward reads conv's weight."""

    def __init__(self, reads: bool):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4, dtype=torch.float64))
        self.conv = nn.Linear(4, 4, bias=False, dtype=torch.float64)
        self.reads = reads

    def forward(self, x):
        return x * self.scale + (F.linear(x, self.conv.weight) if self.reads else 0)


class Layer(nn.Module):
    """``outside``: the layer itself reads its mixer's conv weight too (F.linear on its own input)."""

    def __init__(self, reads: bool, outside: bool):
        super().__init__()
        self.mixer = Mixer(reads)
        self.outside = outside

    def forward(self, x):
        return self.mixer(x) + (F.linear(x, self.mixer.conv.weight) if self.outside else 0)


@pytest.mark.parametrize(
    "reads, outside, made_one",
    [(True, False, True), (False, True, False), (True, True, False)],
    ids=["read by the mixer", "planted: read by the layer", "planted: read by both"],
)
def test_a_reader_is_made_one_layer_with_the_weight_only_where_its_own_output_holds_every_read(
    reads, outside, made_one
):
    """The module above that ran is made one layer with the child only if its own output reaches the weight and
    nothing else in the layer reads it: a layer's read outside the mixer (planted) would get no per-sample
    gradient through the mixer's replay, and is refused as a read outside any call."""
    layer = Layer(reads, outside)
    if made_one:
        assert hf_capturable.find_fixes("probe", layer, (), {}, 2, 3, (4,)).reads == (("mixer", ("conv",)),)
        assert read_children(layer.mixer) == ("conv",)
        return
    with pytest.raises(UnsupportedModelError, match=r"probe: mixer.conv.weight \(in a Linear\) is read outside"):
        hf_capturable.find_fixes("probe", layer, (), {}, 2, 3, (4,))
    assert read_children(layer.mixer) == ()


def test_layers_of_one_class_frozen_differently_are_probed_each():
    """The first convolution layer frozen (partial fine-tuning): the later one, trained, still reads its weight
    through its module, one layer with it, not a weight no per-sample gradient reaches."""
    model = build(family("lfm2"))
    model.model.layers[0].requires_grad_(False)
    layers = block_layers(model_blocks(model))
    assert read_children(model.model.layers[2].conv) == ("conv",)
    assert "model.layers.2.conv" in layers and "model.layers.2.conv.conv" not in layers


class Flattening(nn.Module):
    """A layer running its feed-forward on its tokens flattened, batch-major (as OPT's) or, planted, [T, batch]."""

    def __init__(self, sequence_major: bool):
        super().__init__()
        torch.manual_seed(0)
        self.ffn = nn.Linear(4, 4, dtype=torch.float64)
        self.sequence_major = sequence_major

    def forward(self, x):
        batch, length, width = x.shape
        if self.sequence_major:
            out = self.ffn(x.transpose(0, 1).reshape(-1, width))
            return x + out.reshape(length, batch, width).transpose(0, 1)
        return x + self.ffn(x.reshape(-1, width)).reshape(batch, length, width)


def test_planted_tokens_flattened_sequence_major_are_refused_when_the_model_is_split():
    """A module called on [batch T, ...] is called on [batch, T, ...], batch-major: checked by autograd on random
    hidden states when the model is split (each sample's rows depend on its own hidden states only), so a layer
    flattening [T, batch] (planted) is refused by name there, not left to the self-check."""
    assert hf_capturable.find_fixes("probe", Flattening(False), (), {}, 2, 3, (4,)).flattened == ("ffn",)
    with pytest.raises(UnsupportedModelError, match=r"probe.ffn \(Linear\) is called on the tokens flattened"):
        hf_capturable.find_fixes("probe", Flattening(True), (), {}, 2, 3, (4,))
