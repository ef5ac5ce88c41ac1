"""Old import path of DataConfig, ModelConfig, TrainerConfig, kept for one release: import them from
``lightning_merak.modules.config``."""

from lightning_merak.util.lazy import lazy_attributes

_EXPORTS = {
    "DataConfig": "lightning_merak.modules.config",
    "ModelConfig": "lightning_merak.modules.config",
    "TrainerConfig": "lightning_merak.modules.config",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_attributes(__name__, _EXPORTS, moved_to="the old path is removed in lightning-merak 0.3")
