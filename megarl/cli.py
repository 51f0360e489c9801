"""The `megarl` command.

    megarl train configs/quickstart.yaml actor.optim.lr=3e-4 trainer.total_steps=50
    megarl show-config configs/quickstart.yaml [overrides...]   # print the resolved config

Bad configuration exits with status 2 and one line naming the key, before any process starts.
show-config needs neither the model's weights (a directory with only its config.json will do, as
configs/models/* for the scale configs) nor a GPU or SGLang; train checks both.
"""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megarl", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("train", "run RL training"),
                       ("show-config", "print the validated, resolved config as YAML")):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("config", nargs="?", help="YAML config file (e.g. configs/quickstart.yaml)")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.optim.lr=3e-4")
        p.add_argument("--config", dest="config_flag", help="YAML config file (alternative)")
    return parser


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
    return {**PRESETS[cfg.model.preset], **preset_overrides(cfg.model)}


_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")


def _missing_weights(cfg) -> str | None:
    """A model dir may hold only config.json (configs/models/*: the architecture of a scale config,
    enough for show-config); training needs the checkpoint's weights."""
    from pathlib import Path

    for key, path in (("model.path", cfg.model.path), ("critic.model.path", cfg.critic.model.path)):
        if path is None or any(next(Path(path).glob(p), None) for p in _WEIGHT_FILES):
            continue
        return (f"{key}={path!r} holds a config.json but no weights (*.safetensors); it is enough for "
                f"show-config, but training needs the checkpoint: download it (huggingface-cli download "
                f"ORG/MODEL --local-dir DIR) and set {key}=DIR")
    return None


def _backend_unavailable(cfg) -> str | None:
    """Real SGLang needs CUDA and the sglang package on this machine (checked before starting)."""
    if cfg.rollout.backend != "sglang":
        return None
    from megarl.rollout.sglang_launch import sglang_unavailable_reason

    return sglang_unavailable_reason()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from megarl.config.loader import ConfigError, dump, load_config
    from megarl.config.validate import validate
    from megarl.data.dataset import DatasetError

    config_path, overrides = _split(args)
    try:
        cfg = load_config(config_path, overrides)
        cfg = validate(cfg, _preset_model_config(cfg))
    except (ConfigError, FileNotFoundError) as err:
        print(f"megarl: config error: {err}", file=sys.stderr)
        return 2
    if args.command == "show-config":
        print(dump(cfg), end="")
        return 0
    reason = _missing_weights(cfg) or _backend_unavailable(cfg)
    if reason:
        print(f"megarl: config error: {reason}", file=sys.stderr)
        return 2
    from megarl.trainer.run import train

    try:
        train(cfg)
    except DatasetError as err:
        print(f"megarl: data error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("megarl: interrupted; every process this run started has been stopped",
              file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
