"""The embedded sandbox cluster: real Slurm daemons on network namespaces with a two-rail fabric, and the demo
(``demo``). Only the CLI imports it; it starts node daemons as programs (``clockworkd``), never in-process."""
