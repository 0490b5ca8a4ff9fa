"""A Llama checkpoint loaded stage by stage in real processes: each rank holds only its share."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from oracles import max_relative_error  # noqa: E402
from steps import tiny_llama_config  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from pipedp import PipelineDPTrainer  # noqa: E402
from pipedp.models import token_loss  # noqa: E402
from pipedp.runtime.launch import launch  # noqa: E402
from pipedp.split.hf_loading import resident_parameter_bytes  # noqa: E402

pytestmark = pytest.mark.dist


def test_llama_stage_loading_in_processes_equals_whole_model(tmp_path):
    from workers import hf_stage_step

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    LlamaForCausalLM(cfg).save_pretrained(tmp_path, max_shard_size="20KB")
    results = launch(hf_stage_step, 2, (str(tmp_path), 2), timeout_s=300)
    whole = LlamaForCausalLM.from_pretrained(tmp_path)
    total = resident_parameter_bytes(whole)
    residents = [r for r, _ in results]
    assert sum(residents) == total and max(residents) < 0.75 * total, (residents, total)
    # the same step on the whole model in one process
    trainer = PipelineDPTrainer(
        whole,
        token_loss,
        lambda p: torch.optim.SGD(p, lr=0.5),
        stages=2,
        microbatches=2,
        noise_multiplier=0.0,
        max_grad_norm=0.05,
        expected_batch_size=6,
        untie_weights=True,
        transport="inprocess",
    )
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 40, (6, 8), generator=g)
    trainer.step(x, torch.randint(0, 40, (6, 8), generator=g))
    assert max_relative_error(results[0][1], trainer.state_dict()) < 1e-6


def test_save_pretrained_from_two_processes_round_trips(tmp_path):
    import transformers
    from workers import llama_export

    launch(llama_export, 2, (str(tmp_path / "export"),), timeout_s=300)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 40, (6, 8), generator=g)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export")).double()
    want = llama_export(0, None)  # the same step in one process
    assert torch.allclose(reloaded(x).logits, want, rtol=0, atol=1e-10)


def test_attention_masks_over_two_processes_equal_the_in_process_run():
    from workers import llama_padded_step

    got = launch(llama_padded_step, 2, (), timeout_s=300)[0]
    want = llama_padded_step(0, inprocess=True)
    assert max_relative_error(got, want) < 1e-12


def test_the_llama_lora_example_runs_under_torchrun_and_exports(tmp_path):
    import os
    import subprocess
    import sys

    from pipedp.runtime.launch import free_port

    pytest.importorskip("peft")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            os.path.join(root, "examples", "finetune_llama.py"),
            "--steps",
            "3",
            "--batch-size",
            "8",
            "--export",
            str(tmp_path / "adapter"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "adapter written to" in out.stdout
    assert (tmp_path / "adapter" / "adapter_config.json").exists()


def test_tied_embedding_across_two_processes_is_exact_and_stays_tied():

    from workers import tied_llama_step

    got = launch(tied_llama_step, 2, (0.0,), timeout_s=300)[0]
    assert torch.equal(got["model.embed_tokens.weight"], got["lm_head.weight"])  # both copies, one update
    want = tied_llama_step(0, 0.0, inprocess=True)
    assert max_relative_error(got, want) < 1e-12
    noisy = launch(tied_llama_step, 2, (1.0,), timeout_s=300)[0]
    assert torch.equal(noisy["model.embed_tokens.weight"], noisy["lm_head.weight"])  # the noise added once
    assert max_relative_error(noisy, tied_llama_step(0, 1.0, inprocess=True)) < 1e-12


def test_a_bf16_tie_across_processes_meets_in_one_dtype_on_an_empty_batch():
    """bf16-true: the owner starts the tied sum as the noise, in float32; the partner's copy, untouched by an empty
    batch, must reach the tie's all-reduce in float32 too (gloo aborts on float32 against bf16). The copies stay
    one tensor, and the run equals the in-process one to bf16's rounding (the parts are added in another order)."""
    from workers import tied_llama_step

    got = launch(tied_llama_step, 2, (1.0, False, True), timeout_s=300)[0]
    assert torch.equal(got["model.embed_tokens.weight"], got["lm_head.weight"])
    assert max_relative_error(got, tied_llama_step(0, 1.0, inprocess=True, bf16=True)) < 1e-2


def test_a_tied_checkpoint_loaded_stage_by_stage_trains_tied(tmp_path):
    import transformers
    from workers import tied_llama_from_folder

    cfg = tiny_llama_config(tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "tied")
    got = launch(tied_llama_from_folder, 2, (str(tmp_path / "tied"),), timeout_s=300)[0]
    want = tied_llama_from_folder(0, str(tmp_path / "tied"), inprocess=True)
    assert max_relative_error(got, want) < 1e-12
    assert torch.equal(got["model.embed_tokens.weight"], got["lm_head.weight"])


def gemma_stage_step(rank, folder):
    """Rank r materializes stage r of a tied Gemma checkpoint (its rotary frequencies and embedding scale
    recomputed, not read), then one DP step on a left-padded batch: what it subtracted from its tensors."""
    from hf_families import CLIP, padded_batch

    from pipedp.split.hf_loading import load_pipeline_stage

    model = load_pipeline_stage(folder, 2, rank).double()
    before = {k: v.detach().clone() for k, v in model.named_parameters(remove_duplicate=False) if not v.is_meta}
    trainer = PipelineDPTrainer(
        model,
        token_loss,
        lambda p: torch.optim.SGD(p, lr=1.0),
        stages=2,
        microbatches=2,
        noise_multiplier=0.0,
        max_grad_norm=CLIP,
        expected_batch_size=1,
    )
    trainer.step(*padded_batch("left"))
    after = dict(model.named_parameters(remove_duplicate=False))  # the tied head: its own copy on rank 1
    return {k: v - after[k].detach() for k, v in before.items() if not after[k].is_meta}


def test_a_tied_gemma_loaded_stage_by_stage_in_processes_matches_the_loop_oracle(tmp_path):
    from hf_families import CLIP, build, family, padded_batch
    from oracles import loop_clipped_sum

    gemma = family("gemma")
    build(gemma, tie=True).float().save_pretrained(tmp_path, max_shard_size="20KB")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).double()
    assert model.lm_head.weight is model.get_input_embeddings().weight
    inputs, labels = padded_batch("left")
    want = loop_clipped_sum(model, lambda out, y: token_loss(out.logits, y), inputs, labels, CLIP)
    first, last = launch(gemma_stage_step, 2, (str(tmp_path),), timeout_s=300)
    # the tied tensor is two copies in two processes, which got the same update
    assert torch.equal(first["model.embed_tokens.weight"], last.pop("lm_head.weight"))
    assert max_relative_error({**first, **last}, want) < gemma.tolerance


def test_a_mixture_of_experts_over_two_stages_by_two_replicas_equals_the_loop_oracle():
    """4 processes: the rows split over the replicas, each expert bank's clipped sums added over them."""
    from oracles import loop_clipped_sum
    from workers import moe_model, moe_step, tensor_parallel_batch

    results = launch(moe_step, 4, ({"stages": 2, "replicas": 2},), timeout_s=600)
    model = moe_model()
    x, y = tensor_parallel_batch(seed=2)
    total = loop_clipped_sum(model, lambda out, t: token_loss(out.logits, t), x, y, 0.05)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p -= 0.5 * total[name] / 6
    assert max_relative_error(results[0], model.state_dict()) < 1e-12
