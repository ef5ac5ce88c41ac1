"""merak-train refuses, before any process starts, the MoE runs that used to fail or be refused after launch with
advice that did not help: the DeepSpeed-MoE swap with the model's router aux loss or with tensor parallelism, and an
expert count whose suggested ``moe.ep_size`` values did not fit the data-parallel ranks."""

import re
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from transformers import MixtralConfig, MixtralForCausalLM

from lightning_merak.cli.config import register_configs
from lightning_merak.cli.train import prepare
from lightning_merak.plugins.moe.experts import expert_split_problem

SMALL_MIXTRAL = ["model=mixtral_tiny", "model.config.hidden_size=32", "model.config.intermediate_size=64",
                 "model.config.num_hidden_layers=1", "data.vocab_size=64", "data.seq_len=16"]


def _prepare(tmp_path: Path, *overrides: str) -> None:
    register_configs()
    with initialize_config_module(config_module="lightning_merak.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"output_dir={tmp_path}", *SMALL_MIXTRAL, *overrides])
    prepare(OmegaConf.to_object(cfg))


@pytest.mark.parametrize("layout", [["trainer.devices=2"], ["trainer.devices=2", "strategy=ddp"],
                                    ["trainer.devices=4", "strategy.pipeline_parallel=2", "strategy.micro_batches=2"]])
def test_the_swap_with_the_models_router_aux_loss_is_refused_before_launch(tmp_path: Path, layout: list[str]):
    """The swap removes Mixtral's routers, so the model's load_balancing_loss_func found no router logits after
    launch (an IndexError; under pipeline stages a refusal advising pipeline_parallel=1, which led to it)."""
    with pytest.raises(ValueError, match=r"^model\.config\.output_router_logits=True .* DeepSpeed-MoE swap replaces: "
                                         r"the swapped layers add their own load-balancing loss \(weighted by "
                                         r"moe\.aux_loss_coef\); .* or use moe\.experts=merak_ep, which keeps the "
                                         r"model's routers"):
        _prepare(tmp_path, *layout, "moe=prophet", "+model.config.output_router_logits=true")


def test_the_swap_under_tensor_parallelism_is_refused_before_launch(tmp_path: Path):
    """It was refused after launch by the tensor splitter, naming the swapped experts' internal layers."""
    with pytest.raises(ValueError, match=r"^strategy\.tensor_parallel=2 is not supported with moe\.experts=deepspeed"
                                         r".*use moe\.experts=merak_ep"):
        _prepare(tmp_path, "trainer.devices=4", "strategy.tensor_parallel=2", "moe=prophet")


@pytest.mark.parametrize("devices, experts, ep_size, choices", [(2, 3, 2, "[1]"), (4, 6, 4, "[1, 2]")])
def test_an_uneven_expert_count_offers_only_sizes_the_data_parallel_ranks_take(tmp_path: Path, devices: int,
                                                                                experts: int, ep_size: int,
                                                                                choices: str):
    """The sizes offered used to divide the experts alone ([1, 3] on 2 ranks), which the layout check refuses."""
    with pytest.raises(ValueError, match=rf"^moe\.ep_size={ep_size} does not divide the {experts} experts .*choose "
                                         rf"moe\.ep_size from {re.escape(choices)} "
                                         rf"\(dividing both the experts and the {devices} data-parallel ranks\)$"):
        _prepare(tmp_path, f"trainer.devices={devices}", f"model.config.num_local_experts={experts}", "moe=prophet",
                 "moe.experts=merak_ep", f"moe.ep_size={ep_size}")


def test_the_sizes_offered_divide_the_experts_and_the_data_parallel_ranks_given():
    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, num_local_experts=6))
    assert expert_split_problem(model, 4).endswith("choose ep_size from [1, 2, 3, 6]")  # the ranks unknown
    assert expert_split_problem(model, 4, data_parallel=4).endswith(
        "choose ep_size from [1, 2] (dividing both the experts and the 4 data-parallel ranks)")
    assert expert_split_problem(model, 3, data_parallel=4) is None  # 3 divides 6; the layout check judges the ranks
