"""The root of swarmtrain's exception hierarchy.

A ``SwarmtrainError`` is a user-facing error: its message says what went wrong and how to fix it, and the CLI
prints it as one paragraph and exits non-zero without a traceback. Anything else that escapes is a bug.
"""


class SwarmtrainError(Exception):
    """An error caused by input or environment that the user can fix; the message names the fix."""


class ConfigError(SwarmtrainError):
    """A config file, environment variable or flag is malformed, unknown or out of range."""


class DataError(SwarmtrainError):
    """A corpus is missing, empty, not text, or too small for the model's context."""


class CheckpointError(SwarmtrainError):
    """A checkpoint cannot be used: unreadable, or written for a different model."""


class IncompatibleSwarm(SwarmtrainError):
    """The swarm this node joined trains another model shape or runs another protocol version."""
