"""The `sft` section: supervised fine-tuning on chat transcripts (`megarl sft`, megarl/trainer/sft.py).

An SFT run also reads: model (the checkpoint or preset to start from), actor.parallel, actor.optim
(lr, Adam, clipping, the distributed optimizer), actor.micro_batch_size,
max_tokens_per_micro_batch, pack_sequences, precision, recompute, logits_memory, offload and seed,
cluster, and the trainer keys output_dir, experiment_name, log_every, loggers (and wandb, mlflow), val_every, save_every,
max_checkpoints, resume, balance_batch, stop_grace_s, export_hf and seed. It starts no rollout
engine and reads no other section (docs/configuration.md, "Supervised fine-tuning").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class SFTConfig:
    # .parquet or .jsonl, one or a list; each row holds a list of messages {"role": system | user
    # | assistant | tool, "content": str} under messages_key. Required unless `task` is set
    train_files: str | list[str] | None = None
    val_files: str | list[str] | None = None  # the same format: val/sft/loss every trainer.val_every steps
    # a procedural chat task generated in the driver instead of train_files (megarl.data.tasks.CHAT_TASKS):
    # num_train conversations with `seed`, and num_val with seed + 1 when val_files is null
    task: Literal["arith_tool"] | None = None
    num_train: int = 1024
    num_val: int = 0
    messages_key: str = "messages"
    # tokens of one conversation after the chat template; a longer one is refused ("error") or cut
    # to max_length ("truncate": counted, and a row left without an assistant token is dropped, counted)
    max_length: int = 1024
    overlong: Literal["error", "truncate"] = "error"
    batch_size: int = 32  # conversations per optimizer step, over all data-parallel ranks
    # the run's length: `epochs` passes over the train rows (null: 1), or `total_steps` optimizer
    # steps (continuing into further epochs as needed); set at most one of them
    epochs: int | None = None
    total_steps: int | None = None
    shuffle: bool = True  # each epoch's row order drawn from (seed, epoch); false: file order
    seed: int = 0
