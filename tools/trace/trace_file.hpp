// Reading the per-rank files RINGZERO_TRACE writes: a strict JSON parser (the files are plain
// JSON) and a line reader that accepts what a killed process leaves behind, a file without its
// closing bracket whose last line may be cut short.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ringzero::trace_tool {

struct json {
  enum class kind { null, boolean, number, string, array, object };
  kind k = kind::null;
  bool b = false;
  double num = 0;
  std::string str;
  std::vector<json> arr;
  // An object's members in file order: a struct completed after json, not a std::pair<std::string,
  // json>, which needs json complete where it is declared (Clang refuses it). The functions that
  // make a json are defined after the struct for the same reason.
  struct member;
  std::vector<member> obj;

  [[nodiscard]] const json* find(std::string_view key) const;
  [[nodiscard]] double number_or(std::string_view key, double fallback) const {
    const json* v = find(key);
    return v != nullptr && v->k == kind::number ? v->num : fallback;
  }
  [[nodiscard]] std::string string_or(std::string_view key, std::string fallback) const {
    const json* v = find(key);
    return v != nullptr && v->k == kind::string ? v->str : fallback;
  }
  json& set(std::string_view key, json v);
  static json number_value(double d);
  static json string_value(std::string s);
};

struct json::member {
  std::string first;
  json second;
};

inline const json* json::find(std::string_view key) const {
  for (const auto& [name, v] : obj)
    if (name == key) return &v;
  return nullptr;
}

inline json json::number_value(double d) {
  json j;
  j.k = kind::number;
  j.num = d;
  return j;
}

inline json json::string_value(std::string s) {
  json j;
  j.k = kind::string;
  j.str = std::move(s);
  return j;
}

inline json& json::set(std::string_view key, json v) {
  for (auto& [name, x] : obj)
    if (name == key) return x = std::move(v);
  obj.push_back(member{std::string(key), std::move(v)});
  return obj.back().second;
}

struct parse_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

namespace detail {

class parser {
 public:
  explicit parser(std::string_view s) : s_(s) {}

  json document() {
    json v = value();
    skip_ws();
    if (i_ != s_.size()) fail("text after the JSON value");
    return v;
  }

 private:
  [[noreturn]] void fail(std::string_view what) const {
    throw parse_error(fmt::format("{} at offset {}", what, i_));
  }
  void skip_ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\r' || s_[i_] == '\t'))
      ++i_;
  }
  bool eat(char c) {
    skip_ws();
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!eat(c)) fail(fmt::format("expected '{}'", c));
  }
  void literal(std::string_view word) {
    if (s_.substr(i_, word.size()) != word) fail("unknown literal");
    i_ += word.size();
  }

  json value() {
    if (++depth_ > 64) fail("nesting too deep");
    skip_ws();
    if (i_ >= s_.size()) fail("unexpected end of text");
    json v;
    const char c = s_[i_];
    if (c == '{') {
      ++i_;
      v.k = json::kind::object;
      if (!eat('}')) {
        do {
          skip_ws();
          std::string key = string();
          expect(':');
          v.obj.push_back(json::member{std::move(key), value()});
        } while (eat(','));
        expect('}');
      }
    } else if (c == '[') {
      ++i_;
      v.k = json::kind::array;
      if (!eat(']')) {
        do v.arr.push_back(value());
        while (eat(','));
        expect(']');
      }
    } else if (c == '"') {
      v.k = json::kind::string;
      v.str = string();
    } else if (c == 't') {
      literal("true");
      v.k = json::kind::boolean;
      v.b = true;
    } else if (c == 'f') {
      literal("false");
      v.k = json::kind::boolean;
    } else if (c == 'n') {
      literal("null");
    } else {
      v.k = json::kind::number;
      v.num = number();
    }
    --depth_;
    return v;
  }

  double number() {
    const std::size_t start = i_;
    if (i_ < s_.size() && s_[i_] == '-') ++i_;
    auto digits = [&] {
      const std::size_t d = i_;
      while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
      if (i_ == d) fail("expected a digit");
    };
    digits();
    if (i_ < s_.size() && s_[i_] == '.') {
      ++i_;
      digits();
    }
    if (i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
      ++i_;
      if (i_ < s_.size() && (s_[i_] == '+' || s_[i_] == '-')) ++i_;
      digits();
    }
    return std::strtod(std::string(s_.substr(start, i_ - start)).c_str(), nullptr);
  }

  std::string string() {
    if (i_ >= s_.size() || s_[i_] != '"') fail("expected a string");
    ++i_;
    std::string out;
    while (true) {
      if (i_ >= s_.size()) fail("unterminated string");
      const char c = s_[i_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) fail("unterminated escape");
      const char e = s_[i_++];
      switch (e) {
        case '"':
        case '\\':
        case '/':
          out += e;
          break;
        case 'n':
          out += '\n';
          break;
        case 't':
          out += '\t';
          break;
        case 'r':
          out += '\r';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'u': {
          if (i_ + 4 > s_.size()) fail("short \\u escape");
          const unsigned cp = static_cast<unsigned>(
              std::strtoul(std::string(s_.substr(i_, 4)).c_str(), nullptr, 16));
          i_ += 4;
          // The writer only escapes control characters; others are kept as UTF-8 bytes.
          if (cp < 0x80) {
            out += static_cast<char>(cp);
          } else if (cp < 0x800) {
            out += static_cast<char>(0xc0 | (cp >> 6));
            out += static_cast<char>(0x80 | (cp & 0x3f));
          } else {
            out += static_cast<char>(0xe0 | (cp >> 12));
            out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
            out += static_cast<char>(0x80 | (cp & 0x3f));
          }
          break;
        }
        default:
          fail("unknown escape");
      }
    }
  }

  std::string_view s_;
  std::size_t i_ = 0;
  int depth_ = 0;
};

inline void write_string(std::string& out, std::string_view s) {
  out += '"';
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
    } else {
      out += c;
    }
  }
  out += '"';
}

}  // namespace detail

/// Parses one JSON document strictly; parse_error says what and where.
[[nodiscard]] inline json parse_json(std::string_view text) {
  return detail::parser(text).document();
}

/// Compact JSON text of v.
inline void write_json(std::string& out, const json& v) {
  switch (v.k) {
    case json::kind::null:
      out += "null";
      break;
    case json::kind::boolean:
      out += v.b ? "true" : "false";
      break;
    case json::kind::number:
      out += fmt::format("{}", v.num);
      break;
    case json::kind::string:
      detail::write_string(out, v.str);
      break;
    case json::kind::array:
      out += '[';
      for (std::size_t i = 0; i < v.arr.size(); ++i) {
        if (i > 0) out += ',';
        write_json(out, v.arr[i]);
      }
      out += ']';
      break;
    case json::kind::object:
      out += '{';
      for (std::size_t i = 0; i < v.obj.size(); ++i) {
        if (i > 0) out += ',';
        detail::write_string(out, v.obj[i].first);
        out += ':';
        write_json(out, v.obj[i].second);
      }
      out += '}';
      break;
  }
}

/// One rank's file as read back.
struct rank_file {
  std::string path;
  int rank = -1;
  int size = 0;
  int instance = 0;
  /// Add to this file's timestamps to get rank 0's clock.
  double offset_us = 0;
  double rtt_us = 0;
  std::vector<json> events;
  /// Ended with "]": the process closed it. False for a killed or still running process.
  bool closed = false;
  /// The last line was cut short (the process died while writing it) and was skipped.
  bool torn_tail = false;
};

[[nodiscard]] inline std::string trim(std::string_view s) {
  std::size_t a = 0, b = s.size();
  while (a < b && (s[a] == ' ' || s[a] == '\t' || s[a] == '\r')) ++a;
  while (b > a && (s[b - 1] == ' ' || s[b - 1] == '\t' || s[b - 1] == '\r')) --b;
  return std::string(s.substr(a, b - a));
}

/// Reads a RINGZERO_TRACE file line by line. A missing "]" and a torn last line are accepted;
/// anything else that is not an event is a parse_error naming the file and line.
[[nodiscard]] inline rank_file read_rank_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw parse_error(fmt::format("{}: cannot open", path));
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(trim(line));
  while (!lines.empty() && lines.back().empty()) lines.pop_back();
  rank_file f;
  f.path = path;
  for (std::size_t n = 0; n < lines.size(); ++n) {
    std::string_view l = lines[n];
    if (l.empty()) continue;
    if (l == "]") {
      f.closed = true;
      continue;
    }
    if (l.front() == '[' || l.front() == ',') l.remove_prefix(1);
    json ev;
    try {
      ev = parse_json(l);
    } catch (const parse_error& e) {
      if (n + 1 == lines.size()) {
        f.torn_tail = true;
        break;
      }
      throw parse_error(fmt::format("{}:{}: not a trace event: {}", path, n + 1, e.what()));
    }
    if (ev.k != json::kind::object)
      throw parse_error(fmt::format("{}:{}: not a trace event (not an object)", path, n + 1));
    if (ev.string_or("ph", "") == "M" && ev.string_or("name", "") == "ringzero_clock") {
      if (const json* a = ev.find("args")) {
        f.rank = static_cast<int>(a->number_or("rank", -1));
        f.size = static_cast<int>(a->number_or("size", 0));
        f.instance = static_cast<int>(a->number_or("instance", 0));
        f.offset_us = a->number_or("offset_us", 0);
        f.rtt_us = a->number_or("rtt_us", 0);
      }
    }
    f.events.push_back(std::move(ev));
  }
  if (f.rank < 0)
    throw parse_error(fmt::format("{}: no ringzero_clock event; not a RINGZERO_TRACE file", path));
  return f;
}

/// The rank files named on a command line: files as given, directories' rank*.json.
[[nodiscard]] inline std::vector<rank_file> read_inputs(const std::vector<std::string>& args) {
  std::vector<std::string> paths;
  for (const auto& a : args) {
    if (std::filesystem::is_directory(a)) {
      std::vector<std::string> found;
      for (const auto& e : std::filesystem::directory_iterator(a)) {
        const auto name = e.path().filename().string();
        if (e.is_regular_file() && name.starts_with("rank") && name.ends_with(".json"))
          found.push_back(e.path().string());
      }
      std::sort(found.begin(), found.end());
      if (found.empty()) throw parse_error(fmt::format("{}: no rank*.json files in it", a));
      paths.insert(paths.end(), found.begin(), found.end());
    } else {
      paths.push_back(a);
    }
  }
  std::vector<rank_file> files;
  for (const auto& p : paths) files.push_back(read_rank_file(p));
  std::sort(files.begin(), files.end(), [](const rank_file& a, const rank_file& b) {
    return std::pair(a.instance, a.rank) < std::pair(b.instance, b.rank);
  });
  return files;
}

}  // namespace ringzero::trace_tool
