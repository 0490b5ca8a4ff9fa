"""Every check that needs no rank, before any process starts: ``resolve(args) -> Job``.

In order of cost: the flags (no torch: a bad value answers in well under a second), the run folder
(another run's checkpoint, a lock held by a live job), the model (built on the meta device from its
config.json and split by pipedp's adapter: an unsupported family or more stages than blocks is refused
here), the data (read, tokenised once into the cache, grouped into privacy units), the privacy
(delta < 1/N for N units, the sample rate, the steps, the noise calibration with its progress), and on
--resume the previous run's configuration (what changed, and whether the update allows it).

Imports that load torch stay inside the later steps' functions: a flag error answers before torch loads
(tests/test_cli_parts.py's no-torch test checks it).
"""

from __future__ import annotations

import math
import os
import time
from contextlib import ExitStack
from dataclasses import fields, replace
from typing import Callable, List, Optional, Tuple

from ..config import FitConfig, PipelineConfig, PrivacyConfig
from ..errors import ConfigError, PipeDPError
from .configfile import STRATEGY_STEPS
from .export import merge_scratch
from .flags import DEFAULT_STEPS, config_from_args, flag_name
from .options import DataConfig, OptimizerConfig
from .record import RunFolder, default_run_dir, link_latest
from .spec import TINY_GPT, TINY_GPT_SEQ_LEN, TINY_GPT_SHAPE, Job, Model
from .trackers import check_installed, parse

Say = Callable[[str], None]


# ---- 1. the flags: no torch ------------------------------------------------------------------------
def check_flags(args) -> Tuple[PipelineConfig, PrivacyConfig, FitConfig, DataConfig, OptimizerConfig]:
    pipeline = config_from_args(PipelineConfig, args, transport="inprocess" if args.inprocess else "auto").validate()
    data = config_from_args(DataConfig, args).validate()
    optim = config_from_args(OptimizerConfig, args).validate()
    if args.disable_dp:
        _check_no_privacy_flags(args)
    privacy = config_from_args(PrivacyConfig, args, expected_batch_size=1, enabled=not args.disable_dp)
    # the privacy fields' own checks; sample rate and steps come from the data, later
    replace(
        privacy,
        sample_rate=args.sample_rate or 1.0,
        sampling=privacy.sampling if privacy.sampling != "shuffle" else None,
    ).validate()
    if args.checkpoint_dir == "":
        raise ConfigError(
            "checkpoint_dir: give a folder (the run folder); --no-checkpoint saves no checkpoints", "checkpoint_dir"
        )
    fit = config_from_args(
        FitConfig,
        args,
        steps=args.steps if args.steps is not None or args.epochs is not None else DEFAULT_STEPS,  # 0 is refused
        checkpoint_dir=None,  # the run folder's, set once the folder is known (resolve)
        resume=False,  # the CLI loads the checkpoint itself, to say what changed
    ).validate()
    if args.resume and args.overwrite:
        raise ConfigError("--resume continues the run in --checkpoint-dir and --overwrite replaces it: pick one")
    if args.overwrite and _under_torchrun(args):
        raise ConfigError(
            "--overwrite under torchrun: every rank would move the folder at once; move or remove it yourself, or "
            "give another --checkpoint-dir"
        )
    _check_strategies(args, data)
    if args.resume and _no_checkpoint(args):
        flag = "--no-checkpoint" if args.no_checkpoint else "--save-strategy no"
        raise ConfigError(f"--resume continues a checkpoint: drop {flag}")
    _refuse_existing_export(args)
    if privacy.sampling == "shuffle" and fit.max_logical_batch is not None:
        raise ConfigError(
            "max_logical_batch: caps Poisson batches; shuffled batches have a fixed size", "max_logical_batch"
        )
    _check_model_flags(args)
    for path in (data.data, data.eval_data):
        if path is not None:
            from ..data.sources import check_source

            check_source(path)
    check_installed(parse(args.report_to))
    if data.privacy_unit == "user" and pipeline.microbatch_size is not None and data.max_records_per_user:
        if pipeline.microbatch_size % data.max_records_per_user:
            raise ConfigError(
                f"microbatch_size: {pipeline.microbatch_size} is not a multiple of --max-records-per-user "
                f"{data.max_records_per_user}: a micro-batch holds whole users",
                "microbatch_size",
            )
    return pipeline, privacy, fit, data, optim


NOT_WITHOUT_DP = ("noise_multiplier", "max_grad_norm", "clipping", "target_epsilon", "max_epsilon", "secure_mode")


def _check_no_privacy_flags(args) -> None:
    """--disable-dp with a privacy option set: refused, not ignored (the run would not be what was asked)."""
    defaults = {f.name: f.default for f in fields(PrivacyConfig)}
    given = [name for name in NOT_WITHOUT_DP if getattr(args, name) != defaults[name]]
    if given:
        flags = ", ".join(flag_name(n) for n in given)
        raise ConfigError(
            f"--disable-dp trains without clipping or noise, so {flags} would do nothing: drop "
            f"{'it' if len(given) == 1 else 'them'}, or drop --disable-dp for a private run"
        )


def _check_strategies(args, data: DataConfig) -> None:
    """--eval-strategy / --save-strategy (Hugging Face's names) against the step flags they replace. ``no`` for
    saving is --no-checkpoint (``_no_checkpoint``)."""
    for strategy, every in STRATEGY_STEPS.items():
        if getattr(args, strategy) != "steps" and every in args.given:
            raise ConfigError(
                f"{flag_name(strategy)} {getattr(args, strategy)} and {flag_name(every)} both say when: give one "
                f"({flag_name(every)} N is {flag_name(strategy)} steps)",
                strategy,
            )
    if args.eval_strategy == "epoch" and data.eval_data is None and not data.eval_fraction:
        raise ConfigError(
            "eval_strategy: epoch evaluates on evaluation data: give --eval-data FILE or --eval-fraction F",
            "eval_strategy",
        )
    if args.no_checkpoint and args.save_strategy != "steps":
        raise ConfigError(
            f"--no-checkpoint saves no checkpoint, so --save-strategy {args.save_strategy} would do nothing: give one",
            "save_strategy",
        )


def _no_checkpoint(args) -> bool:
    """No checkpoints: --no-checkpoint, or Hugging Face's --save-strategy no."""
    return bool(args.no_checkpoint) or args.save_strategy == "no"


def _apply_strategies(args, data: DataConfig, fit: FitConfig, privacy: PrivacyConfig, say: Say):
    """(data, fit) with the epoch strategies' steps: one epoch by the run length's own rule (FitConfig.planned_steps
    of epochs=1: ceil(1 / q) Poisson steps, ceil(N / B) shuffled)."""
    if "epoch" not in (args.eval_strategy, args.save_strategy):
        return data, fit
    epoch = replace(fit, steps=None, epochs=1.0).planned_steps(privacy)
    what = [w for w, s in (("evaluating", args.eval_strategy), ("checkpointing", args.save_strategy)) if s == "epoch"]
    say(f"an epoch is {epoch} steps: {' and '.join(what)} every {epoch} steps")
    if args.eval_strategy == "epoch":
        data = replace(data, eval_every=epoch).validate()
    if args.save_strategy == "epoch":
        fit = replace(fit, checkpoint_every=epoch)
    return data, fit


def _under_torchrun(args) -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and not args.inprocess


def _check_model_flags(args) -> None:
    if args.model == TINY_GPT:
        if args.lora_r is not None:
            raise ValueError("--lora-r adds PEFT LoRA adapters to a Hugging Face model: give --model a model folder")
        if args.export is not None or args.export_merged is not None:
            raise ValueError(
                "--export writes a Hugging Face folder: it needs --model pointing at a Hugging Face model "
                "folder (the built-in tiny-gpt is saved in the checkpoints)"
            )
        return
    if args.export_merged is not None and args.lora_r is None:
        raise ConfigError(
            "--export-merged merges a LoRA adapter into the base model: without --lora-r the model is trained "
            "whole, and --export DIR writes it",
            "export_merged",
        )
    if not os.path.isdir(args.model):
        raise FileNotFoundError(
            f"model {args.model!r} is neither 'tiny-gpt' nor a local folder: pass a Hugging Face model folder "
            "(with config.json and weights)"
        )
    names = os.listdir(args.model)
    if "config.json" not in names:
        raise FileNotFoundError(f"model folder {args.model!r} has no config.json: save it with save_pretrained")
    if not any(n.endswith(".safetensors") or n == "model.safetensors.index.json" for n in names):
        raise FileNotFoundError(
            f"model folder {args.model!r} has no safetensors weights (each rank reads its own stage from them): "
            "save it with save_pretrained(..., safe_serialization=True)"
        )


# ---- 2. the run folder ------------------------------------------------------------------------------
def check_folder(args, say: Say, lead: bool = True, hold: Optional[ExitStack] = None) -> RunFolder:
    """``lead``: the process that may touch the folder (under torchrun, rank 0: the others only look). ``hold``:
    the folder's lock is taken into it, before anything is written (else only probed)."""
    from ..train.checkpoint import folder as checkpoints
    from ..train.checkpoint import resolve_key

    default = args.checkpoint_dir is None
    folder = RunFolder(args.checkpoint_dir if not default else default_run_dir(args.resume, _under_torchrun(args)))
    if lead:  # (not on every rank at once: two probes of the lock would collide)
        if hold is None:
            folder.check_free()
        else:
            hold.enter_context(folder.locked())
            if default and not args.resume:
                link_latest(folder.path)
    held = folder.holds_checkpoint()
    if held and not (args.resume or args.overwrite):
        raise PipeDPError(
            f"{folder.path!r} already holds the checkpoint of a run: pass --resume to continue it, --overwrite to "
            "start afresh (the old run is moved aside), or give another --checkpoint-dir"
        )
    if not _no_checkpoint(args):  # an empty key, or a signed folder resumed without its key: refused before any rank
        key = resolve_key(args.checkpoint_key)
        if held and args.resume:
            checkpoints.require_key(folder.path, key)
    if held and args.overwrite:
        say(f"--overwrite: the previous run in {folder.path} moved to {folder.move_aside()}")
    if args.resume and not held:
        say(f"--resume: no checkpoint in {folder.path}: starting from step 0")
    return folder


# ---- 3. the model, on the meta device ---------------------------------------------------------------
def check_model(args, pipeline: PipelineConfig) -> Model:
    """The model's blocks and vocabulary, from its structure alone (no weights read)."""
    import torch

    from ..split.adapters import model_blocks
    from ..split.partition import block_costs, partition

    if args.model == TINY_GPT:
        from ..models import GPTConfig, tiny_gpt

        with torch.device("meta"):
            model = tiny_gpt(GPTConfig(vocab_size=256, seq_len=args.seq_len or TINY_GPT_SEQ_LEN, **TINY_GPT_SHAPE))
    else:
        from ..split.hf_loading import build_on_meta

        try:
            model = build_on_meta(args.model)
        except (ValueError, KeyError, OSError) as exc:  # an architecture transformers does not know, a bad config
            raise PipeDPError(f"model folder {args.model!r} cannot be built: {str(exc).strip()[:400]}") from exc
    blocks = model_blocks(model, pipeline.untie_weights)  # an unsupported family is refused here, by name
    if pipeline.stages > len(blocks):
        names = ", ".join(b.name or "(root)" for b in blocks)
        raise ConfigError(
            f"stages: {pipeline.stages} stages for a model of {len(blocks)} blocks ({names}): use --stages "
            f"{len(blocks)} or fewer",
            "stages",
        )
    partition(blocks, pipeline.stages, "compute", block_costs(blocks, "compute"))
    if args.lora_r is not None:
        from ..train.lora import with_lora

        try:
            lora = with_lora(model, args.lora_r, tuple(t for t in args.lora_targets.split(",") if t), seed=0)
        except (ValueError, KeyError) as exc:  # e.g. target modules not found
            raise ConfigError(f"lora_targets: {str(exc).strip()[:400]}", "lora_targets") from exc
        model_blocks(lora, pipeline.untie_weights)
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else model[0].tok
    config = getattr(model, "config", None)
    positions = next((getattr(config, k) for k in POSITION_KEYS if isinstance(getattr(config, k, None), int)), None)
    return Model(args.model, vocab_size=int(embedding.num_embeddings), blocks=len(blocks), positions=positions)


POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length")


# ---- 4. the data ------------------------------------------------------------------------------------
def prepare_data(args, data: DataConfig, folder: RunFolder, seed: int, model: Model, say: Say):
    """Tokenise (or read from the cache) the training and evaluation sources; group the units."""
    from ..data import describe_counts, hold_out, load_tokenizer, record_units, tokenized, user_units

    tokenizer = load_tokenizer(args.model)
    cache = data.cache_dir or folder.cache_dir()
    progress = _progress_bar(not args.no_progress)

    def rows(path):
        start = time.monotonic()
        t, file, hit = tokenized(
            path, tokenizer, data.seq_len, data.format, data.text_field, data.user_field, cache, seed, progress
        )
        name = path or "the generated corpus"
        how = "from the cache" if hit else f"tokenised in {time.monotonic() - start:.1f}s, cached"
        say(describe_counts(t, name, data.seq_len) + f" ({how}: {file})")
        top = max(int(t.input_ids.max()), int(t.labels.max()))
        if top >= model.vocab_size:
            raise ConfigError(
                f"data: {name} has token id {top}, but the model's vocabulary has {model.vocab_size} entries: "
                "the tokenizer does not match the model",
                "data",
            )
        return t, file

    if data.seq_len is None:
        data = replace(
            data,
            seq_len=TINY_GPT_SEQ_LEN
            if model.name == TINY_GPT
            else _default_length(data, tokenizer, model, seed, say, private=not args.disable_dp),
        )
    assert data.seq_len is not None
    train, train_file = rows(data.data)
    _warn_if_truncated(train, data.seq_len, args.seq_len is None, say)
    units = user_units(train, data.max_records_per_user) if data.privacy_unit == "user" else record_units(train)
    if data.privacy_unit == "user":
        c = units.counts
        say(
            f"privacy unit: user ({data.user_field!r}): {c['units']} users of {units.unit_rows} rows each; "
            f"{c['users capped']} users had more records ({c['records cut']} cut), {c['padding rows']} padding rows"
        )
    train_units, held = hold_out(len(units), data.eval_fraction, seed)
    eval_file = None
    if data.eval_data is not None:
        _, eval_file = rows(data.eval_data)
    if held:
        say(
            f"eval: {len(held)} of {len(units)} privacy units held out (--eval-fraction {data.eval_fraction:g}); "
            "their loss and perplexity are computed from private records without noise: not differentially private"
        )
    elif eval_file is not None:
        say("eval: --eval-data; its loss and perplexity carry no DP guarantee unless those records are public")
    return data, train_file, eval_file, len(train_units), units.unit_rows


def _refuse_existing_export(args) -> None:
    """An export folder that already holds files is never written over silently: --overwrite replaces what it
    holds, and a --resume re-exports the run it continues (its own export)."""
    for flag, folder in (("--export", args.export), ("--export-merged", args.export_merged)):
        if folder and os.path.isdir(folder) and os.listdir(folder) and not (args.overwrite or args.resume):
            raise ConfigError(
                f"{flag} {folder} already holds files (an earlier export?): give another folder, remove it, or "
                "pass --overwrite to write over it",
                flag[2:].replace("-", "_"),
            )
    if args.export_merged and os.path.exists(merge_scratch(args.export_merged)):
        raise ConfigError(
            f"--export-merged {args.export_merged}: {merge_scratch(args.export_merged)} is left from an interrupted "
            "merged export (the adapter it was merging): remove it, or give another folder",
            "export_merged",
        )
    if args.export and args.export_merged and os.path.abspath(args.export) == os.path.abspath(args.export_merged):
        raise ConfigError("--export and --export-merged name one folder: give each its own", "export_merged")


TRUNCATED_WARNING = 0.05  # above this fraction of records truncated, say so


PUBLIC_SEQ_LEN = 512  # a private run's default --seq-len for a Hugging Face model, at most its positions


def _default_length(data: DataConfig, tokenizer, model: Model, seed: int, say: Say, private: bool) -> int:
    """A Hugging Face model's --seq-len when none is given. The length that holds 95% of the training records
    whole (see length_from_data) is a statistic of those records: one record can move it, and with it every row,
    so a private run only suggests it (to the operator, who holds the data) and takes a public default, the
    model's positions up to PUBLIC_SEQ_LEN; a non-private run (--disable-dp) takes it."""
    from ..data import Records, generated_records, length_from_data, read_records, record_lengths
    from ..data.cache import GENERATED

    source = read_records(data.data, data.text_field) if data.data else Records(GENERATED, generated_records(seed=seed))
    lengths = record_lengths(source, tokenizer, data.format, data.text_field)
    fitted = length_from_data(lengths, model.positions)
    bound = f", at most the model's {model.positions} positions" if model.positions else ""
    found = (
        f"the 95th percentile of the {len(lengths)} records' token lengths (longest {max(lengths)}), rounded up to a "
        f"multiple of 8{bound}"
    )
    if not private:
        say(f"--seq-len {fitted} from the data: {found} (the run is not private)")
        return fitted
    public = min(model.positions or PUBLIC_SEQ_LEN, PUBLIC_SEQ_LEN)
    say(
        f"--seq-len {public}: the model's positions, at most {PUBLIC_SEQ_LEN} (public). The data suggest "
        f"--seq-len {fitted} ({found}); that is a statistic of the training records, outside the DP guarantee if "
        "training uses it: pass it (or a length known in public) to choose it yourself"
    )
    return public


def _warn_if_truncated(rows, seq_len: int, chosen: bool, say: Say) -> None:
    c = rows.counts
    if c["records"] and c["truncated"] / c["records"] > TRUNCATED_WARNING:
        why = "chosen from the data, bounded by the model's positions" if chosen else "as given"
        say(
            f"warning: {c['truncated']} of {c['records']} records ({c['truncated'] / c['records']:.0%}) are truncated "
            f"at --seq-len {seq_len} ({why}), {c['tokens cut']} tokens cut: their ends are never trained on; raise "
            "--seq-len if the model allows"
        )


def _progress_bar(enabled: bool):
    if not enabled or os.environ.get("RANK", "0") != "0":
        return lambda it, total: it

    def bar(it, total):
        from tqdm import tqdm

        # shown only once tokenising takes more than 2 s (a big dataset): small ones say nothing
        return tqdm(it, total=total, desc="tokenising", unit="record", dynamic_ncols=True, mininterval=0.5, delay=2.0)

    return bar


# ---- 5. the privacy -----------------------------------------------------------------------------------
def resolve_privacy(args, privacy: PrivacyConfig, fit: FitConfig, units: int, unit_rows: int, say: Say):
    """(privacy with its sample rate, batch, N and noise multiplier; fit with its steps, from the one rule of
    the run length, FitConfig.planned_steps). Everything counts privacy units: records, or users of ``unit_rows``
    rows each."""
    if args.sample_rate is not None:
        sample_rate = args.sample_rate
        batch = max(1, round(sample_rate * units))
    else:
        batch = args.batch_size
        if batch > units:
            raise ConfigError(
                f"batch_size: --batch-size {batch} is larger than the data ({units} privacy units): lower it",
                "batch_size",
            )
        sample_rate = batch / units
    shuffle = privacy.sampling == "shuffle"
    privacy = replace(
        privacy, sample_rate=sample_rate, expected_batch_size=batch, dataset_size=units, unit_rows=unit_rows
    ).validate()  # delta < 1/N is checked here
    steps = fit.planned_steps(privacy)
    if privacy.target_epsilon is not None:  # calibrate once here, so every rank gets the same sigma
        from ..privacy.accounting import adjacency, calibrated

        say(
            f"calibrating the noise for epsilon {privacy.target_epsilon:g} at delta {privacy.delta:g} "
            f"({adjacency(privacy.sampling, args.privacy_unit)}) over {steps} steps"
        )
        sigma = calibrated(privacy, fit, progress=lambda line: say("  " + line)).noise_multiplier
        privacy = replace(privacy, noise_multiplier=sigma, target_epsilon=None)
    if privacy.max_epsilon is not None and not shuffle and privacy.noise_multiplier > 0:
        from ..privacy.accounting import steps_within_budget

        allowed = steps_within_budget(
            privacy.max_epsilon,
            privacy.delta,
            privacy.noise_multiplier,
            sample_rate,
            privacy.accountant,
            limit=steps + 1,
        )
        if allowed == 0:
            raise ConfigError(
                f"max_epsilon: {privacy.max_epsilon:g} is spent by the first step (noise multiplier "
                f"{privacy.noise_multiplier:.4g}, sample rate {sample_rate:.4g}): raise it, or add noise",
                "max_epsilon",
            )
        if allowed < steps:
            say(f"budget: --max-epsilon {privacy.max_epsilon:g} stops the run after step {allowed} of {steps}")
    return privacy, replace(fit, steps=steps, epochs=None)


WEAK_EPSILON = 10.0  # above it, the guarantee is said to be weak (docs/privacy.md)


def privacy_warnings(args, privacy: PrivacyConfig, steps: int) -> List[str]:
    """What the user should hear about the privacy before the run: a mechanism left at pipedp's defaults, noise too
    large to learn anything, and an epsilon above WEAK_EPSILON."""
    if not privacy.enabled:
        return []
    out = []
    left = [flag_name(n) for n in ("noise_multiplier", "max_grad_norm") if n not in args.given]  # (main.parse's)
    if args.target_epsilon is not None and "--noise-multiplier" in left:
        left.remove("--noise-multiplier")  # calibrated, not defaulted
    if left:
        out.append(
            f"{' and '.join(left)} left at pipedp's default{'s' if len(left) > 1 else ''} (1.0), not chosen for this "
            "model and data: give --target-epsilon (or --noise-multiplier) and --max-grad-norm (C: e.g. near the "
            "median per-sample gradient norm; a short run's clipped_fraction says how many are clipped)"
        )
    ratio = privacy.noise_multiplier / ((privacy.expected_batch_size or 1) * math.sqrt(steps))
    if ratio > 1:
        out.append(
            f"noise multiplier {privacy.noise_multiplier:.4g} is too large to learn: over the run's {steps} steps the "
            f"noise summed on each coordinate (std sigma x C x sqrt(steps) / batch = {ratio:.3g} x steps x C) exceeds "
            "the most the clipped gradients can move it (steps x C); raise the batch or the steps, or the target epsilon"
        )
    eps = _planned_epsilon(privacy, steps)
    if eps is not None and eps > WEAK_EPSILON:
        out.append(
            f"the run will end at epsilon {eps:.3g} (delta {privacy.delta:g}), above {WEAK_EPSILON:g}: a weak "
            "guarantee (e^epsilon bounds how much more likely any outcome becomes with a unit in the data); add noise, "
            "lower the sample rate or train fewer steps"
        )
    return out


def _planned_epsilon(privacy: PrivacyConfig, steps: int) -> Optional[float]:
    """The epsilon of a run that takes all its steps (Poisson runs; None where it is not known in advance)."""
    from ..privacy.accounting import epsilon_after

    if privacy.sampling == "shuffle" or privacy.noise_multiplier == 0 or privacy.sample_rate is None:
        return None if privacy.noise_multiplier else math.inf
    if privacy.max_epsilon is not None:
        return None  # the budget stops it first
    return epsilon_after(steps, privacy.noise_multiplier, privacy.sample_rate, privacy.delta, privacy.accountant)


# ---- all of it --------------------------------------------------------------------------------------------
def resolve(args, say: Say = print, lead: bool = True, hold: Optional[ExitStack] = None) -> Job:
    """The checked job; ``hold``: takes the run folder's lock, held until it closes (see check_folder)."""
    pipeline, privacy, fit, data, optim = check_flags(args)
    folder = check_folder(args, say, lead, hold)
    fit = replace(fit, checkpoint_dir=None if _no_checkpoint(args) else folder.path)
    model = check_model(args, pipeline)
    data, train_file, eval_file, units, unit_rows = prepare_data(args, data, folder, privacy.public_seed(), model, say)
    privacy, fit = resolve_privacy(args, privacy, fit, units, unit_rows, say)
    data, fit = _apply_strategies(args, data, fit, privacy, say)
    job = Job(
        pipeline=pipeline,
        privacy=privacy,
        fit=fit,
        data=data,
        optim=optim,
        model=model,
        run_dir=folder.path,
        resume=args.resume,
        overwrite=args.overwrite,
        train_rows=train_file,
        eval_rows=eval_file,
        export=args.export,
        export_merged=args.export_merged,
        lora_r=args.lora_r,
        lora_targets=tuple(t for t in args.lora_targets.split(",") if t),
        report_to=parse(args.report_to),
        epsilon_every=args.epsilon_every or max(1, fit.steps // 20),
        eval_batch_size=args.eval_batch_size or args.batch_size,
        threads=args.threads,
        progress=not args.no_progress,
        inprocess=args.inprocess,
    )
    warned = privacy_warnings(args, privacy, fit.steps)
    for line in warned:
        say(f"warning: {line}")
    job = replace(job, privacy_warnings=tuple(warned))
    if args.resume and folder.holds_checkpoint():
        notes = folder.compare(args, job)  # refuses what the update does not allow
        job = replace(job, resume_notes=tuple(notes))
    return job


def flags_of(args) -> dict:
    return {k: v for k, v in vars(args).items() if k != "command"}


__all__: List[str] = ["resolve", "check_flags", "flags_of"]
