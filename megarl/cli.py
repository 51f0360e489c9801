"""The `megarl` command.

    megarl train configs/quickstart.yaml actor.optim.lr=3e-4 trainer.total_steps=50 [--debug]
    megarl train quickstart          # a shipped config by name, from any directory (megarl/configs)
    megarl sft configs/sft-quickstart.yaml sft.epochs=3 [--debug]  # supervised fine-tuning on chats
    megarl show-config configs/quickstart.yaml [overrides...]   # print the resolved config
    megarl plan configs/deepseek-v3-671b.yaml --devices 256xH100 [--json]  # memory, step time, weight sync
    megarl plan configs/deepseek-v3-671b.yaml --devices 256xH100 --search [--top 5] [--json]  # best layouts
    megarl export outputs/quickstart [--step N] [--out DIR]     # a checkpoint as a HF folder
    megarl compare-runs RUN_A RUN_B     # metrics.jsonl identical step for step (but wall clocks)?
    megarl plot RUN [RUN...] -o curves.png [--x step|samples]   # the runs' curves, overlaid

Bad configuration exits with status 2 and one line naming the key, before any process starts.
show-config needs neither the model's weights (a directory with only its config.json will do, as
configs/models/* for the scale configs) nor a GPU or SGLang; train checks both. A run that fails
ends with one line saying what failed and what to do (exit status 1); its traceback goes to
RUN_DIR/train.log, and also to the terminal with --debug. sft reads and checks every chat row
before anything starts: a bad row exits 2 with one line naming the file, the row and the field. A layout that does not fit the devices'
memory (megarl/perf/plan.py) is refused by plan and train alike: exit 2, one line naming the knob.
"""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megarl", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("train", "run RL training"),
        ("sft", "run supervised fine-tuning on chat transcripts (the sft section)"),
        ("show-config", "print the validated, resolved config as YAML"),
        ("plan", "predict memory per device and step time; refuse a layout that cannot fit"),
    ):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument(
            "config",
            nargs="?",
            help="YAML config file, or a shipped config's name (configs/quickstart.yaml, quickstart)",
        )
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.optim.lr=3e-4")
        p.add_argument("--config", dest="config_flag", help="YAML config file (alternative)")
        if name == "plan":
            p.add_argument(
                "--devices",
                help="COUNTxTYPE, e.g. 256xH100 (default: the config's pools on cluster.device_type, or on this host)",
            )
            p.add_argument(
                "--response-len",
                type=float,
                default=None,
                help="mean response tokens for the time prediction (default: rollout.max_new_tokens)",
            )
            p.add_argument("--search", action="store_true", help="search the layouts on --devices; rank by step time")
            p.add_argument("--top", type=int, default=5, help="--search: layouts to print (default 5)")
            p.add_argument("--json", action="store_true", help="print the plan (or --search's ranking) as JSON")
        if name in ("train", "sft"):
            p.add_argument(
                "--debug",
                action="store_true",
                help="print a failure's full traceback here too (it always goes to RUN_DIR/train.log)",
            )
    e = sub.add_parser(
        "export",
        help="write a run's policy checkpoint as a Hugging Face folder",
        description="write a run's policy checkpoint as a Hugging Face folder (safetensors + config + tokenizer)",
    )
    e.add_argument("run_dir", help="the run dir (trainer.output_dir/trainer.experiment_name)")
    e.add_argument("--step", type=int, help="the checkpoint of this step (default: the newest)")
    e.add_argument("--out", help="target folder (default: RUN_DIR/hf_step_NNNNNN)")
    e.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    c = sub.add_parser(
        "compare-runs",
        help="do two runs' metrics.jsonl agree step for step?",
        description="compare two runs' metrics.jsonl step for step (wall-clock keys perf/* "
        "and *_s left out); exit 0 when every other value is identical",
    )
    c.add_argument("run_a", help="a run dir or its metrics.jsonl")
    c.add_argument("run_b", help="a run dir or its metrics.jsonl")
    p = sub.add_parser(
        "plot",
        help="draw runs' curves (reward, validation, KL, entropy, length, step time, throughput)",
        description="draw one or more runs' metrics.jsonl into one image, a panel per metric, the runs "
        "overlaid; a metric no run logged gets no panel",
    )
    p.add_argument("runs", nargs="+", help="run dirs or metrics.jsonl files")
    p.add_argument("-o", "--out", required=True, help="the image to write (e.g. curves.png)")
    p.add_argument(
        "--x",
        choices=("step", "samples"),
        default="step",
        help="x axis: steps, or samples generated (from each run's config.yaml)",
    )
    return parser


def compare_runs(a: str, b: str) -> int:
    from pathlib import Path

    from megarl.trainer.metrics import compare_runs as compare

    paths = [Path(p) / "metrics.jsonl" if Path(p).is_dir() else Path(p) for p in (a, b)]
    steps, diffs = compare(*paths)
    if diffs:
        print(f"megarl: the runs differ ({len(diffs)} values):\n  " + "\n  ".join(diffs[:20]))
        return 1
    print(f"megarl: identical: {steps} steps, every metric but the wall-clock ones (perf/*, *_s)")
    return 0


def plot(runs: list[str], out: str, x: str) -> int:
    """`megarl plot`: exit 2 with one line naming the file (and line) of bad input."""
    from megarl.trainer.plot import PlotInputError, legend_names, load_run, plot_runs, save_figure

    try:
        loaded = [load_run(path, name) for path, name in zip(runs, legend_names(runs))]
        written = save_figure(plot_runs(loaded, x), out)
    except PlotInputError as err:
        print(f"megarl: plot: {err}", file=sys.stderr)
        return 2
    print(f"megarl: wrote {written} ({len(loaded)} run{'s' if len(loaded) > 1 else ''}, x = {x})")
    return 0


def _split(args) -> tuple[str | None, list[str]]:
    config, overrides = args.config_flag, list(args.overrides)
    if args.config is not None:
        if "=" in args.config:  # `megarl train key=value ...` with no file
            overrides.insert(0, args.config)
        elif config is not None:
            raise SystemExit(f"megarl: two config files given: {args.config} and --config {config}")
        else:
            config = args.config
    return config, overrides


def _preset_model_config(cfg) -> dict | None:
    """The architecture a preset will have, so parallel sizes are checked against it too."""
    if cfg.model.path is not None:
        return None  # validate reads the checkpoint's config.json
    from megarl.models import smollm2
    from megarl.models.tiny import PRESETS, preset_overrides

    if cfg.model.preset == smollm2.PRESET:
        return smollm2.SMOLLM2_135M
    from megarl.models import tiny_vlm

    if cfg.model.preset == tiny_vlm.PRESET:
        text = {"num_hidden_layers": cfg.model.num_hidden_layers} if cfg.model.num_hidden_layers else None
        return tiny_vlm.hf_config(text).to_dict()
    return {**PRESETS[cfg.model.preset], **preset_overrides(cfg.model)}


_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")


def _missing_weights(cfg) -> str | None:
    """A model dir may hold only config.json (configs/models/*: the architecture of a scale config,
    enough for show-config); training needs the checkpoint's weights."""
    from pathlib import Path

    reward_model = cfg.reward.model.path if cfg.reward.model.kind == "classifier" else None
    paths = (("model.path", cfg.model.path), ("critic.model.path", cfg.critic.model.path))
    for key, path in (*paths, ("reward.model.path", reward_model)):
        if path is None or any(next(Path(path).glob(p), None) for p in _WEIGHT_FILES):
            continue
        return (
            f"{key}={path!r} holds a config.json but no weights (*.safetensors); it is enough for "
            f"show-config, but training needs the checkpoint: download it (huggingface-cli download "
            f"ORG/MODEL --local-dir DIR) and set {key}=DIR"
        )
    return None


def _backend_unavailable(cfg) -> str | None:
    """Real SGLang needs CUDA and the sglang package on this host (checked before starting)."""
    if cfg.rollout.backend != "sglang":
        return None
    from megarl.rollout.fleet.sglang_launch import sglang_unavailable_reason

    return sglang_unavailable_reason()


def _model_config(cfg) -> dict:
    from megarl.config.validate import read_model_config
    from megarl.config.validate_vision import text_view

    return text_view(read_model_config(cfg) or _preset_model_config(cfg))


def plan(cfg, devices: str | None, response_len: float | None, json_out: bool = False) -> int:
    """`megarl plan`: print the breakdown; exit 2 with one line when the layout cannot fit."""
    from megarl.perf.hardware import parse_devices
    from megarl.perf.plan import format_plan, make_plan, plan_json, pool_sizes, refusal, run_device

    hf = _model_config(cfg)
    need = sum(pool_sizes(cfg))
    if devices:
        try:
            count, device = parse_devices(devices, cfg.cluster.devices_per_node or need)
        except ValueError as err:
            print(f"megarl: plan: {err}", file=sys.stderr)
            return 2
        if count != need:
            print(
                f"megarl: plan: --devices {devices} but the config's pools use {need} devices "
                f"(cluster.num_actor_ranks{' + cluster.num_rollout_devices' if need != cfg.cluster.num_actor_ranks else ''}); "
                f"set cluster.num_actor_ranks (and the layout) for {count} devices, or --devices {need}x...",
                file=sys.stderr,
            )
            return 2
    else:
        device, why = run_device(cfg)
        if device is None:
            print(f"megarl: plan: {why.split(': ', 1)[-1]}; or pass --devices COUNTxTYPE", file=sys.stderr)
            return 2
        if device.name == "CPU":
            from megarl.perf.hardware import cpu_device

            device = cpu_device(cfg.cluster.devices_per_node or need)
    try:
        result = make_plan(cfg, hf, device, response_len)
    except ValueError as err:  # e.g. a model type the FLOPs model does not know
        print(f"megarl: plan: {err}", file=sys.stderr)
        return 2
    if json_out:
        import json

        print(json.dumps(plan_json(cfg, result), indent=1))
    else:
        print(format_plan(cfg, result))
    reason = refusal(cfg, hf, result)
    if reason:
        print(f"megarl: plan: does not fit: {reason}", file=sys.stderr)
        return 2
    return 0


def _memory_refusal(cfg) -> str | None:
    """train's pre-start check: the planner's verdict on the run's own devices (None: fits, or
    the devices are unknown from here, which is said once on the terminal)."""
    from megarl.perf.plan import make_plan, refusal, run_device

    device, why = run_device(cfg)
    if device is None:
        print(f"megarl: {why}", file=sys.stderr)
        return None
    hf = _model_config(cfg)
    try:
        result = make_plan(cfg, hf, device, timed=False)
    except ValueError as err:
        print(f"megarl: memory check skipped: {err}", file=sys.stderr)
        return None
    reason = refusal(cfg, hf, result)
    return f"does not fit in memory: {reason} (megarl plan CONFIG prints the breakdown)" if reason else None


def export(run_dir: str, step: int | None, out: str | None, overwrite: bool) -> int:
    """`megarl export`: a run checkpoint's actor -> HF folder (checkpoint_convert's streaming
    mcore-to-hf, any layout, one process), with the config and tokenizer of the run's model."""
    from pathlib import Path

    from checkpoint_convert import ConvertError
    from checkpoint_convert.convert import mcore_to_hf
    from megarl.trainer import checkpoints

    found = checkpoints.complete_checkpoints(Path(run_dir))
    if not found:
        print(
            f"megarl: export: {run_dir} holds no complete checkpoint (runs save them with "
            "trainer.save_every > 0); the end-of-run export is RUN_DIR/hf",
            file=sys.stderr,
        )
        return 2
    chosen = dict(found).get(step) if step is not None else found[-1][1]
    if chosen is None:
        print(
            f"megarl: export: no complete checkpoint of step {step} in {run_dir}; there are steps "
            f"{[s for s, _ in found]}",
            file=sys.stderr,
        )
        return 2
    state = checkpoints.read_run_checkpoint(chosen)
    target = out or str(Path(run_dir) / f"hf_{chosen.name}")
    try:
        info = mcore_to_hf(str(chosen / "actor"), target, hf_config=state.get("model_path"), overwrite=overwrite)
    except ConvertError as err:
        print(f"megarl: export: {err}", file=sys.stderr)
        return 2
    print(f"megarl: exported {chosen} (step {state['step']}) -> {info['path']} ({info['tensors']} tensors)")
    return 0


def _report_failure(err: BaseException, run_dir, debug: bool) -> int:
    """One line on the terminal: what failed, the last checkpoint, where the traceback is."""
    import traceback

    from megarl.trainer import checkpoints
    from megarl.trainer.run import log_path_of

    log = log_path_of(run_dir)
    text = "".join(traceback.format_exception(err))
    with open(log, "a") as f:
        f.write(text)
    if debug:
        print(text, file=sys.stderr, end="")
    what = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    what = f"run failed: {type(err).__name__}: {what}" if what else f"run failed: {type(err).__name__}"
    what = getattr(err, "summary", None) or what  # a rank's death or error names the rank (WorkerError)
    last = checkpoints.latest_checkpoint(run_dir)
    resume = (
        f"last checkpoint {last}; continue from it with trainer.resume=auto"
        if last is not None
        else "no checkpoint was saved (trainer.save_every keeps progress)"
    )
    print(
        f"megarl: {what} | {resume} | traceback in {log}" + ("" if debug else " (or rerun with --debug)"),
        file=sys.stderr,
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "export":
        return export(args.run_dir, args.step, args.out, args.overwrite)
    if args.command == "compare-runs":
        return compare_runs(args.run_a, args.run_b)
    if args.command == "plot":
        return plot(args.runs, args.out, args.x)
    from megarl.config.loader import ConfigError, dump, load_config
    from megarl.config.validate import validate

    config_path, overrides = _split(args)
    if args.command == "sft":
        return sft(config_path, overrides, args.debug)
    try:
        cfg = load_config(config_path, overrides)
        cfg = validate(cfg, _preset_model_config(cfg))
    except (ConfigError, FileNotFoundError) as err:
        print(f"megarl: config error: {err}", file=sys.stderr)
        return 2
    if args.command == "show-config":
        print(dump(cfg), end="")
        return 0
    if args.command == "plan" and args.search:
        from megarl.perf.search import run_search

        code, out, err = run_search(cfg, _model_config(cfg), args.devices, args.top, args.json, args.response_len)
        print(out or "", end="\n" if out else "")
        if err:
            print(f"megarl: plan: {err}", file=sys.stderr)
        return code
    if args.command == "plan":
        return plan(cfg, args.devices, args.response_len, args.json)
    reason = _missing_weights(cfg) or _backend_unavailable(cfg) or _memory_refusal(cfg)
    if reason:
        print(f"megarl: config error: {reason}", file=sys.stderr)
        return 2
    from megarl.trainer.run import train

    return _run(lambda: train(cfg), cfg, args.debug)


def sft(config_path: str | None, overrides: list[str], debug: bool) -> int:
    """`megarl sft`: the config checked (validate_sft), every chat row read, rendered and masked
    with the model's tokenizer (exit 2 on the first bad one), then the run."""
    from megarl.config.loader import ConfigError, load_config
    from megarl.config.validate_sft import validate_sft
    from megarl.data.errors import DatasetError

    try:
        cfg = load_config(config_path, overrides)
        cfg = validate_sft(cfg, _preset_model_config(cfg))
        reason = _missing_weights(cfg)
        if reason:
            raise ConfigError("model.path", reason)
        from megarl.trainer.sft_run import prepare_sft_data, run_sft

        data = prepare_sft_data(cfg)
    except (ConfigError, FileNotFoundError) as err:
        print(f"megarl: config error: {err}", file=sys.stderr)
        return 2
    except DatasetError as err:
        print(f"megarl: data error: {err}", file=sys.stderr)
        return 2
    return _run(lambda: run_sft(cfg, data), cfg, debug)


def _run(run, cfg, debug: bool) -> int:
    """run() (train or sft): 0 when it ends (also stopped by a signal at a step boundary: it
    saved, its last line says where), 2 when it is refused before starting, 1 with one line when
    it fails, 130 on a second Ctrl-C."""
    from megarl.data.errors import DatasetError
    from megarl.trainer.checkpoints import ResumeRefused
    from megarl.trainer.run_lock import RunDirBusy
    from megarl.trainer.runtime import run_dir_of

    try:
        run()
    except DatasetError as err:
        print(f"megarl: data error: {err}", file=sys.stderr)
        return 2
    except (RunDirBusy, ResumeRefused) as err:
        print(f"megarl: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:  # a first Ctrl-C saves and stops (trainer/preemption.py); a second
        print(f"megarl: {err or 'interrupted'}; every process this run started has been stopped", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001  (any failure: one line here, the traceback in the log)
        return _report_failure(err, run_dir_of(cfg), debug)
    return 0


def entry() -> None:
    """The `megarl` command (console script and `python -m megarl.cli`): main(), then exit without
    tearing down the interpreter. Every file is closed and the run's Ray cluster is gone by then;
    the exit handlers run (logging, multiprocessing's children, temporary directories) and the
    standard streams are flushed, but the module-by-module teardown of torch, Ray, transformers
    and the rest is skipped: it took 2-3 s after a quickstart's last line (1 s for `import torch,
    ray` alone), measured. main() itself returns, for callers in the same process (tests)."""
    import atexit
    import os

    try:
        code = main()
    except SystemExit as exc:  # argparse's --help / usage errors
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`megarl ... | head`): nothing left to flush to
            pass
    os._exit(code)


if __name__ == "__main__":
    entry()
