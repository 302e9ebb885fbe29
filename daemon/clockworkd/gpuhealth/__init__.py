"""GPU health watch: read every GPU of the node (NVML, or a fault file on the sandbox), judge the readings
against the ``[health]`` policy, and act before a failing GPU takes its rank down: warn the job, migrate the
rank live through TorchPass's coordinator, and let the health check drain the node once the job has left.

``host`` starts it in the daemon and ``ops`` answers ``gpus``; its settings (the ``[health]`` section) and the
signal catalogue they are checked against are ``clockwork.contracts.config.health`` and ``health_signals``.
"""
