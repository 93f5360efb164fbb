// The GPT demo's data: a text as a sequence of byte tokens over the bytes it contains, and the
// training batches drawn from it. A batch is a pure function of (seed, step, sequence index), so
// any rank can cut any sequence and a run sees the same global batches at every world size.
#pragma once

#include <ringzero/error.hpp>

#include <fmt/format.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <span>
#include <string>
#include <vector>

#include "model.hpp"

namespace gpt {

class corpus {
 public:
  /// Tokens are the distinct bytes of `text`, in byte order (a UTF-8 character of two bytes is
  /// two tokens).
  explicit corpus(std::string text) : text_(std::move(text)) {
    std::array<bool, 256> seen{};
    for (unsigned char ch : text_) seen[ch] = true;
    id_.fill(-1);
    for (int b = 0; b < 256; ++b)
      if (seen[static_cast<std::size_t>(b)]) {
        id_[static_cast<std::size_t>(b)] = static_cast<int>(bytes_.size());
        bytes_.push_back(static_cast<unsigned char>(b));
      }
    ids_.reserve(text_.size());
    for (unsigned char ch : text_) ids_.push_back(id_[ch]);
  }

  static corpus from_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw ringzero::invalid_argument(fmt::format("cannot read the text file '{}'", path));
    return corpus(std::string(std::istreambuf_iterator<char>(in), {}));
  }

  [[nodiscard]] int vocab() const noexcept { return static_cast<int>(bytes_.size()); }
  [[nodiscard]] std::size_t size() const noexcept { return ids_.size(); }
  [[nodiscard]] std::span<const int> ids() const noexcept { return ids_; }

  /// Token of a byte, or -1 if the text never contains it.
  [[nodiscard]] int token(unsigned char b) const noexcept { return id_[b]; }
  [[nodiscard]] char byte(int token) const noexcept {
    return static_cast<char>(bytes_[static_cast<std::size_t>(token)]);
  }

  /// Sequence `index` of step `step`: `len` tokens from a pseudo-random place, and the tokens
  /// that follow each of them.
  void sequence(std::uint64_t seed, std::uint64_t step, std::uint64_t index, int len, int* tokens,
                int* targets) const {
    const auto l = static_cast<std::size_t>(len);
    if (ids_.size() < l + 1)
      throw ringzero::invalid_argument(
          fmt::format("the text has {} bytes, a sequence needs {}", ids_.size(), l + 1));
    const std::size_t start = hash(seed, 0x7e47 + step, index) % (ids_.size() - l);
    for (std::size_t i = 0; i < l; ++i) {
      tokens[i] = ids_[start + i];
      targets[i] = ids_[start + i + 1];
    }
  }

 private:
  std::string text_;
  std::vector<unsigned char> bytes_;
  std::array<int, 256> id_{};
  std::vector<int> ids_;
};

}  // namespace gpt
