"""clockworkd: the Clockwork node agent and the `clockwork` command line.

The source lives under ``daemon/`` but imports as ``clockworkd``: the name ``daemon`` belongs to
python-daemon.
"""

__version__ = "0.1.0"
