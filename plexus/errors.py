"""The exceptions plexus raises, and what a caller should do about each.

Recovery, by type:

- ``ConfigError``: the user asked for something impossible. Nothing ran; fix the
  configuration. The CLI prints the message on one line and exits with status 2.
- ``CommTimeout``: a peer did not answer within the timeout. The message names the peer
  and the operation. The link may be unusable; treat the peer as lost or retry the job.
- ``PeerLost``: a peer's link broke (it died or closed). Strategies that tolerate faults
  remove the peer from the live set; the others end the job.
- ``ProtocolError``: a peer sent something that does not fit the protocol (wrong length,
  dtype or operation). Only the link it arrived on is affected.
- ``JobFailed``: a process of the job exited abnormally; carries its exit status.
- ``JobInterrupted``: the user stopped the job (Ctrl-C, SIGTERM); its summary.json is
  marked ``interrupted`` with what was measured so far. Status 128 + the signal.
"""
from __future__ import annotations

__all__ = [
    "PlexusError",
    "ConfigError",
    "CommError",
    "CommTimeout",
    "PeerLost",
    "ProtocolError",
    "JobFailed",
    "JobInterrupted",
]


class PlexusError(Exception):
    """Base class of every error plexus raises on purpose."""

    exit_code = 1


class ConfigError(PlexusError, ValueError):
    """A usage or configuration error: nothing ran; the message says the rule and the fix."""

    exit_code = 2


class CommError(PlexusError):
    """A communication failure with a named peer."""

    def __init__(self, message: str, peer: str | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class CommTimeout(CommError):
    """A blocking operation waited longer than its timeout for ``peer``."""


class PeerLost(CommError):
    """The link to ``peer`` is broken: the peer died or closed it."""


class ProtocolError(CommError):
    """A message or collective argument did not match what the protocol expects."""


class JobFailed(PlexusError):
    """A process of the job failed; ``exit_code`` is the first failure's exit status."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class JobInterrupted(JobFailed):
    """The job was stopped by signal ``signum`` (SIGINT, SIGTERM) before it finished;
    ``exit_code`` is 128 + ``signum``, as a shell reports it."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message, exit_code=128 + signum)
        self.signum = signum
