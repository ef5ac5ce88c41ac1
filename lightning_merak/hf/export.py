"""A lightning-merak checkpoint as a Hugging Face directory ``from_pretrained`` reads (:func:`export_checkpoint`;
the command line is ``merak-export``, :mod:`lightning_merak.cli.export`).

The input is a merak3d sharded checkpoint (a torch distributed checkpoint directory keyed by the
unsplit model's names, taken in any layout) or a Lightning ``.ckpt`` file (DDP). The output is
``config.json`` (plus generation config and tokenizer files when the model was loaded from a
directory that has them) and the weights as ``save_pretrained`` writes them: ``model.safetensors`` when one file
holds them, else ``model-0000k-of-0000N.safetensors`` and ``model.safetensors.index.json``.

Streaming: tensors are read one at a time (``dcp.load`` of a one-key state dict, or a memory-mapped
weights-only ``torch.load``: nothing is unpickled, :mod:`lightning_merak.checkpoint.safe_load`) and
written shard by shard, so peak memory is about one output shard. Names,
tied weights and transformers' renamings are undone as ``save_pretrained`` does
(:mod:`lightning_merak.checkpoint.names`); rows of a padded vocabulary are dropped. Checkpoints already
hold the unsplit layout (tensor-parallel regrouping undone, experts numbered globally). Fused MoE
expert parameters are written as ``save_pretrained`` writes them (per expert for Mixtral, Qwen-MoE,
OLMoE, DeepSeek; :mod:`lightning_merak.hf.experts`), cut from one whole parameter read at a time.

Adapters: a PEFT user saving a ``PeftModel`` gets the adapter alone, which :func:`export_adapter`
(``merak-export --adapter-only``) writes as PEFT does; a user exporting for ``from_pretrained`` wants plain
weights. So :func:`export_checkpoint` refuses a checkpoint with adapter weights unless
``--merge-adapters`` is given, which writes ``base + delta`` (PEFT's own merge, one layer at a time)
under the base names, PEFT's merge run on a layer of the model's own type (``nn.Linear``, ``nn.Embedding``, GPT-2's
``Conv1D`` with ``fan_in_fan_out``; any other type is refused, pointing to ``--adapter-only``). An adapter on one
of tied weights (``embed_tokens`` of a ``tie_word_embeddings`` model) merges into that weight alone: its partners
(``lm_head``) are written unmerged and the config untied, as the trained model computed. A base stored quantised
(bitsandbytes nf4/fp4/int8, the project's int4) is dequantised first (:mod:`lightning_merak.hf.dequantised`), so
the merged weights are float and carry the quantisation rounding: the weights the adapter was trained against, plus
its delta. LoRA on fused expert tensors (PEFT's
``target_parameters``, one nested ``ParamWrapper`` per tensor) is merged one experts module at a time the
same way: the meta model's module wrapped by the recorded config, the checkpoint's base and factors assigned
in (``lora_B`` back from a merak3d directory's ``[out, r, E]``), PEFT's merge, then cut per expert as
``save_pretrained`` writes it; that module's tensors are held twice (read and merged) while it merges.
"""

from __future__ import annotations

import json
import logging
import shutil
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Union

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "EXPORT_DTYPES", "ExportReport", "export_adapter", "export_checkpoint",
           "shard_size_bytes"]

log = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_SIZE = "2GB"
"""The largest safetensors file :func:`export_checkpoint` writes unless told otherwise."""

EXPORT_DTYPES = ("bfloat16", "float16", "float32", "float64")
"""The dtypes ``dtype`` (``--dtype``) writes weights in: the floating-point ones ``from_pretrained`` loads."""

_VALID_CHECKPOINT = ("merak-train writes valid ones: a .ckpt file (DDP) or a merak3d checkpoint directory under "
                     "the run's checkpoints/ folder, as does Lightning's Trainer.save_checkpoint")

_COPIED_FILES = ("generation_config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json",
                 "vocab.*", "merges.txt", "chat_template*", "spiece.model")


_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"


@dataclass
class ExportReport:
    """Files written and the largest tensor group held in memory at once (one shard)."""

    files: list[str] = field(default_factory=list)
    total_size: int = 0
    largest_shard_bytes: int = 0


class _Source:
    """Tensors of a checkpoint under Lightning's names (``model.<name>``), read one at a time."""

    def __init__(self, path: Path) -> None:
        import torch

        from lightning_merak.checkpoint.safe_load import SafeFileSystemReader, load_torch_file  # lazy: torch
        from lightning_merak.checkpoint.sharded import LIGHTNING_CHECKPOINT, is_sharded_checkpoint  # lazy: torch

        self.path = path
        self.sharded = is_sharded_checkpoint(path)
        if self.sharded:
            from torch.distributed.checkpoint.metadata import TensorStorageMetadata

            if not (path / _DCP_INDEX).is_file():
                raise ValueError(f"{path} holds {LIGHTNING_CHECKPOINT} but no {_DCP_INDEX} index, so its tensors "
                                 f"cannot be read (a save that did not finish?); {_VALID_CHECKPOINT}")
            self.metadata = _checkpoint_dict(path / LIGHTNING_CHECKPOINT, load_torch_file)
            stored = SafeFileSystemReader(path).read_metadata().state_dict_metadata
            self.entries = {key[len("model."):]: (tuple(entry.size), entry.properties.dtype)
                            for key, entry in stored.items()
                            if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)}
        elif path.is_file():
            self.metadata = _checkpoint_dict(path, lambda file: load_torch_file(file, mmap=True))
            self.state = self.metadata.get("state_dict", {})
            self.entries = {key: (tuple(value.shape), value.dtype) for key, value in self.state.items()
                            if isinstance(value, torch.Tensor)}
        else:
            raise ValueError(_not_a_checkpoint(path))

    def read(self, key: str) -> torch.Tensor:
        import torch

        if not self.sharded:
            return self.state[key]
        import torch.distributed.checkpoint as dcp

        from lightning_merak.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner  # lazy: torch

        shape, dtype = self.entries[key]
        state = {"model." + key: torch.empty(shape, dtype=dtype)}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=SafeFileSystemReader(self.path), planner=SafeLoadPlanner(), no_dist=True)
        return state["model." + key]


_DCP_INDEX = ".metadata"
"""The index torch distributed checkpoint writes last in a directory, naming where each tensor is stored."""


def _not_a_checkpoint(path: Path) -> str:
    """Why ``path`` (neither a file nor a merak3d checkpoint directory) is refused, naming what to pass instead."""
    from lightning_merak.checkpoint.sharded import LIGHTNING_CHECKPOINT, is_sharded_checkpoint  # lazy: torch

    if not path.is_dir():
        what = "is not a regular file" if path.exists() else "does not exist"
        return f"{path} {what}; pass a checkpoint: {_VALID_CHECKPOINT}"
    inside = sorted(entry.name for entry in path.iterdir()
                    if entry.suffix == ".ckpt" or is_sharded_checkpoint(entry))
    held = f"it holds the checkpoints {inside[:5]}: pass one of them" if inside else _VALID_CHECKPOINT
    return (f"{path} is a directory without {LIGHTNING_CHECKPOINT}, so neither a merak3d checkpoint directory nor a "
            f"Lightning .ckpt file; {held}")


def _checkpoint_dict(path: Path, load: Callable[[Path], Any]) -> dict[str, Any]:
    """The checkpoint dict ``load`` reads from the ``torch.save`` file ``path``, refused up front when the file is no
    ``torch.save`` archive (empty, truncated, another format): torch's own error would blame its mmap option."""
    size = path.stat().st_size
    if not _is_torch_archive(path):
        raise ValueError(f"{path} ({size} bytes) is not a readable checkpoint: not a torch.save archive (empty, "
                         f"truncated, or another format); {_VALID_CHECKPOINT}")
    checkpoint = load(path)
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{path} holds a {type(checkpoint).__name__}, not a Lightning checkpoint dict; "
                         f"{_VALID_CHECKPOINT}")
    return checkpoint


def _is_torch_archive(path: Path) -> bool:
    """Whether ``path`` is a zip archive holding a ``data.pkl`` record, as ``torch.save`` writes by default."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(name.rpartition("/")[2] == "data.pkl" for name in archive.namelist())


def shard_size_bytes(max_shard_size: Union[int, str]) -> int:
    """``max_shard_size`` in bytes, read as ``save_pretrained`` reads it; a ``ValueError`` naming the accepted forms
    for anything else, so a typo is refused before the checkpoint is read, not after."""
    from transformers.utils.hub import convert_file_size_to_int

    text = str(max_shard_size).strip()
    try:
        size = int(text) if text.isdigit() else convert_file_size_to_int(text)
    except ValueError:
        size = 0
    if size <= 0:
        raise ValueError(f"max shard size {max_shard_size!r} is not a size; pass a positive whole number with a unit, "
                         "e.g. 5GB, 500MB, 100KB (powers of 1000) or 2GiB, 512MiB (powers of 1024), or a number of "
                         "bytes, e.g. 2000000000")
    return size


def _check_output(out: Path) -> None:
    """``out`` becomes a directory: refused up front when it, or a folder above it, is an existing file."""
    existing = next(path for path in (out, *out.parents) if path.exists())
    if not existing.is_dir():
        raise ValueError(f"output directory {out}: {existing} is an existing file; pass a new or existing directory")


def _remove_earlier_weights(out: Path) -> None:
    """Delete the weight files an earlier export left in ``out``, as ``save_pretrained`` does: a stale
    ``model.safetensors`` beside a new sharded set would be the file ``from_pretrained`` loads."""
    for stale in (*out.glob("model-*-of-*.safetensors"), out / _SINGLE_FILE, out / _INDEX_FILE):
        stale.unlink(missing_ok=True)


def _skeleton(path: str, leaf: nn.Module) -> nn.Module:
    """A module tree holding only ``leaf``, under its name in the model, so PEFT's targets match as they did there."""
    from torch import nn

    skeleton = nn.Module()
    parent = skeleton
    *parents, name = path.split(".")
    for part in parents:
        parent.add_module(part, nn.Module())
        parent = getattr(parent, part)
    parent.add_module(name, leaf)
    return skeleton


def _inject(skeleton: nn.Module, adapters: dict[str, Any]) -> None:
    """Wrap ``skeleton`` as each recorded adapter config wrapped the model (its other targets are elsewhere)."""
    from peft import PeftConfig, inject_adapter_in_model

    import lightning_merak.adapters  # noqa: F401  # lazy: torch, PEFT (registers Q-BaRA and QA-HiRA with PEFT)

    with warnings.catch_warnings():  # "target_modules/target_parameters ... no module was matched": expected here
        warnings.filterwarnings("ignore", message=".*(were set but no|did not match any targeted).*")
        warnings.filterwarnings("ignore", message="fan_in_fan_out is set to")  # per layer type, as in training
        for name, values in adapters.items():
            inject_adapter_in_model(PeftConfig.from_peft_type(**_narrowed(values, skeleton)), skeleton,
                                    adapter_name=name)


def _narrowed(values: dict[str, Any], skeleton: nn.Module) -> dict[str, Any]:
    """A recorded adapter config with only the ``target_parameters`` and ``lambda_overrides`` that name what
    ``skeleton`` holds: the others live in other layers, and Q-BaRA / QA-HiRA refuse names that match nothing."""
    from lightning_merak.adapters.base import names_module  # lazy: torch, PEFT
    from lightning_merak.adapters.pooled_experts import expert_tensor_names  # lazy: torch, PEFT

    held = [name.replace(".base_layer", "") for name, _ in skeleton.named_modules()]
    held += [f"{name}.{tensor}" for name, module in skeleton.named_modules() for tensor in expert_tensor_names(module)]

    def present(key: str) -> bool:
        return any(names_module(key, name) for name in held)

    narrowed = dict(values)
    if values.get("target_parameters"):
        narrowed["target_parameters"] = [key for key in values["target_parameters"] if present(key)] or None
    if values.get("lambda_overrides"):
        narrowed["lambda_overrides"] = {key: pair for key, pair in values["lambda_overrides"].items() if present(key)}
    return narrowed


def _refuse_unmergeable(model: nn.Module, layers: Iterable[str]) -> None:
    """Refuse, before anything is written, an adapted layer of ``model`` whose type :func:`_merged_weight` does not
    rebuild: merged as another type, its weight would come out wrong (a ``Conv1D`` as an ``nn.Linear`` did)."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    for layer_name in layers:
        layer = model.get_submodule(layer_name)
        if not isinstance(layer, (nn.Linear, nn.Embedding, Conv1D)):
            raise ValueError(f"--merge-adapters: the adapted layer {layer_name} is a {type(layer).__name__}; the "
                             "merge rebuilds nn.Linear, nn.Embedding and transformers Conv1D layers only (and fused "
                             "experts): export the adapters alone with --adapter-only and merge them with PEFT")


def _untied(model: nn.Module, hf_config: Any, adapted: Iterable[str]) -> tuple[nn.Module, dict[str, str]]:
    """``model`` rebuilt untied where an adapter is on one of a group of tied weights, and those ties (copy →
    source). The trained model read base + delta there but the unmerged base in its tied partners, so the partners
    are written apart from it and ``tie_word_embeddings`` set false: merged into the one shared tensor, the delta
    would reach every partner (as in PEFT's ``merge_and_unload``, which warns of it: PEFT issue #2777)."""
    from lightning_merak.checkpoint.names import build_meta_model  # lazy: torch

    layers = set(adapted)
    ties = {copy: source for copy, source in model.all_tied_weights_keys.items()
            if {copy.rpartition(".")[0], source.rpartition(".")[0]} & layers}
    if not ties:
        return model, ties
    hf_config.tie_word_embeddings = False
    hf_config.get_text_config().tie_word_embeddings = False
    model = build_meta_model(hf_config)
    still = sorted(set(ties) & set(model.all_tied_weights_keys))
    if still:
        raise ValueError(f"--merge-adapters: an adapter is on tied weights {still}, which tie_word_embeddings=false "
                         "does not untie in this model; export the adapters alone with --adapter-only")
    return model, ties


def _merged_weight(layer_name: str, model_layer: nn.Module, base: dict[str, torch.Tensor],
                   adapter: dict[str, torch.Tensor], adapters: dict[str, Any]) -> torch.Tensor:
    """``layer_name``'s weight with every recorded adapter merged, by PEFT's own layer on a one-layer skeleton.

    The skeleton's layer has ``model_layer``'s type, so PEFT wraps it as it wrapped the live one: a GPT-2
    ``Conv1D`` (weight ``(in, out)``) gets ``fan_in_fan_out`` as PEFT sets it, an embedding its own LoRA."""
    import torch
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    weight = base["weight"]
    if not weight.is_floating_point():
        raise ValueError(f"--merge-adapters: the base of {layer_name} is stored quantized ({weight.dtype}); "
                         "train the adapter on an unquantized base (adapter.quantization=none) to export it merged")
    layer_module: nn.Module  # model_layer's type, one _refuse_unmergeable passed
    if isinstance(model_layer, Conv1D):
        layer_module = Conv1D(weight.shape[1], weight.shape[0]).to(weight.dtype)
    elif isinstance(model_layer, nn.Embedding):
        layer_module = nn.Embedding(weight.shape[0], weight.shape[1], dtype=weight.dtype)
    else:
        layer_module = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in base, dtype=weight.dtype)
    skeleton = _skeleton(layer_name, layer_module)
    _inject(skeleton, adapters)
    layer = skeleton.get_submodule(layer_name)
    layer.load_state_dict({**{f"base_layer.{key}": value for key, value in base.items()}, **adapter})
    with torch.no_grad():
        layer.merge(adapter_names=list(adapters))
    return layer.get_base_layer().weight.detach()


def _merged_experts(module_name: str, experts: nn.Module, stored: dict[str, torch.Tensor],
                    adapters: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The parameters of the fused experts module ``module_name`` with every recorded adapter merged.

    PEFT adapts each fused tensor with its own ``ParamWrapper``, nested around the module in PEFT's order, so
    the wrapping is PEFT's own: the meta model's module is wrapped by the recorded configs (still on meta),
    ``stored`` (the checkpoint's tensors under the wrapped module, by PEFT's names) is assigned in, and each
    wrapper merges its ``scaling·B_e A_e`` into its tensor, as ``merge_and_unload`` does on the live model. A
    ``lora_B`` a merak3d checkpoint holds as ``[out, r, E]`` is reshaped back to PEFT's ``[out, r·E]``.
    """
    import copy

    import torch
    from peft.tuners.tuners_utils import BaseTunerLayer

    skeleton = _skeleton(module_name, copy.deepcopy(experts))
    _inject(skeleton, adapters)
    wrapped = skeleton.get_submodule(module_name)
    expected = wrapped.state_dict()
    if sorted(expected) != sorted(stored):
        raise ValueError(f"--merge-adapters: the recorded adapter config wraps {module_name} as "
                         f"{sorted(expected)}, the checkpoint holds {sorted(stored)}; export with the adapter "
                         "config the run trained")
    values = {}
    for key, target in expected.items():
        value = stored[key]
        if "lora_B." in key and value.ndim == 3 and value.numel() == target.numel():
            value = value.reshape(target.shape)  # as merak3d stores it
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"{module_name}.{key} has shape {tuple(value.shape)} in the checkpoint, the recorded "
                             f"adapter config makes it {tuple(target.shape)}")
        values[key] = value.clone()  # merged in place; a memory-mapped checkpoint stays untouched
    wrapped.load_state_dict(values, assign=True)
    with torch.no_grad():
        for module in wrapped.modules():
            if isinstance(module, BaseTunerLayer):
                module.merge(adapter_names=list(adapters))
    base = wrapped.get_base_layer()
    return {name: param.detach() for name, param in base.named_parameters(recurse=False)}


def _copy_source_files(record_config: dict[str, Any], out: Path) -> list[str]:
    """Copy the generation config and tokenizer files of the folder the model was loaded from (``_name_or_path``)
    into ``out``; a recorded folder that is not there (moved, or recorded relative) is named in a warning."""
    recorded = str(record_config.get("_name_or_path") or "")
    if not recorded:  # initialised at random: no source folder
        return []
    source = Path(recorded).expanduser()
    if not source.is_dir():
        log.warning(f"merak-export: warning: the checkpoint records its model as loaded from {recorded}, which is not "
                    f"a folder here ({Path.cwd()}), so {out} has no generation_config.json or tokenizer files "
                    f"({', '.join(_COPIED_FILES)}) from it; copy them from the model's folder by hand")
        return []
    copied = []
    for pattern in _COPIED_FILES:
        for file in sorted(source.glob(pattern)):
            if file.is_file():
                shutil.copy2(file, out / file.name)
                copied.append(file.name)
    return copied


def export_checkpoint(checkpoint: Union[str, Path], out: Union[str, Path], *, merge_adapters: bool = False,
                      max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
                      config: Optional[Union[str, Path]] = None, dtype: Optional[str] = None) -> ExportReport:
    """Write ``checkpoint`` to ``out`` as a Hugging Face directory; see the module docstring.

    ``config`` (a transformers directory or config.json) stands in for a checkpoint that recorded
    none; ``dtype`` (one of :data:`EXPORT_DTYPES`) converts the weights on the way out. The arguments are checked
    before the checkpoint is read. With ``merge_adapters``, an adapter on a tied weight (LoRA on ``embed_tokens``
    with ``tie_word_embeddings``) merges into it alone: its partners (``lm_head``) are written as the unmerged base
    and the exported config says ``tie_word_embeddings: false``, so the export computes what the adapter model did.
    """
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one export writes; pass one of {', '.join(EXPORT_DTYPES)}")
    limit = shard_size_bytes(max_shard_size)
    if config is not None and not (Path(config).is_file() or (Path(config) / "config.json").is_file()):
        raise ValueError(f"config {config} is neither a config.json file nor a directory holding one; pass the "
                         "model's local transformers directory")
    _check_output(Path(out))
    import torch
    from safetensors.torch import save_file

    from lightning_merak.adapters.resume import quantized_layers  # lazy: torch, PEFT
    from lightning_merak.checkpoint.names import (  # lazy: torch
        MODEL_RECORD_KEY,
        PEFT_LAYER_INFIX,
        build_meta_model,
        load_config,
        strip_wrappers,
    )
    from lightning_merak.hf.dequantised import DequantisedSource, int4_expert_tensors  # lazy: torch
    from lightning_merak.hf.experts import export_layout  # lazy: torch

    source: Union[_Source, DequantisedSource] = _Source(Path(checkpoint))
    quantized = quantized_layers(source.entries)
    quantized_experts = int4_expert_tensors(source.entries)
    if (quantized or quantized_experts) and not merge_adapters:
        what = (f"{next(iter(quantized.values()))}: {next(iter(quantized))} and {len(quantized) - 1} more layers"
                if quantized else f"int4 experts: {min(quantized_experts)} and {len(quantized_experts) - 1} more")
        raise ValueError(f"{checkpoint} holds a quantised base ({what}); pass --merge-adapters to write it "
                         "dequantised with the adapters merged (float weights carrying the quantisation rounding), or "
                         "--adapter-only to write the adapters alone")
    record = source.metadata.get(MODEL_RECORD_KEY) or {}
    if config is None and not record.get("config"):
        raise ValueError(f"{checkpoint} records no transformers config (saved before merak-export existed, or "
                         "not from a transformers model); pass --config DIR with the model's config.json")
    hf_config = load_config(config if config is not None else record["config"])
    model = build_meta_model(hf_config)
    if quantized or quantized_experts:
        transposed = {name for name, module in model.named_modules() if getattr(module, "is_transposed", False)}
        source = DequantisedSource(source, quantized, quantized_experts, transposed)
    names, experts = export_layout(model)
    meta_state = model.state_dict()
    prefix, resolved = strip_wrappers(source.entries, meta_state)
    by_module = {bare: key for key, bare in resolved.items() if bare is not None}
    extra = sorted(key for key, bare in resolved.items() if bare is None)
    adapters = record.get("adapters") or {}
    if extra and "base_model." not in prefix:
        raise ValueError(f"{checkpoint} holds tensors {type(model).__name__} does not have: {extra[:8]}")
    if merge_adapters and not extra and not (quantized or quantized_experts):
        raise ValueError(f"--merge-adapters: {checkpoint} holds no adapters (its run trained without adapter=...), "
                         "so there is nothing to merge; drop --merge-adapters to export its weights as they are")
    if extra and not merge_adapters:
        raise ValueError(f"{checkpoint} holds adapter weights ({extra[:3]}, ...); pass --merge-adapters to write "
                         "them merged into the base weights")
    if extra and not adapters:
        raise ValueError(f"{checkpoint} holds adapter weights but records no adapter config to merge them with")
    adapted = {key[len(prefix):].split(PEFT_LAYER_INFIX)[0]: key.split(PEFT_LAYER_INFIX)[0]
               for key in source.entries if PEFT_LAYER_INFIX in key} if extra else {}
    model, ties = _untied(model, hf_config, adapted)
    if ties:  # the partners written apart: each from its own tensor, else from the tie's source (its unmerged base)
        names, experts = export_layout(model)
        by_module.update({copy: by_module[source] for copy, source in ties.items()
                          if copy not in by_module and source in by_module})
    merged_layers = {name.rpartition(".")[0] for name in names if name.endswith(".weight")} & set(adapted)
    _refuse_unmergeable(model, sorted(merged_layers))
    missing = sorted(name for name in [*names, *experts] if name not in by_module)
    if missing:
        raise ValueError(f"{checkpoint} lacks tensors of {type(model).__name__}: {missing[:8]}")
    out_dtype = getattr(torch, dtype) if dtype else None

    def shape_of(name: str) -> tuple[int, ...]:
        stored, expected = source.entries[by_module[name]][0], tuple(meta_state[name].shape)
        padded = stored[0] > expected[0] == getattr(hf_config, "vocab_size", -1) and stored[1:] == expected[1:]
        if stored != expected and not padded:
            raise ValueError(f"{by_module[name]} has shape {stored} in {checkpoint}, {type(model).__name__} "
                             f"expects {expected}")
        return expected

    merged_experts: dict[str, dict[str, torch.Tensor]] = {}  # the last adapted experts module, merged

    def tensor_of(name: str) -> torch.Tensor:
        layer, _, leaf = name.rpartition(".")
        if name in experts and layer in adapted:
            if layer not in merged_experts:
                merged_experts.clear()
                full = adapted[layer]
                stored = {key[len(full) + 1:]: source.read(key) for key in source.entries if key.startswith(full + ".")}
                merged_experts[layer] = _merged_experts(layer, model.get_submodule(layer), stored, adapters)
            tensor = merged_experts[layer][leaf]
            return (tensor.to(out_dtype) if out_dtype else tensor).contiguous()
        tensor = source.read(by_module[name])
        if tensor.ndim:
            tensor = tensor[:shape_of(name)[0]]  # rows of a padded vocabulary dropped
        if name.endswith(".weight") and layer in adapted:
            full = adapted[layer]
            base = {key.rpartition(".")[2]: source.read(key) for key in source.entries
                    if key.startswith(full + PEFT_LAYER_INFIX)}
            adapter = {key[len(full) + 1:]: source.read(key) for key in extra if key.startswith(full + ".")}
            tensor = _merged_weight(layer, model.get_submodule(layer), base, adapter, adapters)
        return (tensor.to(out_dtype) if out_dtype else tensor).contiguous()

    outputs: dict[str, tuple[str, Optional[int], Any]] = {}  # key → (module name, expert, part of an expert)
    for name in meta_state:
        if name in names:
            outputs[names[name]] = (name, None, None)
        elif name in experts:  # per expert, as save_pretrained writes them (hf/experts.py)
            outputs.update((key, (name, expert, part)) for key, expert, part in experts[name].pieces())
    held: dict[str, torch.Tensor] = {}  # the last tensor read: an expert parameter's pieces are cut from it

    def output(key: str) -> torch.Tensor:
        name, expert, part = outputs[key]
        if name not in held:
            held.clear()
            held[name] = tensor_of(name)
        return held[name] if part is None else experts[name].piece(held[name], expert, part).clone()

    sizes = {key: torch.Size(shape_of(name) if part is None else experts[name].piece_shape(part)).numel()
             * (out_dtype or source.entries[by_module[name]][1]).itemsize for key, (name, _, part) in outputs.items()}
    shards: list[list[str]] = [[]]
    for key in outputs:
        if shards[-1] and sum(sizes[k] for k in shards[-1]) + sizes[key] > limit:
            shards.append([])
        shards[-1].append(key)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _remove_earlier_weights(out)
    report = ExportReport(total_size=sum(sizes.values()))
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        file_name = (f"model-{number:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1
                     else _SINGLE_FILE)  # as save_pretrained names them
        tensors = {key: output(key) for key in shard}
        save_file(tensors, out / file_name, metadata={"format": "pt"})
        report.largest_shard_bytes = max(report.largest_shard_bytes, sum(sizes[key] for key in shard))
        weight_map.update(dict.fromkeys(tensors, file_name))
        report.files.append(file_name)
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": report.total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (out / _INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        report.files.append(_INDEX_FILE)
    if out_dtype is not None:
        hf_config.dtype = out_dtype
    hf_config.save_pretrained(out)
    report.files += ["config.json", *_copy_source_files(record.get("config") or {}, out)]
    return report


def export_adapter(checkpoint: Union[str, Path], out: Union[str, Path]) -> ExportReport:
    """Write the adapters of ``checkpoint`` alone to ``out`` as PEFT's ``save_pretrained`` does, so that
    ``peft.PeftModel.from_pretrained(base, out)`` loads them onto the base model (quantised or not).

    The recorded configs wrap the recorded model on the meta device, so the folder's names and
    ``adapter_config.json`` are PEFT's own; the checkpoint supplies each adapter tensor by that name.
    """
    from peft import PeftConfig, get_peft_model

    import lightning_merak.adapters  # noqa: F401  # lazy: torch, PEFT (registers Q-BaRA and QA-HiRA with PEFT)
    from lightning_merak.checkpoint.names import MODEL_RECORD_KEY, build_meta_model, load_config  # lazy: torch

    _check_output(Path(out))
    source = _Source(Path(checkpoint))
    record = source.metadata.get(MODEL_RECORD_KEY) or {}
    adapters = record.get("adapters") or {}
    if not adapters or not record.get("config"):
        raise ValueError(f"{checkpoint} records no adapter (trained without adapter=...); export the whole model "
                         "with merak-export CHECKPOINT OUT instead of --adapter-only")
    base = build_meta_model(load_config(record["config"]))
    names = list(adapters)
    model = get_peft_model(base, PeftConfig.from_peft_type(**adapters[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, PeftConfig.from_peft_type(**adapters[name]))
    state = {key: _adapter_tensor(source, key, tuple(param.shape)) for key, param in model.named_parameters()
             if any(f".{name}." in key or key.endswith(f".{name}") for name in names)}  # Q-BaRA's factors end so
    state.update(_embedding_bases(model, source))
    out = Path(out)
    model.save_pretrained(out, state_dict=state, selected_adapters=names)
    report = ExportReport(total_size=sum(tensor.numel() * tensor.element_size() for tensor in state.values()))
    report.files = sorted(str(path.relative_to(out)) for path in out.rglob("*") if path.is_file())
    return report


def _embedding_bases(model: nn.Module, source: _Source) -> dict[str, torch.Tensor]:
    """The base weights of an adapted input embedding or LM head, by PEFT's names, for PEFT's ``save_pretrained``:
    with an embedding layer among the targets it writes them beside the adapters (``save_embedding_layers="auto"``),
    taking them from the state dict it is given, so they are offered here and PEFT decides."""
    from torch import nn

    bases = {}
    for layer in (model.get_input_embeddings(), model.get_output_embeddings()):
        base = getattr(layer, "base_layer", None)
        if not isinstance(base, (nn.Linear, nn.Embedding)):
            continue  # not adapted: PEFT writes it only for a resized vocabulary, which merak-train never does
        prefix = next(name for name, module in model.named_modules() if module is base) + "."
        for name, param in base.named_parameters():
            bases[prefix + name] = _adapter_tensor(source, prefix + name, tuple(param.shape))
    return bases


def _adapter_tensor(source: _Source, key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor PEFT names ``key`` (``base_model.model.<module>...``), found in ``source`` under any wrapper."""
    bare = key.removeprefix("base_model.model.")
    found = [entry for entry in source.entries if entry == key or entry == bare or entry.endswith("." + bare)]
    if len(found) != 1:
        raise ValueError(f"the checkpoint holds {len(found)} tensors for the adapter weight {key} (expected one); "
                         "was it written with the adapter config it records?")
    tensor = source.read(found[0])
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{found[0]} has shape {tuple(tensor.shape)} in the checkpoint, PEFT's layer expects {shape}; "
                         "--adapter-only writes adapters of dense layers (merge expert adapters with --merge-adapters)")
    return tensor.detach().clone()
