# trtc developer commands. Each target works on a fresh clone: it installs what it needs first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Dev and CI pin the CPU build of torch 2.13.0 (users get the range in pyproject.toml).
TORCH_PIN ?= torch==2.13.0
# where profiles/resnet_digits.toml looks for the demo's model and data
DEMO_DIR := build/demo

.PHONY: install test test-all test-tensorrt lint demo engines clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# The fast tier: every test not marked slow (export, calibration, serving, bench, CLI). `make test-all` adds the
# slow tier (real architectures, fuzzing, SIGKILL, benchmark scripts, the ONNX conformance suite); CI runs both.
test: install
	$(PY) -m pytest -q -m "not slow"

test-all: install
	$(PY) -m pytest -q

# The real-TensorRT acceptance suite, on a machine with TensorRT (10.12+ or 11.x) and an NVIDIA GPU:
# `make install`, then `.venv/bin/pip install '.[tensorrt]'`, then this. Elsewhere every test skips with the reason;
# the target fails when none ran, so a CI job on a machine without TensorRT cannot pass it by skipping.
test-tensorrt: install
	$(PY) -m pytest -q -m tensorrt -rs tests/compiler/backends/tensorrt tests/compiler/serve/test_engines_gpu.py \
		--junitxml=build/test-tensorrt.xml
	@$(PY) -c "import sys, xml.etree.ElementTree as E; s = E.parse('build/test-tensorrt.xml').getroot().find('testsuite'); \
		ran = int(s.get('tests')) - int(s.get('skipped')); print(f'test-tensorrt: {ran} real-TensorRT tests ran'); \
		sys.exit(0 if ran else 'test-tensorrt: no test ran: TensorRT and a GPU are needed (see the skip reasons above)')"

# mypy checks the TensorRT modules against the project's own stub, typings/tensorrt.pyi (pyproject's mypy_path)
lint: install
	$(VENV)/bin/ruff check compiler calibration tests examples benchmarks
	$(VENV)/bin/mypy

# The main job: train the example CNN on scikit-learn's digits, then build it end to end.
# Without TensorRT, trtc build exits 4 after writing everything but the engines: the demo goes on.
demo: install
	$(PY) examples/digits.py --out $(DEMO_DIR)
	@$(VENV)/bin/trtc build --profile profiles/resnet_digits.toml; rc=$$?; \
	if [ $$rc -eq 4 ]; then echo "demo: TensorRT is not installed here, so no engines were built;" \
		"the ONNX models, calibration and accuracy report are in $(DEMO_DIR)/engines"; \
	elif [ $$rc -ne 0 ]; then exit $$rc; fi
	$(VENV)/bin/trtc bench $(DEMO_DIR)/engines -n 50 --min-seconds 0.5 --warmup-seconds 0.2

# Rebuild the engines of every profile: the CI job to run on a TensorRT upgrade.
engines: install
	@for p in profiles/*.toml; do echo "== $$p"; $(VENV)/bin/trtc rebuild --profile $$p --if-stale || exit $$?; done

clean:
	rm -rf build .pytest_cache .mypy_cache .ruff_cache
