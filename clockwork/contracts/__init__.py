"""What ranks, Slurm hooks, the node daemon and the CLI share, torch-free and daemon-free.

Errors, the configuration, hostlists, job options and keys, the Slurm access layer, the daemon's wire and
client, the coordinator's wire and client, the snapshot format and writer. It imports no other Clockwork
package (tests/unit/test_code_rules.py), so a training rank can load it without the daemon.
"""
