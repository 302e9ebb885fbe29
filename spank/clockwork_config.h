/*
 * clockwork_config.h - the admin's arguments on the plugstack.conf line.
 *
 *   optional /path/clockwork.so default_ft=off allow_borrow=yes max_spares=4 config=/etc/clockwork/clockwork.toml
 *
 * Pure C (no Slurm dependency) so that it can be unit-tested (test_options.c).
 */
#ifndef CLOCKWORK_CONFIG_H
#define CLOCKWORK_CONFIG_H

#include <stddef.h>

#define CW_VALUE_MAX 32
#define CW_PATH_MAX 4096
#define CW_MAX_SPARES_LIMIT 1024
#define CW_MAX_SPARES_DEFAULT 4

struct cw_config {
	/* default_ft=aware|transparent|off: the mode of a job that asks for nothing; "" when absent. */
	char default_ft[CW_VALUE_MAX];
	/* allow_borrow=yes|no (default yes): may jobs ask for --clockwork-spares=borrow? */
	int allow_borrow;
	/* max_spares=N, 0..1024 (default 4); 0 turns spare nodes off (only --clockwork-spares=none). */
	int max_spares;
	/* config=PATH: absolute path of clockwork.toml; "" when absent. */
	char config_path[CW_PATH_MAX];
};

/* The defaults: no default_ft, allow_borrow=yes, max_spares=4, no config. */
void cw_config_init(struct cw_config *cfg);

/*
 * Parse the plugstack arguments (key=value each). Returns 0, or -1 with a full message in err, e.g.
 *   clockwork: plugstack.conf: unknown argument 'foo=1' (known: default_ft, allow_borrow, max_spares, config)
 * cfg is left unchanged on error.
 */
int cw_config_parse(struct cw_config *cfg, int ac, char **av, char *err, size_t errlen);

#endif /* CLOCKWORK_CONFIG_H */
