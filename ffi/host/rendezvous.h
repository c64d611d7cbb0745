// A process-wide rendezvous of the ranks of one collective call, for the host implementation:
// with N CPU devices in one process XLA:CPU runs each device's program on its own thread, so the
// ranks of one call meet here, publish pointers to their (XLA-owned) buffers, and read each
// other's directly: the model of MoRI's intra-node mode, where peers reach each other's symmetric
// buffers. The wait for peers is bounded: a missing rank is an error naming who did and did not
// arrive, never a hang.
#pragma once

#include <chrono>
#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

namespace moejax_ffi {

// What one rank publishes: its buffers (read by the others between the two barriers) and the
// sizes they must agree on.
struct Published {
  std::vector<const void*> buffers;
  std::vector<int64_t> sizes;
};

class Rendezvous {
 public:
  // Identifies one collective call: the execution (XLA's run id, shared by the devices of one
  // launch), the op (a per-call-site id from the lowering) and its kind (dispatch or combine).
  using Key = std::tuple<int64_t, int64_t, int>;

  // Runs one call: publish `mine` as `rank` of `n_ranks`; once all have arrived, `body` runs
  // with everyone's publications (indexed by rank) and may read their buffers; it returns once
  // every rank's body finished, so no buffer is released while a peer still reads it.
  // Returns "" on success, else what went wrong (timeout, mismatched sizes, duplicate rank).
  template <typename Body>
  static std::string Run(const Key& key, int rank, int n_ranks, Published mine, std::chrono::milliseconds timeout,
                         Body&& body);

 private:
  struct Call {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<Published> pub;
    std::vector<bool> arrived;
    int n_arrived = 0, n_done = 0;
    bool failed = false;
    std::string error;
  };
  // The open call of `key` (created by its first rank). Once every rank has arrived it is
  // forgotten, so the next call with the same key (a loop running the op again) opens a new one.
  static std::shared_ptr<Call> Join(const Key& key, int n_ranks);
  static void Forget(const Key& key, const std::shared_ptr<Call>& call);
  static std::string Missing(const Call& c);
};

std::string DescribeKey(const Rendezvous::Key& key);

template <typename Body>
std::string Rendezvous::Run(const Key& key, int rank, int n_ranks, Published mine,
                            std::chrono::milliseconds timeout, Body&& body) {
  if (rank < 0 || rank >= n_ranks) return "rank " + std::to_string(rank) + " outside [0, " + std::to_string(n_ranks) + ")";
  std::shared_ptr<Call> call = Join(key, n_ranks);
  std::unique_lock<std::mutex> lock(call->mu);
  auto fail = [&](std::string why) {
    if (!call->failed) {
      call->failed = true;
      call->error = why;
    }
    call->cv.notify_all();
    std::string error = call->error;
    lock.unlock();
    Forget(key, call);
    return DescribeKey(key) + ": " + error;
  };
  if (static_cast<int>(call->arrived.size()) != n_ranks)
    return fail("ranks disagree on n_ranks (" + std::to_string(call->arrived.size()) + " vs " + std::to_string(n_ranks) + ")");
  if (call->arrived[rank]) return fail("rank " + std::to_string(rank) + " arrived twice");
  if (call->n_arrived > 0) {
    const Published& first = call->pub[std::distance(call->arrived.begin(),
                                                     std::find(call->arrived.begin(), call->arrived.end(), true))];
    if (first.sizes != mine.sizes) return fail("rank " + std::to_string(rank) + "'s shapes differ from its peers'");
  }
  call->pub[rank] = std::move(mine);
  call->arrived[rank] = true;
  if (++call->n_arrived == n_ranks) {
    Forget(key, call);
    call->cv.notify_all();
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  if (!call->cv.wait_until(lock, deadline, [&] { return call->failed || call->n_arrived == n_ranks; }))
    return fail("timed out after " + std::to_string(timeout.count()) + " ms waiting for the other ranks (" +
                Missing(*call) + "); XLA did not run every device's program concurrently, or a rank failed");
  if (call->failed) return fail(call->error);
  lock.unlock();
  body(call->pub);  // reads peers' buffers; writes only this rank's outputs
  lock.lock();
  if (++call->n_done == n_ranks) call->cv.notify_all();
  // Unbounded, and safe: every rank has arrived and only runs its finite copy; leaving early
  // would let XLA free this rank's inputs while a peer still reads them.
  call->cv.wait(lock, [&] { return call->n_done == n_ranks; });
  return "";
}

}  // namespace moejax_ffi
