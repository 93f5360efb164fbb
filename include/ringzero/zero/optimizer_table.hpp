// The optimizers as a table: each is one rule type holding everything the library knows of it —
// its name, the fp32 moments it keeps per element, and its per-element arithmetic — and the
// table is the list of rules. Parsing, naming, the state's allocation (host and device), the host
// update loop, the emulated device space, the CUDA kernels and the checkpoint's arrays all read
// the rule; none tests for a particular optimizer. Adding one is a rule and its place in
// `builtin_optimizers` (tests/zero/optimizer_table_test.cpp adds one that exists only there).
//
// No formatting and no allocation, so CUDA translation units include it as it is.
#pragma once

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

#include "ringzero/error.hpp"
#include "ringzero/kernels/optimizer.hpp"

namespace ringzero::zero {

/// Names an optimizer in options and checkpoints: adamw (Adam with decoupled weight decay,
/// Loshchilov & Hutter) or sgd (with momentum). A rule outside the built-in table takes an
/// enumerator no built-in one uses.
enum class optimizer_kind : std::uint8_t { adamw, sgd };

/// What the library knows of an optimizer besides its arithmetic: its name, another name it
/// answers to, and the fp32 moments it keeps per element (1 or 2), in the order the state holds
/// them and a checkpoint's arrays follow the master weights.
struct optimizer_descriptor {
  optimizer_kind kind;
  std::string_view name;
  std::string_view alias;  ///< "" when there is none
  int moments;
  std::array<std::string_view, 2> moment_names;
};

/// An optimizer: its descriptor, a per-run factor computed once per segment (weight decay's
/// part, which depends on the parameter's decay flag), and one element's update, which returns
/// the new master weight and updates `master` and the moments in place (`m2` is a scratch value
/// when the rule keeps one moment). RINGZERO_HD functions, so the CUDA kernels run them too.
template <class R>
concept optimizer_rule = requires(float g, float& w, float& m1, float& m2,
                                  const kernels::optimizer_constants& c, bool decay, float f) {
  { R::descriptor } -> std::convertible_to<optimizer_descriptor>;
  { R::factor(c, decay) } -> std::same_as<float>;
  { R::step(g, w, m1, m2, c, f) } -> std::same_as<float>;
  requires(R::descriptor.moments == 1 || R::descriptor.moments == 2);
};

/// AdamW: kernels::adamw with the decoupled decay's keep factor.
struct adamw_rule {
  static constexpr optimizer_descriptor descriptor{
      optimizer_kind::adamw, "adamw", "adam", 2, {"exp_avg", "exp_avg_sq"}};
  RINGZERO_HD static float factor(const kernels::optimizer_constants& c, bool decay) noexcept {
    return kernels::adamw_keep(c, decay);
  }
  RINGZERO_HD static float step(float g, float& w, float& m1, float& m2,
                                const kernels::optimizer_constants& c, float keep) noexcept {
    return kernels::adamw(g, w, m1, m2, c, keep);
  }
};

/// SGD with (Nesterov) momentum: kernels::sgd with L2 decay where the parameter decays.
struct sgd_rule {
  static constexpr optimizer_descriptor descriptor{
      optimizer_kind::sgd, "sgd", "", 1, {"momentum", ""}};
  RINGZERO_HD static float factor(const kernels::optimizer_constants& c, bool decay) noexcept {
    return decay ? c.weight_decay : 0.0f;
  }
  RINGZERO_HD static float step(float g, float& w, float& m1, float&,
                                const kernels::optimizer_constants& c, float wd) noexcept {
    return kernels::sgd(g, w, m1, c, wd);
  }
};

template <optimizer_rule... Rules>
struct optimizer_table {
  static constexpr std::size_t size = sizeof...(Rules);
  static constexpr std::array<optimizer_descriptor, size> rows{Rules::descriptor...};

  /// The row of `k`, or nullptr when no rule of this table has it.
  [[nodiscard]] static constexpr const optimizer_descriptor* find(optimizer_kind k) noexcept {
    for (const optimizer_descriptor& d : rows)
      if (d.kind == k) return &d;
    return nullptr;
  }

  [[nodiscard]] static constexpr bool has(optimizer_kind k) noexcept {
    return ((Rules::descriptor.kind == k) || ...);
  }

  /// The row of `k`; throws invalid_argument for a kind no rule has.
  [[nodiscard]] static const optimizer_descriptor& at(optimizer_kind k) {
    if (const optimizer_descriptor* d = find(k)) return *d;
    throw invalid_argument("zero: no optimizer has kind " + std::to_string(static_cast<int>(k)));
  }

  /// Calls f(std::type_identity<Rule>{}) with the rule of `k`: where a loop or a kernel is
  /// instantiated per optimizer. Throws invalid_argument for a kind no rule has.
  template <class F>
  static void visit(optimizer_kind k, F&& f) {
    static_cast<void>(at(k));
    static_cast<void>(
        ((Rules::descriptor.kind == k ? (f(std::type_identity<Rules>{}), true) : false) || ...));
  }

  /// This table with more rules after its own.
  template <optimizer_rule... More>
  using with = optimizer_table<Rules..., More...>;
};

/// The optimizers ringzero ships.
using builtin_optimizers = optimizer_table<adamw_rule, sgd_rule>;

/// The built-in rows, for code that lists them.
inline constexpr const auto& optimizers = builtin_optimizers::rows;

/// A built-in kind's row (every optimizer_kind enumerator has one; checked below).
[[nodiscard]] constexpr const optimizer_descriptor& describe(optimizer_kind k) noexcept {
  const optimizer_descriptor* d = builtin_optimizers::find(k);
  return d != nullptr ? *d : optimizers[0];
}

static_assert(builtin_optimizers::has(optimizer_kind::adamw) &&
                  builtin_optimizers::has(optimizer_kind::sgd),
              "every optimizer_kind enumerator has its rule in builtin_optimizers");

}  // namespace ringzero::zero
