"""Typed exceptions: one class per TensorHub error code (core/result.h).

Every call of a :class:`tensorhub.Handle` that fails raises the class of its code, a subclass of
:class:`TensorHubError`, whose ``code`` is the code's name and ``detail`` says what happened.
"""

from __future__ import annotations


class TensorHubError(Exception):
    """A TensorHub call failed; ``code`` names why ("version-unavailable"), ``detail`` says more."""

    code = "unknown-error"

    def __init__(self, detail: str = ""):
        super().__init__(f"{self.code}: {detail}" if detail else self.code)
        self.detail = detail


def _error(name: str, code: str, doc: str) -> type:
    return type(name, (TensorHubError,), {"code": code, "__doc__": doc, "__module__": __name__})


InvalidArgument = _error("InvalidArgument", "invalid-argument", "The request is malformed or out of range.")
BadSelector = _error("BadSelector", "bad-selector", "A version selector is not '42', 'latest' or 'latest-k'.")
UnknownClient = _error("UnknownClient", "unknown-client", "The server does not know this client (any more).")
AlreadyOpen = _error("AlreadyOpen", "already-open", "This handle is already open.")
ShardAlreadyOpen = _error("ShardAlreadyOpen", "shard-already-open", "Another handle holds this shard of the replica.")
OpenMismatch = _error("OpenMismatch", "open-mismatch",
                      "num_shards, datacenter, spot or role differ from the replica's other shards.")
StaleIncarnation = _error("StaleIncarnation", "stale-incarnation",
                          "A newer incarnation of this replica is already open.")
SequenceGap = _error("SequenceGap", "sequence-gap", "A request skipped a sequence number (a bug).")
LimitExceeded = _error("LimitExceeded", "limit-exceeded", "A named limit of the server would be exceeded.")
VersionNotFound = _error("VersionNotFound", "version-not-found", "The version was never published here.")
VersionUnavailable = _error("VersionUnavailable", "version-unavailable",
                            "The version was published, but no copy that could serve it is left.")
StaleVersion = _error("StaleVersion", "stale-version",
                      "Publishing a version below latest that the model does not know in this life.")
NotPublished = _error("NotPublished", "not-published", "unpublish() without a published version.")
AlreadyHolding = _error("AlreadyHolding", "already-holding",
                        "publish/replicate/register while the shard already holds a version.")
LayoutMismatch = _error("LayoutMismatch", "layout-mismatch",
                        "Tensor names, dtypes or sizes differ from the model's layout.")
ChecksumConflict = _error("ChecksumConflict", "checksum-conflict",
                          "A second publisher of a version announced different checksums.")
DivergentCall = _error("DivergentCall", "divergent-call",
                       "Shards of one replica made different calls at the same position.")
ReplicaEvicted = _error("ReplicaEvicted", "replica-evicted",
                        "The replica was removed (heartbeat timeout, connection loss, restart).")
ReplicaClosed = _error("ReplicaClosed", "replica-closed", "Another shard of the replica closed it.")
BarrierTimeout = _error("BarrierTimeout", "barrier-timeout", "Not every shard re-opened after a server failover.")
Timeout = _error("Timeout", "timeout", "The call's own deadline passed.")
PermissionDenied = _error("PermissionDenied", "permission-denied",
                          "The server refused the token (or TLS refused the server).")
Unavailable = _error("Unavailable", "unavailable",
                     "No server could be reached, or the handle was interrupted or closed.")
LastRetainedCopy = _error("LastRetainedCopy", "last-retained-copy",
                          "No longer raised: close() is never refused (kept so that handlers of it still load).")
Cancelled = _error("Cancelled", "cancelled", "A shard of the replica cancelled the call (Receive.cancel()).")

_BY_CODE = {cls.code: cls for cls in [
    InvalidArgument, BadSelector, UnknownClient, AlreadyOpen, ShardAlreadyOpen, OpenMismatch, StaleIncarnation,
    SequenceGap, LimitExceeded, VersionNotFound, VersionUnavailable, StaleVersion, NotPublished, AlreadyHolding,
    LayoutMismatch, ChecksumConflict, DivergentCall, ReplicaEvicted, ReplicaClosed, BarrierTimeout, Timeout,
    PermissionDenied, Unavailable, LastRetainedCopy, Cancelled]}


def error_of(code: str, detail: str) -> TensorHubError:
    """The exception for an error code (the extension calls this)."""
    return _BY_CODE.get(code, TensorHubError)(detail)
