"""Convert between Hugging Face checkpoints and megarl's Megatron distributed checkpoints.

`python -m checkpoint_convert hf-to-mcore | mcore-to-hf | inspect` (see __main__.py).

The Megatron side is exactly the format the engine's own checkpoints use (megarl/engine/megatron/
checkpoint.py: megatron-core's torch_dist, global sharded keys, the `megarl_ckpt.json` marker), so a
converted checkpoint loads with `MegatronEngine.load_checkpoint(dir, load_optimizer=False)` into any
TP / PP / EP / ETP / VPP layout, and a trainer's checkpoint converts back to Hugging Face. The
conversion builds the engine's own model (TP=1, PP=1) on the meta device and streams tensors one
parameter or one chunk at a time (convert.py): mbridge's name mapping and per-parameter format
conversion and megatron's sharded state dict are the code paths training uses, not copies of them.
"""


class ConvertError(RuntimeError):
    """An input the converter refuses; the message is one line naming the problem."""
