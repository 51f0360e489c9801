"""Wire formats that the weight bridge writes and the rollout engine reads: the weights codec for
tensor payloads (weights_codec) and the unpickler that guards it (safe_unpickle), the update-group
records of the distributed and reshard transports (update_group), and the MoE routing records that
SGLang returns with each response (routing), and which weights produced each output token
(weight_versions). Shared by both sides so neither imports the other."""
