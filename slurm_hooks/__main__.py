"""``python -m slurm_hooks prolog|epilog|prolog_slurmctld|epilog_slurmctld|healthcheck`` (what Slurm runs)."""

import sys

from slurm_hooks import healthcheck, runner

if sys.argv[1:2] == ["healthcheck"]:
    sys.exit(healthcheck.main())
sys.exit(runner.main(sys.argv[1:]))
