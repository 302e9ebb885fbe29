"""The embedded sandbox cluster: real Slurm daemons on network namespaces with a two-rail fabric."""
