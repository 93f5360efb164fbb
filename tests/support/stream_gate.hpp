// A host function that holds a CUDA stream until the test opens it (or 20 s pass): how the GPU
// tests make a stream that does not drain, for deadlines and ordering checks.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace test_support {

struct stream_gate {
  std::atomic<bool> open{false};
  static void CUDART_CB hold(void* p) {
    auto* g = static_cast<stream_gate*>(p);
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!g->open.load() && std::chrono::steady_clock::now() < give_up)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
};

}  // namespace test_support
