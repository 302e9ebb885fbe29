"""Clockwork for Slurm: the parts that are not the node daemon (``clockworkd``).

``clockwork.contracts`` (torch-free code that ranks, hooks, daemon and CLI share), ``clockwork.cli`` (the
``clockwork`` command line), ``clockwork.sandbox`` (the embedded test cluster and the demo) and
``clockwork.audit`` (Fleet Audit). This marker imports nothing: importing one of them never loads another.
"""

__version__ = "0.1.0"
