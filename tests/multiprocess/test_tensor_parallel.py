"""Tensor parallelism inside the stages, in real processes over gloo, against the batch-size-1 loop oracle
calling the user's own model: 2 tensor-parallel ranks alone, and 2 stages x 2 ranks (4 processes)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from oracles import loop_clipped_sum, max_relative_error  # noqa: E402

from pipedp.errors import RankFailedError  # noqa: E402
from pipedp.models import token_loss  # noqa: E402
from pipedp.runtime.launch import launch  # noqa: E402

pytestmark = pytest.mark.dist

LR, CLIP, N = 0.5, 0.05, 6


def oracle(steps, per_layer=False, **model_fields):
    """``steps`` DP-SGD steps (noise 0) of the same model, each sample's gradient from its own backward pass
    (``per_layer``: each layer's part clipped to C / sqrt(layers) on its own)."""
    from workers import tensor_parallel_batch, tensor_parallel_llama

    model = tensor_parallel_llama(**model_fields)
    groups = None
    if per_layer:
        layers = [n for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]
        groups = [(f"{n}.", CLIP / len(layers) ** 0.5) for n in layers]
    for step in range(steps):
        x, y = tensor_parallel_batch(seed=2 + step)
        total = loop_clipped_sum(model, lambda out, t: token_loss(out.logits, t), x, y, CLIP, groups)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p -= LR * total[name] / N
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run(steps, options, plant=None, world=None, checkpoint=None, first_step=0):
    from workers import tensor_parallel_steps

    if options.get("transport") == "inprocess":
        return [tensor_parallel_steps(0, steps, options, plant, checkpoint, first_step)]
    world = world or options.get("stages", 1) * options["tensor_parallel"]
    return launch(tensor_parallel_steps, world, (steps, options, plant, checkpoint, first_step), timeout_s=600)


def test_two_tensor_parallel_ranks_equal_the_loop_oracle_and_keep_whole_tensors_alike():
    results = run(2, {"stages": 1, "tensor_parallel": 2})
    want = oracle(2)
    assert max_relative_error(results[0][0], want) < 1e-12
    first, second = results[0][1], results[1][1]
    assert set(first) == set(second) and first  # the norms and the row-parallel biases
    assert all(torch.equal(first[k], second[k]) for k in first)
    shapes = results[1][2]  # each rank holds its slices only: heads, MLP width, vocabulary
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (8, 16)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (16, 8)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (16, 16)
    assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == (20, 16)


def test_the_users_own_loss_sees_the_gathered_logits_and_equals_the_loop_oracle():
    results = run(1, {"stages": 1, "tensor_parallel": 2, "user_loss": True})
    assert max_relative_error(results[0][0], oracle(1)) < 1e-12


@pytest.mark.parametrize(
    "plant", ["norm counted on every rank", "slice norm left out", "the loss without the -100 mask"]
)
def test_a_planted_norm_bug_is_caught_by_the_oracle(plant):
    results = run(1, {"stages": 1, "tensor_parallel": 2}, plant)
    assert max_relative_error(results[0][0], oracle(1)) > 1e-6


def test_two_stages_by_two_tensor_parallel_ranks_read_slice_by_slice_from_a_folder_equal_the_loop_oracle(tmp_path):
    """Each of the 4 ranks loads its stage from the saved folder (load_pipeline_stage(tensor_parallel=2)): the
    split layers stay unread until the split reads the rank's slice of each from the file; the head, tied to the
    embedding, is stored once, under the embedding's name."""
    from workers import tensor_parallel_llama

    tied = {"tie_word_embeddings": True}
    tensor_parallel_llama(**tied).save_pretrained(str(tmp_path))
    results = run(1, {"stages": 2, "tensor_parallel": 2, "schedule": "gpipe", "folder": str(tmp_path)})
    assert max_relative_error(results[0][0], oracle(1, **tied)) < 1e-12
    unread = results[1][3]  # stage 0's second rank, as loaded: its split layers left to the split
    assert {"model.embed_tokens.weight", "model.layers.0.self_attn.o_proj.weight"} <= unread
    assert (
        "model.layers.0.input_layernorm.weight" not in unread and "model.layers.0.self_attn.o_proj.bias" not in unread
    )


@pytest.mark.parametrize("stages", [1, 2])
def test_an_embedding_tied_to_the_head_cut_along_the_vocabulary_equals_the_loop_oracle(stages):
    """One weight for the embedding and the head, each rank holding the same vocabulary rows of it: in one stage
    the two layers' per-sample gradients of the slice are summed; across stages the head's ranks send each their
    slice's part of the tie's cross term back to the embedding's rank of the same slice."""
    tied = {"tie_word_embeddings": True}
    results = run(2, {"stages": stages, "tensor_parallel": 2, "model": tied})
    assert max_relative_error(results[0][0], oracle(2, **tied)) < 1e-12


def test_lora_on_the_split_projections_of_two_stages_by_two_ranks_equals_the_loop_oracle():
    """PEFT LoRA on every projection, the base frozen: a column-parallel layer's B and a row-parallel layer's A are
    split with their base, the other factor held whole (its gradient the same on every rank, counted once)."""
    lora = {"lora": True}
    results = run(2, {"stages": 2, "tensor_parallel": 2, "model": lora})
    assert max_relative_error(results[0][0], oracle(2, **lora)) < 1e-12
    shapes, layer = results[1][2], "base_model.model.model.layers.0."
    assert shapes[layer + "self_attn.q_proj.lora_B.default.weight"] == (8, 3)  # this rank's 2 heads' rows
    assert shapes[layer + "self_attn.q_proj.lora_A.default.weight"] == (3, 16)  # whole
    assert shapes[layer + "mlp.down_proj.lora_A.default.weight"] == (3, 16)  # this rank's half of 32 columns
    assert shapes[layer + "mlp.down_proj.lora_B.default.weight"] == (16, 3)  # whole
    whole = results[0][1]  # the whole factors step alike on both ranks
    assert layer + "self_attn.q_proj.lora_A.default.weight" in whole
    assert all(torch.equal(whole[k], results[1][1][k]) for k in whole)


def test_a_lora_b_without_its_copy_is_caught_as_a_whole_factor_that_differs_between_ranks():
    """Planted: a column-parallel B without the all-reduce of its input's gradient leaves each rank only its part
    of A's gradient; the check of the whole tensors' sums names A."""
    with pytest.raises(RankFailedError, match=r"clipped sum of \S+lora_A\.default\.weight, held whole"):
        run(1, {"stages": 1, "tensor_parallel": 2, "model": {"lora": True}}, "a LoRA B without its copy")


def test_per_layer_clipping_over_two_stages_by_two_ranks_equals_the_grouped_loop_oracle():
    results = run(1, {"stages": 2, "tensor_parallel": 2, "clipping": "per_layer"})
    assert max_relative_error(results[0][0], oracle(1, per_layer=True)) < 1e-12


def test_the_noise_of_two_ranks_equals_one_ranks_and_a_divided_noise_is_caught():
    noisy = {"noise_multiplier": 1.0}
    one = run(1, {"stages": 1, "tensor_parallel": 1, "transport": "inprocess", **noisy})[0][0]
    two = run(1, {"stages": 1, "tensor_parallel": 2, **noisy})[0][0]
    assert max_relative_error(two, one) < 1e-12
    planted = run(1, {"stages": 1, "tensor_parallel": 2, **noisy}, "noise divided by T")[0][0]
    assert max_relative_error(planted, one) > 1e-3


def test_a_checkpoint_of_two_ranks_resumes_on_one_and_on_two_stages_as_if_it_never_stopped(tmp_path):
    """Saved by 2 tensor-parallel ranks (their slices and momentum buffers joined into the one-rank file), resumed
    on 1 rank in one process and on 2 stages x 2 ranks: both equal 2 steps that never stopped."""
    one = {"stages": 1, "tensor_parallel": 1, "transport": "inprocess"}
    never = run(2, one, checkpoint=(str(tmp_path / "never"), "save"))[0][0]
    run(1, {"stages": 1, "tensor_parallel": 2}, checkpoint=(str(tmp_path / "tp"), "save"))
    on_one = run(1, one, checkpoint=(str(tmp_path / "tp"), "load"), first_step=1)[0][0]
    assert max_relative_error(on_one, never) < 1e-12
    split = {"stages": 2, "tensor_parallel": 2}
    on_four = run(1, split, checkpoint=(str(tmp_path / "tp"), "load"), first_step=1)[0][0]
    assert max_relative_error(on_four, never) < 1e-12


def test_two_replicas_of_two_tensor_parallel_ranks_equal_the_loop_oracle():
    """4 processes: the batch's rows split over the replicas, each replica's 2 ranks splitting the layers; the
    clipped sums added over each slice's replicas."""
    results = run(1, {"stages": 1, "replicas": 2, "tensor_parallel": 2}, world=4)
    assert max_relative_error(results[0][0], oracle(1)) < 1e-12


def test_a_whole_tensor_whose_sum_differs_between_ranks_is_refused_by_name():
    """The check behind the broadcast of the whole tensors' sums (which would hide a difference): planted on rank 1."""
    with pytest.raises(RankFailedError, match=r"clipped sum of model\.\S+, held whole by every tensor-parallel"):
        run(1, {"stages": 1, "tensor_parallel": 2}, "a whole sum differs on rank 1")


def test_an_optimizer_that_is_not_elementwise_is_refused():
    import functools

    adafactor = functools.partial(torch.optim.Adafactor, lr=0.01)
    with pytest.raises(RankFailedError, match="tensor_parallel=2 with Adafactor"):
        run(1, {"stages": 1, "tensor_parallel": 2, "optimizer": adafactor})


def test_a_failure_on_one_tensor_parallel_rank_ends_every_rank_with_its_report():
    """Its peers wait in a layer's collective it never joins: they end at the timeout (10 s here) and read the
    failing rank's report in the store (not a bare transport error); the failing rank's own error is the run's."""
    with pytest.raises(RankFailedError, match="rank 1 failed: RuntimeError: boom: a forward that fails on one"):
        run(1, {"stages": 1, "tensor_parallel": 2, "timeout": 10.0}, "rank 1 fails in a forward")


def test_secure_mode_noise_keeps_the_whole_tensors_alike_across_ranks():
    """Each rank draws its own OS-entropy noise; the whole tensors step with rank 0's (checked before the noise)."""
    results = run(2, {"stages": 1, "tensor_parallel": 2, "noise_multiplier": 1.0, "secure_mode": True})
    first, second = results[0][1], results[1][1]
    assert first and all(torch.equal(first[k], second[k]) for k in first)


def test_torchrun_fine_tunes_a_folder_on_two_stages_by_two_ranks_as_the_loop_oracle_and_resumes_on_another_split(
    tmp_path, cli
):
    """The issue's done criterion. `torchrun --nproc_per_node 4 -m pipedp train --stages 2 --tensor-parallel 2` on a
    saved float64 Llama-style folder (each rank reading only its slices), one step; then resumed on 2 stages in one
    process for a second; the exported model equals two steps of the loop oracle on the same rows (every record in
    every batch: shuffle sampling at rate 1, noise 0)."""
    import glob
    import os
    import subprocess
    import sys

    from test_cli_finetune import chats, tiny_chat_llama

    from pipedp.runtime.launch import free_port

    folder = tiny_chat_llama(transformers, tmp_path / "llama32")
    transformers.AutoModelForCausalLM.from_pretrained(folder).double().save_pretrained(tmp_path / "llama")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (folder / name).exists():
            (tmp_path / "llama" / name).write_bytes((folder / name).read_bytes())
    job = ["--model", str(tmp_path / "llama"), "--data", str(chats(tmp_path / "chat.jsonl", 12)), "--seq-len", "40"]
    job += ["--batch-size", "12", "--sampling", "shuffle", "--noise-multiplier", "0", "--max-grad-norm", str(CLIP)]
    job += ["--optimizer", "sgd", "--lr", str(LR), "--no-progress", "--checkpoint-dir", str(tmp_path / "ck")]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port"]
    split = ["--stages", "2", "--tensor-parallel", "2", "--device", "cpu", "--steps", "1"]
    out = subprocess.run(
        [*torchrun, str(free_port()), "-m", "pipedp", "train", *split, *job],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
        env=dict(os.environ, PYTHONPATH=root),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("the tensor-parallel slices are read when the layers are split") == 4
    resumed = cli(
        "train", *job, "--inprocess", "--stages", "2", "--steps", "2", "--resume", "--export", str(tmp_path / "out")
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 1" in resumed.stdout

    rows = torch.load(glob.glob(str(tmp_path / "ck" / "data-cache" / "rows-*.pt"))[0], weights_only=True)
    ids, labels = rows["input_ids"].long(), rows["labels"].long()
    mask = (torch.arange(ids.shape[1])[None, :] < rows["lengths"].long()[:, None]).long()
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.float64)
    for _ in range(2):
        x = {"input_ids": ids, "attention_mask": mask}
        total = loop_clipped_sum(model, lambda out, t: token_loss(out.logits, t), x, labels, CLIP)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p -= LR * total[name] / len(ids)
    trained = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64)
    assert max_relative_error(trained.state_dict(), model.state_dict()) < 1e-12
    start = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.float64)
    assert max_relative_error(start.state_dict(), model.state_dict()) > 1e-4  # the steps moved the weights


def traced_oracle(steps, **model_fields):
    from loop_models import GatedNet
    from workers import traced_tensor_parallel_batch

    torch.manual_seed(0)
    model = GatedNet(**model_fields).double()
    for step in range(steps):
        x, y = traced_tensor_parallel_batch(seed=2 + step)
        total = loop_clipped_sum(model, token_loss, x, y, CLIP)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p -= LR * total[name] / N
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_traced_model_split_by_the_pass_over_its_graphs_on_two_stages_by_two_ranks_equals_the_loop_oracle():
    """A model written the common way (traced into blocks): the pass makes its GELU and gated MLPs column- then
    row-parallel and its embedding vocabulary-parallel; the head, whose output is the model's, stays whole."""
    from workers import traced_tensor_parallel_steps

    results = launch(traced_tensor_parallel_steps, 4, (2, {"stages": 2, "tensor_parallel": 2}), timeout_s=600)
    assert max_relative_error(results[0][0], traced_oracle(2)) < 1e-12
    assert results[0][2] == ["blocks.0.down.weight", "blocks.0.up.bias", "blocks.0.up.weight", "blocks.0.w1.weight",
                             "blocks.0.w2.weight", "blocks.0.w3.weight", "embed.weight"]  # fmt: skip
    assert all(torch.equal(results[0][1][k], results[1][1][k]) for k in results[0][1])


def test_a_slice_mixed_with_a_whole_value_is_caught_where_the_pass_would_keep_it_split():
    """Planted: the pass keeps ``hidden * gate(x)`` a slice; the gradient of gate(x), and of all that feeds it (the
    block's norm first), is then each rank's part of it, and the check of the whole tensors' sums names the first."""
    from workers import traced_tensor_parallel_steps

    options = {"stages": 1, "tensor_parallel": 2, "model": {"scaled": True}}
    with pytest.raises(RankFailedError, match=r"clipped sum of blocks\.0\.ln\.weight, held whole"):
        launch(traced_tensor_parallel_steps, 2, (1, options, "a whole operand mixed with a slice"), timeout_s=600)
