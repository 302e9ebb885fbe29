"""Fleet Audit: is a cluster sound before it is handed over? (`clockwork audit`)

One worker per node (started through Slurm, so it runs inside the node as jobs do) measures what only
that node can see and answers the driver's requests over an authenticated socket; the driver schedules
the measurements that involve two nodes, and :mod:`clockwork.audit.verdict` turns the raw figures into
pass/fail per node and per link, naming the port and the evidence.
"""
