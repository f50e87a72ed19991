// Profile: the hardware a run is timed on — a GPU model and the links between GPUs — read from a TOML
// file in profiles/. Every number in a profile file carries its source in a comment beside it.
//
// Units are in the field names: `_gbps` is gigabytes (1e9 bytes) per second, the unit NCCL and
// nccl-tests report in; `_us` is microseconds; `_tflops` is 1e12 floating-point operations per second.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ranklab {

struct GpuModel {
  std::string name;
  double peak_tflops_fp32 = 0;     // dense, without tensor cores
  double peak_tflops_tf32 = 0;     // dense tensor-core TF32
  double peak_tflops_bf16 = 0;     // dense tensor-core BF16
  double hbm_bandwidth_gbps = 0;   // HBM bandwidth
  double hbm_capacity_gib = 0;     // device memory
  double launch_overhead_us = 0;   // host time to launch one kernel
  // Fraction of peak FLOP/s and HBM bandwidth a well-shaped kernel reaches (the roofline's ceiling).
  double compute_efficiency = 1.0;
  double memory_efficiency = 1.0;
};

// One tier of links: NVLink inside a node, or the network between nodes.
struct LinkTier {
  std::string name;                // "nvlink", "infiniband", "roce", "pcie"
  double bandwidth_gbps = 0;       // per GPU, per direction
  double latency_us = 0;           // per hop/step
};

struct Profile {
  std::string name;
  std::string description;
  std::string source_file;         // where it was read from ("" for built-in defaults)
  GpuModel gpu;
  int gpus_per_node = 1;
  int nodes = 1;                   // how many nodes the run may use (--nodes)
  LinkTier intra_node;             // between GPUs of one node
  LinkTier inter_node;             // between nodes
  double barrier_latency_us = 0;   // host rendezvous cost of barrier()

  int max_world() const { return gpus_per_node * nodes; }
  std::int64_t hbm_capacity_bytes() const;
};

// Parses a profile file. Errors (syntax, unknown key, missing field, a value out of range) raise
// ProfileError naming the file and line.
Profile load_profile_file(const std::string& path);
// Parses profile text; `origin` names it in errors.
Profile parse_profile(const std::string& text, const std::string& origin);
// Finds a profile by name (in the profile directories) or by path.
Profile load_profile(const std::string& name_or_path);
// Names of the profiles found in the profile directories.
std::vector<std::string> list_profiles();
// The directories searched: $RANKLAB_PROFILE_DIR, then the source tree's profiles/.
std::vector<std::string> profile_dirs();

}  // namespace ranklab
