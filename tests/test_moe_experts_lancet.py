"""Block-scope Lancet on ``merak_ep``: decoder layers as overlapped sub-batches at top-8, equal to the unswapped
model (outputs, aux loss, gradients) on 2 gloo ranks; the ``auto`` choice and the refusals without processes; the
router aux loss as CausalLMModule optimises it, and where merak3d refuses it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from lightning_merak.plugins.moe.experts.lancet import (
    CANDIDATE_CHUNKS,
    TRIAL_ROUNDS,
    choose_chunks,
    expert_parallel_lancet,
)
from lightning_merak.testing import run_distributed


def test_choose_chunks_takes_the_fastest_best_call_and_fewer_chunks_on_a_tie() -> None:
    assert choose_chunks({1: [0.9, 0.5], 2: [0.6, 0.45], 4: [0.7, 0.8]}) == 2
    assert choose_chunks({4: [0.5], 1: [0.5], 2: [0.5]}) == 1
    with pytest.raises(ValueError, match="at least one timed call"):
        choose_chunks({1: [0.5], 2: []})


def test_refusals_name_the_fix() -> None:
    from lightning_merak.plugins.moe.experts import tiny_moe_model

    model = tiny_moe_model("qwen3_moe")
    with pytest.raises(ValueError, match="'auto' or an integer >= 1"):
        expert_parallel_lancet(model, chunks=0)
    blocks = expert_parallel_lancet(model, chunks=2)
    assert len(blocks) == model.config.num_hidden_layers
    with pytest.raises(ValueError, match="call expert_parallel_lancet once"):
        expert_parallel_lancet(model, chunks=2)
    ids = torch.randint(0, 128, (3, 8))
    with pytest.raises(ValueError, match="cannot be split into 2 Lancet sub-batches"):
        model(ids, use_cache=False)
    with pytest.raises(ValueError, match="use_cache=False"):
        model(torch.randint(0, 128, (2, 8)), use_cache=True)
    with pytest.raises(ValueError, match="no experts module"):
        expert_parallel_lancet(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def _lancet_case(rank: int, world: int, family: str, chunks: int | str) -> dict[str, float]:
    """The unswapped model on this rank's batch against ``merak_ep`` + block-scope Lancet; returns the largest
    differences of logits, loss (with the router's aux loss) and gradients, and how many exchanges ran in turn
    from a second sub-batch."""
    from lightning_merak.distributed.collectives import record_communication
    from lightning_merak.plugins.moe.experts import enable_expert_parallel, tiny_moe_model

    reference = tiny_moe_model(family, output_router_logits=True, router_aux_loss_coef=0.05, use_cache=False)
    swapped = copy.deepcopy(reference)
    report = enable_expert_parallel(swapped)
    layers = expert_parallel_lancet(swapped, chunks)
    generator = torch.Generator().manual_seed(20 + rank)
    steps = 1 + TRIAL_ROUNDS * len([c for c in CANDIDATE_CHUNKS if 4 % c == 0]) + 1 if chunks == "auto" else 1
    worst = {"logits": 0.0, "loss": 0.0, "grads": 0.0, "second_sub_batch_exchanges": 0.0}
    for _ in range(steps):
        ids = torch.randint(0, 128, (4, 12), generator=generator)
        reference.zero_grad()
        swapped.zero_grad()
        out = reference(ids, labels=ids)
        out.loss.backward()
        ref_grads = {}
        for name, param in reference.named_parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)
                ref_grads[name] = param.grad / world
        with record_communication() as trace:
            ours = swapped(ids, labels=ids)
            ours.loss.backward()
        worst["second_sub_batch_exchanges"] += sum(1 for event in trace.events if event["sub_batch"] == 1)
        worst["logits"] = max(worst["logits"], (ours.logits - out.logits).abs().max().item())
        worst["loss"] = max(worst["loss"], abs(ours.loss.item() - out.loss.item()))
        experts = set(report.expert_parameters)
        for name, param in swapped.named_parameters():
            if name in experts:
                grad = param.grad / world
                ref = ref_grads[name][report.local_experts.start:report.local_experts.stop]
            elif name in ref_grads:
                dist.all_reduce(param.grad)
                grad, ref = param.grad / world, ref_grads[name]
            else:
                continue
            worst["grads"] = max(worst["grads"], (grad - ref).abs().max().item())
    worst["chosen"] = float(layers[0].forward.chunks)
    return worst


def _run_lancet(rank: int, world: int) -> dict[str, dict[str, float]]:
    return {"qwen3_moe/2": _lancet_case(rank, world, "qwen3_moe", 2),
            "deepseek_v3/4": _lancet_case(rank, world, "deepseek_v3", 4),
            "mixtral/auto": _lancet_case(rank, world, "mixtral", "auto")}


@pytest.mark.distributed
def test_ep2_block_lancet_equals_unswapped_at_top8_and_auto_agrees() -> None:
    results = run_distributed(_run_lancet, 2, timeout_s=180)
    for case in results[0]:
        for rank_result in results:
            got = rank_result[case]
            assert got["logits"] <= 1e-5 and got["loss"] <= 1e-5 and got["grads"] <= 1e-5, (case, got)
        if not case.endswith("auto"):  # a second sub-batch issued the count gather and both all-to-alls in turn
            assert results[0][case]["second_sub_batch_exchanges"] > 0, case
    assert results[0]["mixtral/auto"]["chosen"] == results[1]["mixtral/auto"]["chosen"]
    assert results[0]["mixtral/auto"]["chosen"] in CANDIDATE_CHUNKS


def _train_block_lancet(rank: int, world: int) -> list[float]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_merak.cli.options.moe import ProphetMoEConfig
    from lightning_merak.modules.causal_lm import CausalLMModule
    from lightning_merak.plugins.moe.experts import tiny_moe_model
    from lightning_merak.testing import TraceRecorder
    from tests.test_moe_experts_distributed import BATCH, STEPS, _lm_batches, _optim

    config = ProphetMoEConfig(experts="merak_ep", ep_size=2, lancet_scope="block", lancet_block_chunks="2")
    module = CausalLMModule(config.apply(tiny_moe_model("qwen3_moe", use_cache=True, output_router_logits=True)),
                            _optim())
    assert module.model.config.use_cache is False
    recorder = TraceRecorder()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, callbacks=[recorder, *config.build_callbacks()])
    trainer.fit(module, DataLoader(TensorDataset(_lm_batches(rank)), batch_size=BATCH))
    return recorder.trace.losses


@pytest.mark.distributed
def test_hydra_block_lancet_trains_like_one_process_under_lightning_ddp() -> None:
    from lightning_merak.modules.causal_lm import CausalLMModule
    from lightning_merak.plugins.moe.experts import tiny_moe_model
    from lightning_merak.testing import module_losses
    from tests.test_moe_experts_distributed import BATCH, STEPS, _lm_batches, _optim

    class PerRankLosses(CausalLMModule):
        """The mean of each rank's loss, as DDP optimises it: the aux loss is not linear in the batch."""

        def compute_loss(self, batch):
            (ids,) = batch
            return sum(super(PerRankLosses, self).compute_loss((half,)) for half in ids.chunk(2)) / 2

    results = run_distributed(_train_block_lancet, 2, timeout_s=120)
    module = PerRankLosses(tiny_moe_model("qwen3_moe", output_router_logits=True), _optim())
    data = [_lm_batches(rank) for rank in range(2)]
    reference = module_losses(module, [(torch.cat([d[step * BATCH:(step + 1) * BATCH] for d in data]),)
                                       for step in range(STEPS)])
    mean = [(a + b) / 2 for a, b in zip(*results)]
    assert mean == pytest.approx(reference, abs=1e-5)


def test_causal_lm_module_optimises_the_router_aux_loss_as_transformers_does() -> None:
    from lightning_merak.modules.causal_lm import CausalLMModule
    from lightning_merak.plugins.moe.experts import tiny_moe_model

    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    for aux in (True, False):
        model = tiny_moe_model("qwen3_moe", output_router_logits=aux, router_aux_loss_coef=0.5)
        module = CausalLMModule(model)
        expected = model(ids, labels=ids).loss
        assert module.compute_loss((ids,)).item() == pytest.approx(expected.item(), rel=1e-6)
        assert (module._router_aux_loss is not None) == aux


def test_jetmoes_aux_loss_weight_is_read_under_its_own_name() -> None:
    """JetMoE weights its aux loss by ``config.aux_loss_coef``, not ``router_aux_loss_coef``."""
    import transformers

    from lightning_merak.modules.causal_lm import CausalLMModule

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "jetmoe", vocab_size=64, hidden_size=32, num_hidden_layers=1, num_key_value_heads=2, kv_channels=8,
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        aux_loss_coef=0.5)
    model = transformers.AutoModelForCausalLM.from_config(config)
    ids = torch.randint(64, (2, 8), generator=torch.Generator().manual_seed(1))
    loss = CausalLMModule(model).compute_loss(ids)
    assert loss.item() == pytest.approx(model(ids, labels=ids).loss.item(), rel=1e-6)


def test_router_aux_loss_is_refused_only_where_a_stage_lacks_the_whole_micro_batch() -> None:
    """Pipeline stages carry the router logits to the last stage (tests/test_merak3d_router_aux.py); token-weighted
    micro-batching, sequence-split routers and, without stages, sub-batched calls are refused."""
    from lightning_merak.parallel.pipeline.router_aux import router_aux_loss_problem

    assert router_aux_loss_problem(True, 2) is None
    assert router_aux_loss_problem(True, 1, micro_batching="dynamic") is None
    assert router_aux_loss_problem(True, "auto", micro_batching="pack") is None  # decided once planned
    assert router_aux_loss_problem(False, 4, micro_batching="dynamic") is None
    assert "use micro_batching='none'" in router_aux_loss_problem(True, 2, micro_batching="dynamic")
    assert "set sequence_parallel=False" in router_aux_loss_problem(True, 2, sequence_parallel=True,
                                                                      tensor_parallel=2)
    assert router_aux_loss_problem(True, 2, sequence_parallel=True, tensor_parallel=1) is None
    # without stages too: a rank's routers see its share of the sequence; a sub-batch's call its own rows
    assert "set sequence_parallel=False" in router_aux_loss_problem(True, 1, sequence_parallel=True,
                                                                      tensor_parallel=2)
    assert "set tp_overlap=1" in router_aux_loss_problem(True, 1, tensor_parallel=2, tp_overlap=2)
    assert router_aux_loss_problem(True, 2, tensor_parallel=2, tp_overlap=2) is None  # carried logits join whole
    assert router_aux_loss_problem(True, 1, tensor_parallel=2, tp_overlap=2, context_parallel=2) is None  # gathered
    assert router_aux_loss_problem(False, 1, sequence_parallel=True, tensor_parallel=2, tp_overlap=2) is None


def _replication_pays() -> object:
    """A cost model under which copying an expert is nearly free and computing tokens dear: every plan replicates,
    so the run exercises replicas (a profiled model on this CPU often plans none at this size)."""
    from lightning_merak.plugins.moe import CommCurve, CostModel

    return CostModel(all_to_all=CommCurve((1.0, 1e6), (1e-3, 1.0)), point_to_point=CommCurve((1.0, 1e6), (1e-9, 1e-9)),
                     expert_tokens_per_s=1e3, bytes_per_token=4 * 64, expert_param_bytes=4 * 3 * 64 * 32,
                     experts_per_rank=8)


def _train_with_replicas(rank: int, world: int, placement: str, preset_cost_model: bool) -> dict[str, object]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_merak.cli.options.moe import ProphetMoEConfig
    from lightning_merak.modules.causal_lm import CausalLMModule
    from lightning_merak.plugins.moe.experts import experts_modules, tiny_moe_model
    from lightning_merak.plugins.moe.experts.parallel import SHARD_ATTRIBUTE
    from lightning_merak.testing import TraceRecorder
    from tests.test_moe_experts_distributed import BATCH, STEPS, _lm_batches, _optim

    config = ProphetMoEConfig(experts="merak_ep", ep_size=2, placement=placement, replan_every=1,
                              log_every_n_steps=1)
    module = CausalLMModule(config.apply(tiny_moe_model("qwen3_moe")), _optim())
    callbacks = config.build_callbacks()
    if preset_cost_model:
        callbacks[0]._planner.cost_model = _replication_pays()
    recorder = TraceRecorder()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, callbacks=[recorder, *callbacks])
    trainer.fit(module, DataLoader(TensorDataset(_lm_batches(rank)), batch_size=BATCH))
    plans = [getattr(experts, SHARD_ATTRIBUTE).plan for _, experts in experts_modules(module.model)]
    return {"losses": recorder.trace.losses, "planned": all(plan is not None for plan in plans),
            "cost_model": callbacks[0]._planner.cost_model is not None,
            "logged": "moe_ep/replicas" in trainer.callback_metrics,
            "replicas": callbacks[0]._planner.replicas_planned}


@pytest.mark.distributed
@pytest.mark.parametrize(("placement", "preset_cost_model"), [("shadowing", True), ("pro_prophet", True),
                                                              ("shadowing", False)])
def test_replicas_replanned_every_batch_train_like_one_process(placement: str, preset_cost_model: bool) -> None:
    from lightning_merak.modules.causal_lm import CausalLMModule
    from lightning_merak.plugins.moe.experts import tiny_moe_model
    from lightning_merak.testing import module_losses
    from tests.test_moe_experts_distributed import BATCH, STEPS, _lm_batches, _optim

    results = run_distributed(_train_with_replicas, 2, args=(placement, preset_cost_model), timeout_s=180)
    module = CausalLMModule(tiny_moe_model("qwen3_moe"), _optim())
    data = [_lm_batches(rank) for rank in range(2)]
    reference = module_losses(module, [(torch.cat([d[step * BATCH:(step + 1) * BATCH] for d in data]),)
                                       for step in range(STEPS)])
    for result in results:
        assert result["planned"] and result["cost_model"] and result["logged"], result
        assert result["replicas"] > 0 or not preset_cost_model, result
    mean = [(a + b) / 2 for a, b in zip(results[0]["losses"], results[1]["losses"])]
    assert mean == pytest.approx(reference, abs=1e-5)


def test_replica_placement_refusals() -> None:
    from lightning_merak.plugins.moe.experts.replanning import ReplicaPlanner

    with pytest.raises(ValueError, match="use pro_prophet or shadowing"):
        ReplicaPlanner("auto")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="replan_every=0 must be >= 1"):
        ReplicaPlanner("shadowing", replan_every=0)
