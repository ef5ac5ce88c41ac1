"""A ``plan_only`` run plans and trains nothing: no warning about a warm-up it never steps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm
from lightning_merak.modules.config import ModelConfig, OptimConfig

MODEL = ModelConfig(name="test", model_type="llama", config={"hidden_size": 32, "intermediate_size": 64,
                                                              "num_attention_heads": 4, "num_key_value_heads": 2,
                                                              "num_hidden_layers": 1})


def test_a_plan_only_run_is_not_warned_about_a_warm_up_it_never_steps(recwarn: pytest.WarningsRecorder):
    for plan_only, warned in ((True, False), (False, True)):
        module = CausalLMModule(build_causal_lm(MODEL, vocab_size=64), optim=OptimConfig(warmup_steps=20))
        module._trainer = SimpleNamespace(strategy=SimpleNamespace(plan_only=plan_only), estimated_stepping_batches=2)
        recwarn.clear()
        module.configure_optimizers()
        assert any("is longer than the run's 2 optimizer steps" in str(w.message) for w in recwarn) is warned
