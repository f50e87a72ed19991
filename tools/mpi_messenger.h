// MPI's processes as `ranklab plan` spreads its simulations over them (plan/cluster.h): the plan's
// Messenger over the job's MpiHostComm, here where the tools meet the backends' host side.
#pragma once

#include <optional>
#include <string>
#include <utility>

#include "common/errors.h"
#include "plan/cluster.h"
#include "real/host_comm.h"

namespace ranklab {

class MpiMessenger final : public plan::Messenger {
 public:
  MpiMessenger() : comm_(MpiHostComm::instance()) {}
  ~MpiMessenger() override {
    try {
      comm_.flush();  // rank 0's word to stop, a worker's last answer
    } catch (const Error&) {
    }
  }
  int rank() const override { return comm_.rank(); }
  int size() const override { return comm_.size(); }
  std::string host() const override { return comm_.host(); }
  void send(int to, const std::string& message) override { comm_.send(to, message); }
  std::optional<std::pair<int, std::string>> poll() override { return comm_.poll(); }

 private:
  MpiHostComm& comm_;
};

}  // namespace ranklab
