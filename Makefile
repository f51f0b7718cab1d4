# The two entry points of the README: `make train` and `make test`. Both set up .venv first.
PY := .venv/bin/python

.PHONY: setup train test
setup:
	@bash scripts/setup_env.sh

train: setup
	$(PY) scripts/train.py $(ARGS)

# Tests run on CPU with 8 fake devices (GPU-marked tests skip themselves there).
test: setup
	JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=8 $(PY) -m pytest -n 2 $(ARGS)
