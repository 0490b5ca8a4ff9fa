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
    adapter = job.export or f"{os.path.abspath(job.export_merged or '')}.adapter-partial"  # (merged only: a scratch)
    trainer.save_pretrained(adapter)  # every rank takes part; rank 0 writes
    if not lead:
        return
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(job.model.name, local_files_only=True)
    base = _name_base(adapter, job.model.name)
    if job.export:
        tokenizer.save_pretrained(job.export)
        on = f" (a LoRA adapter on {base})" if base else ""
        print(f"exported: {job.export}{on} (transformers' from_pretrained loads it)", flush=True)
    if job.export_merged:
        _merge(adapter, job.model.name, job.export_merged)
        tokenizer.save_pretrained(job.export_merged)
        if not job.export:
            shutil.rmtree(adapter)
        print(f"exported: {job.export_merged} (the LoRA adapter merged into {base}; no peft needed)", flush=True)


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
    base = os.path.abspath(model) if os.path.isdir(model) else model
    config["base_model_name_or_path"] = base
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return base
