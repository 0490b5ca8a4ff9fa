"""The CUDA paths, checked without a GPU: the device a run's ranks get (a pure function of the GPU count),
NCCL's settings (recorded through monkeypatched torch.distributed calls), and tensors made on their stage's
device (under FakeTensorMode a fake cuda tensor mixed with a real CPU one raises, as on a GPU)."""

from dataclasses import dataclass, field
from datetime import timedelta
from types import SimpleNamespace
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from pipedp import PipelineConfig
from pipedp.errors import ConfigError
from pipedp.runtime import distributed, launch, measure
from pipedp.runtime.placement import backend_for, local_device, place
from pipedp.wire import Wire


# ---- 1. where pipedp train puts the ranks ------------------------------------------------------------------
@pytest.mark.parametrize(
    "stages, replicas, device, gpus, inprocess, processes, backend, devices",
    [
        (2, 1, "auto", 0, False, True, "gloo", ("cpu", "cpu")),
        (2, 1, "auto", 0, True, False, None, ("cpu", "cpu")),
        (2, 1, "auto", 2, False, True, "nccl", ("cuda:0", "cuda:1")),
        (2, 2, "auto", 8, False, True, "nccl", ("cuda:0", "cuda:1", "cuda:2", "cuda:3")),
        (2, 1, "auto", 1, False, False, None, ("cuda:0", "cuda:0")),
        (3, 1, "auto", 2, False, False, None, ("cuda:0", "cuda:0", "cuda:1")),
        (4, 1, "auto", 2, False, False, None, ("cuda:0", "cuda:0", "cuda:1", "cuda:1")),
        (2, 1, "auto", 4, True, False, None, ("cuda:0", "cuda:1")),
        (1, 1, "auto", 1, False, False, None, ("cuda:0",)),
        (2, 1, "cpu", 4, False, True, "gloo", ("cpu", "cpu")),
        (2, 1, "cuda", 2, False, True, "nccl", ("cuda:0", "cuda:1")),
        (2, 2, "auto", 3, False, True, "gloo", ("cuda:0", "cuda:1", "cuda:2", "cuda:0")),  # shared, host-staged
        (1, 2, "auto", 1, False, True, "gloo", ("cuda:0", "cuda:0")),
    ],
)
def test_placement(stages, replicas, device, gpus, inprocess, processes, backend, devices):
    got = place(stages, replicas, device, gpus, inprocess)
    assert (got.processes, got.backend, got.devices) == (processes, backend, devices)
    assert got.describe().startswith("pipedp: ")


@pytest.mark.parametrize("stages, replicas, gpus", [(s, r, g) for s in (1, 2, 3, 5) for r in (1, 2) for g in (1, 2, 4)])
def test_with_gpus_never_on_the_cpu_and_never_two_nccl_ranks_on_one_gpu(stages, replicas, gpus):
    got = place(stages, replicas, "auto", gpus)
    assert all(d.startswith("cuda:") and int(d[5:]) < gpus for d in got.devices)
    if got.backend == "nccl":  # NCCL cannot put two ranks on one GPU
        assert len(set(got.devices)) == len(got.devices)
    if got.shared:  # more ranks than GPUs: over gloo, and said so
        assert got.backend == "gloo" and len(got.devices) > gpus and "host memory" in got.describe()


def test_refusals_name_the_fix():
    with pytest.raises(ConfigError, match="--device cpu"):
        place(2, 1, "cuda", 0)
    with pytest.raises(ConfigError, match="device"):
        place(2, 1, "tpu", 0)


@dataclass(frozen=True)
class _Job:  # the fields pipedp.cli.job.run reads
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    inprocess: bool = False
    resume: bool = False
    run_dir: str = ""
    resume_notes: tuple = ()
    export_merged: Optional[str] = None


@pytest.mark.parametrize(
    "gpus, flag, replicas, want",
    [
        (2, "auto", 1, ("launch", "nccl", "auto")),
        (0, "auto", 1, ("launch", "gloo", "auto")),
        (4, "cpu", 1, ("launch", "gloo", "cpu")),
        (1, "auto", 1, ("inprocess", ("cuda:0", "cuda:0"))),
        (1, "auto", 2, ("launch", "gloo", "cuda")),  # 4 ranks share the GPU: their stages on it, not the CPU
    ],
)
def test_pipedp_train_uses_the_gpus_it_finds(monkeypatch, capsys, gpus, flag, replicas, want):
    from pipedp.cli import job as cli_job
    from pipedp.cli import preflight, record

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    the_job = _Job(pipeline=PipelineConfig(stages=2, replicas=replicas, device=flag))
    monkeypatch.setattr(preflight, "resolve", lambda args, say, lead, **kw: the_job)
    monkeypatch.setattr(
        record, "RunFolder", lambda path: SimpleNamespace(write_config=lambda *a: None, clear_record=lambda: None)
    )
    monkeypatch.setattr(cli_job, "_print_job", lambda job: None)
    got = []
    monkeypatch.setattr(
        cli_job, "_launch", lambda job, world, backend: got.append(("launch", backend, job.pipeline.device)) or 0
    )
    monkeypatch.setattr(
        cli_job, "train_rank", lambda rank, job: got.append(("inprocess", job.pipeline.devices)) or {"loss": 0.0}
    )
    monkeypatch.setattr(cli_job, "exit_code", lambda summary: 0)
    monkeypatch.setattr(preflight, "flags_of", lambda args: {})
    assert cli_job.run(SimpleNamespace(inprocess=False, resume=False)) == 0
    assert got == [want]
    said = capsys.readouterr().out
    assert ("nccl" in said) == (want[1] == "nccl") and ("cuda:0" in said) == (gpus > 0 and flag != "cpu")


def test_the_device_flag_comes_from_the_config():
    from pipedp.cli.main import parse

    assert parse(["train", "--device", "cpu"]).device == "cpu"
    assert parse(["train"]).device == "auto"
    with pytest.raises(SystemExit):
        parse(["train", "--device", "gpu"])


def test_device_contradicting_devices_is_refused():
    with pytest.raises(ConfigError, match="device 'cpu'"):
        PipelineConfig(stages=2, device="cpu", devices=("cuda:0", "cuda:1")).validate()
    PipelineConfig(stages=2, device="cuda", devices=("cuda:0", "cuda:1")).validate()


def test_in_process_device_cuda_refuses_a_model_on_the_cpu():
    from pipedp import PipelineDPTrainer

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with pytest.raises(ConfigError, match="device 'cuda' but stage 0 on cpu"):
        PipelineDPTrainer(
            model,
            nn.CrossEntropyLoss(reduction="none"),
            lambda p: torch.optim.SGD(p, lr=0.1),
            stages=2,
            device="cuda",
            transport="inprocess",
            expected_batch_size=4,
            noise_multiplier=0.0,
        )


# ---- 3. a rank's GPU under NCCL ---------------------------------------------------------------------------
def test_local_device():
    assert local_device(1, 2, 2) == 1
    assert local_device(0, 1, 2, masked=True) == 0  # CUDA_VISIBLE_DEVICES gives each process its own GPU
    with pytest.raises(ConfigError, match="NCCL cannot put two ranks on one GPU"):
        local_device(1, 1, 2)  # the old LOCAL_RANK % device_count() put both on cuda:0
    with pytest.raises(ConfigError, match="--nproc_per_node 2"):
        local_device(0, 2, 3)
    with pytest.raises(ConfigError, match="gloo"):
        local_device(0, 0, 1)


@pytest.fixture
def nccl_calls(monkeypatch):
    """torch.distributed's NCCL entry points recorded, on a machine with 2 (fake) GPUs."""
    calls = SimpleNamespace(init=[], groups=[], set_device=[])
    for key in launch.NCCL_FAULTS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", calls.set_device.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.init.append((a, k)))
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: calls.groups.append((a, k)))
    return calls


def test_init_from_env_nccl_own_gpu_and_timeouts(monkeypatch, nccl_calls):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    launch.init_from_env("nccl", timeout_s=7.0)
    assert nccl_calls.set_device == [1]
    ((args, kwargs),) = nccl_calls.init
    assert args == ("nccl",) and kwargs["timeout"] == timedelta(seconds=7.0)
    import os

    assert os.environ["TORCH_NCCL_BLOCKING_WAIT"] == "1" and os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"


def test_init_from_env_refuses_two_ranks_on_one_gpu_before_init(monkeypatch, nccl_calls):
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="NCCL cannot put two ranks"):
        launch.init_from_env("nccl", timeout_s=7.0)
    assert nccl_calls.init == []


def test_a_user_made_nccl_group_still_gets_the_local_ranks_gpu(monkeypatch, nccl_calls):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # nobody called set_device
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert distributed._device_for_backend() == torch.device("cuda", 1)
    assert nccl_calls.set_device == [1]
    with pytest.raises(ConfigError, match="gloo"):
        distributed._device_for_backend("cpu")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert distributed._device_for_backend() == torch.device("cpu")
    with pytest.raises(ConfigError, match="sees no CUDA device"):
        distributed._device_for_backend("cuda")  # (this CPU build: no GPU to share)


# ---- 4. several ranks on one GPU: gloo, every tensor crossing through host memory ----------------------------
@pytest.mark.parametrize(
    "device, gpus, ranks_here, masked, want",
    [
        ("auto", 0, 2, False, "gloo"),
        ("cpu", 4, 2, False, "gloo"),
        ("auto", 2, 2, False, "nccl"),
        ("cuda", 2, 2, False, "nccl"),
        ("cuda", 1, 2, False, "gloo"),  # shared: NCCL cannot put two ranks on one GPU
        ("cuda", 2, 3, False, "gloo"),
        ("cuda", 1, 2, True, "nccl"),  # CUDA_VISIBLE_DEVICES: each process sees its own GPU
        ("auto", 1, 2, False, "nccl"),  # refused by local_device before init, naming device='cuda'
    ],
)
def test_backend_for(device, gpus, ranks_here, masked, want):
    assert backend_for(device, gpus, ranks_here, masked) == want


def test_backend_for_refuses_cuda_without_a_gpu():
    with pytest.raises(ConfigError, match="sees no CUDA device"):
        backend_for("cuda", 0, 1)


def test_two_ranks_share_one_gpu_over_gloo_when_asked(monkeypatch, nccl_calls):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # nobody chose
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="device='cuda'"):  # auto: refused, naming the way to share
        launch.init_from_env(timeout_s=7.0)
    assert nccl_calls.init == []
    launch.init_from_env(timeout_s=7.0, device="cuda")
    ((args, _),) = nccl_calls.init
    assert args == ("gloo",) and nccl_calls.set_device == [0]
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert distributed._device_for_backend("cuda") == torch.device("cuda", 0)
    assert distributed._device_for_backend("auto") == torch.device("cpu")  # gloo, not asked: the CPU as before
    assert Wire.of(torch.device("cuda", 0), "gloo").staged and not Wire.of(torch.device("cuda", 0), "nccl").staged
    assert not Wire.of(torch.device("cpu"), "gloo").staged
    # a mixed backend: NCCL carries the CUDA tensors (each rank on its own GPU), gloo the CPU's
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    with pytest.raises(ConfigError, match="NCCL cannot put two ranks on one GPU"):  # (2 ranks here, 1 GPU)
        distributed._device_for_backend("auto")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1"), monkeypatch.setenv("LOCAL_RANK", "0")
    assert distributed._device_for_backend("auto") == torch.device("cuda", 0)
    assert distributed._device_for_backend("cpu") == torch.device("cpu")
    assert not Wire.of(torch.device("cuda", 0), "cpu:gloo,cuda:nccl").staged
    assert (
        Wire.of(torch.device("cuda", 0), "cpu:gloo,cuda:gloo").staged
        and Wire.of(torch.device("cuda"), "cpu:gloo").staged
    )


def test_every_group_waits_at_most_the_timeout(nccl_calls):
    wait = timedelta(seconds=11)
    distributed._create_groups(distributed.Mesh(2, 2, 0), wait, tied=True, across_stages=True)
    assert len(nccl_calls.groups) == 2 * 3 + 2 + 1 + 2
    assert all(kwargs.get("timeout") == wait for _, kwargs in nccl_calls.groups)


# ---- 2. every tensor on its stage's device -----------------------------------------------------------------
def test_fingerprint_on_the_tensors_device():
    with FakeTensorMode():
        t = torch.empty(5, 3, device="cuda:1")
        assert distributed._fingerprint_tensor(t).device == torch.device("cuda:1")
    t = torch.arange(6.0)
    assert distributed._fingerprint(t) == distributed._fingerprint(t.clone()) != distributed._fingerprint(t.flip(0))


def test_transport_messages_on_the_stage_device(monkeypatch):
    from pipedp.runtime.dist_transport import DistTransport, PipelineGroups
    from schedules import Kind

    sent = []
    monkeypatch.setattr(dist, "isend", lambda tensor, dst, group=None: sent.append(tensor) or SimpleNamespace())
    with FakeTensorMode():
        device = torch.device("cuda:1")
        transport = DistTransport(0, 0, None, 1, PipelineGroups(None, None, None), Wire(device))
        for mb in range(3):  # the first message (header, payload), then joined ones, then a new shape
            transport.send(Kind.SEND_F, mb, torch.empty(2, 4 if mb < 2 else 5, device=device))
        transport.send(Kind.SEND_F, 3, ())  # an empty message: a notice, then its header
    assert len(sent) == 2 + 1 + 1 + 2 + 2 and all(t.device == device for t in sent)


def test_a_staged_transport_hands_gloo_host_memory_only(monkeypatch):
    """A stage on a GPU over gloo: every send, receive buffer and reduction is on the host, and what arrives is
    on the stage's GPU (gloo reads a tensor's raw pointer: a GPU one would be read as host memory)."""
    from pipedp.runtime.dist_transport import DistTransport, PipelineGroups
    from schedules import Kind

    handed = []

    def recv(tensor, src, group=None):
        handed.append(tensor)
        inbox.pop(0)(tensor)

    monkeypatch.setattr(dist, "isend", lambda tensor, dst, group=None: handed.append(tensor) or SimpleNamespace())
    monkeypatch.setattr(dist, "recv", recv)
    monkeypatch.setattr(dist, "all_reduce", lambda t, **k: handed.append(t) or SimpleNamespace())
    groups = PipelineGroups(None, None, None)
    with FakeTensorMode():  # the sender's stage on a (fake) GPU: a tensor it hands gloo must be a host copy
        device = torch.device("cuda:1")
        sender = DistTransport(0, 0, None, 1, groups, Wire.of(device, "gloo"))
        for mb in range(2):  # the first message (header, payload), then a joined one
            sender.send(Kind.SEND_F, mb, torch.empty(2, 4, device=device))
        sender.norm_reduce_start(0, torch.zeros(2, dtype=torch.float64, device=device))
    assert len(handed) == 3 + 1 and all(t.device == torch.device("cpu") for t in handed)
    # the receiver's stage on the meta device, standing for a GPU (its headers must be read, so real): every
    # buffer gloo fills is on the host, and each payload arrives on the stage's device
    messages = [
        torch.tensor([0, 0, -1, 0, 2, 2, 4, 0, 0, 0, 0]),  # micro-batch 0's header: bare float32 [2, 4]
        torch.arange(8.0).view(2, 4),
        torch.cat(
            [
                torch.tensor([1, 0, -1, 0, 2, 2, 4, 0, 0, 0, 0]).view(torch.uint8),
                (8 + torch.arange(8.0)).view(torch.uint8),
            ]
        ),
    ]
    inbox = [lambda t, m=m: t.copy_(m.view_as(t)) for m in messages]
    handed.clear()
    receiver = DistTransport(1, 1, 0, None, groups, Wire(torch.device("meta"), staged=True))
    got = [receiver.recv(Kind.RECV_F, mb) for mb in range(2)]
    assert len(handed) == 3 and all(t.device == torch.device("cpu") for t in handed)
    assert all(g.device == torch.device("meta") and g.shape == (2, 4) for g in got)


def test_noise_generator_on_the_sums_device(monkeypatch):
    from pipedp.privacy import noise

    made = []
    real = torch.Generator

    def generator(device="cpu"):  # a meta device has no generator: record the device, draw on the CPU's
        made.append(torch.device(device))
        return real()

    monkeypatch.setattr(torch, "Generator", generator)
    g = torch.zeros(40, device="meta")
    noise.add_noise([g], ["w"], 1.0, seed=0, step=0)
    assert made == [torch.device("meta")]


def test_measured_costs_synchronise_cuda_and_put_the_factors_on_the_device(monkeypatch):
    events = []

    class FakeStage:  # records what the timing hands a stage (the backward cannot run on fake CUDA)
        def __init__(self, *args):
            self.device = torch.device("cuda:1")

        def forward(self, mb, x, size):
            events.append("forward")
            return x * 2

        def backward_input(self, mb, grad):
            events.append(("grad", grad.device))

        def weight(self, mb, factors):
            events.append(("factors", factors.device))

        def close(self):
            pass

    monkeypatch.setattr(measure, "Stage", FakeStage)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("sync", device)))
    with FakeTensorMode():
        measure._time_block(None, torch.empty(3, 4, device="cuda:1"), 3, True, "ghost", repeats=1)
    cuda = torch.device("cuda:1")
    one = [("sync", cuda), "forward", ("grad", cuda), ("factors", cuda), ("sync", cuda)]
    assert events == one * 2
    measure.synchronize(torch.device("cpu"))  # nothing to wait for on the CPU
    assert len(events) == 10


# ---- 6. full precision for the per-sample norms --------------------------------------------------------------
@pytest.fixture
def precision_restored():
    from pipedp.privacy.per_sample import _precision_settings

    settings = _precision_settings()
    saved = [read() for read, _, _ in settings]
    yield
    for (_, write, _), value in zip(settings, saved):
        write(value)


def _matmul_allows_tf32() -> bool:
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        return matmul.fp32_precision == "tf32"
    return torch.get_float32_matmul_precision() != "highest"


def test_full_precision_sets_and_restores(precision_restored):
    from pipedp.privacy.per_sample import full_precision

    torch.set_float32_matmul_precision("high")  # TF32 allowed, as many training scripts set it
    assert _matmul_allows_tf32()
    with full_precision():
        assert not _matmul_allows_tf32()
    assert _matmul_allows_tf32()
    assert torch.get_float32_matmul_precision() == "high"  # the user's own setting still reads back
    with pytest.raises(KeyError):
        with full_precision():
            raise KeyError("restored on an error too")
    assert _matmul_allows_tf32()


def test_the_norm_computations_run_in_full_precision(monkeypatch, precision_restored):
    from pipedp.privacy import per_sample

    seen = []

    def norms(layer, inputs, backprops, grams):
        seen.append(_matmul_allows_tf32())
        return {}

    def grads(layer, inputs, backprops):
        seen.append(_matmul_allows_tf32())
        return {}

    monkeypatch.setattr(per_sample, "rule_for", lambda layer: SimpleNamespace(norms=norms, grads=grads))
    torch.set_float32_matmul_precision("high")
    per_sample.ghost_squared_norms(nn.Linear(2, 2), (), torch.zeros(1))
    per_sample.per_sample_grads(nn.Linear(2, 2), (), torch.zeros(1))
    assert seen == [False, False]


# ---- 5. the planner's CUDA allowance --------------------------------------------------------------------------
def test_the_planner_adds_the_cuda_allowance():
    from pipedp.planner import report as plan

    assert plan.cuda_allowance(0) == plan.CUDA_CONTEXT_BYTES + plan.NCCL_BUFFER_BYTES
    gib = 1 << 30
    assert plan.cuda_allowance(10 * gib) == int(10 * gib * (1 + plan.ALLOCATOR_SLACK)) + plan.cuda_allowance(0)
