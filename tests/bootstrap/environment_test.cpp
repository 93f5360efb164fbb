#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ringzero/bootstrap/environment.hpp"
#include "ringzero/bootstrap/file_store.hpp"
#include "ringzero/bootstrap/rendezvous.hpp"
#include "ringzero/bootstrap/tcp_store.hpp"

namespace rb = ringzero::bootstrap;

namespace {

// Every variable detect_launch() reads: a test starts from none of them set (whatever launched
// the test binary) and gets the original values back afterwards.
const char* const launch_variables[] = {"RANK",
                                        "WORLD_SIZE",
                                        "LOCAL_RANK",
                                        "LOCAL_WORLD_SIZE",
                                        "MASTER_ADDR",
                                        "MASTER_PORT",
                                        "RINGZERO_TOKEN",
                                        "RINGZERO_LAUNCHER",
                                        "RINGZERO_STORE",
                                        "RINGZERO_SOCKET_IFNAME",
                                        "TORCHELASTIC_RUN_ID",
                                        "OMPI_COMM_WORLD_RANK",
                                        "OMPI_COMM_WORLD_SIZE",
                                        "OMPI_COMM_WORLD_LOCAL_RANK",
                                        "OMPI_COMM_WORLD_LOCAL_SIZE",
                                        "OMPI_MCA_ess_base_jobid",
                                        "PMIX_NAMESPACE",
                                        "SLURM_PROCID",
                                        "SLURM_NTASKS",
                                        "SLURM_NPROCS",
                                        "SLURM_LOCALID",
                                        "SLURM_NODEID",
                                        "SLURM_NTASKS_PER_NODE",
                                        "SLURM_STEP_TASKS_PER_NODE",
                                        "SLURM_STEP_NODELIST",
                                        "SLURM_JOB_NODELIST",
                                        "SLURM_NODELIST",
                                        "SLURM_JOB_ID",
                                        "SLURM_STEP_ID",
                                        "SLURM_STEPID"};

class scoped_env {
 public:
  scoped_env() : scoped_env(std::map<std::string, std::string>{}) {}
  explicit scoped_env(const std::map<std::string, std::string>& vars) {
    for (const char* name : launch_variables) {
      const char* v = std::getenv(name);
      saved_.emplace_back(name, v ? std::optional<std::string>(v) : std::nullopt);
      ::unsetenv(name);
    }
    for (const auto& [k, v] : vars) ::setenv(k.c_str(), v.c_str(), 1);
  }
  scoped_env(const scoped_env&) = delete;
  scoped_env& operator=(const scoped_env&) = delete;
  ~scoped_env() {
    for (const auto& [name, v] : saved_) {
      if (v)
        ::setenv(name.c_str(), v->c_str(), 1);
      else
        ::unsetenv(name.c_str());
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

// The message of the ringzero::error detect_launch() throws under `vars` ("" if none).
template <class Error = ringzero::error>
std::string launch_error(const std::map<std::string, std::string>& vars) {
  scoped_env env(vars);
  try {
    static_cast<void>(rb::detect_launch());
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

const std::map<std::string, std::string> slurm_vars = {{"SLURM_PROCID", "5"},
                                                       {"SLURM_NTASKS", "8"},
                                                       {"SLURM_LOCALID", "1"},
                                                       {"SLURM_NODEID", "1"},
                                                       {"SLURM_STEP_TASKS_PER_NODE", "4(x2)"},
                                                       {"SLURM_STEP_NODELIST", "node[07-08]"},
                                                       {"SLURM_JOB_NODELIST", "other[1-9]"},
                                                       {"SLURM_JOB_ID", "1234"},
                                                       {"SLURM_STEP_ID", "2"}};

std::map<std::string, std::string> with(std::map<std::string, std::string> base,
                                        const std::map<std::string, std::string>& changes) {
  for (const auto& [k, v] : changes) {
    if (v.empty())
      base.erase(k);
    else
      base[k] = v;
  }
  return base;
}

}  // namespace

TEST_CASE("no launcher variables: a single rank") {
  scoped_env env;
  const auto li = rb::detect_launch();
  CHECK(li.launcher == "single");
  CHECK(li.rank == 0);
  CHECK(li.world_size == 1);
  CHECK(li.local_rank == 0);
  CHECK(li.local_size == 1);
  CHECK(li.master_addr == "127.0.0.1");
  CHECK(li.master_port == 0);
  CHECK(li.token.size() == 32);
}

TEST_CASE("ringzero-run and torchrun variables") {
  {
    scoped_env env({{"RANK", "3"},
                    {"WORLD_SIZE", "4"},
                    {"LOCAL_RANK", "1"},
                    {"LOCAL_WORLD_SIZE", "2"},
                    {"MASTER_ADDR", "10.0.0.7"},
                    {"MASTER_PORT", "29500"},
                    {"RINGZERO_TOKEN", "secret"},
                    {"RINGZERO_LAUNCHER", "ringzero-run"}});
    const auto li = rb::detect_launch();
    CHECK(li.launcher == "ringzero-run");
    CHECK(li.rank == 3);
    CHECK(li.world_size == 4);
    CHECK(li.local_rank == 1);
    CHECK(li.local_size == 2);
    CHECK(li.master_addr == "10.0.0.7");
    CHECK(li.master_port == 29500);
    CHECK(li.token == "secret");
  }
  {
    // Set by hand without LOCAL_*: one rank per host is assumed.
    scoped_env env({{"RANK", "1"},
                    {"WORLD_SIZE", "2"},
                    {"MASTER_ADDR", "head"},
                    {"MASTER_PORT", "1234"},
                    {"TORCHELASTIC_RUN_ID", "run7"}});
    const auto li = rb::detect_launch();
    CHECK(li.launcher == "torchrun");
    CHECK(li.local_rank == 0);
    CHECK(li.local_size == 1);
    CHECK(li.token == "torchrun:run7");
  }
  {
    scoped_env env({{"RANK", "0"}, {"WORLD_SIZE", "1"}});
    const auto li = rb::detect_launch();
    CHECK(li.world_size == 1);
    CHECK(li.master_port == 0);
  }
}

TEST_CASE("inconsistent or malformed torchrun variables name the variable") {
  const std::map<std::string, std::string> base = {{"RANK", "1"},        {"WORLD_SIZE", "2"},
                                                   {"LOCAL_RANK", "1"},  {"LOCAL_WORLD_SIZE", "2"},
                                                   {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1234"}};
  CHECK(launch_error(base).empty());
  CHECK(contains(launch_error<ringzero::invalid_argument>(with(base, {{"RANK", "one"}})),
                 "RANK='one'"));
  CHECK(contains(launch_error<ringzero::bootstrap_error>(with(base, {{"RANK", "2"}})), "RANK=2"));
  CHECK(contains(launch_error<ringzero::bootstrap_error>(with(base, {{"WORLD_SIZE", ""}})),
                 "WORLD_SIZE is not set"));
  CHECK(contains(launch_error<ringzero::bootstrap_error>(with(base, {{"WORLD_SIZE", "0"}})),
                 "WORLD_SIZE=0"));
  CHECK(contains(launch_error<ringzero::bootstrap_error>(with(base, {{"LOCAL_RANK", "2"}})),
                 "LOCAL_RANK=2"));
  CHECK(contains(launch_error<ringzero::bootstrap_error>(with(base, {{"LOCAL_WORLD_SIZE", ""}})),
                 "LOCAL_WORLD_SIZE is not"));
  CHECK(contains(launch_error<ringzero::bootstrap_error>(with(base, {{"LOCAL_WORLD_SIZE", "3"}})),
                 "LOCAL_WORLD_SIZE=3"));
  CHECK(contains(launch_error<ringzero::bootstrap_error>(with(base, {{"MASTER_ADDR", ""}})),
                 "MASTER_ADDR is not"));
  CHECK(contains(launch_error<ringzero::bootstrap_error>(
                     with(base, {{"MASTER_ADDR", ""}, {"MASTER_PORT", ""}})),
                 "MASTER_ADDR and MASTER_PORT"));
  CHECK(contains(launch_error<ringzero::invalid_argument>(with(base, {{"MASTER_PORT", "70000"}})),
                 "MASTER_PORT=70000"));
  CHECK(contains(launch_error<ringzero::invalid_argument>(with(base, {{"MASTER_PORT", "12a"}})),
                 "MASTER_PORT='12a'"));
}

TEST_CASE("Open MPI variables") {
  const std::map<std::string, std::string> base = {{"OMPI_COMM_WORLD_RANK", "2"},
                                                   {"OMPI_COMM_WORLD_SIZE", "4"},
                                                   {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                                                   {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                                   {"OMPI_MCA_ess_base_jobid", "1902182401"}};
  {
    scoped_env env(with(base, {{"MASTER_ADDR", "n1"}, {"MASTER_PORT", "4000"}}));
    const auto li = rb::detect_launch();
    CHECK(li.launcher == "openmpi");
    CHECK(li.rank == 2);
    CHECK(li.world_size == 4);
    CHECK(li.local_rank == 0);
    CHECK(li.local_size == 2);
    CHECK(li.master_addr == "n1");
    CHECK(li.master_port == 4000);
    CHECK(li.token == "ompi:1902182401");
  }
  // Across hosts the rendezvous address cannot be guessed: the error says what to set.
  const std::string e = launch_error<ringzero::bootstrap_error>(base);
  CHECK(contains(e, "MASTER_ADDR and MASTER_PORT"));
  CHECK(contains(e, "mpirun -x MASTER_ADDR"));
  {
    // On one host, loopback and a port derived from the job id, the same on every rank.
    scoped_env env(with(base, {{"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}}));
    const auto li = rb::detect_launch();
    CHECK(li.master_addr == "127.0.0.1");
    CHECK(li.master_port >= rb::derived_port_first);
    CHECK(li.master_port < rb::derived_port_first + rb::derived_port_count);
    scoped_env other(
        with(base, {{"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}, {"OMPI_COMM_WORLD_RANK", "0"}}));
    CHECK(rb::detect_launch().master_port == li.master_port);
  }
  CHECK(contains(
      launch_error<ringzero::bootstrap_error>(with(base, {{"OMPI_COMM_WORLD_LOCAL_SIZE", ""}})),
      "OMPI_COMM_WORLD_LOCAL_SIZE is not set"));
  CHECK(
      contains(launch_error<ringzero::bootstrap_error>(with(base, {{"OMPI_COMM_WORLD_RANK", "4"}})),
               "OMPI_COMM_WORLD_RANK=4"));
}

TEST_CASE("Slurm srun variables") {
  {
    scoped_env env(slurm_vars);
    const auto li = rb::detect_launch();
    CHECK(li.launcher == "slurm");
    CHECK(li.rank == 5);
    CHECK(li.world_size == 8);
    CHECK(li.local_rank == 1);
    CHECK(li.local_size == 4);
    CHECK(li.master_addr == "node07");  // first host of the step, not of the job
    CHECK(li.master_port == rb::derived_port(1234, 2));
    CHECK(li.token == "slurm:1234.2");
  }
  {
    scoped_env env(with(slurm_vars, {{"MASTER_ADDR", "login"}, {"MASTER_PORT", "5555"}}));
    const auto li = rb::detect_launch();
    CHECK(li.master_addr == "login");
    CHECK(li.master_port == 5555);
  }
  {
    // Uneven steps: this node runs the one leftover task.
    scoped_env env(with(slurm_vars, {{"SLURM_PROCID", "3"},
                                     {"SLURM_NTASKS", "4"},
                                     {"SLURM_LOCALID", "0"},
                                     {"SLURM_STEP_TASKS_PER_NODE", "3,1"}}));
    CHECK(rb::detect_launch().local_size == 1);
  }
  {
    scoped_env env(with(slurm_vars, {{"SLURM_STEP_TASKS_PER_NODE", ""},
                                     {"SLURM_NTASKS_PER_NODE", "4"},
                                     {"SLURM_STEP_NODELIST", ""}}));
    const auto li = rb::detect_launch();
    CHECK(li.local_size == 4);
    CHECK(li.master_addr == "other1");
  }
  // A batch script (no step of its own) or Slurm's special steps are not srun tasks.
  CHECK(launch_error(with(slurm_vars, {{"SLURM_STEP_ID", ""}})).empty());
  {
    scoped_env env(with(slurm_vars, {{"SLURM_STEP_ID", "4294967294"}}));
    CHECK(rb::detect_launch().launcher == "single");
  }
  CHECK(contains(launch_error<ringzero::bootstrap_error>(
                     with(slurm_vars, {{"SLURM_STEP_TASKS_PER_NODE", "4(x3)"}})),
                 "SLURM_STEP_TASKS_PER_NODE='4(x3)' adds up to 12"));
  CHECK(contains(launch_error<ringzero::invalid_argument>(
                     with(slurm_vars, {{"SLURM_STEP_TASKS_PER_NODE", "4(2)"}})),
                 "SLURM_STEP_TASKS_PER_NODE='4(2)'"));
  CHECK(contains(launch_error<ringzero::bootstrap_error>(with(
                     slurm_vars, {{"SLURM_STEP_TASKS_PER_NODE", "5,3"}, {"SLURM_NODEID", ""}})),
                 "SLURM_NODEID"));
  CHECK(contains(launch_error<ringzero::invalid_argument>(
                     with(slurm_vars, {{"SLURM_STEP_NODELIST", "node[07-"}})),
                 "SLURM_STEP_NODELIST"));
  CHECK(
      contains(launch_error<ringzero::bootstrap_error>(with(slurm_vars, {{"SLURM_LOCALID", "4"}})),
               "SLURM_LOCALID=4"));
  CHECK(contains(launch_error<ringzero::bootstrap_error>(with(slurm_vars, {{"SLURM_NTASKS", ""}})),
                 "SLURM_NPROCS is not set"));
  CHECK(contains(launch_error<ringzero::bootstrap_error>(with(slurm_vars, {{"SLURM_JOB_ID", ""}})),
                 "SLURM_JOB_ID"));
}

TEST_CASE("launchers inside launchers: the innermost wins") {
  {
    scoped_env env(with(slurm_vars, {{"OMPI_COMM_WORLD_RANK", "1"},
                                     {"OMPI_COMM_WORLD_SIZE", "2"},
                                     {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                     {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                     {"OMPI_MCA_ess_base_jobid", "77"}}));
    CHECK(rb::detect_launch().launcher == "openmpi");
  }
  scoped_env env(
      with(slurm_vars,
           {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "9"}}));
  const auto li = rb::detect_launch();
  CHECK(li.launcher == "torchrun");
  CHECK(li.world_size == 2);
}

TEST_CASE("Slurm hostlists expand like scontrol show hostnames") {
  using v = std::vector<std::string>;
  CHECK(rb::expand_hostlist("node[01-04,07],gpu5") ==
        v{"node01", "node02", "node03", "node04", "node07", "gpu5"});
  CHECK(rb::expand_hostlist("a,b") == v{"a", "b"});
  CHECK(rb::expand_hostlist("solo") == v{"solo"});
  CHECK(rb::expand_hostlist("n[8-10]") == v{"n8", "n9", "n10"});
  CHECK(rb::expand_hostlist("n[098-101]") == v{"n098", "n099", "n100", "n101"});
  CHECK(rb::expand_hostlist("r[1-2]n[1-2]-ib") == v{"r1n1-ib", "r1n2-ib", "r2n1-ib", "r2n2-ib"});
  CHECK(rb::expand_hostlist("x[3],y[0-1]z") == v{"x3", "y0z", "y1z"});
  for (const char* bad :
       {"", "a,,b", "n[1-", "n]1", "n[a]", "n[3-1]", "n[]", "n[1,]", "n[[1]]", "n[1-2-3]"}) {
    CAPTURE(bad);
    CHECK_THROWS_AS(static_cast<void>(rb::expand_hostlist(bad)), ringzero::invalid_argument);
  }
  CHECK_THROWS_WITH_AS(static_cast<void>(rb::expand_hostlist("n[0-99999999999]")),
                       doctest::Contains("more than"), ringzero::invalid_argument);
  CHECK_THROWS_AS(static_cast<void>(rb::expand_hostlist("a[0-9]b[0-9]", 50)),
                  ringzero::invalid_argument);
}

TEST_CASE("derived ports stay in their documented range and differ between steps") {
  CHECK(rb::derived_port(0, 0) == rb::derived_port_first);
  CHECK(rb::derived_port(1234, 1) != rb::derived_port(1234, 0));
  CHECK(rb::derived_port(1235, 0) != rb::derived_port(1234, 0));
  for (std::uint64_t job : {0ull, 1ull, 999999ull, ~0ull}) {
    const int p = rb::derived_port(job, 3);
    CHECK(p >= rb::derived_port_first);
    CHECK(p < rb::derived_port_first + rb::derived_port_count);
  }
}

TEST_CASE("make_store follows RINGZERO_STORE") {
  {
    scoped_env env;
    const auto li = rb::detect_launch();
    auto s = rb::make_store(li, std::chrono::seconds(10));
    CHECK(dynamic_cast<rb::tcp_store*>(s.get()) != nullptr);
    s->set_string("k", "v");
    CHECK(s->get_string("k") == "v");
  }
  char tmpl[] = "/tmp/ringzero-make-store-XXXXXX";
  REQUIRE(::mkdtemp(tmpl) != nullptr);
  const std::filesystem::path dir(tmpl);
  {
    scoped_env env({{"RINGZERO_STORE", "file:" + dir.string()}, {"RINGZERO_TOKEN", "job-a"}});
    auto s = rb::make_store(rb::detect_launch(), std::chrono::seconds(10));
    auto* fs = dynamic_cast<rb::file_store*>(s.get());
    REQUIRE(fs != nullptr);
    CHECK(fs->directory().parent_path() == dir);
    s->set_string("k", "a");
    // Another job sharing the directory does not see this job's keys.
    scoped_env other({{"RINGZERO_STORE", "file:" + dir.string()}, {"RINGZERO_TOKEN", "job-b"}});
    auto s2 = rb::make_store(rb::detect_launch(), std::chrono::milliseconds(50));
    CHECK_THROWS_AS(static_cast<void>(s2->get("k")), ringzero::timeout_error);
  }
  {
    scoped_env env(std::map<std::string, std::string>{{"RINGZERO_STORE", "redis"}});
    CHECK_THROWS_WITH_AS(static_cast<void>(rb::make_store(rb::detect_launch())),
                         doctest::Contains("RINGZERO_STORE='redis'"), ringzero::invalid_argument);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("two processes given the same rank: one of them says so at once") {
  // Ranks 0, 1 and 1 of a world of 3: before, all three waited for rank 2's keys and timed out
  // naming a key. Now the second claimant of rank 1 fails as it opens the store.
  rb::launch_info li;
  li.world_size = 3;
  li.local_size = 3;
  li.token = "duplicate-rank-test";
  li.launcher = "torchrun";
  std::vector<pid_t> pids;
  std::vector<int> port_pipes;
  for (int i = 0; i < 2; ++i) {  // both rank 1; forked before the server's thread exists
    int p[2];
    REQUIRE(::pipe(p) == 0);
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::close(p[1]);
      int port = 0;
      if (::read(p[0], &port, sizeof port) != sizeof port) ::_exit(10);
      rb::launch_info mine = li;
      mine.rank = 1;
      mine.local_rank = 1;
      mine.master_port = port;
      try {
        auto s = rb::make_store(mine, std::chrono::seconds(5));
        ::_exit(0);
      } catch (const ringzero::bootstrap_error& e) {
        ::_exit(std::string(e.what()).find("2 processes of this job were given rank 1") !=
                        std::string::npos
                    ? 7
                    : 8);
      } catch (...) {
        ::_exit(9);
      }
    }
    ::close(p[0]);
    pids.push_back(pid);
    port_pipes.push_back(p[1]);
  }
  {
    auto s = rb::make_store(li, std::chrono::seconds(5));
    auto* tcp = dynamic_cast<rb::tcp_store*>(s.get());
    REQUIRE(tcp != nullptr);
    const int port = tcp->port();
    for (int fd : port_pipes) {
      CHECK(::write(fd, &port, sizeof port) == sizeof port);
      ::close(fd);
    }
    std::vector<int> codes;
    for (pid_t pid : pids) {
      int status = 0;
      REQUIRE(::waitpid(pid, &status, 0) == pid);
      REQUIRE(WIFEXITED(status));
      codes.push_back(WEXITSTATUS(status));
    }
    std::sort(codes.begin(), codes.end());
    CHECK(codes == std::vector<int>{0, 7});
  }
}
