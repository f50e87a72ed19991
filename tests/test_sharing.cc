// The incremental max-min solver (sim/net/sharing.h) against the full one (sim/net/max_min.h): the
// hand-solved cases, and thousands of random flow sets built up and torn down one flow at a time.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <stdexcept>
#include <vector>

#include "sim/net/max_min.h"
#include "sim/net/sharing.h"

namespace ranklab::sim {
namespace {

using Path = std::vector<std::uint32_t>;

// Adds `paths` as flows, solves, and returns their rates in order.
std::vector<double> rates_of(SharingNetwork& net, const std::vector<Path>& paths) {
  std::vector<SharingNetwork::FlowId> ids;
  for (const Path& p : paths) ids.push_back(net.add_flow(p));
  net.solve();
  std::vector<double> r;
  for (auto id : ids) r.push_back(net.rate_gbps(id));
  return r;
}

// A link's capacity for the random tests: half of them multiples of 25 GB/s, so that shares tie.
double random_capacity(std::mt19937_64& rng) {
  return rng() % 2 ? static_cast<double>(1 + rng() % 8) * 25
                   : std::uniform_real_distribution<double>(0.5, 400)(rng);
}

// `links` links of random capacities, added alike to every network of `nets`; returns the capacities.
std::vector<double> add_random_links(std::mt19937_64& rng, int links,
                                     std::initializer_list<SharingNetwork*> nets) {
  std::vector<double> capacity;
  for (int l = 0; l < links; ++l) {
    capacity.push_back(random_capacity(rng));
    for (SharingNetwork* net : nets) net->add_link(capacity.back());
  }
  return capacity;
}

// One of the live flows of `live` (a map by flow id), at random.
template <class Map>
typename Map::iterator random_live(std::mt19937_64& rng, Map& live) {
  auto it = live.begin();
  std::advance(it, static_cast<long>(rng() % live.size()));
  return it;
}

// A path of `len` distinct links out of `links`.
Path random_path(std::mt19937_64& rng, int links, int len) {
  Path p;
  while (static_cast<int>(p.size()) < len) {
    const auto l = static_cast<std::uint32_t>(rng() % links);
    if (std::find(p.begin(), p.end(), l) == p.end()) p.push_back(l);
  }
  return p;
}

TEST(Sharing, TwoFlowsOnOneLinkGetHalfEach) {
  SharingNetwork net;
  const std::uint32_t l = net.add_link(100);
  EXPECT_EQ(rates_of(net, {{l}, {l}}), (std::vector<double>{50, 50}));
}

TEST(Sharing, AFlowHeldBackElsewhereLeavesTheRestToOthers) {
  SharingNetwork net;
  const std::uint32_t narrow = net.add_link(10), wide = net.add_link(100);
  const std::vector<double> r = rates_of(net, {{narrow, wide}, {wide}});
  EXPECT_DOUBLE_EQ(r[0], 10);
  EXPECT_DOUBLE_EQ(r[1], 90);
}

TEST(Sharing, TheTextbookExample) {
  SharingNetwork net;
  const std::uint32_t a = net.add_link(1), b = net.add_link(2);
  EXPECT_EQ(rates_of(net, {{a, b}, {a}, {b}}), (std::vector<double>{0.5, 0.5, 1.5}));
}

TEST(Sharing, ALinklessFlowIsNotLimited) {
  SharingNetwork net;
  net.add_link(90);
  EXPECT_EQ(rates_of(net, {{}}), (std::vector<double>{std::numeric_limits<double>::infinity()}));
}

TEST(Sharing, RemovingAFlowGivesItsShareBackAndTouchesOnlyItsComponent) {
  SharingNetwork net;
  const std::uint32_t a = net.add_link(90), b = net.add_link(40);
  const auto f0 = net.add_flow(Path{a}), f1 = net.add_flow(Path{a}), f2 = net.add_flow(Path{a});
  const auto g = net.add_flow(Path{b});
  net.solve();
  EXPECT_EQ(net.rate_gbps(f0), 30);
  EXPECT_EQ(net.rate_gbps(g), 40);
  net.remove_flow(f1);
  const std::vector<SharingNetwork::FlowId> changed = net.solve();
  EXPECT_EQ(net.rate_gbps(f0), 45);
  EXPECT_EQ(net.rate_gbps(f2), 45);
  // Link b shares nothing with link a: its flow was not solved again.
  EXPECT_EQ(changed.size(), 2u);
  for (auto id : changed) EXPECT_NE(id, g);
  // Nothing changed: nothing to solve.
  EXPECT_TRUE(net.solve().empty());
}

// The full solver's answer for the live flows, in the order of `live`.
std::vector<double> reference(const std::vector<double>& capacity, const std::vector<Path>& live) {
  FlowNetwork full;
  for (double c : capacity) full.add_link(c);
  for (const Path& p : live) full.add_flow(p);
  return max_min_rates(full);
}

// Random networks, random flows arriving and leaving; after every change the incremental rates must equal
// the full solver's. Capacities are often small integers, so exact ties between links (and between
// components) are common, which is where a solver that fixes links level by level could go wrong.
TEST(Sharing, EqualsTheFullSolverOnRandomFlowSets) {
  std::mt19937_64 rng(12345);
  int compared = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int links = 2 + static_cast<int>(rng() % 24);
    const int max_path = 1 + static_cast<int>(rng() % std::min(links, 5));
    SharingNetwork net;
    const std::vector<double> capacity = add_random_links(rng, links, {&net});
    std::map<SharingNetwork::FlowId, Path> live;
    const int changes = 10 + static_cast<int>(rng() % 40);
    for (int step = 0; step < changes; ++step) {
      // Several changes may come between solves, as when flows start and end at the same moment.
      const int batch = 1 + static_cast<int>(rng() % 3);
      for (int b = 0; b < batch; ++b) {
        if (!live.empty() && rng() % 3 == 0) {
          auto it = random_live(rng, live);
          net.remove_flow(it->first);
          live.erase(it);
        } else {
          const int len = static_cast<int>(rng() % (max_path + 1));  // 0: a flow over no link
          const Path p = random_path(rng, links, len);
          live[net.add_flow(p)] = p;
        }
      }
      net.solve();
      std::vector<Path> paths;
      for (const auto& [id, p] : live) paths.push_back(p);
      const std::vector<double> want = reference(capacity, paths);
      int i = 0;
      for (const auto& [id, p] : live) {
        const double got = net.rate_gbps(id);
        if (std::isinf(want[i])) {
          EXPECT_TRUE(std::isinf(got)) << "trial " << trial << " step " << step;
        } else {
          // Equal up to the solvers' tie tolerance (see sim/net/sharing.h).
          EXPECT_NEAR(got, want[i], 1e-12 * want[i] + 1e-300) << "trial " << trial << " step " << step;
        }
        ++i;
        ++compared;
      }
    }
  }
  EXPECT_GT(compared, 10000);
}

// Collectives come and go one after another: a batch of flows starts on links nothing crosses, ends, and
// the next starts. solve() then shares the added flows without gathering their components; where one of
// them crosses a link an earlier flow still holds, or a flow leaves beside others, it gathers them. Either
// way the rates are the full solver's, and what solve() returns is every flow connected to a change.
TEST(Sharing, FlowsStartingOnIdleLinksAreSharedAsTheGatheringWould) {
  std::mt19937_64 rng(4242);
  int compared = 0, idle_starts = 0, shared_starts = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const int links = 4 + static_cast<int>(rng() % 28);
    SharingNetwork net;
    const std::vector<double> capacity = add_random_links(rng, links, {&net});
    std::map<SharingNetwork::FlowId, Path> live;
    for (int step = 0; step < 20; ++step) {
      std::vector<bool> dirty(links, false);  // links whose flows changed since the last solve
      auto remove = [&](std::map<SharingNetwork::FlowId, Path>::iterator it) {
        for (std::uint32_t l : it->second) dirty[l] = true;
        net.remove_flow(it->first);
        return live.erase(it);
      };
      // Sometimes everything ends first, as a collective's flows do together; sometimes one flow.
      if (rng() % 2 == 0) {
        for (auto it = live.begin(); it != live.end();) it = remove(it);
      } else if (!live.empty() && rng() % 3 == 0) {
        remove(random_live(rng, live));
      }
      std::vector<bool> held(links, false);
      for (const auto& [id, p] : live)
        for (std::uint32_t l : p) held[l] = true;
      bool onto_held = false;
      const int starting = 1 + static_cast<int>(rng() % 12);
      std::vector<SharingNetwork::FlowId> started;
      auto start = [&] {
        const Path p = random_path(rng, links, 1 + static_cast<int>(rng() % std::min(links, 4)));
        for (std::uint32_t l : p) {
          onto_held = onto_held || held[l];
          dirty[l] = true;
        }
        started.push_back(net.add_flow(p));
        live[started.back()] = p;
      };
      for (int k = 0; k < starting; ++k) start();
      if (rng() % 3 == 0) {
        // One of them ends before it was shared, and the next to start takes its id.
        remove(live.find(started[rng() % started.size()]));
        start();
      }
      ++(onto_held ? shared_starts : idle_starts);
      const std::vector<SharingNetwork::FlowId> changed = net.solve();
      // The flows connected, through links they share, to a link whose flows changed.
      std::vector<bool> reached = dirty;
      std::set<SharingNetwork::FlowId> want_changed;
      for (bool grew = true; grew;) {
        grew = false;
        for (const auto& [id, p] : live) {
          if (want_changed.count(id)) continue;
          if (std::none_of(p.begin(), p.end(), [&](std::uint32_t l) { return reached[l]; })) continue;
          want_changed.insert(id);
          for (std::uint32_t l : p) reached[l] = true;
          grew = true;
        }
      }
      EXPECT_EQ(std::set<SharingNetwork::FlowId>(changed.begin(), changed.end()), want_changed)
          << "trial " << trial << " step " << step;
      EXPECT_EQ(changed.size(), want_changed.size()) << "each changed flow once";
      std::vector<Path> paths;
      for (const auto& [id, p] : live) paths.push_back(p);
      const std::vector<double> want = reference(capacity, paths);
      int i = 0;
      for (const auto& [id, p] : live) {
        EXPECT_NEAR(net.rate_gbps(id), want[i], 1e-12 * want[i]) << "trial " << trial << " step " << step;
        ++i;
        ++compared;
      }
    }
  }
  // Many starts onto idle links, and many onto links that earlier flows still held.
  EXPECT_GT(idle_starts, 500);
  EXPECT_GT(shared_starts, 500);
  EXPECT_GT(compared, 10000);
}

// Rates given for flows that started on idle links are taken as they are, and refused where the links
// were not idle or the count is not the flows'.
TEST(Sharing, RatesGivenForAnIdleStartAreTakenAndCheckedAgainstIt) {
  SharingNetwork shared, given;
  for (SharingNetwork* net : {&shared, &given}) {
    const std::uint32_t a = net->add_link(90), b = net->add_link(40);
    net->add_flow(Path{a});
    net->add_flow(Path{a, b});
    net->add_flow(Path{});  // over no link: not among the rates
    EXPECT_TRUE(net->idle_start());
    EXPECT_EQ(net->added_linked_flows(), 2);
  }
  const std::vector<SharingNetwork::FlowId> changed = shared.solve();
  EXPECT_THROW(given.solve_idle_start(std::vector<double>{50}), std::logic_error);
  const std::vector<SharingNetwork::FlowId> taken = given.solve_idle_start(std::vector<double>{50, 40});
  EXPECT_EQ(taken, changed);
  for (SharingNetwork::FlowId id : changed) EXPECT_EQ(given.rate_gbps(id), shared.rate_gbps(id)) << id;
  // A flow added beside one that is still there: its link was not idle.
  given.add_flow(Path{0});
  EXPECT_FALSE(given.idle_start());
  EXPECT_THROW(given.solve_idle_start(std::vector<double>{30}), std::logic_error);
}

// A flow standing for k copies gets, bit for bit, the rate each of k separate flows on its path gets, and
// leaves the others exactly what k separate flows leave them: the transfer engine relies on it to share a
// ring's channels through one NVLink hop as one flow.
TEST(Sharing, AFlowOfCopiesSharesExactlyAsTheCopiesWould) {
  std::mt19937_64 rng(4242);
  int compared = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int links = 2 + static_cast<int>(rng() % 24);
    const int max_path = 1 + static_cast<int>(rng() % std::min(links, 5));
    SharingNetwork separate, copied;
    add_random_links(rng, links, {&separate, &copied});
    // copied's id -> separate's ids, one per copy
    std::map<SharingNetwork::FlowId, std::vector<SharingNetwork::FlowId>> live;
    const int changes = 10 + static_cast<int>(rng() % 40);
    for (int step = 0; step < changes; ++step) {
      if (!live.empty() && rng() % 3 == 0) {
        auto it = random_live(rng, live);
        copied.remove_flow(it->first);
        for (auto id : it->second) separate.remove_flow(id);
        live.erase(it);
      } else {
        const int len = 1 + static_cast<int>(rng() % max_path);
        const Path p = random_path(rng, links, len);
        const auto copies = static_cast<std::uint32_t>(1 + rng() % 4);
        std::vector<SharingNetwork::FlowId> ids;
        for (std::uint32_t k = 0; k < copies; ++k) ids.push_back(separate.add_flow(p));
        live[copied.add_flow(p, copies)] = ids;
      }
      separate.solve();
      copied.solve();
      for (const auto& [id, ids] : live) {
        for (auto s : ids) {
          EXPECT_EQ(copied.rate_gbps(id), separate.rate_gbps(s)) << "trial " << trial << " step " << step;
          ++compared;
        }
      }
    }
  }
  EXPECT_GT(compared, 10000);
}

// Components of thousands of links, with many links at each level: the solver takes a level's links, and
// drops the ones the level left stale, in one pass once there are many. Rates stay the full solver's.
TEST(Sharing, LargeComponentsEqualTheFullSolver) {
  std::mt19937_64 rng(99);
  for (int trial = 0; trial < 4; ++trial) {
    const int links = 4000 + static_cast<int>(rng() % 2000);
    std::vector<double> capacity;
    SharingNetwork net;
    for (int l = 0; l < links; ++l) {
      // Few distinct capacities, so that thousands of links fill at one level.
      capacity.push_back(static_cast<double>(1 + rng() % 3) * 100);
      net.add_link(capacity.back());
    }
    std::vector<Path> paths;
    std::vector<SharingNetwork::FlowId> ids;
    const int flows = 3000 + static_cast<int>(rng() % 3000);
    for (int f = 0; f < flows; ++f) {
      const int len = 1 + static_cast<int>(rng() % 4);
      const Path p = random_path(rng, links, len);
      paths.push_back(p);
      ids.push_back(net.add_flow(p));
    }
    net.solve();
    std::vector<double> want = reference(capacity, paths);
    for (std::size_t i = 0; i < ids.size(); ++i) {
      ASSERT_NEAR(net.rate_gbps(ids[i]), want[i], 1e-12 * want[i]) << "trial " << trial << " flow " << i;
    }
    // Remove a third and share again: a component's links left stale by the removals.
    std::vector<Path> kept;
    std::vector<SharingNetwork::FlowId> kept_ids;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (i % 3 == 0) {
        net.remove_flow(ids[i]);
      } else {
        kept.push_back(paths[i]);
        kept_ids.push_back(ids[i]);
      }
    }
    net.solve();
    want = reference(capacity, kept);
    for (std::size_t i = 0; i < kept_ids.size(); ++i) {
      ASSERT_NEAR(net.rate_gbps(kept_ids[i]), want[i], 1e-12 * want[i]) << "trial " << trial << " kept " << i;
    }
  }
}

// A collective's shape at scale: thousands of flows each filled by its own link at one level, each also
// crossing a wider link that the level leaves stale (their shares below the next level's), and thousands
// more flows filled at higher levels.
TEST(Sharing, ThousandsOfLinksLeftStaleByALevelAreDroppedAtOnce) {
  SharingNetwork net;
  const int n = 3000;
  std::vector<double> capacity;
  auto link = [&](double c) {
    capacity.push_back(c);
    return net.add_link(c);
  };
  std::vector<Path> paths;
  for (int i = 0; i < n; ++i) {
    const std::uint32_t narrow = link(100), wide = link(200);
    paths.push_back({narrow, wide});
  }
  for (int i = 0; i < n; ++i) {
    // Every seventh of these shares its link with a second flow: two more levels.
    const std::uint32_t own = link(500 + i % 7);
    paths.push_back({own});
    if (i % 7 == 0) paths.push_back({own});
  }
  std::vector<SharingNetwork::FlowId> ids;
  for (const Path& p : paths) ids.push_back(net.add_flow(p));
  net.solve();
  const std::vector<double> want = reference(capacity, paths);
  for (std::size_t i = 0; i < ids.size(); ++i) ASSERT_EQ(net.rate_gbps(ids[i]), want[i]) << "flow " << i;
  EXPECT_EQ(net.rate_gbps(ids[0]), 100);
  EXPECT_EQ(net.rate_gbps(ids[n]), 250);  // link 500 shared by two
  EXPECT_EQ(net.rate_gbps(ids[n + 2]), 501);
}

// Batches of changes solved together (end_batch between them, one solve for several) give the rates that
// solving after every batch gives, bit for bit: the transfer engine relies on it to share once for the
// many transfers the simulator starts one by one at one moment.
TEST(Sharing, SolvingSeveralBatchesAtOnceEqualsSolvingEach) {
  std::mt19937_64 rng(777);
  int compared = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int links = 2 + static_cast<int>(rng() % 24);
    const int max_path = 1 + static_cast<int>(rng() % std::min(links, 5));
    SharingNetwork each, batched;
    add_random_links(rng, links, {&each, &batched});
    std::map<SharingNetwork::FlowId, SharingNetwork::FlowId> live;  // each's id -> batched's id
    const int changes = 10 + static_cast<int>(rng() % 40);
    for (int step = 0; step < changes; ++step) {
      const int batch = 1 + static_cast<int>(rng() % 3);
      for (int b = 0; b < batch; ++b) {
        if (!live.empty() && rng() % 3 == 0) {
          auto it = random_live(rng, live);
          each.remove_flow(it->first);
          batched.remove_flow(it->second);
          live.erase(it);
        } else {
          const int len = static_cast<int>(rng() % (max_path + 1));
          const Path p = random_path(rng, links, len);
          live[each.add_flow(p)] = batched.add_flow(p);
        }
      }
      each.solve();
      batched.end_batch();
      if (rng() % 4 != 0) continue;
      batched.solve();
      for (const auto& [a, b] : live) {
        EXPECT_EQ(each.rate_gbps(a), batched.rate_gbps(b)) << "trial " << trial << " step " << step;
        ++compared;
      }
    }
  }
  EXPECT_GT(compared, 1000);
}

}  // namespace
}  // namespace ranklab::sim
