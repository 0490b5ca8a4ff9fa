"""The automatic split over real processes: several tensors crossing, stage-local weight loading."""

import pytest
import torch

from pipedp import PipelineDPTrainer
from pipedp.models import token_loss
from pipedp.runtime.launch import launch

pytestmark = pytest.mark.dist


def test_a_traced_model_over_two_processes_equals_the_in_process_run():
    from oracles import max_relative_error
    from workers import traced_step

    got = launch(traced_step, 2, (), timeout_s=300)[0]
    assert max_relative_error(got, traced_step(0, inprocess=True)) < 1e-12


def test_several_tensors_cross_between_two_processes_as_in_one():
    """Two inputs as a dict; a tuple of float and integer tensors crosses the cut (the gradient message
    back holds the float ones only); the in-process run is itself checked against the loop oracle."""
    from oracles import max_relative_error
    from workers import traced_masked_step

    got = launch(traced_masked_step, 2, (), timeout_s=300)[0]
    assert max_relative_error(got, traced_masked_step(0, inprocess=True)) < 1e-12


def test_each_process_loads_only_its_stage_of_a_traced_model(tmp_path):
    """Built on the meta device, each rank reads its own tensors from a safetensors file; the step equals
    the one of the whole model in one process."""
    from loop_models import MaskedNet
    from oracles import max_relative_error
    from safetensors.torch import save_file
    from workers import traced_stage_step

    torch.manual_seed(0)
    whole = MaskedNet().double()
    save_file(whole.state_dict(), str(tmp_path / "weights.safetensors"))
    results = launch(traced_stage_step, 2, (str(tmp_path / "weights.safetensors"),), timeout_s=300)
    total = sum(p.numel() * p.element_size() for p in whole.parameters())
    assert all(0 < resident < total for resident, _ in results)
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, 11, (6, 5), generator=g)
    trainer = PipelineDPTrainer(
        whole,
        token_loss,
        lambda p: torch.optim.SGD(p, lr=0.5),
        stages=2,
        microbatches=2,
        noise_multiplier=0.0,
        max_grad_norm=0.1,
        expected_batch_size=6,
        transport="inprocess",
    )
    trainer.step({"ids": ids, "mask": torch.ones_like(ids)}, torch.randint(0, 11, (6, 5), generator=g))
    assert max_relative_error(results[0][1], trainer.state_dict()) < 1e-12


def test_the_torchrun_example_of_the_automatic_split_runs():
    import os
    import subprocess
    import sys

    from pipedp.runtime.launch import free_port

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
            os.path.join(root, "examples", "auto_split.py"),
            "--steps",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=root,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "partition: blocks per stage" in out.stdout and "step   3" in out.stdout


def test_each_process_loads_its_stage_of_a_tied_model_and_the_tie_holds(tmp_path):
    """The head shares the embedding's weight; materializing a stage replaces parameters, and the tie is
    restored, so the cross-stage tie is trained exactly: equal to the whole model's step in one process
    (itself checked against the loop oracle in tests/numerics/test_traced_split.py)."""
    from loop_models import TiedLM
    from oracles import max_relative_error
    from safetensors.torch import save_model
    from workers import tied_stage_step, tied_step

    torch.manual_seed(0)
    whole = TiedLM().double()
    save_model(whole, str(tmp_path / "tied.safetensors"))
    got = launch(tied_stage_step, 2, (str(tmp_path / "tied.safetensors"),), timeout_s=300)[0]
    assert max_relative_error(got, tied_step(whole, transport="inprocess")) < 1e-12
