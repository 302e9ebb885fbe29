/*
 * clockwork_args.c - plugstack arguments, option registration and the option callback.
 */
#include <string.h>

#include "clockwork_args.h"

static struct cw_state state;

static int option_cb(int val, const char *optarg, int remote);

/* has_arg: 1 = required argument, 2 = optional argument (written --opt=VAL). */
static struct spank_option options[CW_NOPTS] = {
	{ "clockwork-ft", "[aware|transparent|off]",
	  "[clockwork] turn on fault tolerance and pick its mode (bare flag: aware)", 2, CW_FT, option_cb },
	{ "clockwork-spares", "none|standby|borrow",
	  "[clockwork] where replacement nodes come from (default none)", 1, CW_SPARES, option_cb },
	{ "clockwork-snapshot", "off|DURATION",
	  "[clockwork] periodic async snapshots, e.g. 20m, 1h (default off)", 1, CW_SNAPSHOT, option_cb },
	{ "clockwork-linkpass", "on|off",
	  "[clockwork] fail over to a healthy network link (default on)", 1, CW_LINKPASS, option_cb },
};

struct cw_state *cw_state(void)
{
	return &state;
}

/*
 * Called by Slurm for each --clockwork-* option: by sbatch/salloc/srun for the command line and
 * #SBATCH lines (possibly more than once: the last one wins), and by slurmstepd (remote=1) for the
 * options it forwards to a step.
 */
static int option_cb(int val, const char *optarg, int remote)
{
	char err[CW_ERR_MAX];

	(void)remote;
	if (!state.ready || val < 0 || val >= CW_NOPTS)
		return CW_SPANK_FAIL;
	if (cw_options_set_cli(&state.opts, (enum cw_opt)val, optarg, err, sizeof(err)) < 0 ||
	    cw_options_check(&state.opts, &state.cfg, (enum cw_opt)val, err, sizeof(err)) < 0) {
		slurm_error("%s", err);
		return CW_SPANK_FAIL;
	}
	return 0;
}

int cw_args_init(spank_t sp, int ac, char **av)
{
	char err[CW_ERR_MAX];
	int i;

	memset(&state, 0, sizeof(state));
	cw_config_init(&state.cfg);
	cw_options_init(&state.opts);
	if (cw_config_parse(&state.cfg, ac, av, err, sizeof(err)) < 0) {
		slurm_error("%s", err);
		return CW_SPANK_FAIL;
	}
	state.ready = 1;
	for (i = 0; i < CW_NOPTS; i++) {
		spank_err_t rc = spank_option_register(sp, &options[i]);

		if (rc != ESPANK_SUCCESS) {
			slurm_error("clockwork: cannot register --%s: %s", options[i].name, spank_strerror(rc));
			state.ready = 0;
			return CW_SPANK_FAIL;
		}
	}
	return 0;
}
