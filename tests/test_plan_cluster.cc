// `ranklab plan` across the processes of an MPI job (plan/cluster.h). CTest runs this file under
// `mpirun -n 2` and `-n 3` (so the work does not split evenly): rank 0 plans a question alone, then with
// the other ranks simulating (and probing) for it, and the two plan.json agree field for field but for
// wall times and the process counts. Alone, the tests skip.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "common/options.h"
#include "plan/cluster.h"
#include "plan/plan_command.h"
#include "plan/plan_report.h"
#include "plan/search.h"
#include "plan_fixture.h"
#include "real/launch_env.h"
#include "tools/mpi_messenger.h"

namespace ranklab {
namespace {

using nlohmann::json;

// plan.json without what may differ between runs of the same plan: the wall times and the process counts.
json comparable(const std::string& plan_json) {
  json j = json::parse(plan_json);
  for (const char* key : {"wall_s", "jobs", "processes"}) j.erase(key);
  for (json& c : j["candidates"]) c.erase("simulation_wall_s");
  return j;
}

plan::Question question(int nodes) {
  plan::Request r;
  r.shape = {{"block", "llama"}, {"layers", "4"}, {"hidden", "64"}, {"heads", "4"},
             {"kv-heads", "2"},  {"seq", "16"},   {"vocab", "128"}, {"global-batch", "16"}};
  r.nodes = nodes;
  r.max_interleave = 2;
  return plan::make_question(r);
}

class PlanCluster : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!detect_launch_env().under_launcher() || !mpi_available())
      GTEST_SKIP() << "not started by mpirun or srun";
  }
};

TEST_F(PlanCluster, TheJobsPlanIsTheOneProcessPlan) {
  MpiMessenger cluster;
  ASSERT_GE(cluster.size(), 2);
  for (const plan::Question& q : {question(1), question(2), testing::deep_pipeline_question()}) {
    if (cluster.rank() > 0) {
      plan::serve(q, cluster, 1);
      continue;
    }
    plan::SearchOptions options;
    options.progress = false;
    const plan::Plan alone = plan::search(q, options);
    options.cluster = &cluster;
    const plan::Plan together = plan::search(q, options);
    EXPECT_EQ(together.processes, cluster.size());
    EXPECT_GT(together.simulated, 10);
    EXPECT_EQ(together.probed, alone.probed);
    EXPECT_EQ(comparable(plan::plan_to_json(together)), comparable(plan::plan_to_json(alone)))
        << plan::describe_question(q);
  }
}

}  // namespace
}  // namespace ranklab
