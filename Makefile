PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP_FLAGS := -q --disable-pip-version-check -c constraints.txt
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstall when the package metadata or the pins change.
$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PY) -m pip install $(PIP_FLAGS) -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	MPLCONFIGDIR=$${MPLCONFIGDIR:-/tmp/plexus-mpl} $(VENV)/bin/plexus train --strategy allreduce --algorithm ring --workers 4 \
		--dataset digits --model mlp --steps 300 --out runs/demo --overwrite

# Three stages, which always all run: the tests marked `parallel` (training jobs whose
# processes mostly wait on each other, with no timing assertion: three at a time take about
# 0.6 of the time); the unit tests (not `slow`: short, no timing assertion), two at a
# time, one per core; then the `slow` rest one at a time, since many of them time what
# they measure. On a clean clone on 2026-11-27 the stages took 361, 67 and 481 s (15.2
# minutes, with the reference op of `plexus bench`'s `machine:` line at 0.86 ms). Most
# `plexus` commands the tests run are forked from a helper that has imported torch
# (tests/warm_cli.py): those run to their end, the jobs a test signals or joins while they
# run (warm_cli.popen), and the processes of jobs across namespaced hosts (a helper on each
# host, tests/netns.py).
PYTEST := MPLCONFIGDIR=$${MPLCONFIGDIR:-/tmp/plexus-mpl} $(PY) -m pytest -q -p no:cacheprovider --durations=25

test: $(STAMP)
	$(PYTEST) -n 3 -m parallel tests; first=$$?; \
	$(PYTEST) -n 2 -m "not parallel and not slow" tests; second=$$?; \
	$(PYTEST) -p no:xdist -m "not parallel and slow" tests; third=$$?; \
	test $$first -eq 0 -a $$second -eq 0 -a $$third -eq 0

bench: $(STAMP)
	$(PY) benchmarks/ddp_throughput.py

clean:
	rm -rf $(VENV) runs
