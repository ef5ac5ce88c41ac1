"""What a run is made of: the model, its data and the training loop's settings (plain dataclasses).

They are ``merak-train``'s ``model``, ``data`` and ``trainer`` groups (the Hydra schema registers them as they
are), and what :class:`~lightning_merak.modules.causal_lm.CausalLMModule` and
:class:`~lightning_merak.modules.data.LanguageModelingData` take from Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

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

    name: str = MISSING
    model_type: Optional[str] = None
    config: dict[str, Any] = field(default_factory=dict)
    path: Optional[str] = None

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

    name: str = MISSING
    seq_len: int = 64
    batch_size: int = 16
    num_workers: int = 0
    seed: int = 1234
    # synthetic
    vocab_size: int = 256
    num_sequences: int = 8192
    branching: int = 3
    # text / jsonl
    path: Optional[str] = None
    text_field: str = "text"
    tokenizer_path: Optional[str] = None
    val_fraction: float = 0.02
    # fixed: blocks of seq_len tokens; variable: each sample keeps its length (up to max_length), in global batches
    lengths: str = "fixed"
    max_length: int = 2048


@dataclass
class TrainerConfig:
    """The subset of ``lightning.Trainer`` arguments ``merak-train`` exposes."""

    accelerator: str = "cpu"
    devices: int = 2
    num_nodes: int = 1
    max_steps: int = 300
    max_epochs: int = -1
    precision: str = "32-true"
    gradient_clip_val: Optional[float] = 1.0
    accumulate_grad_batches: int = 1
    log_every_n_steps: int = 10
    val_check_interval: Optional[int] = 100
    limit_val_batches: int = 8
    enable_progress_bar: bool = True
    save_last: bool = False
    seed: int = 1234
    learning_rate: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int = 20
