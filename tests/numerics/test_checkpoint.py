"""Checkpoints hold what training changes, by parameter name: a run saved on p stages resumes on q
stages exactly as the run that never stopped (float64, to rounding), with the same epsilon; the
frozen base is not copied, only fingerprinted. The oracle is the uninterrupted run."""

import json
import os

import pytest
import torch
import torch.nn as nn
from oracles import max_relative_error
from steps import class_data, class_loss

from pipedp import CheckpointError, PipelineDPTrainer
from pipedp.models import token_loss


def data(n=80, seed=0):
    return class_data(n, 6, 3, seed)


def model(frozen_seed=5, frozen="weight"):
    torch.manual_seed(1)
    net = nn.Sequential(
        nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3)
    ).double()
    with torch.no_grad():  # the frozen base: its own seed, so that a test can build a different one
        g = torch.Generator().manual_seed(frozen_seed)
        net[0].weight.copy_(torch.randn(12, 6, generator=g, dtype=torch.float64) * 0.4)
    net[0].weight.requires_grad_(False)
    if frozen == "layer":  # on 3 stages the first stage is this layer alone: nothing to train there, no optimizer
        net[0].bias.requires_grad_(False)
    return net


def adam(params):
    """Two param groups with their own options: weights and biases."""
    return torch.optim.Adam(
        [
            {"params": [p for p in params if p.dim() > 1], "lr": 0.05},
            {"params": [p for p in params if p.dim() == 1], "lr": 0.02, "weight_decay": 0.01},
        ]
    )


def warmup(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 4))


def trainer(stages, net=None, **kw):
    args = dict(
        stages=stages,
        microbatches=2,
        noise_multiplier=0.7,
        max_grad_norm=0.3,
        expected_batch_size=8,
        sample_rate=0.1,
        seed=4,
        accountant="rdp",
    )
    args.update(kw)
    return PipelineDPTrainer(net if net is not None else model(), class_loss, adam, scheduler=warmup, **args)


def lrs(t):
    """The learning rates of every param group that holds a parameter."""
    return [g["lr"] for opt in t.state.optimizers if opt is not None for g in opt.param_groups if g["params"]]


@pytest.mark.parametrize("frozen", ["weight", "layer"])
@pytest.mark.parametrize("saved, resumed", [(2, 3), (3, 2)])
def test_a_run_resumed_on_another_split_equals_the_uninterrupted_run(tmp_path, saved, resumed, frozen):
    straight = trainer(saved, model(frozen=frozen))
    straight.fit(data(), steps=6)
    first = trainer(saved, model(frozen=frozen))
    first.fit(data(), steps=3, checkpoint_dir=str(tmp_path))
    del first  # the job "dies"; another one resumes it on another split
    again = trainer(resumed, model(frozen=frozen))
    result = again.fit(data(), steps=6, checkpoint_dir=str(tmp_path), resume=True)
    assert result.steps == 6
    want, got = straight.model.state_dict(), again.model.state_dict()
    assert max_relative_error(got, want) < 1e-10  # the norms are summed in another order: float64 rounding
    assert max_relative_error(got, model().state_dict()) > 1e-2  # it trained
    assert torch.equal(got["0.weight"], model()[0].weight)  # the frozen base is as it was
    assert (frozen == "layer") == torch.equal(got["0.bias"], model()[0].bias)
    assert again.epsilon(1e-5) == straight.epsilon(1e-5)
    assert set(lrs(again)) == set(lrs(straight)) and len(set(lrs(again))) == 2  # the schedule went on


@pytest.mark.parametrize("drop", ["optimizer state", "scheduler state"])
def test_the_resume_test_fails_without_the_optimizer_or_scheduler_state(tmp_path, drop):
    """The comparison above can fail: resuming without either part of the state lands elsewhere."""
    straight = trainer(2)
    straight.fit(data(), steps=6)
    trainer(2).fit(data(), steps=3, checkpoint_dir=str(tmp_path))
    again = trainer(3)
    again.load_checkpoint(str(tmp_path))
    assert again.steps_taken == 3
    if drop == "optimizer state":
        for opt in again.state.optimizers:
            opt.state.clear()
    else:
        fresh = trainer(3)
        for mine, theirs in zip(again.state.schedulers, fresh.state.schedulers):
            mine.load_state_dict(theirs.state_dict())
    again.fit(data(), steps=6)
    assert max_relative_error(again.model.state_dict(), straight.model.state_dict()) > 1e-4


def test_the_stage_files_hold_the_trainable_parameters_and_optimizer_state_only(tmp_path):
    from safetensors import safe_open

    t = trainer(2)
    t.fit(data(), steps=2, checkpoint_dir=str(tmp_path))
    folder = tmp_path / "step-00000002"
    keys = set()
    for path in sorted(folder.glob("stage-*.safetensors")):
        with safe_open(str(path), "pt") as f:  # the safetensors library reads them as they are
            keys |= set(f.keys())
    trainable = [n for n, p in t.model.named_parameters() if p.requires_grad]
    want = {f"p/{n}" for n in trainable}
    want |= {f"o/{n}/{k}" for n in trainable for k in ("step", "exp_avg", "exp_avg_sq")}
    assert keys == want  # no frozen tensor: 0.weight is fingerprinted, not copied
    manifest = json.loads((folder / "manifest.json").read_text())
    assert set(manifest["stages"][0]["frozen"]) == {"0.weight"}


def test_other_frozen_weights_are_refused(tmp_path):
    trainer(2).fit(data(), steps=1, checkpoint_dir=str(tmp_path))
    other = trainer(2, model(frozen_seed=6))  # the same architecture on another base
    with pytest.raises(CheckpointError, match="frozen tensor 0.weight is not the one the checkpoint was trained on"):
        other.load_checkpoint(str(tmp_path))
    nudged = model()
    with torch.no_grad():
        nudged[0].weight[7, 3] += 1e-6  # one element (of 72: every one is in the fingerprint's sample)
    with pytest.raises(CheckpointError, match="frozen tensor 0.weight"):
        trainer(2, nudged).load_checkpoint(str(tmp_path))


def test_a_frozen_tensor_made_trainable_or_the_reverse_is_refused(tmp_path):
    trainer(2).fit(data(), steps=1, checkpoint_dir=str(tmp_path))
    thawed = model()
    thawed[0].weight.requires_grad_(True)
    with pytest.raises(CheckpointError, match="parameter 0.weight is frozen in the checkpoint, trainable now"):
        trainer(2, thawed).load_checkpoint(str(tmp_path))
    frozen = model()
    frozen[2].weight.requires_grad_(False)
    with pytest.raises(CheckpointError, match="tensor 2.weight is trained in the checkpoint, frozen now"):
        trainer(2, frozen).load_checkpoint(str(tmp_path))


def test_a_second_save_at_the_same_step_replaces_the_first_atomically(tmp_path):
    t = trainer(2)
    # checkpoint_every divides the steps: the loop saves at step 4 twice (every 2, and at the end); the
    # second save is byte for byte the first, so the first stays
    t.fit(data(), steps=4, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002", "step-00000004"]
    for opt in t.state.optimizers:  # a change without a step (as the CLI's --lr on resume): a new save
        for group in opt.param_groups:
            group["lr"] = 0.125
    t.save_checkpoint(str(tmp_path))
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002", "step-00000004-1"]
    again = trainer(3)
    again.load_checkpoint(str(tmp_path))
    assert again.steps_taken == 4 and set(lrs(again)) == {0.125}
    assert max_relative_error(again.model.state_dict(), t.model.state_dict()) == 0


def test_a_tied_embedding_and_head_resume_on_another_split(tmp_path):
    """In one process the head's stage holds the embedding's own tensor (saved once, as an alias)."""
    from loop_models import TiedLM

    def tied_trainer(stages):
        torch.manual_seed(0)
        return PipelineDPTrainer(
            TiedLM().double(),
            token_loss,
            lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9),
            stages=stages,
            microbatches=2,
            noise_multiplier=0.5,
            max_grad_norm=0.2,
            expected_batch_size=6,
            sample_rate=0.2,
            seed=2,
        )

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 11, (40, 6), generator=g)
    dataset = ({"input_ids": ids, "mask": torch.ones_like(ids)}, torch.randint(0, 11, (40, 6), generator=g))
    straight = tied_trainer(2)
    straight.fit(dataset, steps=4)
    tied_trainer(2).fit(dataset, steps=2, checkpoint_dir=str(tmp_path))
    manifest = json.loads(next(tmp_path.glob("step-*/manifest.json")).read_text())
    assert manifest["stages"][1]["aliases"] == {"head.weight": "embed.weight"}
    again = tied_trainer(3)
    again.fit(dataset, steps=4, checkpoint_dir=str(tmp_path), resume=True)
    got = again.model.state_dict()
    assert got["head.weight"].data_ptr() == got["embed.weight"].data_ptr()  # still tied
    assert max_relative_error(got, straight.model.state_dict()) < 1e-10


def test_replicas_and_stages_need_not_match_per_stage_clipping_thresholds_must(tmp_path):
    trainer(2, clipping="per_stage").fit(data(), steps=1, checkpoint_dir=str(tmp_path))
    with pytest.raises(CheckpointError, match="stages: checkpoint 2, now 3"):
        trainer(3, clipping="per_stage").load_checkpoint(str(tmp_path))


def test_the_saved_config_the_scheduler_and_the_optimizer_must_match(tmp_path):
    trainer(2).fit(data(), steps=1, checkpoint_dir=str(tmp_path))
    plain = PipelineDPTrainer(model(), class_loss, adam, stages=2, expected_batch_size=8, sample_rate=0.1, seed=4)
    with pytest.raises(CheckpointError, match="different configuration"):
        plain.load_checkpoint(str(tmp_path))
    no_scheduler = PipelineDPTrainer(
        model(),
        class_loss,
        adam,
        stages=2,
        microbatches=2,
        noise_multiplier=0.7,
        max_grad_norm=0.3,
        expected_batch_size=8,
        sample_rate=0.1,
        seed=4,
        accountant="rdp",
    )
    with pytest.raises(CheckpointError, match="the checkpoint has an LR scheduler.*this run none"):
        no_scheduler.load_checkpoint(str(tmp_path))
    sgd = PipelineDPTrainer(
        model(),
        class_loss,
        lambda p: torch.optim.SGD(p, lr=0.1),
        scheduler=warmup,
        stages=2,
        microbatches=2,
        noise_multiplier=0.7,
        max_grad_norm=0.3,
        expected_batch_size=8,
        sample_rate=0.1,
        seed=4,
        accountant="rdp",
    )
    with pytest.raises(CheckpointError, match="optimizer"):
        sgd.load_checkpoint(str(tmp_path))
    assert os.listdir(tmp_path)  # nothing was removed by the refusals


def _adam_with(**options):
    def factory(params):
        groups = [
            {"params": [p for p in params if p.dim() > 1], "lr": 0.05},
            {"params": [p for p in params if p.dim() == 1], "lr": 0.02, "weight_decay": 0.01},
        ]
        return torch.optim.Adam(groups, **options)

    return factory


@pytest.mark.parametrize("saved, resumed", [({}, {"fused": True}), ({"fused": True}, {"foreach": True})])
def test_how_torch_steps_is_the_resumed_runs_own_choice(tmp_path, saved, resumed):
    """fused / foreach are how the step is computed, not what: a checkpoint written before the CLI took the
    fused kernel resumes under it (and the reverse), with this run's choice kept; in float64 every kernel
    computes the same update, so the resumed run equals the uninterrupted one."""
    kw = dict(scheduler=warmup, stages=2, microbatches=2, noise_multiplier=0.7, max_grad_norm=0.3)
    kw.update(expected_batch_size=8, sample_rate=0.1, seed=4, accountant="rdp")
    straight = PipelineDPTrainer(model(), class_loss, _adam_with(**saved), **kw)
    straight.fit(data(), steps=6)
    PipelineDPTrainer(model(), class_loss, _adam_with(**saved), **kw).fit(data(), steps=3, checkpoint_dir=str(tmp_path))
    again = PipelineDPTrainer(model(), class_loss, _adam_with(**resumed), **kw)
    again.fit(data(), steps=6, checkpoint_dir=str(tmp_path), resume=True)
    assert max_relative_error(again.model.state_dict(), straight.model.state_dict()) < 1e-10
    for opt in again.state.optimizers:
        for g in opt.param_groups:
            assert all(
                g[k] == resumed.get(k, torch.optim.Adam([torch.zeros(1)]).defaults[k]) for k in ("fused", "foreach")
            )
    # a hyperparameter is still the checkpoint's: the saved betas come back over this run's, the kernel does not
    other = PipelineDPTrainer(model(), class_loss, _adam_with(betas=(0.5, 0.9), **resumed), **kw)
    other.load_checkpoint(str(tmp_path))
    groups = [g for opt in other.state.optimizers for g in opt.param_groups]
    assert {g["betas"] for g in groups} == {(0.9, 0.999)}
    assert {g["fused"] for g in groups} == {resumed.get("fused")}


def _peak_rss_increase_mib(work):
    """VmHWM after ``work()`` minus VmRSS before it, the kernel's peak mark reset first (Linux)."""

    def kib(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = kib("VmRSS")
    work()
    return (kib("VmHWM") - start) / 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux peak-RSS accounting")
def test_a_save_streams_its_tensors_instead_of_assembling_them(tmp_path):
    """A 128 MiB stage is written adding a few MiB to the peak, not the stage's size (the old torch.save into
    memory added 120-190%: python -m bench.checkpoint_memory)."""
    from pipedp.train.checkpoint import tensorfile

    tensors = [(f"p/{k}", torch.randn(1024, 1024, dtype=torch.float64)) for k in range(16)]
    tensors.append(("p/t", torch.randn(512, 2048).t()))  # not contiguous: copied in chunks
    increase = _peak_rss_increase_mib(lambda: tensorfile.write(str(tmp_path / "s.safetensors"), tensors))
    assert increase < 0.05 * 128, increase


def _fit_on_ranks(rank, directory, steps, resume):
    """One rank of a 2-process run (pipedp.runtime.launch): the same trainer, one stage per process."""
    t = trainer(2)
    t.fit(data(), steps=steps, checkpoint_dir=directory, resume=resume)
    return t.state_dict(), t.epsilon(1e-5)


@pytest.mark.dist
def test_saved_by_two_processes_resumed_in_one_on_three_stages_and_back(tmp_path):
    from pipedp.runtime.launch import launch

    straight = trainer(2)
    straight.fit(data(), steps=6)
    want, eps = straight.model.state_dict(), straight.epsilon(1e-5)
    # each process writes its own stage's file; one process resumes them on three stages
    launch(_fit_on_ranks, 2, (str(tmp_path / "a"), 3, False), timeout_s=300)
    again = trainer(3)
    again.fit(data(), steps=6, checkpoint_dir=str(tmp_path / "a"), resume=True)
    assert max_relative_error(again.model.state_dict(), want) < 1e-10 and again.epsilon(1e-5) == eps
    # one process on three stages writes three files; two processes resume them, each reading its names
    trainer(3).fit(data(), steps=3, checkpoint_dir=str(tmp_path / "b"))
    state, resumed_eps = launch(_fit_on_ranks, 2, (str(tmp_path / "b"), 6, True), timeout_s=300)[0]
    assert max_relative_error(state, want) < 1e-10 and resumed_eps == eps


def _load_on_ranks(rank, directory):
    t = trainer(2)
    try:
        t.load_checkpoint(directory)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


@pytest.mark.dist
def test_a_file_only_one_process_reads_is_refused_by_every_process(tmp_path):
    """Rank 1 finds its stage file truncated; rank 0's is intact: both raise, neither waits for the other."""
    from pipedp.runtime.launch import launch

    trainer(2).fit(data(), steps=1, checkpoint_dir=str(tmp_path))
    path = tmp_path / "step-00000001" / "stage-1.safetensors"
    path.write_bytes(path.read_bytes()[:-8])
    first, second = launch(_load_on_ranks, 2, (str(tmp_path),), timeout_s=300)
    assert "rank 1:" in first and "stage-1.safetensors" in first and "truncated or corrupted" in first
    assert "stage-1.safetensors" in second and "truncated or corrupted" in second
