"""The one thing pyproject.toml cannot say with every setuptools >= 77: the C extensions.

``clockworkd.lens._probeio`` does Lens's per-packet work (build, tag and send probes; receive, verify and
parse them), which in Python cost several percent of a core per node (docs: bench/lens_overhead.py).
``linkpass._hbfast`` does LinkPass's (tag and send heartbeats; receive, verify and check them; docs/linkpass.md).
``pip install -e .`` (``make venv``) compiles it in place next to its Python package.
"""

from typing import Any

from setuptools import Extension, setup

CSRC = "daemon/clockworkd/lens/csrc"
HBSRC = "linkpass/csrc"
HARDENED: dict[str, Any] = dict(
    define_macros=[("_GNU_SOURCE", None), ("_FORTIFY_SOURCE", "2")],
    extra_compile_args=["-std=gnu11", "-O2", "-fstack-protector-strong", "-Wall", "-Wextra", "-Werror"],
    extra_link_args=["-Wl,-z,relro,-z,now", "-Wl,-z,noexecstack"],
)

setup(
    ext_modules=[
        Extension(
            "clockworkd.lens._probeio",
            sources=[f"{CSRC}/{name}.c" for name in ("_probeio", "pacer", "probe_send", "py_args", "tag")],
            depends=[f"{CSRC}/{name}.h" for name in ("pacer", "probe_send", "py_args", "tag", "records")],
            libraries=["m", "sodium"],  # llrint (the pacer applies the clock seam); BLAKE2b tags (libsodium)
            **HARDENED,
        ),
        Extension(
            "linkpass._hbfast",
            # Lens's tag.c (keyed BLAKE2b, pairwise key tables) is shared, not copied: one implementation of the tags.
            sources=[f"{HBSRC}/_hbfast.c", f"{CSRC}/tag.c"],
            depends=[f"{CSRC}/tag.h"],
            include_dirs=[CSRC],
            libraries=["sodium"],
            **HARDENED,
        ),
    ]
)
