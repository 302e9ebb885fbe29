"""The shared-memory arena a rank stages its snapshot in, and its writer process reads from.

Why shared memory: the rank copies its state once (host memory speed, or a GPU copy) and the writer process
reads the same pages, so the disk write never takes the rank's GIL or a second copy.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import tempfile

import torch

__all__ = ["ALIGN", "SharedArena"]

#: Alignment of every entry in the arena: the writer sends whole aligned pages to the disk with O_DIRECT.
ALIGN = 4096
LOG = logging.getLogger("clockwork.torchpass.snapshot")


class SharedArena:
    """A shared-memory file mapped here (as a uint8 tensor) and by the writer; page-locked when CUDA is used.

    The file is unlinked as soon as it exists: the writer opens it through this process's descriptor
    (``/proc/PID/fd/N``), so a job killed with SIGKILL leaves nothing behind in /dev/shm."""

    def __init__(self, size: int, cuda: bool) -> None:
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        st = os.statvfs(folder)
        if size > st.f_bavail * st.f_frsize:  # tmpfs allocates on write: past its end a copy dies of SIGBUS
            raise OSError(errno.ENOSPC, f"{folder} has {st.f_bavail * st.f_frsize} bytes free, the arena needs {size}")
        fd, name = tempfile.mkstemp(prefix=f"torchpass-snapshot-{os.getpid()}-", dir=folder)
        os.unlink(name)
        self.fd = fd
        self.path = f"/proc/{os.getpid()}/fd/{fd}"
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.size = size
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)
        self.registered = False
        self.cuda = cuda  # registration was attempted (if it failed, GPU copies into it are synchronous)
        if cuda:
            rc = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), size, 0)
            self.registered = int(rc) == 0
            if not self.registered:
                LOG.warning("cudaHostRegister of the %d-byte arena failed (%s): GPU copies will block", size, rc)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """The arena's bytes [offset, offset + nbytes) as a uint8 tensor."""
        return self.tensor[offset : offset + nbytes]

    def close(self) -> None:
        """Unregister, unmap and close; the memory goes once the writer has unmapped it too."""
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
        del self.tensor
        try:
            self.map.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process
        os.close(self.fd)
