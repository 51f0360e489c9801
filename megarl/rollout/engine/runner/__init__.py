"""Tensor parallelism for the embedded rollout engine: one engine, several processes, in lockstep.

Sharding: transformers' own TP machinery (`from_pretrained(tp_plan="auto")` with a plan derived
from the model's `base_model_tp_plan`, sharding.py). Chosen over PyTorch DTensor
`parallelize_module` and over hand-written shards because it is the model authors' plan (no
per-architecture tables here), each rank reads only its slices from safetensors, and with the
plain-tensor styles (`local_colwise` / `local_rowwise` + one `gather` per block) it is the
fastest HF-native route on CPU (measured 2026-11: ~9 ms/token vs 19-27 for DTensor on the tiny
model; DTensor's shard metadata is not needed since `shard_spec` computes every slice).
transformers lacks two styles, which are registered with its `ParallelInterface`: a
vocab-parallel embedding and a vocab-parallel LM head gathered to rank 0.
CPU pitfalls handled: transformers needs `accelerate` for any TP load; an explicit `device_mesh`
breaks its CPU loader (safetensors is asked for device 0 = CUDA), so on CPU transformers builds
its own mesh over the default group (which spans exactly the TP ranks); the class's LM-head plan
is dropped by transformers, so the plan lists the head itself.

Processes (mesh.py): rank 0 is the HTTP server's process and owns the scheduler and sampling
(generation.py, unchanged in that respect); followers run `follow` (follower.py). Before every step
rank 0 broadcasts a command (channel.py) and then runs it itself (runners.py -> rank.py):

    forward   {cache, keep (rows kept in that KV cache, or None), drop (finished caches), ids,
               positions, mask (bit-packed), keep_all}   -> logits, full-vocab on rank 0 only
    update    {source: "payloads" (SGLang serialized_named_tensors; rank r reads entry r, a single
               entry is read by all) | "disk" (safetensors files; each rank reads its slices)
               | "distributed" (full tensors broadcast over an update group) | "reshard" (rank r
               receives the point-to-point messages listed in ranks[r]), load_format, defer,
               weight_version}   -> (receive,) check, (defer: copy into spares,) vote, write or stage
    commit {weight_version} / abort            -> swap in / write, or discard the stage (stage.py)
    init_group / destroy_group                 -> join / leave an update group (receive.py)
    release / resume                                        -> every rank frees / re-allocates
    shutdown                                                -> followers exit

A dead rank is fatal for the whole engine (watchdog.py): nothing waits on a missing peer.
"""
