"""load_stage: a model built on the meta device gets only one stage's tensors, from a file, a folder
of shards or a mapping; what cannot be loaded is refused by name."""

import pytest
import torch
from loop_models import MaskedNet
from safetensors.torch import save_file

from pipedp import CheckpointError, PartitionError, load_stage, measured_costs
from pipedp.split.adapters import model_blocks
from pipedp.split.partition import partition


def meta_model():
    with torch.device("meta"):
        return MaskedNet().double()


@pytest.mark.parametrize("source", ["file", "mapping"])
def test_only_the_stage_s_tensors_get_memory_and_they_are_the_saved_ones(tmp_path, source):
    torch.manual_seed(0)
    whole = MaskedNet().double()
    save_file(whole.state_dict(), str(tmp_path / "w.safetensors"))
    weights = str(tmp_path / "w.safetensors") if source == "file" else whole.state_dict()
    for stage in (0, 1):
        model = load_stage(meta_model(), weights, 2, stage)
        stage_blocks = partition(model_blocks(model), 2, "params")
        mine = {id(p) for b in stage_blocks[stage] for p in b.module.parameters()}
        saved = dict(whole.named_parameters())
        for name, p in model.named_parameters():
            if id(p) in mine:
                assert torch.equal(p, saved[name])
            else:
                assert p.is_meta


def test_what_cannot_be_loaded_is_refused_by_name(tmp_path):
    torch.manual_seed(0)
    state = MaskedNet().double().state_dict()
    del state["head.weight"]
    with pytest.raises(CheckpointError, match="'head.weight' is not in the weights"):
        load_stage(meta_model(), state, 2, 1)
    with pytest.raises(PartitionError, match="meta device has no values to run"):
        load_stage(meta_model(), state, 2, 0, balance=measured_costs(torch.zeros(2, 3)))
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        load_stage(meta_model(), str(tmp_path), 2, 0)

    class WithTable(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
            self.b.register_buffer("table", torch.ones(3), persistent=False)

        def forward(self, x):
            return self.b(self.a(x))

    with torch.device("meta"):
        model = WithTable()
    with pytest.raises(CheckpointError, match="b.table: buffers that are not saved"):
        load_stage(model, {k: torch.zeros(v.shape) for k, v in model.state_dict().items()}, 2, 1)


def test_a_tied_model_stays_tied_on_every_stage(tmp_path):
    from loop_models import TiedLM
    from safetensors.torch import save_model

    torch.manual_seed(0)
    whole = TiedLM().double()
    save_model(whole, str(tmp_path / "tied.safetensors"))  # stores the shared tensor under one name
    for stage in (0, 1):
        with torch.device("meta"):
            model = TiedLM().double()
        load_stage(model, str(tmp_path / "tied.safetensors"), 2, stage)
        assert model.head.weight is model.embed.weight  # one tensor again, as in the model built
        assert not model.embed.weight.is_meta and torch.equal(model.embed.weight, whole.embed.weight)


def test_tensor_parallel_loading_leaves_the_split_layers_unread_and_a_run_that_does_not_cut_them_is_refused(
    tmp_path,
):
    """load_pipeline_stage(tensor_parallel=2) reads every tensor of its stage but those the split cuts, which stay
    on the meta device until each rank reads its slice (their values are checked against the loop oracle in
    tests/multiprocess/test_tensor_parallel.py); a trainer that does not cut them refuses by name."""
    transformers = pytest.importorskip("transformers")
    from steps import tiny_llama_config

    from pipedp import PipelineDPTrainer
    from pipedp.errors import ConfigMismatchError
    from pipedp.models import token_loss
    from pipedp.split.hf_loading import load_pipeline_stage

    torch.manual_seed(0)
    config = tiny_llama_config(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    whole = transformers.LlamaForCausalLM(config)
    whole.save_pretrained(str(tmp_path))
    model = load_pipeline_stage(str(tmp_path), 1, 0, tensor_parallel=2)
    unread = {n for n, p in model.named_parameters() if p.is_meta}
    split = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    want = {f"model.layers.{i}.{part}.{m}.weight" for i in (0, 1) for m in split for part in ("self_attn", "mlp")}
    want = {n for n in want if n in dict(whole.named_parameters())} | {"model.embed_tokens.weight", "lm_head.weight"}
    assert unread == want
    saved = dict(whole.named_parameters())
    assert all(torch.equal(p, saved[n]) for n, p in model.named_parameters() if n not in unread)
    with pytest.raises(ConfigMismatchError, match="'model.embed_tokens.weight' was left unread"):
        PipelineDPTrainer(model, token_loss, lambda p: torch.optim.SGD(p, lr=0.1), stages=1, expected_batch_size=2)


def test_lora_on_layers_left_unread_for_the_split_gets_memory_and_the_same_start_as_on_one_rank(tmp_path):
    """PEFT puts an adapter on its base weight's device: the meta device where the loader left it for the split.
    pipedp's LoRA (the CLI's --lora-r) gives such adapters memory, and every adapter the same start whatever the
    split: A Kaiming-uniform from a stream of (seed, layer), B zero."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from steps import tiny_llama_config

    from pipedp.split.hf_loading import load_pipeline_stage
    from pipedp.train.lora import with_lora

    torch.manual_seed(0)
    config = tiny_llama_config(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(str(tmp_path))
    targets = ("q_proj", "o_proj")
    model = with_lora(load_pipeline_stage(str(tmp_path), 1, 0, tensor_parallel=2), 2, targets, seed=0)
    adapters = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(adapters) == 8 and not any(p.is_meta for p in adapters.values())
    assert all(p.abs().sum() > 0 for n, p in adapters.items() if "lora_A" in n)
    assert all(torch.equal(p, torch.zeros_like(p)) for n, p in adapters.items() if "lora_B" in n)
    assert model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.is_meta  # still the split's
    whole = with_lora(load_pipeline_stage(str(tmp_path), 1, 0), 2, targets, seed=0)  # T = 1: nothing left unread
    assert all(torch.equal(p, adapters[n]) for n, p in whole.named_parameters() if "lora_" in n)
    last = with_lora(load_pipeline_stage(str(tmp_path), 2, 1, tensor_parallel=2), 2, targets, seed=0)  # stage 1 of 2
    held = {n: p for n, p in last.named_parameters() if "lora_" in n and not p.is_meta}
    assert held and all(torch.equal(p, adapters[n]) for n, p in held.items())
    assert any(p.is_meta for n, p in last.named_parameters() if "lora_" in n)  # stage 0's: left on meta
