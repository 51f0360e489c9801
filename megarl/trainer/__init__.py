"""megarl.trainer: the RL loops and what a run needs around them.

The Trainer (loop.py) runs every step's phases (phases.py) in order on the rows of its rollout
source (sources.py), which trainer.mode picks: sync, one_step_off (a rollout thread one step
ahead) or fully_async (async_rollout.py's producer). Around them: run set-up and tear-down
(run.py, runtime.py), checkpoints and resume (checkpoints.py, run_state.py), validation, metrics,
MFU and weight-sync parity checks.
"""
