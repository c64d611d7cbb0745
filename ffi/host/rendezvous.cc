#include "rendezvous.h"

namespace moejax_ffi {

namespace {
std::mutex calls_mu;
std::map<Rendezvous::Key, std::shared_ptr<void>>& OpenCalls() {
  static auto* calls = new std::map<Rendezvous::Key, std::shared_ptr<void>>();  // never destroyed: no exit-order race
  return *calls;
}
}  // namespace

std::shared_ptr<Rendezvous::Call> Rendezvous::Join(const Key& key, int n_ranks) {
  std::lock_guard<std::mutex> g(calls_mu);
  auto& slot = OpenCalls()[key];
  if (!slot) {
    auto call = std::make_shared<Call>();
    call->pub.resize(n_ranks);
    call->arrived.assign(n_ranks, false);
    slot = call;
  }
  return std::static_pointer_cast<Call>(slot);
}

void Rendezvous::Forget(const Key& key, const std::shared_ptr<Call>& call) {
  std::lock_guard<std::mutex> g(calls_mu);
  auto it = OpenCalls().find(key);
  if (it != OpenCalls().end() && it->second == call) OpenCalls().erase(it);
}

std::string Rendezvous::Missing(const Call& c) {
  std::string here, missing;
  for (size_t r = 0; r < c.arrived.size(); ++r) (c.arrived[r] ? here : missing) += " " + std::to_string(r);
  return "arrived:" + (here.empty() ? std::string(" none") : here) + "; missing:" + (missing.empty() ? std::string(" none") : missing);
}

std::string DescribeKey(const Rendezvous::Key& key) {
  return std::string(std::get<2>(key) == 0 ? "moejax_ep_dispatch" : "moejax_ep_combine") + " (host, run " +
         std::to_string(std::get<0>(key)) + ", op " + std::to_string(std::get<1>(key)) + ")";
}

}  // namespace moejax_ffi
