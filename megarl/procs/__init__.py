"""Process helpers shared by the runtime and the rollout fleet: free ports, the node's IP and the
loopback check (net), managed subprocesses with health probes (managed), the parent-death signal
(lifeline) and the reaper of a dead driver's processes (reaper). Nothing here imports torch."""
