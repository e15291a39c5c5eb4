# `make demo` and `make test` set everything up in a local virtualenv (.venv) and run.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python

.PHONY: demo test

# DDP on 2 CPU processes (gloo) on a machine without GPUs, else one process per GPU; then the same
# script as one plain process, so the two accuracies print one under the other
demo: $(VENV)/.installed
	$(PY) -m ddipp.launch $$($(PY) -c "import torch; print('--gpus all' if torch.cuda.is_available() else '--nproc 2')") \
		examples/scripts/train_digits.py
	$(PY) examples/scripts/train_digits.py

# fastai 1.0.61's own test suite with ddipp (tools/fastai_suite.py), then ddipp's; both run, either fails the target
test: $(VENV)/.installed
	$(PY) tools/fastai_suite.py; status=$$?; $(PY) -m pytest tests && exit $$status

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade 'pip>=23'
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@
