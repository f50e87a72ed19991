// The allocator setting the simulator runs best with, applied before anything is allocated.
#pragma once

namespace ranklab::sim {

// A simulated run allocates and frees millions of small blocks (tensors' storage records, operations,
// flows) of a few sizes, and glibc's per-thread cache of freed blocks holds only 7 of each size by
// default: the rest go through the arenas' bins and their consolidation, a fifth of the CPU time of a
// large run. The cache size can only be set from the environment at startup (GLIBC_TUNABLES), so this
// sets glibc.malloc.tcache_count and executes the program again, once; it returns at once when the
// variable already names that tunable, when RANKLAB_MALLOC_TUNED is set, or where the C library is not
// glibc, and carries on untuned if the program cannot be executed again.
void tune_malloc(char** argv);

}  // namespace ranklab::sim
