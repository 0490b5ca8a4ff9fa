"""--export: the trained model as a Hugging Face folder (a PeftModel: its adapter, naming its base model by
absolute path) with the tokenizer. --export-merged: with LoRA, the whole model with the adapter merged into
its weights (peft's merge_and_unload), loadable without peft."""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

from .spec import Job


def export(trainer, job: Job, lead: bool) -> None:
    """--export's folder, and for --export-merged the adapter in its scratch folder (merged by ``export_merged``
    once every rank has finished). Every rank takes part; rank 0 writes."""
    if job.export:
        trainer.save_pretrained(job.export)
        if lead:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(job.model.name, local_files_only=True).save_pretrained(job.export)
            base = _name_base(job.export, job.model.name)
            on = f" (a LoRA adapter on {base})" if base else ""
            print(f"exported: {job.export}{on} (transformers' from_pretrained loads it)", flush=True)
    if job.export_merged:
        trainer.save_pretrained(merge_scratch(job.export_merged))
        if lead:
            _name_base(merge_scratch(job.export_merged), job.model.name)


def merge_scratch(folder: str) -> str:
    """Where a run leaves its adapter for --export-merged ``folder`` (preflight refuses one left by an interrupted
    merge)."""
    return f"{os.path.abspath(folder)}.adapter-partial"


def export_merged(job: Job) -> None:
    """--export-merged, on the job's lead process after every rank has finished: loading the whole base model and
    merging may take minutes, longer than a rank may wait in a collective. Nothing to do when the run wrote no
    adapter (a finished run resumed)."""
    folder = job.export_merged
    if folder is None or not os.path.isdir(merge_scratch(folder)):
        return
    from transformers import AutoTokenizer

    _merge(merge_scratch(folder), job.model.name, folder)
    AutoTokenizer.from_pretrained(job.model.name, local_files_only=True).save_pretrained(folder)
    shutil.rmtree(merge_scratch(folder))
    print(f"exported: {folder} (the LoRA adapter merged into {_base(job.model.name)}; no peft needed)", flush=True)


def _merge(adapter: str, base: str, folder: str) -> None:
    """The base model loaded whole (in its saved dtype), the adapter merged in, the LoRA modules gone."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.save_pretrained(folder)  # (a folder holding files was refused before the run without --overwrite)


def _name_base(folder: str, model: str) -> Optional[str]:
    """An adapter names its base model as --model was typed (a relative folder), which only resolves from where the
    run started: name it by its absolute path. Returns that path, or None for a whole model."""
    path = os.path.join(folder, "adapter_config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        config = json.load(f)
    base = config["base_model_name_or_path"] = _base(model)
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return base


def _base(model: str) -> str:
    """--model as the base model's name anywhere: a folder by its absolute path, a hub id as it is."""
    return os.path.abspath(model) if os.path.isdir(model) else model
