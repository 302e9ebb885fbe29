/*
 * clockwork_dispatch.c - the SPANK entry points: one switch on spank_context() each.
 *
 *   S_CTX_ALLOCATOR (sbatch, salloc), S_CTX_LOCAL (srun): register and validate the options,
 *       export them for the Prolog/Epilog and the job (clockwork_local.c);
 *   S_CTX_REMOTE (slurmstepd): put CLOCKWORK_* into the job's environment (clockwork_remote.c);
 *   S_CTX_SLURMD, S_CTX_JOB_SCRIPT: nothing.
 */
#include <slurm/spank.h>

#include "clockwork_args.h"
#include "clockwork_local.h"
#include "clockwork_remote.h"

SPANK_PLUGIN(clockwork, 1)

int slurm_spank_init(spank_t sp, int ac, char **av)
{
	switch (spank_context()) {
	case S_CTX_LOCAL:
	case S_CTX_ALLOCATOR:
	case S_CTX_REMOTE:
		return cw_args_init(sp, ac, av);
	default:
		return 0;
	}
}

int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	switch (spank_context()) {
	case S_CTX_LOCAL:
	case S_CTX_ALLOCATOR:
		return cw_local_post_opt(sp);
	case S_CTX_REMOTE:
		return cw_remote_post_opt(sp);
	default:
		return 0;
	}
}
