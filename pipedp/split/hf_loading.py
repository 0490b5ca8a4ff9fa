"""Hugging Face models from a local folder: the whole model, or only one stage's tensors.

Nothing is downloaded: every function reads a local folder (config.json, safetensors
shards, tokenizer files).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Dict, Iterator, List, Set, Tuple

import torch
import torch.nn as nn

from ..errors import CheckpointError
from ..parallel.plan import sliced_parameters
from .adapters import model_blocks
from .hf_buffers import compute_buffers
from .safetensors_read import Stored
from .stage_loading import load_stage, resident_parameter_bytes, weight_map  # noqa: F401 (re-exported)


def _require_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        raise ImportError("Hugging Face models need transformers: pip install 'pipedp[hf]'") from exc


def _auto_class(config):
    """AutoModelForSequenceClassification for a classifier's folder, else AutoModelForCausalLM."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    classifier = any(n.endswith("ForSequenceClassification") for n in getattr(config, "architectures", None) or [])
    return AutoModelForSequenceClassification if classifier else AutoModelForCausalLM


def load_local_model(path: str, attn_implementation: str = "sdpa", device: str = "cpu") -> nn.Module:
    """The whole model from a local folder (nothing is downloaded)."""
    _require_transformers()
    from transformers import AutoConfig

    if not os.path.isdir(path):
        raise FileNotFoundError(f"model folder {path!r} does not exist")
    auto = _auto_class(AutoConfig.from_pretrained(path, local_files_only=True))
    return auto.from_pretrained(path, local_files_only=True, attn_implementation=attn_implementation).to(device)


def build_on_meta(path_or_config, attn_implementation: str = "sdpa", device="cpu") -> nn.Module:
    """The model's structure with no memory behind its parameters; its buffers that checkpoints do not
    hold (rotary frequencies, embedding scales) computed on ``device``, as from_pretrained computes them."""
    _require_transformers()
    from transformers import AutoConfig

    config = path_or_config
    if isinstance(path_or_config, str):
        config = AutoConfig.from_pretrained(path_or_config, local_files_only=True)
    config._attn_implementation = attn_implementation
    with torch.device("meta"):
        model = _auto_class(config).from_config(config, attn_implementation=attn_implementation)
    compute_buffers(model, model.modules(), device)
    return model


def tokenize_for_model(path: str, text: str) -> List[int]:
    _require_transformers()
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise FileNotFoundError(f"no tokenizer in {path!r} ({exc}): save one with tokenizer.save_pretrained") from exc
    return tokenizer(text)["input_ids"]


def load_pipeline_stage(
    folder: str,
    stages: int,
    stage: int,
    balance="compute",
    untie_weights: bool = False,
    attn_implementation: str = "sdpa",
    device="cpu",
    tensor_parallel: int = 1,
) -> nn.Module:
    """The model built on the meta device with only ``stage``'s parameters materialized and loaded.

    Hand the result to PipelineDPTrainer with the same ``stages``, ``balance``,
    ``untie_weights`` and ``tensor_parallel`` on the rank that runs that stage: each rank reads only its own
    tensors from the (possibly sharded) safetensors checkpoint, so no rank ever holds the
    whole model. With ``tensor_parallel`` > 1 the layers transformers' plan splits are left on the meta device
    and the trainer's split reads each rank's slice of them alone (a checkpoint that transformers converts on
    loading is read whole, then split).
    """
    model = build_on_meta(folder, attn_implementation, device)
    if converted_on_loading(model, folder):  # (a mixture of experts' per-expert tensors, merged into banks)
        if not _splits_on_loading(model):  # each tensor converted from its own sources: read only the stage's
            converted = _Converted(folder, attn_implementation)
            return load_stage(model, converted, stages, stage, balance, device, untie_weights)
        print(
            f"stage {stage}: transformers splits some of {folder}'s tensors on loading: this rank loads the whole "
            "model once, keeps its stage's tensors and frees the rest",
            flush=True,
        )
        whole = load_local_model(folder, attn_implementation)
        tensors = {k: v.detach() for k, v in whole.state_dict().items()}
        del whole
        return load_stage(model, tensors, stages, stage, balance, device, untie_weights)
    later = _split_later(model, tensor_parallel, untie_weights)  # (a converted checkpoint above is cut after)
    return load_stage(model, checkpoint_tensors(model, folder), stages, stage, balance, device, untie_weights, later)


def _split_later(model: nn.Module, tensor_parallel: int, untie_weights: bool) -> Set[str]:
    """The parameters the tensor-parallel split will cut (parallel/plan.py), to be read slice by slice."""
    if tensor_parallel == 1:
        return set()
    return set(sliced_parameters(model, model_blocks(model, untie_weights), tensor_parallel))


def _transforms(model: nn.Module) -> Tuple[list, list, list]:
    """transformers' conversion mapping for ``model``: (the whole mapping, its renamings, its converters)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    return mapping, renamings, [t for t in mapping if not isinstance(t, WeightRenaming)]


def _splits_on_loading(model: nn.Module) -> bool:
    """Does a conversion make several of the model's tensors from one stored tensor (a fused qkv split)?"""
    return any(len(t.target_patterns) > 1 for t in _transforms(model)[2])


class _Converted(Mapping):
    """A checkpoint whose tensors transformers converts on loading (a mixture of experts' per-expert tensors
    merged into banks), read one model tensor at a time: its stored sources only, converted by transformers'
    own loader (``convert_and_load_state_dict_in_model``) into a scratch copy of the model on the meta device.
    So a rank reads its stage's tensors alone, never the whole model."""

    def __init__(self, folder: str, attn_implementation: str):
        from transformers.core_model_loading import rename_source_key

        self.scratch = build_on_meta(folder, attn_implementation)
        self.mapping, renamings, converters = _transforms(self.scratch)
        self.files = weight_map(folder)
        self.sources: Dict[str, List[str]] = {}  # model name -> the stored names it is made from
        own = self.scratch.state_dict()  # (as transformers' loader: a checkpoint saved without the prefix matches)
        for key in self.files:
            name = rename_source_key(key, renamings, converters, self.scratch.base_model_prefix, own)[0]
            self.sources.setdefault(name, []).append(key)

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        stored: Dict[str, torch.Tensor] = {}
        for key in self.sources[name]:
            with safe_open(self.files[key], framework="pt") as f:
                stored[key] = f.get_tensor(key)
        config = LoadStateDictConfig(weight_mapping=self.mapping, device_map={"": "cpu"})
        convert_and_load_state_dict_in_model(self.scratch, stored, config)
        value = dict(self.scratch.state_dict(keep_vars=True))[name]
        if value.is_meta:
            raise CheckpointError(f"{name!r}: transformers' conversion of {self.sources[name]} did not produce it")
        _set_meta(self.scratch, name)  # the scratch copy keeps nothing: the caller holds the tensor
        return value.detach()

    def __iter__(self) -> Iterator[str]:
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)


def _set_meta(model: nn.Module, name: str) -> None:
    module_name, _, attribute = name.rpartition(".")
    module = model.get_submodule(module_name)
    value = getattr(module, attribute)
    meta = torch.empty_like(value, device="meta")
    if isinstance(value, nn.Parameter):
        setattr(module, attribute, nn.Parameter(meta, requires_grad=value.requires_grad))
    else:
        module.register_buffer(attribute, meta)


def converted_on_loading(model: nn.Module, folder: str) -> bool:
    """Does transformers convert (merge, split) some of the checkpoint's tensors when it loads them?"""
    from transformers.core_model_loading import rename_source_key

    converters = _transforms(model)[2]
    return any(rename_source_key(key, [], converters)[1] is not None for key in weight_map(folder))


class _Renamed(Mapping):
    """A checkpoint's tensors under the model's names, read lazily: transformers renames some of them
    when loading (GPT-NeoX saves its head as ``embed_out``, loads it as ``lm_head``)."""

    def __init__(self, stored: Dict[str, str], names: Dict[str, str]):
        self.stored, self.names = stored, names  # model name -> checkpoint name; checkpoint name -> file

    def location(self, name: str) -> Stored:
        """Where the tensor ``name`` lies (for a slice-by-slice read: stage_loading.materialize_stage)."""
        return Stored(self.names[self.stored[name]], self.stored[name])

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        key = self.stored[name]
        with safe_open(self.names[key], framework="pt") as f:
            return f.get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.stored)

    def __len__(self) -> int:
        return len(self.stored)


def checkpoint_tensors(model: nn.Module, folder: str):
    """``folder``, or its tensors under the model's names when transformers renames any of them; a
    checkpoint whose tensors transformers converts on loading (split, merged, transposed) is refused."""
    from transformers.core_model_loading import rename_source_key

    renamings = _transforms(model)[1]
    files = weight_map(folder)
    if converted_on_loading(model, folder):
        raise CheckpointError(
            f"{type(model).__name__}: the checkpoint at {folder!r} holds tensors that transformers converts when "
            "loading (merged or split), which this plain reader cannot read: load it with load_pipeline_stage, which "
            "converts such checkpoints stage by stage through transformers' own loader"
        )
    own = model.state_dict()
    stored = {rename_source_key(key, renamings, [], model.base_model_prefix, own)[0]: key for key in files}
    if all(name == key for name, key in stored.items()):
        return folder
    return _Renamed(stored, files)
