"""Functions run on each rank by the multi-process tests (importable by spawned children)."""

import os
import signal
import time

import torch

from pipedp import PipelineDPTrainer
from pipedp.models import GPTConfig, tiny_gpt, token_loss

CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=3)
LR, CLIP = 0.5, 0.05


def make_model():
    torch.manual_seed(7)
    return tiny_gpt(CFG).double()


def make_batch(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, CFG.vocab_size, (n, CFG.seq_len), generator=g)
    y = torch.randint(0, CFG.vocab_size, (n, CFG.seq_len), generator=g)
    return x, y


def make_trainer(model, **kw):
    args = dict(noise_multiplier=0.0, max_grad_norm=CLIP, expected_batch_size=13, seed=0)
    args.update(kw)
    return PipelineDPTrainer(model, token_loss, lambda p: torch.optim.SGD(p, lr=LR), **args)


def parity(rank, configs, n):
    """One step per configuration; rank 0 returns the gathered state dicts."""
    x, y = make_batch(n)
    out = []
    for cfg in configs:
        trainer = make_trainer(make_model(), expected_batch_size=n, **cfg)
        trainer.step(x, y)
        out.append(trainer.state_dict())
    return out


def noisy_run(rank, steps, cfg):
    """A few noisy steps on changing batch sizes; rank 0 returns the final state dict."""
    trainer = make_trainer(make_model(), noise_multiplier=1.0, **cfg)
    for step in range(steps):
        trainer.step(*make_batch(9 + 3 * step, seed=step))
    return trainer.state_dict()


def failing(rank, fail_rank, at_call):
    calls = {"n": 0}

    def loss(out, y):
        calls["n"] += 1
        if rank == fail_rank and calls["n"] == at_call:
            raise ValueError("boom: a bad batch on purpose")
        return token_loss(out, y)

    trainer = PipelineDPTrainer(
        make_model(), loss, stages=2, microbatches=2, noise_multiplier=0.0, expected_batch_size=8
    )
    for step in range(3):
        trainer.step(*make_batch(8, seed=step))
    return "finished"


def _fails_once(owner, name, what, when=lambda: True):
    """``owner.name`` raises RuntimeError("planted: " + ``what``) at its first call where ``when()`` holds, and is
    the real one again from then on (before: the real one)."""
    real = getattr(owner, name)

    def planted(*args, **kwargs):
        if not when():
            return real(*args, **kwargs)
        setattr(owner, name, real)
        raise RuntimeError(f"planted: {what}")

    setattr(owner, name, planted)


def failed_step(rank, schedule, bad_stage, how="batch", first=False):
    """A bad batch at the second step (stage 0: a token id past the vocabulary; stage 1: a label past it), or
    (``how="noise"``) the bad stage's noise draw raising as out of memory, before its first receive (before its
    first W in the run's first, self-checked, step: ``first``), or (``how="start"``) its pass's start raising so,
    before its first action (``how="probe"``: in the self-check's probe, with ``first``); then the good steps; and
    the same good steps never failed. Returns (each call's error or None, seconds the failed step took, the failed
    run's and the straight run's state on rank 0)."""
    good = [make_batch(8, seed=1), make_batch(8, seed=2)]
    x, y = make_batch(8, seed=3)
    if how == "batch":
        (x if bad_stage == 0 else y)[2, 3] = CFG.vocab_size + 7
    kw = dict(stages=2, microbatches=2, schedule=schedule, noise_multiplier=1.0, timeout=30)
    trainer = make_trainer(make_model(), **kw)
    if not first:
        trainer.step(*good[0])
    stage = trainer.runtime.local_stages[0]
    if rank == bad_stage and how == "noise":  # (a call with no noise set draws nothing: the next one raises)
        _fails_once(stage, "draw_noise", "out of memory while drawing the noise", when=lambda: stage.noise is not None)
    if rank == bad_stage and how == "start":  # the last thing Executor.start_pass does
        _fails_once(stage, "watch_values", "out of memory while starting the pass")
    if rank == bad_stage and how == "probe":  # the self-check's probe, made as the pass starts
        _fails_once(stage.check, "probe_for", "out of memory while probing")
    start = time.monotonic()
    try:
        trainer.step(x, y)
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - start
    for batch in good if first else good[1:]:
        trainer.step(*batch)
    straight = make_trainer(make_model(), **kw)
    for batch in good:
        straight.step(*batch)
    return error, took, trainer.state_dict(), straight.state_dict()


def failed_update(rank):
    """Rank 1's update raises (outside any pass: rank 0 is past it, in the loss total): rank 0 must learn it
    from the store at once; then every call on every rank is refused with that failure."""
    trainer = make_trainer(make_model(), stages=2, microbatches=2, timeout=30)
    trainer.step(*make_batch(8, seed=1))
    if rank == 1:
        stage = trainer.runtime.local_stages[0]

        def planted():
            raise RuntimeError("planted: this stage's update failed")

        stage.take_clipped_sum = planted
    out = {}
    start = time.monotonic()
    for what, call in [
        ("step", lambda: trainer.step(*make_batch(8, seed=2))),
        ("next step", lambda: trainer.step(*make_batch(8, seed=3))),
        ("state_dict", trainer.state_dict),
        ("checkpoint", lambda: trainer.save_checkpoint(os.path.join(os.environ["PIPEDP_TEST_DIR"], "ck"))),
    ]:
        try:
            call()
            out[what] = None
        except Exception as exc:
            out[what] = f"{type(exc).__name__}: {exc}"
    out["seconds"] = time.monotonic() - start
    return out


def failed_pass_state(rank, bad_rank):
    """``bad_rank``'s pass fails before its state exists (planted: PassState raises once, at the second step): that pass
    cannot be drained, so the run is refused on every rank (the peer by its timeout). Returns each call's error and
    the seconds."""
    from pipedp.runtime import executor

    trainer = make_trainer(make_model(), stages=2, microbatches=2, timeout=10)
    trainer.step(*make_batch(8, seed=1))
    if rank == bad_rank:
        _fails_once(executor, "PassState", "the pass's state could not be made")
    out = {}
    start = time.monotonic()
    for what, batch in [("step", make_batch(8, seed=2)), ("next step", make_batch(8, seed=3))]:
        try:
            trainer.step(*batch)
            out[what] = None
        except Exception as exc:
            out[what] = f"{type(exc).__name__}: {exc}"
    out["seconds"] = time.monotonic() - start
    return out


def mismatched(rank):
    make_trainer(make_model(), stages=2, microbatches=4 if rank == 0 else 8)
    return "constructed"


def fit_run(rank, steps, checkpoint_dir, resume, die_at_step=None):
    """Poisson-sampled noisy training; optionally rank 1 dies right after step ``die_at_step``."""
    x, y = make_batch(120, seed=42)
    trainer = make_trainer(
        make_model(),
        stages=2,
        microbatches=2,
        noise_multiplier=1.0,
        sample_rate=0.08,
        expected_batch_size=10,
        accountant="rdp",
    )

    def maybe_die(step, loss, _):
        if rank == 1 and step == die_at_step:
            raise RuntimeError(f"killed after step {step}")

    trainer.fit(
        (x, y), steps=steps, checkpoint_dir=checkpoint_dir, checkpoint_every=2, resume=resume, callback=maybe_die
    )
    return trainer.state_dict(), trainer.epsilon(1e-5)


def node_local_fit(rank, checkpoint_dir):
    """fit() with checkpoints where rank 1 cannot see what rank 0 writes (as on another node with a node-local
    folder): rank 1's view of the folder misses every file rank 0 makes there."""
    real = os.path.exists
    if rank == 1:
        os.path.exists = lambda path: False if os.path.basename(path).startswith(".tmp-probe-") else real(path)
    try:
        fit_run(rank, 2, checkpoint_dir, False)
    finally:
        os.path.exists = real
    return "trained"


def hf_stage_step(rank, folder, stages):
    """Each rank materializes only its stage from the checkpoint, then one DP step."""
    from pipedp.split.hf_loading import load_pipeline_stage, resident_parameter_bytes

    model = load_pipeline_stage(folder, stages, rank % stages, untie_weights=True)
    resident = resident_parameter_bytes(model)
    trainer = PipelineDPTrainer(
        model,
        token_loss,
        lambda p: torch.optim.SGD(p, lr=0.5),
        stages=stages,
        microbatches=2,
        noise_multiplier=0.0,
        max_grad_norm=0.05,
        expected_batch_size=6,
        untie_weights=True,
    )
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 40, (6, 8), generator=g)
    trainer.step(x, torch.randint(0, 40, (6, 8), generator=g))
    return resident, trainer.state_dict()


def mismatched_batch(rank, what):
    trainer = make_trainer(make_model(), stages=2, microbatches=2)
    if what == "size":
        trainer.step(*make_batch(8 if rank == 0 else 9))
    else:
        trainer.step(*make_batch(8, seed=rank))
    return "stepped"


def secure_fit(rank):
    """Secure-mode sampling uses OS randomness; the batch check would refuse disagreeing ranks."""
    trainer = make_trainer(
        make_model(), stages=2, microbatches=2, noise_multiplier=1.0, sample_rate=0.2, secure_mode=True
    )
    trainer.fit(make_batch(40, seed=5), steps=3)
    return trainer.steps_taken


def signal_at_step(rank, signal_name, timeout):
    """Rank 1 sends itself ``signal_name`` (SIGSTOP: hangs; SIGKILL: dies) before its third step."""
    trainer = make_trainer(make_model(), stages=2, microbatches=2, timeout=timeout)
    for step in range(6):
        if rank == 1 and step == 2:
            os.kill(os.getpid(), getattr(signal, signal_name))
        trainer.step(*make_batch(8, seed=step))
    return "finished"


def sleep_and_report_pid(rank, folder):
    with open(os.path.join(folder, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
    return "slept"


def listening_addresses(pids):
    """The local addresses of the TCP sockets these processes listen on (from /proc, Linux)."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    out.append(fields[1].split(":")[0])
    return out


def report_listening_sockets(rank):
    import torch.distributed as dist

    dist.barrier()  # every rank is connected: all sockets are up
    return listening_addresses([os.getpid(), os.getppid()]) if rank == 0 else []


def report_rendezvous(rank):
    """The rendezvous file, its folder's permission bits, and the TCP ports the launcher (this rank's parent)
    and this rank listen on."""
    import stat

    import torch.distributed as dist

    path = os.environ["PIPEDP_RENDEZVOUS"]
    dist.barrier()  # every rank is connected: all sockets are up
    mode = stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode)
    return path, mode, listening_addresses([os.getppid()]), listening_addresses([os.getpid()])


def llama_export(rank, path):
    """One noisy DP step of a tiny Llama on 2 stages, then a Hugging Face folder written by rank 0."""
    import transformers
    from steps import tiny_llama_config  # here: some launches put only this folder on the path

    cfg = tiny_llama_config()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).double()
    kw = {} if path else {"transport": "inprocess"}
    trainer = PipelineDPTrainer(
        model,
        token_loss,
        lambda p: torch.optim.SGD(p, lr=0.5),
        stages=2,
        microbatches=2,
        noise_multiplier=1.0,
        seed=0,  # a given seed: the runs compared draw the same noise
        expected_batch_size=6,
        **kw,
    )
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 40, (6, 8), generator=g), torch.randint(0, 40, (6, 8), generator=g)
    trainer.step(x, y)
    if path:
        trainer.save_pretrained(path)
        return None
    return model(x).logits.detach()


def llama_padded_step(rank, inprocess=False):
    """One noisy step of a tiny Llama on a left-padded dict batch (input_ids + attention_mask)."""
    import transformers
    from steps import tiny_llama_config  # here: some launches put only this folder on the path

    cfg = tiny_llama_config()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).double()
    g = torch.Generator().manual_seed(2)
    ids, labels = torch.randint(1, 40, (5, 8), generator=g), torch.randint(1, 40, (5, 8), generator=g)
    mask = torch.ones(5, 8, dtype=torch.long)
    for i, pad in enumerate([0, 3, 5, 1, 2]):
        mask[i, :pad] = 0
    ids, labels = ids.masked_fill(mask == 0, 0), labels.masked_fill(mask == 0, -100)
    kw = {"transport": "inprocess"} if inprocess else {}
    trainer = PipelineDPTrainer(
        model,
        token_loss,
        lambda p: torch.optim.SGD(p, lr=0.5),
        stages=2,
        microbatches=2,
        noise_multiplier=1.0,
        seed=0,  # a given seed: the runs compared draw the same noise
        max_grad_norm=0.3,
        expected_batch_size=5,
        **kw,
    )
    trainer.step({"input_ids": ids, "attention_mask": mask}, labels)
    return trainer.state_dict()


def tied_llama_step(rank, noise, inprocess=False, bf16=False):
    """Two DP steps of a tiny Llama whose embedding is tied to its head, on 2 stages; ``bf16``: bf16-true, the first
    step on an empty batch (noise only: no sample touches the head's copy)."""
    import transformers
    from steps import tiny_llama_config  # here: some launches put only this folder on the path

    cfg = tiny_llama_config(tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).double()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randint(0, 40, (7, 8), generator=g), torch.randint(0, 40, (7, 8), generator=g)
    kw = {"transport": "inprocess"} if inprocess else {}
    if bf16:
        kw["precision"] = "bf16-true"
    trainer = PipelineDPTrainer(
        model,
        token_loss,
        lambda p: torch.optim.SGD(p, lr=1.0),
        stages=2,
        microbatches=3,
        noise_multiplier=noise,
        max_grad_norm=0.3,
        expected_batch_size=1,
        seed=0,  # a given seed: the runs compared draw the same noise
        **kw,
    )
    trainer.step(*((x[:0], y[:0]) if bf16 else (x, y)))
    trainer.step(x, y)  # a second step: the two copies must still be equal
    return trainer.state_dict()


def tied_llama_from_folder(rank, folder, inprocess=False):
    """A tied Llama read stage by stage from a local folder (each rank its own stage), one DP step."""
    from pipedp.split.hf_loading import load_local_model, load_pipeline_stage

    if inprocess:
        model = load_local_model(folder).double()
    else:
        model = load_pipeline_stage(folder, 2, rank).double()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 40, (6, 8), generator=g), torch.randint(0, 40, (6, 8), generator=g)
    kw = {"transport": "inprocess"} if inprocess else {}
    trainer = PipelineDPTrainer(
        model,
        token_loss,
        lambda p: torch.optim.SGD(p, lr=1.0),
        stages=2,
        microbatches=2,
        noise_multiplier=0.0,
        max_grad_norm=0.3,
        expected_batch_size=1,
        **kw,
    )
    trainer.step(x, y)
    return trainer.state_dict()


def traced_step(rank, inprocess=False):
    from loop_models import LoopNet

    torch.manual_seed(0)
    model = LoopNet().double()
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(7, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (7,), generator=g)
    kw = {"transport": "inprocess"} if inprocess else {}
    trainer = PipelineDPTrainer(
        model,
        lambda o, t: torch.nn.functional.cross_entropy(o, t, reduction="none"),
        lambda p: torch.optim.SGD(p, lr=0.5),
        stages=2,
        microbatches=2,
        noise_multiplier=1.0,
        seed=0,  # a given seed: the runs compared draw the same noise
        max_grad_norm=0.1,
        expected_batch_size=7,
        **kw,
    )
    trainer.step(x, y)
    return trainer.state_dict()


def traced_masked_step(rank, inprocess=False):
    """MaskedNet: a float stream, the embedding output, the mask and the ids cross the cut as a tuple."""
    from loop_models import MaskedNet

    torch.manual_seed(0)
    model = MaskedNet().double()
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 11, (7, 5), generator=g)
    mask = (torch.arange(5)[None, :] < torch.randint(1, 6, (7,), generator=g)[:, None]).long()
    y = torch.randint(0, 11, (7, 5), generator=g)
    kw = {"transport": "inprocess"} if inprocess else {}
    trainer = PipelineDPTrainer(
        model,
        token_loss,
        lambda p: torch.optim.SGD(p, lr=0.5),
        stages=2,
        microbatches=3,
        noise_multiplier=1.0,
        seed=0,  # a given seed: the runs compared draw the same noise
        max_grad_norm=0.1,
        expected_batch_size=7,
        **kw,
    )
    trainer.step({"ids": ids, "mask": mask}, y)
    return trainer.state_dict()


def traced_stage_step(rank, weights):
    """MaskedNet built on the meta device; each rank loads only its stage's tensors from ``weights``."""
    from loop_models import MaskedNet

    from pipedp import load_stage
    from pipedp.split.stage_loading import resident_parameter_bytes

    with torch.device("meta"):
        model = MaskedNet().double()
    load_stage(model, weights, 2, rank)
    resident = resident_parameter_bytes(model)
    trainer = PipelineDPTrainer(
        model,
        token_loss,
        lambda p: torch.optim.SGD(p, lr=0.5),
        stages=2,
        microbatches=2,
        noise_multiplier=0.0,
        max_grad_norm=0.1,
        expected_batch_size=6,
    )
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, 11, (6, 5), generator=g)
    trainer.step({"ids": ids, "mask": torch.ones_like(ids)}, torch.randint(0, 11, (6, 5), generator=g))
    return resident, trainer.state_dict()


def variable_width_model():
    """A stage output whose width depends on the data: the micro-batches of one pass send other shapes."""

    class Trim(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x)[:, : 4 if float(x[0, 0]) > 0 else 2]

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(1, 3)

        def forward(self, h):
            return self.lin(torch.tanh(h).sum(-1, keepdim=True))

    torch.manual_seed(0)
    return torch.nn.Sequential(Trim(), Head()).double()


def variable_width_data():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(8, 4, generator=g, dtype=torch.float64)
    # micro-batches of 2, both rows of one sign (so a sample alone gets its micro-batch's width): 4, 2, 2, 4
    x[:, 0] = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0, -1.0, 1.0, 1.0], dtype=torch.float64)
    return x, torch.randint(0, 3, (8,), generator=g)


def variable_width_step(rank, inprocess=False):
    model = variable_width_model()
    x, y = variable_width_data()
    kw = {"transport": "inprocess"} if inprocess else {}
    trainer = PipelineDPTrainer(
        model,
        lambda o, t: torch.nn.functional.cross_entropy(o, t, reduction="none"),
        lambda p: torch.optim.SGD(p, lr=1.0),
        stages=2,
        microbatches=4,
        noise_multiplier=0.0,
        max_grad_norm=0.1,
        expected_batch_size=1,
        **kw,
    )
    for _ in range(2):  # the second pass starts from what the first one learnt
        trainer.step(x, y)
    return trainer.state_dict()


def tied_stage_step(rank, weights):
    """TiedLM built on the meta device, each rank loading its stage; the tie spans the two stages."""
    from loop_models import TiedLM

    from pipedp import load_stage

    with torch.device("meta"):
        model = TiedLM().double()
    load_stage(model, weights, 2, rank)
    return tied_step(model)


def tied_step(model, **kw):
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, 11, (6, 5), generator=g)
    trainer = PipelineDPTrainer(
        model,
        token_loss,
        lambda p: torch.optim.SGD(p, lr=0.5),
        stages=2,
        microbatches=2,
        noise_multiplier=0.0,
        max_grad_norm=0.1,
        expected_batch_size=6,
        **kw,
    )
    trainer.step({"input_ids": ids, "mask": torch.ones_like(ids)}, torch.randint(0, 11, (6, 5), generator=g))
    return trainer.state_dict()


def time_first_rank(rank):
    """A model whose attention sees its input time-first, with T equal to the micro-batch size: the
    self-check's probes travel through the processes and the stage holding it refuses the model."""
    from opacus.layers import DPMultiheadAttention

    class TimeFirst(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.att = DPMultiheadAttention(8, 2, batch_first=False)

        def forward(self, x):
            h = x.transpose(0, 1)
            return self.att(h, h, h, need_weights=False)[0].transpose(0, 1)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), TimeFirst(), torch.nn.Linear(8, 5)).double()
    trainer = PipelineDPTrainer(
        model,
        lambda out, y: torch.nn.functional.cross_entropy(out.transpose(1, 2), y, reduction="none").mean(1),
        stages=2,
        microbatches=1,
        expected_batch_size=4,
        timeout=30,
    )
    g = torch.Generator().manual_seed(0)
    trainer.step(torch.randn(4, 4, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (4, 4), generator=g))


def tensor_parallel_llama(lora=False, **overrides):
    """The tensor-parallel tests' tiny Llama: 4 heads over 2 key-value heads (grouped), biased attention (a
    row-parallel bias), untied head, float64. ``lora``: PEFT LoRA (rank 3) on every projection, the base frozen,
    both factors random (PEFT starts B at zero, which would leave A's first gradient zero)."""
    import transformers
    from steps import tiny_llama_config  # here: some launches put only this folder on the path

    fields = dict(num_attention_heads=4, num_key_value_heads=2, attention_bias=True, tie_word_embeddings=False)
    fields.update(overrides)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config(**fields)).double()
    with torch.no_grad():  # trained norms, so that their gradients are not all alike
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    if lora:
        import peft

        projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = peft.get_peft_model(model, peft.LoraConfig(r=3, lora_alpha=6, target_modules=projections))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.3 * torch.randn_like(p))
    return model


def tensor_parallel_batch(n=6, seed=2):
    """A left-padded dict batch whose labels hold -100 at the padding and at a few real positions."""
    g = torch.Generator().manual_seed(seed)
    ids, labels = torch.randint(1, 40, (n, 8), generator=g), torch.randint(0, 40, (n, 8), generator=g)
    mask = torch.ones(n, 8, dtype=torch.long)
    for i in range(n):
        mask[i, : i % 4] = 0
    ids, labels = ids.masked_fill(mask == 0, 0), labels.masked_fill(mask == 0, -100)
    labels[:, -1] = -100
    return {"input_ids": ids, "attention_mask": mask}, labels


def tensor_parallel_steps(rank, steps, options, plant=None, checkpoint=None, first_step=0):
    """``steps`` DP steps of the tiny Llama under ``options`` (stages, tensor_parallel, clipping, noise...);
    returns the state dict (rank 0), this rank's parameters every rank holds whole (their sameness) and the shapes
    of all it holds.
    ``plant``: a bug put in on purpose, which the tests must catch; ``checkpoint``: (folder, "save" after the steps
    or "load" before them; SGD with momentum then, whose buffers are split as their parameters);
    ``first_step``: the first step's batch."""
    if plant is not None:
        _plant(plant)
    args = dict(noise_multiplier=0.0, max_grad_norm=0.05, expected_batch_size=6, seed=0, microbatches=2)
    args.update(options)
    folder, unread = args.pop("folder", None), None
    model = tensor_parallel_llama(**args.pop("model", {}))
    if folder is not None:  # this rank's stage from the saved model, its split layers read slice by slice
        from pipedp.split.hf_loading import load_pipeline_stage

        stages, tp = args.get("stages", 1), args["tensor_parallel"]
        model = load_pipeline_stage(folder, stages, (rank // tp) % stages, tensor_parallel=tp).double()
        unread = {n for n, p in model.named_parameters() if p.is_meta}
    momentum = 0.9 if checkpoint is not None else 0.0
    optimizer = args.pop("optimizer", lambda p: torch.optim.SGD(p, lr=0.5, momentum=momentum))
    # pipedp's token_loss: on the head's vocabulary slices; the user's own loss: on the gathered logits
    loss = (lambda logits, y: token_loss(logits, y)) if args.pop("user_loss", False) else token_loss
    trainer = PipelineDPTrainer(model, loss, optimizer, **args)
    if checkpoint is not None and checkpoint[1] == "load":
        trainer.load_checkpoint(checkpoint[0])
    for step in range(first_step, first_step + steps):
        trainer.step(*tensor_parallel_batch(seed=2 + step))
    if checkpoint is not None and checkpoint[1] == "save":
        trainer.save_checkpoint(checkpoint[0])
    stage = trainer.runtime.local_stages[0]
    names = stage.names()
    whole = {names[id(p)]: p.detach().clone() for p in stage.parameters if id(p) not in stage.tensor_parallel.shards}
    shapes = {names[id(p)]: tuple(p.shape) for p in stage.parameters}
    if folder is not None:
        return trainer.state_dict(), whole, shapes, unread
    return trainer.state_dict(), whole, shapes


def traced_tensor_parallel_steps(rank, steps, options, plant=None):
    """``steps`` DP steps (noise 0) of loop_models.GatedNet, traced, split by the pass over its blocks' graphs;
    returns the state dict, this rank's whole parameters (for their sameness) and the names of those it holds a
    slice of."""
    from loop_models import GatedNet

    if plant == "a whole operand mixed with a slice":  # the pass would keep x * (a whole value) a slice
        from pipedp.parallel import traced_plan

        traced_plan._only_slices = lambda inputs, from_slices: True
    torch.manual_seed(0)
    model = GatedNet(**options.pop("model", {})).double()
    args = dict(noise_multiplier=0.0, max_grad_norm=0.05, expected_batch_size=6, seed=0, microbatches=2)
    args.update(options)
    trainer = PipelineDPTrainer(model, token_loss, lambda p: torch.optim.SGD(p, lr=0.5), **args)
    for step in range(steps):
        trainer.step(*traced_tensor_parallel_batch(seed=2 + step))
    stage = trainer.runtime.local_stages[0]
    names = stage.names()
    whole = {names[id(p)]: p.detach().clone() for p in stage.parameters if id(p) not in stage.tensor_parallel.shards}
    return (
        trainer.state_dict(),
        whole,
        sorted(names[id(p)] for p in stage.parameters if id(p) in stage.tensor_parallel.shards),
    )


def traced_tensor_parallel_batch(n=6, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 12, (n, 5), generator=g), torch.randint(0, 12, (n, 5), generator=g)


def _plant(bug):
    """The bugs the tensor-parallel tests must catch."""
    from pipedp.privacy import noise
    from pipedp.runtime import stage as stage_module
    from pipedp.shards import TensorParallelPart

    if bug == "norm counted on every rank":
        TensorParallelPart.counts = lambda self, p: True
    elif bug == "slice norm left out":
        TensorParallelPart.counts = lambda self, p: self.rank == 0 and id(p) not in self.shards
    elif bug == "a whole sum differs on rank 1":  # as a norm over a rank's own heads would make it
        take = stage_module.Stage.take_clipped_sum

        def skewed(self):
            grads = take(self)
            if self.tensor_parallel.rank == 1:
                for p, g in zip(self.parameters, grads):
                    if id(p) not in self.tensor_parallel.shards:
                        g.add_(1e-3)
            return grads

        stage_module.Stage.take_clipped_sum = skewed
    elif bug == "a LoRA B without its copy":  # A's gradient then each rank's part of it
        import torch.nn.functional as F

        from pipedp.parallel.layers import ColumnParallelLinear

        split = ColumnParallelLinear.split.__func__

        def uncopied(cls, layer, group):
            layer = split(cls, layer, group)
            if layer.in_features == 3:  # a LoRA B (rank 3)
                layer.forward = lambda x: F.linear(x, layer.weight, layer.bias)
            return layer

        ColumnParallelLinear.split = classmethod(uncopied)
    elif bug == "the loss without the -100 mask":
        from pipedp.parallel import loss as loss_module

        def unmasked(self, logits, targets):  # loss.py's arithmetic with every token counted
            z, t = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
            with torch.no_grad():
                top = z.max(-1).values
                self.head.group.all_reduce(top, torch.distributed.ReduceOp.MAX)
            shifted = z - top.unsqueeze(-1)
            total = loss_module.reduce(shifted.exp().sum(-1), self.head.group)
            local = t - self.head.start
            mine = (local >= 0) & (local < z.shape[-1])
            picked = shifted.gather(1, local.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1) * mine
            return (total.log() - loss_module.reduce(picked, self.head.group)).view(targets.shape).mean(1)

        loss_module.VocabParallelTokenLoss.__call__ = unmasked
    elif bug == "rank 1 fails in a forward":
        forward = stage_module.Stage.forward

        def failing(self, *args, **kwargs):
            if self.tensor_parallel.rank == 1:
                raise RuntimeError("boom: a forward that fails on one tensor-parallel rank")
            return forward(self, *args, **kwargs)

        stage_module.Stage.forward = failing
    elif bug == "noise divided by T":
        add = noise.add_noise

        def divided(grads, names, std, *rest, **kw):
            shards = rest[3] if len(rest) > 3 else kw.get("shards")
            return add(grads, names, std / 2 if shards and any(shards) else std, *rest, **kw)

        import pipedp.train.trainer as trainer_module

        trainer_module.add_noise = divided


def moe_model():
    """The tests' tiny Mixtral (4 experts, top 2, eager experts: float64), from tests/hf_families.py."""
    import transformers
    from hf_families import Family, tiny_config

    torch.manual_seed(0)
    config = tiny_config(Family("mixtral"))
    return transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager").double()


def moe_step(rank, options):
    """One DP step (noise 0) of the tiny Mixtral under ``options`` (stages, replicas); the state dict."""
    model = moe_model()
    args = dict(noise_multiplier=0.0, max_grad_norm=0.05, expected_batch_size=6, seed=0, microbatches=2)
    args.update(options)
    trainer = PipelineDPTrainer(model, token_loss, lambda p: torch.optim.SGD(p, lr=0.5), **args)
    trainer.step(*tensor_parallel_batch(seed=2))
    return trainer.state_dict()


def sharded_fit(rank, options, steps, checkpoint_dir=None, resume=False):
    """Noisy Poisson-sampled training with AdamW (two param groups: weight decay on matrices only) and an LR
    schedule under ``options`` (stages, replicas, shard_optimizer); the final state dict (rank 0), epsilon, and the
    bytes of this rank's optimizer state after the first step (by a hook, before any checkpoint reload)."""
    x, y = make_batch(120, seed=42)

    def adamw(params):
        decay = [p for p in params if p.dim() > 1]
        rest = [p for p in params if p.dim() <= 1]
        return torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=0.05, weight_decay=0.1)

    trainer = PipelineDPTrainer(
        make_model(),
        token_loss,
        adamw,
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)),
        microbatches=2,
        noise_multiplier=1.0,
        max_grad_norm=CLIP,
        sample_rate=0.08,
        expected_batch_size=10,
        accountant="rdp",
        seed=0,
        **options,
    )
    held = {}

    def measure(step, loss, t):
        if "bytes" not in held:
            held["bytes"] = sum(
                v.numel() * v.element_size()
                for opt in t.state.optimizers
                if opt is not None
                for s in opt.state.values()
                for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0
            )

    trainer.fit((x, y), steps=steps, checkpoint_dir=checkpoint_dir, checkpoint_every=2, resume=resume, callback=measure)
    local = [p.detach().clone() for stage in trainer.runtime.local_stages for p in stage.parameters]
    return trainer.state_dict(), trainer.epsilon(1e-5), held.get("bytes"), local


def uneven_replicas(rank, options, sizes):
    """DP steps (noise 0) on logical batches of ``sizes`` rows, some smaller than the replica count or splitting into
    unequal pass counts; the final state dict (rank 0)."""
    trainer = make_trainer(make_model(), **options)
    for step, n in enumerate(sizes):
        trainer.step(*make_batch(n, seed=step))
    return trainer.state_dict()


def bf16_replicas(rank, options, sizes):
    """Noisy bf16-true steps on logical batches of ``sizes`` rows (0: a noise-only update, where no sample touches
    any sum); the final state dict (rank 0)."""
    trainer = make_trainer(make_model(), precision="bf16-true", noise_multiplier=1.0, **options)
    for step, n in enumerate(sizes):
        trainer.step(*make_batch(n, seed=step))
    return trainer.state_dict()


def host_staged(rank, worker, *args):
    """``worker(rank, *args)`` with this rank's wire staged through host memory as it is where a stage sits on a GPU
    under gloo (here the stage is on the CPU, so the copies are CPU to CPU), and every tensor pipedp hands
    torch.distributed checked to be one the wire made: a call that bypassed the wire would hand gloo a GPU
    pointer. Returns the worker's result and how many calls were checked."""
    import torch.distributed as dist

    from pipedp import wire

    made = set()  # storages of the tensors the wire made
    alive = []  # ... kept, so that no address of theirs is reused by a tensor that bypassed the wire
    checked = {"calls": 0}
    for name in ("empty", "copy", "out"):  # (staged, out always copies)
        real = getattr(wire.Wire, name)

        def making(self, *a, _real=real, **k):
            out = _real(self, *a, **k)
            made.add(out.untyped_storage().data_ptr())
            alive.append(out)
            return out

        setattr(wire.Wire, name, making)
    wire.Wire.of = classmethod(lambda cls, device, backend: cls(device, staged=True))

    def tensors(value):
        if torch.is_tensor(value):
            return [value]
        if isinstance(value, (list, tuple)):
            return [t for v in value for t in tensors(v)]
        return []

    for name in ("isend", "send", "recv", "all_reduce", "broadcast", "reduce", "all_gather", "gather"):
        real = getattr(dist, name)

        def checking(*a, _real=real, _name=name, **k):
            handed = tensors(list(a) + list(k.values()))
            stray = [tuple(t.shape) for t in handed if t.untyped_storage().data_ptr() not in made]
            assert not stray, f"dist.{_name} got tensors the wire did not make: {stray}"
            checked["calls"] += 1
            return _real(*a, **k)

        setattr(dist, name, checking)
    return worker(rank, *args), checked["calls"]
