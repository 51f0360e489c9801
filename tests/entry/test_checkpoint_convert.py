"""checkpoint_convert: Hugging Face <-> megarl torch_dist, round trips, layouts, refusals.

Three tiny random checkpoints (Qwen3-MoE, dense Qwen3, DeepSeek-V3) are converted in one
one-rank process (the API, as the CLI calls it): HF -> mcore -> HF must give back every tensor
bit for bit (same names, dtypes and values; 64 KiB shards so the index spans several files). One
two-rank process loads the converted checkpoints into engines that never read the Hugging Face
weights (load_hf=False: their weights are random until the load) under TP=2, PP=2 and EP=2, and
compares their log-probs with a one-rank engine that read the HF folder: 1e-5 absolute (fp32; the
layouts differ from TP=1 by reduction order only; test_checkpoint.py observes ~5e-7). A control shows the comparison can
fail: before the load the same engine is off by more than 1e-2. That process also loads the
converted checkpoint into a TRAINING engine (TP=2, with an optimizer) and saves it with the
trainer's own save_checkpoint; the CLI converts that back to HF, bit-exact again.

Refusals (one line, naming the problem; nothing written): a removed tensor, a changed shape, an
architecture mbridge does not know, an existing target without --overwrite.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests._dist import run_ranks
from tests.engine.test_megatron_engine import make_rows

PRESETS = ("tiny-qwen3-moe", "tiny-qwen3", "tiny-deepseek-v3")
LAYOUTS = [
    ("tiny-qwen3-moe", dict(tp=2)),
    ("tiny-qwen3-moe", dict(pp=2)),
    ("tiny-qwen3-moe", dict(ep=2)),
    ("tiny-qwen3", dict(tp=2)),
    ("tiny-qwen3", dict(pp=2)),
    ("tiny-deepseek-v3", dict(tp=2)),
    ("tiny-deepseek-v3", dict(ep=2)),
]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _hf_tensors(path) -> dict:
    from safetensors.torch import load_file

    index = os.path.join(path, "model.safetensors.index.json")
    files = (
        sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else ["model.safetensors"]
    )
    out = {}
    for f in files:
        out.update(load_file(os.path.join(path, f)))
    return out


def _corrupt(src, dst, edit):
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    tensors = _hf_tensors(src)
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from megarl.models.tiny import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("convert")
    for preset in PRESETS:
        build_tiny_checkpoint(root / preset, seed=3, preset=preset)
    moe = root / "tiny-qwen3-moe"
    _corrupt(moe, root / "missing", lambda t: t.pop("model.layers.1.mlp.experts.2.up_proj.weight"))
    _corrupt(
        moe, root / "reshaped", lambda t: t.update({"model.layers.0.self_attn.o_proj.weight": torch.zeros(64, 32)})
    )
    shutil.copytree(moe, root / "unknown-arch")
    cfg = json.load(open(moe / "config.json"))
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    json.dump(cfg, open(root / "unknown-arch" / "config.json", "w"))
    (root / "occupied").mkdir()
    return root


def _convert_on_rank(rank, root):
    from megatron.core import parallel_state as ps

    from checkpoint_convert import ConvertError
    from checkpoint_convert.convert import hf_to_mcore, mcore_to_hf
    from megarl.engine.megatron.engine import EngineSpec, MegatronEngine

    out = {"reference": {}, "refusals": {}}
    for preset in PRESETS:
        hf_to_mcore(f"{root}/{preset}", f"{root}/mcore-{preset}")
        mcore_to_hf(f"{root}/mcore-{preset}", f"{root}/back-{preset}", max_shard_bytes=64 * 1024)
        engine = MegatronEngine(EngineSpec(model_path=f"{root}/{preset}", micro_batch_size=2))
        engine.initialize()
        out["reference"][preset] = engine.compute_log_prob(make_rows())["log_probs"]
        ps.destroy_model_parallel()
    for case in ("missing", "reshaped", "unknown-arch"):
        try:
            hf_to_mcore(f"{root}/{case}", f"{root}/out-{case}")
            out["refusals"][case] = None
        except ConvertError as e:
            out["refusals"][case] = str(e)
    try:
        hf_to_mcore(f"{root}/tiny-qwen3", f"{root}/occupied")
        out["refusals"]["occupied"] = None
    except ConvertError as e:
        out["refusals"]["occupied"] = str(e)
    return out


def _layouts_on_rank(rank, root):
    from megatron.core import parallel_state as ps

    from megarl.config.schema import OptimConfig, ParallelConfig
    from megarl.engine.megatron.engine import EngineSpec, MegatronEngine

    def engine(preset, optim=None, **layout):
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        spec = EngineSpec(
            model_path=f"{root}/{preset}",
            load_hf=False,
            micro_batch_size=2,
            optim=optim,
            parallel=ParallelConfig(sequence_parallel=layout.get("tp", 1) > 1, **layout),
        )
        e = MegatronEngine(spec)
        e.initialize()
        return e

    def log_probs(e):
        got = e.compute_log_prob(make_rows())
        return None if got is None else got["log_probs"]

    out = {}
    for i, (preset, layout) in enumerate(LAYOUTS):
        e = engine(preset, **layout)
        if i == 0:
            out["before_load"] = log_probs(e)
        e.load_checkpoint(f"{root}/mcore-{preset}", load_optimizer=False)
        out[(preset, tuple(layout.items()))] = log_probs(e)
    trainer = engine("tiny-qwen3-moe", optim=OptimConfig(lr=1e-3), tp=2)
    trainer.load_checkpoint(f"{root}/mcore-tiny-qwen3-moe", load_optimizer=False)
    trainer.save_checkpoint(f"{root}/trainer-tp2")
    return out


@pytest.fixture(scope="module")
def converted(root):
    return run_ranks(_convert_on_rank, 1, str(root))[0]


@pytest.fixture(scope="module")
def layouts(root, converted):
    ranks = run_ranks(_layouts_on_rank, 2, str(root))
    merged = {}
    for r in ranks:  # the last pipeline stage reports; with PP=1 both ranks do (same values)
        merged.update({k: v for k, v in r.items() if v is not None})
    return merged


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run(
        [sys.executable, "-m", "checkpoint_convert", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("preset", PRESETS)
def test_round_trip_bit_exact(root, converted, preset):
    from transformers import AutoModelForCausalLM

    src, back = _hf_tensors(root / preset), _hf_tensors(root / f"back-{preset}")
    assert sorted(back) == sorted(src)
    for name, t in src.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    index = json.load(open(root / f"back-{preset}" / "model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in src.values())
    model, info = AutoModelForCausalLM.from_pretrained(root / f"back-{preset}", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (root / f"back-{preset}" / f).read_bytes() == (root / preset / f).read_bytes()
    meta = json.load(open(root / f"mcore-{preset}" / "megarl_ckpt.json"))
    assert meta["optimizer"] is None and meta["rng"] is False and meta["contents"] == "model"
    assert not any(p.name.endswith((".partial",)) or ".converting" in p.name for p in root.iterdir())


@pytest.mark.parametrize("preset,layout", LAYOUTS, ids=[f"{p}-{next(iter(l))}2" for p, l in LAYOUTS])
def test_converted_checkpoint_loads_in_layout(converted, layouts, preset, layout):
    got, want = layouts[(preset, tuple(layout.items()))], converted["reference"][preset]
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()


def test_control_random_weights_differ(converted, layouts):
    assert (layouts["before_load"] - converted["reference"]["tiny-qwen3-moe"]).abs().max() > 1e-2


@pytest.mark.parametrize(
    "case,needle",
    [
        ("missing", "missing tensors 'model.layers.1.mlp.experts.2.up_proj.weight'"),
        ("reshaped", "shape mismatch for tensor 'model.layers.0.self_attn.o_proj.weight': (64, 32)"),
        ("unknown-arch", "unsupported architecture: model_type 'gpt2'"),
        ("occupied", "exists; choose a new directory or pass --overwrite"),
    ],
)
def test_refusals(root, converted, case, needle):
    message = converted["refusals"][case]
    assert message is not None and needle in message and "\n" not in message, message
    assert not (root / f"out-{case}").exists()
    assert not os.listdir(root / "occupied")


def test_cli_converts_trainer_checkpoint_and_inspects(root, layouts):
    from checkpoint_convert.inspect_ckpt import inspect

    done = _cli("mcore-to-hf", "--mcore", str(root / "trainer-tp2"), "--out", str(root / "trainer-back"))
    assert done.returncode == 0, done.stderr
    src, back = _hf_tensors(root / "tiny-qwen3-moe"), _hf_tensors(root / "trainer-back")
    assert sorted(back) == sorted(src) and all(torch.equal(back[k], v) for k, v in src.items())
    again = _cli("mcore-to-hf", "--mcore", str(root / "trainer-tp2"), "--out", str(root / "trainer-back"))
    assert again.returncode == 2
    assert again.stderr.strip().splitlines()[-1].startswith("checkpoint_convert: error: ")
    assert "--overwrite" in again.stderr
    report = inspect(str(root / "trainer-tp2"))
    assert report["format"] == "megarl torch_dist" and report["metadata"]["layout"]["tp"] == 2
    assert report["metadata"]["optimizer"] == "fully_reshardable"
    model = inspect(str(root / "mcore-tiny-qwen3-moe"))
    assert model["metadata"]["optimizer"] is None and model["total_bytes"] == sum(
        t.numel() * t.element_size() for t in src.values()
    )
    assert model["tensors"]["decoder.layers.mlp.experts.experts.linear_fc1.weight"]["shape"] == [2, 4, 128, 64]
