// ringzero-perf's command line: the input is split at newlines into arguments, the first line
// being the program name (so links such as all_reduce_perf are covered too). Bad arguments must
// end in ringzero::invalid_argument; anything else escaping is a crash.
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "cli.hpp"
#include "ringzero/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::vector<std::string_view> args;
  std::size_t begin = 0;
  while (begin <= text.size() && args.size() < 256) {
    const auto end = text.find('\n', begin);
    if (end == std::string_view::npos) {
      args.push_back(text.substr(begin));
      break;
    }
    args.push_back(text.substr(begin, end - begin));
    begin = end + 1;
  }
  const std::string_view program = args.empty() ? "ringzero-perf" : args.front();
  const std::span<const std::string_view> rest =
      args.empty() ? std::span<const std::string_view>() : std::span(args).subspan(1);
  try {
    const ringzero::perf::options o = ringzero::perf::parse_args(rest, program);
    static_cast<void>(o);
  } catch (const ringzero::error&) {
  }
  return 0;
}
