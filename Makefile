# The two entry points of the README: `make train` and `make test`. Both set up .venv first.
PY := .venv/bin/python

.PHONY: setup train test test-fast test-all
setup:
	@bash scripts/setup_env.sh

train: setup
	$(PY) scripts/train.py $(ARGS)

# Tests run on CPU with 8 fake devices (GPU-marked tests skip themselves there). Whole modules go to one worker
# (--dist loadscope), so a module's shared fixtures (its trained runs) are built once, not once per worker.
# `make test-fast` runs every test not marked slow; `make test-all` adds the slow ones (training runs, sharded
# programs, scripts: most of the suite's compile time). `make test` (the README's command, CI) is the fast tier
# while the whole suite takes longer than its ~12-minute budget on 2 cores.
test: test-fast

test-fast: setup
	JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=8 $(PY) -m pytest -n 2 --dist loadscope -m "not slow" $(ARGS)

test-all: setup
	JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=8 $(PY) -m pytest -n 2 --dist loadscope $(ARGS)
