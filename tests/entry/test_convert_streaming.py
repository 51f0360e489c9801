"""checkpoint_convert streams: it never holds more than one chunk of the model at once.

One one-rank process converts a 12-layer tiny Qwen3 (hidden 64, fp32, ~1.9 MB of parameters) and a
12-layer tied-embedding tiny Qwen2 HF -> mcore -> HF, with mcore-to-hf loading chunks of at most 128 KiB
and writing ONE safetensors shard (max_shard_bytes 1 GiB), and reports the converter's own count
of tensor bytes alive at once (checkpoint_convert/held.py: every tensor it reads, builds or loads,
counted until Python frees it). The old path built the whole model and wrote a shard from a dict
of all its tensors, so it held at least the model's bytes; here the peak must stay within 3x the
largest parameter (hf-to-mcore builds one parameter at a time) or the largest chunk plus one
parameter (mcore-to-hf), and below a quarter of the model.

Independent checks, all exact (bit-equal, no tolerance): the round trip gives back every HF tensor
(fp32, and --dtype bfloat16 equals the HF tensors cast to bfloat16); the streamed torch_dist
checkpoint, loaded by megatron's own loader into an engine that never read HF weights, equals an
engine that loaded the HF folder, parameter by parameter. A config whose shapes differ from the
checkpoint is refused in one line naming the tensor, with no output left behind.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests._dist import run_ranks
from tests.entry.test_checkpoint_convert import _hf_tensors

CHUNK = 128 * 1024
DEEP = dict(num_hidden_layers=12)


def _on_rank(rank, root):
    from megatron.core import parallel_state as ps

    from checkpoint_convert import ConvertError
    from checkpoint_convert.convert import hf_to_mcore, mcore_to_hf, one_rank
    from checkpoint_convert.meta_model import MetaModel
    from megarl.engine.megatron.engine import EngineSpec, MegatronEngine
    from megarl.models.tiny import build_tiny_checkpoint

    out = {}
    deep = build_tiny_checkpoint(f"{root}/deep", seed=5, preset="tiny-qwen3", **DEEP)
    tied = build_tiny_checkpoint(f"{root}/tied", seed=5, preset="tiny-qwen2", tie_word_embeddings=True, **DEEP)
    for name, hf in (("deep", deep), ("tied", tied)):
        to = hf_to_mcore(str(hf), f"{root}/mcore-{name}")
        back = mcore_to_hf(f"{root}/mcore-{name}", f"{root}/back-{name}", chunk_bytes=CHUNK)
        with one_rank():
            meta = MetaModel(str(hf))
            out[name] = dict(
                to=to["peak_held_bytes"],
                back=back["peak_held_bytes"],
                model=meta.nbytes,
                param=max(p.nbytes for p in meta.params),
                chunk=max(sum(p.nbytes for p in c) for c in meta.chunks(CHUNK)),
            )
    mcore_to_hf(f"{root}/mcore-deep", f"{root}/bf16-deep", dtype="bfloat16", chunk_bytes=CHUNK)

    def params(load_hf):
        engine = MegatronEngine(EngineSpec(model_path=str(deep), load_hf=load_hf))
        engine.initialize()
        if not load_hf:
            engine.load_checkpoint(f"{root}/mcore-deep", load_optimizer=False)
        got = {k: v.clone() for k, v in engine.bare_chunks()[0].state_dict().items() if "_extra_state" not in k}
        ps.destroy_model_parallel()
        return got

    out["from_hf"], out["from_mcore"] = params(True), params(False)
    wider = build_tiny_checkpoint(f"{root}/wider", seed=5, preset="tiny-qwen3", intermediate_size=192, **DEEP)
    try:
        mcore_to_hf(f"{root}/mcore-deep", f"{root}/out-wider", hf_config=str(wider), chunk_bytes=CHUNK)
        out["refusal"] = None
    except ConvertError as e:
        out["refusal"] = str(e)
    return out


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    return root, run_ranks(_on_rank, 1, str(root))[0]


@pytest.mark.parametrize("name", ["deep", "tied"])
def test_round_trip_bit_exact_in_one_shard(streamed, name):
    root, _ = streamed
    src, back = _hf_tensors(root / name), _hf_tensors(root / f"back-{name}")
    assert sorted(back) == sorted(src)
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in src.items())
    index = json.load(open(root / f"back-{name}" / "model.safetensors.index.json"))
    assert set(index["weight_map"].values()) == {"model-00001-of-00001.safetensors"}


def test_bfloat16_output(streamed):
    root, _ = streamed
    src, back = _hf_tensors(root / "deep"), _hf_tensors(root / "bf16-deep")
    assert sorted(back) == sorted(src)
    assert all(back[k].dtype == torch.bfloat16 and torch.equal(back[k], v.to(torch.bfloat16)) for k, v in src.items())


@pytest.mark.parametrize("name", ["deep", "tied"])
def test_holds_one_chunk_not_the_model(streamed, name):
    _, out = streamed
    s = out[name]
    assert s["model"] > 12 * s["param"]  # a model much larger than any one parameter
    assert 0 < s["to"] <= 3 * s["param"], s
    assert 0 < s["back"] <= s["chunk"] + s["param"], s
    assert max(s["to"], s["back"]) < s["model"] / 4, s  # the whole-model path held >= s["model"]


def test_streamed_checkpoint_loads_with_megatron(streamed):
    _, out = streamed
    want, got = out["from_hf"], out["from_mcore"]
    assert sorted(got) == sorted(want) and len(want) > 90
    assert all(torch.equal(got[k], v) for k, v in want.items())


def test_shape_mismatch_refused_naming_the_tensor(streamed):
    root, out = streamed
    message = out["refusal"]
    assert message is not None and "\n" not in message, message
    assert "shape mismatch for tensor 'decoder.layers.mlp.linear_fc1.weight'" in message
    assert not (root / "out-wider").exists()
    assert not any(".converting" in p.name for p in root.iterdir())
