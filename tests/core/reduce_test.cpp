#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "reference.hpp"
#include "ringzero/error.hpp"
#include "ringzero/reduce/cpu.hpp"

using ringzero::bfloat16;
using ringzero::float16;
using ringzero::op;
namespace reduction = ringzero::reduction;

namespace {

template <class T>
T combine1(op o, T a, T b) {
  T out{};
  reduction::combine(o, &a, &b, &out, 1);
  return out;
}

template <class T>
T avg_of(T sum, int ranks) {
  reduction::finish_avg(&sum, 1, ranks);
  return sum;
}

template <class F>
void for_each_integer(F&& f) {
  f(std::int8_t{});
  f(std::uint8_t{});
  f(std::int32_t{});
  f(std::uint32_t{});
  f(std::int64_t{});
  f(std::uint64_t{});
}

}  // namespace

TEST_CASE("integer sum and prod wrap modulo 2^bits") {
  for_each_integer([](auto zero) {
    using T = decltype(zero);
    using L = std::numeric_limits<T>;
    INFO(ringzero::dtype_name(ringzero::dtype_of<T>()));
    CHECK(combine1<T>(op::sum, L::max(), T{1}) == L::min());
    CHECK(combine1<T>(op::sum, L::min(), static_cast<T>(-1)) == L::max());
    // 2^(bits/2) squared is 2^bits: zero after wrapping.
    const T half = static_cast<T>(T{1} << (sizeof(T) * 4));
    CHECK(combine1<T>(op::prod, half, half) == T{0});
    CHECK(combine1<T>(op::prod, L::max(), L::max()) == T{1});  // (2^b - 1)^2 or (2^(b-1) - 1)^2
    CHECK(combine1<T>(op::prod, T{3}, T{5}) == T{15});
  });
  CHECK(combine1<std::int8_t>(op::prod, -1, -128) == -128);
  CHECK(combine1<std::int8_t>(op::prod, 100, 3) == 44);  // 300 - 256
  CHECK(combine1<std::uint8_t>(op::prod, 200, 2) == 144);
  CHECK(combine1<std::uint8_t>(op::sum, 200, 100) == 44);
}

TEST_CASE("integer min and max order signed values as signed") {
  CHECK(combine1<std::int8_t>(op::min, -5, 3) == -5);
  CHECK(combine1<std::int8_t>(op::max, -5, 3) == 3);
  CHECK(combine1<std::uint8_t>(op::min, 250, 3) == 3);
  CHECK(combine1<std::int64_t>(op::min, std::numeric_limits<std::int64_t>::min(), 0) ==
        std::numeric_limits<std::int64_t>::min());
  CHECK(combine1<std::uint64_t>(op::max, ~std::uint64_t{0}, 1) == ~std::uint64_t{0});
}

TEST_CASE("integer avg truncates toward zero, in a type wide enough for any rank count") {
  CHECK(avg_of<std::int32_t>(7, 2) == 3);
  CHECK(avg_of<std::int32_t>(-7, 2) == -3);
  CHECK(avg_of<std::int8_t>(-100, 3) == -33);
  CHECK(avg_of<std::int8_t>(100, 200) == 0);  // 200 ranks does not fit int8
  CHECK(avg_of<std::uint8_t>(255, 2) == 127);
  CHECK(avg_of<std::uint64_t>(~std::uint64_t{0}, 3) == ~std::uint64_t{0} / 3);
  CHECK(avg_of<std::int64_t>(std::numeric_limits<std::int64_t>::min(), 2) ==
        std::numeric_limits<std::int64_t>::min() / 2);
  CHECK(avg_of<std::int32_t>(5, 1) == 5);
}

TEST_CASE("float16 rounds every step to nearest even") {
  CHECK(float(combine1(op::sum, float16(2048.0f), float16(1.0f))) == 2048.0f);  // tie -> even
  CHECK(float(combine1(op::sum, float16(2048.0f), float16(3.0f))) == 2052.0f);  // tie -> even
  CHECK(float(combine1(op::sum, float16(1.0f), float16(0x1p-11f))) == 1.0f);
  CHECK(float(combine1(op::sum, float16(1.0f), float16(3 * 0x1p-11f))) == 1.0f + 0x1p-9f);
  const float16 x(1.0f + 0x1p-10f);
  CHECK(float(combine1(op::prod, x, x)) == 1.0f + 0x1p-9f);  // 1 + 2^-9 + 2^-20 rounds down
  CHECK(std::isinf(float(combine1(op::sum, float16(65504.0f), float16(32.0f)))));
  CHECK(float(combine1(op::min, float16(-2.0f), float16(1.0f))) == -2.0f);
  CHECK(float(combine1(op::max, float16(-2.0f), float16(1.0f))) == 1.0f);
  CHECK(avg_of(float16(1.0f), 3).bits == float16(1.0f / 3.0f).bits);
  CHECK(float(avg_of(float16(3.0f), 2)) == 1.5f);
}

TEST_CASE("bfloat16 rounds every step to nearest even") {
  CHECK(float(combine1(op::sum, bfloat16(1.0f), bfloat16(0x1p-8f))) == 1.0f);
  CHECK(float(combine1(op::sum, bfloat16(256.0f), bfloat16(1.0f))) == 256.0f);
  CHECK(float(combine1(op::sum, bfloat16(256.0f), bfloat16(3.0f))) == 260.0f);
  const bfloat16 x(1.0f + 0x1p-7f);
  CHECK(float(combine1(op::prod, x, x)) == 1.0f + 0x1p-6f);  // 1 + 2^-6 + 2^-14 rounds down
  CHECK(avg_of(bfloat16(1.0f), 3).bits == bfloat16(1.0f / 3.0f).bits);
}

TEST_CASE("combine accepts an output aliasing either input") {
  std::vector<float> a = {1, 2, 3}, b = {10, 20, 30};
  reduction::combine(op::sum, a.data(), b.data(), a.data(), a.size());
  CHECK(a == std::vector<float>{11, 22, 33});
  reduction::combine(op::max, a.data(), b.data(), b.data(), b.size());
  CHECK(b == std::vector<float>{11, 22, 33});
}

TEST_CASE("combine agrees with the serial reference for every type and op") {
  auto run = [](auto zero) {
    using T = decltype(zero);
    for (op o : ringzero::all_ops) {
      INFO(ringzero::dtype_name(ringzero::dtype_of<T>()) << " " << ringzero::op_name(o));
      for (std::size_t i = 0; i < 200; ++i) {
        const T a = ringzero::testing::input_value<T>(7, 0, i, o);
        const T b = ringzero::testing::input_value<T>(7, 1, i, o);
        T got = combine1(o, a, b);
        if (o == op::avg) reduction::finish_avg(&got, 1, 2);
        const auto want =
            ringzero::testing::reduce_serial<T>(o, 2, [&](int j) { return j ? b : a; });
        CHECK(ringzero::testing::matches(want, got));
      }
    }
  };
  for_each_integer(run);
  run(float16{});
  run(float{});
  run(double{});
  run(bfloat16{});
}

TEST_CASE("combine rejects an op code it does not know") {
  float a = 1, b = 2, c = 0;
  CHECK_THROWS_AS(reduction::combine(static_cast<op>(9), &a, &b, &c, 1),
                  ringzero::invalid_argument);
}
