// The executor concept (ringzero/executor.hpp) as the schedules name it, and the one helper they
// share: a step hands the executor only the messages that carry data.
#pragma once

#include <span>
#include <vector>

#include "ringzero/executor.hpp"
#include "ringzero/types.hpp"

namespace ringzero::algorithms::schedule {

using ringzero::executor;
using ringzero::max_message_ids;
using ringzero::transfer;

namespace detail {

/// One step with its empty messages dropped. Sender and receiver compute the same lengths, so
/// both drop the same ones; a step left with nothing is not handed to the executor at all.
template <element E, executor<E> X>
void step(X& x, std::vector<transfer<const E>> sends, std::vector<transfer<E>> recvs) {
  std::erase_if(sends, [](const auto& t) { return t.count == 0; });
  std::erase_if(recvs, [](const auto& t) { return t.count == 0; });
  if (sends.empty() && recvs.empty()) return;
  x.exchange(std::span<const transfer<const E>>(sends), std::span<const transfer<E>>(recvs));
}

}  // namespace detail

}  // namespace ringzero::algorithms::schedule
