"""Old import path of CausalLMModule, build_causal_lm, kept for one release: import them from
``lightning_merak.modules.causal_lm``."""

from lightning_merak.util.lazy import lazy_attributes

_EXPORTS = {
    "CausalLMModule": "lightning_merak.modules.causal_lm",
    "build_causal_lm": "lightning_merak.modules.causal_lm",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_attributes(__name__, _EXPORTS, moved_to="the old path is removed in lightning-merak 0.3")
