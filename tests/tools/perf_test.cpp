// ringzero-perf, run in this process over the loopback transport: its command line, its
// bandwidth arithmetic and its table, and full sweeps of every collective, type and op whose
// checks must find no wrong element, plus the proof that a wrong element fails the run.
#include <doctest/doctest.h>
#include <stdlib.h>
#include <unistd.h>

#include <bit>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <initializer_list>
#include <regex>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "checks.hpp"
#include "perf.hpp"
#include "ringzero/model/fabric.hpp"

namespace perf = ringzero::perf;
using test_support::scoped_env;

namespace {

struct result {
  int status = -1;
  std::string out;
};

// Runs ringzero-perf with `args` (split on spaces) and captures what it prints, error messages
// included; `extra`: the transports built in besides loopback (none by default).
result run(const std::string& args, const perf::transports& extra = {}) {
  std::vector<std::string> words;
  std::istringstream in(args);
  for (std::string w; in >> w;) words.push_back(w);
  const std::vector<std::string_view> views(words.begin(), words.end());
  std::FILE* f = std::tmpfile();
  REQUIRE(f != nullptr);
  result r;
  r.status = perf::main(views, "ringzero-perf", f, f, nullptr, extra);
  std::fflush(f);
  std::rewind(f);
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) r.out.append(buf, n);
  std::fclose(f);
  return r;
}

// The data rows of a table: lines that do not start with '#'.
std::vector<std::string> rows_of(const std::string& out) {
  std::vector<std::string> rows;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);)
    if (!line.empty() && line[0] != '#') rows.push_back(line);
  return rows;
}

// The two #wrong columns of a data row (fields 9 and 13).
std::pair<std::string, std::string> wrong_columns(const std::string& row) {
  std::istringstream in(row);
  std::vector<std::string> f;
  for (std::string w; in >> w;) f.push_back(w);
  REQUIRE_MESSAGE(f.size() == 13, "row has " << f.size() << " fields: " << row);
  return {f[8], f[12]};
}

void check_clean(const std::string& args, std::size_t expected_rows) {
  const result r = run(args);
  INFO("ringzero-perf " << args << "\n" << r.out);
  CHECK(r.status == 0);
  CHECK(r.out.find("# Out of bounds values : 0 OK") != std::string::npos);
  const auto rows = rows_of(r.out);
  CHECK(rows.size() == expected_rows);
  for (const auto& row : rows) {
    const auto [oop, ip] = wrong_columns(row);
    CHECK_MESSAGE(oop == "0", row);
    CHECK_MESSAGE(ip == "0", row);
  }
}

}  // namespace

TEST_CASE("sizes take nccl-tests' binary suffixes") {
  CHECK(perf::parse_size("-b", "8") == 8);
  CHECK(perf::parse_size("-b", "64K") == 65536);
  CHECK(perf::parse_size("-b", "1M") == 1048576);
  CHECK(perf::parse_size("-b", "1.5m") == 1572864);
  CHECK(perf::parse_size("-b", "2G") == 2147483648ULL);
  CHECK(perf::parse_size("-b", "4KiB") == 4096);
  CHECK_THROWS_AS((void)perf::parse_size("-b", "4X"), ringzero::invalid_argument);
  CHECK_THROWS_AS((void)perf::parse_size("-b", "lots"), ringzero::invalid_argument);
  // Found by fuzzing: converting a double past 2^64 to size_t is undefined.
  CHECK_THROWS_WITH_AS((void)perf::parse_size("-b", "1e30"), doctest::Contains("larger than"),
                       ringzero::invalid_argument);
  CHECK_THROWS_AS((void)perf::parse_size("-e", "17179869184G"), ringzero::invalid_argument);
}

TEST_CASE("the command line reads nccl-tests' flags") {
  const std::vector<std::string_view> args = {"all_reduce_perf",
                                              "-b",
                                              "8",
                                              "-e",
                                              "128M",
                                              "-f",
                                              "2",
                                              "-n",
                                              "7",
                                              "-w",
                                              "3",
                                              "-c",
                                              "0",
                                              "-o",
                                              "all",
                                              "-d",
                                              "all",
                                              "-a",
                                              "1",
                                              "-z",
                                              "1",
                                              "-t",
                                              "3",
                                              "-A",
                                              "ring",
                                              "-T",
                                              "loopback",
                                              "--root=all"};
  const perf::options o = perf::parse_args(args);
  CHECK(o.coll == ringzero::collective::all_reduce);
  CHECK(o.min_bytes == 8);
  CHECK(o.max_bytes == std::size_t{128} << 20);
  CHECK(o.step_factor == 2);
  CHECK(o.iters == 7);
  CHECK(o.warmup_iters == 3);
  CHECK(o.check == 0);
  CHECK(o.ops.size() == 5);
  CHECK(o.types.size() == 10);
  CHECK(o.average == perf::time_mode::avg);
  CHECK(o.blocking == 1);
  CHECK(o.threads == 3);
  CHECK(o.algo == ringzero::algorithm::ring);
  CHECK(o.transport == perf::transport_kind::loopback);
  CHECK(o.root == -1);

  const std::vector<std::string_view> none;
  CHECK(perf::parse_args(none, "/usr/bin/sendrecv_perf").coll == ringzero::collective::send_recv);
  const std::vector<std::string_view> glued = {"reduce", "-r1", "-dhalf", "-omin"};
  const perf::options g = perf::parse_args(glued);
  CHECK(g.root == 1);
  CHECK(g.types == std::vector<ringzero::dtype>{ringzero::dtype::float16});
  const std::vector<std::string_view> sock = {"all_gather", "-T", "socket"};
  CHECK(perf::parse_args(sock).transport == perf::transport_kind::socket);
  CHECK(g.ops == std::vector<ringzero::op>{ringzero::op::min});
}

TEST_CASE("bad command lines are refused with status 2") {
  CHECK(run("").status == 2);
  const result bad = run("all_wrong");
  CHECK(bad.status == 2);
  CHECK(bad.out.find("unknown collective 'all_wrong'") != std::string::npos);
  CHECK(run("all_reduce -b 1M -e 1K").status == 2);
  CHECK(run("all_reduce -x 1").status == 2);
  CHECK(run("all_reduce -o median").status == 2);
  CHECK(run("all_reduce -n").status == 2);
  const result root = run("broadcast -t 2 -r 5 -b 8 -e 8");
  CHECK(root.status == 3);
  CHECK(root.out.find("-r 5: root out of range for 2 ranks") != std::string::npos);
  const result h = run("--help");
  CHECK(h.status == 0);
  CHECK(h.out.find("usage: ringzero-perf") != std::string::npos);
}

TEST_CASE("a launcher environment that makes no launch is a clear error, not a one-rank run") {
  // Each with the default transport: the program must print one line and fail (status 2 for a
  // value that is no number, 3 for a launch that is incomplete), not run alone (each of N
  // processes would then measure a one-rank job) nor end in std::terminate.
  const struct {
    const char* rank;
    const char* world;
    const char* var;
    const char* value;
    int status;
    const char* says;
  } cases[] = {
      {"0", "abc", nullptr, nullptr, 2, "WORLD_SIZE"},
      {"1", nullptr, "MASTER_ADDR", "127.0.0.1", 3, "WORLD_SIZE is not set"},
      {nullptr, nullptr, "OMPI_COMM_WORLD_SIZE", "4", 3, "OMPI_COMM_WORLD_RANK is not set"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.says);
    const scoped_env rank("RANK", c.rank), world("WORLD_SIZE", c.world);
    const scoped_env other(c.var != nullptr ? c.var : "RINGZERO_PERF_UNUSED", c.value);
    const result r = run("all_reduce -b 1K -e 1K -n 1");
    CHECK(r.status == c.status);
    CHECK_MESSAGE(r.out.find(c.says) != std::string::npos, r.out);
    CHECK(r.out.find("all_reduce_perf") == std::string::npos);  // no table: nothing ran
  }
}

TEST_CASE("no -T: between hosts the socket transport unless something asks for libfabric") {
  const auto runner = [](const perf::options&, const perf::context&) { return 0; };
  perf::transports built;
  built.libfabric = runner;
  built.socket = runner;
  built.shm = runner;
  const auto choose = [&](std::initializer_list<std::string_view> extra_args = {}) {
    std::vector<std::string_view> args{"all_reduce"};
    args.insert(args.end(), extra_args.begin(), extra_args.end());
    return perf::automatic_transport(perf::parse_args(args), built);
  };
  const scoped_env addr("MASTER_ADDR", "127.0.0.1"), port("MASTER_PORT", "29500");
  const scoped_env no_provider("FI_PROVIDER", nullptr);
  {
    const scoped_env rank("RANK", nullptr), world("WORLD_SIZE", nullptr);
    CHECK(choose() == perf::transport_kind::loopback);  // not launched: one process
  }
  const scoped_env rank("RANK", "0"), world("WORLD_SIZE", "4"), local_rank("LOCAL_RANK", "0");
  {
    const scoped_env local("LOCAL_WORLD_SIZE", "4");  // every rank on this host
    CHECK(choose() == perf::transport_kind::libfabric);
  }
  const scoped_env local("LOCAL_WORLD_SIZE", "2");  // two hosts of two ranks
  CHECK(choose() == perf::transport_kind::socket);
  CHECK(choose({"-p", "efa"}) == perf::transport_kind::libfabric);  // a provider asked for by name
  CHECK(choose({"--memory", "device"}) == perf::transport_kind::libfabric);
  {
    const scoped_env provider("FI_PROVIDER", "tcp;ofi_rxm");
    CHECK(choose() == perf::transport_kind::libfabric);
  }
  built.efa_present = [] { return true; };  // an EFA host: libfabric's efa is the fast path
  CHECK(choose() == perf::transport_kind::libfabric);
  built.efa_present = nullptr;
  CHECK(choose({"-t", "2"}) == perf::transport_kind::loopback);  // threads are loopback ranks
}

TEST_CASE("--memory device: parsed, and refused clearly where it cannot run") {
  const std::string_view args[] = {"all_reduce", "-T", "libfabric", "--memory", "device"};
  CHECK(perf::parse_args(args).device_memory);
  const std::string_view host[] = {"all_reduce", "--memory=host"};
  CHECK_FALSE(perf::parse_args(host).device_memory);
  const result bad = run("all_reduce --memory gpu");
  CHECK(bad.status == 2);
  CHECK(bad.out.find("--memory: 'gpu' is neither host nor device") != std::string::npos);
  // Loopback and shm move host memory only.
  const result loopback = run("all_reduce -T loopback --memory device");
  CHECK(loopback.status == 2);
  CHECK(loopback.out.find("--memory device needs -T libfabric") != std::string::npos);
  // A build with libfabric but without CUDA: the libfabric runner is there, the device one not.
  bool host_runner_ran = false;
  perf::transports without_cuda;
  without_cuda.libfabric = [&](const perf::options&, const perf::context&) {
    host_runner_ran = true;
    return 0;
  };
  const result no_cuda = run("all_reduce -T libfabric --memory device", without_cuda);
  CHECK(no_cuda.status == 3);
  CHECK(no_cuda.out.find("--memory device: this ringzero-perf was built without CUDA") !=
        std::string::npos);
  CHECK_FALSE(host_runner_ran);
  // Where it is built in, the device runner gets the run, with the flag set.
  bool device_runner_ran = false;
  perf::transports with_cuda = without_cuda;
  with_cuda.libfabric_device = [&](const perf::options& o, const perf::context&) {
    device_runner_ran = o.device_memory;
    return 0;
  };
  CHECK(run("all_reduce -T libfabric --memory device", with_cuda).status == 0);
  CHECK(device_runner_ran);
  CHECK_FALSE(host_runner_ran);
}

TEST_CASE("sweeps visit nccl-tests' sizes") {
  const std::vector<std::string_view> f = {"all_reduce", "-b", "8", "-e", "64", "-f", "2"};
  CHECK(perf::sweep_sizes(perf::parse_args(f)) == std::vector<std::size_t>{8, 16, 32, 64});
  const std::vector<std::string_view> i = {"all_reduce", "-b", "10", "-e", "35", "-i", "10"};
  CHECK(perf::sweep_sizes(perf::parse_args(i)) == std::vector<std::size_t>{10, 20, 30});
}

TEST_CASE("bus bandwidth uses nccl-tests' factors") {
  using ringzero::collective;
  // 4 ranks, 1 s, 1e9 bytes of float in the row's full buffer.
  const std::size_t count = 250'000'000;
  auto bw = [&](collective c) {
    const auto sh = perf::shape_for(c, count * 4, 4, 4);
    return perf::bandwidth_for(c, sh, 4, 4, 1.0);
  };
  CHECK(bw(collective::all_reduce).alg == doctest::Approx(1.0));
  CHECK(bw(collective::all_reduce).bus == doctest::Approx(1.5));
  CHECK(bw(collective::reduce_scatter).alg == doctest::Approx(1.0));
  CHECK(bw(collective::reduce_scatter).bus == doctest::Approx(0.75));
  CHECK(bw(collective::all_gather).bus == doctest::Approx(0.75));
  CHECK(bw(collective::broadcast).bus == doctest::Approx(1.0));
  CHECK(bw(collective::reduce).bus == doctest::Approx(1.0));
  CHECK(bw(collective::send_recv).bus == doctest::Approx(1.0));
  for (collective c : {collective::all_to_all, collective::gather, collective::scatter}) {
    CHECK(bw(c).alg == doctest::Approx(1.0));
    CHECK(bw(c).bus == doctest::Approx(0.75));
  }

  // ringzero-model prints busbw through tuning::bus_bandwidth: the same figure for every row.
  for (collective c : {collective::all_reduce, collective::reduce_scatter, collective::all_gather,
                       collective::broadcast, collective::reduce, collective::send_recv,
                       collective::all_to_all, collective::gather, collective::scatter}) {
    INFO(ringzero::collective_name(c));
    CHECK(ringzero::tuning::bus_bandwidth(c, bw(c).alg * 1e9, 4, 1.0) ==
          doctest::Approx(bw(c).bus * 1e9));
  }

  const auto rs = perf::shape_for(collective::reduce_scatter, 1000, 4, 3);  // 250 floats
  CHECK(rs.param == 83);
  CHECK(rs.send == 249);
  CHECK(perf::row_bytes(rs, 4) == 996);
  // nccl-tests' alltoall, gather and scatter shapes: count/n per peer, n blocks in the full
  // buffer, gather's input and scatter's output at block rank() of it when in place.
  const auto a2a = perf::shape_for(collective::all_to_all, 1000, 4, 3);
  CHECK((a2a.param == 83 && a2a.send == 249 && a2a.recv == 249));
  CHECK((a2a.send_inplace_offset == 0 && a2a.recv_inplace_offset == 0));
  const auto g = perf::shape_for(collective::gather, 1000, 4, 3);
  CHECK((g.param == 83 && g.send == 83 && g.recv == 249 && g.send_inplace_offset == 83));
  const auto sc = perf::shape_for(collective::scatter, 1000, 4, 3);
  CHECK((sc.param == 83 && sc.send == 249 && sc.recv == 83 && sc.recv_inplace_offset == 83));
  const std::vector<std::string_view> none;
  CHECK(perf::parse_args(none, "alltoall_perf").coll == collective::all_to_all);
  CHECK(perf::parse_args(none, "gather_perf").coll == collective::gather);
  CHECK(perf::parse_args(none, "scatter_perf").coll == collective::scatter);
}

TEST_CASE("numbers fit nccl-tests' column widths") {
  CHECK(perf::fit(3.14159, 7) == "   3.14");
  CHECK(perf::fit(1234.5, 7) == "1234.50");
  CHECK(perf::fit(12345.6, 7) == "12345.6");
  CHECK(perf::fit(1234567.0, 7) == "1234567");
  CHECK(perf::fit(0.004, 6) == "  0.00");
  CHECK(perf::fit(123.456, 6) == "123.46");
  for (double v : {0.0, 1.0, 99.9, 1e3, 1e5, 1e6, 1e9, 1e12}) {
    CHECK(perf::fit(v, 7).size() == 7);
    CHECK(perf::fit(v, 6).size() == 6);
  }
}

TEST_CASE("the table has nccl-tests' header and one row per size") {
  const result r = run("all_reduce -t 2 -b 8 -e 1K -f 4 -n 2 -w 1 -A ring");
  INFO(r.out);
  CHECK(r.status == 0);
  CHECK(r.out.find("# nThread 2 nGpus 1 minBytes 8 maxBytes 1024 step: 4(factor) warmup iters: 1 "
                   "iters: 2 agg iters: 1 validation: 1 graph: 0") != std::string::npos);
  CHECK(std::regex_search(r.out, std::regex(R"(#\s+size\s+count\s+type\s+redop\s+root\s+time\s+)"
                                            R"(algbw\s+busbw\s+#wrong\s+time\s+algbw\s+busbw\s+)"
                                            R"(#wrong)")));
  const auto rows = rows_of(r.out);
  REQUIRE(rows.size() == 4);  // 8, 32, 128, 512
  CHECK(rows[0].substr(0, 12) == "           8");
  CHECK(rows[0].find("float     sum      -1") != std::string::npos);
  CHECK(r.out.find("# Avg bus bandwidth    : ") != std::string::npos);
  CHECK(r.out.find("# Collective test concluded: all_reduce_perf") != std::string::npos);
}

TEST_CASE("every collective, type and op checks clean on 2 and 3 loopback ranks") {
  // 8, 64 and 512 bytes: fewer elements than ranks, about one block each, several chunks.
  const std::string sweep = " -b 8 -e 512 -f 8 -n 1 -w 0 -d all";
  for (int ranks : {2, 3}) {
    const std::string t = " -t " + std::to_string(ranks);
    // Every root on 3 ranks; on 2, root 1 (a root other than 0 is the case worth covering).
    const std::string roots = ranks == 3 ? " -r all" : " -r 1";
    const std::size_t nroots = ranks == 3 ? 3 : 1;
    check_clean("all_reduce" + t + sweep + " -o all", 3 * 10 * 5);
    check_clean("reduce_scatter" + t + sweep + " -o all", 3 * 10 * 5);
    check_clean("all_gather" + t + sweep, 3 * 10);
    check_clean("broadcast" + t + sweep + roots, 3 * 10 * nroots);
    check_clean("reduce" + t + sweep + " -o all" + roots, 3 * 10 * 5 * nroots);
    check_clean("sendrecv" + t + sweep, 3 * 10);
    check_clean("alltoall" + t + sweep, 3 * 10);
    check_clean("gather" + t + sweep + roots, 3 * 10 * nroots);
    check_clean("scatter" + t + sweep + roots, 3 * 10 * nroots);
  }
}

TEST_CASE("each algorithm that applies checks clean") {
  const std::string sweep = " -t 3 -b 8 -e 64K -f 16 -n 2 -w 1 -d float -o sum";
  for (const char* a : {"ring", "tree", "rd", "rhd", "hier"}) {
    check_clean(std::string("all_reduce -A ") + a + sweep, 4);
  }
  check_clean("reduce_scatter -A rhd" + sweep, 4);
  check_clean("all_gather -A rd" + sweep, 4);
  check_clean("broadcast -A tree" + sweep, 4);
  check_clean("reduce -A tree" + sweep, 4);
  for (const char* a : {"pairwise", "bruck"})
    check_clean(std::string("alltoall -A ") + a + sweep, 4);
  for (const char* a : {"linear", "tree"}) {
    check_clean(std::string("gather -r 1 -A ") + a + sweep, 4);
    check_clean(std::string("scatter -r 2 -A ") + a + sweep, 4);
  }
}

TEST_CASE("a wrong element is counted and fails the run") {
  REQUIRE(::setenv("RINGZERO_PERF_CORRUPT", "1", 1) == 0);
  const result r = run("all_reduce -t 2 -b 64 -e 64 -n 1 -w 0 -A ring");
  const result g = run("all_gather -t 3 -b 64 -e 64 -n 1 -w 0 -d int8 -A ring");
  const result a = run("alltoall -t 3 -b 96 -e 96 -n 1 -w 0");
  const result gr = run("gather -t 3 -b 96 -e 96 -n 1 -w 0 -r 1");
  const result sc = run("scatter -t 3 -b 96 -e 96 -n 1 -w 0 -r 1");
  ::unsetenv("RINGZERO_PERF_CORRUPT");
  CHECK(a.status == 1);
  CHECK(gr.status == 1);
  CHECK(sc.status == 1);
  INFO(r.out);
  CHECK(r.status == 1);
  CHECK(r.out.find("# Out of bounds values : 2 FAILED") != std::string::npos);
  const auto rows = rows_of(r.out);
  REQUIRE(rows.size() == 1);
  CHECK(wrong_columns(rows[0]) == std::pair<std::string, std::string>{"1", "1"});
  CHECK(g.status == 1);
}

TEST_CASE("without -c the #wrong columns say N/A and the run passes") {
  const result r = run("all_reduce -t 2 -b 64 -e 64 -n 1 -c 0 -A ring");
  INFO(r.out);
  CHECK(r.status == 0);
  const auto rows = rows_of(r.out);
  REQUIRE(rows.size() == 1);
  CHECK(wrong_columns(rows[0]) == std::pair<std::string, std::string>{"N/A", "N/A"});
}

TEST_CASE("-J writes nccl-tests' JSON report") {
  std::string pattern = (std::filesystem::temp_directory_path() / "ringzero-perf-XXXXXX").string();
  const int fd = ::mkstemp(pattern.data());
  REQUIRE(fd >= 0);
  ::close(fd);
  const std::string path = pattern;
  ::unlink(path.c_str());  // -J refuses to overwrite; the name is now free and ours
  const result r = run("all_gather -t 2 -b 64 -e 128 -f 2 -n 1 -A ring -J " + path);
  CHECK(r.status == 0);
  std::FILE* f = std::fopen(path.c_str(), "r");
  REQUIRE(f != nullptr);
  std::string doc;
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) doc.append(buf, n);
  std::fclose(f);
  ::unlink(path.c_str());
  INFO(doc);
  CHECK(doc.starts_with("{\"version\":2,"));
  CHECK(doc.find("\"results\":[{\"size\":64,\"count\":8,\"type\":\"float\",\"redop\":\"none\","
                 "\"root\":\"    -1\",\"out_of_place\":{\"time\":") != std::string::npos);
  CHECK(doc.find("\"nwrong\":0.000000}") != std::string::npos);
  CHECK(doc.find("\"out_of_bounds\":{\"count\":0,\"okay\":\"true\"}") != std::string::npos);
  CHECK(doc.find("\"average_bus_bandwidth\":{\"bandwidth\":") != std::string::npos);
  CHECK(doc.find("\"end_time\":") != std::string::npos);
}

TEST_CASE("--tune fits alpha and beta by relative error") {
  const std::vector<double> m{8, 64, 1024, 65536, 1 << 20};
  std::vector<double> t;
  for (double x : m) t.push_back(2e-6 + x / 5e9);
  const perf::line_fit f = perf::fit_alpha_beta(m, t);
  CHECK(f.alpha == doctest::Approx(2e-6).epsilon(1e-9));
  CHECK(f.beta == doctest::Approx(1 / 5e9).epsilon(1e-9));
  CHECK(f.rms() < 1e-9);
  // Times that would need a negative alpha get the best line through the origin instead.
  const std::vector<double> steep{1e-9, 64e-9, 1024e-9, 65536e-9, 1.2e-3};
  const perf::line_fit g = perf::fit_alpha_beta(m, steep);
  CHECK(g.alpha == 0);
  CHECK(g.beta > 0);
  CHECK(g.residual.size() == m.size());
  const std::vector<double> flat{3e-6, 3e-6, 3e-6, 3e-6, 2e-6};
  CHECK_THROWS_AS((void)perf::fit_alpha_beta(m, flat), ringzero::invalid_argument);
}

TEST_CASE("--tune: one phase up to the last size where it is no more than 2 % slower") {
  const std::vector<std::size_t> sizes{1024, 2048, 4096, 8192};
  // One phase wins, ties within the margin, then loses: the limit is the tie's size.
  CHECK(perf::choose_one_phase_limit(sizes, std::vector<double>{1.0, 2.0, 3.05, 5.0},
                                     std::vector<double>{1.5, 2.5, 3.0, 4.0}) == 4096);
  // Losing once ends it, even where one phase would win again further on (noise, or a size
  // whose blocks stop fitting the cache, is not a reason to go back to one phase).
  CHECK(perf::choose_one_phase_limit(sizes, std::vector<double>{1.0, 3.0, 3.0, 3.0},
                                     std::vector<double>{1.5, 2.5, 4.0, 4.0}) == 1024);
  // One phase at every size, and at none (half the smallest size: nothing measured runs in it).
  CHECK(perf::choose_one_phase_limit(sizes, std::vector<double>(4, 1.0),
                                     std::vector<double>(4, 2.0)) == 8192);
  CHECK(perf::choose_one_phase_limit(sizes, std::vector<double>(4, 2.0),
                                     std::vector<double>(4, 1.0)) == 512);
  CHECK_THROWS_AS((void)perf::choose_one_phase_limit(sizes, std::vector<double>(3, 1.0),
                                                     std::vector<double>(4, 1.0)),
                  ringzero::invalid_argument);
}

TEST_CASE("--tune writes the transport's section of a tuning file, keeping the others") {
  std::string pattern = (std::filesystem::temp_directory_path() / "ringzero-tune-XXXXXX").string();
  const int fd = ::mkstemp(pattern.data());
  REQUIRE(fd >= 0);
  ::close(fd);
  const std::string path = pattern;
  {
    std::FILE* f = std::fopen(path.c_str(), "w");
    REQUIRE(f != nullptr);
    std::fputs("version = 1\n[shm]\nalpha = 1e-7\n", f);
    std::fclose(f);
  }
  // The fit is taken from real timings: on a loaded machine a sweep can come out flat, which
  // --tune refuses with a clear error (not what this case checks: the file it writes), so that
  // refusal alone is retried.
  result r = run("all_reduce -t 2 --tune " + path);
  for (int again = 0; again < 4 && r.status != 0 &&
                      r.out.find("the times do not grow with the size") != std::string::npos;
       ++again)
    r = run("all_reduce -t 2 --tune " + path);
  INFO(r.out);
  CHECK(r.status == 0);
  CHECK(r.out.find("# alpha = ") != std::string::npos);
  CHECK(r.out.find("rms residual") != std::string::npos);
  CHECK(r.out.find("# wrote [loopback] to " + path) != std::string::npos);
  const ringzero::tuning::tuning_file t = ringzero::tuning::read_tuning(path);
  ::unlink(path.c_str());
  REQUIRE(t.find("loopback") != nullptr);
  const auto& s = *t.find("loopback");
  CHECK(*s.alpha >= 0);
  CHECK(*s.beta > 0);
  CHECK(*s.gamma > 0);
  CHECK(s.measured.starts_with("2 ranks on "));
  REQUIRE(t.find("shm") != nullptr);
  CHECK(*t.find("shm")->alpha == 1e-7);

  const result one = run("all_reduce -t 1 --tune " + path);
  CHECK(one.status != 0);
  CHECK(one.out.find("--tune: alpha and beta are measured between ranks") != std::string::npos);
  CHECK(run("all_reduce -t 2 --tune").status == 2);
}

TEST_CASE("--tune's fit of the model's own predictions recovers the constants behind them") {
  // The predictions are linear in alpha, beta and gamma, so times the model itself predicted
  // for known constants must give those constants back.
  ringzero::tuning::policy truth = ringzero::loopback::world_options{}.tuning;
  truth.alpha = 3.5e-6;
  truth.beta = 1 / 6e9;
  truth.gamma = 1 / 11e9;
  for (int n : {2, 3, 4, 7}) {
    std::vector<double> ca, cb, c0, t;
    for (double s = 8; s <= 8 << 20; s *= 4)
      for (auto a : ringzero::tuning::candidates(ringzero::collective::all_reduce, false)) {
        const auto unit = [&](double x, double y, double z) {
          ringzero::tuning::policy p = truth;
          p.alpha = x;
          p.beta = y;
          p.gamma = z;
          return ringzero::tuning::predict(ringzero::collective::all_reduce, a, s, n, p);
        };
        ca.push_back(unit(1, 0, 0));
        cb.push_back(unit(0, 1, 0));
        c0.push_back(unit(0, 0, 1) * truth.gamma);
        t.push_back(ringzero::tuning::predict(ringzero::collective::all_reduce, a, s, n, truth));
      }
    const perf::line_fit f = perf::fit_alpha_beta(ca, cb, c0, t);
    INFO("n = " << n);
    CHECK(f.alpha == doctest::Approx(truth.alpha).epsilon(1e-6));
    CHECK(f.beta == doctest::Approx(truth.beta).epsilon(1e-6));
    CHECK(f.rms() < 1e-6);
  }
}

TEST_CASE("--reproducible: parsed, refused where it cannot apply, taken on device buffers") {
  const std::vector<std::string_view> args = {"reduce_scatter", "--reproducible", "-o", "avg"};
  CHECK(perf::parse_args(args).reproducible);
  const std::vector<std::string_view> plain = {"reduce_scatter"};
  CHECK_FALSE(perf::parse_args(plain).reproducible);
  const result gather = run("all_gather --reproducible");
  CHECK(gather.status == 2);
  CHECK(gather.out.find("--reproducible: all_gather adds nothing") != std::string::npos);
  const result prod = run("all_reduce --reproducible -o all");
  CHECK(prod.status == 2);
  CHECK(prod.out.find("prod has no reproducible form") != std::string::npos);
  CHECK(run("all_reduce --reproducible=1").status == 2);
  // On device buffers too: -T nccl with it ends as -T nccl without it does here (run on a
  // GPU, or refused for want of one or of NCCL), never on the option.
  const result nccl = run("all_reduce --reproducible -T nccl");
  CHECK(nccl.status == run("all_reduce -T nccl").status);
  CHECK(nccl.out.find("--reproducible") == std::string::npos);
  const result line = run("all_reduce -t 2 --reproducible -b 64 -e 64 -n 1 -w 0");
  CHECK(line.status == 0);
  CHECK(line.out.find("# Algorithm: auto (the cost model picks per call); reproducible sums") !=
        std::string::npos);
}

TEST_CASE("--reproducible inputs are not exactly summable in floating point") {
  // Were they, the bitwise check would pass any summation order: most sums of three must come
  // out differently when added in float left to right.
  int differ = 0;
  const int count = 1000;
  for (int i = 0; i < count; ++i) {
    const float t[3] = {perf::exact_sum_value<float>(0, static_cast<std::size_t>(i), 1),
                        perf::exact_sum_value<float>(1, static_cast<std::size_t>(i), 1),
                        perf::exact_sum_value<float>(2, static_cast<std::size_t>(i), 1)};
    const float naive = (t[0] + t[1]) + t[2];
    const float exact = ringzero::reproducible::serial_sum(t, 3);
    if (std::bit_cast<std::uint32_t>(naive) != std::bit_cast<std::uint32_t>(exact)) ++differ;
  }
  CHECK(differ > count / 10);
}

TEST_CASE("--reproducible sums check bitwise clean on 2 and 3 loopback ranks") {
  // 8 B to 32 KiB: one element, part of a block, several blocks, the gathered and the digit
  // paths; every algorithm the call takes.
  const std::string sweep = " --reproducible -b 8 -e 128K -f 16 -n 1 -w 0 -d all";
  for (int ranks : {2, 3}) {
    const std::string t = " -t " + std::to_string(ranks);
    check_clean("all_reduce" + t + sweep + " -o sum", 4 * 10);
    check_clean("all_reduce" + t + sweep + " -o avg -A ring", 4 * 10);
    check_clean("reduce_scatter" + t + sweep + " -o avg", 4 * 10);
    check_clean("reduce" + t + sweep + " -o sum -r all", 4 * 10 * static_cast<std::size_t>(ranks));
  }
  check_clean("all_reduce -t 3 --reproducible -b 64K -e 64K -n 1 -w 0 -d float -o min", 1);
}

TEST_CASE("--reproducible: a wrong sum is counted and fails the run") {
  const scoped_env corrupt("RINGZERO_PERF_CORRUPT", "1");
  const result r = run("all_reduce -t 3 --reproducible -b 1K -e 1K -n 1 -w 0 -d float -o sum");
  INFO(r.out);
  CHECK(r.status == 1);
  const auto rows = rows_of(r.out);
  REQUIRE(rows.size() == 1);
  CHECK(wrong_columns(rows[0]) == std::pair<std::string, std::string>{"1", "1"});
}

TEST_CASE("--wire: parsed, refused where it cannot apply, checked within the error bound") {
  const std::vector<std::string_view> args = {"all_gather", "--wire", "int4", "--wire-block", "64"};
  const perf::options o = perf::parse_args(args);
  CHECK(o.wire == ringzero::wire_format::int4);
  CHECK(o.wire_block == 64);
  for (const char* bad :
       {"broadcast --wire int8", "all_reduce --wire int8 -d int32", "all_reduce --wire int8 -o max",
        "all_reduce --wire int9", "all_reduce --wire int8 --reproducible",
        "all_gather --wire-block 0", "all_reduce --wire int8 --memory device -T libfabric"}) {
    INFO(bad);
    CHECK(run(bad).status == 2);
  }
  const result line = run("all_gather -t 2 --wire int8 -b 64 -e 64 -n 1 -w 0");
  CHECK(line.out.find("wire int8 in blocks of 256 (--wire: bandwidth counts the full-precision "
                      "bytes delivered)") != std::string::npos);
  // 3 ranks, every format, collective and element type, a block that leaves short blocks: clean
  // (avg on float only; test_quantized_collectives covers the world sizes).
  for (const std::string f : {"bf16", "int8", "int4"})
    for (const std::string c : {"all_gather", "reduce_scatter", "all_reduce"})
      for (const std::string t : {"float", "half", "bfloat16"})
        for (const std::string o : {"sum", "avg"})
          if (o == "sum" || (c != "all_gather" && t == "float"))
            check_clean(c + " -t 3 --wire " + f +
                            " --wire-block 100 -b 1K -e 64K -f 8 -n 1 -w 0 -d " + t + " -o " + o,
                        3);
  // The allowance is the error bound, not a blanket pass: a flipped element still fails.
  const scoped_env corrupt("RINGZERO_PERF_CORRUPT", "1");
  const result r = run("all_reduce -t 3 --wire int8 -b 1K -e 1K -n 1 -w 0 -d float -o sum");
  CHECK(r.status == 1);
  const auto rows = rows_of(r.out);
  REQUIRE(rows.size() == 1);
  CHECK(wrong_columns(rows[0]) == std::pair<std::string, std::string>{"1", "1"});
}
