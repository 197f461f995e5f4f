"""Weight receipt: the bookkeeping of one weight-update session on the engine's side, the same for strop
serve (:class:`strop.serving.engine_weights.WeightUpdates`) and strop's vLLM worker extension
(:mod:`strop.serving.vllm_worker`). A session is opened (begin), receives buckets in the trainer's order,
and is closed (end); its receipt is the digest of every byte received, in order
(:class:`strop.wire.digest.StreamDigest`, which the trainer computes over what it sent), the version that
came with the last bucket, and which of the expected tensors were written.

Imports: the standard library, torch and strop.wire only (the vLLM worker imports this module)."""

from __future__ import annotations

from strop.wire.digest import StreamDigest


class ReceiptSession:
    """One weight update: the digest of every byte received, the tensors written, the version sent.
    ``expected``: the names a complete update writes; ``tied``: each name that aliases an earlier one,
    with that one's name (what the receiver must redo after the load, if anything)."""

    def __init__(self, expected: set[str] | None = None, tied: dict[str, str] | None = None):
        self.digest, self.expected, self.tied, self.loaded = StreamDigest(), expected or set(), tied or {}, set()
        self.version, self.buckets, self.bytes = None, 0, 0
        self.seconds = {"receive": 0.0, "load": 0.0, "finish": 0.0}  # where the receiver's time went

    def bucket(self, names, nbytes: int, version=None) -> None:
        """Count one bucket received and loaded: the tensors it wrote, its bytes, and the version that came
        with it (the trainer sends one with the last bucket only)."""
        self.loaded |= set(names or ())
        self.buckets, self.bytes = self.buckets + 1, self.bytes + nbytes
        if version is not None:
            self.version = str(version)

    def checksum(self) -> str:
        """The digest of every byte received so far, in order."""
        return self.digest.hexdigest()

    def receipt(self, open_: bool) -> dict:
        missing = sorted(self.expected - self.loaded)
        return {
            "checksum": self.checksum(),
            "version": self.version,
            "loaded": not missing and not open_,
            "missing": missing[:5],
            "n_missing": len(missing),
            "buckets": self.buckets,
            "bytes": self.bytes,
            "open": open_,
            "seconds": dict(self.seconds),
        }


def no_receipt() -> dict:
    """The receipt before any session closed."""
    return {
        "checksum": None,
        "version": None,
        "loaded": False,
        "missing": [],
        "n_missing": 0,
        "buckets": 0,
        "bytes": 0,
        "open": False,
        "seconds": {},
    }
