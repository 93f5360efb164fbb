#include <doctest/doctest.h>
#include <fmt/format.h>

#include <ringzero/zero/detail/crc32c.hpp>
#include <ringzero/zero/plan.hpp>

#include <string>
#include <vector>

namespace zero = ringzero::zero;

namespace {

zero::model_layout odd_layout(int variant) {
  // Sizes chosen to be prime, tiny, empty, or not a multiple of anything useful.
  const std::vector<std::vector<std::size_t>> sizes[] = {
      {{1}},
      {{7, 3}, {13}, {1, 1, 1}},
      {{1000, 31}, {0, 17}, {4099}, {5, 2, 97}},
      {{65537}, {3}},
  };
  zero::model_layout l;
  int li = 0;
  for (const auto& layer : sizes[variant]) {
    l.add_layer("layer" + std::to_string(li));
    int pi = 0;
    for (std::size_t n : layer)
      l.add({.name = fmt::format("l{}.p{}", li, pi++),
             .shape = {n},
             .type = ringzero::dtype::bfloat16});
    ++li;
  }
  return l;
}

}  // namespace

TEST_CASE("partition plans cover every element exactly once, aligned, for odd sizes and N = 1..9") {
  for (int variant = 0; variant < 4; ++variant) {
    const auto layout = odd_layout(variant);
    for (int n = 1; n <= 9; ++n) {
      for (std::size_t bucket : {std::size_t{0}, std::size_t{64}, std::size_t{5000}}) {
        for (std::size_t align : {std::size_t{1}, std::size_t{16}}) {
          CAPTURE(variant);
          CAPTURE(n);
          CAPTURE(bucket);
          CAPTURE(align);
          const zero::partition_plan plan(layout, n, bucket, align);
          REQUIRE(plan.padded_size() == plan.shard_size() * static_cast<std::size_t>(n));
          std::size_t real = 0;
          for (const auto& p : plan.params()) {
            CHECK(p.offset % align == 0);
            real += p.numel;
            const auto& b = plan.buckets()[static_cast<std::size_t>(p.bucket)];
            CHECK(p.offset >= b.offset);
            CHECK(p.offset + p.numel <= b.offset + b.used);
          }
          CHECK(plan.numel() == real);
          std::size_t shard = 0;
          for (const auto& b : plan.buckets()) {
            CHECK(b.padded % (static_cast<std::size_t>(n) * align) == 0);
            CHECK(b.slice * static_cast<std::size_t>(n) == b.padded);
            CHECK(b.slice % align == 0);
            CHECK(b.shard_offset == shard);
            CHECK(b.padded - b.used < static_cast<std::size_t>(n) * align);
            shard += b.slice;
          }
          CHECK(shard == plan.shard_size());
          // Every parameter element is owned by exactly one rank, at the place owner() says.
          std::vector<int> seen(plan.padded_size(), 0);
          for (int r = 0; r < n; ++r) {
            std::size_t prev_end = 0;
            for (const auto& s : plan.segments(r)) {
              const auto& p = plan.params()[static_cast<std::size_t>(s.param)];
              CHECK(s.begin + s.count <= p.numel);
              CHECK(s.flat_offset == p.offset + s.begin);
              CHECK(s.shard_offset >= prev_end);
              CHECK(s.shard_offset + s.count <= plan.shard_size());
              prev_end = s.shard_offset + s.count;
              const auto [owner, pos] = plan.owner(s.flat_offset);
              CHECK(owner == r);
              CHECK(pos == s.shard_offset);
              for (std::size_t k = 0; k < s.count; ++k) ++seen[s.flat_offset + k];
            }
          }
          std::size_t covered = 0;
          for (const auto& p : plan.params())
            for (std::size_t k = 0; k < p.numel; ++k) {
              CHECK_MESSAGE(seen[p.offset + k] == 1, p.name, "[", k, "] owned ", seen[p.offset + k],
                            " times, expected once");
              ++covered;
            }
          CHECK(covered == real);
        }
      }
    }
  }
}

TEST_CASE("a single bucket gives each rank the r-th contiguous 1/N of the flat buffer") {
  const auto layout = odd_layout(2);
  const zero::partition_plan plan(layout, 3, 0, 16);
  REQUIRE(plan.buckets().size() == 1);
  // 1000+31 -> 1008+32, 0+17 -> 0+32, 4099 -> 4112, 5+2+97 -> 16+16+112: 5328, to 48: 5328.
  CHECK(plan.padded_size() == 5328);
  CHECK(plan.shard_size() == 1776);
  for (int r = 0; r < 3; ++r)
    for (const auto& s : plan.segments(r)) {
      CHECK(s.flat_offset >= static_cast<std::size_t>(r) * 1776);
      CHECK(s.flat_offset + s.count <= static_cast<std::size_t>(r + 1) * 1776);
      CHECK(s.shard_offset == s.flat_offset - static_cast<std::size_t>(r) * 1776);
    }
}

TEST_CASE("buckets hold whole layers up to the bucket size") {
  const auto layout = odd_layout(2);
  const zero::partition_plan plan(layout, 2, 1100, 16);
  // layer0 (1040) fits; layer1 (32) joins it; layer2 (4112) is larger than a bucket: its own;
  // layer3 (144) starts a new one.
  REQUIRE(plan.buckets().size() == 3);
  CHECK(plan.buckets()[0].layer_count == 2);
  CHECK(plan.buckets()[1].layer_count == 1);
  CHECK(plan.buckets()[1].used == 4112);
  CHECK(plan.buckets()[2].first_layer == 3);
  for (const auto& l : plan.layers())
    for (int p = l.first_param; p < l.first_param + l.param_count; ++p)
      CHECK(plan.params()[static_cast<std::size_t>(p)].bucket == l.bucket);
}

TEST_CASE("the plan prints its buckets and what each rank owns") {
  const auto layout = odd_layout(1);
  const zero::partition_plan plan(layout, 2, 0, 16);
  const std::string s = fmt::format("{}", plan);
  CHECK(s.find("partition plan: 6 parameters in 3 layers, 26 elements (96 padded") !=
        std::string::npos);
  CHECK(s.find("2 ranks x 48 elements") != std::string::npos);
  CHECK(s.find("rank 0: l0.p0 l0.p1 l1.p0") != std::string::npos);
  CHECK(s.find("rank 1: l2.p0 l2.p1 l2.p2") != std::string::npos);
}

TEST_CASE("layouts reject names a checkpoint could not hold, and duplicates") {
  zero::model_layout l;
  CHECK_THROWS_AS(l.add({.name = "", .shape = {1}}), ringzero::invalid_argument);
  CHECK_THROWS_AS(l.add({.name = "a b", .shape = {1}}), ringzero::invalid_argument);
  l.add({.name = "w", .shape = {2, 3}});
  CHECK_THROWS_AS(l.add({.name = "w", .shape = {1}}), ringzero::invalid_argument);
  CHECK_THROWS_AS(zero::partition_plan(zero::model_layout{}, 2, 0), ringzero::invalid_argument);
  CHECK_THROWS_AS(zero::partition_plan(l, 0, 0), ringzero::invalid_argument);
  CHECK_THROWS_AS(zero::partition_plan(l, 2, 0, 12), ringzero::invalid_argument);
}

TEST_CASE("crc32c matches the Castagnoli check value and is incremental") {
  const std::string s = "123456789";
  const auto bytes = std::as_bytes(std::span(s));
  CHECK(zero::detail::crc32c(bytes) == 0xe3069283u);
  const auto part = zero::detail::crc32c_update(0, bytes.first(4));
  CHECK(zero::detail::crc32c_update(part, bytes.subspan(4)) == 0xe3069283u);
  std::string zeros(32, '\0');
  CHECK(zero::detail::crc32c(std::as_bytes(std::span(zeros))) == 0x8a9136aau);
}

TEST_CASE("all_segments lists every element once; unpadded drops the padding") {
  for (int variant = 0; variant < 4; ++variant)
    for (int world : {1, 3, 4}) {
      const zero::partition_plan plan(odd_layout(variant), world, 64, 8);
      // A flat buffer holding each element's registration-order index, padding -1.
      std::vector<long> flat(plan.padded_size(), -1);
      std::vector<int> seen(plan.numel(), 0);
      std::size_t start = 0;
      std::vector<std::size_t> starts;
      for (const auto& p : plan.params()) {
        starts.push_back(start);
        start += p.numel;
      }
      for (const auto& s : plan.all_segments())
        for (std::size_t k = 0; k < s.count; ++k) {
          const std::size_t at = starts[static_cast<std::size_t>(s.param)] + s.begin + k;
          ++seen[at];
          flat[s.flat_offset + k] = static_cast<long>(at);
        }
      for (int n : seen) CHECK(n == 1);
      const auto out = plan.unpadded(flat);
      REQUIRE(out.size() == plan.numel());
      for (std::size_t i = 0; i < out.size(); ++i) CHECK(out[i] == static_cast<long>(i));
    }
  const zero::partition_plan plan(odd_layout(1), 2, 0);
  CHECK_THROWS_AS((void)plan.unpadded(std::vector<float>(plan.padded_size() + 1)),
                  ringzero::invalid_argument);
}

TEST_CASE("a shared parameter stays one parameter; its using layers hold its bucket") {
  zero::model_layout l;
  l.add_layer("embed");
  const int wte = l.add({.name = "wte", .shape = {10, 4}});
  l.add_layer("block");
  l.add({.name = "w", .shape = {40}});
  l.add_layer("head");
  l.share(wte);
  const int bias = l.add({.name = "head.bias", .shape = {10}});
  // 48 elements per bucket: embed, block and head each get their own.
  const zero::partition_plan plan(l, 3, 48, 16);
  REQUIRE(plan.params().size() == 3);
  CHECK(plan.numel() == 40 + 40 + 10);
  CHECK(plan.params()[static_cast<std::size_t>(wte)].uses == 2);
  CHECK(plan.params()[static_cast<std::size_t>(bias)].uses == 1);
  REQUIRE(plan.layers().size() == 3);
  const auto& head = plan.layers()[2];
  CHECK(head.param_count == 1);
  CHECK(head.shared == std::vector<int>{wte});
  CHECK(head.shared_buckets == std::vector<int>{plan.params()[0].bucket});
  CHECK(head.bucket != plan.params()[0].bucket);
  CHECK(plan.layers()[0].shared_buckets.empty());
  // In one bucket the using layer needs no other.
  const zero::partition_plan one(l, 3, 0, 16);
  CHECK(one.layers()[2].shared == std::vector<int>{wte});
  CHECK(one.layers()[2].shared_buckets.empty());
}

TEST_CASE("share() refuses an unknown parameter, its own layer's, a repeat, and no open layer") {
  zero::model_layout l;
  const int loose = l.add({.name = "loose", .shape = {3}});
  CHECK_THROWS_WITH_AS(l.share(loose),
                       "ringzero: share(loose): no open layer; call add_layer() before share()",
                       ringzero::invalid_argument);
  l.add_layer("a");
  const int a = l.add({.name = "a.w", .shape = {3}});
  CHECK_THROWS_WITH_AS(l.share(a),
                       "ringzero: share(a.w): the parameter belongs to layer 'a' itself",
                       ringzero::invalid_argument);
  CHECK_THROWS_WITH_AS(l.share(7), "ringzero: share: parameter id 7 of 2 registered",
                       ringzero::invalid_argument);
  CHECK_THROWS_WITH_AS(l.share(-1), "ringzero: share: parameter id -1 of 2 registered",
                       ringzero::invalid_argument);
  l.add_layer("b");
  l.share(a);
  l.share(loose);
  CHECK_THROWS_WITH_AS(l.share(a), "ringzero: share(a.w): already shared into layer 'b'",
                       ringzero::invalid_argument);
  CHECK(l.layers().back().shared == std::vector<int>{a, loose});
}
