/*
 * test_options.c - unit tests for the option parser and the plugstack configuration
 * (clockwork_options.c, clockwork_config.c). Run by `make -C spank test`; the last line printed
 * is "N passed, M failed" and the exit status is non-zero on any failure.
 */
#include <stdio.h>
#include <string.h>

#include "clockwork_config.h"
#include "clockwork_options.h"

static int passed;
static int failed;

#define CHECK(cond, ...)                                                        \
	do {                                                                    \
		if (cond) {                                                     \
			passed++;                                               \
		} else {                                                        \
			failed++;                                               \
			printf("FAIL %s:%d: ", __FILE__, __LINE__);             \
			printf(__VA_ARGS__);                                    \
			printf("\n");                                           \
		}                                                               \
	} while (0)

#define CHECK_STR(got, want, what) \
	CHECK(strcmp((got), (want)) == 0, "%s: got '%s', want '%s'", (what), (got), (want))

/* ---- a fake environment ------------------------------------------------------------------- */

struct fake_env {
	const char *const *vars;	/* "NAME=value", NULL-terminated */
};

static const char *fake_getenv(void *ctx, const char *name, char *buf, size_t buflen)
{
	const struct fake_env *env = ctx;
	size_t n = strlen(name);
	const char *const *v;

	for (v = env->vars; *v != NULL; v++) {
		if (strncmp(*v, name, n) == 0 && (*v)[n] == '=') {
			snprintf(buf, buflen, "%s", *v + n + 1);
			return buf;
		}
	}
	return NULL;
}

static const char *const no_vars[] = { NULL };
static struct fake_env empty_env = { no_vars };

/* ---- helpers ----------------------------------------------------------------------------- */

static void expect_value(enum cw_opt opt, const char *arg, const char *want)
{
	char out[CW_VALUE_MAX] = "";
	char err[CW_ERR_MAX] = "";
	int rc = cw_value_parse(opt, arg, out, sizeof(out), err, sizeof(err));

	CHECK(rc == 0, "--%s=%s should be valid (%s)", cw_opt_name(opt), arg ? arg : "NULL", err);
	if (rc == 0)
		CHECK_STR(out, want, cw_opt_name(opt));
}

static void expect_cli_error(enum cw_opt opt, const char *arg, const char *want)
{
	struct cw_options o;
	char err[CW_ERR_MAX] = "";

	cw_options_init(&o);
	CHECK(cw_options_set_cli(&o, opt, arg, err, sizeof(err)) < 0, "--%s=%s should be rejected", cw_opt_name(opt),
	      arg ? arg : "NULL");
	CHECK_STR(err, want, "error message");
	CHECK(o.source[opt] == CW_SRC_UNSET, "a rejected value must leave the option unset");
}

static void expect_config_error(int ac, char **av, const char *want)
{
	struct cw_config cfg;
	char err[CW_ERR_MAX] = "";

	cw_config_init(&cfg);
	CHECK(cw_config_parse(&cfg, ac, av, err, sizeof(err)) < 0, "plugstack '%s' should be rejected", av[ac - 1]);
	CHECK_STR(err, want, "plugstack error message");
}

/* Resolve like sbatch does: command-line arguments (NULL-terminated pairs), then the user's env. */
static int resolve_client(const struct cw_config *cfg, const char *const *cli, const char *const *env,
			  struct cw_options *o, int *enabled, char *err)
{
	struct fake_env fe = { env };

	cw_options_init(o);
	for (; cli != NULL && cli[0] != NULL; cli += 2) {
		enum cw_opt opt = CW_NOPTS;
		int i;

		for (i = 0; i < CW_NOPTS; i++)
			if (strcmp(cw_opt_name((enum cw_opt)i), cli[0]) == 0)
				opt = (enum cw_opt)i;
		if (opt == CW_NOPTS || cw_options_set_cli(o, opt, cli[1], err, CW_ERR_MAX) < 0 ||
		    cw_options_check(o, cfg, opt, err, CW_ERR_MAX) < 0)
			return -1;
	}
	if (cw_options_apply_env(o, "", CW_SRC_ENV, CW_NAME_ENV, 0, fake_getenv, &fe, err, CW_ERR_MAX) < 0)
		return -1;
	return cw_options_resolve(o, cfg, enabled, err, CW_ERR_MAX);
}

static void expect_resolved(const struct cw_options *o, const char *ft, const char *spares, const char *snapshot,
			    const char *linkpass)
{
	CHECK_STR(o->value[CW_FT], ft, "ft");
	CHECK_STR(o->value[CW_SPARES], spares, "spares");
	CHECK_STR(o->value[CW_SNAPSHOT], snapshot, "snapshot");
	CHECK_STR(o->value[CW_LINKPASS], linkpass, "linkpass");
}

/* ---- tests ------------------------------------------------------------------------------- */

static void test_names(void)
{
	CHECK_STR(cw_opt_name(CW_FT), "clockwork-ft", "name");
	CHECK_STR(cw_opt_name(CW_SPARES), "clockwork-spares", "name");
	CHECK_STR(cw_opt_name(CW_SNAPSHOT), "clockwork-snapshot", "name");
	CHECK_STR(cw_opt_name(CW_LINKPASS), "clockwork-linkpass", "name");
	CHECK_STR(cw_opt_env(CW_FT), "CLOCKWORK_FT", "env");
	CHECK_STR(cw_opt_env(CW_SPARES), "CLOCKWORK_SPARES", "env");
	CHECK_STR(cw_opt_env(CW_SNAPSHOT), "CLOCKWORK_SNAPSHOT", "env");
	CHECK_STR(cw_opt_env(CW_LINKPASS), "CLOCKWORK_LINKPASS", "env");
}

static void test_valid_values(void)
{
	expect_value(CW_FT, "aware", "aware");
	expect_value(CW_FT, "transparent", "transparent");
	expect_value(CW_FT, "off", "off");
	/* The three forms Slurm uses for a bare --clockwork-ft. */
	expect_value(CW_FT, NULL, "aware");
	expect_value(CW_FT, "", "aware");
	expect_value(CW_FT, "(null)", "aware");

	expect_value(CW_SPARES, "none", "none");
	expect_value(CW_SPARES, "standby", "standby");
	expect_value(CW_SPARES, "borrow", "borrow");

	expect_value(CW_SNAPSHOT, "off", "off");
	expect_value(CW_SNAPSHOT, "90s", "90s");
	expect_value(CW_SNAPSHOT, "20m", "20m");
	expect_value(CW_SNAPSHOT, "1h", "1h");
	expect_value(CW_SNAPSHOT, "2d", "2d");
	expect_value(CW_SNAPSHOT, "020m", "20m");
	expect_value(CW_SNAPSHOT, "24855d", "24855d");	/* 2147472000 s: still fits in 32 bits */

	expect_value(CW_LINKPASS, "on", "on");
	expect_value(CW_LINKPASS, "off", "off");
}

static void test_bad_values(void)
{
	static const char *const bad_ft[] = { "maybe", "on", "Aware", "aware ", "yes", "1", NULL };
	static const char *const bad_spares[] = { "maybe", "None", "spare", "standby,borrow", "1", NULL };
	static const char *const bad_snapshot[] = { "maybe", "0m", "0", "20", "m", "20x", "1.5h", "-5m", "+5m",
						    " 20m", "20m ", "20M", "1h30m", "24856d", "99999999999999d",
						    "on", NULL };
	static const char *const bad_linkpass[] = { "maybe", "yes", "no", "true", "ON", "1", NULL };
	const char *const *v;
	char want[CW_ERR_MAX];

	for (v = bad_ft; *v != NULL; v++) {
		snprintf(want, sizeof(want),
			 "clockwork: --clockwork-ft: invalid value '%s' (expected aware, transparent, off)", *v);
		expect_cli_error(CW_FT, *v, want);
	}
	for (v = bad_spares; *v != NULL; v++) {
		snprintf(want, sizeof(want),
			 "clockwork: --clockwork-spares: invalid value '%s' (expected none, standby, borrow)", *v);
		expect_cli_error(CW_SPARES, *v, want);
	}
	for (v = bad_snapshot; *v != NULL; v++) {
		snprintf(want, sizeof(want),
			 "clockwork: --clockwork-snapshot: invalid value '%s' (expected off or a duration like 20m, 1h)",
			 *v);
		expect_cli_error(CW_SNAPSHOT, *v, want);
	}
	for (v = bad_linkpass; *v != NULL; v++) {
		snprintf(want, sizeof(want), "clockwork: --clockwork-linkpass: invalid value '%s' (expected on, off)",
			 *v);
		expect_cli_error(CW_LINKPASS, *v, want);
	}
	/* The exact message from the issue. */
	expect_cli_error(CW_SPARES, "maybe",
			 "clockwork: --clockwork-spares: invalid value 'maybe' (expected none, standby, borrow)");
	/* A bare flag is only meaningful for --clockwork-ft. */
	expect_cli_error(CW_SPARES, NULL,
			 "clockwork: --clockwork-spares: invalid value '' (expected none, standby, borrow)");
	expect_cli_error(CW_SNAPSHOT, "",
			 "clockwork: --clockwork-snapshot: invalid value '' (expected off or a duration like 20m, 1h)");
	expect_cli_error(CW_LINKPASS, "(null)",
			 "clockwork: --clockwork-linkpass: invalid value '(null)' (expected on, off)");
}

static void test_duration_seconds(void)
{
	long s = -1;

	CHECK(cw_duration_seconds("90s", &s) == 0 && s == 90, "90s -> %ld", s);
	CHECK(cw_duration_seconds("20m", &s) == 0 && s == 1200, "20m -> %ld", s);
	CHECK(cw_duration_seconds("1h", &s) == 0 && s == 3600, "1h -> %ld", s);
	CHECK(cw_duration_seconds("2d", &s) == 0 && s == 172800, "2d -> %ld", s);
	CHECK(cw_duration_seconds("off", &s) < 0, "off is not a duration");
	CHECK(cw_duration_seconds(NULL, &s) < 0, "NULL is not a duration");
	CHECK(cw_duration_seconds("0s", &s) < 0, "0s is not a duration");
}

static void test_cli_last_wins(void)
{
	struct cw_options o;
	char err[CW_ERR_MAX];

	cw_options_init(&o);
	CHECK(cw_options_set_cli(&o, CW_SPARES, "standby", err, sizeof(err)) == 0, "standby");
	CHECK(cw_options_set_cli(&o, CW_SPARES, "borrow", err, sizeof(err)) == 0, "borrow");
	CHECK_STR(o.value[CW_SPARES], "borrow", "the last --clockwork-spares wins");
	CHECK(cw_options_set_cli(&o, CW_SPARES, "maybe", err, sizeof(err)) < 0, "maybe");
	CHECK_STR(o.value[CW_SPARES], "borrow", "a rejected value keeps the previous one");
}

static void test_precedence(void)
{
	struct cw_config cfg;
	struct cw_options o;
	char err[CW_ERR_MAX] = "";
	int enabled = -1;

	cw_config_init(&cfg);

	/* Nothing asked: off, nothing to export. */
	CHECK(resolve_client(&cfg, NULL, no_vars, &o, &enabled, err) == 0 && enabled == 0, "no options -> off");
	CHECK_STR(o.value[CW_FT], "off", "ft");

	/* A bare flag: aware with every default filled. */
	{
		const char *cli[] = { "clockwork-ft", NULL, NULL };

		CHECK(resolve_client(&cfg, cli, no_vars, &o, &enabled, err) == 0 && enabled == 1, "bare flag: %s",
		      err);
		expect_resolved(&o, "aware", "none", "off", "on");
	}
	/* Environment defaults apply when the option is not on the command line. */
	{
		const char *cli[] = { "clockwork-ft", "transparent", "clockwork-spares", "borrow", NULL, NULL };
		const char *env[] = { "CLOCKWORK_FT=aware", "CLOCKWORK_SPARES=standby", "CLOCKWORK_SNAPSHOT=1h",
				      "CLOCKWORK_LINKPASS=off", NULL };

		CHECK(resolve_client(&cfg, cli, env, &o, &enabled, err) == 0 && enabled == 1, "cli + env: %s", err);
		expect_resolved(&o, "transparent", "borrow", "1h", "off");
		CHECK(o.source[CW_FT] == CW_SRC_CLI && o.source[CW_SNAPSHOT] == CW_SRC_ENV, "sources");
	}
	/* CLOCKWORK_FT alone turns it on; an empty variable counts as unset. */
	{
		const char *env[] = { "CLOCKWORK_FT=aware", "CLOCKWORK_SPARES=", NULL };

		CHECK(resolve_client(&cfg, NULL, env, &o, &enabled, err) == 0 && enabled == 1, "env ft: %s", err);
		expect_resolved(&o, "aware", "none", "off", "on");
	}
	/* Other CLOCKWORK_* defaults alone do not turn Clockwork on. */
	{
		const char *env[] = { "CLOCKWORK_SPARES=borrow", "CLOCKWORK_SNAPSHOT=20m", NULL };

		CHECK(resolve_client(&cfg, NULL, env, &o, &enabled, err) == 0 && enabled == 0, "env spares only");
	}
	/* Another --clockwork-* option on the command line implies aware... */
	{
		const char *cli[] = { "clockwork-snapshot", "20m", NULL, NULL };

		CHECK(resolve_client(&cfg, cli, no_vars, &o, &enabled, err) == 0 && enabled == 1, "implied: %s", err);
		expect_resolved(&o, "aware", "none", "20m", "on");
	}
	/* ...but an explicit off wins, from the command line or the environment. */
	{
		const char *cli[] = { "clockwork-ft", "off", "clockwork-spares", "standby", NULL, NULL };
		const char *env[] = { "CLOCKWORK_FT=aware", NULL };

		CHECK(resolve_client(&cfg, cli, env, &o, &enabled, err) == 0 && enabled == 0, "cli off beats env");
	}
	{
		const char *cli[] = { "clockwork-spares", "standby", NULL, NULL };
		const char *env[] = { "CLOCKWORK_FT=off", NULL };

		CHECK(resolve_client(&cfg, cli, env, &o, &enabled, err) == 0 && enabled == 0, "env off");
	}
	/* The command line beats a bad environment value: the variable is not even read. */
	{
		const char *cli[] = { "clockwork-spares", "none", NULL, NULL };
		const char *env[] = { "CLOCKWORK_SPARES=maybe", NULL };

		CHECK(resolve_client(&cfg, cli, env, &o, &enabled, err) == 0, "cli shadows bad env: %s", err);
	}
	/* A bad environment value is an error naming the variable. */
	{
		static const struct {
			const char *var;
			const char *want;
		} cases[] = {
			{ "CLOCKWORK_FT=maybe",
			  "clockwork: CLOCKWORK_FT: invalid value 'maybe' (expected aware, transparent, off)" },
			{ "CLOCKWORK_FT=(null)",
			  "clockwork: CLOCKWORK_FT: invalid value '(null)' (expected aware, transparent, off)" },
			{ "CLOCKWORK_SPARES=maybe",
			  "clockwork: CLOCKWORK_SPARES: invalid value 'maybe' (expected none, standby, borrow)" },
			{ "CLOCKWORK_SNAPSHOT=5",
			  "clockwork: CLOCKWORK_SNAPSHOT: invalid value '5' (expected off or a duration like 20m, 1h)" },
			{ "CLOCKWORK_LINKPASS=yes",
			  "clockwork: CLOCKWORK_LINKPASS: invalid value 'yes' (expected on, off)" },
		};
		size_t i;

		for (i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
			const char *env[] = { cases[i].var, NULL };

			err[0] = '\0';
			CHECK(resolve_client(&cfg, NULL, env, &o, &enabled, err) < 0, "%s must be rejected", cases[i].var);
			CHECK_STR(err, cases[i].want, cases[i].var);
		}
	}
}

static void test_default_ft(void)
{
	struct cw_config cfg;
	struct cw_options o;
	char err[CW_ERR_MAX] = "";
	int enabled = -1;
	char *av_aware[] = { "default_ft=transparent" };
	char *av_off[] = { "default_ft=off" };

	cw_config_init(&cfg);
	CHECK(cw_config_parse(&cfg, 1, av_aware, err, sizeof(err)) == 0, "default_ft=transparent: %s", err);
	CHECK(resolve_client(&cfg, NULL, no_vars, &o, &enabled, err) == 0 && enabled == 1, "default_ft applies");
	expect_resolved(&o, "transparent", "none", "off", "on");
	{
		const char *env[] = { "CLOCKWORK_FT=off", NULL };

		CHECK(resolve_client(&cfg, NULL, env, &o, &enabled, err) == 0 && enabled == 0, "CLOCKWORK_FT beats it");
	}
	{
		const char *cli[] = { "clockwork-ft", "aware", NULL, NULL };

		CHECK(resolve_client(&cfg, cli, no_vars, &o, &enabled, err) == 0 && enabled == 1, "cli beats it");
		CHECK_STR(o.value[CW_FT], "aware", "ft");
	}

	cw_config_init(&cfg);
	CHECK(cw_config_parse(&cfg, 1, av_off, err, sizeof(err)) == 0, "default_ft=off: %s", err);
	CHECK(resolve_client(&cfg, NULL, no_vars, &o, &enabled, err) == 0 && enabled == 0, "default_ft=off: nothing");
}

static void test_config(void)
{
	struct cw_config cfg;
	char err[CW_ERR_MAX] = "";
	char *all[] = { "default_ft=aware", "allow_borrow=no", "max_spares=1024", "config=/etc/clockwork/clockwork.toml" };
	char *zero[] = { "max_spares=0", "allow_borrow=yes" };

	cw_config_init(&cfg);
	CHECK(cfg.default_ft[0] == '\0' && cfg.allow_borrow == 1 && cfg.max_spares == 4 && cfg.config_path[0] == '\0',
	      "defaults");
	CHECK(cw_config_parse(&cfg, 0, NULL, err, sizeof(err)) == 0, "no arguments");
	CHECK(cw_config_parse(&cfg, 4, all, err, sizeof(err)) == 0, "all arguments: %s", err);
	CHECK_STR(cfg.default_ft, "aware", "default_ft");
	CHECK(cfg.allow_borrow == 0, "allow_borrow");
	CHECK(cfg.max_spares == 1024, "max_spares");
	CHECK_STR(cfg.config_path, "/etc/clockwork/clockwork.toml", "config");
	CHECK(cw_config_parse(&cfg, 2, zero, err, sizeof(err)) == 0 && cfg.max_spares == 0 && cfg.allow_borrow == 1,
	      "max_spares=0");

	{
		char *av[] = { "foo=1" };

		expect_config_error(1, av, "clockwork: plugstack.conf: unknown argument 'foo=1' "
				    "(known: default_ft, allow_borrow, max_spares, config)");
	}
	{
		char *av[] = { "allow_borrow=yes", "verbose" };

		expect_config_error(2, av, "clockwork: plugstack.conf: unknown argument 'verbose' "
				    "(known: default_ft, allow_borrow, max_spares, config)");
	}
	{
		char *av[] = { "default_ft_x=aware" };

		expect_config_error(1, av, "clockwork: plugstack.conf: unknown argument 'default_ft_x=aware' "
				    "(known: default_ft, allow_borrow, max_spares, config)");
	}
	{
		static const struct {
			char *arg;
			const char *want;
		} cases[] = {
			{ "default_ft=maybe",
			  "clockwork: plugstack.conf: default_ft: invalid value 'maybe' (expected aware, transparent, off)" },
			{ "default_ft=",
			  "clockwork: plugstack.conf: default_ft: invalid value '' (expected aware, transparent, off)" },
			{ "default_ft=(null)",
			  "clockwork: plugstack.conf: default_ft: invalid value '(null)' (expected aware, transparent, off)" },
			{ "allow_borrow=maybe",
			  "clockwork: plugstack.conf: allow_borrow: invalid value 'maybe' (expected yes, no)" },
			{ "allow_borrow=1", "clockwork: plugstack.conf: allow_borrow: invalid value '1' (expected yes, no)" },
			{ "max_spares=1025",
			  "clockwork: plugstack.conf: max_spares: invalid value '1025' (expected an integer from 0 to 1024)" },
			{ "max_spares=-1",
			  "clockwork: plugstack.conf: max_spares: invalid value '-1' (expected an integer from 0 to 1024)" },
			{ "max_spares=",
			  "clockwork: plugstack.conf: max_spares: invalid value '' (expected an integer from 0 to 1024)" },
			{ "max_spares=4x",
			  "clockwork: plugstack.conf: max_spares: invalid value '4x' (expected an integer from 0 to 1024)" },
			{ "max_spares=99999999999999999999",
			  "clockwork: plugstack.conf: max_spares: invalid value '99999999999999999999' "
			  "(expected an integer from 0 to 1024)" },
			{ "config=clockwork.toml",
			  "clockwork: plugstack.conf: config: invalid value 'clockwork.toml' (expected an absolute path)" },
			{ "config=", "clockwork: plugstack.conf: config: invalid value '' (expected an absolute path)" },
		};
		size_t i;

		for (i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
			char *av[] = { cases[i].arg };

			expect_config_error(1, av, cases[i].want);
		}
	}
	{
		char *av[] = { "max_spares=2", "max_spares=3" };

		expect_config_error(2, av, "clockwork: plugstack.conf: argument 'max_spares' given more than once");
	}
	/* A failed parse leaves the configuration as it was. */
	{
		char *av[] = { "max_spares=7", "foo=1" };

		cw_config_init(&cfg);
		CHECK(cw_config_parse(&cfg, 2, av, err, sizeof(err)) < 0 && cfg.max_spares == 4, "unchanged on error");
	}
}

static void test_limits(void)
{
	struct cw_config cfg;
	struct cw_options o;
	char err[CW_ERR_MAX] = "";
	int enabled = -1;
	char *no_borrow[] = { "allow_borrow=no" };
	char *no_spares[] = { "max_spares=0" };

	cw_config_init(&cfg);
	CHECK(cw_config_parse(&cfg, 1, no_borrow, err, sizeof(err)) == 0, "allow_borrow=no");
	{
		const char *cli[] = { "clockwork-ft", NULL, "clockwork-spares", "borrow", NULL, NULL };

		CHECK(resolve_client(&cfg, cli, no_vars, &o, &enabled, err) < 0, "borrow refused");
		CHECK_STR(err,
			  "clockwork: --clockwork-spares: 'borrow' is not allowed on this cluster "
			  "(plugstack.conf: allow_borrow=no; use none or standby)", "borrow message");
	}
	{
		const char *env[] = { "CLOCKWORK_FT=aware", "CLOCKWORK_SPARES=borrow", NULL };

		CHECK(resolve_client(&cfg, NULL, env, &o, &enabled, err) < 0, "borrow from env refused");
		CHECK_STR(err,
			  "clockwork: CLOCKWORK_SPARES: 'borrow' is not allowed on this cluster "
			  "(plugstack.conf: allow_borrow=no; use none or standby)", "env borrow message");
	}
	{
		const char *cli[] = { "clockwork-ft", NULL, "clockwork-spares", "standby", NULL, NULL };

		CHECK(resolve_client(&cfg, cli, no_vars, &o, &enabled, err) == 0 && enabled == 1, "standby allowed");
	}
	/* With Clockwork off, a CLOCKWORK_SPARES=borrow default is not an error. */
	{
		const char *env[] = { "CLOCKWORK_SPARES=borrow", NULL };

		CHECK(resolve_client(&cfg, NULL, env, &o, &enabled, err) == 0 && enabled == 0, "off: limits unchecked");
	}

	cw_config_init(&cfg);
	CHECK(cw_config_parse(&cfg, 1, no_spares, err, sizeof(err)) == 0, "max_spares=0");
	{
		const char *cli[] = { "clockwork-spares", "standby", NULL, NULL };

		CHECK(resolve_client(&cfg, cli, no_vars, &o, &enabled, err) < 0, "standby refused with max_spares=0");
		CHECK_STR(err,
			  "clockwork: --clockwork-spares: 'standby' is not allowed on this cluster "
			  "(plugstack.conf: max_spares=0; use none)", "max_spares message");
	}
	{
		const char *cli[] = { "clockwork-spares", "none", NULL, NULL };

		CHECK(resolve_client(&cfg, cli, no_vars, &o, &enabled, err) == 0 && enabled == 1, "none allowed");
	}
}

/* slurmstepd: what the batch step finds in its environment (captured from a real sbatch). */
static void test_step_env(void)
{
	struct cw_config cfg;
	struct cw_options o;
	char err[CW_ERR_MAX] = "";
	int enabled = -1;

	cw_config_init(&cfg);

	/* sbatch --export=NONE --clockwork-ft --clockwork-snapshot=020m: no callback ran in the step. */
	{
		const char *vars[] = {
			"SLURM_SPANK__SLURM_SPANK_OPTION_clockwork_clockwork_ft=(null)",
			"SLURM_SPANK__SLURM_SPANK_OPTION_clockwork_clockwork_snapshot=020m",
			"SLURM_SPANK_CLOCKWORK_FT=aware", "SLURM_SPANK_CLOCKWORK_SPARES=none",
			"SLURM_SPANK_CLOCKWORK_SNAPSHOT=20m", "SLURM_SPANK_CLOCKWORK_LINKPASS=on", NULL,
		};
		struct fake_env fe = { vars };

		cw_options_init(&o);
		CHECK(cw_options_apply_step_env(&o, fake_getenv, &fe, err, sizeof(err)) == 0, "step env: %s", err);
		CHECK(cw_options_resolve(&o, &cfg, &enabled, err, sizeof(err)) == 0 && enabled == 1, "on: %s", err);
		expect_resolved(&o, "aware", "none", "20m", "on");
		CHECK(o.source[CW_FT] == CW_SRC_CLI, "the option copy counts as command line");
	}
	/* Only Slurm's option copies (the spank job-control copies missing): still complete. */
	{
		const char *vars[] = { "SLURM_SPANK__SLURM_SPANK_OPTION_clockwork_clockwork_ft=",
				       "SLURM_SPANK__SLURM_SPANK_OPTION_clockwork_clockwork_spares=borrow", NULL };
		struct fake_env fe = { vars };

		cw_options_init(&o);
		CHECK(cw_options_apply_step_env(&o, fake_getenv, &fe, err, sizeof(err)) == 0 &&
		      cw_options_resolve(&o, &cfg, &enabled, err, sizeof(err)) == 0 && enabled == 1, "copies: %s", err);
		expect_resolved(&o, "aware", "borrow", "off", "on");
	}
	/* A step's own option (the callback) beats the job's copies; CLOCKWORK_* fills the rest. */
	{
		const char *vars[] = { "SLURM_SPANK__SLURM_SPANK_OPTION_clockwork_clockwork_spares=borrow",
				       "SLURM_SPANK_CLOCKWORK_FT=aware", "SLURM_SPANK_CLOCKWORK_SPARES=borrow",
				       "CLOCKWORK_SNAPSHOT=1h", NULL };
		struct fake_env fe = { vars };

		cw_options_init(&o);
		CHECK(cw_options_set_cli(&o, CW_SPARES, "standby", err, sizeof(err)) == 0, "callback");
		CHECK(cw_options_apply_step_env(&o, fake_getenv, &fe, err, sizeof(err)) == 0 &&
		      cw_options_resolve(&o, &cfg, &enabled, err, sizeof(err)) == 0 && enabled == 1, "mix: %s", err);
		expect_resolved(&o, "aware", "standby", "1h", "on");
	}
	/* srun --clockwork-ft=off inside a Clockwork job: off. */
	{
		const char *vars[] = { "SLURM_SPANK_CLOCKWORK_FT=aware", "CLOCKWORK_FT=aware", NULL };
		struct fake_env fe = { vars };

		cw_options_init(&o);
		CHECK(cw_options_set_cli(&o, CW_FT, "off", err, sizeof(err)) == 0, "callback off");
		CHECK(cw_options_apply_step_env(&o, fake_getenv, &fe, err, sizeof(err)) == 0 &&
		      cw_options_resolve(&o, &cfg, &enabled, err, sizeof(err)) == 0 && enabled == 0, "step off");
	}
	/* A job without Clockwork: nothing. */
	cw_options_init(&o);
	CHECK(cw_options_apply_step_env(&o, fake_getenv, &empty_env, err, sizeof(err)) == 0 &&
	      cw_options_resolve(&o, &cfg, &enabled, err, sizeof(err)) == 0 && enabled == 0, "plain job");
}

int main(void)
{
	test_names();
	test_valid_values();
	test_bad_values();
	test_duration_seconds();
	test_cli_last_wins();
	test_precedence();
	test_default_ft();
	test_config();
	test_limits();
	test_step_env();
	printf("%d passed, %d failed\n", passed, failed);
	return failed == 0 ? 0 : 1;
}
