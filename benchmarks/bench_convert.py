"""Peak host memory (max RSS) of checkpoint_convert for models of several depths.

Builds random fp32 Qwen3 checkpoints of one width and several depths (tiny preset with wider /
deeper overrides), runs each conversion as its own process under /usr/bin/time -v, and prints one
line per size: checkpoint bytes, the RSS of the imports alone, and per direction wall seconds and
peak RSS. Streaming conversion should give about the same peak RSS at every depth.

    .venv/bin/python benchmarks/bench_convert.py --root /tmp/bench_convert
    # the same sizes with another checkout's converter (e.g. the whole-model one, to compare):
    .venv/bin/python benchmarks/bench_convert.py --root /tmp/bench_convert --code /path/to/checkout
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDE = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=8, head_dim=64)
SIZES = {
    "tiny": {},
    "h1024-L8": dict(WIDE, num_hidden_layers=8),
    "h1024-L16": dict(WIDE, num_hidden_layers=16),
    "h1024-L32": dict(WIDE, num_hidden_layers=32),
}


def _peak(cmd: list[str], code: str) -> tuple[float, int]:
    env = dict(os.environ, PYTHONPATH=code, OMP_NUM_THREADS="1")
    start = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-v", *cmd], cwd=code, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(done.stderr[-3000:])
    kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1))
    return time.perf_counter() - start, kb * 1024


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/tmp/bench_convert")
    p.add_argument("--code", default=ROOT, help="checkout whose checkpoint_convert runs (default: this one)")
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument(
        "--chunk-size",
        type=float,
        default=0.125,
        help="mcore-to-hf --chunk-size in GiB (default 0.125: about 3 layers of the h1024 models)",
    )
    args = p.parse_args()
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
        baseline = _peak(
            [sys.executable, "-c", "import megarl.engine.megatron.engine, transformers, mbridge"], args.code
        )
        t1, m1 = _peak(py + ["hf-to-mcore", "--hf", str(hf), "--out", mcore], args.code)
        t2, m2 = _peak(py + ["mcore-to-hf", "--mcore", mcore, "--out", back, *chunk], args.code)
        print(
            f"{name}: safetensors {size / 2**20:.1f} MiB | imports only {baseline[1] / 2**20:.0f} MiB | "
            f"hf-to-mcore {t1:.1f} s, peak RSS {m1 / 2**20:.0f} MiB | "
            f"mcore-to-hf {t2:.1f} s, peak RSS {m2 / 2**20:.0f} MiB",
            flush=True,
        )
        shutil.rmtree(mcore, ignore_errors=True)
        shutil.rmtree(back, ignore_errors=True)


if __name__ == "__main__":
    main()
