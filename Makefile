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

test: $(STAMP)
	MPLCONFIGDIR=$${MPLCONFIGDIR:-/tmp/plexus-mpl} $(PY) -m pytest -q -p no:cacheprovider --durations=25 tests

bench: $(STAMP)
	$(PY) benchmarks/ddp_throughput.py

clean:
	rm -rf $(VENV) runs
