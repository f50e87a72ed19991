# The two commands of the README, and the builds CI uses. Everything else is plain CMake.
BUILD ?= build
JOBS ?= 2
CMAKE_FLAGS ?=

.PHONY: demo test build setup bench sanitize format clean install

setup:
	@scripts/setup.sh

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

build: setup $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j$(JOBS)

# Builds, then runs the lesson tour on the simulator.
demo: build
	$(BUILD)/tools/ranklab run tour --world 4

# Builds, then runs every test.
test: build
	cd $(BUILD) && ctest --output-on-failure -j$(JOBS)

# Installs bin/ranklab and its profiles under PREFIX.
PREFIX ?= /usr/local
install: build
	cmake --install $(BUILD) --prefix $(PREFIX)

bench: build
	$(BUILD)/bench/ranklab_bench

# The tests again under AddressSanitizer + UndefinedBehaviorSanitizer.
# scripts/asan.supp says why one sanitizer-internal report is suppressed.
sanitize:
	ASAN_OPTIONS=suppressions=$(CURDIR)/scripts/asan.supp UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	$(MAKE) test BUILD=build-asan CMAKE_FLAGS="-DCMAKE_BUILD_TYPE=Debug -DRANKLAB_SANITIZE=ON -DRANKLAB_BENCH=OFF -DRANKLAB_CUDA=OFF"

format:
	clang-format -i $$(git ls-files '*.h' '*.cc' '*.cu' '*.cuh')

clean:
	rm -rf build build-asan build-werror
