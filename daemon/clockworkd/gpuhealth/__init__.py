"""GPU health watch: read every GPU of the node (NVML, or a fault file on the sandbox), judge the readings
against the ``[health]`` policy, and act before a failing GPU takes its rank down: warn the job, migrate the
rank live through TorchPass's coordinator, and let the health check drain the node once the job has left.
"""
