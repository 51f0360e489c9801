"""benchmarks/published_runs.yaml as planner inputs: each published run turned into a megarl config,
the metrics it measured, how the planner prices each, and the fit / held-out split.

A run becomes one of the scale configs (configs/<model>.yaml) with overrides from its layout and
workload. What the yaml leaves open is filled by stated rules, the same for every run:

- lengths: a mean prompt or response the source does not publish is planned at half its cap;
  NeMo-RL caps prompt + response together (max_seq_len): its prompts are capped at 512 for memory,
  and the time model lets the longest response run to max_seq_len less the mean prompt (the
  generation's tail: a response stops at the shared cap, not at max_seq_len - 512);
  a pre-training step (train_step) is a batch of seq_len-token rows, planned as prompt + response
  halves with the response at its cap, one row per micro-batch, one optimizer step;
- the rollout engine (vLLM in verl and NeMo-RL) is planned as SGLang at the same memory fraction;
  the yaml's rollout dp (engines) is rollout.num_servers, its tp an engine's devices;
- recompute: selective recompute of modules holding at least half of the forward's matmul FLOPs
  (recomputed_share: `moe` in a MoE model, `mlp` in a dense one) is priced as full, of the rest
  (DeepSeek-V3's `mlp`: its three dense layers; up-projections, norms, activations) as megarl's
  selective;
- precision: every run is planned in bf16 (memory, communication); a run whose `precision.train`
  is FP8 (fp8-blockwise, fp8-current-scaling, mxfp8) has its linear layers' GEMMs priced at the
  device's FP8 dense peak times Efficiency.gemm_fp8 (attention's core at the bf16 rate, as
  Transformer Engine's FP8 recipes run it): a precision megarl does not train in, so it is a trait
  of the run's Efficiency (fp8_gemms), never a megarl config option;
- expert dispatch: node-level (a token crosses the network once per destination node, fans out
  over NVLink there; Efficiency.node_dispatch) where the run's notes or table name DeepEP /
  HybridEP, and for Megatron-Bridge's performance recipes (their DeepSeek-V3 and Qwen3 MoE
  workload configs set the flex dispatcher with the HybridEP backend); per routed copy (Megatron's
  default alltoall dispatcher) where the notes name the plain all-to-all dispatcher and for the
  RL frameworks, whose recipes keep Megatron's default;
- CPU Adam (verl, slime: optimizer_offload_fraction 1.0): actor.offload.host_optimizer = 1.0;
- weight sync, priced as the source moved the weights (megarl/perf/sync_model.py prices each
  transport): verl's `sync_s` is one NCCL broadcast per tensor (its notes), priced as
  `distributed` with every tensor its own request; its `sync_s_checkpoint_engine` is bucketed,
  priced as megarl's bucketed `distributed`; NeMo-RL's refit streams each training rank's own
  shards to the co-located inference ranks (no gather at a root; ~2.4 s for DeepSeek-V3 on 256
  H100), priced as megarl's `reshard`; everything else with the config's transport;
- framework traits the planner cannot read from a megarl config, applied to the run's Efficiency:
  data-parallel gradient / parameter traffic overlapped with compute (Megatron's
  overlap_grad_reduce / overlap_param_gather: NeMo-RL, Megatron-Bridge and the Megatron-Core
  model zoo set them; verl's default DDP config and slime do not, megarl's engine does not);
  expert all-to-all overlapped where the notes say so; expert load forced balanced where the
  notes say so (routing_cv = 0).

Split (chosen before any held-out error was seen): within each kind (rl_step, train_step,
weight_sync), runs alternate fit, holdout, fit, ... in file order; an entry whose notes say to use
it as a check and not to fit it is held out and skipped by the alternation (slime's inferred sync,
and the rows entered after the constants were fitted, priced once with them frozen). Appending runs
never moves an earlier run between the halves.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RUNS_FILE = ROOT / "benchmarks" / "published_runs.yaml"

MODEL_DIRS = {
    "deepseek-ai/DeepSeek-V3": "deepseek-v3",
    "Qwen/Qwen3-235B-A22B": "qwen3-235b-a22b",
    "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b",
}
BASE_CONFIGS = {
    "deepseek-ai/DeepSeek-V3": "deepseek-v3-671b",
    "Qwen/Qwen3-235B-A22B": "qwen3-235b-a22b",
    "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b",
}
# frameworks whose Megatron DDP overlaps gradient reduce-scatter / parameter all-gather with compute
OVERLAPS_DP = {"nemo-rl", "megatron-bridge", "megatron-core"}
NEMO_PROMPT_CAP = 512
# frameworks whose published MoE recipes dispatch per destination node (flex dispatcher, HybridEP)
NODE_DISPATCH = {"megatron-bridge"}
# measured numbers that are not a time of the planner's model, and why
NOT_PRICED = {
    "sync_s_before_optimization": "slime's sync before its CUDA-IPC rework: not the transport priced",
}
# weight-sync metrics timed per tensor (one request or broadcast each), by their runs' notes
SYNC_PER_TENSOR = {"sync_s": {"verl-qwen3-30b-a3b-sync-16to16xH20", "verl-qwen3-235b-a22b-sync-64to64xH20"}}
# frameworks whose refit is priced by another transport than the config's, in an RL step
REFIT_AS = {"nemo-rl": "reshard"}
# measured numbers compared but not fitted nor counted in the error: the time model's calibration
CHECK_ONLY = {
    "gpu_memory_gb": "memory, not time: shown as a check of the memory model",
    "cpu_memory_gb": "host memory per node (plan.host), not time: a check of the host-memory model",
}


@dataclass
class Priced:
    """A run planned: its config, device, lengths and the traits applied to its Efficiency."""

    run: dict
    cfg: object
    hf: dict
    count: int
    device: object
    mean_prompt: float
    mean_response: float
    host_optimizer: float = 0.0
    overlap_dp: bool = False
    overlap_a2a: bool = False
    forced_balance: bool = False
    fp8: bool = False
    node_dispatch: bool = False
    assumptions: list[str] = field(default_factory=list)
    train_mem: object = None  # filled by calibration.prepare: memory does not depend on the constants
    rollout_mem: object = None
    timing: object = None  # what the time model reads: the prompt cap at the mean prompt (as make_plan's
    # mean_prompt), the run's own vpp, its host optimizer


def load_runs() -> list[dict]:
    return yaml.safe_load(RUNS_FILE.read_text())["runs"]


def _notes(run: dict) -> str:
    """The run's notes as one lower-case line (the yaml folds them over several)."""
    return " ".join(run.get("notes", "").split()).lower()


def check_only(run: dict) -> bool:
    notes = _notes(run)
    return "as a check" in notes and "not to fit" in notes


def entered_after_fit(run: dict) -> bool:
    """A check entered after the constants were fitted and priced once with them frozen (its notes
    say "entered after the fit"); a check, so held out and never fitted."""
    return "entered after the fit" in _notes(run)


def split(runs: list[dict]) -> dict[str, str]:
    """id -> 'fit' | 'holdout' (the rule in the module docstring)."""
    out, seen = {}, {}
    for run in runs:
        if check_only(run):
            out[run["id"]] = "holdout"
            continue
        i = seen.get(run["kind"], 0)
        seen[run["kind"]] = i + 1
        out[run["id"]] = "fit" if i % 2 == 0 else "holdout"
    return out


def forced_balance(run: dict) -> bool:
    """The source forced the expert load balanced (Megatron's moe_router_force_load_balancing)."""
    notes = _notes(run)
    return "forced expert balance" in notes or "forced balanced" in notes


def overlaps_a2a(run: dict) -> bool:
    """The source overlaps the expert all-to-all with compute (Megatron's
    overlap_moe_expert_parallel_comm with delay_wgrad_compute): its notes say "all-to-all
    overlapped with compute", as read from its recipe. The model zoo's EP32 row is the one
    without its 1F1B overlap."""
    return "all-to-all overlapped with compute" in _notes(run)


def fp8_gemms(run: dict) -> bool:
    """The run's GEMMs ran in FP8 (its precision.train: fp8-blockwise, fp8-current-scaling, mxfp8)."""
    return "fp8" in str(run.get("precision", {}).get("train", "")).lower()


def node_dispatch(run: dict) -> bool:
    """The run's expert dispatch sends a token once per destination node (the rule in the module
    docstring): its notes or table say so, else its framework's recipes decide."""
    text = " ".join([run.get("notes", ""), str(run.get("source", {}).get("table", ""))]).lower()
    if "deepep" in text or "hybridep" in text:
        return True
    if "a2a dispatcher" in text or "all-to-all dispatcher" in text:
        return False
    return run["framework"] in NODE_DISPATCH


def _hf(run: dict) -> dict:
    return json.loads((ROOT / "configs" / "models" / MODEL_DIRS[run["model"]] / "config.json").read_text())


def recomputed_share(hf: dict, modules: list[str]) -> float:
    """The share of a token's forward matmul FLOPs that Megatron's selective recompute of `modules`
    runs again: `mlp` is the dense MLP of the layers that are not MoE (DeepSeek-V3's first three),
    `moe` a MoE layer's shared and routed experts (k of them); the rest (mla_up_proj, layernorm,
    moe_act, core_attn) are up-projections, norms and activations, a few percent at most."""
    from megarl.perf.flops import layer_params

    k = hf.get("num_experts_per_tok") or 0
    total = part = 0.0
    for i in range(hf["num_hidden_layers"]):
        lp = layer_params(hf, i)
        total += lp.attn + lp.mlp + k * lp.expert * bool(lp.experts)
        if "mlp" in modules and not lp.experts:
            part += lp.mlp
        if "moe" in modules and lp.experts:
            part += lp.mlp + k * lp.expert
    return part / total if total else 0.0


def _recompute(value: str, hf: dict) -> str:
    """megarl's granularity for a published recompute setting: selective recompute of modules that
    hold most of the forward's FLOPs (recomputed_share >= 1/2) is priced as full, of the rest as
    megarl's selective (core attention: a few percent more compute)."""
    if value in ("none", "full"):
        return value
    modules = [m.strip() for m in value.split(":", 1)[1].split(",")] if ":" in value else []
    return "full" if recomputed_share(hf, modules) >= 0.5 else "selective"


def _layout_overrides(run: dict) -> list[str]:
    lay, hw = run["layout"], run["hardware"]
    out = [f"actor.parallel.{k}={lay[k]}" for k in ("tp", "pp", "ep", "etp", "cp")]
    out += [
        f"actor.parallel.vpp={lay.get('vpp') or 1}",
        f"actor.parallel.first_stage_layers={lay.get('first_stage_layers') or 'null'}",
        f"actor.parallel.last_stage_layers={lay.get('last_stage_layers') or 'null'}",
        f"actor.parallel.sequence_parallel={str(lay.get('sequence_parallel', 'null')).lower()}",
        f"actor.recompute={_recompute(lay['recompute'], _hf(run))}",
        f"cluster.devices_per_node={hw['gpus_per_node']}",
        "actor.precision=bf16",
    ]
    off = lay["offload"].lower()
    host = "cpu adam" in off
    # offloaded around generation: the engine's memory fraction needs the device, so the weights
    # and gradients leave with the optimizer state (megarl's colocated configs, NeMo-RL's refit)
    around = "around generation" in off
    params = host or around or "weights offloaded" in off
    grads = host or around
    optimizer = "optimizer offloaded" in off and not host
    out += [f"actor.offload.params={params}", f"actor.offload.grads={grads}", f"actor.offload.optimizer={optimizer}"]
    return [o.replace("=True", "=true").replace("=False", "=false") for o in out]


def _rollout_overrides(run: dict) -> list[str]:
    r, hw = run["layout"]["rollout"], run["hardware"]
    out = [
        "rollout.backend=sglang",
        f"rollout.tp={r['tp']}",
        f"rollout.num_servers={r['dp']}",
        "rollout.dp=1",
        f"rollout.ep={r.get('ep', 1)}",
        f"rollout.nnodes={max(1, r['tp'] // hw['gpus_per_node'])}",
    ]
    if r.get("mem_fraction"):
        out.append(f"rollout.mem_fraction_static={r['mem_fraction']}")
    return out


def _rl_workload(run: dict) -> tuple[list[str], float, float, list[str]]:
    w, assumed = run["workload"], []
    if "max_seq_len" in w:  # NeMo-RL: prompt + response capped together
        prompt_cap, response_cap = NEMO_PROMPT_CAP, w["max_seq_len"] - NEMO_PROMPT_CAP
        budget = w["max_seq_len"] * w.get("micro_batch", 1)
    else:
        prompt_cap, response_cap = w["max_prompt_tokens"], w["max_response_tokens"]
        budget = w.get("max_tokens_per_micro_batch") or prompt_cap + response_cap
    mean_prompt = w.get("mean_prompt_tokens")
    if mean_prompt is None:
        mean_prompt = prompt_cap / 2
        assumed.append(f"mean prompt {mean_prompt:.0f} (half the cap)")
    mean_response = w.get("mean_response_tokens")
    if mean_response is None:
        mean_response = response_cap / 2
        assumed.append(f"mean response {mean_response:.0f} (half the cap)")
    out = [
        f"data.train_batch_size={w['prompts_per_step']}",
        f"rollout.n={w['samples_per_prompt']}",
        f"actor.ppo_mini_batch_size={w['mini_batch_rollouts']}",
        f"data.max_prompt_length={prompt_cap}",
        f"rollout.max_new_tokens={response_cap}",
        f"actor.max_tokens_per_micro_batch={budget}",
        f"actor.use_kl_loss={str(bool(w.get('kl_loss'))).lower()}",
        f"data.num_train={max(65536, w['rollouts_per_step'])}",
    ]
    return out, mean_prompt, mean_response, assumed


def _train_step_workload(run: dict) -> tuple[list[str], float, float]:
    w = run["workload"]
    half = w["seq_len"] // 2
    out = [
        f"data.train_batch_size={w['global_batch'] // 2}",  # rows = prompts x n; GRPO needs n >= 2
        "rollout.n=2",
        f"actor.ppo_mini_batch_size={w['global_batch']}",
        f"data.max_prompt_length={half}",
        f"rollout.max_new_tokens={w['seq_len'] - half}",
        f"actor.max_tokens_per_micro_batch={w['seq_len'] * w.get('micro_batch', 1)}",
        "actor.use_kl_loss=false",
        f"data.num_train={max(65536, w['global_batch'])}",
    ]
    return out, half, w["seq_len"] - half


def overrides(run: dict) -> tuple[list[str], float, float, list[str]]:
    """(overrides of the base config, mean prompt, mean response, assumptions stated)."""
    lay, hw, kind = run["layout"], run["hardware"], run["kind"]
    train_gpus = hw["count"] if lay["colocated"] or lay["rollout"] is None else hw["count"] - lay["rollout"]["gpus"]
    out = [f"cluster.num_actor_ranks={train_gpus}", *_layout_overrides(run)]
    if host_optimizer_fraction(run):
        out.append(f"actor.offload.host_optimizer={host_optimizer_fraction(run)}")
    assumed: list[str] = []
    if kind == "train_step":
        work, prompt, response = _train_step_workload(run)
        # the engines are not timed: one per node's devices, released while training
        out += [*work, "cluster.placement=colocated", "rollout.tp=8", f"rollout.num_servers={train_gpus // 8}"]
        out += ["rollout.nnodes=1", "rollout.dp=1", "rollout.ep=1"]
        return out, prompt, response, assumed
    out += _rollout_overrides(run)
    if kind == "rl_step":
        work, prompt, response, assumed = _rl_workload(run)
        return out + work, prompt, response, assumed
    if lay["colocated"]:  # weight_sync: the lengths do not enter the sync
        out += ["bridge.transport=tensor"]
    else:
        out += [
            "cluster.placement=disaggregated",
            f"cluster.num_rollout_devices={lay['rollout']['gpus']}",
            "bridge.transport=distributed",
            "rollout.release_memory=null",
        ]
    return out, 1024, 1024, assumed


def host_optimizer_fraction(run: dict) -> float:
    return 1.0 if "cpu adam" in run["layout"]["offload"].lower() else 0.0


def _validated(base: str, ovr: list[str], run: dict, assumed: list[str]):
    """(validated config, the run's own vpp when the config had to drop it). A pipeline split
    megarl refuses (a depth that pp * vpp does not divide, split by a Megatron layout the source
    does not give) is priced on the most balanced per-rank split megarl accepts at vpp 1, with the
    run's vpp set back for the time terms (bubble, stage-to-stage traffic)."""
    from megarl.config.loader import ConfigError, load_config
    from megarl.config.validate import validate
    from megarl.perf.search_space import stage_splits

    path = str(ROOT / "configs" / f"{base}.yaml")
    try:
        return validate(load_config(path, ovr)), None
    except ConfigError as e:
        lay = run["layout"]
        if (
            not str(e.key).startswith("actor.parallel.")
            or lay.get("first_stage_layers")
            or lay.get("last_stage_layers")
        ):
            raise
        hf = _hf(run)
        splits = stage_splits(hf["num_hidden_layers"], lay["pp"], 1)
        if not splits:
            raise
        first, last = splits[0]
        vpp = lay.get("vpp") or 1
        assumed.append(
            f"pipeline split not published ({hf['num_hidden_layers']} layers over pp {lay['pp']} x vpp {vpp}): "
            f"the most balanced per-rank split, first {first or '-'} / last {last or '-'} layers"
        )
        fixed = [
            o for o in ovr if not o.startswith(("actor.parallel.vpp=", "actor.parallel.first_", "actor.parallel.last_"))
        ]
        fixed += ["actor.parallel.vpp=1", f"actor.parallel.first_stage_layers={first or 'null'}"]
        fixed += [f"actor.parallel.last_stage_layers={last or 'null'}"]
        return validate(load_config(path, fixed)), vpp


def price(run: dict) -> Priced:
    """The run as a validated megarl config; ConfigError when megarl's validation refuses it."""
    from megarl.perf.hardware import parse_devices

    base = BASE_CONFIGS[run["model"]]
    ovr, prompt, response, assumed = overrides(run)
    cfg, vpp = _validated(base, ovr, run, assumed)
    hf = json.loads((ROOT / cfg.model.path / "config.json").read_text())
    hw = run["hardware"]
    count, device = parse_devices(f"{hw['count']}x{hw['gpu']}")
    host = host_optimizer_fraction(run)
    timing = copy.deepcopy(cfg)
    timing.data.max_prompt_length = int(round(prompt))
    if "max_seq_len" in run["workload"]:  # a response may run to the shared cap less its own prompt
        timing.rollout.max_new_tokens = run["workload"]["max_seq_len"] - int(round(prompt))
    if vpp:
        timing.actor.parallel.vpp = vpp
    return Priced(
        run,
        cfg,
        hf,
        count,
        device,
        prompt,
        response,
        host_optimizer=host,
        overlap_dp=run["framework"] in OVERLAPS_DP,
        overlap_a2a=overlaps_a2a(run),
        forced_balance=forced_balance(run),
        fp8=fp8_gemms(run),
        node_dispatch=node_dispatch(run),
        assumptions=assumed,
        timing=timing,
    )


def efficiency_for(p: Priced, eff, a2a_overlap: float):
    """The run's Efficiency: the constants (eff.dp_overlap: what an overlapping engine hides) with
    its framework's traits applied."""
    return replace(
        eff,
        dp_overlap=eff.dp_overlap if p.overlap_dp else 0.0,
        a2a_overlap=a2a_overlap if p.overlap_a2a else 0.0,
        routing_cv=0.0 if p.forced_balance else eff.routing_cv,
        fp8_gemms=p.fp8,
        node_dispatch=p.node_dispatch,
    )


def is_finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
