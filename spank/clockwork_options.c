/*
 * clockwork_options.c - the --clockwork-* options: parsing, validation, defaults.
 * See clockwork_options.h. No Slurm dependency.
 */
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "clockwork_options.h"

struct cw_opt_info {
	const char *name;
	const char *env;
	const char *expected;
	const char *fallback;	/* the built-in default when Clockwork is on */
	const char *const *words;	/* the accepted words; NULL-terminated */
};

static const char *const ft_words[] = { "aware", "transparent", "off", NULL };
static const char *const spares_words[] = { "none", "standby", "borrow", NULL };
static const char *const snapshot_words[] = { "off", NULL };
static const char *const linkpass_words[] = { "on", "off", NULL };

static const struct cw_opt_info opt_info[CW_NOPTS] = {
	[CW_FT] = { "clockwork-ft", "CLOCKWORK_FT", "aware, transparent, off", "off", ft_words },
	[CW_SPARES] = { "clockwork-spares", "CLOCKWORK_SPARES", "none, standby, borrow", "none", spares_words },
	[CW_SNAPSHOT] = { "clockwork-snapshot", "CLOCKWORK_SNAPSHOT", "off or a duration like 20m, 1h", "off",
			  snapshot_words },
	[CW_LINKPASS] = { "clockwork-linkpass", "CLOCKWORK_LINKPASS", "on, off", "on", linkpass_words },
};

/* Seconds are capped so that every consumer can hold them in a signed 32-bit integer. */
#define CW_DURATION_MAX_SECONDS 2147483647L

const char *cw_opt_name(enum cw_opt opt)
{
	return opt_info[opt].name;
}

const char *cw_opt_env(enum cw_opt opt)
{
	return opt_info[opt].env;
}

const char *cw_opt_expected(enum cw_opt opt)
{
	return opt_info[opt].expected;
}

void cw_options_init(struct cw_options *opts)
{
	memset(opts, 0, sizeof(*opts));
}

/* Copy text into out; -1 (and nothing copied) when it does not fit. */
static int copy_text(char *out, size_t outlen, const char *text)
{
	size_t n = strlen(text);

	if (n >= outlen)
		return -1;
	memcpy(out, text, n + 1);
	return 0;
}

static int is_bare_flag(const char *arg)
{
	return arg == NULL || arg[0] == '\0' || strcmp(arg, "(null)") == 0;
}

static int parse_duration(const char *text, long *seconds)
{
	long value = 0;
	long unit;
	const char *p = text;

	if (*p < '0' || *p > '9')
		return -1;
	for (; *p >= '0' && *p <= '9'; p++) {
		value = value * 10 + (*p - '0');
		if (value > CW_DURATION_MAX_SECONDS)
			return -1;
	}
	switch (*p) {
	case 's':
		unit = 1;
		break;
	case 'm':
		unit = 60;
		break;
	case 'h':
		unit = 3600;
		break;
	case 'd':
		unit = 86400;
		break;
	default:
		return -1;
	}
	if (p[1] != '\0' || value <= 0 || value > CW_DURATION_MAX_SECONDS / unit)
		return -1;
	*seconds = value * unit;
	return 0;
}

int cw_duration_seconds(const char *text, long *seconds)
{
	if (text == NULL)
		return -1;
	return parse_duration(text, seconds);
}

int cw_value_parse(enum cw_opt opt, const char *arg, char *out, size_t outlen, char *err, size_t errlen)
{
	const struct cw_opt_info *info = &opt_info[opt];
	const char *const *w;
	long seconds;

	if (opt == CW_FT && is_bare_flag(arg) && copy_text(out, outlen, "aware") == 0)
		return 0;

	if (arg != NULL) {
		for (w = info->words; *w != NULL; w++) {
			if (strcmp(arg, *w) == 0) {
				if (copy_text(out, outlen, *w) < 0)
					break;
				return 0;
			}
		}
		if (opt == CW_SNAPSHOT && parse_duration(arg, &seconds) == 0) {
			/* Canonical text: the number without leading zeros, then the unit. */
			const char *digits = arg;
			size_t n;

			while (*digits == '0')
				digits++;
			n = strlen(digits);
			if (n < outlen) {
				memcpy(out, digits, n + 1);
				return 0;
			}
		}
	}
	snprintf(err, errlen, "invalid value '%s' (expected %s)", arg != NULL ? arg : "", info->expected);
	return -1;
}

static void set_label(struct cw_options *opts, enum cw_opt opt, const char *prefix, const char *name)
{
	snprintf(opts->label[opt], sizeof(opts->label[opt]), "%s%s", prefix, name);
}

int cw_options_set_cli(struct cw_options *opts, enum cw_opt opt, const char *arg, char *err, size_t errlen)
{
	char value[CW_VALUE_MAX];
	char why[CW_ERR_MAX];

	if (cw_value_parse(opt, arg, value, sizeof(value), why, sizeof(why)) < 0) {
		snprintf(err, errlen, "clockwork: --%s: %s", cw_opt_name(opt), why);
		return -1;
	}
	memcpy(opts->value[opt], value, sizeof(value));
	opts->source[opt] = CW_SRC_CLI;
	set_label(opts, opt, "--", cw_opt_name(opt));
	return 0;
}

/* "clockwork-spares" -> "clockwork_spares", as Slurm's _opt_env_name() does. */
static void option_var_name(enum cw_opt opt, char *out, size_t outlen)
{
	const char *name = cw_opt_name(opt);
	size_t i;

	for (i = 0; name[i] != '\0' && i + 1 < outlen; i++)
		out[i] = ((name[i] >= 'a' && name[i] <= 'z') || (name[i] >= 'A' && name[i] <= 'Z') ||
			  (name[i] >= '0' && name[i] <= '9')) ? name[i] : '_';
	out[i] = '\0';
}

int cw_options_apply_env(struct cw_options *opts, const char *prefix, enum cw_source source,
			 enum cw_naming naming, int bare_flag_ok, cw_getenv_fn getenv_fn, void *ctx, char *err,
			 size_t errlen)
{
	int opt;

	for (opt = 0; opt < CW_NOPTS; opt++) {
		char name[CW_LABEL_MAX];
		char buf[CW_VALUE_MAX * 8];
		char value[CW_VALUE_MAX];
		char why[CW_ERR_MAX];
		char suffix[CW_LABEL_MAX];
		const char *arg;

		if (opts->source[opt] != CW_SRC_UNSET)
			continue;
		if (naming == CW_NAME_OPTION)
			option_var_name((enum cw_opt)opt, suffix, sizeof(suffix));
		else
			snprintf(suffix, sizeof(suffix), "%s", cw_opt_env((enum cw_opt)opt));
		if ((size_t)snprintf(name, sizeof(name), "%s%s", prefix, suffix) >= sizeof(name))
			continue;
		arg = getenv_fn(ctx, name, buf, sizeof(buf));
		if (arg == NULL)
			continue;
		if (opt == CW_FT && bare_flag_ok && is_bare_flag(arg)) {
			arg = NULL;	/* Slurm's copy of a bare --clockwork-ft */
		} else if (arg[0] == '\0') {
			continue;	/* an empty variable counts as unset */
		} else if (opt == CW_FT && is_bare_flag(arg)) {
			snprintf(err, errlen, "clockwork: %s: invalid value '%s' (expected %s)", name, arg,
				 cw_opt_expected(opt));
			return -1;
		}
		if (cw_value_parse(opt, arg, value, sizeof(value), why, sizeof(why)) < 0) {
			snprintf(err, errlen, "clockwork: %s: %s", name, why);
			return -1;
		}
		memcpy(opts->value[opt], value, sizeof(value));
		opts->source[opt] = source;
		set_label(opts, opt, "", name);
	}
	return 0;
}

int cw_options_apply_step_env(struct cw_options *opts, cw_getenv_fn getenv_fn, void *ctx, char *err,
			      size_t errlen)
{
	if (cw_options_apply_env(opts, CW_SLURM_OPTION_COPY_PREFIX, CW_SRC_CLI, CW_NAME_OPTION, 1, getenv_fn, ctx, err,
				 errlen) < 0 ||
	    cw_options_apply_env(opts, CW_SLURM_JOB_CONTROL_PREFIX, CW_SRC_ENV, CW_NAME_ENV, 0, getenv_fn, ctx, err,
				 errlen) < 0 ||
	    cw_options_apply_env(opts, "", CW_SRC_ENV, CW_NAME_ENV, 0, getenv_fn, ctx, err, errlen) < 0)
		return -1;
	return 0;
}

int cw_options_check(const struct cw_options *opts, const struct cw_config *cfg, enum cw_opt opt, char *err,
		     size_t errlen)
{
	const char *value = opts->value[opt];

	if (opt != CW_SPARES || opts->source[opt] == CW_SRC_UNSET)
		return 0;
	if (strcmp(value, "borrow") == 0 && !cfg->allow_borrow) {
		snprintf(err, errlen,
			 "clockwork: %s: 'borrow' is not allowed on this cluster "
			 "(plugstack.conf: allow_borrow=no; use none or standby)", opts->label[opt]);
		return -1;
	}
	if (strcmp(value, "none") != 0 && cfg->max_spares == 0) {
		snprintf(err, errlen,
			 "clockwork: %s: '%s' is not allowed on this cluster "
			 "(plugstack.conf: max_spares=0; use none)", opts->label[opt], value);
		return -1;
	}
	return 0;
}

static void set_default(struct cw_options *opts, enum cw_opt opt, const char *value, const char *label)
{
	snprintf(opts->value[opt], sizeof(opts->value[opt]), "%s", value);
	opts->source[opt] = CW_SRC_DEFAULT;
	snprintf(opts->label[opt], sizeof(opts->label[opt]), "%s", label);
}

int cw_options_resolve(struct cw_options *opts, const struct cw_config *cfg, int *enabled, char *err,
		       size_t errlen)
{
	int opt;

	*enabled = 0;
	if (opts->source[CW_FT] == CW_SRC_UNSET) {
		int asked = 0;

		for (opt = 0; opt < CW_NOPTS; opt++)
			asked |= opts->source[opt] == CW_SRC_CLI;
		if (cfg->default_ft[0] != '\0' && strcmp(cfg->default_ft, "off") != 0)
			set_default(opts, CW_FT, cfg->default_ft, "plugstack.conf default_ft");
		else if (asked)
			set_default(opts, CW_FT, "aware", "--clockwork-ft");
		else
			set_default(opts, CW_FT, "off", "--clockwork-ft");
	}
	if (strcmp(opts->value[CW_FT], "off") == 0)
		return 0;

	for (opt = 0; opt < CW_NOPTS; opt++) {
		if (opts->source[opt] == CW_SRC_UNSET) {
			char label[CW_LABEL_MAX];

			snprintf(label, sizeof(label), "--%s", cw_opt_name(opt));
			set_default(opts, opt, opt_info[opt].fallback, label);
		}
		if (cw_options_check(opts, cfg, opt, err, errlen) < 0)
			return -1;
	}
	*enabled = 1;
	return 0;
}
