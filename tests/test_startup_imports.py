"""What a run without adapters imports: PEFT and bitsandbytes cost about 1.4 s per rank process to import
(bitsandbytes loads torch's compiler stack), so only a model with adapters or a quantised base may pull them in."""

from __future__ import annotations

import subprocess
import sys

import pytest

# every module a default merak-train run or a Python user's merak3d / callback run imports
RUN_MODULES = ("lightning_merak.cli.train", "lightning_merak.strategies.merak3d.strategy",
               "lightning_merak.strategies.merak3d.build", "lightning_merak.checkpoint.compatible",
               "lightning_merak.checkpoint.sharded", "lightning_merak.modules.causal_lm", "lightning_merak.callbacks",
               "lightning_merak.hf.export", "lightning_merak.parallel.tensor.layers")


@pytest.mark.distributed
def test_a_run_without_adapters_imports_neither_peft_nor_bitsandbytes():
    probe = (f"import importlib, sys\nfor name in {RUN_MODULES!r}:\n    importlib.import_module(name)\n"
             "print(sorted(name for name in ('peft', 'bitsandbytes') if name in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]", (
        f"imported by a run without adapters: {result.stdout.strip()}; import lightning_merak.adapters inside the "
        "function that needs it (`# lazy: PEFT`)")
