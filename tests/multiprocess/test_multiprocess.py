"""Real processes over gloo on loopback: parity with Opacus, noisy reproducibility, failures."""

import time

import pytest
import torch
from oracles import max_relative_error, opacus_step
from workers import CLIP, LR, make_batch, make_model

from pipedp import PipelineDPTrainer, RankFailedError
from pipedp.runtime.launch import free_port, launch

pytestmark = pytest.mark.dist
N = 13  # does not divide into micro-batches: padded rows travel too

GRID2 = [
    dict(stages=2, microbatches=m, schedule=s, grad_mode=g)
    for s in ("gpipe", "1f1b", "dp-zb", "dp-zb-2x")
    for g in ("ghost", "materialize")
    for m in (4,)
] + [dict(stages=2, microbatches=4, schedule=s, grad_mode="keep") for s in ("1f1b", "dp-zb")]
GRID4 = [
    dict(stages=4, microbatches=m, schedule=s, grad_mode=g)
    for s, g, m in (
        ("gpipe", "ghost", 4),
        ("1f1b", "materialize", 4),
        ("1f1b", "ghost", 8),
        ("gpipe", "materialize", 2),
        ("dp-zb", "ghost", 8),
        ("dp-zb-2x", "materialize", 6),
        ("1f1b", "keep", 8),
    )
]
MESH = [dict(stages=2, replicas=2, microbatches=2, schedule="1f1b", grad_mode="ghost")]


def opacus_reference(mode):
    x, y = make_batch(N)
    return opacus_step(make_model(), x, y, token_model=True, mode=mode, max_grad_norm=CLIP, lr=LR)


def check(configs, results):
    for cfg, got in zip(configs, results):
        err = max_relative_error(got, opacus_reference(cfg["grad_mode"]))
        assert err < 1e-5, f"{cfg}: relative error {err:.2e}"


def test_two_stages_match_opacus():
    results = launch(__import__("workers").parity, 2, (GRID2, N), timeout_s=300)
    assert results[1] == [None] * len(GRID2)  # only rank 0 gets the gathered state
    check(GRID2, results[0])


def test_four_stages_and_2x2_mesh_match_opacus():
    results = launch(__import__("workers").parity, 4, (GRID4 + MESH, N), timeout_s=300)
    check(GRID4 + MESH, results[0])


def test_noisy_runs_reproduce_and_equal_in_process():
    from workers import noisy_run

    cfg = dict(stages=2, microbatches=3, schedule="1f1b")
    first = launch(noisy_run, 2, (3, cfg))[0]
    second = launch(noisy_run, 2, (3, cfg))[0]
    assert all(torch.equal(first[k], second[k]) for k in first)
    local = noisy_run(0, 3, dict(cfg, transport="inprocess"))
    assert max_relative_error(first, local) < 1e-12
    assert max_relative_error(first, make_model().state_dict()) > 1e-3  # noise really moved them


def test_replicas_whose_share_of_a_batch_runs_out_still_run_every_pass():
    """A 1-row batch over 2 replicas (replica 1 gets none) and, with 1-row passes, 3 rows (2 passes against 1): the
    short replica runs padding passes, so every pass's collectives meet (this hung before), and the update is the
    one-replica run's."""
    from workers import uneven_replicas

    sizes = [1, 3, 2]
    for options in (
        {"stages": 1, "replicas": 2},
        {"stages": 1, "replicas": 2, "microbatches": 1, "microbatch_size": 1},
    ):
        got = launch(uneven_replicas, 2, (options, sizes), timeout_s=120)[0]
        want = uneven_replicas(0, {"stages": 1, "transport": "inprocess"}, sizes)
        assert max_relative_error(got, want) < 1e-12, options
        assert max_relative_error(got, make_model().state_dict()) > 1e-5  # the steps moved the weights


def test_bf16_replicas_sum_every_clipped_sum_in_one_dtype_whoever_drew_its_noise():
    """bf16-true over 2 replicas: replica 0 starts its sums as the noise, in float32 (sum_dtype), and replica 1 has
    none for a parameter no sample touched (an empty batch: none is touched). Each sum must reach the all-reduce in
    the same dtype on both (gloo aborts the process on float32 against bf16), and the run equals one replica's."""
    from workers import bf16_replicas

    sizes = [0, 4]
    options = {"stages": 1, "replicas": 2, "microbatches": 1}
    got = launch(bf16_replicas, 2, (options, sizes), timeout_s=120)[0]
    want = bf16_replicas(0, {"stages": 1, "microbatches": 1, "transport": "inprocess"}, sizes)
    # to bf16's rounding: the replicas' float32 parts are added in another order than one replica's rows
    assert max_relative_error(got, want) < 1e-2
    assert max_relative_error(got, make_model().state_dict()) > 1e-3  # the noise moved the weights


def test_a_failing_rank_stops_every_rank_and_is_named():
    from workers import failing

    start = time.monotonic()
    failed = r"rank 1 failed: StepFailedError: rank 1 \(stage 1\) failed in a step: ValueError: boom"
    with pytest.raises(RankFailedError, match=failed) as info:
        # call 7: step 2's first micro-batch (step 1: 2 micro-batches + the self-check's 4 one-sample losses)
        launch(failing, 2, (1, 7), timeout_s=120, grace_s=2)
    assert time.monotonic() - start < 60
    assert info.value.rank == 1
    assert all(code not in (None, 0) for code in info.value.exitcodes), info.value.exitcodes


def test_ranks_with_different_configs_are_refused_at_start():
    from workers import mismatched

    with pytest.raises(RankFailedError, match=r"rank 1 has microbatches=8 but rank 0 has 4"):
        launch(mismatched, 2, timeout_s=120)


def test_kill_and_resume_equals_the_uninterrupted_run(tmp_path):
    from workers import fit_run

    straight_state, straight_eps = launch(fit_run, 2, (6, None, False))[0]
    with pytest.raises(RankFailedError, match="rank 1 failed: RuntimeError: killed after step 5"):
        launch(fit_run, 2, (6, str(tmp_path), False, 5), grace_s=1)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002", "step-00000004"]
    resumed_state, resumed_eps = launch(fit_run, 2, (6, str(tmp_path), True))[0]
    assert all(torch.equal(straight_state[k], resumed_state[k]) for k in straight_state)
    assert resumed_eps == straight_eps


@pytest.mark.parametrize("what", ["size", "contents"])
def test_ranks_with_different_batches_are_refused(what):
    from workers import mismatched_batch

    with pytest.raises(RankFailedError, match=r"ranks got different logical batches"):
        launch(mismatched_batch, 2, (what,), timeout_s=120)


def test_secure_mode_ranks_agree_on_the_batch():
    from workers import secure_fit

    steps = launch(secure_fit, 2, timeout_s=120)
    assert steps == [3, 3]


def test_torchrun_example_runs():
    import os
    import subprocess
    import sys

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
            os.path.join(root, "examples", "train_tiny_gpt.py"),
            "--steps",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=root,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "gathered" in out.stdout


def test_per_stage_clipping_in_processes_equals_in_process():
    from workers import parity

    cfg = dict(
        stages=2, microbatches=3, schedule="1f1b", grad_mode="ghost", clipping="per_stage", max_grad_norm=[0.02, 0.04]
    )
    got = launch(parity, 2, ([cfg], N), timeout_s=300)[0][0]
    want = parity(0, [dict(cfg, transport="inprocess")], N)[0]
    assert max_relative_error(got, want) < 1e-12
    assert max_relative_error(got, opacus_reference("ghost")) > 1e-6  # not flat clipping (equal runs agree to 1e-12)


def test_per_layer_clipping_in_processes_equals_in_process():
    from workers import parity

    cfg = dict(stages=2, microbatches=3, schedule="dp-zb", grad_mode="ghost", clipping="per_layer", max_grad_norm=0.05)
    got = launch(parity, 2, ([cfg], N), timeout_s=300)[0][0]
    want = parity(0, [dict(cfg, transport="inprocess")], N)[0]
    assert max_relative_error(got, want) < 1e-12
    assert max_relative_error(got, opacus_reference("ghost")) > 1e-6  # not flat clipping


def test_micro_batches_of_one_pass_may_send_other_shapes():
    """The transport joins header and payload once a shape is known; a micro-batch whose stage output has
    another width (data-dependent) is announced and sent anew, forward and backward. Oracle: the loop of
    batch-size-1 passes for the first step; the in-process run for two."""
    import copy

    from oracles import loop_clipped_sum
    from workers import variable_width_data, variable_width_model, variable_width_step

    model = variable_width_model()
    x, y = variable_width_data()
    want = loop_clipped_sum(
        copy.deepcopy(model), lambda o, t: torch.nn.functional.cross_entropy(o, t, reduction="none"), x, y, 0.1
    )
    trainer = PipelineDPTrainer(
        model,
        lambda o, t: torch.nn.functional.cross_entropy(o, t, reduction="none"),
        lambda p: torch.optim.SGD(p, lr=1.0),
        stages=2,
        microbatches=4,
        noise_multiplier=0.0,
        max_grad_norm=0.1,
        expected_batch_size=1,
        transport="inprocess",
    )
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    trainer.step(x, y)
    got = {k: before[k] - p.detach() for k, p in model.named_parameters()}
    assert max_relative_error(got, want) < 1e-10
    over_processes = launch(variable_width_step, 2, (), timeout_s=300)[0]
    assert max_relative_error(over_processes, variable_width_step(0, inprocess=True)) < 1e-12
