"""``merak-export``: a lightning-merak checkpoint as a Hugging Face directory ``from_pretrained`` reads.

    merak-export outputs/.../checkpoints/final.ckpt OUT [--merge-adapters] [--max-shard-size 2GB]
    merak-export outputs/.../checkpoints/final.ckpt OUT --adapter-only    # a PEFT adapter folder

The work is :func:`lightning_merak.hf.export.export_checkpoint` (``export_adapter`` with ``--adapter-only``); this
is its command line, which answers ``--help`` without importing torch. A user's mistake (a refused value, a file
that is no checkpoint) prints ``merak-export: error: <the reason, naming the fix>`` and ends with status 2, as
``merak-train`` does; the arguments and the output directory are checked before the checkpoint is read, and an
export that fails or is interrupted leaves an earlier one in OUT as it was.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Sequence

from lightning_merak.hf.export import (  # imports torch only when called
    DEFAULT_MAX_SHARD_SIZE,
    EXPORT_DTYPES,
    export_adapter,
    export_checkpoint,
)
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
    parser.add_argument("--max-shard-size", default=None,
                        help="largest safetensors file: 5GB, 500MB (powers of 1000), 2GiB (of 1024) or a number of "
                             f"bytes (default {DEFAULT_MAX_SHARD_SIZE})")
    parser.add_argument("--config", default=None,
                        help="transformers directory or config.json, for checkpoints that recorded no config "
                             "(beside a recorded config it is refused where it would change the model)")
    parser.add_argument("--dtype", default=None, choices=EXPORT_DTYPES, help="write weights in this dtype")
    return parser


@contextmanager
def _refusals() -> Iterator[None]:
    """A refused export prints the reason alone on stderr (no traceback: the reason names the fix) and ends with
    status 2; other errors are the program's, and raise."""
    from lightning_merak.checkpoint.safe_load import UnsafeCheckpointError  # lazy: torch, after --help

    try:
        yield
    except (ValueError, UnsafeCheckpointError) as error:  # refused values; a checkpoint that would run code to load
        print(f"merak-export: error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Console entry point of ``merak-export``."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.adapter_only and (args.config or args.dtype or args.max_shard_size is not None):
        parser.error("--adapter-only writes the adapters as the checkpoint holds them, in one file; drop --config, "
                     "--dtype and --max-shard-size")
    from lightning_merak.distributed.host_memory import skip_final_collection  # lazy: torch, after --help

    quiet_dependency_noise()
    with _refusals():
        if args.adapter_only:
            report = export_adapter(args.checkpoint, args.out)
        else:
            report = export_checkpoint(args.checkpoint, args.out, merge_adapters=args.merge_adapters,
                                       max_shard_size=(DEFAULT_MAX_SHARD_SIZE if args.max_shard_size is None
                                                       else args.max_shard_size),
                                       config=args.config, dtype=args.dtype)
    skip_final_collection()
    print(f"merak-export: wrote {len(report.files)} files ({report.total_size / 2**20:.1f} MiB of weights) "
          f"to {Path(args.out).resolve()}")


if __name__ == "__main__":
    main()
