# `make demo` and `make test` set everything up and run: fastai v1 in .venv, fastai v2 in .venv2 (fastai v1 and v2
# are one distribution name, so each has its own virtualenv).
PYTHON ?= python3
VENV   ?= .venv
VENV2  ?= .venv2
PY      = $(VENV)/bin/python
PY2     = $(VENV2)/bin/python

.PHONY: demo test gpu-check benchmark memory recompute fastai-ddp-suite matrix dist

# DDP on 2 CPU processes (gloo) on a machine without GPUs, else one process per GPU; then the same
# script as one plain process, so the two accuracies print one under the other: fastai v1, then fastai v2
DDP = $$($(PY) -c "import torch; print('--gpus all' if torch.cuda.is_available() else '--nproc 2')")
demo: $(VENV)/.installed $(VENV2)/.installed
	$(PY) -m ddipp.launch $(DDP) examples/scripts/train_digits.py
	$(PY) examples/scripts/train_digits.py
	$(PY2) -m ddipp.launch $(DDP) examples/scripts/train_digits_v2.py
	$(PY2) examples/scripts/train_digits_v2.py

# fastai 1.0.61's own test suite with ddipp (tools/fastai_suite.py) while .venv2 installs (its output shown after),
# ddipp's fastai v1 tests, then its fastai v2 and core tests in .venv2 (core uses no fastai: once is enough); all
# run, any failure fails the target.
# (The two installs do not run at once: each editable install rewrites ddipp.egg-info in this folder.)
test: $(VENV)/.installed
	mkdir -p tmp; $(MAKE) -s $(VENV2)/.installed >tmp/venv2-install.log 2>&1 & v2=$$!; \
		$(PY) tools/fastai_suite.py; s1=$$?; wait $$v2; i2=$$?; cat tmp/venv2-install.log; [ $$i2 -eq 0 ] || exit $$i2; \
		$(PY) -m pytest tests --ignore=tests/fastai2 --ignore=tests/core; s2=$$?; \
		$(PY2) -m pytest tests/fastai2 tests/core; s3=$$?; [ $$s1 -eq 0 ] && [ $$s2 -eq 0 ] && exit $$s3

$(VENV)/.installed: pyproject.toml constraints/fastai1.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade 'pip>=23'
	$(PY) -m pip install --quiet -c constraints/fastai1.txt -e '.[fastai1,test]'
	touch $@

# .venv2 hard-links the distributions .venv holds at its pins (tools/link_venv.py: torch and its CUDA libraries, 6 GB,
# stored once), so .venv comes first
$(VENV2)/.installed: pyproject.toml constraints/fastai2.txt | $(VENV)/.installed
	$(PYTHON) -m venv $(VENV2)
	$(PYTHON) tools/link_venv.py $(VENV) $(VENV2) constraints/fastai2.txt
	$(PY2) -m pip install --quiet --upgrade 'pip>=23'
	$(PY2) -m pip install --quiet -c constraints/fastai2.txt -e '.[fastai2,test]'
	touch $@

# the GPU paths on a host with one GPU (cuda:0 only): one PASS/FAIL/SKIP line per check, SKIP without CUDA; fails if
# a check failed. Not part of `make test`
gpu-check: $(VENV)/.installed $(VENV2)/.installed
	$(PY) tools/gpu_check.py --python1 $(PY) --python2 $(PY2)

# the same training under a torch DDP loop (torchrun), fastai v1's and v2's own DDP (v2's needs accelerate) and ddipp
# launched and in notebook mode on fastai v1 and v2, 1 and 2 processes: writes benchmarks/README.md and
# benchmarks/throughput.png. Not part of `make test`
benchmark: $(VENV)/.installed $(VENV2)/.installed
	$(PY2) -m pip install --quiet accelerate
	$(PY) benchmarks/throughput.py

# each rank's bytes of parameters, gradients and optimizer state, peak RSS and samples/s, to_ddp() and shard=True on 1-3
# CPU processes, and the widths a per-rank budget trains: benchmarks/README.md's Memory section. Not part of `make test`
memory: $(VENV2)/.installed
	$(PY2) benchmarks/memory.py

# the bytes a convnet's training step saves for backward and its seconds, with and without ddipp.Recompute, at 3 batch
# sizes in one process and on 2 launched CPU ranks, and Recompute's exactness: benchmarks/README.md's Recompute section
# (about 3 minutes). Not part of `make test`
recompute: $(VENV2)/.installed
	$(PY2) benchmarks/recompute.py

# fastai 1.0.61's training tests under 2-rank DDP, every Learner .to_ddp()-ed, one `python -m ddipp.launch --nproc 2`
# per test (tools/fastai_ddp_suite.py): prints a table of the tests, each passed only when both ranks passed it; fails
# if a test failed. About 8 minutes on 2 cores, so not part of `make test`
fastai-ddp-suite: $(VENV)/.installed
	$(PY) tools/fastai_suite.py --ddp

# the oldest and the newest stack pyproject.toml declares (tools/matrix.py: four virtualenvs in .matrix/, 6 GB each
# with torch's CUDA wheels, about 2 minutes each to install here, reused after), each running the fastai v2 suite, and
# a fastai v1 subset with the core and launcher tests; writes the table into README.md, fails if a test failed.
# Not in CI
matrix:
	$(PYTHON) tools/matrix.py

# the sdist and the wheel users would install, built by PyPA's build into dist/ and checked by twine (both tools live
# in .venv-dist). Not in CI
dist:
	$(PYTHON) -m venv .venv-dist
	.venv-dist/bin/pip install --quiet build twine
	rm -rf dist; .venv-dist/bin/python -m build --outdir dist .
	.venv-dist/bin/twine check --strict dist/*
