"""What a user composes with a Trainer: :class:`CausalLMModule` (a transformers causal LM as a LightningModule),
:class:`LanguageModelingData` (its data: generated, or a text file), :class:`HFDatasetData` (a local Hugging Face
``datasets`` corpus), their settings, and :class:`MuonWithAdamW` (Muon on the matrices, AdamW on the rest, divided
over merak3d's data-parallel ranks). Names are imported on first use."""

from lightning_merak.util.lazy import lazy_attributes

_EXPORTS = {
    "CausalLMModule": ".causal_lm", "build_causal_lm": ".causal_lm",
    "LanguageModelingData": ".data", "HFDatasetData": ".hf_data",
    "MuonWithAdamW": ".muon",
    "DataConfig": ".config", "ModelConfig": ".config", "OptimConfig": ".config", "TrainerConfig": ".config",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_attributes(__name__, _EXPORTS)
