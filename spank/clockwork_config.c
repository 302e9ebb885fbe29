/*
 * clockwork_config.c - the admin's arguments on the plugstack.conf line. See clockwork_config.h.
 * No Slurm dependency.
 */
#include <stdio.h>
#include <string.h>

#include "clockwork_config.h"
#include "clockwork_options.h"

#define KNOWN "default_ft, allow_borrow, max_spares, config"

enum cw_key { KEY_DEFAULT_FT, KEY_ALLOW_BORROW, KEY_MAX_SPARES, KEY_CONFIG, KEY_COUNT };

static const char *const key_names[KEY_COUNT] = {
	[KEY_DEFAULT_FT] = "default_ft",
	[KEY_ALLOW_BORROW] = "allow_borrow",
	[KEY_MAX_SPARES] = "max_spares",
	[KEY_CONFIG] = "config",
};

void cw_config_init(struct cw_config *cfg)
{
	memset(cfg, 0, sizeof(*cfg));
	cfg->allow_borrow = 1;
	cfg->max_spares = CW_MAX_SPARES_DEFAULT;
}

static int bad_value(char *err, size_t errlen, const char *key, const char *value, const char *expected)
{
	snprintf(err, errlen, "clockwork: plugstack.conf: %s: invalid value '%s' (expected %s)", key, value, expected);
	return -1;
}

static int parse_int(const char *text, int lo, int hi, int *out)
{
	long value = 0;
	const char *p = text;

	if (*p == '\0')
		return -1;
	for (; *p != '\0'; p++) {
		if (*p < '0' || *p > '9')
			return -1;
		value = value * 10 + (*p - '0');
		if (value > hi)
			return -1;
	}
	if (value < lo)
		return -1;
	*out = (int)value;
	return 0;
}

int cw_config_parse(struct cw_config *cfg, int ac, char **av, char *err, size_t errlen)
{
	struct cw_config out = *cfg;
	int seen[KEY_COUNT] = { 0 };
	int i;

	for (i = 0; i < ac; i++) {
		const char *arg = av[i];
		const char *eq = strchr(arg, '=');
		const char *value;
		size_t keylen;
		int key;
		char why[CW_ERR_MAX];

		if (eq == NULL) {
			snprintf(err, errlen, "clockwork: plugstack.conf: unknown argument '%s' (known: " KNOWN ")",
				 arg);
			return -1;
		}
		keylen = (size_t)(eq - arg);
		value = eq + 1;
		for (key = 0; key < KEY_COUNT; key++)
			if (strlen(key_names[key]) == keylen && strncmp(arg, key_names[key], keylen) == 0)
				break;
		if (key == KEY_COUNT) {
			snprintf(err, errlen, "clockwork: plugstack.conf: unknown argument '%s' (known: " KNOWN ")",
				 arg);
			return -1;
		}
		if (seen[key]++) {
			snprintf(err, errlen, "clockwork: plugstack.conf: argument '%s' given more than once",
				 key_names[key]);
			return -1;
		}
		switch (key) {
		case KEY_DEFAULT_FT:
			/* A bare-flag form is meaningless here: the admin must name the mode. */
			if (value[0] == '\0' || strcmp(value, "(null)") == 0 ||
			    cw_value_parse(CW_FT, value, out.default_ft, sizeof(out.default_ft), why, sizeof(why)) < 0)
				return bad_value(err, errlen, "default_ft", value, cw_opt_expected(CW_FT));
			break;
		case KEY_ALLOW_BORROW:
			if (strcmp(value, "yes") == 0)
				out.allow_borrow = 1;
			else if (strcmp(value, "no") == 0)
				out.allow_borrow = 0;
			else
				return bad_value(err, errlen, "allow_borrow", value, "yes, no");
			break;
		case KEY_MAX_SPARES:
			if (parse_int(value, 0, CW_MAX_SPARES_LIMIT, &out.max_spares) < 0)
				return bad_value(err, errlen, "max_spares", value, "an integer from 0 to 1024");
			break;
		case KEY_CONFIG:
			if (value[0] != '/' || strlen(value) >= sizeof(out.config_path))
				return bad_value(err, errlen, "config", value, "an absolute path");
			memcpy(out.config_path, value, strlen(value) + 1);
			break;
		}
	}
	*cfg = out;
	return 0;
}
