"""Peak host memory (max RSS) of checkpoint_convert for models of several sizes.

Builds random Qwen3 checkpoints (tiny preset with wider / deeper overrides), runs each conversion
as its own process under /usr/bin/time -v, and prints one line per (size, direction):
parameters, checkpoint bytes, wall seconds, peak RSS.

    .venv/bin/python benchmarks/bench_convert.py --root /tmp/bench_convert [--sizes tiny,h1024-L8] [--max-shard-gib 0.25]
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
SIZES = {
    "tiny": {},
    "h1024-L4": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                     num_key_value_heads=8, head_dim=64),
    "h1024-L8": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                     num_key_value_heads=8, head_dim=64),
    "h1024-L32": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=32, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=64),
}


def _peak(cmd: list[str]) -> tuple[float, int]:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    start = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-v", *cmd], cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(done.stderr[-3000:])
    kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1))
    return time.perf_counter() - start, kb * 1024


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/tmp/bench_convert")
    p.add_argument("--max-shard-gib", type=float, default=5.0,
                   help="mcore-to-hf's --max-shard-size: the writer holds up to one shard")
    p.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    args = p.parse_args()
    from megarl.models.tiny import build_tiny_checkpoint

    py = [sys.executable, "-m", "checkpoint_convert"]
    for name in args.sizes.split(","):
        overrides = SIZES[name]
        hf = build_tiny_checkpoint(os.path.join(args.root, name), seed=0, preset="tiny-qwen3", **overrides)
        size = os.path.getsize(os.path.join(hf, "model.safetensors"))
        mcore, back = os.path.join(args.root, f"{name}-mcore"), os.path.join(args.root, f"{name}-back")
        shutil.rmtree(mcore, ignore_errors=True)
        shutil.rmtree(back, ignore_errors=True)
        baseline = _peak([sys.executable, "-c", "import megarl.engine.megatron.engine, transformers, mbridge"])
        t1, m1 = _peak(py + ["hf-to-mcore", "--hf", str(hf), "--out", mcore])
        t2, m2 = _peak(py + ["mcore-to-hf", "--mcore", mcore, "--out", back, "--max-shard-size", str(args.max_shard_gib)])
        print(f"{name}: safetensors {size / 2**20:.1f} MiB | imports only {baseline[1] / 2**20:.0f} MiB | "
              f"hf-to-mcore {t1:.1f} s, peak RSS {m1 / 2**20:.0f} MiB | "
              f"mcore-to-hf {t2:.1f} s, peak RSS {m2 / 2**20:.0f} MiB", flush=True)


if __name__ == "__main__":
    main()
