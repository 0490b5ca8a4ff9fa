"""``pipedp train``: resolve the job once, then run it on every rank (own processes or torchrun)."""

from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass, replace
from typing import Optional, Tuple

import torch

from ..config import PipelineConfig, PrivacyConfig, steps_for_epochs
from ..data import CharTokenizer, generated_corpus, read_text, windows
from ..errors import PipeDPError
from ..models import GPTConfig, tiny_gpt, token_loss
from ..privacy.accounting import calibrate_noise
from ..runtime.launch import init_from_env, launch
from ..runtime.process import settle_process
from ..split.adapters import model_blocks
from ..split.hf_loading import load_local_model, load_pipeline_stage, tokenize_for_model
from ..split.partition import block_costs
from ..train.trainer import PipelineDPTrainer
from .flags import DEFAULT_STEPS, configs_from_args


@dataclass(frozen=True)
class Job:
    """Everything a rank needs, resolved and validated before any process starts: the run's
    two configs (the same objects the trainer takes) and what only the CLI's job knows."""

    pipeline: PipelineConfig
    privacy: PrivacyConfig
    model: str
    data: Optional[str]
    steps: int
    lr: float
    seq_len: int
    checkpoint_dir: Optional[str]
    checkpoint_every: int
    checkpoint_key: Optional[str]  # None: PIPEDP_CHECKPOINT_KEY if set, else unsigned checkpoints
    export: Optional[str]  # a folder for the trained Hugging Face model (rank 0 writes it)
    lora_r: Optional[int]  # LoRA rank: train LoRA adapters (PEFT) on lora_targets, the base frozen
    lora_targets: Tuple[str, ...]
    keep_last: Optional[int]
    resume: bool
    threads: int
    progress: bool
    inprocess: bool


def load_dataset(job: Job):
    """(inputs, targets, vocab_size or None) — deterministic, so every rank builds the same one."""
    text = read_text(job.data) if job.data else generated_corpus(seed=job.privacy.seed)
    if job.model != "tiny-gpt":
        x, y = windows(tokenize_for_model(job.model, text), job.seq_len)
        return x, y, None
    tok = CharTokenizer.fit(text)
    x, y = windows(tok.encode(text), job.seq_len)
    return x, y, tok.vocab_size


def build_model(job: Job, vocab_size: Optional[int], rank: int):
    if job.model == "tiny-gpt":
        torch.manual_seed(job.privacy.seed)
        return tiny_gpt(GPTConfig(vocab_size=vocab_size, seq_len=job.seq_len, d_model=64, n_heads=4, n_layers=4))
    if job.inprocess:
        return load_local_model(job.model)
    # each rank reads only its own stage's tensors from the checkpoint
    stages = job.pipeline.stages
    return load_pipeline_stage(job.model, stages, rank % stages, untie_weights=job.pipeline.untie_weights)


def with_lora(model, job: Job):
    """The model with PEFT LoRA adapters on ``job.lora_targets`` (the base frozen), seeded alike on every rank."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(job.privacy.seed)
    config = LoraConfig(
        r=job.lora_r, lora_alpha=2 * job.lora_r, lora_dropout=0.0, target_modules=list(job.lora_targets)
    )
    return get_peft_model(model, config)


def resolve(args) -> Job:
    """Check every flag and file, calibrate the noise: errors surface here, before any process starts."""
    if args.model != "tiny-gpt" and not os.path.isdir(args.model):
        raise FileNotFoundError(
            f"model {args.model!r} is neither 'tiny-gpt' nor a local folder: pass a Hugging Face model folder "
            "(with config.json and weights)"
        )
    if args.lora_r is not None and args.model == "tiny-gpt":
        raise ValueError("--lora-r adds PEFT LoRA adapters to a Hugging Face model: give --model a model folder")
    if args.export is not None and args.model == "tiny-gpt":
        raise ValueError(
            "--export writes a Hugging Face folder: it needs --model pointing at a Hugging Face model "
            "folder (the built-in tiny-gpt is saved in the checkpoints)"
        )
    if args.data is not None and not os.path.exists(args.data):
        raise FileNotFoundError(f"dataset {args.data!r} does not exist: pass a local .txt or .jsonl file")
    pipeline, privacy = configs_from_args(
        args,
        transport="inprocess" if args.inprocess else "auto",
        expected_batch_size=1,  # set below
    )
    pipeline.validate()
    job = Job(
        pipeline=pipeline,
        privacy=privacy,
        model=args.model,
        data=args.data,
        steps=0,
        lr=args.lr,
        seq_len=args.seq_len,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        checkpoint_key=args.checkpoint_key,
        export=args.export,
        keep_last=args.keep_last,
        resume=args.resume,
        lora_r=args.lora_r,
        lora_targets=tuple(t for t in args.lora_targets.split(",") if t),
        threads=args.threads,
        progress=not args.no_progress,
        inprocess=args.inprocess,
    )
    x, _, _ = load_dataset(job)
    n = len(x)
    if args.sample_rate is not None:
        sample_rate = args.sample_rate
    else:
        if args.batch_size > n:
            raise ValueError(f"--batch-size {args.batch_size} is larger than the dataset ({n} sequences)")
        sample_rate = args.batch_size / n
    steps = args.steps or (steps_for_epochs(args.epochs, sample_rate) if args.epochs else DEFAULT_STEPS)
    privacy = replace(
        privacy,
        sample_rate=sample_rate,
        expected_batch_size=max(1, round(sample_rate * n)),
        total_steps=steps if privacy.target_epsilon is not None else None,
    ).validate()
    if privacy.target_epsilon is not None:  # calibrate once here, so every rank gets the same sigma
        sigma = calibrate_noise(privacy.target_epsilon, privacy.delta, sample_rate, steps, privacy.accountant)
        privacy = replace(privacy, noise_multiplier=sigma, target_epsilon=None, total_steps=None)
    return replace(job, privacy=privacy, steps=steps)


def train_rank(rank: int, job: Job) -> dict:
    from tqdm import tqdm

    torch.set_num_threads(job.threads)
    lead = rank == 0
    if not lead:
        warnings.filterwarnings("ignore")
    x, y, vocab = load_dataset(job)
    model = build_model(job, vocab, rank)
    pipeline = job.pipeline
    if job.lora_r is not None:
        # split where the stage loader split the base model, whatever parameters LoRA adds
        pipeline = replace(pipeline, balance=block_costs(model_blocks(model, pipeline.untie_weights), "params"))
        model = with_lora(model, job)
    trainer = PipelineDPTrainer(
        model, token_loss, lambda params: torch.optim.Adam(params, lr=job.lr), pipeline=pipeline, privacy=job.privacy
    )
    privacy = job.privacy
    if lead:
        print(f"partition: {trainer.partition_report}", flush=True)
    start_step = 0
    has_checkpoint = job.checkpoint_dir and os.path.exists(os.path.join(job.checkpoint_dir, "latest"))
    if job.resume and has_checkpoint:
        trainer.load_checkpoint(job.checkpoint_dir, job.checkpoint_key)
        start_step = trainer.steps_taken
        saved_lr = _apply_lr(trainer, job.lr)
        if lead:
            print(f"resumed from step {start_step} in {job.checkpoint_dir}", flush=True)
            if saved_lr is not None:
                print(f"learning rate: --lr {job.lr:g} replaces the checkpoint's {saved_lr:g}", flush=True)
    elif job.resume and lead:
        print(f"--resume: no checkpoint in {job.checkpoint_dir}: starting from step 0", flush=True)
    elif has_checkpoint and lead:
        print(
            f"{job.checkpoint_dir} already holds a checkpoint: starting afresh and overwriting it "
            "(pass --resume to continue it instead)",
            flush=True,
        )
    bar = tqdm(
        total=job.steps,
        initial=start_step,
        disable=not (lead and job.progress),
        desc="DP training",
        unit="step",
        dynamic_ncols=True,
    )
    state = {"samples": 0, "first_loss": None, "first_nonfinite": None, "eps": 0.0}
    eps_every = max(1, job.steps // 15)
    settle_process()  # the built objects out of full collections; freed memory kept for reuse (see README)
    t0 = time.perf_counter()

    def on_step(step, loss, tr):
        if tr.last_batch_size and state["first_loss"] is None:
            state["first_loss"] = loss
        if tr.last_batch_size and not math.isfinite(loss) and state["first_nonfinite"] is None:
            state["first_nonfinite"] = step
        state["samples"] += round(tr.last_batch_size)
        if lead and (step % eps_every == 0 or step == job.steps):  # the accountant's cost on rank 0 only
            state["eps"] = tr.epsilon(privacy.delta)
        rate = state["samples"] / max(1e-9, time.perf_counter() - t0)
        bar.set_postfix(loss=f"{loss:.3f}", eps=f"{state['eps']:.2f}", qps=f"{rate:.0f}")
        bar.update(1)

    result = trainer.fit(
        (x, y),
        steps=job.steps,
        checkpoint_dir=job.checkpoint_dir,
        checkpoint_every=job.checkpoint_every,
        checkpoint_key=job.checkpoint_key,
        keep_last=job.keep_last,
        callback=on_step,
    )
    bar.close()
    elapsed = time.perf_counter() - t0
    if job.export:
        trainer.save_pretrained(job.export)  # every rank takes part; rank 0 writes
        if lead:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(job.model, local_files_only=True).save_pretrained(job.export)
            print(f"exported: {job.export} (transformers' from_pretrained loads it)", flush=True)
    summary = {
        "steps": result.steps,
        "epsilon": result.epsilon,
        "delta": privacy.delta,
        "loss": result.loss,
        "first_loss": state["first_loss"],
        "seconds": elapsed,
        "samples_per_s": state["samples"] / max(elapsed, 1e-9),
        "noise_multiplier": privacy.noise_multiplier,
        "stopped_by_budget": result.stopped_by_budget,
        "first_nonfinite_step": state["first_nonfinite"],
    }
    if lead:
        print(
            f"done: {result.steps} steps in {elapsed:.1f}s, {summary['samples_per_s']:.0f} samples/s | loss "
            f"{summary['first_loss'] if summary['first_loss'] is not None else float('nan'):.3f} -> {result.loss:.3f} | "
            f"epsilon {result.epsilon:.3f} at delta {privacy.delta:g} (noise multiplier "
            f"{privacy.noise_multiplier:.3f}, sample rate {privacy.sample_rate:.4f}, {privacy.accountant})"
            + (f"\ncheckpoint: {job.checkpoint_dir}" if job.checkpoint_dir else "")
            + (f"\nstopped: {result.stopped_by_budget}" if result.stopped_by_budget else "")
            + (
                f"\nnon-finite losses from step {state['first_nonfinite']} on (NaN/inf in the data or the model)"
                if state["first_nonfinite"] is not None
                else ""
            ),
            flush=True,
        )
    return summary


def _apply_lr(trainer: PipelineDPTrainer, lr: float) -> Optional[float]:
    """Give a resumed run the --lr it was started with; return the checkpoint's lr if it differed."""
    saved = None
    for opt in trainer.state.optimizers:
        for group in opt.param_groups if opt is not None else []:
            if group["lr"] != lr:
                saved, group["lr"] = group["lr"], lr
    return saved


def run(args) -> int:
    job = resolve(args)
    stages, replicas = job.pipeline.stages, job.pipeline.replicas
    world = stages * replicas
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ and not job.inprocess
    if under_torchrun:
        if int(os.environ["WORLD_SIZE"]) != world:
            raise PipeDPError(
                f"torchrun started {os.environ['WORLD_SIZE']} processes but --stages {stages} x --replicas "
                f"{replicas} = {world}: use torchrun --nproc_per_node {world}"
            )
        init_from_env(timeout_s=job.pipeline.timeout)
        return _exit_code(train_rank(int(os.environ["RANK"]), job))
    if job.inprocess or world == 1:
        if replicas > 1:
            raise PipeDPError("--replicas > 1 needs one process per (stage, replica): drop --inprocess")
        return _exit_code(
            train_rank(0, replace(job, inprocess=True, pipeline=replace(job.pipeline, transport="inprocess")))
        )
    print(
        f"pipedp: launching {world} processes ({stages} stages x {replicas} replica"
        f"{'s' if replicas > 1 else ''}, gloo)",
        flush=True,
    )
    summary = launch(
        train_rank, world, (job,), timeout_s=24 * 3600, threads=job.threads, op_timeout_s=job.pipeline.timeout
    )[0]
    return _exit_code(summary)


def _exit_code(summary: dict) -> int:
    """Non-zero (3) when the run ended on non-finite losses, so scripts notice."""
    loss = summary["loss"]
    return 3 if isinstance(loss, float) and not math.isfinite(loss) and summary["first_loss"] is not None else 0
