// The allocator settings the simulator runs best with, applied before anything is allocated.
#pragma once

namespace ranklab::sim {

// A simulated run allocates and frees millions of small blocks (tensors' storage records, operations,
// flows) of a few sizes, in waves that sweep every rank. glibc's defaults suit it badly twice over:
// - its per-thread cache of freed blocks holds only 7 of each size, and the rest go through the arenas'
//   bins, a fifth of the CPU time of a large run; tcache_count=2000 keeps them in the cache;
// - what overflows even that cache lands in the fast bins, which any request of 1 KiB or more (a report
//   vector growing) sweeps and merges with the blocks' neighbours. A wave over 4,096 ranks overflows the
//   cache where one over 512 does not, and those sweeps touch blocks all over the heap: mxfast=0 turns
//   the fast bins off, so such a block is merged once, when it is freed, while it is still in cache.
// The settings can only be made from the environment at startup (GLIBC_TUNABLES), so this adds those
// the variable does not name yet and executes the program again, once; it returns at once when the
// variable names them all, when RANKLAB_MALLOC_TUNED is set, where the C library is not glibc or
// another allocator (tcmalloc, which the simulating programs link where it is installed) serves malloc,
// and carries on untuned if the program cannot be executed again.
void tune_malloc(char** argv);

// Whether tcmalloc, not glibc's allocator, serves malloc in this process (linked in, as the simulating
// programs are where it is installed, or preloaded). glibc's own calls (malloc_trim) must not be made then:
// its arenas were never set up, and trimming them faults when a thread exits.
bool tcmalloc_serves_malloc();

}  // namespace ranklab::sim
