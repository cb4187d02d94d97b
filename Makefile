# opsmith build. Two commands matter (README): `make demo`, `make test`.
# Each sets itself up: when python3 cannot import torch, a virtual
# environment (.venv) is made and requirements-dev.txt installed into it;
# where torch is already importable (a machine with its own torch and no
# network), that interpreter is used as it is.
# The C library (kernels, no Python) builds with gcc and nvcc alone; the two
# PyTorch extensions build through setup.py (torch.utils.cpp_extension).

SHELL := /bin/bash
.DEFAULT_GOAL := build

SYSTEM_TORCH := $(shell python3 -c 'import torch' >/dev/null 2>&1 && echo yes)
ifeq ($(SYSTEM_TORCH),yes)
PYTHON := python3
PY_ENV :=
else
PYTHON := .venv/bin/python
PY_ENV := .venv/.installed
endif

# CUDA is built when nvcc is found (on PATH or in /usr/local/cuda).
NVCC ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
WITH_CUDA := $(if $(NVCC),1,0)

CC := gcc
# hidden by default: only what include/ marks OPSMITH_API is exported
CFLAGS := -std=c11 -O3 -fPIC -fopenmp -fvisibility=hidden -Wall -Wextra -Werror=implicit-function-declaration \
          -Iinclude -Icsrc
# sm_80 (A100) and sm_90 (H100/H200) machine code, plus sm_90 PTX for newer GPUs
CUDA_ARCH := -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
             -gencode arch=compute_90,code=compute_90
NVCCFLAGS := -O3 -std=c++17 --threads 0 -Xcompiler -fPIC -Xcompiler -fvisibility=hidden -Xcompiler -Wall $(CUDA_ARCH) \
             -Iinclude -Icsrc \
             --expt-relaxed-constexpr

# every op's files are found here: csrc/{reference,cpu,internal,no_cuda}/<op>.c, csrc/cuda/<op>.cu
C_SRCS := csrc/core.c $(wildcard csrc/cpu/*.c) $(wildcard csrc/reference/*.c) $(wildcard csrc/internal/*.c)
CU_SRCS := $(wildcard csrc/cuda/*.cu)
NO_CUDA_SRCS := $(wildcard csrc/no_cuda/*.c)
HEADERS := include/opsmith.h $(wildcard include/opsmith/*.h) $(wildcard csrc/*.h) $(wildcard csrc/internal/*.h) \
           $(wildcard csrc/cuda/*.cuh)
ifeq ($(WITH_CUDA),1)
OBJS := $(C_SRCS:%.c=build/%.o) $(CU_SRCS:%.cu=build/%.o)
# cuBLASLt: fused_linear_cross_entropy's matrix products
CUDA_LINK := -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart -lcublasLt
CUDA_TEST_FLAGS := -DOPSMITH_WITH_CUDA=1 -I$(CUDA_HOME)/include
else
OBJS := $(C_SRCS:%.c=build/%.o) $(NO_CUDA_SRCS:%.c=build/%.o)
endif
LIB := build/libopsmith.a
SO := build/libopsmith.so
# switching between a CUDA and a CPU-only build (NVCC=) rebuilds every object
CONFIG := build/config-cuda$(WITH_CUDA)
$(CONFIG):
	@mkdir -p build && rm -f build/config-cuda* && touch $@

.PHONY: build lib so ext kernel-bench ctest ctest-sanitize pack-test example check-exports install-check cmake-example pytest new-op-check hf-compat test demo bench clean env

build: ext
	@touch build/READY

lib: $(LIB)

# each object depends on the headers it includes (-MMD writes them to its .d
# file, read below), so editing an op's sources or its csrc/internal/<op>.h
# recompiles that op's objects alone (and an op's built on it); but
# include/opsmith.h includes every op's public header and nearly every object
# includes it, so editing any include/opsmith/<op>.h, even a comment,
# recompiles them all, with the C tests and the extensions' bridges
DEPFLAGS = -MMD -MP -MF $(@:.o=.d)
build/%.o: %.c build/%.d $(CONFIG)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(DEPFLAGS) -c $< -o $@

build/%.o: %.cu build/%.d $(CONFIG)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) $(DEPFLAGS) -c $< -o $@

$(LIB): $(OBJS)
	@rm -f $@
	ar rcs $@ $^

# the same objects as a shared library, for C programs (examples/c); linked
# by g++: the CUDA objects need the C++ runtime
so: $(SO)
$(SO): $(OBJS)
	g++ -shared $^ -fopenmp $(CUDA_LINK) -o $@

# only the public ABI leaves the shared library: opsmith_* symbols, none of
# them opsmith_internal_*
check-exports: $(SO)
	@bad=$$(nm -D --defined-only $(SO) | awk '$$2 ~ /^[TDBRVW]$$/ {print $$3}' | grep -Ev '^opsmith_' ; \
	        nm -D --defined-only $(SO) | awk '{print $$3}' | grep '^opsmith_internal_'); \
	if [ -n "$$bad" ]; then echo "exported but not public ABI:"; echo "$$bad"; exit 1; fi; \
	echo "check-exports: $$(nm -D --defined-only $(SO) | grep -c ' opsmith_') opsmith_* symbols exported, nothing else"

# examples/c: a plain C program over the public header and the shared library
EXAMPLE_CUDA := $(if $(filter 1,$(WITH_CUDA)),-DOPSMITH_EXAMPLE_CUDA -I$(CUDA_HOME)/include)
build/rms_norm_example: examples/c/rms_norm_example.c $(SO) include/opsmith.h $(wildcard include/opsmith/*.h)
	$(CC) -std=c11 -O2 -Wall -Wextra -Iinclude $(EXAMPLE_CUDA) $< -Lbuild -lopsmith -Wl,-rpath,'$$ORIGIN' -lm \
	    $(CUDA_LINK) -o $@

example: build/rms_norm_example
	./build/rms_norm_example

# --- C tests: the kernels against the scalar reference, no Python ---------
TEST_SRCS := $(wildcard tests/c/*.c)
TEST_OBJS := $(TEST_SRCS:%.c=build/%.o)
build/tests/c/%.o: tests/c/%.c build/tests/c/%.d $(CONFIG)
	@mkdir -p $(dir $@)
	$(CC) -std=c11 -O2 -Wall -Wextra -Iinclude -Icsrc $(CUDA_TEST_FLAGS) $(DEPFLAGS) -c $< -o $@

# linked by g++: the CUDA objects need the C++ runtime
build/test_c: $(TEST_OBJS) $(LIB)
	g++ $(TEST_OBJS) $(LIB) -fopenmp -lm $(CUDA_LINK) -o $@

# an object without its .d file (built before dependency files existed) is
# rebuilt once to get one
DEPFILES := $(OBJS:.o=.d) $(TEST_OBJS:.o=.d)
$(DEPFILES):
include $(wildcard $(DEPFILES))

ctest: build/test_c
	OMP_NUM_THREADS=2 ./build/test_c

# the launchers timed without PyTorch (bench/kernel_bench.c), for kernel work
kernel-bench: build/kernel_bench
build/kernel_bench: bench/kernel_bench.c $(LIB)
	$(CC) -std=c11 -O2 -Wall -Wextra -Iinclude $(CUDA_TEST_FLAGS) $< $(LIB) -fopenmp -lm -lstdc++ $(CUDA_LINK) -o $@

# CUDA helpers checked on the host (tests/cuda_host): nvcc compiles the
# tests, no GPU runs them. The whole-pack conversions (csrc/cuda/common.cuh)
# bit for bit against the element-wise ones; AdamW's gradient-norm spans
# (csrc/cuda/adamw_spans.cuh) read every element once. Skipped (and said so)
# without nvcc.
build/test_pack_convert: tests/cuda_host/test_pack_convert.cu csrc/cuda/common.cuh
	@mkdir -p build
	$(NVCC) -O2 -std=c++17 -Iinclude -Icsrc $< -o $@

build/test_adamw_spans: tests/cuda_host/test_adamw_spans.cu csrc/cuda/adamw_spans.cuh include/opsmith/adamw.h
	@mkdir -p build
	$(NVCC) -O2 -std=c++17 -Iinclude -Icsrc $< -o $@

ifeq ($(WITH_CUDA),1)
pack-test: build/test_pack_convert build/test_adamw_spans
	./build/test_pack_convert
	./build/test_adamw_spans
else
pack-test:
	@echo "pack-test: SKIPPED (no nvcc)"
endif

# The same C tests under AddressSanitizer + UndefinedBehaviorSanitizer, on a
# CPU-only build of the library (the CUDA launchers are the stand-ins there).
SAN_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g -O1
SAN_SRCS := $(C_SRCS) $(NO_CUDA_SRCS) $(TEST_SRCS)
build/test_c_sanitize: $(SAN_SRCS) $(HEADERS) $(wildcard tests/c/*.h)
	@mkdir -p build
	$(CC) -std=c11 -fopenmp -Wall -Wextra -Iinclude -Icsrc $(SAN_FLAGS) $(SAN_SRCS) -lm -o $@

ctest-sanitize: build/test_c_sanitize
	OMP_NUM_THREADS=2 ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
	    ./build/test_c_sanitize

# --- Python environment and the two PyTorch extensions ---------------------
env: $(PY_ENV)

.venv/.installed: requirements-dev.txt
	python3 -m venv .venv
	.venv/bin/pip install -q --no-cache-dir --upgrade pip
	.venv/bin/pip install -q --no-cache-dir -r requirements-dev.txt
	@touch $@

ext: build/ext.stamp

# the stamp makes a second `make` with nothing changed a no-op
build/ext.stamp: $(PY_ENV) $(LIB) setup.py $(wildcard csrc/torch/*) include/opsmith.h $(wildcard include/opsmith/*.h)
	OPSMITH_WITH_CUDA=$(WITH_CUDA) MAX_JOBS=$$(nproc) $(PYTHON) setup.py -q build_ext --inplace
	@touch $@

pytest: build
	$(PYTHON) -m pytest -q tests

# --- installing, as a user would: pip into a fresh environment that sees the
# project's torch, the package used from another directory, the C example
# compiled against the C library the wheel carries; then an editable install.
INSTALL_ENV := build/install-env
install-check: build
	rm -rf $(INSTALL_ENV) build/install-cwd && mkdir -p build/install-cwd
	$(PYTHON) -m venv --without-pip $(INSTALL_ENV)
	$(PYTHON) -c 'import site, sys; print("\n".join(site.getsitepackages()))' > \
	    $$($(INSTALL_ENV)/bin/python -c 'import site; print(site.getsitepackages()[0])')/project-torch.pth
	$(INSTALL_ENV)/bin/python -m pip install -q --no-build-isolation --no-index .
	cd build/install-cwd && ../install-env/bin/python $(CURDIR)/examples/installed_check.py
	cd build/install-cwd && ../install-env/bin/opsmith --version && ../install-env/bin/opsmith doctor
	cd build/install-cwd && $(CC) -std=c11 -O2 -Wall $(EXAMPLE_CUDA) $(CURDIR)/examples/c/rms_norm_example.c \
	    $$(../install-env/bin/python -m opsmith.c_flags) -lm $(CUDA_LINK) -o rms_norm_example && ./rms_norm_example
	$(INSTALL_ENV)/bin/python -m pip uninstall -q -y opsmith
	$(INSTALL_ENV)/bin/python -m pip install -q --no-build-isolation --no-index -e .
	cd build/install-cwd && ../install-env/bin/python $(CURDIR)/examples/installed_check.py --editable

# the route B library built by CMake against libtorch (reusing the Makefile's
# C library), and a C++ program on libtorch alone calling it (examples/cpp)
cmake-example: build
	cmake -S . -B build/cmake -DCMAKE_PREFIX_PATH="$$($(PYTHON) -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')" \
	    -DOPSMITH_C_LIBRARY=$(CURDIR)/$(LIB) -DOPSMITH_WITH_CUDA=$(if $(filter 1,$(WITH_CUDA)),ON,OFF) > build/cmake-configure.log \
	    || { cat build/cmake-configure.log; exit 1; }
	cmake --build build/cmake -j$$(nproc)
	./build/cmake/rms_norm_dispatcher build/cmake/libopsmith_ops.so

# --- `opsmith new-op`: the generated op builds and passes its tests ----------
# In-tree: the tree (git's files) is copied to build/new-op-tree with this
# build's products, timestamps kept; the op is generated there and built.
# The two shared headers the generator touches (include/opsmith.h's new
# #include line, the op's own headers) are given back the old timestamp:
# they only declare the new op's functions, which no existing object uses,
# and every new file includes them whole, so make compiles just the new C and
# CUDA objects. The extensions compile only the new op's bridge: every other
# bridge source is the same file as here, and setup.py links this tree's
# object for it (OPSMITH_REUSE_OBJECTS_FROM; ninja alone would compile them
# all again, its files name the tree's absolute path). Then the op's C test
# group, its pytest file and the spec-driven harnesses filtered to it. Out-of-tree: --out/--namespace into
# build/new-op-standalone, built just in time by its own loader (its CUDA C
# for sm_90 alone: the in-tree build covers every arch), its tests.
NEW_OP_NAME := generated_op
NEW_OP_NS := generated_ops
NEW_OP_NS_UPPER := $(shell echo $(NEW_OP_NS) | tr a-z A-Z)
NEW_OP_TREE := build/new-op-tree
NEW_OP_OUT := build/new-op-standalone
NEW_OP_PYTHON := $(if $(filter yes,$(SYSTEM_TORCH)),$(PYTHON),$(CURDIR)/$(PYTHON))
new-op-check: build
	@start=$$(date +%s); \
	rm -rf $(NEW_OP_TREE) $(NEW_OP_OUT) && mkdir -p $(NEW_OP_TREE)/build && \
	{ git ls-files -co --exclude-standard 2>/dev/null || \
	  find . \( -name build -o -name .venv -o -name .git -o -name __pycache__ \) -prune -o -type f ! -name '*.so' -print; } | \
	    while read -r f; do [ -f "$$f" ] && printf '%s\n' "$$f"; done | tar cf - -T - | tar xf - -C $(NEW_OP_TREE) && \
	cp -a build/csrc $(wildcard build/tests) build/config-cuda* $(LIB) $(SO) $(NEW_OP_TREE)/build/ && cp -a opsmith/*.so $(NEW_OP_TREE)/opsmith/ && \
	if [ -d .venv ]; then ln -s $(CURDIR)/.venv $(NEW_OP_TREE)/.venv; fi && \
	touch -r $(NEW_OP_TREE)/include/opsmith.h $(NEW_OP_TREE)/build/new-op.ref && \
	$(PYTHON) -m opsmith new-op $(NEW_OP_NAME) --root $(NEW_OP_TREE) -q && \
	touch -r $(NEW_OP_TREE)/build/new-op.ref $(NEW_OP_TREE)/include/opsmith.h \
	    $(NEW_OP_TREE)/include/opsmith/$(NEW_OP_NAME).h $(NEW_OP_TREE)/csrc/internal/$(NEW_OP_NAME).h && \
	OPSMITH_REUSE_OBJECTS_FROM=$(CURDIR) $(MAKE) -C $(NEW_OP_TREE) build build/test_c PY_ENV= NVCC=$(NVCC) && \
	cd $(NEW_OP_TREE) && \
	$(CC) -std=c11 -O2 -Wall -Wextra -Iinclude -Icsrc $(CUDA_TEST_FLAGS) tests/c/test_main.c tests/c/test_$(NEW_OP_NAME).c \
	    build/libopsmith.a -fopenmp -lm -lstdc++ $(CUDA_LINK) -o build/test_c_$(NEW_OP_NAME) && \
	OMP_NUM_THREADS=2 ./build/test_c_$(NEW_OP_NAME) && \
	$(NEW_OP_PYTHON) -m pytest -q -p no:cacheprovider tests/test_$(NEW_OP_NAME).py && \
	$(NEW_OP_PYTHON) -m pytest -q -p no:cacheprovider tests/test_reliability.py tests/test_integration.py -k $(NEW_OP_NAME) && \
	cd $(CURDIR) && mid=$$(date +%s) && \
	$(PYTHON) -m opsmith new-op $(NEW_OP_NAME) --out $(NEW_OP_OUT) --namespace $(NEW_OP_NS) -q && \
	cd $(NEW_OP_OUT) && $(NEW_OP_NS_UPPER)_CUDA_ARCH=90 $(NEW_OP_PYTHON) -m pytest -q -p no:cacheprovider tests && \
	end=$$(date +%s) && \
	echo "new-op-check: in-tree $$((mid - start)) s, out-of-tree $$((end - mid)) s"

# --- Hugging Face patching on the other transformers the project meets: the
# GPU machine's 5.17 (pytest above runs requirements-dev.txt's 5.23). It is
# installed beside the environment (a --target folder read first on
# PYTHONPATH, its own dependencies only where 5.17 needs others), and
# tests/test_hf.py runs again on it; where 5.17 is the environment's own,
# pytest has covered it already.
HF_COMPAT_VERSION := 5.17.0
HF_COMPAT := build/transformers-$(HF_COMPAT_VERSION)
hf-compat: build
	@if $(PYTHON) -c 'import sys, transformers; sys.exit(transformers.__version__ != "$(HF_COMPAT_VERSION)")' 2>/dev/null; then \
	    echo "hf-compat: transformers $(HF_COMPAT_VERSION) is the environment's own: covered by pytest"; \
	else \
	    rm -rf $(HF_COMPAT) && \
	    $(PYTHON) -m pip install -q --no-cache-dir --no-deps --target $(HF_COMPAT) transformers==$(HF_COMPAT_VERSION) \
	        "huggingface-hub>=1.5,<2" httpx httpcore certifi sniffio && \
	    PYTHONPATH=$(CURDIR)/$(HF_COMPAT) $(PYTHON) -c 'import transformers; \
	        assert transformers.__version__ == "$(HF_COMPAT_VERSION)", transformers.__version__' && \
	    PYTHONPATH=$(CURDIR)/$(HF_COMPAT) $(PYTHON) -m pytest -q -p no:cacheprovider tests/test_hf.py; \
	fi

test: ctest ctest-sanitize pack-test example check-exports install-check cmake-example pytest new-op-check hf-compat

demo: build
	$(PYTHON) -m opsmith demo

# on a machine with a CUDA GPU: results, plots and table under bench/results/latest
bench: build
	$(PYTHON) -m opsmith bench $(BENCH_ARGS)

clean:
	rm -rf build opsmith/*.so *.egg-info
