"""The guard for learning itself: the quickstart's first steps, run now, must reproduce the checked-in
reference curve (benchmarks/reference_curves/quickstart.jsonl) step for step. A change that moves
the curve updates the reference in the same commit (scripts/compare_curve.py --update) and says why."""

from __future__ import annotations

import io
from pathlib import Path

from megarl.config.loader import load_config
from megarl.config.validate import validate
from tests.trainer.test_durability import assert_export_matches_checkpoint

ROOT = Path(__file__).resolve().parents[2]
STEPS = 30  # reward is still rising here: sampling, advantages, the update and the sync all show


def test_quickstart_reproduces_the_reference_curve(tmp_path, capsys):
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    import compare_curve

    from megarl.trainer.run import train

    # validation off: it draws from the server's sampler, and the reference validates at step 50 only
    cfg = validate(
        load_config(
            ROOT / "configs/quickstart.yaml",
            [
                f"trainer.output_dir={tmp_path}",
                f"trainer.total_steps={STEPS}",
                "trainer.val_every=0",
                "trainer.loggers=[console,jsonl]",
                f"trainer.save_every={STEPS}",
            ],
        )
    )
    train(cfg, stream=io.StringIO())
    code = compare_curve.main([str(tmp_path / "quickstart" / "metrics.jsonl")])
    report = capsys.readouterr().out
    assert code == 0, report
    assert f"{STEPS} steps (1..{STEPS})" in report
    # the quickstart leaves its trained policy as a Hugging Face folder that transformers loads,
    # with the trainer's log-probs (the final checkpoint's, on a Megatron engine of one rank)
    run_dir = tmp_path / "quickstart"
    assert_export_matches_checkpoint(run_dir / "hf", run_dir / "checkpoints" / f"step_{STEPS:06d}")
