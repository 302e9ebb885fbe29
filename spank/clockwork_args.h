/*
 * clockwork_args.h - the plugin's state in one process: the admin's configuration, the options
 * as Slurm handed them over, and their registration with spank_option_register().
 */
#ifndef CLOCKWORK_ARGS_H
#define CLOCKWORK_ARGS_H

#include <slurm/spank.h>

#include "clockwork_config.h"
#include "clockwork_options.h"

/*
 * What every SPANK callback of this plugin returns on failure. Before 25.05 Slurm read only a negative
 * return as an error (a positive one passed silently); since 25.05 any non-zero one is. -1 fails on both.
 */
#define CW_SPANK_FAIL (-1)

/*
 * Since 25.05 a plugin may say how Slurm handles a failed slurm_spank_init() of a `required` plugin:
 * ESPANK_JOB_FAILURE fails the job, the default ESPANK_NODE_FAILURE drains the node. Clockwork sets
 * ESPANK_JOB_FAILURE where the headers have it (clockwork_dispatch.c). Older releases drain a node whose
 * remote init fails, so there the plugin reports a remote failure later, from slurm_spank_task_init(),
 * which fails the job's tasks and never the node.
 */
#if SLURM_VERSION_NUMBER >= SLURM_VERSION_NUM(25, 5, 0)
#define CW_HAVE_INIT_FAILURE_MODE 1
#else
#define CW_HAVE_INIT_FAILURE_MODE 0
#endif

struct cw_state {
	struct cw_config cfg;
	struct cw_options opts;
	int ready;		/* the plugstack arguments parsed and the options registered */
	int failed;		/* a remote-context failure held back for slurm_spank_task_init() */
};

struct cw_state *cw_state(void);

/*
 * Parse the plugstack arguments and register the --clockwork-* options (the only way they show in
 * sbatch/salloc --help). Returns 0, or CW_SPANK_FAIL after printing the error with slurm_error().
 */
int cw_args_init(spank_t sp, int ac, char **av);

#endif /* CLOCKWORK_ARGS_H */
