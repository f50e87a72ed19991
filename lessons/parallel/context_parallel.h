// Context parallelism (Liu et al. 2023, "Ring Attention"; Megatron-Core's and TransformerEngine's context
// parallelism; Dubey et al. 2024, section 3.3.2): each sequence is split over the cp ranks, and every layer
// but attention works on a rank's own tokens alone. Attention needs every earlier token's key and value, so
// the ranks exchange them.
//
// The split: 2 cp chunks, rank i holding chunks i and 2 cp - 1 - i. With the causal mask, a rank holding
// only early tokens would have little to attend to and one holding late tokens much; pairing chunk i with
// its mirror gives every rank the same work.
//
// p2p (the ring): step s holds the keys and values of rank i - s. Step 0 is the rank's own, with the causal
// mask. For an earlier rank (j < i) both of this rank's chunks see all of j's first chunk and none of its
// second; for a later one, only this rank's second chunk sees anything, and it sees all of j. Either way
// half a block, unmasked: the ring is balanced. While a block's attention runs, the next rank's keys and
// values arrive; each block's result merges into the running one by their log-sum-exps. The backward
// passes the keys and values around again, each with the gradient the ranks before have added to it, which
// ends one hop later back at its owner.
//
// all-gather: every rank's keys and values gathered at once (the transfer exposed), put in sequence order,
// and each of this rank's chunks attends to the prefix before it; the backward reduce-scatters their
// gradients. Fewer, larger transfers, none hidden: Llama 3 chose it for its simpler masks (document masks)
// at 128k tokens, where attention's compute dwarfs them.
//
// A sliding window (AttentionSpec::window) masks by true positions, so the ring's blocks are then split into
// pairs of chunks, and the pairs whose keys all lie outside every query's window are skipped. Sinks join
// once, after the blocks (Rank::attention_sinks_).
#pragma once

#include <string>
#include <vector>

#include "common/rank.h"
#include "lessons/parallel/exposed.h"

namespace ranklab::parallel {

struct ContextParallel {
  Rank& r;
  Group group;
  int size = 1;
  int index = 0;             // this rank's place in the group: it holds chunks index and 2 size - 1 - index
  std::vector<int> ranks{};  // the group's global ranks, in order
  bool all_gather = false;   // all-gather instead of the ring
  bool phantom = false;
  ExposedComm& exposed;
  // A deliberate bug for the tests: "cp-mask-every-block" applies the causal mask to the other ranks'
  // blocks too, by local position, as if every block were this rank's own.
  std::string broken{};

  // Attention of this rank's queries (qkv's rows: its two chunks, in order) over the whole sequence's keys.
  // The output is in qkv's dtype; lse is float32 [batch, heads, seq / cp], as Rank::attention's.
  Rank::AttentionOut attention(const Tensor& qkv, const AttentionSpec& spec);
  // d qkv from d out, for this rank's rows (the other ranks' share of its keys' gradients included).
  Tensor attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& lse,
                            const AttentionSpec& spec);

 private:
  // Which of this rank's queries, and which part of rank `from`'s keys, a block of the ring's step takes.
  struct RingBlock {
    Rank::AttentionBlock block;
    int key_chunk = -1;  // all of the keys (-1), or the first (0) or the second (1) of their chunks
  };
  // Step `from`'s blocks: one, or under a sliding window (whose mask compares positions) one for each pair
  // of a query chunk and a key chunk with any key in a query's window, at their positions.
  std::vector<RingBlock> ring_blocks(int from, std::int64_t chunk, const AttentionSpec& spec) const;
  RingBlock ring_block(int from, std::int64_t chunk) const;
  // The part of keys and values `t` (or of their gradient) a block takes.
  Tensor block_keys(const RingBlock& b, const Tensor& t, std::int64_t chunk_rows);
  // Where chunk `half` (0 or 1) of rank `owner` starts in the sequence.
  std::int64_t chunk_position(int owner, int half, std::int64_t chunk) const {
    return (half == 0 ? owner : 2 * size - 1 - owner) * chunk;
  }
  // Keys and values (or their gradients) sent to the next rank of the ring, and `receive`, a new buffer
  // like them, filled from the one before.
  std::vector<Work> pass_on(const Tensor& send, Tensor& receive);
  Rank::AttentionOut ring_attention(const Tensor& qkv, const AttentionSpec& spec);
  Tensor ring_attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& lse,
                                 const AttentionSpec& spec);
  Rank::AttentionOut gathered_attention(const Tensor& qkv, const AttentionSpec& spec);
  Tensor gathered_attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                                     const Tensor& lse, const AttentionSpec& spec);
  // The gathered keys (every rank's two chunks, rank by rank) in sequence order, and back.
  Tensor to_sequence_order(const Tensor& by_rank, std::int64_t chunk_rows);
  Tensor to_rank_order(const Tensor& by_position, std::int64_t chunk_rows);
  Rank::AttentionOut empty_result(const Tensor& qkv, const AttentionSpec& spec);
};

}  // namespace ranklab::parallel
