// A view of a store under a key prefix: communicators built one after another over one store
// (an elastic job's generations) each see a fresh key space, so a key a former generation set
// never satisfies a wait of the next one.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ringzero/bootstrap/store.hpp"

namespace ringzero::bootstrap {

class prefixed_store final : public store {
 public:
  prefixed_store(std::shared_ptr<store> base, std::string prefix)
      : base_(std::move(base)), prefix_(std::move(prefix)) {}

  void set(std::string_view key, std::span<const std::byte> value) override {
    base_->set(k(key), value);
  }
  [[nodiscard]] std::vector<std::byte> get(std::string_view key) override {
    return base_->get(k(key));
  }
  std::int64_t add(std::string_view key, std::int64_t delta) override {
    return base_->add(k(key), delta);
  }
  void wait(std::span<const std::string> keys) override {
    std::vector<std::string> full;
    full.reserve(keys.size());
    for (const auto& key : keys) full.push_back(k(key));
    base_->wait(full);
  }
  std::int64_t add_within(std::string_view key, std::int64_t delta,
                          std::chrono::nanoseconds limit) override {
    return base_->add_within(k(key), delta, limit);
  }
  void set_within(std::string_view key, std::span<const std::byte> value,
                  std::chrono::nanoseconds limit) override {
    base_->set_within(k(key), value, limit);
  }
  [[nodiscard]] std::vector<std::byte> get_within(std::string_view key,
                                                  std::chrono::nanoseconds limit) override {
    return base_->get_within(k(key), limit);
  }
  // The base store outlives every generation: nothing to excuse or say farewell to here.

  [[nodiscard]] const std::string& prefix() const noexcept { return prefix_; }

 private:
  [[nodiscard]] std::string k(std::string_view key) const {
    std::string s = prefix_;
    s += key;
    return s;
  }

  std::shared_ptr<store> base_;
  std::string prefix_;
};

}  // namespace ringzero::bootstrap
