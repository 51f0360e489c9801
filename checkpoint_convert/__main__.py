"""`python -m checkpoint_convert {hf-to-mcore,mcore-to-hf,inspect}`; refusals exit 2 with one line."""

from __future__ import annotations

import argparse
import json
import sys

from checkpoint_convert import ConvertError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m checkpoint_convert", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-mcore", help="Hugging Face safetensors -> megarl torch_dist (model only)")
    a.add_argument("--hf", required=True, help="Hugging Face model directory")
    a.add_argument("--out", required=True, help="new checkpoint directory")
    a.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    b = sub.add_parser("mcore-to-hf", help="megarl torch_dist (converted or saved by the trainer) -> Hugging Face")
    b.add_argument("--mcore", required=True, help="checkpoint directory (has megarl_ckpt.json)")
    b.add_argument("--out", required=True, help="new Hugging Face model directory")
    b.add_argument(
        "--hf-config",
        help="directory (or config.json) with the model's config and tokenizer; "
        "default: the files stored at conversion, else the trainer's model_path",
    )
    b.add_argument("--max-shard-size", type=float, default=5.0, help="GiB per safetensors file (default 5)")
    b.add_argument(
        "--chunk-size",
        type=float,
        default=1.0,
        help="GiB of Megatron parameters loaded at once (default 1; a larger parameter is loaded alone)",
    )
    b.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the written tensors (default: config.json's torch_dtype)",
    )
    b.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    c = sub.add_parser("inspect", help="describe a checkpoint (torch_dist or Hugging Face)")
    c.add_argument("path")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "hf-to-mcore":
            from checkpoint_convert.convert import hf_to_mcore

            meta = hf_to_mcore(args.hf, args.out, overwrite=args.overwrite)
            dropped = meta["source"]["dropped_tensors"]
            print(
                f"wrote {meta['path']} (torch_dist, model only; held at most {_mib(meta['peak_held_bytes'])} "
                f"of {_mib(meta['model_bytes'])} at once)"
                + (f"; dropped {len(dropped)} multi-token-prediction tensors" if dropped else "")
            )
        elif args.command == "mcore-to-hf":
            from checkpoint_convert.convert import mcore_to_hf

            out = mcore_to_hf(
                args.mcore,
                args.out,
                hf_config=args.hf_config,
                overwrite=args.overwrite,
                max_shard_bytes=int(args.max_shard_size * 1024**3),
                dtype=args.dtype,
                chunk_bytes=int(args.chunk_size * 1024**3),
            )
            print(
                f"wrote {out['path']} ({out['tensors']} tensors, config from {out['config']}; held at most "
                f"{_mib(out['peak_held_bytes'])} of {_mib(out['model_bytes'])} at once)"
            )
        else:
            from checkpoint_convert.inspect_ckpt import inspect, render

            report = inspect(args.path)
            print(json.dumps(report, indent=1, sort_keys=True) if args.json else render(report))
    except ConvertError as e:
        print(f"checkpoint_convert: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
