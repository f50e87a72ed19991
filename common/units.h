// How every output of ranklab writes sizes and bandwidths, so that a number means the same wherever it is
// printed. Sizes use binary prefixes (1 KiB = 1024 B): device memory comes in powers of two, nvidia-smi
// reports MiB, torch.cuda.memory_summary() prints KiB, MiB and GiB, and nccl-tests lists message sizes in
// bytes that are powers of two. Bandwidths use decimal units (1 GB/s = 1e9 bytes per second), as
// nccl-tests' algbw and busbw (doc/PERFORMANCE.md of NVIDIA/nccl-tests) and NVIDIA's datasheets do for
// NVLink, PCIe and network links. docs/lessons/README.md says the same to the reader.
#pragma once

#include <string>

namespace ranklab {

// "512 B", "64 KiB", "1.50 KiB", "300 KiB", "79.6 GiB": whole numbers of a unit without a fraction (the
// usual power-of-two sizes), others with three significant digits.
std::string format_bytes(double bytes);

// "447.4 GB/s"; below 1 GB/s in MB/s ("4.4 MB/s"), where small messages, all latency, would read 0.0.
std::string format_gbps(double gbps);

}  // namespace ranklab
