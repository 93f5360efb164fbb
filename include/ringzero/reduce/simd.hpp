// Which instruction set the host reduction loops (reduce/cpu.hpp) run on. The widest one the CPU
// offers is picked once per process; RINGZERO_SIMD=scalar|avx2|avx512 forces one, so tests and
// benchmarks can run each path. Every path gives the same bits as the scalar loop.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>

#include "ringzero/detail/env.hpp"
#include "ringzero/error.hpp"

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define RINGZERO_X86_SIMD 1
#include <cpuid.h>
#else
#define RINGZERO_X86_SIMD 0
#endif

namespace ringzero::reduction {

#if RINGZERO_X86_SIMD
namespace detail {
/// Clang's __builtin_cpu_supports does not know "f16c"; CPUID leaf 1 does.
[[nodiscard]] inline bool cpu_has_f16c() noexcept {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & bit_F16C) != 0;
}
}  // namespace detail
#endif

/// A code path of the host reductions.
enum class simd : std::uint8_t {
  scalar,  ///< plain C++ (whatever the compiler makes of it for the baseline target)
  avx2,    ///< 256-bit AVX2 with F16C
  avx512,  ///< 512-bit AVX-512 F, BW, VL and DQ
};

inline constexpr simd all_simd[] = {simd::scalar, simd::avx2, simd::avx512};

[[nodiscard]] constexpr std::string_view simd_name(simd s) noexcept {
  switch (s) {
    case simd::scalar:
      return "scalar";
    case simd::avx2:
      return "avx2";
    case simd::avx512:
      return "avx512";
  }
  return "?";
}

namespace detail {

[[nodiscard]] inline bool probe_simd(simd s) noexcept {
  switch (s) {
    case simd::scalar:
      return true;
#if RINGZERO_X86_SIMD
    case simd::avx2:
      return __builtin_cpu_supports("avx2") && cpu_has_f16c();
    case simd::avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             cpu_has_f16c();
#else
    case simd::avx2:
    case simd::avx512:
      return false;
#endif
  }
  return false;
}

}  // namespace detail

/// Whether this CPU (and this build) can run path s. Probed once: CPUID traps to the hypervisor
/// in a virtual machine, which would cost more than a small combine.
[[nodiscard]] inline bool simd_supported(simd s) noexcept {
  static const bool supported[] = {detail::probe_simd(simd::scalar), detail::probe_simd(simd::avx2),
                                   detail::probe_simd(simd::avx512)};
  const auto i = static_cast<std::size_t>(s);
  return i < std::size(supported) && supported[i];
}

namespace detail {

/// The path for a RINGZERO_SIMD value (none: the widest supported); a name that is unknown or
/// that this CPU cannot run is an invalid_argument naming it.
[[nodiscard]] inline simd choose_simd(std::optional<std::string_view> requested,
                                      bool (*supported)(simd)) {
  if (!requested) {
    for (const simd s : {simd::avx512, simd::avx2})
      if (supported(s)) return s;
    return simd::scalar;
  }
  for (const simd s : all_simd) {
    if (simd_name(s) != *requested) continue;
    if (!supported(s))
      throw invalid_argument("RINGZERO_SIMD=" + std::string(*requested) +
                             ": this CPU or build cannot run that path");
    return s;
  }
  throw invalid_argument("RINGZERO_SIMD='" + std::string(*requested) +
                         "' is not one of scalar, avx2, avx512");
}

}  // namespace detail

/// The path reduction::combine and finish_avg take: chosen on first use, from RINGZERO_SIMD or
/// the CPU, and kept for the life of the process.
[[nodiscard]] inline simd active_simd() {
  static const simd chosen = [] {
    const auto env = ringzero::detail::getenv_str("RINGZERO_SIMD");
    return detail::choose_simd(env ? std::optional<std::string_view>(*env) : std::nullopt,
                               simd_supported);
  }();
  return chosen;
}

}  // namespace ringzero::reduction
