"""--export: the trained model as a Hugging Face folder (a PeftModel: its adapter, naming its base model by
absolute path) with the tokenizer."""

from __future__ import annotations

import json
import os
from typing import Optional

from .spec import Job


def export(trainer, job: Job, lead: bool) -> None:
    assert job.export is not None  # (called only with --export)
    trainer.save_pretrained(job.export)  # every rank takes part; rank 0 writes
    if lead:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(job.model.name, local_files_only=True).save_pretrained(job.export)
        base = _name_base(job.export, job.model.name)
        adapter = f" (a LoRA adapter on {base})" if base else ""
        print(f"exported: {job.export}{adapter} (transformers' from_pretrained loads it)", flush=True)


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
