"""Config: schema defaults, YAML + overrides, type checks, cross-field validation messages."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from megarl.config import ConfigError, RunConfig, dump, from_dict, load_config, to_dict, validate
from megarl.models.tiny import TINY_QWEN3_MOE

torch.set_num_threads(1)

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
TINY = dict(TINY_QWEN3_MOE)  # heads 4, kv heads 2, 2 layers, 4 experts


def test_defaults_build_and_validate():
    cfg = load_config(None, [])
    assert isinstance(cfg, RunConfig)
    assert cfg.actor.optim.lr == 1e-6 and cfg.cluster.num_actor_ranks == 2
    resolved = validate(cfg, TINY)
    assert resolved.actor.parallel.sequence_parallel is False  # tp=1
    assert resolved.ref.enabled is False  # no KL loss
    assert cfg.actor.parallel.sequence_parallel is None  # validate returns a copy


def test_quickstart_yaml_is_valid():
    cfg = validate(load_config(QUICKSTART), TINY)
    assert cfg.data.task == "digits" and cfg.model.path is None
    assert cfg.cluster.num_actor_ranks == 2


def test_a_key_written_twice_in_a_config_file_is_refused(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: over 5 seeds\nrollout:\n  n: 4\nmodel:\n  preset: tiny-qwen3\n")
    with pytest.raises(ConfigError, match=r"'model' appears twice.*line 4"):
        load_config(path)
    path.write_text("rollout:\n  n: 4\n  top_k: 2\n  n: 8\n")  # nested mappings too
    with pytest.raises(ConfigError, match="'n' appears twice"):
        load_config(path)


def test_overrides_are_typed(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"actor": {"optim": {"lr": 0.1}}, "rollout": {"n": 4}}))
    cfg = load_config(
        path,
        [
            "actor.optim.lr=3e-4",
            "rollout.top_k=-1",
            "ref.enabled=true",
            "model.path=null",
            "cluster.address=auto",
            "trainer.experiment_name=2024",
            "actor.parallel.sequence_parallel=false",
            "bridge.bucket_size_mb=16",
        ],
    )
    assert cfg.actor.optim.lr == pytest.approx(3e-4)  # PyYAML reads 3e-4 as a string
    assert isinstance(cfg.actor.optim.lr, float)
    assert cfg.rollout.n == 4  # from the file
    assert cfg.ref.enabled is True and cfg.model.path is None and cfg.cluster.address == "auto"
    assert cfg.trainer.experiment_name == "2024"
    assert cfg.actor.parallel.sequence_parallel is False
    assert cfg.bridge.bucket_size_mb == 16.0 and isinstance(cfg.bridge.bucket_size_mb, float)


def test_section_overrides_merge_and_empty_sections_default(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("actor:\n  parallel: {tp: 2, ep: 1}\nref:\n")
    cfg = load_config(path, ["actor.parallel={pp: 2}"])
    assert (cfg.actor.parallel.tp, cfg.actor.parallel.ep, cfg.actor.parallel.pp) == (2, 1, 2)
    assert cfg.ref.enabled is None


def test_dump_roundtrip(tmp_path):
    cfg = load_config(QUICKSTART, ["actor.optim.lr=0.005"])
    path = tmp_path / "dumped.yaml"
    path.write_text(dump(cfg))
    assert load_config(path) == cfg
    assert from_dict(RunConfig, to_dict(cfg)) == cfg
    assert to_dict(cfg)["actor"]["parallel"]["ep"] == cfg.actor.parallel.ep


@pytest.mark.parametrize(
    "override, key, fragment",
    [
        ("actor.optim.lrr=1", "actor.optim.lrr", "did you mean actor.optim.lr"),
        ("actor.lr=1", "actor.lr", "actor.optim.lr"),
        ("bogus.x=1", "bogus", "not a config key"),
        ("rollout.n=two", "rollout.n", "is not a valid int"),
        ("rollout.n=2.5", "rollout.n", "is not a valid int"),
        ("actor.loss_agg_mode=mean", "actor.loss_agg_mode", "must be one of"),
        ("rollout.backend=vllm", "rollout.backend", "'embedded' | 'sglang'"),
        ("actor.use_kl_loss=1", "actor.use_kl_loss", "is not a valid bool"),
        ("actor.optim.lr=fast", "actor.optim.lr", "is not a valid float"),
        ("actor.parallel=3", "actor.parallel", "is a section"),
        ("actor.optim.lr.x=3", "actor.optim.lr", "is a value, not a section"),
        ("rollout.n", "rollout.n", "section.key=value"),
        ("actor.parallel.sequence_parallel=maybe", "actor.parallel.sequence_parallel", "bool | null"),
    ],
)
def test_bad_overrides_name_the_key(override, key, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    message = str(info.value)
    assert key in message and fragment in message
    assert "\n" not in message


def test_unknown_key_in_file_is_named_with_full_path(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("actor:\n  parallel:\n    tpp: 2\n")
    with pytest.raises(
        ConfigError,
        match=r"actor\.parallel\.tpp is not a config key; did you "
        r"mean actor\.parallel\.tp",
    ):
        load_config(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


BAD_CONFIGS = [
    # (overrides, expected key, fragment of the message)
    (
        ["actor.parallel.tp=3", "cluster.num_actor_ranks=6"],
        "actor.parallel.tp",
        "actor.parallel.tp=3 does not divide model.num_attention_heads=4; choose a divisor",
    ),
    (
        ["actor.parallel.tp=4", "cluster.num_actor_ranks=4"],
        "actor.parallel.tp",
        "does not divide model.num_key_value_heads=2",
    ),
    (["actor.parallel.tp=3"], "actor.parallel", "tp*pp*cp=3*1*1=3 does not divide cluster.num_actor_ranks=2"),
    (["actor.parallel.ep=4"], "actor.parallel.ep", "does not divide the ranks of one pipeline stage"),
    (["actor.parallel.ep=3", "cluster.num_actor_ranks=3"], "actor.parallel.ep", "does not divide model.num_experts=4"),
    (
        ["actor.parallel.pp=2", "cluster.num_actor_ranks=4", "actor.parallel.ep=2"],
        None,
        None,
    ),  # pp=2 divides 2 layers and ep=2 divides 4/2: valid (control case)
    (
        ["actor.parallel.pp=3", "cluster.num_actor_ranks=3", "actor.parallel.ep=1"],
        "actor.parallel.pp",
        "does not divide model.num_hidden_layers=2",
    ),
    (
        ["actor.parallel.tp=2", "actor.parallel.sequence_parallel=false"],
        "actor.parallel.sequence_parallel",
        "needs sequence parallel for MoE",
    ),
    (["actor.parallel.sequence_parallel=true"], "actor.parallel.sequence_parallel", "needs actor.parallel.tp > 1"),
    (["rollout.n=1"], "rollout.n", "must be >= 2 for grpo"),
    # advantage estimators: group baselines need n >= 2; gae needs the critic
    (["rollout.n=1", "algorithm.adv_estimator=rloo"], "rollout.n", "must be >= 2 for rloo"),
    (["rollout.n=1", "algorithm.adv_estimator=opo"], "rollout.n", "must be >= 2 for opo"),
    (
        ["rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus_baseline"],
        "rollout.n",
        "must be >= 2 for reinforce_plus_plus_baseline",
    ),
    (
        ["rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus", "actor.ppo_mini_batch_size=8"],
        None,
        None,
    ),  # no group baseline: one sample per prompt is fine (control)
    (["algorithm.adv_estimator=dr_grpo", "actor.loss_agg_mode=seq-mean-token-sum"], None, None),
    (["algorithm.adv_estimator=gae"], "critic.enabled", "gae needs the critic: set critic.enabled=true"),
    (["critic.enabled=true"], "critic.enabled", "only algorithm.adv_estimator=gae uses"),
    # remax's baseline is the greedy rollout, not the group: one sample per prompt is fine
    (["algorithm.adv_estimator=remax", "rollout.n=1", "actor.ppo_mini_batch_size=8"], None, None),
    (["algorithm.gamma=1.5"], "algorithm.gamma", "must be in [0, 1]"),
    (["algorithm.lam=-0.1"], "algorithm.lam", "must be in [0, 1]"),
    (["actor.ppo_mini_batch_size=100"], "actor.ppo_mini_batch_size", "must divide the rows per step"),
    (
        ["actor.ppo_mini_batch_size=1", "data.train_batch_size=1", "rollout.n=3"],
        "actor.ppo_mini_batch_size",
        "divisible by the data-parallel size 2",
    ),
    (["rollout.temperature=-0.5"], "rollout.temperature", "must be >= 0"),
    (["rollout.top_p=0"], "rollout.top_p", "must be in (0, 1]"),
    (["rollout.top_p=1.5"], "rollout.top_p", "must be in (0, 1]"),
    (["rollout.top_k=0"], "rollout.top_k", "-1 (off) or >= 1"),
    (["actor.optim.lr=0"], "actor.optim.lr", "must be > 0"),
    (["actor.clip_ratio_low=-0.1"], "actor.clip_ratio_low", "must be >= 0"),
    (["actor.clip_ratio_low=1.0"], "actor.clip_ratio_low", "must be < 1"),
    (["actor.optim.adam_beta2=1.0"], "actor.optim.adam_beta2", "must be in [0, 1)"),
    (["data.train_batch_size=0"], "data.train_batch_size", "must be > 0"),
    (["rollout.max_new_tokens=0"], "rollout.max_new_tokens", "must be > 0"),
    (["rollout.port=70000"], "rollout.port", "0..65535"),
    (["actor.use_kl_loss=true", "ref.enabled=false"], "ref.enabled", "needs reference log-probs"),
    (["reward.custom_function=my_module"], "reward.custom_function", "package.module:function"),
    (["data.train_files=/nonexistent/train.parquet"], "data.train_files", "does not exist"),
    (["data.train_files=train.csv"], "data.train_files", "must end in .parquet or .jsonl"),
    (["model.path=/nonexistent/ckpt"], "model.path", "no config.json"),
    (["data.max_prompt_length=300"], "data.max_prompt_length", "exceeds model.max_position_embeddings=256"),
    (["data.num_train=4"], "data.num_train", "smaller than data.train_batch_size"),
    (["cluster.num_cpus=0"], "cluster.num_cpus", "must be >= 1 or null"),
    # placement: rollout layouts that do not fit their pool, or the model
    (
        ["rollout.tp=2", "rollout.num_servers=2"],
        "rollout.num_servers",
        "2*2=4 devices do not fit the colocated pool of cluster.num_actor_ranks=2",
    ),
    (["rollout.num_servers=3"], "rollout.num_servers", "3*1=3 devices do not fit"),
    (
        ["cluster.placement=disaggregated", "rollout.tp=2", "cluster.num_rollout_devices=1"],
        "cluster.num_rollout_devices",
        "2 devices do not fit the rollout pool of cluster.num_rollout_devices=1",
    ),
    (["cluster.num_rollout_devices=2"], "cluster.num_rollout_devices", "is for cluster.placement=disaggregated"),
    (["rollout.tp=2", "rollout.nnodes=4"], "rollout.nnodes", "does not divide rollout.tp=2"),
    (
        ["cluster.placement=disaggregated", "rollout.tp=2", "cluster.devices_per_node=1"],
        "rollout.nnodes",
        "set rollout.nnodes=2",
    ),
    (["cluster.placement=disaggregated", "rollout.tp=4"], "rollout.tp", "does not divide model.num_key_value_heads=2"),
    (["rollout.ep=2"], "rollout.ep", "the embedded engine shards experts by tensor parallel"),
    (
        ["rollout.backend=sglang", "rollout.tp=2", "rollout.ep=4", "cluster.placement=disaggregated"],
        "rollout.ep",
        "must divide rollout.tp=2",
    ),
    (
        ["cluster.placement=disaggregated", "rollout.release_memory=true"],
        "rollout.release_memory",
        "is for colocated engines",
    ),
    (["rollout.tp=0"], "rollout.tp", "must be > 0"),
    (
        ["rollout.router=true", "rollout.router_policy=power_of_two"],
        "rollout.router_policy",
        "needs rollout.num_servers >= 2",
    ),
    (["reward.custom_function=/nonexistent/reward.py:score"], "reward.custom_function", "does not exist"),
    (["trainer.output_dir=' '"], "trainer.output_dir", "must not be empty"),
    # the critic: its own layout on the actor ranks, its own batch sizes and loss
    (
        ["critic.enabled=true", "algorithm.adv_estimator=gae", "critic.parallel.tp=2"],
        None,
        None,
    ),  # MoE: SP auto-enabled (control)
    (
        ["critic.enabled=true", "algorithm.adv_estimator=gae", "critic.parallel.tp=3"],
        "critic.parallel",
        "critic.parallel tp*pp*cp=3*1*1=3 does not divide cluster.num_actor_ranks=2",
    ),
    (
        [
            "critic.enabled=true",
            "algorithm.adv_estimator=gae",
            "critic.parallel.tp=2",
            "critic.parallel.sequence_parallel=false",
        ],
        "critic.parallel.sequence_parallel",
        "needs sequence parallel for MoE",
    ),
    (
        [
            "critic.enabled=true",
            "algorithm.adv_estimator=gae",
            "critic.parallel.pp=2",
            "cluster.num_actor_ranks=4",
            "critic.parallel.ep=4",
        ],
        "critic.parallel.ep",
        "does not divide the ranks of one pipeline stage",
    ),
    (
        ["critic.enabled=true", "algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=100"],
        "critic.ppo_mini_batch_size",
        "must divide the rows per step data.train_batch_size*rollout.n=256",
    ),
    (
        ["critic.enabled=true", "algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=1"],
        "critic.ppo_mini_batch_size",
        "divisible by the critic's data-parallel size 2",
    ),
    (["critic.cliprange_value=0"], "critic.cliprange_value", "must be > 0"),
    (["critic.optim.lr=-1e-5"], "critic.optim.lr", "must be > 0"),
    (["critic.optim.adam_beta1=1.0"], "critic.optim.adam_beta1", "must be in [0, 1)"),
    (["critic.parallel.tp=0"], "critic.parallel.tp", "must be > 0"),
    (["critic.micro_batch_size=0"], "critic.micro_batch_size", "must be > 0"),
    (["critic.model.path=/nonexistent/ckpt"], "critic.model.path", "no config.json"),
    (["rollout.agent_loop=nope"], "rollout.agent_loop", "'nope' is not a registered agent loop; known: ['single_turn'"),
    (
        ["rollout.agent_loop=tool", "rollout.agent.tools=[python,nope]"],
        "rollout.agent.tools",
        "unregistered tools ['nope']",
    ),
    (["cluster.device_type=TPU"], "cluster.device_type", "not a device the planner knows; use one of H100, H100 PCIe"),
    (["cluster.device_type=NVIDIA H100 80GB HBM3"], None, None),  # a CUDA device name is one
]


@pytest.mark.parametrize("overrides, key, fragment", BAD_CONFIGS)
def test_bad_configs_name_the_key(overrides, key, fragment):
    cfg = load_config(QUICKSTART, overrides)
    if key is None:
        validate(cfg, TINY)
        return
    with pytest.raises(ConfigError) as info:
        validate(cfg, TINY)
    message = str(info.value)
    assert info.value.key == key
    assert message.startswith(key) and fragment in message, message
    assert "\n" not in message


def test_adv_estimator_is_checked_on_load_and_algorithm_name_is_gone():
    with pytest.raises(ConfigError) as info:
        load_config(QUICKSTART, ["algorithm.adv_estimator=ppo"])
    assert info.value.key == "algorithm.adv_estimator" and "rloo" in str(info.value)
    # algorithm.name (GRPO only) became algorithm.adv_estimator; an old file is told so
    with pytest.raises(ConfigError) as info:
        load_config(QUICKSTART, ["algorithm.name=grpo"])
    assert info.value.key == "algorithm.name" and "algorithm.adv_estimator" in str(info.value)


def test_moe_tp2_auto_enables_sequence_parallel():
    cfg = load_config(QUICKSTART, ["actor.parallel.tp=2", "actor.parallel.ep=1", "actor.ppo_mini_batch_size=256"])
    assert validate(cfg, TINY).actor.parallel.sequence_parallel is True
    assert validate(load_config(QUICKSTART, ["actor.use_kl_loss=true"]), TINY).ref.enabled is True


def test_model_config_read_from_checkpoint_dir(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"num_attention_heads": 6, "num_key_value_heads": 6}')
    cfg = load_config(QUICKSTART, [f"model.path={ckpt}", "actor.parallel.tp=2", "actor.parallel.ep=1"])
    validate(cfg)  # 6 heads split over tp=2
    cfg = load_config(
        QUICKSTART, [f"model.path={ckpt}", "actor.parallel.tp=2", "cluster.num_actor_ranks=4", "actor.parallel.ep=1"]
    )
    validate(cfg)
    (ckpt / "config.json").write_text('{"num_attention_heads": 5}')
    with pytest.raises(ConfigError, match="model.num_attention_heads=5"):
        validate(cfg)


def test_critic_checkpoint_is_checked_against_its_own_config(tmp_path):
    ckpt = tmp_path / "critic"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({**TINY, "num_attention_heads": 6, "num_key_value_heads": 6}))
    cfg = load_config(
        QUICKSTART,
        ["critic.enabled=true", "algorithm.adv_estimator=gae", f"critic.model.path={ckpt}", "critic.parallel.tp=2"],
    )
    out = validate(cfg, TINY)  # the actor's 4 heads would also split over tp=2; 6 heads do too
    assert out.critic.parallel.sequence_parallel is True and out.actor.parallel.sequence_parallel is False
    cfg = load_config(
        QUICKSTART,
        [
            "critic.enabled=true",
            "algorithm.adv_estimator=gae",
            f"critic.model.path={ckpt}",
            "critic.parallel.tp=4",
            "cluster.num_actor_ranks=4",
            "actor.parallel.ep=4",
        ],
    )
    with pytest.raises(ConfigError, match=r"^critic\.parallel\.tp=4 does not divide model\.num_attention_heads=6"):
        validate(cfg, TINY)
    (ckpt / "config.json").write_text(json.dumps({**TINY, "vocab_size": 128}))
    cfg = load_config(QUICKSTART, ["critic.enabled=true", "algorithm.adv_estimator=gae", f"critic.model.path={ckpt}"])
    with pytest.raises(ConfigError, match="has vocab_size=128 but the actor's model has 64"):
        validate(cfg, TINY)


def test_config_built_in_code_is_type_checked():
    cfg = RunConfig()
    cfg.rollout.n = "8"  # dataclasses do not enforce annotations; validate does
    with pytest.raises(ConfigError, match=r"rollout\.n='8' is not a valid int"):
        validate(cfg, TINY)
    cfg = RunConfig()
    cfg.actor.optim.lr = 1  # an int where a float is expected is fine
    validate(cfg, TINY)


def test_rollout_layout_auto_fields(monkeypatch):
    colocated = validate(load_config(QUICKSTART, []), TINY)
    # a local cluster on this CPU-only machine: no device memory to give back
    assert colocated.rollout.router is False and colocated.rollout.release_memory is False
    joined = validate(load_config(QUICKSTART, ["cluster.address=auto"]), TINY)
    assert joined.rollout.release_memory is True  # a cluster joined by address may have GPUs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert validate(load_config(QUICKSTART, []), TINY).rollout.release_memory is True
    monkeypatch.undo()
    assert colocated.cluster.num_rollout_devices is None
    disagg = validate(load_config(QUICKSTART, ["cluster.placement=disaggregated", "rollout.num_servers=2"]), TINY)
    assert disagg.rollout.router is True and disagg.rollout.release_memory is False
    assert disagg.cluster.num_rollout_devices == 2
    multi_node = load_config(
        QUICKSTART,
        ["cluster.placement=disaggregated", "rollout.tp=2", "rollout.nnodes=2", "cluster.devices_per_node=1"],
    )
    assert validate(multi_node, TINY).rollout.nnodes == 2  # one rank per node fits nodes of one device


def test_agent_names_config_accepts_are_the_registered_ones():
    """Validation knows the agent loops and tools by name (config/agent_names.py) without importing
    the agent loop; the names must be exactly those megarl/rollout/agent/ registers."""
    from megarl.config.agent_names import AGENT_LOOP_NAMES, TOOL_NAMES
    from megarl.rollout.agent import AGENT_LOOPS, TOOLS

    assert AGENT_LOOP_NAMES == set(AGENT_LOOPS), "add the loop's name to megarl/config/agent_names.py"
    assert TOOL_NAMES == set(TOOLS), "add the tool's name to megarl/config/agent_names.py"


def test_an_agent_loop_registered_by_user_code_is_declared_to_config(monkeypatch):
    from megarl.config import agent_names

    monkeypatch.setattr(agent_names, "AGENT_LOOP_NAMES", set(agent_names.AGENT_LOOP_NAMES))
    monkeypatch.setattr(agent_names, "TOOL_NAMES", set(agent_names.TOOL_NAMES))
    cfg = load_config(QUICKSTART, ["rollout.agent_loop=mine", "rollout.agent.tools=[python,grep]"])
    with pytest.raises(ConfigError, match="rollout.agent_loop='mine' is not a registered agent loop"):
        validate(cfg, TINY)
    agent_names.declare_agent_loop("mine")
    with pytest.raises(ConfigError, match=r"unregistered tools \['grep'\]"):
        validate(cfg, TINY)
    agent_names.declare_tool("grep")
    assert validate(cfg, TINY).rollout.agent_loop == "mine"


def test_register_agent_loop_and_register_tool_declare_their_names(monkeypatch):
    """The rollout registries' decorators declare the names, so a config naming a loop or tool
    that user code registered validates (and the registries keep the test's entries to itself)."""
    from megarl.config import agent_names
    from megarl.rollout.agent import AGENT_LOOPS, TOOLS
    from megarl.rollout.agent.base import SingleTurnLoop, register_agent_loop
    from megarl.rollout.agent.tools import register_tool

    monkeypatch.setattr(agent_names, "AGENT_LOOP_NAMES", set(agent_names.AGENT_LOOP_NAMES))
    monkeypatch.setattr(agent_names, "TOOL_NAMES", set(agent_names.TOOL_NAMES))
    try:
        register_agent_loop("user_loop")(type("UserLoop", (SingleTurnLoop,), {}))
        register_tool("user_tool")(lambda **kwargs: None)
        cfg = load_config(QUICKSTART, ["rollout.agent_loop=user_loop", "rollout.agent.tools=[user_tool]"])
        assert validate(cfg, TINY).rollout.agent_loop == "user_loop"
    finally:
        AGENT_LOOPS.pop("user_loop", None), TOOLS.pop("user_tool", None)


def test_device_names_config_accepts_are_the_planners():
    """cluster.device_type's names (config/devices.py) are the planner's devices, each with its
    datasheet entry (perf/hardware.py, perf/peak.py)."""
    from megarl.config.devices import DEVICE_TYPES, canonical_device
    from megarl.perf.hardware import GPUS
    from megarl.perf.peak import PEAK_TFLOPS, gpu_table_entry

    assert set(GPUS) == set(DEVICE_TYPES)
    assert all(GPUS[key].name == entry and entry in PEAK_TFLOPS for key, entry in DEVICE_TYPES.items())
    assert canonical_device("h100-sxm") == canonical_device("NVIDIA H100 80GB HBM3") == "H100"
    assert canonical_device("NVIDIA H100 NVL") is None and gpu_table_entry("NVIDIA H100 NVL") == "H100 NVL"
    assert canonical_device(" cpu ") == "CPU" and canonical_device("TPU") is None
