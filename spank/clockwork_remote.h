/*
 * clockwork_remote.h - slurmstepd (S_CTX_REMOTE): the job's own environment.
 */
#ifndef CLOCKWORK_REMOTE_H
#define CLOCKWORK_REMOTE_H

#include <slurm/spank.h>

/*
 * Resolve the step's options and put CLOCKWORK_FT, CLOCKWORK_SPARES, CLOCKWORK_SNAPSHOT and
 * CLOCKWORK_LINKPASS into its environment (spank_setenv). Sources, per option, best first:
 *   1. the option callback (options Slurm forwarded to this step);
 *   2. SLURM_SPANK__SLURM_SPANK_OPTION_clockwork_clockwork_<opt>: Slurm's copy of the submit
 *      options, which survives --export=NONE (the batch step never runs the callback then);
 *   3. SLURM_SPANK_CLOCKWORK_<OPT>: the values sbatch/salloc/srun resolved and exported;
 *   4. CLOCKWORK_<OPT> in the job's environment;
 *   5. the plugstack default_ft and the built-in defaults.
 */
int cw_remote_post_opt(spank_t sp);

#endif /* CLOCKWORK_REMOTE_H */
