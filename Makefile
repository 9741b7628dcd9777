# The two commands of the README:
#   make demo   set up (or reuse) .venv, then data -> train -> recommend on the bundled MovieLens sample
#   make test   set up (or reuse) .venv, then run the test suite in two worker processes (TEST_WORKERS=2)
#               and print its 25 slowest tests
# and, for development:
#   make system-deps  Debian's Derby jars for the tests' metastore service (run by test and test-fast)
#   make test-fast  the same set-up, then the tests not marked slow or cluster: no standalone cluster,
#                   Airflow, Spark Connect backend or MLflow server; about 2 minutes on 2 cores
#
# torch: TORCH is installed before the package. torch==2.13.0 resolves to the CPU build on
# machines whose pip finds one first (a local wheel cache), and to PyPI's CUDA build elsewhere.
# On a machine without a GPU and without such a cache, get the small CPU build with
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
# and on a GPU machine pick the CUDA build matching your driver, e.g.
#   make demo TORCH_INDEX=https://download.pytorch.org/whl/cu126

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
PYTEST_ARGS ?=
# test processes (pytest-xdist): the suite mostly waits on JVMs, subprocesses and services, so two workers on
# two cores take about half the time of one; TEST_WORKERS=1 runs it in one process, in the same order
TEST_WORKERS ?= 2
XDIST = $(if $(filter-out 0 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder,-p no:xdist)

BIN := $(VENV)/bin
STAMP := $(VENV)/.recsys-installed

.PHONY: demo test test-fast venv check-java check-python clean-demo system-deps

demo: check-java $(STAMP)
	$(BIN)/recsys demo

test: check-java system-deps $(STAMP)
	$(BIN)/python -m pytest $(XDIST) --durations=25 $(PYTEST_ARGS)

test-fast: check-java system-deps $(STAMP)
	$(BIN)/python -m pytest $(XDIST) -m "not slow and not cluster" $(PYTEST_ARGS)

venv: $(STAMP)

$(STAMP): pyproject.toml | check-python
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

# The tests' metastore service (a Derby network server on loopback, tests/conftest.py) runs from Debian's
# Derby jars: installed here when missing and this is root with apt-get (CI), else the command is printed.
DERBY_JARS := /usr/share/java/derby.jar /usr/share/java/derbynet.jar /usr/share/java/derbyclient.jar
system-deps:
	@missing=""; for jar in $(DERBY_JARS); do [ -f "$$jar" ] || missing=1; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libderby-java libderbyclient-java >/dev/null; \
	  else \
	    echo "the tests' metastore service needs Derby's network server and client: sudo apt-get install -y libderby-java libderbyclient-java"; \
	    exit 1; \
	  fi; \
	fi

check-python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null || { \
	  echo "recsys needs Python 3.10 or newer as '$(PYTHON)' (override with make PYTHON=python3.11 ...)"; exit 1; }

check-java:
	@java_bin="$${JAVA_HOME:+$$JAVA_HOME/bin/}java"; \
	version=$$("$$java_bin" -version 2>&1 | awk -F'"' '/version/ {print $$2; exit}'); \
	major=$${version%%.*}; \
	if [ "$$major" = "1" ]; then major=$$(echo "$$version" | cut -d. -f2); fi; \
	if [ -z "$$version" ] || [ "$$major" -lt 17 ] 2>/dev/null; then \
	  echo "Spark needs Java 17 or newer; found: $${version:-no java on PATH or in JAVA_HOME}."; \
	  echo "Install it, then rerun:"; \
	  echo "  Debian/Ubuntu:  sudo apt-get install -y openjdk-17-jre-headless"; \
	  echo "  Fedora/RHEL:    sudo dnf install -y java-17-openjdk-headless"; \
	  echo "  macOS:          brew install openjdk@17   (and put it on PATH or set JAVA_HOME)"; \
	  echo "  or set JAVA_HOME to an existing JDK/JRE 17+"; \
	  exit 1; \
	fi

clean-demo:
	rm -rf .recsys
