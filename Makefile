# megamoe: two commands on a fresh machine -- `make setup`, then `make test`.
PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: setup lint test test-fast fuzz test-gpu notebooks figures lab bench clean

setup:  ## create .venv and install megamoe (editable) with test + notebook extras
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
ifeq ($(HAS_GPU),1)
	$(VPY) -m pip install -q -e '.[test,notebook,gpu]'
else
	@echo "no GPU found: installing the CPU build of torch 2.13.0 and Triton 3.6.0 (kernels run under TRITON_INTERPRET=1)"
	$(VPY) -m pip install -q torch==2.13.0 triton==3.6.0
	$(VPY) -m pip install -q -e '.[test,notebook]'
endif
	$(VPY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	$(VPY) -c "import megamoe, megamoe.kernels; print('megamoe', megamoe.__version__, 'ready:', megamoe.describe_environment())"

lint:  ## ruff (config in pyproject.toml)
	$(VPY) -m ruff check megamoe kernels tests

# pytest-xdist workers for `make test` (tests/conftest.py says which tests share one worker and why). The tests
# marked `alone` must not have another test beside them: bounds on elapsed times (a barrier timeout must fire
# within ~1 timeout; with another worker's ranks on the same cores one overran, 4.08 s for < 4.0 s), or a sweep of
# every megamoe shm file (`sweep_stale_shm(min_age_s=0)` removed a file of another worker's rank that had just
# exited). They run afterwards, alone.
TEST_WORKERS ?= 2
test:  ## the CPU test suite (Triton interpreter, CPU ranks), notebooks included: ~17.5 min on 2 cores (f6140e0; `.ci/run` ~19 min with setup)
	$(VPY) -m pytest tests --ignore=tests/gpu -q -n $(TEST_WORKERS) --dist loadgroup -m "not alone"
	$(VPY) -m pytest tests --ignore=tests/gpu -q -m alone

test-fast:  ## the CPU suite without the tests marked slow (> ~5 s each; notebooks, multi-rank, fuzz), ~5 min on 2 cores
	$(VPY) -m pytest tests --ignore=tests/gpu -q -m "not slow"

FUZZ_COUNT    ?= 200
FUZZ_SEED     ?= 1
FUZZ_MAX_COST ?= 400
fuzz:  ## FUZZ_COUNT random layer configurations (seed FUZZ_SEED) vs the reference, bit for bit (CPU, ~10 min)
	MEGAMOE_FUZZ_COUNT=$(FUZZ_COUNT) MEGAMOE_FUZZ_SEED=$(FUZZ_SEED) MEGAMOE_FUZZ_MAX_COST=$(FUZZ_MAX_COST) \
		$(VPY) -m pytest tests/test_fuzz.py -q -k local

test-gpu:  ## the GPU suite: kernels at real sizes, notebooks with world_size = number of GPUs
	$(VPY) -m pytest tests/gpu -q

notebooks:  ## re-execute every notebook in place (outputs kept); CPU ranks when there is no GPU
	$(VPY) -m megamoe.notebooks run

figures:  ## regenerate figures/ (PNG + SVG): executes the notebooks into a temp dir (they are the figures' source)
	$(VPY) -m megamoe.notebooks figures

bench:  ## GPU benchmarks -> results/*.json
	$(VPY) -m megamoe.bench

lab:  ## open JupyterLab on the notebooks
	$(VENV)/bin/jupyter lab notebooks/

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
