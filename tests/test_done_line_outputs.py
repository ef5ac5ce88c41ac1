"""The done-line lists the files the run wrote, the profiler's among them, and only those that exist."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from lightning_merak.cli.outputs import outputs


def test_the_profiler_s_files_that_exist_are_listed(tmp_path: Path) -> None:
    trace, perfetto = tmp_path / "merak_trace.json", tmp_path / "merak_trace.perfetto.json"
    trace.write_text("{}")
    perfetto.write_text("{}")
    profiler = SimpleNamespace(paths={"trace": trace, "perfetto": perfetto,
                                      "timeline": tmp_path / "merak_trace.timeline.png"})  # never drawn
    final = tmp_path / "final.ckpt"
    final.write_text("")
    listed = outputs(SimpleNamespace(loggers=[], profiler=profiler), final)
    assert listed == [f"checkpoint: {final}", f"trace: {trace}", f"perfetto: {perfetto}"]
