"""Peak host memory (max RSS) of checkpoint_convert for models of several depths.

Builds random fp32 Qwen3 checkpoints of one width and several depths (tiny preset with wider /
deeper overrides), runs each conversion as its own process (its peak RSS is the kernel's
ru_maxrss of the child, read by a small Python parent: what `/usr/bin/time -v` reports, without
needing it installed), and prints one line per size: checkpoint bytes, the RSS of the imports alone, and per direction wall seconds and
peak RSS. Streaming conversion should give about the same peak RSS at every depth.

    .venv/bin/python benchmarks/bench_convert.py --root /tmp/bench_convert
    # the same sizes with another checkout's converter (e.g. the whole-model one, to compare):
    .venv/bin/python benchmarks/bench_convert.py --root /tmp/bench_convert --code /path/to/checkout
    # the tiny size only, in a temporary root, without the imports-only process (checks the script
    # and both directions):
    .venv/bin/python benchmarks/bench_convert.py --smoke
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDE = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=8, head_dim=64)
SIZES = {
    "tiny": {},
    "h1024-L8": dict(WIDE, num_hidden_layers=8),
    "h1024-L16": dict(WIDE, num_hidden_layers=16),
    "h1024-L32": dict(WIDE, num_hidden_layers=32),
}


# runs argv[1:] and prints the peak RSS (KiB on Linux) of it and its waited-for descendants, last on stderr
_PEAK_RSS = (
    "import resource, subprocess, sys\n"
    "rc = subprocess.run(sys.argv[1:]).returncode\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
    "sys.exit(rc)\n"
)


def _peak(cmd: list[str], code: str) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of `cmd` run from `code` with its PYTHONPATH."""
    env = dict(os.environ, PYTHONPATH=code, OMP_NUM_THREADS="1")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _PEAK_RSS, *cmd], cwd=code, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(done.stderr[-3000:])
    kb = int(done.stderr.strip().splitlines()[-1])
    return time.perf_counter() - start, kb * 1024


def _round_trip(original: str, back: str) -> str:
    """'bit-exact' when the converted-back checkpoint holds the original's tensors unchanged; exits otherwise."""
    import glob

    from safetensors.torch import load_file

    def tensors(folder: str) -> dict:
        return {k: v for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))) for k, v in load_file(f).items()}

    want, got = tensors(str(original)), tensors(back)
    differ = sorted(k for k in want if k not in got or not want[k].equal(got[k]))
    if differ or set(got) - set(want):
        sys.exit(f"bench_convert: {back} differs from {original}: {differ[:5]} {sorted(set(got) - set(want))[:5]}")
    return "bit-exact"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--root", default=None, help="where checkpoints go (default /tmp/bench_convert; --smoke: a temp dir)"
    )
    p.add_argument("--code", default=ROOT, help="checkout whose checkpoint_convert runs (default: this one)")
    p.add_argument("--sizes", nargs="+", default=None, choices=list(SIZES), help="default: all (--smoke: tiny)")
    p.add_argument(
        "--chunk-size",
        type=float,
        default=0.125,
        help="mcore-to-hf --chunk-size in GiB (default 0.125: about 3 layers of the h1024 models)",
    )
    p.add_argument("--smoke", action="store_true", help="the tiny size in a temporary root (checks the script)")
    args = p.parse_args()
    args.sizes = args.sizes or (["tiny"] if args.smoke else list(SIZES))
    temporary = args.root is None and args.smoke
    args.root = tempfile.mkdtemp(prefix="bench_convert_") if temporary else args.root or "/tmp/bench_convert"
    try:
        run(args)
    finally:
        if temporary:
            shutil.rmtree(args.root, ignore_errors=True)


def run(args) -> None:
    from megarl.models.tiny import build_tiny_checkpoint

    py = [sys.executable, "-m", "checkpoint_convert"]
    streaming = os.path.isfile(os.path.join(args.code, "checkpoint_convert", "lazy_save.py"))
    chunk = ["--chunk-size", str(args.chunk_size)] if streaming else []  # the whole-model converter has none
    for name in args.sizes:
        hf = build_tiny_checkpoint(os.path.join(args.root, name), seed=0, preset="tiny-qwen3", **SIZES[name])
        size = os.path.getsize(os.path.join(hf, "model.safetensors"))
        mcore, back = os.path.join(args.root, f"{name}-mcore"), os.path.join(args.root, f"{name}-back")
        shutil.rmtree(mcore, ignore_errors=True)
        shutil.rmtree(back, ignore_errors=True)
        # the RSS of the imports alone (not under --smoke: a third process that checks nothing of the converter)
        imports = "import megarl.engine.megatron.engine, transformers, mbridge"
        baseline = (0.0, 0) if args.smoke else _peak([sys.executable, "-c", imports], args.code)
        t1, m1 = _peak(py + ["hf-to-mcore", "--hf", str(hf), "--out", mcore], args.code)
        t2, m2 = _peak(py + ["mcore-to-hf", "--mcore", mcore, "--out", back, *chunk], args.code)
        imports_mib = f"{baseline[1] / 2**20:.0f} MiB" if baseline[1] else "-"
        print(
            f"{name}: safetensors {size / 2**20:.1f} MiB | imports only {imports_mib} | "
            f"hf-to-mcore {t1:.1f} s, peak RSS {m1 / 2**20:.0f} MiB | "
            f"mcore-to-hf {t2:.1f} s, peak RSS {m2 / 2**20:.0f} MiB | round trip {_round_trip(hf, back)}",
            flush=True,
        )
        shutil.rmtree(mcore, ignore_errors=True)
        shutil.rmtree(back, ignore_errors=True)


if __name__ == "__main__":
    main()
