"""The one error TorchPass raises to a training script: the job cannot go on on this rank, and why.

Its own module because the context, joining (:mod:`torchpass.rank.rejoin`) and transparent mode all raise it, and
the context imports the other two."""

from __future__ import annotations

__all__ = ["TorchPassError"]


class TorchPassError(RuntimeError):
    """TorchPass cannot keep this job going (the message says why); the rank exits with an error."""
