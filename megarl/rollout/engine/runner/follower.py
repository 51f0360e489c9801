"""A follower rank's life: run rank 0's commands on this rank's shard until told to stop."""

from __future__ import annotations

import logging

from megarl.rollout.engine.runner.channel import CommandChannel
from megarl.rollout.engine.runner.rank import RankWorker, UpdateFailed, UpdateRejected

log = logging.getLogger(__name__)


def follow(worker: RankWorker, channel: CommandChannel) -> None:
    """Returns on rank 0's shutdown command. Any other exception (a dead peer, a failed forward)
    propagates: the mesh is out of lockstep and the caller must end this process."""
    while True:
        cmd = channel.receive()
        if cmd["op"] == "shutdown":
            log.info("TP rank %d: shutdown from rank 0", worker.rank)
            return
        try:
            worker.execute(cmd)
        except (UpdateRejected, UpdateFailed) as exc:  # rank 0 got the same verdict and reports it
            log.warning("TP rank %d: weight update not applied: %s", worker.rank, exc)
