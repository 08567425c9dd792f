# kubeinfer: `make serve` and `make test` work on a fresh machine (they set up .venv first).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8080
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup serve test test-fast lint bench clean images image-test

$(VENV)/.installed: pyproject.toml scripts/setup.sh scripts/setup-helm.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/setup.sh
	touch $@

setup: $(VENV)/.installed

serve: setup
	$(PY) -m server --host $(HOST) --port $(PORT) $(ARGS)

# The Debian packages some tests need (Prometheus, Chromium, buildah), as CI has them: installed when
# run as root with apt-get, else named with the tests that will skip (SKIP_SYSTEM_DEPS=1: not even that).
# TEST_WORKERS pytest-xdist workers, each file's tests on one worker (--dist loadfile: module-scoped servers
# are built once and a file's tests keep their order; tests/images is one file): many tests wait on
# servers, operators and timeouts rather than compute, so 3 workers on 2 cores finish well before 1 does.
# TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= 3
test: setup
	@[ -n "$(SKIP_SYSTEM_DEPS)" ] || bash scripts/install-test-deps.sh
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check server kernels operator tests benchmarks
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

bench: setup
	$(PY) benchmarks/offline_throughput.py

# Every image from its Dockerfile (buildah, else docker): the CPU server image, the operator, the router.
# IMAGES=operator builds one; KUBEINFER_STANDIN_BASES=1 makes local stand-in bases where no registry
# can be reached (CI). See README "Images".
images:
	bash scripts/images/build.sh $(IMAGES)

# Runs the built images as the operator's pods run them (tests/images, marker `images`).
image-test: setup
	$(PY) -m pytest -q -m images tests/images $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
