# ddpkit — every target installs what it needs on first use.
SHELL := /bin/bash
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
DDPKIT := $(VENV)/bin/ddpkit
NODES ?= 2
GPUS ?=
JOB ?= examples/cifar10-resnet18.yaml
OUT ?= out
PYTEST_ARGS ?=

RENDER_FLAGS = -f $(JOB) --nodes $(NODES) $(if $(GPUS),--gpus-per-node $(GPUS))

.PHONY: lint wheelhouse docker-daemon image image-cpu compose-test install render-slurm render-k8s render-ssh render-compose render-all golden test test-full test-times test-fast demo bench bench-launch clean docs docs-serve

# --no-compile: pip would byte-compile all ~14,500 modules of the venv (about
# 55 CPU-s of the install, on one core, before anything else can start);
# Python compiles the ones a run imports (about 4,000 for torch, _dynamo,
# transformers and lightning together) on their first import.
$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install --no-compile -e '.[test]' -c constraints.txt
	touch $@

install: $(VENV)/.installed

render-slurm: install
	$(DDPKIT) render slurm $(RENDER_FLAGS) -o $(OUT)/slurm

render-k8s: install
	$(DDPKIT) render k8s $(RENDER_FLAGS) -o $(OUT)/k8s

render-ssh: install
	$(DDPKIT) render ssh $(RENDER_FLAGS) -o $(OUT)/ssh

render-compose: install
	$(DDPKIT) render compose $(RENDER_FLAGS) -o $(OUT)/compose

render-all: render-slurm render-k8s render-ssh render-compose

# 2 nodes x 2 processes on this machine (gloo, CPU, synthetic data), then every target into $(OUT)/.
# The metrics go into the run folder (launch local's default), where `ddpkit report ddp-job` finds them.
DEMO_ARGS = --model resnet18 --image-size 32 --data synthetic --synthetic-size 256 --eval-size 128 \
	--batch-size 16 --epochs 1 --workers 0 --log-every 1 --progress bar \
	--checkpoint-dir $(OUT)/demo/ckpt --log-dir $(OUT)/demo/logs
demo: install
	rm -rf $(OUT)/demo
	$(DDPKIT) launch local --nodes 2 --nproc-per-node 2 -- $(DEMO_ARGS)
	$(MAKE) render-all

# Regenerate the checked-in examples under slurm/ and k8s/ from examples/.
golden: install
	$(PY) -m tests.golden --write

# The image (docker/Dockerfile): `make image` is the CUDA + NCCL default,
# `make image-cpu` the gloo/CPU variant; both print the tag last.
# `make wheelhouse` downloads every wheel the CPU image needs (torch as in .venv)
# so that OFFLINE=1 builds reach no index. It is done once per set of
# dependencies (the .complete stamp): a second `make compose-test` asks no index.
WHEELHOUSE := docker/wheelhouse/.complete
$(WHEELHOUSE): $(VENV)/.installed pyproject.toml constraints.txt
	$(PY) -m pip download --only-binary=:all: -d docker/wheelhouse hatchling \
	  $$($(PY) -c 'import torch, torchvision; print("torch==" + torch.__version__.partition("+")[0], "torchvision==" + torchvision.__version__.partition("+")[0])') \
	  $$($(PY) -c 'import tomllib; print(" ".join(d for d in tomllib.load(open("pyproject.toml","rb"))["project"]["dependencies"] if not d.startswith("torch")))')
	touch $@

wheelhouse: $(WHEELHOUSE)

# Before anything slow: one line and exit 3 when the Docker daemon does not answer.
docker-daemon:
	@bash docker/daemon-check.sh make

image:
	bash docker/build.sh cuda $(IMAGE)

image-cpu: docker-daemon install $(WHEELHOUSE)
	OFFLINE=1 bash docker/build.sh cpu $(IMAGE)

# Build the CPU image, run the rendered compose file (NODES=2 default) doing a
# gloo DDP `ddpkit train`; exits with node0's code.
compose-test: docker-daemon install $(WHEELHOUSE)
	OFFLINE=1 NODES=$(NODES) OUT=$(OUT) bash docker/compose-test.sh

# ruff (style, imports, bug patterns) over the whole tree; mypy over src/ddpkit
# with every function typed (settings in pyproject.toml).
lint: install
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/mypy

# CI's tier (.ci/run): every capability proven once end to end on real
# processes (every test but those marked `full`), spread over $(TEST_WORKERS)
# pytest-xdist workers: on the 2-core CI machine three keep both cores busy
# (the machine's CPU time is 1.9x the wall time; a fourth worker gained
# nothing, docs/TESTING.md). A module runs on one worker (--dist loadfile: its
# clusters are built once), longest first (tests/conftest.py orders them by
# tests/test_seconds.json; xdist's own reorder by test count is off). Starts
# with this machine's speed; ends with the slowest tests, the time per module
# and the run's wall and CPU time in units of that speed.
# `make lint` runs beside the tests, not before them: mypy's minute of CPU on
# one core would hold the other core idle before the first test. Its output
# comes after pytest's, and either failing fails the target.
LINT_LOG = $(VENV)/lint.log
define beside_lint
@$(MAKE) --no-print-directory lint > $(LINT_LOG) 2>&1 & lint=$$!; \
$(1); tests=$$?; \
wait $$lint; linted=$$?; cat $(LINT_LOG); \
if [ $$linted -ne 0 ]; then echo "make: lint failed (its output above); run make lint to see it alone" >&2; fi; \
[ $$tests -eq 0 ] && [ $$linted -eq 0 ]
endef
TEST_WORKERS ?= 3
XDIST = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: install
	$(call beside_lint,$(PY) -m pytest $(XDIST) -m "not full" --durations=30 $(PYTEST_ARGS))

# Everything: CI's tier and the full matrix (every framework x target x
# fault, the chaos runs, the benches' longer smokes). Run it when changing
# those parts. Its JUnit XML is what `make test-times` reads.
test-full: install
	$(call beside_lint,$(PY) -m pytest $(XDIST) --durations=30 --junitxml=.pytest_cache/junit-full.xml $(PYTEST_ARGS))

# Refresh tests/test_seconds.json (what conftest orders modules by) from
# the last `make test-full` run.
test-times: install
	$(PY) -m tests.timings .pytest_cache/junit-full.xml

# The edit loop: every test that needs neither root nor a cluster nor a
# torch process (markers root and slow), in a few minutes.
test-fast: install
	$(PY) -m pytest $(XDIST) -m "not root and not slow" --durations=15 $(PYTEST_ARGS)

# One spec on every target (local, ssh, launch.sh, Slurm x2, compose, launch
# docker, four Kubernetes kinds emulated), every rank report compared
# (docs/TESTING.md, "The targets matrix"). Needs root (namespaces, sshd, Slurm, dockerd).
.PHONY: test-targets
test-targets: install
	$(PY) -m pytest $(XDIST) tests/test_targets_matrix.py tests/test_targets_matrix_docker.py \
		tests/test_targets_matrix_k8s.py $(PYTEST_ARGS)

# CPU benchmarks (results in bench/results/, see docs/BENCHMARKS.md).
bench: install
	$(PY) -m bench.train_throughput
	$(PY) -m bench.startup
	$(PY) -m bench.teardown_local
	$(PY) -m bench.watchdog
	$(PY) -m bench.rendezvous

# SSH fan-out and teardown vs pdsh, a serial ssh loop and plain torchrun;
# needs root for its network namespaces and sshd hosts (about 5 minutes).
bench-launch: install
	@if [ "$$(id -u)" = 0 ]; then $(PY) -m bench.launch; \
	else echo "bench-launch: needs root (network namespaces and sshd)"; exit 2; fi

# The documentation site from docs/ (mkdocs.yml), strict: a warning, a broken
# link or anchor, or a page missing from the nav fails it. The reference pages
# are generated from the code as it builds.
docs: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict -d site

# The site built, then served on this machine only: browsers run the search's
# web worker for a page served over http, never for one opened from file://.
DOCS_PORT ?= 8000
docs-serve: docs
	@echo "docs-serve: http://127.0.0.1:$(DOCS_PORT)/ (Ctrl-C stops it)"
	$(PY) -m http.server --bind 127.0.0.1 --directory site $(DOCS_PORT)

clean:
	rm -rf $(OUT) .pytest_cache .hypothesis
