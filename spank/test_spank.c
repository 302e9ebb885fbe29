/*
 * test_spank.c - unit tests of the SPANK entry points (clockwork_dispatch.c, clockwork_args.c,
 * clockwork_local.c, clockwork_remote.c) against a stand-in for the Slurm side: the spank_* and slurm_*
 * functions the plugin calls are defined here, so every path, failures included, runs without Slurm.
 *
 * What it holds the plugin to, on every release it is built for (make -C spank test, once per OUT):
 *   - every callback returns 0 or a negative value (25.05 reads any non-zero return as an error, older
 *     releases only a negative one, so a positive failure would pass silently there);
 *   - every failure it can meet returns negative where the context allows failing at once;
 *   - in slurmstepd (remote) a failure fails the job and never the node: a failed init returns negative
 *     only where slurm_spank_init_failure_mode (= ESPANK_JOB_FAILURE) exists, and a failed post-option
 *     step is held back and returned by slurm_spank_task_init().
 * The last line printed is "N passed, M failed"; the exit status is non-zero on any failure.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "clockwork_args.h"

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

/* ---- the stand-in for Slurm ---------------------------------------------------------------- */

static spank_context_t ctx;
static spank_err_t register_rc;
static spank_err_t setenv_rc;
static spank_err_t control_setenv_rc;
static struct spank_option *registered[CW_NOPTS];
static int nregistered;
static const char *const *job_env;	/* the step's environment: "NAME=value", NULL-terminated */
static int errors_logged;

spank_context_t spank_context(void)
{
	return ctx;
}

spank_err_t spank_option_register(spank_t sp, struct spank_option *opt)
{
	(void)sp;
	if (register_rc != ESPANK_SUCCESS)
		return register_rc;
	if (nregistered < CW_NOPTS)
		registered[nregistered++] = opt;
	return ESPANK_SUCCESS;
}

spank_err_t spank_getenv(spank_t sp, const char *var, char *buf, int len)
{
	size_t n = strlen(var);
	const char *const *v;

	(void)sp;
	for (v = job_env; v != NULL && *v != NULL; v++) {
		if (strncmp(*v, var, n) == 0 && (*v)[n] == '=') {
			snprintf(buf, (size_t)len, "%s", *v + n + 1);
			return ESPANK_SUCCESS;
		}
	}
	return ESPANK_ENV_NOEXIST;
}

spank_err_t spank_setenv(spank_t sp, const char *var, const char *val, int overwrite)
{
	(void)sp;
	(void)var;
	(void)val;
	(void)overwrite;
	return setenv_rc;
}

spank_err_t spank_job_control_setenv(spank_t sp, const char *var, const char *val, int overwrite)
{
	(void)sp;
	(void)var;
	(void)val;
	(void)overwrite;
	return control_setenv_rc;
}

const char *spank_strerror(spank_err_t err)
{
	(void)err;
	return "stand-in error";
}

void slurm_error(const char *format, ...)
{
	(void)format;
	errors_logged++;
}

void slurm_debug(const char *format, ...)
{
	(void)format;
}

/* ---- helpers ----------------------------------------------------------------------------- */

static char arg_ok[] = "default_ft=off";
static char arg_bad[] = "foo=1";
static char *args_ok[] = { arg_ok };
static char *args_bad[] = { arg_bad };
static const char *const env_none[] = { NULL };
static const char *const env_on[] = { "CLOCKWORK_FT=aware", NULL };
static const char *const env_bad[] = { "CLOCKWORK_FT=aware", "CLOCKWORK_SPARES=maybe", NULL };

static const spank_context_t all_contexts[] = { S_CTX_LOCAL, S_CTX_REMOTE, S_CTX_ALLOCATOR, S_CTX_SLURMD,
						S_CTX_JOB_SCRIPT };
#define NCONTEXTS ((int)(sizeof(all_contexts) / sizeof(all_contexts[0])))

static void reset(spank_context_t c)
{
	ctx = c;
	register_rc = ESPANK_SUCCESS;
	setenv_rc = ESPANK_SUCCESS;
	control_setenv_rc = ESPANK_SUCCESS;
	nregistered = 0;
	job_env = env_none;
	errors_logged = 0;
	unsetenv("CLOCKWORK_FT");
	unsetenv("CLOCKWORK_SPARES");
}

/* Every return must be 0 or negative; record the value for the caller's own checks. */
static int sane(int rc, const char *what, spank_context_t c)
{
	CHECK(rc <= 0, "%s in context %d returned %d: return 0 or a negative value (a positive failure passes "
		       "silently where a release checks for < 0)", what, (int)c, rc);
	return rc;
}

static int call_init(spank_context_t c, char **av)
{
	return sane(slurm_spank_init(NULL, 1, av), "slurm_spank_init", c);
}

static int call_post_opt(spank_context_t c)
{
	return sane(slurm_spank_init_post_opt(NULL, 0, NULL), "slurm_spank_init_post_opt", c);
}

static int call_task_init(spank_context_t c)
{
	return sane(slurm_spank_task_init(NULL, 0, NULL), "slurm_spank_task_init", c);
}

static int call_option(int idx, const char *value, int remote)
{
	struct spank_option *o = registered[idx];

	return sane(o->cb(o->val, value, remote), "an option callback", ctx);
}

/* ---- tests ------------------------------------------------------------------------------- */

static void test_success_everywhere(void)
{
	int i;

	for (i = 0; i < NCONTEXTS; i++) {
		spank_context_t c = all_contexts[i];

		reset(c);
		CHECK(call_init(c, args_ok) == 0, "init must succeed in context %d", (int)c);
		CHECK(call_post_opt(c) == 0, "init_post_opt must succeed in context %d", (int)c);
		CHECK(call_task_init(c) == 0, "task_init must succeed in context %d", (int)c);
		CHECK(errors_logged == 0, "no error may be logged on success (context %d)", (int)c);
	}
}

static void test_bad_plugstack_line(void)
{
	reset(S_CTX_ALLOCATOR);
	CHECK(call_init(S_CTX_ALLOCATOR, args_bad) < 0, "sbatch/salloc: a bad plugstack line must fail init");
	reset(S_CTX_LOCAL);
	CHECK(call_init(S_CTX_LOCAL, args_bad) < 0, "srun: a bad plugstack line must fail init");
	CHECK(errors_logged > 0, "the bad plugstack line must be logged");

	reset(S_CTX_REMOTE);
#if CW_HAVE_INIT_FAILURE_MODE
	CHECK(call_init(S_CTX_REMOTE, args_bad) < 0,
	      "slurmstepd (25.05 on): a failed init returns negative, failing the job (failure mode)");
	CHECK(slurm_spank_init_failure_mode == ESPANK_JOB_FAILURE,
	      "slurm_spank_init_failure_mode must be ESPANK_JOB_FAILURE (%d), is %d", (int)ESPANK_JOB_FAILURE,
	      slurm_spank_init_failure_mode);
#else
	CHECK(call_init(S_CTX_REMOTE, args_bad) == 0,
	      "slurmstepd before 25.05: a failed init must not fail (that drains the node)");
	call_post_opt(S_CTX_REMOTE);
	CHECK(call_task_init(S_CTX_REMOTE) < 0, "slurmstepd before 25.05: task_init reports the held failure");
#endif
}

static void test_register_fails(void)
{
	reset(S_CTX_ALLOCATOR);
	register_rc = ESPANK_BAD_ARG;
	CHECK(call_init(S_CTX_ALLOCATOR, args_ok) < 0, "a failed option registration must fail init");
}

static void test_option_callback(void)
{
	reset(S_CTX_ALLOCATOR);
	call_init(S_CTX_ALLOCATOR, args_ok);
	CHECK(nregistered == CW_NOPTS, "all %d options registered, got %d", CW_NOPTS, nregistered);
	if (nregistered != CW_NOPTS)
		return;
	CHECK(call_option(CW_SPARES, "standby", 0) == 0, "a good --clockwork-spares value is accepted");
	CHECK(call_option(CW_SPARES, "maybe", 0) < 0, "a bad --clockwork-spares value returns negative");
	CHECK(call_option(CW_SNAPSHOT, "often", 1) < 0, "a bad value forwarded to slurmstepd returns negative");
	/* A callback before init (not ready) must fail negative too. */
	reset(S_CTX_ALLOCATOR);
	call_init(S_CTX_ALLOCATOR, args_bad);
	CHECK(call_option(CW_FT, "aware", 0) < 0, "an option callback after a failed init returns negative");
}

static void test_local_setenv_fails(void)
{
	reset(S_CTX_LOCAL);
	setenv("CLOCKWORK_FT", "aware", 1);
	call_init(S_CTX_LOCAL, args_ok);
	control_setenv_rc = ESPANK_BAD_ARG;
	CHECK(call_post_opt(S_CTX_LOCAL) < 0, "srun: a failed spank_job_control_setenv returns negative");
	unsetenv("CLOCKWORK_FT");
}

/* Bad CLOCKWORK_* input in sbatch/srun stops the command with status 1 (an `optional` plugin's failing
 * init_post_opt would be ignored by Slurm); run in a child, since that path exits. */
static void test_local_bad_env_exits(void)
{
	pid_t pid;
	int status = 0;

	reset(S_CTX_ALLOCATOR);
	call_init(S_CTX_ALLOCATOR, args_ok);
	fflush(stdout);
	pid = fork();
	if (pid == 0) {
		setenv("CLOCKWORK_FT", "aware", 1);
		setenv("CLOCKWORK_SPARES", "maybe", 1);
		slurm_spank_init_post_opt(NULL, 0, NULL);
		_exit(0);
	}
	CHECK(pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 1,
	      "sbatch with CLOCKWORK_SPARES=maybe must exit 1 (status %d)", status);
}

static void test_remote_failures_held_for_task_init(void)
{
	reset(S_CTX_REMOTE);
	call_init(S_CTX_REMOTE, args_ok);
	job_env = env_bad;
	CHECK(call_post_opt(S_CTX_REMOTE) == 0,
	      "slurmstepd: bad job input must not fail init_post_opt (Slurm counts it as a failed init: drain)");
	CHECK(errors_logged > 0, "the bad job input must be logged");
	CHECK(call_task_init(S_CTX_REMOTE) < 0, "slurmstepd: task_init must fail the job's tasks");

	reset(S_CTX_REMOTE);
	call_init(S_CTX_REMOTE, args_ok);
	job_env = env_on;
	setenv_rc = ESPANK_BAD_ARG;
	CHECK(call_post_opt(S_CTX_REMOTE) == 0, "slurmstepd: a failed spank_setenv is held back");
	CHECK(call_task_init(S_CTX_REMOTE) < 0, "slurmstepd: ... and fails the job's tasks");

	/* A fresh step starts clean: nothing held over from the last one. */
	reset(S_CTX_REMOTE);
	call_init(S_CTX_REMOTE, args_ok);
	job_env = env_on;
	CHECK(call_post_opt(S_CTX_REMOTE) == 0 && call_task_init(S_CTX_REMOTE) == 0, "a good step passes");
}

int main(void)
{
	printf("built against Slurm headers %d.%02d.%d\n", SLURM_VERSION_MAJOR(SLURM_VERSION_NUMBER),
	       SLURM_VERSION_MINOR(SLURM_VERSION_NUMBER), SLURM_VERSION_MICRO(SLURM_VERSION_NUMBER));
	test_success_everywhere();
	test_bad_plugstack_line();
	test_register_fails();
	test_option_callback();
	test_local_setenv_fails();
	test_local_bad_env_exits();
	test_remote_failures_held_for_task_init();
	printf("%d passed, %d failed\n", passed, failed);
	return failed == 0 ? 0 : 1;
}
