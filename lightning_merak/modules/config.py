"""What a run is made of: the model, its data and the training loop's settings (plain dataclasses).

They are ``merak-train``'s ``model``, ``data`` and ``trainer`` groups (the Hydra schema registers them as they
are), and what :class:`~lightning_merak.modules.causal_lm.CausalLMModule` and
:class:`~lightning_merak.modules.data.LanguageModelingData` take from Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import MISSING

from lightning_merak.util.fields import option

__all__ = ["DataConfig", "ModelConfig", "TrainerConfig"]


@dataclass
class ModelConfig:
    """A transformers causal LM: built from its config class (random init), or pretrained from ``path``.

    ``model_type`` is any key of ``transformers.CONFIG_MAPPING`` whose model has a
    causal-LM head (``llama``, ``gpt2``, ``mistral``, ...); ``config`` holds keyword
    arguments for that config class. ``vocab_size`` is taken from the data's tokenizer.

    ``path`` is a local transformers directory (``config.json`` and safetensors weights): the
    model type, sizes and vocabulary come from its ``config.json`` (``model_type`` may be
    omitted; ``config`` entries override its values) and the weights are loaded, not initialised.
    """

    name: str = option(MISSING, "The preset's name, which `model=<option>` sets.")
    model_type: Optional[str] = option(
        None, "A transformers model type with a causal-LM head: `llama`, `gpt2`, `mistral`, ... With `path`, "
        "read from its `config.json` (and may be omitted).")
    config: dict[str, Any] = option(
        default_factory=dict, help="Keyword arguments of the model type's config class (with `path`: overrides "
        "of its `config.json`); `vocab_size` comes from the data.")
    path: Optional[str] = option(
        None, "A local transformers directory (`config.json` and safetensors weights) to load pretrained instead "
        "of initialising at random.")

    def __post_init__(self) -> None:
        if self.path is None:
            if not self.model_type:
                raise ValueError("model.model_type is required (e.g. llama), or model.path=DIR to load a "
                                 "pretrained transformers directory")
            return
        import json
        from pathlib import Path

        config_file = Path(self.path).expanduser() / "config.json"
        if not config_file.is_file():
            raise ValueError(f"model.path={self.path} has no config.json; pass a local transformers model directory "
                             "(save_pretrained output)")
        saved_type = json.loads(config_file.read_text()).get("model_type")
        if self.model_type and self.model_type != saved_type:
            raise ValueError(f"model.model_type={self.model_type!r} but {config_file} says {saved_type!r}; "
                             "omit model.model_type when model.path is given")
        self.model_type = saved_type


@dataclass
class DataConfig:
    """Training data: ``synthetic`` (generated language) or ``text`` (a user's file)."""

    name: str = option(MISSING, "`synthetic` or `text`, which `data=<option>` sets.")
    seq_len: int = option(64, "Tokens per sample (with `lengths=fixed`).")
    batch_size: int = option(16, "Samples per batch of each data-parallel rank (with `lengths=variable`: per "
                             "global batch).")
    num_workers: int = option(0, "DataLoader worker processes.")
    seed: int = option(1234, "Seed of the generated language, the shuffling and the validation split.")
    vocab_size: int = option(256, "`synthetic`: tokens of the generated language.")
    num_sequences: int = option(8192, "`synthetic`: training sequences generated.")
    branching: int = option(3, "`synthetic`: successors each token may have (the fewer, the lower the entropy).")
    path: Optional[str] = option(None, "`text`: a `.txt` or `.jsonl` file, by absolute path.")
    text_field: str = option("text", "`text` with a `.jsonl` file: the field holding each document.")
    tokenizer_path: Optional[str] = option(
        None, "`text`: a local directory with tokenizer files (`null`: bytes are the tokens).")
    val_fraction: float = option(0.02, "Fraction of the samples held out for validation.")
    lengths: str = option(
        "fixed", "`fixed`: blocks of `seq_len` tokens; `variable`: each sample keeps its own length (up to "
        "`max_length`), in global batches, for `strategy.micro_batching`.")
    max_length: int = option(2048, "With `lengths=variable`: the longest sample, in tokens.")


@dataclass
class TrainerConfig:
    """The subset of ``lightning.Trainer`` arguments ``merak-train`` exposes."""

    accelerator: str = option("cpu", "`cpu` or `gpu`.")
    devices: int = option(2, "Processes per node: CPU processes, or GPUs.")
    num_nodes: int = option(1, "Nodes; `num_nodes` × `devices` must equal the launched world size.")
    max_steps: int = option(300, "Optimizer steps to train (the learning-rate schedule ends there).")
    max_epochs: int = option(-1, "Epochs to train (-1: until `max_steps`).")
    precision: str = option("32-true", "Lightning's precision: `32-true`, `bf16-mixed`, `bf16-true`, ...")
    gradient_clip_val: Optional[float] = option(1.0, "Clip the gradients' total norm to this (`null`: no clipping).")
    accumulate_grad_batches: int = option(
        1, "Batches whose gradients add up before a step (merak3d needs 1: raise `strategy.micro_batches` and the "
        "batch size instead).")
    log_every_n_steps: int = option(10, "Steps between logged metrics.")
    val_check_interval: Optional[int] = option(
        100, "Steps between validations and periodic checkpoints (`null`: once per epoch).")
    limit_val_batches: int = option(8, "Batches per validation.")
    enable_progress_bar: bool = option(True, "Show the step progress bar.")
    save_last: bool = option(False, "Also keep `checkpoints/last.ckpt`, a link to the newest checkpoint.")
    seed: int = option(1234, "Seed of every random generator (Lightning's `seed_everything`).")
    learning_rate: float = option(3e-3, "AdamW's peak learning rate.")
    weight_decay: float = option(0.01, "AdamW's weight decay, on matrices only (biases and norms get none).")
    warmup_steps: int = option(20, "Steps of linear warm-up, then a cosine decay to a tenth at `max_steps`.")
