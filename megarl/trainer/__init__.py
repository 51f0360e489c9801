"""megarl.trainer: the RL loops and what a run needs around them.

make_trainer (factory.py) picks the loop for trainer.mode: SyncTrainer (sync_trainer.py) calls the
step's phases (phases.py) in order; OneStepOffTrainer and FullyAsyncTrainer (async_trainer.py) feed
the same train_step rows generated ahead by async_rollout.py. Around them: run set-up and tear-down
(run.py, runtime.py), checkpoints and resume (checkpoints.py, run_state.py), validation, metrics,
MFU and weight-sync parity checks.
"""
