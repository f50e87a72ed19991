// Profile: the hardware a run is timed on — a GPU model, the node around it (NVLink and NVSwitch, PCIe,
// NICs) and the fabric between nodes — read from a TOML file in profiles/. Every number in a profile
// file carries its source in a comment beside it.
//
// Units are in the field names: `_gbps` is gigabytes (1e9 bytes) per second, the unit NCCL and
// nccl-tests report in; `_us` is microseconds; `_tflops` is 1e12 floating-point operations per second.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ranklab {

// How fused (FlashAttention-style) attention's rate depends on its shape, from kernel benchmarks:
//   efficiency = ceiling * seq / (seq + seq_half) * head_dim factor * (causal: seq / (seq + causal_tokens))
// where the head_dim factor is hdim64_factor at head_dim <= 64, 1 at head_dim >= 128, linear between.
// ceiling 0 means no shape model: the flat attention_*_efficiency applies.
struct AttentionShapeModel {
  double ceiling = 0;        // the fraction of peak at head_dim 128, non-causal, as seq grows without bound
  double seq_half = 0;       // tokens at which a non-causal head_dim-128 pass reaches half the ceiling
  double hdim64_factor = 1;  // head_dim 64's rate as a fraction of head_dim 128's
  double causal_tokens =
      0;  // the causal mask's cost: causal runs at seq / (seq + causal_tokens) of non-causal
  bool enabled() const { return ceiling > 0; }
};

struct GpuModel {
  std::string name;
  double peak_tflops_fp32 = 0;    // dense, without tensor cores
  double peak_tflops_tf32 = 0;    // dense tensor-core TF32
  double peak_tflops_bf16 = 0;    // dense tensor-core BF16
  double peak_tflops_fp16 = 0;    // dense tensor-core FP16 (FP32 accumulate); 0 in a file means as BF16
  double hbm_bandwidth_gbps = 0;  // HBM bandwidth
  double hbm_capacity_gib = 0;    // device memory
  double launch_overhead_us = 0;  // host time to launch one kernel
  // Fraction of peak FLOP/s and HBM bandwidth a well-shaped kernel reaches (the roofline's ceiling).
  double compute_efficiency = 1.0;
  double memory_efficiency = 1.0;
  // The 16-bit GEMM model (docs/model.md, "Compute"). Without sm_count and a measured GEMM, 16-bit GEMMs
  // use the roofline with compute_efficiency.
  int sm_count = 0;       // streaming multiprocessors
  int gemm_tile_m = 128;  // output tile one SM computes (the model also tries it transposed)
  int gemm_tile_n = 256;
  double gemm_k_overhead = 0;   // a tile's pipeline fill and drain, in elements of k
  double gemm_mamf_tflops = 0;  // a measured large 16-bit GEMM: its TFLOP/s and its shape
  int gemm_mamf_m = 0, gemm_mamf_n = 0, gemm_mamf_k = 0;
  // The operand intensity (flops per byte an SM loads) at which an SM's operand feed keeps its tensor
  // cores busy. With it, a 16-bit GEMM runs as the fastest of several tile shapes and split-K; 0 keeps
  // the one tile and its transpose.
  double gemm_ridge_flops_per_byte = 0;
  // A GEMM kernel's device time that does not grow with its work (its start, prologue and the last tile's
  // epilogue), added to every 16-bit GEMM; the ceiling is solved with it.
  double gemm_fixed_us = 0;
  // FP8 (docs/model.md, "Compute", FP8 GEMMs). An FP8 GEMM runs the 16-bit model above at the FP8 rate, with
  // k in blocks of twice the elements (the same bytes); its ceiling is solved from a measured FP8 GEMM where
  // the profile names one, else it is the 16-bit ceiling.
  double peak_tflops_fp8 = 0;       // dense tensor-core FP8 (e4m3, e5m2); 0: no FP8 tensor cores
  double peak_tflops_fp4 = 0;       // dense tensor-core FP4; 0: none
  bool fp8_mx = false;              // tensor cores that apply MX block scales (MXFP8: 32 elements per scale)
  double gemm_mamf_fp8_tflops = 0;  // a measured large FP8 GEMM: its TFLOP/s and its shape
  int gemm_mamf_fp8_m = 0, gemm_mamf_fp8_n = 0, gemm_mamf_fp8_k = 0;
  // Fused attention's throughput as a fraction of the 16-bit peak; 0 means compute_efficiency. The flat
  // fractions, used where the profile gives no shape model below.
  double attention_fwd_efficiency = 0;
  double attention_bwd_efficiency = 0;
  // Fused attention's fraction of the 16-bit peak by shape (docs/model.md, "Compute"), one per pass.
  AttentionShapeModel attention_fwd_shape;
  AttentionShapeModel attention_bwd_shape;
};

// The NVLink ports of each GPU, all wired to the node's NVSwitch fabric, so any two GPUs of a node (an
// NVLink domain) talk at the full per-GPU rate. A node without NVLink has no [nvlink] table.
struct NvlinkSpec {
  std::string generation;          // "NVLink 4"
  int links_per_gpu = 0;           // NVLink links (ports) per GPU
  double link_bandwidth_gbps = 0;  // one link, one direction: the line rate
  double efficiency = 1.0;         // fraction of the line rate NCCL's transfers sustain
  double latency_us = 0;           // one hop: GPU to switch, or switch to GPU
  std::string switch_name;         // "NVSwitch (3rd generation)"
  bool nvls = false;               // the switch reduces in the network (NVLink SHARP, NCCL's NVLS)
  double gpu_bandwidth_gbps() const { return links_per_gpu * link_bandwidth_gbps; }
};

// Each GPU's PCIe link to a PCIe switch; the NICs hang off the same switches, and switches meet at the
// CPU's root complex. Without NVLink, GPUs of a node talk over PCIe.
struct PcieSpec {
  std::string generation;     // "PCIe 5.0 x16"
  double bandwidth_gbps = 0;  // one x16 link, one direction: the line rate
  double efficiency = 1.0;    // fraction of the line rate NCCL's transfers sustain
  double latency_us = 0;      // one hop
  int gpus_per_switch = 1;    // GPUs behind one PCIe switch
};

// The network adapters of a node. NIC k serves GPUs [k * g, (k + 1) * g) with g = gpus_per_node / count,
// and is the node's port on rail k of the fabric.
struct NicSpec {
  std::string name;           // "ConnectX-7 NDR 400 Gb/s"
  int count = 1;              // per node
  double bandwidth_gbps = 0;  // one NIC, one direction: the line rate
  double efficiency = 1.0;    // fraction of the line rate NCCL's transfers sustain
  double latency_us = 0;      // the adapter and its cable
};

// The network between nodes: a rail-optimised fat tree. NIC k of every node connects to a leaf switch
// of rail k; leaves connect to spine switches, so traffic stays on its rail unless it changes rails.
struct FabricSpec {
  std::string kind;               // "infiniband" or "roce"
  std::string switch_name;        // "Quantum-2 QM9700"
  int switch_radix = 2;           // ports per switch
  double switch_latency_us = 0;   // port to port
  double oversubscription = 1.0;  // leaf downlink : uplink bandwidth (1 = non-blocking)
};

// How the machine's NCCL differs from what NCCL's tuning model predicts for it. NCCL picks each
// collective's algorithm and protocol from its own predicted latencies (src/graph/tuning.cc, ported in
// sim/net/nccl_tuning.cc); the machine then runs with its real ones, which a measurement can show to be off.
struct NcclSpec {
  // The fixed latency a collective or point-to-point operation really takes, as a multiple of NCCL's
  // prediction for the algorithm and protocol it picked; 1 means NCCL's tables are right. It does not
  // change the pick. `ranklab calibrate` fits it to small messages.
  double latency_scale = 1.0;
};

struct Profile {
  std::string name;
  std::string description;
  std::string source_file;  // where it was read from ("" for profiles parsed from text)
  GpuModel gpu;
  int gpus_per_node = 1;    // a node is one NVLink domain (72 GPUs for GB200 NVL72)
  int nodes = 1;            // how many nodes the run may use (--nodes)
  std::string nodes_at;     // "FILE:LINE" of the profile's own `nodes`, "" when it does not set it
  bool has_nvlink = false;  // false: no [nvlink] table, GPUs of a node talk over PCIe
  NvlinkSpec nvlink;
  PcieSpec pcie;
  NicSpec nic;
  FabricSpec fabric;
  NcclSpec nccl;
  double barrier_latency_us = 0;  // host rendezvous cost of barrier()

  // The GPUs of `node_count` nodes of this profile, the most ranks a run on them has: UsageError naming
  // both counts where the product is more than an int (a rank number) holds.
  int gpus_in(int node_count) const;
  int max_world() const { return gpus_in(nodes); }
  std::int64_t hbm_capacity_bytes() const;
};

// Parses a profile file. Errors (syntax, unknown key, missing field, a value out of range, counts that do
// not fit together) raise ProfileError naming the file and line. A profile may start from another one
// (`base = "dgx-h100"`) and change only what differs; errors then name the file the value came from.
Profile load_profile_file(const std::string& path);
// Parses profile text; `origin` names it in errors.
Profile parse_profile(const std::string& text, const std::string& origin);
// Finds a profile by name (in the profile directories) or by path.
Profile load_profile(const std::string& name_or_path);
// Names of the profiles found in the profile directories.
std::vector<std::string> list_profiles();
// The profile whose GPU a device name describes ("NVIDIA H100 80GB HBM3", as nvidia-smi, CUDA and
// nccl-tests print it): among the profiles whose GPU name shares a model number with it (a word with a
// digit: H100), the one sharing the most words (SXM4, PCIe, 80GB), the first by name on a tie; "" when none.
std::string profile_for_gpu(const std::string& device_name);
// The directories searched: $RANKLAB_PROFILE_DIR, then an installed ranklab's share/ranklab/profiles
// (beside the running executable's bin/), then the source tree's profiles/.
std::vector<std::string> profile_dirs();

}  // namespace ranklab
