/*
 * clockwork_remote.c - slurmstepd (S_CTX_REMOTE): the job's own environment.
 */
#include <string.h>

#include "clockwork_args.h"
#include "clockwork_remote.h"

static const char *job_getenv(void *ctx, const char *name, char *buf, size_t buflen)
{
	spank_err_t rc = spank_getenv((spank_t)ctx, name, buf, (int)buflen);

	/* A value too long for buf comes back truncated; it cannot be valid and fails validation. */
	if (rc == ESPANK_SUCCESS || rc == ESPANK_NOSPACE)
		return buf;
	return NULL;
}

int cw_remote_post_opt(spank_t sp)
{
	struct cw_state *st = cw_state();
	char err[CW_ERR_MAX];
	char inherited[CW_VALUE_MAX];
	int enabled = 0;
	int opt;

	if (!st->ready)
		return CW_SPANK_FAIL;
	if (cw_options_apply_step_env(&st->opts, job_getenv, sp, err, sizeof(err)) < 0 ||
	    cw_options_resolve(&st->opts, &st->cfg, &enabled, err, sizeof(err)) < 0) {
		slurm_error("%s", err);
		return CW_SPANK_FAIL;
	}
	if (!enabled) {
		/* Only an explicit off changes anything: an inherited CLOCKWORK_FT must not say on. */
		if (spank_getenv(sp, cw_opt_env(CW_FT), inherited, sizeof(inherited)) == ESPANK_SUCCESS &&
		    strcmp(inherited, "off") != 0)
			spank_setenv(sp, cw_opt_env(CW_FT), "off", 1);
		return 0;
	}
	for (opt = 0; opt < CW_NOPTS; opt++) {
		const char *name = cw_opt_env((enum cw_opt)opt);
		spank_err_t rc = spank_setenv(sp, name, st->opts.value[opt], 1);

		if (rc != ESPANK_SUCCESS) {
			slurm_error("clockwork: cannot set %s in the job's environment: %s", name, spank_strerror(rc));
			return CW_SPANK_FAIL;
		}
	}
	return 0;
}
