// ringzero-model: what ringzero's algorithms would do on a cluster this machine is not, from a
// description of its links (tools/model/fabrics/*.fabric). The predictions come from the cost
// model algorithm::automatic uses (model/cost_model.hpp), each level priced with its own links
// (model/fabric.hpp).
//
//   ringzero-model tools/model/fabrics/p5.fabric -N 2,64 -b 1M -e 1G
//   ringzero-model --section published tools/model/fabrics/p5.fabric
//   ringzero-model --write docs/scaling.md --csv docs/scaling.csv tools/model/fabrics/*.fabric
//   ringzero-model --check docs/scaling.md tools/model/fabrics/*.fabric
#include <fmt/core.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "fabric_file.hpp"
#include "report.hpp"
#include "ringzero/error.hpp"
#include "ringzero/types.hpp"
#include "ringzero/wire.hpp"

namespace {

using namespace ringzero;
using model::fabric_file;

constexpr const char* usage = R"(usage: ringzero-model [options] FABRIC...

Predicts ring, tree, rd, rhd and hierarchical collectives on the nodes a FABRIC file
describes (tools/model/fabrics/*.fabric), with the cost model algorithm::automatic uses, and
for comparison a ring striped over every NIC of a node, as NCCL runs it. `pick` is the
two-level model's choice, `auto-today` the one-level choice of algorithm::automatic.

  -c, --collective NAME  all_reduce (default), reduce_scatter or all_gather
  -w, --wire FORMAT      full (default), bf16, int8 or int4: price the collective with that
                         wire format (options::wire); busbw counts the elements' bytes
  --wire-block N         elements per scale of int8 and int4 (default 256)
  -d, --datatype TYPE    the elements, for --wire: float (default), half or bfloat16
  -N, --nodes LIST       comma-separated node counts (default 1,2,4,...,4096)
  -b, --minbytes SIZE    smallest size (default 8); K, M, G suffixes are powers of 1024
  -e, --maxbytes SIZE    largest size (default 8G)
  -f, --stepfactor F     size multiplier (default 2)
  --section NAME         print one markdown table: fabrics, published, all_reduce,
                         scatter_gather, crossover, zero, zeropp or architectures
  --write FILE.md        rewrite the tables between <!-- ringzero-model: ... --> markers
  --check FILE.md        exit 1 if those tables differ from what the model gives now
  --csv FILE             all_reduce bus bandwidth at 8 GiB per fabric, algorithm and node
                         count, and the published points (for the plot in docs/scaling.md)
  -h, --help             this text
)";

struct config {
  collective coll = collective::all_reduce;
  wire_format wire = wire_format::full;
  std::size_t wire_block = 0;
  double element_bytes = 4;
  std::vector<int> nodes = model::node_counts();
  double min_bytes = 8, max_bytes = 8 * model::gib, factor = 2;
  std::string section, write, check, csv;
  std::vector<std::string> files;
};

double parse_size(std::string_view s, const char* flag) {
  double scale = 1;
  if (!s.empty()) {
    const char last = s.back();
    if (last == 'K' || last == 'k') scale = model::kib;
    if (last == 'M' || last == 'm') scale = model::mib;
    if (last == 'G' || last == 'g') scale = model::gib;
    if (scale != 1) s.remove_suffix(1);
  }
  char* end = nullptr;
  const std::string text(s);
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || !(v > 0) || !std::isfinite(v))
    throw invalid_argument(fmt::format("{}: expected a positive size, got '{}'", flag, s));
  return v * scale;
}

config parse(int argc, char** argv) {
  config c;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    const auto value = [&]() -> std::string_view {
      if (i + 1 >= argc) throw invalid_argument(fmt::format("{} needs a value", a));
      return argv[++i];
    };
    if (a == "-h" || a == "--help") {
      std::fputs(usage, stdout);
      std::exit(0);
    } else if (a == "-c" || a == "--collective") {
      const std::string_view v = value();
      if (v == "all_reduce")
        c.coll = collective::all_reduce;
      else if (v == "reduce_scatter")
        c.coll = collective::reduce_scatter;
      else if (v == "all_gather")
        c.coll = collective::all_gather;
      else
        throw invalid_argument(
            fmt::format("--collective: '{}' is not all_reduce, reduce_scatter or all_gather", v));
    } else if (a == "-w" || a == "--wire") {
      c.wire = parse_wire_format(value());
    } else if (a == "--wire-block") {
      const double b = parse_size(value(), "--wire-block");
      if (b != std::floor(b) || b > static_cast<double>(max_wire_block))
        throw invalid_argument(
            fmt::format("--wire-block: {} elements (1 to {})", b, max_wire_block));
      c.wire_block = static_cast<std::size_t>(b);
    } else if (a == "-d" || a == "--datatype") {
      c.element_bytes = static_cast<double>(dtype_size(parse_dtype(value())));
    } else if (a == "-N" || a == "--nodes") {
      c.nodes.clear();
      std::istringstream list{std::string(value())};
      std::string item;
      while (std::getline(list, item, ',')) {
        char* end = nullptr;
        const long n = std::strtol(item.c_str(), &end, 10);
        if (item.empty() || *end != '\0' || n < 1 || n > 1 << 20)
          throw invalid_argument(fmt::format("--nodes: '{}' is not a node count", item));
        c.nodes.push_back(static_cast<int>(n));
      }
      if (c.nodes.empty()) throw invalid_argument("--nodes: empty list");
    } else if (a == "-b" || a == "--minbytes") {
      c.min_bytes = parse_size(value(), "--minbytes");
    } else if (a == "-e" || a == "--maxbytes") {
      c.max_bytes = parse_size(value(), "--maxbytes");
    } else if (a == "-f" || a == "--stepfactor") {
      c.factor = parse_size(value(), "--stepfactor");
      if (c.factor <= 1) throw invalid_argument("--stepfactor must be greater than 1");
    } else if (a == "--section") {
      c.section = value();
    } else if (a == "--write") {
      c.write = value();
    } else if (a == "--check") {
      c.check = value();
    } else if (a == "--csv") {
      c.csv = value();
    } else if (!a.empty() && a.front() == '-') {
      throw invalid_argument(fmt::format("unknown option '{}' (see --help)", a));
    } else {
      c.files.emplace_back(a);
    }
  }
  if (c.files.empty()) throw invalid_argument("no fabric file given (see --help)");
  if (c.min_bytes > c.max_bytes) throw invalid_argument("--minbytes is larger than --maxbytes");
  return c;
}

const fabric_file& by_name(const std::vector<fabric_file>& files, std::string_view name) {
  for (const fabric_file& f : files)
    if (f.fabric.name == name) return f;
  throw invalid_argument(fmt::format("no fabric named '{}' among the files given", name));
}

/// The markdown of section `name`; `arg` names a fabric for the per-fabric sections.
std::string section(const std::vector<fabric_file>& files, std::string_view name,
                    std::string_view arg) {
  if (name == "fabrics") return model::fabrics_section(files);
  if (name == "zero") return model::zero_section(files);
  if (name == "zeropp") return model::zeropp_section(files);
  if (name == "architectures") return model::architectures_section(files);
  const auto per_fabric = [&](auto fn) {
    if (!arg.empty()) return fn(by_name(files, arg));
    std::string out;
    for (const fabric_file& f : files) out += (out.empty() ? "" : "\n") + fn(f);
    return out;
  };
  if (name == "published") return per_fabric(model::published_section);
  if (name == "all_reduce") return per_fabric(model::all_reduce_section);
  if (name == "scatter_gather") return per_fabric(model::scatter_gather_section);
  if (name == "crossover") return per_fabric(model::crossover_section);
  throw invalid_argument(
      fmt::format("unknown section '{}' (expected fabrics, published, all_reduce, scatter_gather, "
                  "crossover, zero, zeropp or architectures)",
                  name));
}

constexpr std::string_view begin_marker = "<!-- ringzero-model: ";
constexpr std::string_view end_marker = "<!-- /ringzero-model -->";

/// `doc` with the text between each begin marker and the next end marker regenerated.
std::string regenerate(const std::vector<fabric_file>& files, const std::string& doc,
                       const std::string& path) {
  std::string out;
  std::size_t pos = 0;
  int sections = 0;
  while (true) {
    const std::size_t b = doc.find(begin_marker, pos);
    if (b == std::string::npos) break;
    const std::size_t close = doc.find("-->", b + begin_marker.size());
    const std::size_t e = doc.find(end_marker, b);
    if (close == std::string::npos || e == std::string::npos || e < close)
      throw invalid_argument(fmt::format("{}: unterminated ringzero-model marker", path));
    std::istringstream words(doc.substr(b + begin_marker.size(), close - b - begin_marker.size()));
    std::string name, arg;
    words >> name >> arg;
    out += doc.substr(pos, close + 3 - pos);
    out += "\n\n" + section(files, name, arg) + "\n";
    pos = e;
    ++sections;
  }
  if (sections == 0) throw invalid_argument(fmt::format("{}: no ringzero-model markers", path));
  return out + doc.substr(pos);
}

std::string read(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw invalid_argument(fmt::format("cannot open '{}'", path));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  if (!out) throw invalid_argument(fmt::format("cannot write '{}'", path));
}

std::string csv(const std::vector<fabric_file>& files) {
  std::string s = "fabric,nodes,algorithm,busbw_GBps\n";
  const collective c = collective::all_reduce;
  const double bytes = 8 * model::gib;
  for (const fabric_file& file : files) {
    const tuning::fabric& f = file.fabric;
    for (int nodes : model::node_counts()) {
      const int n = nodes * f.gpus_per_node;
      for (algorithm a : {algorithm::ring, algorithm::tree, algorithm::recursive_doubling,
                          algorithm::recursive_halving_doubling, algorithm::hierarchical}) {
        const double t = tuning::predict(f, c, a, bytes, nodes);
        if (std::isfinite(t))
          s += fmt::format("{},{},{},{:.2f}\n", f.name, nodes, algorithm_name(a),
                           tuning::bus_bandwidth(c, bytes, n, t) / 1e9);
      }
      s += fmt::format(
          "{},{},striped,{:.2f}\n", f.name, nodes,
          tuning::bus_bandwidth(c, bytes, n, tuning::predict_striped_ring(f, c, bytes, nodes)) /
              1e9);
    }
    for (const model::published_point& p : file.published)
      if (p.bytes == bytes)
        s += fmt::format("{},{},published,{:.2f}\n", f.name, p.nodes, p.busbw / 1e9);
  }
  return s;
}

/// --wire: the quantized collective's prediction per size, in columns the one-format table's
/// readers (bench/netbed) parse as a table of one algorithm named after the format.
void wire_table(const config& cfg, const fabric_file& file) {
  const tuning::fabric& f = file.fabric;
  const std::string name(wire_format_name(cfg.wire));
  for (int nodes : cfg.nodes) {
    const int n = nodes * f.gpus_per_node;
    fmt::print(
        "# {} {} with wire {}: {} node(s), {} GPUs; time in us, busbw in GB/s of the "
        "elements' bytes\n",
        f.name, collective_name(cfg.coll), name, nodes, n);
    fmt::print("#{:>12} {:>12} {:>8} {:>6}\n", "size", name + " time", "busbw", "pick");
    for (double x = cfg.min_bytes; x <= cfg.max_bytes * (1 + 1e-9); x *= cfg.factor) {
      const double bytes = std::round(x);
      const double t = tuning::predict_wire(f, cfg.coll, cfg.wire, cfg.wire_block,
                                            cfg.element_bytes, bytes, nodes);
      fmt::print(" {:>12.0f} {:>12.2f} {:>8.2f} {:>6}\n", bytes, t * 1e6,
                 tuning::bus_bandwidth(cfg.coll, bytes, n, t) / 1e9, name);
    }
  }
}

void table(const config& cfg, const fabric_file& file) {
  if (cfg.wire != wire_format::full) return wire_table(cfg, file);
  const tuning::fabric& f = file.fabric;
  const std::vector<algorithm> algos = tuning::candidates(cfg.coll, true);
  for (int nodes : cfg.nodes) {
    const int n = nodes * f.gpus_per_node;
    fmt::print("# {} {}: {} node(s), {} GPUs; time in us, busbw in GB/s\n", f.name,
               collective_name(cfg.coll), nodes, n);
    fmt::print("#{:>12}", "size");
    for (algorithm a : algos)
      fmt::print(" {:>12} {:>8}", fmt::format("{} time", algorithm_name(a)), "busbw");
    fmt::print(" {:>12} {:>8} {:>6} {:>10}\n", "striped time", "busbw", "pick", "auto-today");
    for (double x = cfg.min_bytes; x <= cfg.max_bytes * (1 + 1e-9); x *= cfg.factor) {
      const double bytes = std::round(x);
      fmt::print(" {:>12.0f}", bytes);
      for (algorithm a : algos) {
        const double t = tuning::predict(f, cfg.coll, a, bytes, nodes);
        if (std::isfinite(t))
          fmt::print(" {:>12.2f} {:>8.2f}", t * 1e6,
                     tuning::bus_bandwidth(cfg.coll, bytes, n, t) / 1e9);
        else
          fmt::print(" {:>12} {:>8}", "-", "-");
      }
      const double striped = tuning::predict_striped_ring(f, cfg.coll, bytes, nodes);
      fmt::print(" {:>12.2f} {:>8.2f}", striped * 1e6,
                 tuning::bus_bandwidth(cfg.coll, bytes, n, striped) / 1e9);
      fmt::print(" {:>6} {:>10}\n", algorithm_name(tuning::select(f, cfg.coll, bytes, nodes)),
                 algorithm_name(tuning::select_one_level(f, cfg.coll, bytes, nodes)));
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const config cfg = parse(argc, argv);
    std::vector<fabric_file> files;
    for (const std::string& path : cfg.files) files.push_back(model::load_fabric(path));
    bool printed = false;
    if (!cfg.section.empty()) {
      fmt::print("{}", section(files, cfg.section, ""));
      printed = true;
    }
    if (!cfg.write.empty()) {
      write_file(cfg.write, regenerate(files, read(cfg.write), cfg.write));
      printed = true;
    }
    if (!cfg.csv.empty()) {
      write_file(cfg.csv, csv(files));
      printed = true;
    }
    if (!cfg.check.empty()) {
      const std::string doc = read(cfg.check);
      if (regenerate(files, doc, cfg.check) != doc) {
        fmt::print(stderr,
                   "ringzero-model: the tables in {} differ from the model; regenerate them "
                   "with scripts/scaling.sh\n",
                   cfg.check);
        return 1;
      }
      fmt::print("{}: every table matches the model\n", cfg.check);
      printed = true;
    }
    if (!printed)
      for (const fabric_file& f : files) table(cfg, f);
    return 0;
  } catch (const ringzero::error& e) {
    fmt::print(stderr, "{}\n", e.what());
    return 2;
  }
}
