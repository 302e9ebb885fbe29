"""Which RDMA device (HCA) sits behind a fabric NIC: ``ib3`` -> ``mlx5_3``, read from sysfs.

LinkPass names NICs by their netdev (``ib3``, a rail); NCCL's ``NCCL_IB_HCA`` names HCAs (``mlx5_3``). The
kernel links the two: ``/sys/class/net/<netdev>/device/infiniband/<hca>`` exists for every netdev whose PCI
function carries an RDMA device (InfiniBand, and RoCE on Ethernet). A netdev without that folder (a veth of
the sandbox, a plain Ethernet port) has no HCA and nothing for NCCL's IB transport to avoid.

The sysfs root is the seam: the daemon reads ``/sys``; a test fills a folder with the same tree, since no
machine here has an HCA.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("clockwork.linkpass")

SYSFS = Path("/sys")


class SysfsHcas:
    """Netdev -> HCA through ``<root>/class/net/<netdev>/device/infiniband/``."""

    def __init__(self, root: Path = SYSFS) -> None:
        self.root = root

    def hca_of(self, netdev: str) -> str | None:
        """The HCA behind ``netdev``, or None when it has none (or sysfs cannot be read).

        A PCI function with several RDMA devices is not something NCCL's naming can express per netdev;
        the first by name is taken and the others are logged."""
        if not netdev or "/" in netdev or netdev in (".", ".."):
            return None
        folder = self.root / "class" / "net" / netdev / "device" / "infiniband"
        try:
            names = sorted(entry.name for entry in folder.iterdir())
        except OSError:
            return None
        if len(names) > 1:
            log.warning("%s has several RDMA devices (%s): taking %s", netdev, ", ".join(names), names[0])
        return names[0] if names else None
