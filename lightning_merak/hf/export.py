"""A lightning-merak checkpoint as a Hugging Face directory ``from_pretrained`` reads (:func:`export_checkpoint`;
the command line is ``merak-export``, :mod:`lightning_merak.cli.export`).

The input is a merak3d sharded checkpoint (a torch distributed checkpoint directory keyed by the
unsplit model's names, taken in any layout) or a Lightning ``.ckpt`` file (DDP). The output is
``config.json`` (plus generation config and tokenizer files when the model was loaded from a
directory that has them) and the weights as ``save_pretrained`` writes them: ``model.safetensors`` when one file
holds them, else ``model-0000k-of-0000N.safetensors`` and ``model.safetensors.index.json``.

The config is the one the checkpoint records (``--config`` stands in only where it records none, and is refused
where it differs from the recorded one in a field that changes the model); every tensor must have the shape that
config gives it.

Streaming: tensors are read one at a time (:class:`~lightning_merak.hf.export_source.CheckpointSource`) and
written shard by shard, so peak memory is about one output shard. Names,
tied weights and transformers' renamings are undone as ``save_pretrained`` does
(:mod:`lightning_merak.checkpoint.names`). Checkpoints already
hold the unsplit layout (tensor-parallel regrouping undone, experts numbered globally). Fused MoE
expert parameters are written as ``save_pretrained`` writes them (per expert for Mixtral, Qwen-MoE,
OLMoE, DeepSeek; :mod:`lightning_merak.hf.experts`), cut from one whole parameter read at a time.

Output: everything is checked (the output writable, the checkpoint's data files whole, names and shapes) before
``out`` is touched, and the files are written into a new folder on its file system (inside ``out`` where it exists,
else beside it) that replaces ``out``'s weights and config only once complete (:func:`_publish`, whose order of
renames keeps a reader from pairing old and new files): an export that fails or is interrupted leaves an earlier
export in ``out`` as it was. Such a folder names the process writing it, so the next export into ``out`` or beside it
removes those whose writer was killed outright (SIGKILL, power loss) and says so, never a live export's.

Adapters: a PEFT user saving a ``PeftModel`` gets the adapter alone, which :func:`export_adapter`
(``merak-export --adapter-only``) writes as PEFT does; a user exporting for ``from_pretrained`` wants plain
weights. So :func:`export_checkpoint` refuses a checkpoint with adapter weights unless
``--merge-adapters`` is given, which writes ``base + delta`` (PEFT's own merge, one layer or experts module at a
time: :mod:`lightning_merak.hf.merged_adapters`) under the base names, fused experts then cut per expert as
``save_pretrained`` writes them. A base stored quantised
(bitsandbytes nf4/fp4/int8, the project's int4) is dequantised first (:mod:`lightning_merak.hf.dequantised`), so
the merged weights are float and carry the quantisation rounding: the weights the adapter was trained against, plus
its delta.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import socket
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

from lightning_merak.hf.export_source import CheckpointSource
from lightning_merak.hf.merged_adapters import (
    merged_expert_parameters,
    merged_weight,
    refuse_unmergeable,
    untie_adapted,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "EXPORT_DTYPES", "ExportReport", "config_differences", "export_adapter",
           "export_checkpoint", "shard_size_bytes"]

log = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_SIZE = "2GB"
"""The largest safetensors file :func:`export_checkpoint` writes unless told otherwise."""

EXPORT_DTYPES = ("bfloat16", "float16", "float32", "float64")
"""The dtypes ``dtype`` (``--dtype``) writes weights in: the floating-point ones ``from_pretrained`` loads."""

_COPIED_FILES = ("generation_config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json",
                 "vocab.*", "merges.txt", "chat_template*", "spiece.model")


_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
_STAGING_PREFIX = ".merak-export-partial-"
"""Start of the name of the folder an export is written into before it replaces ``out``'s files; the rest is
``<host>-<boot id>-<pid>-<token>`` of the process writing it (:func:`_writer_tag`), so a later export can tell the
folder of one killed outright from a live one's."""
_WEIGHTS_SUFFIXES = (".safetensors", ".bin")
_CONFIG_FILES = frozenset({"config.json", "adapter_config.json"})
_SUPERSEDED_WEIGHTS = ("model-*-of-*.safetensors", _SINGLE_FILE, _INDEX_FILE)
"""An earlier full export's weight files, which a new one replaces as a set (``save_pretrained`` deletes them)."""

_BOOKKEEPING_FIELDS = frozenset({"_name_or_path", "transformers_version", "dtype", "torch_dtype"})
"""Config fields that say where and how a config was saved (the export writes the weights' dtype itself)."""
_UNUSED_BY_OUTPUTS = frozenset({
    "architectures", "use_cache", "output_attentions", "output_hidden_states", "return_dict", "torchscript",
    "id2label", "label2id", "problem_type", "finetuning_task", "task_specific_params", "tokenizer_class", "prefix",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "initializer_range",
    "chunk_size_feed_forward", "attn_implementation", "_attn_implementation", "_attn_implementation_autoset",
})
"""Config fields that change neither the tensors nor the logits of a trained model: outputs asked for, caching,
labels, generation's token ids, initialisation, attention kernels (dropout fields too: off in evaluation)."""


@dataclass
class ExportReport:
    """Files written and the largest tensor group held in memory at once (one shard)."""

    files: list[str] = field(default_factory=list)
    total_size: int = 0
    largest_shard_bytes: int = 0


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
    """``out`` becomes a directory: refused up front when it, or a folder above it, is an existing file, or where
    the export cannot write (``out`` where it exists, else the nearest folder above it that does)."""
    existing = next(path for path in (out, *out.parents) if path.exists())
    if not existing.is_dir():
        raise ValueError(f"output directory {out}: {existing} is an existing file; pass a new or existing directory")
    probe = existing / f"{_STAGING_PREFIX}{_writer_tag()}-probe{secrets.token_hex(4)}"
    try:  # tried, not asked of os.access, which answers for root as if no mount were read-only
        probe.mkdir()
        probe.rmdir()
    except OSError as error:
        raise ValueError(f"output directory {out}: cannot write in {existing} ({error.strerror}); pass a directory "
                         "you can write to") from error


def _changes_outputs(field_name: str) -> bool:
    """Whether a config field can change a trained model's tensors or logits (unknown fields are taken to)."""
    return not (field_name in _UNUSED_BY_OUTPUTS or "dropout" in field_name or field_name.endswith("_pdrop"))


def config_differences(recorded: Mapping[str, Any], given: Mapping[str, Any],
                       functional: bool = True) -> list[tuple[str, Any, Any]]:
    """``(field, recorded value, given value)`` of each transformers config field (``to_dict()`` form) the two
    differ in: with ``functional``, those that change the model's tensors or logits (every field but
    :data:`_UNUSED_BY_OUTPUTS`, dropout and bookkeeping), else the others but bookkeeping. Only ``model_type`` where
    that differs (the other fields then mean other things)."""
    if recorded.get("model_type") != given.get("model_type"):
        return [("model_type", recorded.get("model_type"), given.get("model_type"))]
    return [(name, recorded.get(name), given.get(name)) for name in sorted({*recorded, *given})
            if recorded.get(name) != given.get(name) and name not in _BOOKKEEPING_FIELDS
            and _changes_outputs(name) == functional]


def _export_config(checkpoint: Union[str, Path], record: Mapping[str, Any],
                   config: Optional[Union[str, Path]]) -> Any:
    """The transformers config to export ``checkpoint`` with: the one it records, else ``config``. A ``config``
    beside a recorded one must not change the model (refused naming the fields); fields it changes that do not
    (generation's token ids, say) are named in a warning, as the recorded config is written."""
    from lightning_merak.checkpoint.names import load_config  # lazy: torch

    if not record.get("config"):
        if config is None:
            raise ValueError(f"{checkpoint} records no transformers config (saved before merak-export existed, or "
                             "not from a transformers model); pass --config DIR with the model's config.json")
        return load_config(config)
    recorded = load_config(record["config"])
    if config is None:
        return recorded
    plain = [json.loads(each.to_json_string(use_diff=False)) for each in (recorded, load_config(config))]

    def shown(differences: list[tuple[str, Any, Any]]) -> str:
        return "; ".join(f"{name} is {there!r} there and {here!r} in --config" for name, there, here in differences)

    changing = config_differences(*plain)
    if changing:
        raise ValueError(f"--config {config} differs from the config {checkpoint} records in fields that change the "
                         f"model: {shown(changing)}. The recorded config is the one its weights were trained with; "
                         "drop --config (it stands in only for a checkpoint that records no config)")
    ignored = config_differences(*plain, functional=False)
    if ignored:
        log.warning(f"merak-export: warning: --config {config} differs from the config {checkpoint} records in "
                    f"fields that do not change the model ({shown(ignored)}); the recorded config is written: edit "
                    "config.json in the output to change them")
    return recorded


def _boot_id() -> str:
    """This machine's boot (Linux's ``boot_id``; ``0`` where there is none): a pid names a process within one boot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:12] or "0"
    except OSError:
        return "0"


def _writer_tag() -> str:
    """``<host>-<boot id>-<pid>`` of this process, as a staging folder's name records its writer."""
    host = "".join(char if char.isalnum() or char in ".-" else "_" for char in socket.gethostname()) or "host"
    return f"{host}-{_boot_id()}-{os.getpid()}"


def _writer_gone(name: str) -> bool:
    """Whether the export that named a staging folder ``name`` can no longer be writing it: it ran on this host, and
    the host has rebooted since or its process is gone. A folder of another host (a shared file system), or without
    the writer's tag, is never judged gone."""
    fields = name.rsplit(_STAGING_PREFIX, 1)[-1].rsplit("-", 3)
    if len(fields) != 4 or not fields[2].isdigit():
        return False
    host, boot, pid, _ = fields
    here_host, here_boot, _ = _writer_tag().rsplit("-", 2)
    if host != here_host:
        return False
    if boot != here_boot:
        return True
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, OverflowError):  # no such process; a number no process has
        return True
    except PermissionError:  # another user's process, alive
        return False
    return False


def _remove_dead_staging(out: Path) -> None:
    """Remove the staging folders that exports killed outright (SIGKILL, power loss) left inside ``out`` and beside
    it, those whose writer is gone (:func:`_writer_gone`), and say so in one line."""
    places = [folder for folder in (out, out.parent) if folder.is_dir()]
    dead = sorted(entry for place in places for entry in place.iterdir()
                  if _STAGING_PREFIX in entry.name and entry.is_dir() and _writer_gone(entry.name))
    for folder in dead:
        shutil.rmtree(folder, ignore_errors=True)
    if dead:
        log.info(f"merak-export: removed {len(dead)} folder(s) left by exports killed before they finished: "
                 + ", ".join(str(folder) for folder in dead))


@contextmanager
def _staging(out: Path) -> Iterator[Path]:
    """A new folder to write the export into, on ``out``'s file system: inside ``out`` where it exists, else beside
    it (the folders above made as needed). It and the folders made for it are removed when the export fails or is
    interrupted, before or after :func:`_publish`; folders left by exports killed outright are removed first."""
    made = [folder for folder in out.parents if not folder.exists()]  # the deepest first
    _remove_dead_staging(out)
    name = f"{_STAGING_PREFIX}{_writer_tag()}-{secrets.token_hex(4)}"
    staging = out / name if out.is_dir() else out.parent / f".{out.name}{name}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
        yield staging
    except BaseException:
        if made:  # the topmost folder made for it holds nothing else
            shutil.rmtree(made[-1], ignore_errors=True)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _publish_rank(file: Path) -> int:
    """Where ``file`` comes in :func:`_publish`'s order: weights, their index, other files, the config last."""
    if file.name == _INDEX_FILE:
        return 1
    if file.name.endswith(_WEIGHTS_SUFFIXES):
        return 0
    return 3 if file.name in _CONFIG_FILES else 2


def _publish(staging: Path, out: Path, superseded: tuple[str, ...] = ()) -> None:
    """Put the export in ``staging`` in place as ``out``: renamed to it where ``out`` is new, else its files moved
    into ``out`` one rename each (each replacing one of that name), then the files matching ``superseded`` that the
    new set does not replace deleted (a stale ``model.safetensors`` beside a new sharded set would be the file
    ``from_pretrained`` loads).

    No rename replaces several files at once, so the order keeps a reader from pairing files of the two exports: the
    weight files first, then their index, then the other files, the config (which ``from_pretrained`` reads first)
    last; and where a new file replaces a ``superseded`` one of the same name (shards numbered alike), the earlier
    index goes before any is moved, so no index names a mix of old and new shards (a reader in that moment finds no
    weights index and fails, rather than loading half of each)."""
    if not out.is_dir():
        staging.rename(out)
        return
    written = sorted((file for file in staging.rglob("*") if file.is_file()),
                     key=lambda file: (_publish_rank(file), str(file.relative_to(staging))))
    targets = [out / file.relative_to(staging) for file in written]
    if any(target.exists() and any(target.match(pattern) for pattern in superseded) for target in targets):
        (out / _INDEX_FILE).unlink(missing_ok=True)
    for file, target in zip(written, targets):
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(file, target)
    kept = set(targets)
    for stale in (path for pattern in superseded for path in out.glob(pattern)):
        if stale not in kept:
            stale.unlink(missing_ok=True)


def _copy_source_files(record_config: dict[str, Any], staging: Path, out: Path) -> list[str]:
    """Copy the generation config and tokenizer files of the folder the model was loaded from (``_name_or_path``)
    into ``staging``, the export's new folder for ``out``; a recorded folder that is not there (moved, or recorded
    relative) is named in a warning."""
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
                shutil.copy2(file, staging / file.name)
                copied.append(file.name)
    return copied


def export_checkpoint(checkpoint: Union[str, Path], out: Union[str, Path], *, merge_adapters: bool = False,
                      max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
                      config: Optional[Union[str, Path]] = None, dtype: Optional[str] = None) -> ExportReport:
    """Write ``checkpoint`` to ``out`` as a Hugging Face directory; see the module docstring.

    ``config`` (a transformers directory or config.json) stands in for a checkpoint that recorded
    none (beside a recorded config, it must not change the model); ``dtype`` (one of :data:`EXPORT_DTYPES`) converts
    the weights on the way out. The arguments and the output are checked before the checkpoint is read. With
    ``merge_adapters``, an adapter on a tied weight (LoRA on ``embed_tokens`` with ``tie_word_embeddings``) merges
    into it alone: its partners (``lm_head``) are written as the unmerged base and the exported config says
    ``tie_word_embeddings: false``, so the export computes what the adapter model did.
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
        strip_wrappers,
    )
    from lightning_merak.hf.dequantised import DequantisedSource, int4_expert_tensors  # lazy: torch
    from lightning_merak.hf.experts import export_layout  # lazy: torch
    from lightning_merak.hf.swapped_experts import SwappedExpertsSource, holds_swapped_experts  # lazy: torch

    source: Union[CheckpointSource, DequantisedSource, SwappedExpertsSource] = CheckpointSource(Path(checkpoint))
    if holds_swapped_experts(source.entries):  # moe.experts=deepspeed: written back as the Mixtral blocks they were
        source = SwappedExpertsSource(source)
    quantized = quantized_layers(source.entries)
    quantized_experts = int4_expert_tensors(source.entries)
    if (quantized or quantized_experts) and not merge_adapters:
        what = (f"{next(iter(quantized.values()))}: {next(iter(quantized))} and {len(quantized) - 1} more layers"
                if quantized else f"int4 experts: {min(quantized_experts)} and {len(quantized_experts) - 1} more")
        raise ValueError(f"{checkpoint} holds a quantised base ({what}); pass --merge-adapters to write it "
                         "dequantised with the adapters merged (float weights carrying the quantisation rounding), or "
                         "--adapter-only to write the adapters alone")
    record = source.metadata.get(MODEL_RECORD_KEY) or {}
    hf_config = _export_config(checkpoint, record, config)
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
        raise ValueError(f"{checkpoint} holds tensors {type(model).__name__} does not have: {', '.join(extra[:8])}"
                         + ("" if by_module else
                            "; the model's tensors must sit under `model.` (the LightningModule's `self.model`, as "
                            "merak-train's CausalLMModule holds it): name that attribute `model` and save again, or "
                            "rename the checkpoint's state_dict keys to start with `model.`"))
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
    model, ties = untie_adapted(model, hf_config, adapted)
    if ties:  # the partners written apart: each from its own tensor, else from the tie's source (its unmerged base)
        names, experts = export_layout(model)
        by_module.update({copy: by_module[source] for copy, source in ties.items()
                          if copy not in by_module and source in by_module})
    merged_layers = {name.rpartition(".")[0] for name in names if name.endswith(".weight")} & set(adapted)
    refuse_unmergeable(model, sorted(merged_layers))
    missing = sorted(name for name in [*names, *experts] if name not in by_module)
    if missing:
        raise ValueError(f"{checkpoint} lacks tensors of {type(model).__name__}: {missing[:8]}")
    out_dtype = getattr(torch, dtype) if dtype else None

    def shape_of(name: str) -> tuple[int, ...]:
        stored, expected = source.entries[by_module[name]][0], tuple(meta_state[name].shape)
        if stored != expected:
            whose = ("the --config given: pass the config of the model the checkpoint was trained with"
                     if config is not None and not record.get("config") else "the config the checkpoint records")
            raise ValueError(f"{by_module[name]} has shape {stored} in {checkpoint}, {type(model).__name__} "
                             f"expects {expected} by {whose}")
        return expected

    merged_experts: dict[str, dict[str, torch.Tensor]] = {}  # the last adapted experts module, merged

    def tensor_of(name: str) -> torch.Tensor:
        layer, _, leaf = name.rpartition(".")
        if name in experts and layer in adapted:
            if layer not in merged_experts:
                merged_experts.clear()
                full = adapted[layer]
                stored = {key[len(full) + 1:]: source.read(key) for key in source.entries if key.startswith(full + ".")}
                merged_experts[layer] = merged_expert_parameters(layer, model.get_submodule(layer), stored, adapters)
            tensor = merged_experts[layer][leaf]
            return (tensor.to(out_dtype) if out_dtype else tensor).contiguous()
        tensor = source.read(by_module[name])
        if name.endswith(".weight") and layer in adapted:
            full = adapted[layer]
            base = {key.rpartition(".")[2]: source.read(key) for key in source.entries
                    if key.startswith(full + PEFT_LAYER_INFIX)}
            adapter = {key[len(full) + 1:]: source.read(key) for key in extra if key.startswith(full + ".")}
            tensor = merged_weight(layer, model.get_submodule(layer), base, adapter, adapters)
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
    report = ExportReport(total_size=sum(sizes.values()))
    weight_map = {}
    with _staging(out) as staging:
        for number, shard in enumerate(shards, start=1):
            file_name = (f"model-{number:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1
                         else _SINGLE_FILE)  # as save_pretrained names them
            tensors = {key: output(key) for key in shard}
            save_file(tensors, staging / file_name, metadata={"format": "pt"})
            report.largest_shard_bytes = max(report.largest_shard_bytes, sum(sizes[key] for key in shard))
            weight_map.update(dict.fromkeys(tensors, file_name))
            report.files.append(file_name)
            del tensors
        if len(shards) > 1:
            index = {"metadata": {"total_size": report.total_size}, "weight_map": dict(sorted(weight_map.items()))}
            (staging / _INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
            report.files.append(_INDEX_FILE)
        written = {out_dtype or source.entries[by_module[name]][1] for name, _, _ in outputs.values()}
        floating = {dtype for dtype in written if dtype.is_floating_point}
        if len(floating) == 1:  # the config names the dtype the weights are in (float64 after precision=64, say)
            hf_config.dtype = floating.pop()
        hf_config.save_pretrained(staging)
        report.files += ["config.json", *_copy_source_files(record.get("config") or {}, staging, out)]
        _publish(staging, out, _SUPERSEDED_WEIGHTS)
    return report


def export_adapter(checkpoint: Union[str, Path], out: Union[str, Path]) -> ExportReport:
    """Write the adapters of ``checkpoint`` alone to ``out`` as PEFT's ``save_pretrained`` does, so that
    ``peft.PeftModel.from_pretrained(base, out)`` loads them onto the base model (quantised or not).

    The recorded configs wrap the recorded model on the meta device, so the folder's names and
    ``adapter_config.json`` are PEFT's own; the checkpoint supplies each adapter tensor by that name. PEFT writes into
    a staging folder that replaces ``out``'s files once complete, as :func:`export_checkpoint`'s does, so an export
    that fails or is interrupted leaves an earlier adapter in ``out`` whole.
    """
    from peft import PeftConfig, get_peft_model

    import lightning_merak.adapters  # noqa: F401  # lazy: torch, PEFT (registers Q-BaRA and QA-HiRA with PEFT)
    from lightning_merak.checkpoint.names import MODEL_RECORD_KEY, build_meta_model, load_config  # lazy: torch

    _check_output(Path(out))
    source = CheckpointSource(Path(checkpoint))
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
    report = ExportReport(total_size=sum(tensor.numel() * tensor.element_size() for tensor in state.values()))
    with _staging(out) as staging:
        if (out / "README.md").is_file():  # PEFT updates the model card it finds in the folder it writes
            shutil.copy2(out / "README.md", staging / "README.md")
        model.save_pretrained(staging, state_dict=state, selected_adapters=names)
        report.files = sorted(str(path.relative_to(staging)) for path in staging.rglob("*") if path.is_file())
        _publish(staging, out)
    return report


def _embedding_bases(model: nn.Module, source: CheckpointSource) -> dict[str, torch.Tensor]:
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


def _adapter_tensor(source: CheckpointSource, key: str, shape: tuple[int, ...]) -> torch.Tensor:
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
