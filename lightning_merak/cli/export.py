"""``merak-export``: a lightning-merak checkpoint as a Hugging Face directory ``from_pretrained`` reads.

    merak-export outputs/.../checkpoints/final.ckpt OUT [--merge-adapters] [--max-shard-size 2GB]
    merak-export outputs/.../checkpoints/final.ckpt OUT --adapter-only    # a PEFT adapter folder

The work is :func:`lightning_merak.hf.export.export_checkpoint` (``export_adapter`` with ``--adapter-only``); this
is its command line, which answers ``--help`` without importing torch.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

from lightning_merak.util.console import quiet_dependency_noise

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="merak-export",
        description="Write a lightning-merak checkpoint (merak3d sharded directory, any layout, or a Lightning "
                    ".ckpt) as a Hugging Face directory that AutoModelForCausalLM.from_pretrained loads.")
    parser.add_argument("checkpoint", help="merak3d checkpoint directory or Lightning .ckpt file")
    parser.add_argument("out", help="output directory")
    adapters = parser.add_mutually_exclusive_group()
    adapters.add_argument("--merge-adapters", action="store_true",
                          help="merge adapter (LoRA, Q-BaRA, QA-HiRA) weights into the base weights (a quantised "
                               "base is dequantised first: float weights carrying its quantisation rounding)")
    adapters.add_argument("--adapter-only", action="store_true",
                          help="write the adapters alone, as a PEFT folder that PeftModel.from_pretrained loads")
    parser.add_argument("--max-shard-size", default="2GB", help="largest safetensors file (default 2GB)")
    parser.add_argument("--config", default=None,
                        help="transformers directory or config.json, for checkpoints that recorded no config")
    parser.add_argument("--dtype", default=None, help="write weights in this dtype, e.g. bfloat16")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Console entry point of ``merak-export``."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.adapter_only and (args.config or args.dtype):
        parser.error("--adapter-only writes the adapters as the checkpoint holds them; drop --config and --dtype")
    from lightning_merak.distributed.host_memory import skip_final_collection  # lazy: torch, after --help
    from lightning_merak.hf.export import export_adapter, export_checkpoint  # lazy: torch, after --help

    quiet_dependency_noise()
    if args.adapter_only:
        report = export_adapter(args.checkpoint, args.out)
    else:
        report = export_checkpoint(args.checkpoint, args.out, merge_adapters=args.merge_adapters,
                                   max_shard_size=args.max_shard_size, config=args.config, dtype=args.dtype)
    skip_final_collection()
    print(f"merak-export: wrote {len(report.files)} files ({report.total_size / 2**20:.1f} MiB of weights) "
          f"to {Path(args.out).resolve()}")


if __name__ == "__main__":
    main()
