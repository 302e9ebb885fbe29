/*
 * clockwork_local.c - sbatch, salloc (S_CTX_ALLOCATOR) and srun (S_CTX_LOCAL).
 */
#include <stdlib.h>
#include <string.h>

#include "clockwork_args.h"
#include "clockwork_local.h"

static const char *process_getenv(void *ctx, const char *name, char *buf, size_t buflen)
{
	(void)ctx;
	(void)buf;
	(void)buflen;
	return getenv(name);
}

int cw_local_post_opt(spank_t sp)
{
	struct cw_state *st = cw_state();
	char err[CW_ERR_MAX];
	int enabled = 0;
	int opt;

	if (!st->ready)
		return CW_SPANK_FAIL;
	if (cw_options_apply_env(&st->opts, "", CW_SRC_ENV, CW_NAME_ENV, 0, process_getenv, NULL, err, sizeof(err)) < 0 ||
	    cw_options_resolve(&st->opts, &st->cfg, &enabled, err, sizeof(err)) < 0) {
		slurm_error("%s", err);
		/*
		 * Bad user input (a CLOCKWORK_* value, or a request the admin's limits forbid) must stop
		 * the command before anything is submitted, as a bad --clockwork-* value does. Slurm
		 * ignores a failing init_post_opt() of an `optional` plugin, so exit the way sbatch,
		 * salloc and srun themselves do after a failed option check; nothing has been sent yet.
		 */
		exit(1);
	}
	if (!enabled) {
		/* Nothing asked: the job looks exactly as without the plugin. An explicit off must not be
		 * contradicted by a CLOCKWORK_FT default that the job would inherit. */
		const char *inherited = getenv(cw_opt_env(CW_FT));

		if (inherited != NULL && strcmp(inherited, "off") != 0)
			setenv(cw_opt_env(CW_FT), "off", 1);
		return 0;
	}
	for (opt = 0; opt < CW_NOPTS; opt++) {
		const char *name = cw_opt_env((enum cw_opt)opt);
		const char *value = st->opts.value[opt];
		spank_err_t rc = spank_job_control_setenv(sp, name, value, 1);

		if (rc != ESPANK_SUCCESS) {
			slurm_error("clockwork: cannot pass %s=%s to the job: %s", name, value, spank_strerror(rc));
			return CW_SPANK_FAIL;
		}
		if (setenv(name, value, 1) < 0) {
			slurm_error("clockwork: cannot set %s=%s", name, value);
			return CW_SPANK_FAIL;
		}
	}
	slurm_debug("clockwork: ft=%s spares=%s snapshot=%s linkpass=%s", st->opts.value[CW_FT],
		    st->opts.value[CW_SPARES], st->opts.value[CW_SNAPSHOT], st->opts.value[CW_LINKPASS]);
	return 0;
}
