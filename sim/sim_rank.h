// SimRank: the Rank interface on the simulator. Compute is done for real on the host (Eigen, GEMM
// through OpenBLAS) and timed by the compute model; communication is handed to SimWorld.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "common/rank.h"
#include "sim/world.h"

namespace ranklab::sim {

class SimRank : public Rank {
 public:
  SimRank(SimWorld& world, int rank) : world_(world), rank_(rank), s_(world.state(rank)) {}

  int rank() const override { return rank_; }
  int world_size() const override { return world_.size(); }

  Tensor empty(const Shape& s) override;
  Tensor zeros(const Shape& s) override;
  Tensor full(const Shape& s, float value) override;
  Tensor arange(const Shape& s, float start) override;
  Tensor randn(const Shape& s, std::uint64_t seed, float std) override;
  Tensor from_host(const Shape& s, const std::vector<float>& values) override;
  Tensor phantom(const Shape& s) override;
  std::vector<float> to_host(const Tensor& t) override;

  Tensor matmul(const Tensor& a, const Tensor& b, Trans ta, Trans tb) override;
  Tensor relu(const Tensor& x) override;
  Tensor relu_backward(const Tensor& grad_out, const Tensor& x) override;
  Tensor add(const Tensor& a, const Tensor& b) override;
  void add_(const Tensor& dst, const Tensor& src, float alpha) override;
  void scale_(const Tensor& t, float factor) override;
  void copy_(const Tensor& dst, const Tensor& src) override;
  Tensor sum(const Tensor& t) override;
  Tensor slice(const Tensor& t, int dim, std::int64_t start, std::int64_t length) override;
  Tensor cat(const std::vector<Tensor>& parts, int dim) override;
  void sgd_step(const Tensor& param, const Tensor& grad, float lr) override;
  void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamW& h,
                  int step) override;

  Work communicate(const CommCall& call) override;
  Group new_group(const std::vector<int>& ranks) override { return world_.new_group(rank_, ranks); }

  void synchronize() override;
  double now() override;

  std::int64_t memory_allocated() const override { return s_.memory->allocated; }
  std::int64_t memory_peak() const override { return s_.memory->peak; }
  std::int64_t memory_capacity() const override { return s_.memory->capacity; }

  void region_begin(const std::string& name) override;
  void region_end() override;
  void print(const std::string& line) override { world_.print(line); }
  void show(const std::string& label, const Tensor& t) override;
  void check(const std::string& what, bool passed, const std::string& detail) override;

  // Waits for everything the rank posted; called when its program returns.
  void finish();

 private:
  // Entry checks shared by every operation.
  void require(const Tensor& t, const char* op, const char* arg) const;
  Tensor allocate(const Shape& s, bool phantom, const char* op);
  // Before a kernel touches `tensors`: the compute stream waits for synchronous communication, and an
  // async operation on one of them that was not waited on is an error.
  void before_kernel(std::initializer_list<const Tensor*> tensors, const char* op);
  void fold_sync_ops(const char* by);
  // Advances the host by the launch overhead and the compute stream by the kernel's modeled time.
  void launch_kernel(const char* name, double flops, double bytes);
  void validate(const CommCall& call) const;
  std::string where(const char* op) const;

  SimWorld& world_;
  int rank_;
  RankState& s_;
  std::vector<std::pair<std::string, double>> regions_;
};

}  // namespace ranklab::sim
