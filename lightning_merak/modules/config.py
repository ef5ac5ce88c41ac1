"""What a run is made of: the model, its data and the training loop's settings (plain dataclasses).

They are ``merak-train``'s ``model``, ``data`` and ``trainer`` groups (the Hydra schema registers them as they
are), and what :class:`~lightning_merak.modules.causal_lm.CausalLMModule` and
:class:`~lightning_merak.modules.data.LanguageModelingData` take from Python.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, Optional

from omegaconf import MISSING

from lightning_merak.util.fields import option
from lightning_merak.util.values import is_count, is_finite_number

__all__ = ["DataConfig", "DataError", "ModelConfig", "OptimConfig", "Schedule", "TrainerConfig"]


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
        _refuse([_size_problem(key, value) for key, value in self.config.items()])
        if self.path is None:
            if not self.model_type:
                raise ValueError("model.model_type is required (e.g. llama), or model.path=DIR to load a "
                                 "pretrained transformers directory")
            _check_model_type(self.model_type)
            return
        import json
        from pathlib import Path

        config_file = Path(self.path).expanduser() / "config.json"
        if not config_file.is_file():
            raise ValueError(f"model.path={self.path} has no config.json; pass a local transformers model directory "
                             "(save_pretrained output)")
        weights = ("model.safetensors", "model.safetensors.index.json")
        if not any((config_file.parent / name).is_file() for name in weights):
            raise ValueError(f"model.path={self.path} has a config.json but neither {' nor '.join(weights)}; save the "
                             "model with save_pretrained(..., safe_serialization=True) (PyTorch .bin weights are "
                             "not read), or drop model.path and set model.model_type to initialise at random")
        try:
            saved = json.loads(config_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"model.path={self.path}: {config_file} is not a JSON config ({error}); write it with "
                             "the model's save_pretrained") from None
        saved_type = saved.get("model_type") if isinstance(saved, dict) else None
        if self.model_type and self.model_type != saved_type:
            raise ValueError(f"model.model_type={self.model_type!r} but {config_file} says {saved_type!r}; "
                             "omit model.model_type when model.path is given")
        self.model_type = saved_type


MODEL_SIZES = {
    "hidden_size": 1, "n_embd": 1, "intermediate_size": 1, "n_inner": 1, "head_dim": 1,
    "num_attention_heads": 1, "n_head": 1, "num_key_value_heads": 1, "max_position_embeddings": 1, "n_positions": 1,
    "num_local_experts": 1, "num_experts_per_tok": 1, "num_hidden_layers": 0, "n_layer": 0,
}
"""``model.config``'s sizes (Llama's and GPT-2's names) and their least value: transformers takes 0 or a negative
size and fails later, deep in the run (a division by zero heads, a tensor of negative width); no layers trains."""
UNSET_SIZES = ("n_inner", "head_dim", "num_key_value_heads")
"""The sizes transformers derives from the others when they are null."""


def _size_problem(key: str, value: Any) -> Optional[str]:
    """Why ``model.config.<key>`` cannot be ``value`` when it is one of :data:`MODEL_SIZES`; None when it can."""
    least = MODEL_SIZES.get(key)
    if least is None or (value is None and key in UNSET_SIZES):
        return None
    bound = (f"an integer of at least {least}" + (" (0: no layers)" if least == 0 else "")
             + (", or null to derive it from the other sizes" if key in UNSET_SIZES else ""))
    return _count_problem(f"model.config.{key}", value, bound, least)


def _check_model_type(model_type: str) -> None:
    """Refuse a ``model_type`` transformers does not know, suggesting the closest one it does."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type in CONFIG_MAPPING_NAMES:
        return
    close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING_NAMES), n=3)
    hint = (f"did you mean {close[0]}?" + (f" (or {', '.join(close[1:])})" if close[1:] else "") if close
            else "see transformers' CONFIG_MAPPING for the model types")
    raise ValueError(f"model.model_type={model_type!r} is not a transformers model type; {hint}")


class DataError(ValueError):
    """The data cannot make what the run asks of it (a file missing or unreadable, too few tokens, documents or
    batches for a rank), found before launch or when the ranks read it: ``merak-train`` prints it as a refusal,
    without a traceback."""


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
    """``lightning.Trainer``'s arguments as ``merak-train`` takes them: the usual ones by name, others in ``kwargs``."""

    accelerator: str = option("cpu", "`cpu` or `gpu`.")
    devices: int = option(2, "Processes per node: CPU processes, or GPUs (`-1`: every GPU of the node).")
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
    kwargs: dict[str, Any] = option(
        default_factory=dict, help="Any other `lightning.Trainer` argument, passed as given: `merak-train "
        "trainer.fast_dev_run=true` puts `fast_dev_run` here (checked against `Trainer`'s signature).")

    def __post_init__(self) -> None:
        """Refuse, before any process starts, a loop setting Lightning would take and then train wrongly with (or
        not at all), one reason per field."""
        problems = [
            _count_problem("trainer.max_steps", self.max_steps, "an integer of at least 1, or -1 for no limit (then "
                           "trainer.max_epochs ends the run)", 1, also=(-1,)),
            _count_problem("trainer.max_epochs", self.max_epochs, "an integer of at least 1, or -1 for no limit "
                           "(then trainer.max_steps ends the run)", 1, also=(-1,)),
            _count_problem("trainer.accumulate_grad_batches", self.accumulate_grad_batches,
                           "an integer of at least 1", 1),
            _count_problem("trainer.log_every_n_steps", self.log_every_n_steps, "an integer of at least 1", 1),
            None if self.val_check_interval is None else _count_problem(
                "trainer.val_check_interval", self.val_check_interval, "an integer of at least 1, or null to "
                "validate once per epoch", 1),
            _count_problem("trainer.limit_val_batches", self.limit_val_batches, "an integer of at least 0 (0: no "
                           "validation)", 0),
            _count_problem("trainer.seed", self.seed, f"an integer in [0, {SEED_LIMIT}] (numpy's seeds)", 0,
                           SEED_LIMIT),
        ]
        clip = self.gradient_clip_val
        if clip is not None and not (is_finite_number(clip) and clip >= 0):
            problems.append(f"trainer.gradient_clip_val={clip!r} must be a finite number >= 0 (0 or null: no "
                            "clipping)")
        algorithm = self.kwargs.get("gradient_clip_algorithm")
        if algorithm is not None and str(algorithm).lower() not in CLIP_ALGORITHMS:
            problems.append(f"trainer.gradient_clip_algorithm={algorithm!r} must be one of "
                            f"{', '.join(CLIP_ALGORITHMS)}")
        _refuse(problems)


SEED_LIMIT = 2**32 - 1
"""The largest seed ``lightning.seed_everything`` takes (numpy's)."""
CLIP_ALGORITHMS = ("norm", "value")
"""``lightning.Trainer``'s ``gradient_clip_algorithm`` values."""


def _count_problem(field: str, value: Any, bound: str, lowest: int, highest: float = math.inf,
                   also: tuple[int, ...] = ()) -> Optional[str]:
    """Why ``field`` cannot be ``value`` (it must be ``bound``): not an integer in [lowest, highest] nor one of
    ``also``; None when it can."""
    if is_count(value) and (lowest <= value <= highest or value in also):
        return None
    return f"{field}={value!r} must be {bound}"


def _refuse(problems: list[Optional[str]]) -> None:
    """Raise one refusal naming every field that is out of range (the Nones are not), each with its own bound."""
    found = [problem for problem in problems if problem is not None]
    if found:
        raise ValueError("; ".join(found))


class Schedule(Enum):
    """How the learning rate moves after a linear warm-up (the factors of ``transformers.get_scheduler``'s
    ``cosine_with_min_lr``, ``linear`` and ``constant_with_warmup``; :mod:`lightning_merak.modules.schedules`)."""

    cosine = "cosine"
    linear = "linear"
    constant = "constant"


OPTIMIZERS = ("adamw", "sgd", "muon")
"""The optimizers :class:`OptimConfig` names (``merak-train optim=<name>``)."""
NEWTON_SCHULZ_DTYPES = ("bfloat16", "float32")
"""The dtypes Muon's Newton–Schulz iteration runs in: ``bfloat16`` (``torch.optim.Muon``'s own kernel) or
``float32`` (:func:`lightning_merak.modules.muon.newton_schulz`, the same iteration)."""


@dataclass
class OptimConfig:
    """The optimizer and learning-rate schedule of :class:`~lightning_merak.modules.causal_lm.CausalLMModule`.

    The schedule ends at the run's last optimizer step, which the module reads from its Trainer
    (``estimated_stepping_batches``), so ``max_steps`` is given once, to the Trainer.
    """

    name: str = option("adamw", "`adamw`, `sgd` or `muon` (`torch.optim.Muon`'s update on the weight matrices and "
                       "each expert's matrix, AdamW on the rest: embeddings, head, norms, biases, convolution "
                       "kernels), which `optim=<option>` sets.")
    learning_rate: float = option(3e-3, "The peak learning rate, reached at the end of the warm-up.")
    weight_decay: float = option(0.01, "Weight decay, on matrices only (biases and norms get none).")
    momentum: float = option(0.9, "`sgd` and `muon`: the momentum factor (`sgd`: 0 turns momentum off).")
    newton_schulz_dtype: str = option(
        "bfloat16", "`muon`: the dtype of its Newton–Schulz iteration: `bfloat16` (`torch.optim.Muon`'s; fast on GPUs "
        "and CPUs with AVX512-BF16 or AMX) or `float32` (the same iteration; on a CPU without native bfloat16 "
        "products, AVX2 only, some 50x faster).")
    warmup_steps: int = option(20, "Steps of linear warm-up from 0 to `learning_rate`.")
    lr_schedule: Schedule = option(
        Schedule.cosine, "After the warm-up: `cosine` decays to `min_lr_ratio` of the peak at the run's last step, "
        "`linear` to 0, `constant` stays (as transformers' `get_scheduler` schedules do).")
    min_lr_ratio: float = option(0.1, "`lr_schedule=cosine`: the final learning rate as a fraction of the peak.")
    total_steps: Optional[int] = option(
        None, "The schedule's length in optimizer steps (`null`: the Trainer's, `estimated_stepping_batches`).")

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            close = difflib.get_close_matches(self.name, OPTIMIZERS, n=1)
            hint = f"did you mean {close[0]}?" if close else f"choose one of {', '.join(OPTIMIZERS)}"
            raise ValueError(f"optim.name={self.name!r} is not an optimizer here; {hint}")
        if self.newton_schulz_dtype not in NEWTON_SCHULZ_DTYPES:
            raise ValueError(f"optim.newton_schulz_dtype={self.newton_schulz_dtype!r} is not supported; choose one of "
                             f"{', '.join(NEWTON_SCHULZ_DTYPES)}")
        if self.name == "muon":
            import torch

            if not hasattr(torch.optim, "Muon"):
                raise ValueError(f"optim=muon needs torch.optim.Muon, which torch {torch.__version__} does not have; "
                                 "use optim=adamw, or a torch that has it")
        schedules = [schedule.value for schedule in Schedule]
        if not isinstance(self.lr_schedule, Schedule):
            if self.lr_schedule not in schedules:
                raise ValueError(f"optim.lr_schedule={self.lr_schedule!r} is not supported; choose one of "
                                 f"{', '.join(schedules)}")
            self.lr_schedule = Schedule(self.lr_schedule)
        _refuse(self._range_problems())

    def _range_problems(self) -> list[Optional[str]]:
        """One reason per number out of range: torch checks some only for its own defaults, not for the parameter
        groups' values, and the schedule none of them."""
        problems: list[Optional[str]] = []
        if not (is_finite_number(self.learning_rate) and self.learning_rate > 0):
            problems.append(f"optim.learning_rate={self.learning_rate!r} must be a finite number > 0")
        if not (is_finite_number(self.weight_decay) and self.weight_decay >= 0):
            problems.append(f"optim.weight_decay={self.weight_decay!r} must be a finite number >= 0 (0: no decay)")
        if not (is_finite_number(self.momentum) and 0 <= self.momentum < 1):
            problems.append(f"optim.momentum={self.momentum!r} must be in [0, 1) (a fraction of the last update kept)")
        problems.append(_count_problem("optim.warmup_steps", self.warmup_steps, "an integer >= 0 (0: no warm-up)",
                                       0))
        if not (is_finite_number(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1):
            problems.append(f"optim.min_lr_ratio={self.min_lr_ratio!r} must lie in [0, 1] (a fraction of the peak)")
        if self.total_steps is not None:
            problems.append(_count_problem("optim.total_steps", self.total_steps, "an integer >= 1, or null for the "
                                           "Trainer's length", 1))
        return problems
