"""The programs Slurm runs around each job: Prolog/Epilog on the nodes, PrologSlurmctld/EpilogSlurmctld.

They are fast, idempotent and never drain a node for Clockwork's own failures (see ``runner``).
"""
