/*
 * clockwork_options.h - the --clockwork-* options: parsing, validation, defaults.
 *
 * Pure C (no Slurm dependency) so that it can be unit-tested (test_options.c).
 *
 *   --clockwork-ft[=aware|transparent|off]   bare flag = aware
 *   --clockwork-spares=none|standby|borrow   default none
 *   --clockwork-snapshot=off|DURATION        default off; DURATION = positive integer + s|m|h|d
 *   --clockwork-linkpass=on|off              default on
 *
 * Values are kept as canonical text, which is what the job and the Prolog/Epilog receive
 * (CLOCKWORK_FT, CLOCKWORK_SPARES, CLOCKWORK_SNAPSHOT, CLOCKWORK_LINKPASS). A snapshot duration keeps
 * its unit ("20m", leading zeros dropped) rather than being turned into seconds, so that every
 * exported value is itself a valid CLOCKWORK_* default (srun inside a job reads them back);
 * cw_duration_seconds() converts it.
 *
 * Precedence, per option: command line > environment (CLOCKWORK_*) > built-in default. The mode
 * (ft) resolves as: --clockwork-ft > CLOCKWORK_FT > plugstack default_ft (unless off) > "aware"
 * when another --clockwork-* option was given on the command line > off. An explicit off wins.
 */
#ifndef CLOCKWORK_OPTIONS_H
#define CLOCKWORK_OPTIONS_H

#include <stddef.h>

#include "clockwork_config.h"

#define CW_ERR_MAX 512
#define CW_LABEL_MAX 96

enum cw_opt {
	CW_FT = 0,
	CW_SPARES,
	CW_SNAPSHOT,
	CW_LINKPASS,
	CW_NOPTS
};

/* Where a value came from, lowest priority first. */
enum cw_source {
	CW_SRC_UNSET = 0,
	CW_SRC_DEFAULT,		/* built-in default or plugstack default_ft */
	CW_SRC_ENV,		/* an environment variable (CLOCKWORK_*, or a copy Slurm made of it) */
	CW_SRC_CLI,		/* a --clockwork-* option (command line, #SBATCH line, or forwarded by Slurm) */
};

struct cw_options {
	enum cw_source source[CW_NOPTS];
	char value[CW_NOPTS][CW_VALUE_MAX];
	/* What to name in a message about this value: "--clockwork-spares" or "CLOCKWORK_SPARES". */
	char label[CW_NOPTS][CW_LABEL_MAX];
};

/* Looks a value up in an environment: returns the value (possibly copied into buf) or NULL. */
typedef const char *(*cw_getenv_fn)(void *ctx, const char *name, char *buf, size_t buflen);

const char *cw_opt_name(enum cw_opt opt);	/* "clockwork-spares" */
const char *cw_opt_env(enum cw_opt opt);	/* "CLOCKWORK_SPARES" */
const char *cw_opt_expected(enum cw_opt opt);	/* "none, standby, borrow" */

void cw_options_init(struct cw_options *opts);

/*
 * Validate one value and write its canonical text to out. For CW_FT a bare flag, which Slurm hands
 * over as NULL (sbatch/srun), "" (slurmstepd) or the string "(null)" (srun inside a job), means
 * "aware"; for the others NULL or "" is an invalid value. On error returns -1 with err set to
 * "invalid value 'maybe' (expected none, standby, borrow)" (no prefix).
 */
int cw_value_parse(enum cw_opt opt, const char *arg, char *out, size_t outlen, char *err, size_t errlen);

/*
 * Set an option from a command-line argument (source CW_SRC_CLI; the last one wins, as Slurm may
 * call a callback more than once). On error returns -1 with err set to the full message:
 *   clockwork: --clockwork-spares: invalid value 'maybe' (expected none, standby, borrow)
 */
int cw_options_set_cli(struct cw_options *opts, enum cw_opt opt, const char *arg, char *err, size_t errlen);

/* How apply_env names a variable after its prefix. */
enum cw_naming {
	CW_NAME_ENV,		/* CLOCKWORK_SPARES */
	CW_NAME_OPTION,		/* clockwork_spares: the option name as Slurm spells it in variables */
};

/*
 * Fill every option that is still unset from the environment variable PREFIX + name (prefix ""
 * and CW_NAME_ENV for the user's CLOCKWORK_* defaults), with the given source. An empty value
 * counts as unset. A bad value is an error naming the variable:
 *   clockwork: CLOCKWORK_SPARES: invalid value 'maybe' (expected none, standby, borrow)
 * With bare_flag_ok, an empty or "(null)" ft value means "aware" (Slurm's copies of --clockwork-ft).
 */
int cw_options_apply_env(struct cw_options *opts, const char *prefix, enum cw_source source,
			 enum cw_naming naming, int bare_flag_ok, cw_getenv_fn getenv_fn, void *ctx, char *err,
			 size_t errlen);

/*
 * Slurm 22.05 (src/common/plugstack.c, sbatch/salloc/srun _set_spank_env()): an option's argument
 * travels as "_SLURM_SPANK_OPTION_" + plugin name + "_" + option name (non-alphanumerics -> '_'),
 * and every spank job-control variable NAME (spank_job_control_setenv) is copied into the job's
 * environment as "SLURM_SPANK_" + NAME, which --export=NONE keeps (it keeps SLURM_*). So with
 * --export=NONE the batch step still finds SLURM_SPANK__SLURM_SPANK_OPTION_clockwork_clockwork_ft
 * (value "(null)" for the bare flag) and SLURM_SPANK_CLOCKWORK_FT.
 */
#define CW_SLURM_OPTION_COPY_PREFIX "SLURM_SPANK__SLURM_SPANK_OPTION_clockwork_"
#define CW_SLURM_JOB_CONTROL_PREFIX "SLURM_SPANK_"

/*
 * What slurmstepd does after the option callbacks: fill the options still unset from the job's
 * environment, best source first:
 *   1. SLURM_SPANK__SLURM_SPANK_OPTION_clockwork_clockwork_<opt>: Slurm's copy of the submit options
 *      (counts as command line; the batch step never runs the callback under --export=NONE);
 *   2. SLURM_SPANK_CLOCKWORK_<OPT>: the values sbatch/salloc/srun resolved and exported;
 *   3. CLOCKWORK_<OPT>: the job's own environment.
 */
int cw_options_apply_step_env(struct cw_options *opts, cw_getenv_fn getenv_fn, void *ctx, char *err,
			      size_t errlen);

/* Check one set value against the admin's limits (borrow allowed? spare nodes allowed?). */
int cw_options_check(const struct cw_options *opts, const struct cw_config *cfg, enum cw_opt opt, char *err,
		     size_t errlen);

/*
 * Decide the mode, fill the defaults and check the limits. *enabled is 1 when Clockwork is on for
 * the job (ft is not off); only then are the defaults filled and the limits checked.
 */
int cw_options_resolve(struct cw_options *opts, const struct cw_config *cfg, int *enabled, char *err,
		       size_t errlen);

/* "20m" -> 1200. Returns 0, or -1 for "off" or anything that is not a duration. */
int cw_duration_seconds(const char *text, long *seconds);

#endif /* CLOCKWORK_OPTIONS_H */
