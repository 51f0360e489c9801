"""Convert between Hugging Face checkpoints and megarl's Megatron distributed checkpoints.

`python -m checkpoint_convert hf-to-mcore | mcore-to-hf | inspect` (see __main__.py).

The Megatron side is exactly the format the engine's own checkpoints use (megarl/engine/megatron/
checkpoint.py: megatron-core's torch_dist, global sharded keys, the `megarl_ckpt.json` marker), so a
converted checkpoint loads with `MegatronEngine.load_checkpoint(dir, load_optimizer=False)` into any
TP / PP / EP / ETP / VPP layout, and a trainer's checkpoint converts back to Hugging Face. The
conversion itself runs the engine on one gloo rank (TP=1, PP=1): mbridge's name mapping and the
engine's loader and exporter are the code paths training uses, not a second copy of them.
"""


class ConvertError(RuntimeError):
    """An input the converter refuses; the message is one line naming the problem."""
