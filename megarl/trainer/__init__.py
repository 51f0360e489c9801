"""megarl.trainer: the RL loops (sync for now), metrics, run set-up and tear-down."""
