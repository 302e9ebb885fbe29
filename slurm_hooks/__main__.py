"""``python -m slurm_hooks prolog|epilog|prolog_slurmctld|epilog_slurmctld`` (what Slurm runs)."""

import sys

from slurm_hooks.runner import main

sys.exit(main(sys.argv[1:]))
