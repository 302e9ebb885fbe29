"""The one thing pyproject.toml cannot say with every setuptools >= 77: Fleet Lens's C extension.

``clockworkd.lens._probeio`` does Lens's per-packet work (build, tag and send probes; receive, verify and
parse them), which in Python cost several percent of a core per node (docs: bench/lens_overhead.py).
``pip install -e .`` (``make venv``) compiles it in place next to its Python package.
"""

from setuptools import Extension, setup

CSRC = "daemon/clockworkd/lens/csrc"

setup(
    ext_modules=[
        Extension(
            "clockworkd.lens._probeio",
            sources=[f"{CSRC}/{name}.c" for name in ("_probeio", "pacer", "probe_send", "py_args", "tag")],
            depends=[f"{CSRC}/{name}.h" for name in ("pacer", "probe_send", "py_args", "tag", "records")],
            define_macros=[("_GNU_SOURCE", None), ("_FORTIFY_SOURCE", "2")],
            libraries=["m", "sodium"],  # llrint (the pacer applies the clock seam); BLAKE2b tags (libsodium)
            extra_compile_args=["-std=gnu11", "-O2", "-fstack-protector-strong", "-Wall", "-Wextra", "-Werror"],
            extra_link_args=["-Wl,-z,relro,-z,now", "-Wl,-z,noexecstack"],
        )
    ]
)
