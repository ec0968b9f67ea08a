# The two commands of the README. Both set everything up first (a .venv with Python 3.12 and the pinned
# development versions, e.g. jax 0.11.2); rerunning them skips what is already installed.
#
#   make test     install, then run the test suite (what CI runs: .ci/run)
#   make serve    install, then serve the bundled demo model on http://127.0.0.1:8000
#
# Others: make test-slow (the slow tests too), make bench-cpu, make clean.

PYTHON ?= $(shell command -v python3.12 2>/dev/null || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed
PY := $(VENV)/bin/python

.PHONY: test test-slow serve bench-cpu clean browser prometheus

$(STAMP): pyproject.toml requirements-dev.txt
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 12), f"jaxserve needs Python >= 3.12 (JAX >= 0.11 does); $(PYTHON) is {sys.version.split()[0]}. Set PYTHON=/path/to/python3.12"'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c requirements-dev.txt -e '.[test,train]'
	touch $(STAMP)

test: $(STAMP) browser prometheus
	$(PY) -m pytest -q -m "not slow"

# The dashboard's browser test (tests/test_dashboard.py) drives Debian's Chromium with Playwright: installed here
# when missing (as root, as CI runs, or with passwordless sudo); a no-op when both are there. If the install fails
# the test fails, saying why. JAXSERVE_SKIP_BROWSER=1 skips the install and the test.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo -n)
browser: $(STAMP)
ifneq ($(JAXSERVE_SKIP_BROWSER),1)
	@command -v chromium >/dev/null 2>&1 || { echo "installing Debian's chromium for the dashboard browser test"; \
		$(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium \
		>/dev/null; } || echo "could not install chromium: tests/test_dashboard.py will fail (see above)"
	@$(PY) -c 'import playwright' 2>/dev/null || $(PY) -m pip install --quiet -c requirements-dev.txt playwright
endif

# The Grafana dashboard's test (tests/test_grafana_dashboard.py) evaluates its queries in Debian's Prometheus:
# installed here when missing, like chromium; JAXSERVE_SKIP_PROMETHEUS=1 skips the install (the test then skips).
prometheus:
ifneq ($(JAXSERVE_SKIP_PROMETHEUS),1)
	@command -v prometheus >/dev/null 2>&1 || { echo "installing Debian's prometheus for the dashboard query test"; \
		$(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus \
		>/dev/null; } || echo "could not install prometheus: tests/test_grafana_dashboard.py will skip"
endif

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

serve: $(STAMP)
	$(VENV)/bin/jaxserve serve

bench-cpu: $(STAMP)
	$(PY) bench/offline_throughput.py --preset small --batch-sizes 1 16 64

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
