"""Old import path of LanguageModelingData, kept for one release: import them from
``lightning_merak.modules.data``."""

from lightning_merak.util.lazy import lazy_attributes

_EXPORTS = {
    "LanguageModelingData": "lightning_merak.modules.data",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_attributes(__name__, _EXPORTS, moved_to="the old path is removed in lightning-merak 0.3")
