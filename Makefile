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

.PHONY: install render-slurm render-k8s render-ssh render-compose render-all golden test demo bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[test]'
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

# Regenerate the checked-in examples under slurm/ and k8s/ from examples/.
golden: install
	$(PY) -m tests.golden --write

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(OUT) .pytest_cache .hypothesis
