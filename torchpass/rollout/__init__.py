"""Weight push to RL rollout workers (``torchpass.rollout.Publisher`` / ``Subscriber``); imports torch.

:mod:`torchpass.rollout.push` holds both ends and explains how a worker always holds one complete version.
"""

from __future__ import annotations

from torchpass.rollout.push import Publisher, Subscriber

__all__ = ["Publisher", "Subscriber"]
