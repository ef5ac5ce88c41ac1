"""``merak-train`` as an A/B test would run it: with the same seed, ``strategy=ddp`` and merak3d at dp2, pp2 and
tp2 start from the same weights (issue #55).

Each run takes one optimizer step at learning rate 0 (the warm-up's first step, as transformers' schedules
start) and its final checkpoint is exported as ``merak-export`` does (``export_checkpoint``, in this process), so
each exported folder holds the run's initial weights under Hugging Face names.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_merak.hf.export import export_checkpoint

REPOSITORY = Path(__file__).resolve().parents[1]
ONE_STEP_AT_ZERO_LR = ["trainer.max_steps=1", "optim.warmup_steps=1", "trainer.val_check_interval=1",
                       "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false", "logger=csv"]
LAYOUTS = {"ddp": ["strategy=ddp"], "dp2": [], "pp2": ["strategy.pipeline_parallel=2"],
           "tp2": ["strategy.tensor_parallel=2"]}


def _run(*arguments: str) -> None:
    result = subprocess.run([sys.executable, *arguments], capture_output=True, text=True, timeout=300,
                            cwd=REPOSITORY, env={**os.environ, "PYTHONPATH": str(REPOSITORY)})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]


def _initial_weights(model: str, layout: str, directory: Path) -> dict[str, torch.Tensor]:
    run = directory / f"{model}-{layout}"
    _run("-m", "lightning_merak.cli.train", f"model={model}", *LAYOUTS[layout], *ONE_STEP_AT_ZERO_LR,
         f"hydra.run.dir={run}")
    export_checkpoint(run / "checkpoints" / "final.ckpt", run / "exported")
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted((run / "exported").glob("*.safetensors")):
        weights.update(load_file(shard))
    assert weights, f"merak-export wrote no weights for {model} at {layout}"
    return weights


@pytest.mark.distributed
@pytest.mark.parametrize(("model", "layouts"), [("llama_tiny", ("dp2", "pp2", "tp2")),
                                                # dp2 builds as DDP does: the MoE family checks the split layouts
                                                ("mixtral_tiny", ("pp2", "tp2"))])
def test_ddp_and_merak3d_layouts_export_the_same_initial_weights(model: str, layouts: tuple[str, ...],
                                                                 tmp_path: Path) -> None:
    reference = _initial_weights(model, "ddp", tmp_path)
    for layout in layouts:
        weights = _initial_weights(model, layout, tmp_path)
        assert weights.keys() == reference.keys(), f"{layout}: other tensor names"
        differing = [name for name in reference if not torch.equal(weights[name], reference[name])]
        assert not differing, f"{model} at {layout}: {len(differing)} of {len(reference)} tensors differ from " \
                              f"DDP's, e.g. {differing[:3]}"
