"""The TRL peer of bench_vs_trl.py: Hugging Face TRL's GRPOTrainer doing megarl's quickstart.

Runs INSIDE the benchmark-only TRL venv (.venv-trl, built by benchmarks/setup_trl_env.sh: torch
2.13.0, trl 1.16.0, transformers 5.x); megarl is not importable there, so nothing here imports it.

    .venv-trl/bin/python benchmarks/_trl_grpo.py --model DIR --train rows.jsonl --steps 200 --out trl.jsonl

`--model` is a Hugging Face folder written by megarl (megarl.models.tiny.build_tiny_checkpoint: the
quickstart's initial weights, character tokenizer and chat template); `--train` has one JSON row a
line, {"prompt": [{"role": "user", "content": "382"}], "answer": "2"}, megarl's digits rows.

A "step" here is megarl's step, one generation round: `prompts` (16) distinct prompts x `n` (16)
samples = 256 rows, then 2 optimizer steps of 128 rows, each accumulated from 2 micro-batches of 64
rows. In TRL 1.16 terms (trl/trainer/grpo_config.py __post_init__, grpo_trainer.py
_get_train_sampler and _prepare_inputs):

    per_device_train_batch_size = 64           micro-batch (rows per forward/backward)
    gradient_accumulation_steps = 2            -> 128 rows per optimizer step (Trainer global_step)
    steps_per_generation        = 4            -> generation_batch_size = 64 * 1 process * 4 = 256
    num_generations             = 16           RepeatSampler: 256 / 16 = 16 distinct prompts, each x16
    max_steps                   = 2 * steps    two optimizer steps per generation round

_prepare_inputs generates when its micro-step counter is a multiple of steps_per_generation *
num_iterations (4), shuffles the 256 rows and hands out 64-row quarters; the Trainer steps the
optimizer after every 2 of them. Since gradient_accumulation_steps (2) is not a multiple of 4,
TRL computes the old log-probs in a separate no-grad pass after generation, as megarl does.

The rest of megarl's configs/quickstart.yaml, mapped:

    lr 1e-3, constant, no warm-up     learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0
    AdamW, weight decay 0, clip 1.0   optim: TrainingArguments' default (adamw_torch_fused; betas 0.9,
                                      0.999, eps 1e-8 = megarl's OptimConfig defaults), max_grad_norm=1.0
    temperature 1, top_p 1, top_k -1  temperature=1.0, top_p=1.0, top_k=0 (TRL: 0 = no top-k)
    max_new_tokens                    max_completion_length
    no KL loss, no reference model    beta=0.0 (TRL then loads no reference model)
    clip_ratio_low/high 0.2           epsilon=0.2, epsilon_high=0.2
    ppo_epochs 1                      num_iterations=1
    GRPO, norm_adv_by_std             scale_rewards="group": (r - group mean) / (group std + 1e-4),
                                      unbiased std; megarl adds 1e-6 instead of 1e-4 (a group whose
                                      std is 0 gets advantage 0 either way)
    loss_agg_mode token-mean          loss_type="dapo": sum of the clipped per-token losses over the
                                      accumulated batch / its number of completion tokens. megarl's
                                      token-mean divides each 128-row mini-batch by its own token
                                      count; TRL's dapo divides by the generation batch's count
                                      scaled to one optimizer step (256-row count / 2), equal when
                                      both mini-batches have as many tokens (always at fixed length;
                                      at most a few % apart in the 2-token quickstart). "bnpo"
                                      averages per 64-row micro-batch, "grpo" per sequence (not
                                      token-mean), "dr_grpo" divides by a constant: none is closer.
    fp32, no recompute                bf16=False, fp16=False, gradient_checkpointing=False (TRL's
                                      defaults are bf16=True and gradient checkpointing on)
    no router aux loss                router_aux_loss_coef=0.0 (the checkpoint's config says 0 too)
    seed 0                            seed=0 (data order and sampling differ from megarl's anyway)

Both sides stop a completion at the tokenizer's / config's eos and count the eos token in the
loss. Nothing is evaluated, saved or reported (eval_strategy="no", save_strategy="no",
report_to="none"); TRL logs its metrics once per round (logging_steps=2), as megarl prints one line
per step. torch keeps its default thread count: TRL is one process and may use every core.

Output (--out, one JSON object a line): {"kind": "step", "step", "start", "end", "step_s",
"reward_mean", "gen_s", "prepare_s" (time_stages), "trl": {TRL's logged metrics}} per round (time.time() stamps), then
{"kind": "summary", ...} with process_start (this script's first line), first_step_start,
last_step_end, steps_s (their difference), startup_s, process_s, torch_threads and versions.
"""

from __future__ import annotations

import time

PROCESS_START = time.time()  # before the heavy imports: they are part of the start-up

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402


def digits_score(solution_str: str, ground_truth: str) -> float:
    """megarl/reward/rule.py digits_score, verbatim in effect (megarl is not importable here):
    the fraction of the answer's characters the response gets right, position by position;
    characters after the answer are ignored. tests/benchmarks/test_bench_vs_trl_reward.py checks equality."""
    if not ground_truth:
        raise ValueError("megarl/digits row has an empty ground_truth")
    hits = sum(a == b for a, b in zip(solution_str, ground_truth))
    return hits / len(ground_truth)


def completion_text(completion) -> str:
    """TRL passes a conversational completion as [{"role": "assistant", "content": text}]."""
    return completion[0]["content"] if isinstance(completion, list) else completion


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF checkpoint folder (megarl-built)")
    p.add_argument("--train", required=True, help="jsonl of {prompt: [messages], answer}")
    p.add_argument("--steps", type=int, required=True, help="generation rounds (megarl steps)")
    p.add_argument("--out", required=True, help="per-step metrics jsonl to write")
    p.add_argument("--prompts", type=int, default=16, help="distinct prompts per step")
    p.add_argument("--n", type=int, default=16, help="samples per prompt (num_generations)")
    p.add_argument("--mini-batch", type=int, default=128, help="rows per optimizer step")
    p.add_argument("--micro-batch", type=int, default=64, help="rows per forward/backward")
    p.add_argument("--max-new-tokens", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="the Trainer's output_dir (nothing is saved there)")
    return p.parse_args(argv)


def batch_shape(args) -> dict:
    """TRL's batch knobs for megarl's rows per step / per optimizer step / per micro-batch."""
    rows = args.prompts * args.n
    if rows % args.mini_batch or args.mini_batch % args.micro_batch:
        raise SystemExit(
            f"_trl_grpo: {rows} rows per step must split into mini-batches of "
            f"{args.mini_batch} rows, and those into micro-batches of {args.micro_batch}"
        )
    return {
        "per_device_train_batch_size": args.micro_batch,
        "gradient_accumulation_steps": args.mini_batch // args.micro_batch,
        "steps_per_generation": rows // args.micro_batch,
        "optimizer_steps_per_round": rows // args.mini_batch,
    }


def time_stages(trainer, stage_s: dict) -> None:
    """Accumulate a round's seconds in TRL's generation (`_generate`: the sampling loop) and in the
    rest of its batch preparation (`prepare`: `_generate_and_score_completions` less generation:
    tokenising, rewards, advantages and the old log-prob pass); the optimizer steps are the rest."""

    def timed(fn, key, minus=None):
        def wrapper(*a, **kw):
            t0, before = time.perf_counter(), stage_s.get(minus, 0.0)
            try:
                return fn(*a, **kw)
            finally:
                stage_s[key] += time.perf_counter() - t0 - (stage_s.get(minus, 0.0) - before)

        return wrapper

    trainer._generate = timed(trainer._generate, "gen")
    trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, "prepare", "gen")


def main(argv=None) -> None:
    args = parse_args(argv)
    # local files only, and no usage pings (TRL's trainers send one through huggingface_hub)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    shape = batch_shape(args)
    per_round = shape.pop("optimizer_steps_per_round")
    with open(args.train) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])

    # the reward function, on_log and the stage timers fill these
    record = {"rewards": [], "final_logs": {}, "stage_s": {"gen": 0.0, "prepare": 0.0}}

    def digits_reward(prompts, completions, answer, **_):
        if len(completions) != args.prompts * args.n:
            raise RuntimeError(
                f"the reward function got {len(completions)} completions, expected one "
                f"generation round of {args.prompts} x {args.n}; TRL's batching differs"
            )
        scores = [digits_score(completion_text(c), a) for c, a in zip(completions, answer)]
        record["rewards"].append(sum(scores) / len(scores))  # once per generation round
        return scores

    out = open(args.out, "w")

    class RoundTimer(TrainerCallback):
        """Times each generation round: on_step_begin of its first optimizer step (before the
        generation, which TRL runs inside the first micro-batch's training_step) to on_step_end of
        its last. A round's line is written when TRL logs it (on_log follows on_step_end)."""

        def __init__(self):
            self.start = self.first_start = self.last_end = self.pending = None
            self.rounds = 0

        def on_step_begin(self, a, state, control, **kw):
            if state.global_step % per_round == 0:
                self.start = time.time()
                self.first_start = self.first_start or self.start

        def on_step_end(self, a, state, control, **kw):
            if state.global_step % per_round:
                return
            end, self.rounds = time.time(), self.rounds + 1
            self.last_end = end
            if len(record["rewards"]) != self.rounds:
                raise RuntimeError(
                    f"round {self.rounds}: the reward function ran {len(record['rewards'])} "
                    "times; TRL's batching is not one generation per round"
                )
            self.flush()
            self.pending = {
                "kind": "step",
                "step": self.rounds,
                "start": self.start,
                "end": end,
                "step_s": end - self.start,
                "reward_mean": record["rewards"][-1],
                **{f"{k}_s": v for k, v in record["stage_s"].items()},
            }
            record["stage_s"].update(dict.fromkeys(record["stage_s"], 0.0))  # in place: the timers hold it

        def on_log(self, a, state, control, logs=None, **kw):
            if self.pending is None:  # the Trainer's end-of-training summary
                record["final_logs"] = dict(logs or {})
            else:
                self.pending["trl"] = dict(logs or {})
                self.flush()

        def flush(self):
            if self.pending is not None:
                out.write(json.dumps(self.pending) + "\n")
                out.flush()
                self.pending = None

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    workdir = args.workdir or os.path.join(os.path.dirname(os.path.abspath(args.out)), "trl_workdir")
    config = GRPOConfig(
        output_dir=workdir,
        use_cpu=True,
        seed=args.seed,
        data_seed=args.seed,
        max_steps=args.steps * per_round,
        **shape,
        num_generations=args.n,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_completion_length=args.max_new_tokens,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.2,
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group",
        router_aux_loss_coef=0.0,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_steps=per_round,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    timer = RoundTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=digits_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    time_stages(trainer, record["stage_s"])
    trainer.train()
    timer.flush()
    end = time.time()
    summary = {
        "kind": "summary",
        "steps": timer.rounds,
        "process_start": PROCESS_START,
        "first_step_start": timer.first_start,
        "last_step_end": timer.last_end,
        "steps_s": timer.last_end - timer.first_start,
        "startup_s": timer.first_start - PROCESS_START,
        "process_s": end - PROCESS_START,
        "trl_final_logs": record["final_logs"],
        "torch_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "versions": {"torch": torch.__version__, "trl": trl.__version__, "transformers": transformers.__version__},
        "trl_config": {
            **shape,
            "generation_batch_size": config.generation_batch_size,
            "num_generations": args.n,
            "max_steps": config.max_steps,
            "loss_type": "dapo",
            "optim": str(config.optim),
            "max_completion_length": args.max_new_tokens,
        },
    }
    out.write(json.dumps(summary) + "\n")
    out.close()
    print(
        f"_trl_grpo: {timer.rounds} steps in {summary['steps_s']:.1f} s "
        f"(start-up {summary['startup_s']:.1f} s, {summary['torch_threads']} torch threads)",
        flush=True,
    )


if __name__ == "__main__":
    main()
