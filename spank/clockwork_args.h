/*
 * clockwork_args.h - the plugin's state in one process: the admin's configuration, the options
 * as Slurm handed them over, and their registration with spank_option_register().
 */
#ifndef CLOCKWORK_ARGS_H
#define CLOCKWORK_ARGS_H

#include <slurm/spank.h>

#include "clockwork_config.h"
#include "clockwork_options.h"

struct cw_state {
	struct cw_config cfg;
	struct cw_options opts;
	int ready;		/* the plugstack arguments parsed and the options registered */
};

struct cw_state *cw_state(void);

/*
 * Parse the plugstack arguments and register the --clockwork-* options (the only way they show in
 * sbatch/salloc --help). Returns 0, or -1 after printing the error with slurm_error().
 */
int cw_args_init(spank_t sp, int ac, char **av);

#endif /* CLOCKWORK_ARGS_H */
