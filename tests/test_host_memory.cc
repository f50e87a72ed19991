// The simulator's own memory: a world whose ranks alone would not fit is refused before it starts, and real
// tensors that would take the machine past what it had available are an error naming the rank, the
// operation and the sizes, where the kernel's OOM killer would otherwise end the run with nothing printed.
#include <gtest/gtest.h>

#include <string>

#include "common/errors.h"
#include "sim/host_memory.h"
#include "sim/sim_backend.h"
#include "tests/sim_fixture.h"

namespace ranklab {
namespace {

TEST(HostMemory, TheMachineSaysWhatIsAvailable) {
  EXPECT_GT(sim::available_host_bytes(), 0);
}

TEST(HostMemory, AWorldWhoseRanksWouldNotFitIsRefusedBeforeItStarts) {
  try {
    sim::host_tensor_limit(1'000'000, 256 * 1024, std::int64_t{8} << 30);
    FAIL() << "no error";
  } catch (const UsageError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("--world 1000000: the simulator needs about"), std::string::npos) << msg;
    EXPECT_NE(msg.find("run at most"), std::string::npos) << msg;
  }
  EXPECT_GT(sim::host_tensor_limit(1024, 256 * 1024, std::int64_t{8} << 30), std::int64_t{6} << 30);
  EXPECT_EQ(sim::host_tensor_limit(1'000'000, 256 * 1024, -1), 0);  // unknown: no limit

  SimConfig c = testing::quiet_config();
  c.host_memory_bytes = 1 << 20;
  SimBackend backend(c);
  bool ran = false;
  EXPECT_THROW(backend.launch(64, [&](Rank&) { ran = true; }), UsageError);
  EXPECT_FALSE(ran);
}

TEST(HostMemory, RealTensorsPastTheMachinesMemoryAreAnErrorNamingTheRank) {
  SimConfig c = testing::quiet_config();
  c.host_memory_bytes = 4 << 20;  // 4 ranks take about 0.3 MiB; their tensors may take about 3.3 MiB
  SimBackend backend(c);
  try {
    backend.launch(4, [](Rank& r) {
      Tensor small = r.zeros({1024});
      Tensor timed = r.phantom({1 << 24});  // phantoms hold no numbers
      if (r.rank() == 2) Tensor big = r.zeros({1 << 20});
    });
    FAIL() << "no error";
  } catch (const UsageError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("rank 2: ", 0), 0u) << msg;
    EXPECT_NE(msg.find("the simulator is out of host memory allocating float32[1048576] (4 MiB)"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("--phantom"), std::string::npos) << msg;
  }
  // What fits runs, and freed tensors give their memory back.
  backend.launch(4, [](Rank& r) {
    for (int i = 0; i < 10; ++i) Tensor t = r.zeros({1 << 17});
  });
}

}  // namespace
}  // namespace ranklab
