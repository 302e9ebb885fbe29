"""clockworkd: the Clockwork node daemon (one per node, root) and the components it hosts.

The core (``agent``, ``server``, ``daemon_auth``, ``daemon_ops``, ``daemon_sockets``, ``registry``, ...) and one
package per hosted component, each holding its host and its ops (``lens``, ``gpuhealth``, ``nodewatch``,
``borrow``, ``failover``). What the daemon shares with ranks, hooks and the CLI is ``clockwork.contracts``.
The source lives under ``daemon/`` but imports as ``clockworkd``: the name ``daemon`` belongs to python-daemon.
"""
