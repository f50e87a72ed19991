// What ends a run from inside a rank without a ranklab error: a foreign exception, a thrown value that is
// not an exception, exit(), a call from another thread, a stack overflow, a loop spinning on now(). Each
// must end the run with a message naming the rank.
#include <gtest/gtest.h>

#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>
#include <typeinfo>

#include "common/errors.h"
#include "common/lesson.h"
#include "sim/sim_backend.h"
#include "sim/stack_pool.h"
#include "tests/sim_fixture.h"

namespace ranklab {
namespace {

using testing::quiet_config;

template <typename E>
std::string error_of(const std::function<void(Rank&)>& fn, int world = 4) {
  SimBackend backend(quiet_config());
  try {
    backend.launch(world, fn);
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

TEST(RankFaults, AForeignExceptionNamesRankAndType) {
  const std::string msg = error_of<ProgramError>([](Rank& r) {
    if (r.rank() == 2) throw std::out_of_range("index 7");
  });
  EXPECT_NE(msg.find("rank 2 threw std::out_of_range: index 7"), std::string::npos) << msg;
}

TEST(RankFaults, AThrownValueThatIsNotAnExceptionNamesRankAndType) {
  const std::string msg = error_of<ProgramError>([](Rank& r) {
    if (r.rank() == 1) throw 42;
  });
  EXPECT_NE(msg.find("rank 1 threw a value of type int, which is not a std::exception"), std::string::npos)
      << msg;
}

// What both backends make of a rank's own exception (the real backend calls it where a rank's thread or
// process ends; the simulator gives the same messages).
TEST(RankFaults, TheErrorOfARankNamesItOnEitherBackend) {
  auto of = [](auto thrown) {
    try {
      throw thrown;
    } catch (...) {
      try {
        std::rethrow_exception(current_error_of_rank(5));
      } catch (const std::exception& e) {
        return std::string(typeid(e).name()) + " " + e.what();
      }
    }
    return std::string();
  };
  EXPECT_NE(of(std::out_of_range("index 7")).find("rank 5 threw std::out_of_range: index 7"),
            std::string::npos);
  EXPECT_NE(of(42).find("rank 5 threw a value of type int, which is not a std::exception"),
            std::string::npos);
  EXPECT_EQ(of(MismatchError("as it was")), std::string(typeid(MismatchError).name()) + " as it was");
  EXPECT_NE(of(std::runtime_error("x")).find(typeid(ProgramError).name()), std::string::npos);
}

void throwing_lesson(Rank& r, const LessonOptions&) {
  if (r.rank() == 3) throw std::runtime_error("boom");
}
RANKLAB_LESSON("test_throwing", "throws from rank 3", throwing_lesson);

TEST(RankFaults, AForeignExceptionInALessonNamesTheLesson) {
  SimBackend backend(quiet_config());
  try {
    run_lesson(backend, "test_throwing", Settings{});
    ADD_FAILURE() << "no error";
  } catch (const ProgramError& e) {
    EXPECT_STREQ(e.what(), "lesson test_throwing: rank 3 threw std::runtime_error: boom");
  }
}

TEST(RankFaults, SpinningOnNowIsAnErrorNamingTheRank) {
  const std::string msg = error_of<UsageError>([](Rank& r) {
    const double t0 = r.now();
    if (r.rank() == 1) {
      while (r.now() < t0 + 100) {
      }
    }
  });
  EXPECT_NE(msg.find("rank 1: now(): returned the same time"), std::string::npos) << msg;
}

TEST(RankFaultsDeathTest, ExitInsideARankNamesTheRank) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        SimBackend backend(quiet_config());
        backend.launch(4, [](Rank& r) {
          r.barrier();
          if (r.rank() == 1) std::exit(0);
        });
      },
      ::testing::ExitedWithCode(1), "rank 1 called exit\\(\\) inside its program");
}

TEST(RankFaultsDeathTest, ACallFromAnotherThreadNamesTheRankAndCall) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        SimBackend backend(quiet_config());
        backend.launch(2, [](Rank& r) {
          Tensor t = r.zeros({4});
          if (r.rank() == 0) {
            std::thread([&] { r.all_reduce(t, ReduceOp::Sum); }).join();
          }
        });
      },
      ::testing::ExitedWithCode(1), "rank 0: all_reduce was called from a thread the rank's program started");
}

TEST(RankFaults, ShowWithDifferentLabelsNamesBothRanks) {
  const std::string msg =
      error_of<MismatchError>([](Rank& r) { r.show(r.rank() == 2 ? "grads" : "weights", r.zeros({2})); });
  EXPECT_NE(msg.find("ranks disagree on show() call #0: rank 0 shows \"weights\", rank 2 shows \"grads\""),
            std::string::npos)
      << msg;
}

TEST(RankFaults, CommunicationOnABufferAnUnwaitedAsyncOperationUsesIsARace) {
  const std::string msg = error_of<UsageError>(
      [](Rank& r) {
        Tensor t = r.full({4}, 1.0f);
        Work w;
        if (r.rank() == 0) w = r.send(t, 1, Async::Yes);
        if (r.rank() == 1) r.recv(r.zeros({4}), 0);
        r.all_reduce(t, ReduceOp::Sum);
        w.wait();
      },
      2);
  EXPECT_NE(msg.find("rank 0: all_reduce: float32[4] is still in use by send/recv #0 from rank 0 to rank 1, "
                     "issued with Async::Yes and not waited on"),
            std::string::npos)
      << msg;
  // Two operations that only read the buffer may overlap.
  SimBackend backend(quiet_config());
  EXPECT_NO_THROW(backend.launch(2, [](Rank& r) {
    Tensor t = r.full({4}, 1.0f);
    if (r.rank() == 0) {
      Work a = r.send(t, 1, Async::Yes), b = r.send(t, 1, Async::Yes);
      a.wait();
      b.wait();
    } else {
      Tensor u = r.zeros({4}), v = r.zeros({4});
      r.recv(u, 0);
      r.recv(v, 0);
    }
  }));
}

TEST(Bounds, AGroupNotMadeByNewGroupIsRefused) {
  // Group 1 of this run is {0, 1}; a hand-made group 1 of four ranks would index past its members.
  std::string msg = error_of<UsageError>([](Rank& r) {
    r.new_group({0, 1});
    Tensor t = r.zeros({4});
    r.all_reduce(t, ReduceOp::Sum, Async::No, Group(1, {0, 1, 2, 3}));
  });
  EXPECT_NE(
      msg.find("rank 0: all_reduce: group 1 {0, 1, 2, 3} was not made by new_group in this run (group 1 "
               "of this run is {0, 1})"),
      std::string::npos)
      << msg;
  msg = error_of<UsageError>([](Rank& r) {
    Tensor t = r.zeros({4});
    r.broadcast(t, 0, Async::No, Group(7, {0, 1}));
  });
  EXPECT_NE(msg.find("rank 0: broadcast: group 7 {0, 1} was not made by new_group"), std::string::npos)
      << msg;
}

TEST(Bounds, ASliceStartNearTheLargestIntegerIsOutOfRange) {
  const std::int64_t huge = std::numeric_limits<std::int64_t>::max() - 1;
  std::string msg = error_of<UsageError>([&](Rank& r) { r.slice(r.zeros({8}), 0, huge, 4); });
  EXPECT_NE(msg.find("rank 0: slice: 4 elements from 9223372036854775806 are outside dimension 0"),
            std::string::npos)
      << msg;
  msg = error_of<UsageError>([&](Rank& r) { r.randn_slice({4, 6}, 1, huge, 4, 1, 1.0f, DType::Float32); });
  EXPECT_NE(msg.find("rank 0: randn_slice: [9223372036854775806, 9223372036854775807) is outside"),
            std::string::npos)
      << msg;
}

TEST(Bounds, AShapeWhoseElementCountOverflowsIsRefused) {
  const std::int64_t big = std::int64_t{1} << 32;
  const std::string msg = error_of<UsageError>([&](Rank& r) { r.phantom({big, big}); });
  EXPECT_NE(msg.find("shape [4294967296, 4294967296] has too many elements"), std::string::npos) << msg;
  EXPECT_THROW(Shape({std::int64_t{1} << 61}), UsageError);
  EXPECT_NO_THROW(Shape({std::int64_t{1} << 59}));
}

#if !defined(RANKLAB_SANITIZE)  // AddressSanitizer reports the overflow itself
// Deep enough to pass any stack of 256 KiB; the volatile page keeps every frame.
int recurse(int depth) {
  volatile char page[4096];
  page[0] = static_cast<char>(depth);
  return depth == 0 ? page[0] : recurse(depth - 1) + page[0];
}

TEST(RankFaultsDeathTest, AStackOverflowNamesTheRankAndTheStackSize) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        SimBackend backend(quiet_config());
        backend.launch(4, [](Rank& r) {
          if (r.rank() == 2) recurse(1000);
        });
      },
      ::testing::ExitedWithCode(1),
      "rank 2: stack overflow: the fiber's stack of 256 KiB was exceeded; raise it with --stack-kib N");
}

// Above kGuardedStacks stacks have no guard pages: the bottom of each must still read zero when its fiber
// ends, and one that does not names the stack's rank. (The pool only reserves address space.)
TEST(RankFaultsDeathTest, AnUnguardedStackThatReachedItsBottomIsCaught) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        sim::StackPool pool(sim::StackPool::kGuardedStacks + 1, 256 * 1024);
        if (pool.guarded()) std::exit(2);
        const boost::context::stack_context untouched = pool.take();
        pool.give_back(untouched);  // a stack its fiber never deepened passes
        const boost::context::stack_context overflowed = pool.take();
        static_cast<char*>(overflowed.sp)[-static_cast<std::ptrdiff_t>(overflowed.size)] = 1;
        pool.give_back(overflowed);
      },
      ::testing::ExitedWithCode(1), "rank 1: stack overflow: the fiber's stack of 256 KiB was exceeded");
}

TEST(RankFaults, ABiggerStackHoldsTheSameRecursion) {
  SimConfig config = quiet_config();
  config.stack_bytes = 8 << 20;
  SimBackend backend(config);
  EXPECT_NO_THROW(backend.launch(2, [](Rank& r) {
    if (r.rank() == 1) recurse(1000);
  }));
}
#endif

}  // namespace
}  // namespace ranklab
