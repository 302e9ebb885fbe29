/*
 * clockwork_dispatch.c - the SPANK entry points: one switch on spank_context() each.
 *
 *   S_CTX_ALLOCATOR (sbatch, salloc), S_CTX_LOCAL (srun): register and validate the options,
 *       export them for the Prolog/Epilog and the job (clockwork_local.c);
 *   S_CTX_REMOTE (slurmstepd): put CLOCKWORK_* into the job's environment (clockwork_remote.c);
 *   S_CTX_SLURMD, S_CTX_JOB_SCRIPT: nothing.
 *
 * Every callback returns 0 or CW_SPANK_FAIL (-1): the one failure value every release reads as an error.
 * In slurmstepd a failure must fail the job, never drain the node (see clockwork_args.h): a remote init
 * failure is returned directly where slurm_spank_init_failure_mode exists (25.05 on), and a remote
 * post-option failure (which Slurm counts as a failed stack init on every release, with no failure mode)
 * is held back and returned by slurm_spank_task_init(), which fails the job's tasks only.
 */
#include <slurm/spank.h>

#include "clockwork_args.h"
#include "clockwork_local.h"
#include "clockwork_remote.h"

SPANK_PLUGIN(clockwork, 1)

#if CW_HAVE_INIT_FAILURE_MODE
/* A failed init of a `required` clockwork.so fails the job instead of draining the node (25.05 on). */
int slurm_spank_init_failure_mode = ESPANK_JOB_FAILURE;
#endif

/* Hold a slurmstepd failure back for slurm_spank_task_init(); the error is already logged. */
static int hold_remote_failure(void)
{
	cw_state()->failed = 1;
	return 0;
}

int slurm_spank_init(spank_t sp, int ac, char **av)
{
	switch (spank_context()) {
	case S_CTX_LOCAL:
	case S_CTX_ALLOCATOR:
		return cw_args_init(sp, ac, av) == 0 ? 0 : CW_SPANK_FAIL;
	case S_CTX_REMOTE:
		if (cw_args_init(sp, ac, av) == 0)
			return 0;
		return CW_HAVE_INIT_FAILURE_MODE ? CW_SPANK_FAIL : hold_remote_failure();
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
		return cw_local_post_opt(sp) == 0 ? 0 : CW_SPANK_FAIL;
	case S_CTX_REMOTE:
		return cw_remote_post_opt(sp) == 0 ? 0 : hold_remote_failure();
	default:
		return 0;
	}
}

int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
	(void)sp;
	(void)ac;
	(void)av;
	if (spank_context() != S_CTX_REMOTE || !cw_state()->failed)
		return 0;
	slurm_error("clockwork: the job's Clockwork settings could not be applied on this node (see the error "
		    "above); failing the job's tasks");
	return CW_SPANK_FAIL;
}
