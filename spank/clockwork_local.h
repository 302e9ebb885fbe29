/*
 * clockwork_local.h - sbatch, salloc (S_CTX_ALLOCATOR) and srun (S_CTX_LOCAL).
 */
#ifndef CLOCKWORK_LOCAL_H
#define CLOCKWORK_LOCAL_H

#include <slurm/spank.h>

/*
 * After option processing: apply the CLOCKWORK_* environment defaults, resolve, validate, and when
 * Clockwork is on export the four values for the Prolog/Epilog (spank_job_control_setenv ->
 * SPANK_CLOCKWORK_*; Slurm also copies them into the job as SLURM_SPANK_CLOCKWORK_*) and into this
 * process's environment (what sbatch exports and what an salloc shell inherits).
 */
int cw_local_post_opt(spank_t sp);

#endif /* CLOCKWORK_LOCAL_H */
