# Two commands for a fresh machine (as root): `make demo` and `make test`. Both start with `make venv`.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed
# Debian packages the sandbox cluster and the SPANK build need (chromium: the test that renders the audit's HTML report;
# gcc, python3-dev and libsodium-dev: Fleet Lens's C extension, which `pip install -e` compiles; systemd: the check of
# etc/systemd/clockworkd.service with systemd-analyze; mmdebstrap: the Slurm roots of `make slurm-24.11` and
# `make slurm-26.05`; lintian: the check of the Debian packages of `make deb`).
APT_PACKAGES := slurm-wlm slurmd slurmctld slurmdbd slurm-client munge libslurm-dev \
	slurm-wlm-basic-plugins-dev mariadb-server iproute2 nftables util-linux procps iputils-ping \
	chromium gcc python3-dev libsodium-dev systemd mmdebstrap lintian

.PHONY: help venv system-packages demo test lint typecheck clean sandbox-down spank slurm-24.11 slurm-26.05 deb

help:
	@echo "make demo   - set up (if needed), then run the demo on the embedded sandbox cluster"
	@echo "make test   - set up (if needed), then run the whole test suite (root runs the integration tests)"
	@echo "make venv   - the idempotent set-up both use: system packages + .venv"

venv: system-packages $(STAMP) spank

# The SPANK plugin (spank/clockwork.so); the sandbox's plugstack.conf loads it once it exists.
spank: system-packages
	$(MAKE) -C spank

# Slurm 24.11 (Debian 13) and 26.05 (Debian sid) beside the host's 22.05, for `clockwork sandbox up --slurm
# VERSION` and their tests: a root built once under /var/cache/clockwork (root and a Debian mirror; `sandbox
# prepare` does nothing when it is there), and the SPANK plugin built and unit-tested against that root's headers
# (spank/slurm-VERSION/clockwork.so).
slurm-24.11 slurm-26.05: slurm-%: venv
	$(VENV)/bin/clockwork sandbox prepare --slurm $*
	$(MAKE) -C spank test SLURM_HEADERS=/var/cache/clockwork/slurm-$*/root/usr/include/slurm OUT=slurm-$*

# Debian packages (packaging/deb/build.sh): clockwork-slurm (the venv under /opt/clockwork, the programs, the
# systemd unit, /etc/clockwork/clockwork.toml) and clockwork-slurm-spank (clockwork.so for the installed Slurm's
# release and its plugstack.conf.d snippet), into build/deb/.
deb: system-packages
	bash packaging/deb/build.sh build/deb

system-packages:
	@missing=$$(for p in $(APT_PACKAGES); do \
		dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" != 0 ]; then echo "make venv: installing $$missing needs root"; exit 1; fi; \
		echo "make venv: installing system packages:" $$missing; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

# torch is pinned to the CPU build that lies on local disk; it is installed first so that the
# project's `torch>=2.4` range is already satisfied and nothing newer (or CUDA) is pulled.
# setup.py and the C sources too: `pip install -e` compiles Fleet Lens's extension (clockworkd.lens._probeio) and
# LinkPass's (linkpass._hbfast) in place.
$(STAMP): pyproject.toml setup.py $(wildcard daemon/clockworkd/lens/csrc/*.[ch]) $(wildcard linkpass/csrc/*.[ch])
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check torch==2.13.0
	$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[node,torch,dev,frameworks]'
	@$(VENV)/bin/python -c 'import torch; assert torch.__version__.startswith("2.13.0"), torch.__version__'
	@touch $@

demo: venv
	$(VENV)/bin/clockwork demo

lint: venv
	$(VENV)/bin/ruff check .

# The suite runs on TEST_WORKERS pytest-xdist workers, a module at a time each (--dist loadfile): a module's
# tests share its worker's sandbox in the shape they ask for, and every worker has a sandbox of its own (its own
# namespaces, subnet and ports: tests/integration/conftest.py). Two by default: on a 2-core machine most
# integration tests wait on jobs, so two workers take ~15 min of pytest where one takes ~25. TEST_WORKERS=1 make
# test runs one. --no-loadscope-reorder: modules go out in collection order
# (integration, the long ones, first: tests/conftest.py), not by their number of tests.
TEST_WORKERS ?= 2

test: lint typecheck slurm-24.11 slurm-26.05
	$(VENV)/bin/python -m pytest tests -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

typecheck: venv
	$(VENV)/bin/mypy

sandbox-down: venv
	$(VENV)/bin/clockwork sandbox down

clean:
	$(MAKE) -C spank clean
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache daemon/clockworkd/lens/*.so linkpass/*.so
