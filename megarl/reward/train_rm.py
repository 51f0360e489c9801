"""Train a sequence-classification reward model with the Bradley-Terry loss on preference pairs.

    python -m megarl.reward.train_rm --task digits --out outputs/rm-digits
    python -m megarl.reward.train_rm --pairs pairs.jsonl --init HF_FOLDER --out DIR

The model starts from `--init`: a tiny preset (megarl/models/tiny*.py: a fresh random decoder and
its character tokenizer) or a Hugging Face folder (a causal LM gets a new `score` head; a reward
model continues training). Pairs come from a procedural task (`--task digits`: a correct answer
preferred over a wrong one for the same prompt, preference_pairs.digits_pairs) or a JSONL file
(`--pairs`, preference_pairs.read_pairs). A held-out share of them is kept out of training.

The loss is Bradley-Terry's: -log sigmoid(r(chosen) - r(rejected)), averaged over `--batch-size`
pairs per step, for `--steps` AdamW steps (gradient norm clipped to 1); a tie (two responses equally
good) counts half a win each way, which is least when they score the same. The folder written to
`--out` is an ordinary Hugging Face checkpoint (XForSequenceClassification, num_labels=1, the
tokenizer) plus megarl_rm.json: the recipe and the held-out pair accuracy, the fraction of held-out
pairs with a winner whose chosen response scores higher. Point a run at it with reward.model.kind=classifier
reward.model.path=DIR. Bad arguments: one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from megarl.reward.preference_pairs import Pair
from megarl.reward.seqcls import check_head, sequence_scores

RECIPE_FILE = "megarl_rm.json"


@dataclass(frozen=True)
class TrainSpec:
    steps: int = 800
    batch_size: int = 64  # pairs per optimizer step
    lr: float = 2e-3
    weight_decay: float = 0.0
    seed: int = 0


def init_classifier(init: str, seed: int = 0):
    """(model, tokenizer): a tiny preset's decoder with a fresh one-score head, or the Hugging
    Face folder `init` loaded as a one-score classifier. Seeded: the same init, the same model."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from megarl.models.tiny import PRESETS, TOOLS_PRESET, build_tokenizer

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if init in PRESETS:
            spec = {k: v for k, v in PRESETS[init].items() if k != "architectures"}
            config = AutoConfig.for_model(**spec, num_labels=1)
            model = AutoModelForSequenceClassification.from_config(config).float()
            tokenizer = build_tokenizer(tools=init == TOOLS_PRESET)
        else:
            verbosity = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()  # a causal LM's "score weights newly initialised": expected
            try:
                model = AutoModelForSequenceClassification.from_pretrained(init, num_labels=1)
            finally:
                hf_logging.set_verbosity(verbosity)
            tokenizer = AutoTokenizer.from_pretrained(init)
    if model.config.pad_token_id is None:  # HF's own forward needs one to score batches
        model.config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    check_head(model, f"--init {init}")
    return model, tokenizer


def bradley_terry_loss(model, pairs: list[Pair], batch_size: int) -> torch.Tensor:
    """-log sigmoid(r(chosen) - r(rejected)) for a win; a tie counts half a win each way, its least
    at equal scores."""
    scores = sequence_scores(model, [p[0] for p in pairs] + [p[1] for p in pairs], batch_size)
    wins = torch.tensor([p[2] for p in pairs], dtype=scores.dtype, device=scores.device)
    return torch.nn.functional.binary_cross_entropy_with_logits(scores[: len(pairs)] - scores[len(pairs) :], wins)


def pair_accuracy(model, pairs: list[Pair], batch_size: int = 256) -> float | None:
    """The fraction of the pairs with a winner whose chosen sequence scores strictly higher (None
    without such pairs)."""
    decided = [p for p in pairs if p[2] == 1.0]
    if not decided:
        return None
    with torch.inference_mode():
        scores = sequence_scores(model, [p[0] for p in decided] + [p[1] for p in decided], batch_size)
    return float((scores[: len(decided)] > scores[len(decided) :]).float().mean())


def train_bradley_terry(model, pairs: list[Pair], spec: TrainSpec) -> list[float]:
    """Train `model` in place; the loss of every step. Pairs are drawn in shuffled epochs."""
    rng = random.Random(spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    model.train()
    losses, order = [], []
    for _ in range(spec.steps):
        if len(order) < spec.batch_size:
            order += rng.sample(range(len(pairs)), len(pairs))
        batch, order = [pairs[i] for i in order[: spec.batch_size]], order[spec.batch_size :]
        loss = bradley_terry_loss(model, batch, batch_size=2 * len(batch))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    return losses


def split_pairs(pairs: list[Pair], held_out: float, seed: int) -> tuple[list[Pair], list[Pair]]:
    """(train, held-out): a shuffled `held_out` share of the pairs kept out of training."""
    pairs = list(pairs)
    random.Random(seed).shuffle(pairs)
    cut = len(pairs) - int(round(held_out * len(pairs)))
    return pairs[:cut], pairs[cut:]


def train_and_save(model, tokenizer, train: list[Pair], held_out: list[Pair], spec: TrainSpec, out, recipe: dict):
    """Train, measure the held-out accuracy, write the folder (atomically: a crash never leaves a
    half-written model that a later run would trust); returns what megarl_rm.json records."""
    losses = train_bradley_terry(model, train, spec)
    info = {
        "recipe": recipe,
        "train_pairs": len(train),
        "held_out_pairs": len(held_out),
        "held_out_preferences": sum(p[2] == 1.0 for p in held_out),  # the accuracy's pairs (no ties)
        "held_out_accuracy": pair_accuracy(model, held_out),
        "final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
    }
    out = Path(out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / RECIPE_FILE).write_text(json.dumps(info, indent=2))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return info


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megarl.reward.train_rm", description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--task", choices=["digits"], help="pairs made in code from this task's ground truth")
    source.add_argument("--pairs", help='JSONL of {"prompt", "chosen", "rejected"}')
    p.add_argument("--out", required=True, help="the reward model's folder (replaced if it exists)")
    p.add_argument("--init", default="tiny-qwen3", help="a tiny preset or a Hugging Face folder (default tiny-qwen3)")
    p.add_argument("--num-pairs", type=int, default=4096, help="--task: pairs to make (default 4096)")
    p.add_argument(
        "--max-response-tokens", type=int, default=2, help="--task: response length (rollout.max_new_tokens)"
    )
    p.add_argument("--held-out", type=float, default=0.1, help="share of the pairs kept for the accuracy (0.1)")
    for name, default in asdict(TrainSpec()).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default, help=f"(default {default})")
    return p


def _argument_problem(args, spec: TrainSpec) -> str | None:
    from megarl.models.tiny import PRESETS

    if args.init not in PRESETS and not (Path(args.init) / "config.json").is_file():
        return f"--init {args.init} is neither a tiny preset ({', '.join(PRESETS)}) nor a Hugging Face folder"
    if args.pairs and not Path(args.pairs).is_file():
        return f"--pairs {args.pairs} does not exist"
    if spec.steps < 1 or spec.batch_size < 1 or args.num_pairs < 2 or not 0 <= args.held_out < 1:
        return "--steps and --batch-size must be >= 1, --num-pairs >= 2, --held-out in [0, 1)"
    return None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    spec = TrainSpec(args.steps, args.batch_size, args.lr, args.weight_decay, args.seed)
    problem = _argument_problem(args, spec)
    if problem:
        print(f"megarl: rm-train error: {problem}", file=sys.stderr)
        return 2
    try:
        model, tokenizer = init_classifier(args.init, spec.seed)
        if args.task:
            from megarl.reward.preference_pairs import digits_pairs

            vocab = model.config.vocab_size
            pairs = digits_pairs(tokenizer, vocab, args.num_pairs, spec.seed, args.max_response_tokens)
        else:
            from megarl.reward.preference_pairs import read_pairs

            pairs = read_pairs(args.pairs, tokenizer)
    except ValueError as err:
        print(f"megarl: rm-train error: {err}", file=sys.stderr)
        return 2
    recipe = {"init": args.init, "task": args.task, "pairs": args.pairs, "train": asdict(spec)}
    info = train_and_save(model, tokenizer, *split_pairs(pairs, args.held_out, spec.seed), spec, args.out, recipe)
    accuracy, n = info["held_out_accuracy"], info["held_out_preferences"]
    held = "no held-out preferences" if accuracy is None else f"held-out pair accuracy {accuracy:.3f} over {n} pairs"
    print(f"saved the reward model to {args.out}: {held}; final loss {info['final_loss']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
