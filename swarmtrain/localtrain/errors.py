"""localtrain's exceptions: user-facing failures of a run, and the conditions a channel wait can end in."""

from swarmtrain.errors import SwarmtrainError


class LocalTrainError(SwarmtrainError):
    """A local-training run cannot start or continue; the message says why and what to change."""


class StageFailed(LocalTrainError):
    """A stage process raised, died or stopped answering; the run was shut down and its segments unlinked."""


class ChannelError(RuntimeError):
    """A wait on a ring, snapshot or control block ended without its condition being met."""


class ChannelClosed(ChannelError):
    """The other side closed the channel normally (a consumer sees this once the ring is drained)."""


class PeerLost(ChannelError):
    """The process on the other side of the channel died (SIGKILL, crash) without closing it."""


class WaitTimeout(ChannelError):
    """A wait lasted longer than its deadline (localtrain.wait_timeout)."""


class Aborted(ChannelError):
    """The run was aborted (an error elsewhere, Ctrl+C, or a stop request) while this side was waiting."""
