// Gloo's allreduce (Debian libgloo-dev: TCP transport, FileStore rendezvous) under ringzero-perf's
// procedure, for bench/compare. Ranks are separate processes started by the caller with
// RANK, WORLD_SIZE and GLOO_STORE_DIR (a directory all ranks share for the rendezvous). Gloo has
// no shared-memory transport, so on one host its messages go through loopback TCP.
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "peer.hpp"
#include "ringzero/detail/env.hpp"

namespace {

using context_ptr = std::shared_ptr<gloo::Context>;

void allreduce(const context_ptr& ctx, const float* in, float* out, std::size_t count) {
  gloo::AllreduceOptions opts(ctx);
  if (in != out) opts.setInput(const_cast<float*>(in), count);
  opts.setOutput(out, count);
  opts.setReduceFunction(
      static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
  gloo::allreduce(opts);
}

double slowest(const context_ptr& ctx, double mine) {
  gloo::AllreduceOptions opts(ctx);
  opts.setOutput(&mine, 1);
  opts.setReduceFunction(
      static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::max<double>));
  gloo::allreduce(opts);
  return mine;
}

double timed(const context_ptr& ctx, const ringzero::bench::peer_options& o, const float* in,
             float* out, std::size_t count) {
  allreduce(ctx, in, out, count);
  gloo::BarrierOptions b(ctx);
  gloo::barrier(b);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < o.iters; ++i) allreduce(ctx, in, out, count);
  const double mine =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / o.iters;
  return slowest(ctx, mine);
}

long checked(const context_ptr& ctx, float* in, float* out, std::size_t count) {
  const int rank = ctx->rank;
  ringzero::bench::peer_fill(in, count, rank);
  if (in != out) std::fill(out, out + count, -1e30f);
  allreduce(ctx, in, out, count);
  double wrong = static_cast<double>(ringzero::bench::peer_wrong(out, count, ctx->size));
  gloo::AllreduceOptions opts(ctx);
  opts.setOutput(&wrong, 1);
  opts.setReduceFunction(
      static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<double>));
  gloo::allreduce(opts);
  return static_cast<long>(wrong);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const auto o = ringzero::bench::parse_peer_options(argc, argv);
    const auto rank = ringzero::detail::getenv_int("RANK");
    const auto size = ringzero::detail::getenv_int("WORLD_SIZE");
    const auto dir = ringzero::detail::getenv_str("GLOO_STORE_DIR");
    if (!rank || !size || !dir)
      throw ringzero::invalid_argument("set RANK, WORLD_SIZE and GLOO_STORE_DIR");
    gloo::transport::tcp::attr attr;
    attr.hostname = "127.0.0.1";
    auto dev = gloo::transport::tcp::CreateDevice(attr);
    gloo::rendezvous::FileStore store(*dir);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(static_cast<int>(*rank),
                                                           static_cast<int>(*size));
    ctx->setTimeout(std::chrono::seconds(300));
    ctx->connectFullMesh(store, dev);
    const context_ptr c = ctx;

    const std::size_t max_count = o.max_bytes / sizeof(float);
    std::vector<float> send(max_count, 1.0f), recv(max_count, 1.0f);
    if (c->rank == 0) ringzero::bench::print_header("Gloo allreduce (TCP)", c->size, o);
    for (std::size_t s = o.min_bytes; s <= o.max_bytes; s *= 2)
      for (int w = 0; w < o.warmup; ++w) allreduce(c, send.data(), recv.data(), s / sizeof(float));
    int status = 0;
    for (std::size_t s : ringzero::bench::peer_sizes(o)) {
      const std::size_t count = s / sizeof(float);
      const double oop = timed(c, o, send.data(), recv.data(), count);
      const long oop_wrong = o.check ? checked(c, send.data(), recv.data(), count) : -1;
      const double ip = timed(c, o, recv.data(), recv.data(), count);
      const long ip_wrong = o.check ? checked(c, recv.data(), recv.data(), count) : -1;
      if (c->rank == 0) ringzero::bench::print_row(count, c->size, oop, oop_wrong, ip, ip_wrong);
      if (oop_wrong > 0 || ip_wrong > 0) status = 1;
    }
    return status;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gloo_allreduce: %s\n", e.what());
    return 2;
  }
}
