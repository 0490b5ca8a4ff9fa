"""``pipedp train``: resolve the job once, then run it on every rank (own processes or torchrun)."""
from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch

from .data import CharTokenizer, generated_corpus, read_text, windows
from .errors import PipeDPError

DEFAULT_STEPS = 300


@dataclass
class Job:
    """Everything a rank needs, resolved and validated before any process starts."""

    model: str
    data: Optional[str]
    stages: int
    replicas: int
    schedule: str
    microbatches: int
    microbatch_size: Optional[int]
    grad_mode: str
    sample_rate: float
    expected_batch_size: int
    noise_multiplier: float
    delta: float
    max_grad_norm: float
    clipping: str
    max_epsilon: Optional[float]
    accountant: str
    steps: int
    lr: float
    seq_len: int
    seed: int
    checkpoint_dir: Optional[str]
    checkpoint_every: int
    resume: bool
    threads: int
    progress: bool
    inprocess: bool
    num_examples: int = 0
    notes: list = field(default_factory=list)


def load_dataset(job: Job):
    """(inputs, targets, vocab_size or None) — deterministic, so every rank builds the same one."""
    text = read_text(job.data) if job.data else generated_corpus(seed=job.seed)
    if job.model != "tiny-gpt":
        from .hf import tokenize_for_model

        x, y = windows(tokenize_for_model(job.model, text), job.seq_len)
        return x, y, None
    tok = CharTokenizer.fit(text)
    x, y = windows(tok.encode(text), job.seq_len)
    return x, y, tok.vocab_size


def build_model(job: Job, vocab_size: Optional[int], rank: int):
    if job.model == "tiny-gpt":
        from .models import GPTConfig, tiny_gpt

        torch.manual_seed(job.seed)
        return tiny_gpt(GPTConfig(vocab_size=vocab_size, seq_len=job.seq_len, d_model=64, n_heads=4, n_layers=4))
    from .hf import load_local_model, load_pipeline_stage

    if job.inprocess:
        return load_local_model(job.model)
    # each rank reads only its own stage's tensors from the checkpoint
    return load_pipeline_stage(job.model, job.stages, rank % job.stages, untie_weights=True)


def resolve(args) -> Job:
    if args.model != "tiny-gpt" and not os.path.isdir(args.model):
        raise FileNotFoundError(
            f"model {args.model!r} is neither 'tiny-gpt' nor a local folder: pass a Hugging Face model folder "
            "(with config.json and weights)"
        )
    if args.data is not None and not os.path.exists(args.data):
        raise FileNotFoundError(f"dataset {args.data!r} does not exist: pass a local .txt or .jsonl file")
    job = Job(
        model=args.model, data=args.data, stages=args.stages, replicas=args.replicas, schedule=args.schedule,
        microbatches=args.microbatches, microbatch_size=args.microbatch_size, grad_mode=args.grad_mode,
        sample_rate=0.0, expected_batch_size=0, noise_multiplier=1.0, delta=args.delta,
        max_grad_norm=args.max_grad_norm, clipping=args.clipping, max_epsilon=args.max_epsilon, accountant=args.accountant, steps=0,
        lr=args.lr, seq_len=args.seq_len, seed=args.seed, checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every, resume=args.resume, threads=args.threads,
        progress=not args.no_progress, inprocess=args.inprocess,
    )
    x, _, _ = load_dataset(job)
    n = len(x)
    job.num_examples = n
    if args.sample_rate is not None:
        if args.sample_rate > 1:
            raise ValueError(f"--sample-rate must be in (0, 1], got {args.sample_rate}")
        job.sample_rate = args.sample_rate
    else:
        if args.batch_size > n:
            raise ValueError(f"--batch-size {args.batch_size} is larger than the dataset ({n} sequences)")
        job.sample_rate = args.batch_size / n
    job.expected_batch_size = max(1, round(job.sample_rate * n))
    job.steps = args.steps or (math.ceil(args.epochs / job.sample_rate) if args.epochs else DEFAULT_STEPS)
    if args.target_epsilon is not None:
        from .accounting import calibrate_noise

        job.noise_multiplier = calibrate_noise(
            args.target_epsilon, args.delta, job.sample_rate, job.steps, None, args.accountant
        )
    elif args.noise_multiplier is not None:
        if args.noise_multiplier < 0:
            raise ValueError(f"--noise-multiplier must be >= 0, got {args.noise_multiplier}")
        job.noise_multiplier = args.noise_multiplier
    return job


def train_rank(rank: int, job: Job) -> dict:
    from tqdm import tqdm

    from .trainer import PipelineDPTrainer

    torch.set_num_threads(job.threads)
    lead = rank == 0
    if not lead:
        warnings.filterwarnings("ignore")
    x, y, vocab = load_dataset(job)
    model = build_model(job, vocab, rank)
    from .models import token_loss

    trainer = PipelineDPTrainer(
        model, token_loss, lambda params: torch.optim.Adam(params, lr=job.lr),
        stages=job.stages, microbatches=job.microbatches, schedule=job.schedule,
        noise_multiplier=job.noise_multiplier, max_grad_norm=job.max_grad_norm, clipping=job.clipping,
        expected_batch_size=job.expected_batch_size, sample_rate=job.sample_rate, grad_mode=job.grad_mode,
        seed=job.seed, accountant=job.accountant, microbatch_size=job.microbatch_size, replicas=job.replicas,
        transport="inprocess" if job.inprocess else "auto", delta=job.delta, max_epsilon=job.max_epsilon,
        untie_weights=job.model != "tiny-gpt",  # HF heads tied to embeddings sit on another stage
    )
    if lead:
        print(f"partition: {trainer.partition_report}", flush=True)
    start_step = 0
    has_checkpoint = job.checkpoint_dir and os.path.exists(os.path.join(job.checkpoint_dir, "latest"))
    if job.resume and has_checkpoint:
        trainer.load_checkpoint(job.checkpoint_dir)
        start_step = trainer.steps_taken
        if lead:
            print(f"resumed from step {start_step} in {job.checkpoint_dir}", flush=True)
    elif has_checkpoint and lead:
        print(f"{job.checkpoint_dir} already holds a checkpoint: starting afresh and overwriting it "
              "(pass --resume to continue it instead)", flush=True)
    bar = tqdm(total=job.steps, initial=start_step, disable=not (lead and job.progress), desc="DP training",
               unit="step", dynamic_ncols=True)
    state = {"samples": 0, "first_loss": None, "eps": 0.0}
    eps_every = max(1, job.steps // 15)
    t0 = time.perf_counter()

    def on_step(step, loss, tr):
        if not math.isnan(loss):
            state["first_loss"] = state["first_loss"] if state["first_loss"] is not None else loss
        state["samples"] += round(tr.last_batch_size)
        if step % eps_every == 0 or step == job.steps:
            state["eps"] = tr.epsilon(job.delta)
        rate = state["samples"] / max(1e-9, time.perf_counter() - t0)
        bar.set_postfix(loss=f"{loss:.3f}", eps=f"{state['eps']:.2f}", qps=f"{rate:.0f}")
        bar.update(1)

    result = trainer.fit((x, y), steps=job.steps, checkpoint_dir=job.checkpoint_dir,
                         checkpoint_every=job.checkpoint_every, callback=on_step)
    bar.close()
    elapsed = time.perf_counter() - t0
    summary = {
        "steps": result.steps, "epsilon": result.epsilon, "delta": job.delta, "loss": result.loss,
        "first_loss": state["first_loss"], "seconds": elapsed, "samples_per_s": state["samples"] / max(elapsed, 1e-9),
        "noise_multiplier": job.noise_multiplier, "stopped_by_budget": result.stopped_by_budget,
    }
    if lead:
        print(
            f"done: {result.steps} steps in {elapsed:.1f}s, {summary['samples_per_s']:.0f} samples/s | loss "
            f"{summary['first_loss'] if summary['first_loss'] is not None else float('nan'):.3f} -> {result.loss:.3f} | "
            f"epsilon {result.epsilon:.3f} at delta {job.delta:g} (noise multiplier {job.noise_multiplier:.3f}, "
            f"sample rate {job.sample_rate:.4f}, {job.accountant})"
            + (f"\ncheckpoint: {job.checkpoint_dir}" if job.checkpoint_dir else "")
            + (f"\nstopped: {result.stopped_by_budget}" if result.stopped_by_budget else ""),
            flush=True,
        )
    return summary


def run(args) -> int:
    from .launch import init_from_env, launch

    job = resolve(args)
    world = job.stages * job.replicas
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ and not job.inprocess
    if under_torchrun:
        if int(os.environ["WORLD_SIZE"]) != world:
            raise PipeDPError(
                f"torchrun started {os.environ['WORLD_SIZE']} processes but --stages {job.stages} x --replicas "
                f"{job.replicas} = {world}: use torchrun --nproc_per_node {world}"
            )
        init_from_env()
        train_rank(int(os.environ["RANK"]), job)
        return 0
    if job.inprocess or world == 1:
        if job.replicas > 1:
            raise PipeDPError("--replicas > 1 needs one process per (stage, replica): drop --inprocess")
        job.inprocess = True
        train_rank(0, job)
        return 0
    print(f"pipedp: launching {world} processes ({job.stages} stages x {job.replicas} replica"
          f"{'s' if job.replicas > 1 else ''}, gloo)", flush=True)
    launch(train_rank, world, (job,), timeout_s=24 * 3600, threads=job.threads)
    return 0
