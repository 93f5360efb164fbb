// ringzero-run: starts N ranks of a program on this host, the way torchrun would, and babysits
// them: output lines are tagged with their rank where a person reads them, Ctrl-C and SIGTERM
// reach every rank, and the first rank to fail takes the job down with a message saying which
// rank and why.
//
//   ringzero-run -n 4 ./train --steps 100
//
// Each rank runs in its own process group (so one signal reaches a rank's helpers too), with
// stdin from /dev/null and the variables detect_launch() reads.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/core.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "ringzero/bootstrap/tcp_store.hpp"
#include "ringzero/detail/shm_names.hpp"
#include "ringzero/elastic.hpp"
#include "ringzero/transport/detail/process_watch.hpp"
#include "ringzero/version.hpp"

extern char** environ;

namespace {

using clock_type = std::chrono::steady_clock;

constexpr const char* usage_text =
    "usage: ringzero-run -n N [options] [--] PROGRAM [ARGS...]\n"
    "\n"
    "Starts N ranks of PROGRAM on this host. Each rank gets RANK, WORLD_SIZE, LOCAL_RANK,\n"
    "LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT (a free port) and RINGZERO_TOKEN\n"
    "(random, per job).\n"
    "\n"
    "Output: ranks' lines come out whole. On a terminal each line is prefixed with \"[RANK] \";\n"
    "into a pipe or a file lines come out untouched, as mpirun prints them, so parsers of\n"
    "nccl-tests output keep working. Each of stdout and stderr is decided on its own.\n"
    "\n"
    "options:\n"
    "  -n, --nproc N      number of ranks (required)\n"
    "  --tag-output       always prefix lines with \"[RANK] \" (as mpirun --tag-output)\n"
    "  --no-tag-output    never prefix lines\n"
    "  --output DIR       also write each rank's stdout and stderr, untagged, to DIR/rank<R>.log\n"
    "                     (torchrun's --tee 3 --log-dir DIR)\n"
    "  --redirect DIR     write each rank's stdout and stderr only to DIR/rank<R>.log; this\n"
    "                     process's own lines still come here (torchrun's --redirects 3)\n"
    "  --port P           MASTER_PORT to use instead of a free one\n"
    "  --timeout S        stop the job after S seconds (exit status 124)\n"
    "  --grace S          seconds between SIGTERM and SIGKILL when stopping ranks (default 5)\n"
    "  --elastic MIN:MAX  elastic job: a rank that dies does not stop the others while MIN\n"
    "                     remain; the store is served here, not by a rank, so any rank may die.\n"
    "                     Ranks get RINGZERO_ELASTIC=MIN:MAX and RINGZERO_ELASTIC_ID and form\n"
    "                     generations through ringzero::elastic::session (ringzero/elastic.hpp)\n"
    "  --job-file F       with --elastic: write what ranks need to join this job to F (0600)\n"
    "  --join F           start N more ranks that join the elastic job F describes, at its next\n"
    "                     step boundary (the job's ranks take them in; see docs/reliability.md).\n"
    "                     Each gets a LOCAL_RANK (its GPU): one a dead rank of the job held on\n"
    "                     this host, else one past those the job started with\n"
    "  -h, --help         show this help\n"
    "  --version          show the version\n"
    "\n"
    "SIGINT and SIGTERM are forwarded to every rank; a second one kills them. When a rank exits\n"
    "with a non-zero status or is killed by a signal, the other ranks are stopped (a stopped\n"
    "rank, SIGSTOP or a debugger, is named as the culprit and continued so that it ends). With\n"
    "--elastic, the job goes on while MIN ranks remain; a rank the job declares lost (its\n"
    "heartbeat silent for RINGZERO_ELASTIC_SETTLE seconds) is ended; a summary says who died\n"
    "when and the world size over time. Its ranks get RINGZERO_LAUNCHER_PID, and SIGPIPE\n"
    "ignored: they end cleanly when this process dies.\n"
    "\n"
    "exit status:\n"
    "  0      every rank exited 0 (elastic: the ranks that finished the job did)\n"
    "  1      the job could not be set up (--output, --job-file, --join, the store)\n"
    "  2      usage error\n"
    "  3      an elastic job that ended without finishing (too few ranks left, or they failed)\n"
    "  4      --join: the job finished before these ranks were taken in\n"
    "  124    --timeout passed\n"
    "  127    a rank could not be started\n"
    "  128+N  this process got signal N (SIGINT, SIGTERM, SIGHUP) and stopped the ranks\n"
    "  other  the status of the rank that failed first (128+N if signal N ended it)\n";

constexpr std::size_t max_line_bytes = 64 * 1024;

enum class tagging { automatic, always, never };

struct options {
  int nproc = 0;
  tagging tag = tagging::automatic;
  std::string output_dir;
  bool console = true;  ///< ranks' lines also go to this process's stdout and stderr
  int port = 0;
  double timeout_s = 0;
  double grace_s = 5;
  std::string elastic;   ///< MIN:MAX, or empty
  std::string job_file;  ///< --job-file
  std::string join;      ///< --join: the job file of the job to join
  std::vector<std::string> command;
};

[[noreturn]] void usage_error(const std::string& msg) {
  fmt::print(stderr, "ringzero-run: {}\n(ringzero-run --help shows the usage)\n", msg);
  std::exit(2);
}

double parse_seconds(std::string_view name, std::string_view v) {
  double d = 0;
  auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), d);
  if (ec != std::errc{} || p != v.data() + v.size() || !(d > 0))
    usage_error(fmt::format("{} needs a positive number of seconds, not '{}'", name, v));
  return d;
}

int parse_int(std::string_view name, std::string_view v, int lo, int hi) {
  int x = 0;
  auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  if (ec != std::errc{} || p != v.data() + v.size() || x < lo || x > hi)
    usage_error(fmt::format("{} needs an integer in [{}, {}], not '{}'", name, lo, hi, v));
  return x;
}

options parse_args(int argc, char** argv) {
  options o;
  int i = 1;
  // Accepts "--opt VALUE", "--opt=VALUE" and, for -n, "-nVALUE".
  auto value = [&](std::string_view arg, std::string_view name) -> std::optional<std::string> {
    if (arg == name) {
      if (i + 1 >= argc) usage_error(fmt::format("{} needs a value", name));
      return std::string(argv[++i]);
    }
    if (arg.size() > name.size() && arg.starts_with(name) && arg[name.size()] == '=')
      return std::string(arg.substr(name.size() + 1));
    if (name == "-n" && arg.size() > 2 && arg.starts_with("-n") && arg[2] != '-')
      return std::string(arg.substr(2));
    return std::nullopt;
  };
  for (; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--") {
      ++i;
      break;
    }
    if (a == "-h" || a == "--help") {
      std::fputs(usage_text, stdout);
      std::exit(0);
    }
    if (a == "--version") {
      fmt::print("ringzero-run {}\n", ringzero::version_string);
      std::exit(0);
    }
    if (auto v = value(a, "-n"))
      o.nproc = parse_int("-n", *v, 1, 4096);
    else if (auto v2 = value(a, "--nproc"))
      o.nproc = parse_int("--nproc", *v2, 1, 4096);
    else if (auto v3 = value(a, "--port"))
      o.port = parse_int("--port", *v3, 1, 65535);
    else if (auto v4 = value(a, "--timeout"))
      o.timeout_s = parse_seconds("--timeout", *v4);
    else if (auto v5 = value(a, "--grace"))
      o.grace_s = parse_seconds("--grace", *v5);
    else if (a == "--tag-output")
      o.tag = tagging::always;
    else if (a == "--no-tag-output")
      o.tag = tagging::never;
    else if (auto v7 = value(a, "--elastic")) {
      try {
        static_cast<void>(ringzero::elastic::parse_limits(*v7));
      } catch (const ringzero::error& e) {
        usage_error(fmt::format("--elastic: {}", e.what()));
      }
      o.elastic = *v7;
    } else if (auto v8 = value(a, "--job-file"))
      o.job_file = *v8;
    else if (auto v9 = value(a, "--join"))
      o.join = *v9;
    else if (auto v6 = value(a, "--output")) {
      if (v6->empty()) usage_error("--output needs a directory");
      o.output_dir = *v6;
    } else if (auto v10 = value(a, "--redirect")) {
      if (v10->empty()) usage_error("--redirect needs a directory");
      o.output_dir = *v10;
      o.console = false;
    } else if (a.starts_with("-") && a.size() > 1)
      usage_error(fmt::format("unknown option '{}'", a));
    else
      break;
  }
  for (; i < argc; ++i) o.command.emplace_back(argv[i]);
  if (o.nproc == 0) usage_error("-n N (the number of ranks) is required");
  if (!o.job_file.empty() && o.elastic.empty()) usage_error("--job-file needs --elastic");
  if (!o.join.empty() && (!o.elastic.empty() || o.port != 0))
    usage_error("--join takes the job's limits and port from its job file");
  if (!o.elastic.empty()) {
    const auto lim = ringzero::elastic::parse_limits(o.elastic);
    if (o.nproc > lim.max)
      usage_error(fmt::format("-n {} is above the --elastic maximum", o.nproc));
    if (o.nproc < lim.min)
      usage_error(fmt::format(
          "-n {} is below the --elastic minimum {}: the job could not form its first generation",
          o.nproc, lim.min));
  }
  if (o.command.empty()) usage_error("no program to run");
  return o;
}

// --- signals: handlers only write the signal number into a pipe the main loop polls ---------

int signal_pipe[2] = {-1, -1};

extern "C" void on_signal(int sig) {
  const int saved = errno;
  const auto b = static_cast<unsigned char>(sig);
  [[maybe_unused]] const ssize_t n = ::write(signal_pipe[1], &b, 1);
  errno = saved;
}

void install_signal_handlers() {
  if (::pipe2(signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    fmt::print(stderr, "ringzero-run: pipe2 failed: {}\n", std::strerror(errno));
    std::exit(1);
  }
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  for (int s : {SIGCHLD, SIGINT, SIGTERM, SIGHUP}) ::sigaction(s, &sa, nullptr);
  // Output to a closed pipe (e.g. `| head`) must not kill the launcher while ranks run.
  ::signal(SIGPIPE, SIG_IGN);
}

// --- the job's environment --------------------------------------------------------------------

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

std::string random_token() {
  std::random_device rd;
  std::string t;
  for (int i = 0; i < 4; ++i) t += fmt::format("{:08x}", rd());
  return t;
}

// Where the ranks meet and what kind of job they are in.
struct job_env {
  std::string addr = "127.0.0.1";
  int port = 0;
  std::string token;
  std::string elastic;        ///< MIN:MAX for an elastic job, else empty
  bool arrival = false;       ///< ranks joining a running elastic job (--join)
  std::int64_t first_id = 0;  ///< the elastic member id of this launcher's first rank
};

/// `local`: the rank's LOCAL_RANK, which an elastic arrival gets too (the GPU it takes).
std::vector<std::string> rank_environment(const options& o, int rank, int local, const job_env& j) {
  static constexpr std::string_view ours[] = {"RANK=",
                                              "WORLD_SIZE=",
                                              "LOCAL_RANK=",
                                              "LOCAL_WORLD_SIZE=",
                                              "MASTER_ADDR=",
                                              "MASTER_PORT=",
                                              "RINGZERO_TOKEN=",
                                              "RINGZERO_LAUNCHER=",
                                              "RINGZERO_LAUNCHER_PID=",
                                              "RINGZERO_ELASTIC=",
                                              "RINGZERO_ELASTIC_ID=",
                                              "RINGZERO_ELASTIC_ARRIVAL="};
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view v = *e;
    if (std::none_of(std::begin(ours), std::end(ours),
                     [&](std::string_view p) { return v.starts_with(p); }))
      env.emplace_back(v);
  }
  // An arrival's rank and the world size are the job's to give, generation by generation: it
  // gets neither, so that nothing mistakes it for a rank of a static job. It does get a local
  // rank: the one a rank of the job that died held on this host, else one past those the job
  // started with (elastic_local below), so that its GPU is not a survivor's.
  if (!j.arrival) {
    env.push_back(fmt::format("RANK={}", rank));
    env.push_back(fmt::format("WORLD_SIZE={}", o.nproc));
    env.push_back(fmt::format("LOCAL_WORLD_SIZE={}", o.nproc));
  }
  env.push_back(fmt::format("LOCAL_RANK={}", local));
  env.push_back("MASTER_ADDR=" + j.addr);
  env.push_back(fmt::format("MASTER_PORT={}", j.port));
  env.push_back("RINGZERO_TOKEN=" + j.token);
  env.push_back("RINGZERO_LAUNCHER=ringzero-run");
  // Ranks of an elastic job watch this process: when it dies, they end cleanly (elastic.hpp).
  env.push_back(fmt::format("RINGZERO_LAUNCHER_PID={}", ::getpid()));
  if (!j.elastic.empty()) {
    env.push_back("RINGZERO_ELASTIC=" + j.elastic);
    env.push_back(fmt::format("RINGZERO_ELASTIC_ID={}", j.first_id + rank));
    if (j.arrival) env.push_back("RINGZERO_ELASTIC_ARRIVAL=1");
  }
  return env;
}

// The local ranks of an elastic job on this host, kept in the job's store: the launcher that
// serves it records how many ranks it started; every launcher records the local rank of each of
// its ranks that died; an arrival takes the freed ones first, in order, then new ones.
struct elastic_local {
  static constexpr const char* started = "elastic/local/started";
  static constexpr const char* freed = "elastic/local/freed";  ///< published free local ranks
  static constexpr const char* slots = "elastic/local/slots";  ///< free/<k> indices handed out
  static constexpr const char* claimed = "elastic/local/claimed";
  static std::string free(std::int64_t k) { return fmt::format("elastic/local/free/{}", k); }

  /// Records that a rank holding local rank `local` died.
  static void release(ringzero::bootstrap::store& s, int local) {
    constexpr auto limit = std::chrono::seconds(1);
    const std::int64_t k = s.add_within(slots, 1, limit) - 1;
    const std::string v = fmt::format("{}", local);
    s.set_within(free(k), std::as_bytes(std::span<const char>(v.data(), v.size())), limit);
    s.add_within(freed, 1, limit);
  }
  /// The local rank for the next arrival started on this host.
  static int claim(ringzero::bootstrap::store& s) {
    const std::int64_t k = s.add(claimed, 1) - 1;
    const std::int64_t available = s.add(freed, 0);
    if (k < available) return static_cast<int>(std::stoll(s.get_string(free(k))));
    return static_cast<int>(s.add(started, 0) + (k - available));
  }
};

// The job file --job-file writes and --join reads: KEY=VALUE lines.
bool write_job_file(const std::string& path, const job_env& j) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return false;
  const std::string text =
      fmt::format("MASTER_ADDR={}\nMASTER_PORT={}\nRINGZERO_TOKEN={}\nRINGZERO_ELASTIC={}\n",
                  j.addr, j.port, j.token, j.elastic);
  const bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  return ::close(fd) == 0 && ok;
}

std::optional<job_env> read_job_file(const std::string& path, std::string& why) {
  std::FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) {
    why = std::strerror(errno);
    return std::nullopt;
  }
  job_env j;
  char line[1024];
  while (std::fgets(line, sizeof line, f) != nullptr) {
    std::string_view l(line);
    while (!l.empty() && (l.back() == '\n' || l.back() == '\r')) l.remove_suffix(1);
    const auto eq = l.find('=');
    if (eq == std::string_view::npos) continue;
    const std::string_view k = l.substr(0, eq), v = l.substr(eq + 1);
    if (k == "MASTER_ADDR") j.addr = v;
    if (k == "MASTER_PORT") std::from_chars(v.data(), v.data() + v.size(), j.port);
    if (k == "RINGZERO_TOKEN") j.token = v;
    if (k == "RINGZERO_ELASTIC") j.elastic = v;
  }
  std::fclose(f);
  if (j.port <= 0 || j.token.empty() || j.elastic.empty()) {
    why = "not a job file of ringzero-run --elastic --job-file";
    return std::nullopt;
  }
  j.arrival = true;
  return j;
}

// --- output: whole lines, each tagged with its rank --------------------------------------------

void write_all(int fd, std::string_view s) {
  while (!s.empty()) {
    const ssize_t n = ::write(fd, s.data(), s.size());
    if (n > 0) {
      s.remove_prefix(static_cast<std::size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) {
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, 100);
      continue;
    }
    return;  // EPIPE and friends: nobody reads our output any more; keep running the job
  }
}

struct stream {
  int fd = -1;       ///< our end of the rank's pipe; -1 once closed
  int out_fd = -1;   ///< where its lines go (1 or 2; -1: only to the log file)
  int file_fd = -1;  ///< the rank's --output log, shared by its stdout and stderr; or -1
  std::string prefix;
  std::string partial;

  // Emits every complete line (and an over-long partial one), prefixed on the console.
  void emit(bool at_eof) {
    std::string batch, raw;
    auto line = [&](std::string_view l) {
      batch += prefix;
      batch += l;
      if (file_fd >= 0) raw += l;
    };
    std::size_t start = 0;
    for (;;) {
      const std::size_t nl = partial.find('\n', start);
      if (nl == std::string::npos) break;
      line(std::string_view(partial).substr(start, nl + 1 - start));
      start = nl + 1;
    }
    partial.erase(0, start);
    if (!partial.empty() && (at_eof || partial.size() >= max_line_bytes)) {
      line(partial + '\n');
      partial.clear();
    }
    if (!batch.empty() && out_fd >= 0) write_all(out_fd, batch);
    if (!raw.empty()) write_all(file_fd, raw);
  }

  // Reads what is there without blocking; closes the stream at end of file.
  void drain() {
    char buf[65536];
    while (fd >= 0) {
      const ssize_t n = ::read(fd, buf, sizeof buf);
      if (n > 0) {
        partial.append(buf, static_cast<std::size_t>(n));
        emit(false);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == EAGAIN) return;
      close();
      emit(true);
    }
  }

  void close() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
};

struct rank_process {
  pid_t pid = -1;
  int local = 0;  ///< its LOCAL_RANK
  bool running = false;
  bool declared_lost = false;  ///< the job declared it lost, and it was ended
  int status = 0;
  int log_fd = -1;
  stream out, err;
};

/// Whether lines bound for fd get the rank prefix: on a terminal, a person reads interleaved
/// ranks and needs to tell them apart; into a pipe or file, a program parses them and needs
/// them as the rank wrote them (mpirun's default).
bool tags(tagging t, int fd) {
  return t == tagging::always || (t == tagging::automatic && ::isatty(fd) == 1);
}

std::string describe(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int s = WTERMSIG(status);
    const char* name = ::strsignal(s);
    return fmt::format("was killed by signal {} ({})", s, name != nullptr ? name : "?");
  }
  return fmt::format("ended with status {:#x}", status);
}

// libfabric's shm provider keeps each endpoint's queues in /dev/shm/<pid>:<domain>:<endpoint>
// and removes it when the endpoint closes; a rank killed outright cannot, so the launcher does.
void remove_shm_regions(pid_t pid) {
  ringzero::detail::remove_shm_names(fmt::format("{}:", pid));
}

// A rank's process group, or the process alone where the group is gone.
void signal_rank(pid_t pid, int sig) {
  if (::kill(-pid, sig) != 0) ::kill(pid, sig);
}

// Whether the process is stopped (SIGSTOP, a debugger): alive, holding up whoever waits on it.
bool is_stopped(pid_t pid) {
  const auto st = ringzero::detail::read_process_stat(pid);
  return st && st->stopped();
}

// The launcher's own exit statuses (its usage text lists them with the others).
constexpr int exit_unfinished = 3;    ///< an elastic job that ended without finishing
constexpr int exit_not_taken_in = 4;  ///< --join: the job finished before its ranks were taken in

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

class job {
 public:
  explicit job(options o) : opt_(std::move(o)), ranks_(static_cast<std::size_t>(opt_.nproc)) {}

  ~job() {
    for (auto& rp : ranks_)
      if (rp.log_fd >= 0) ::close(rp.log_fd);
  }

  int run() {
    if (!opt_.output_dir.empty()) {
      std::error_code ec;
      std::filesystem::create_directories(opt_.output_dir, ec);
      if (ec) {
        fmt::print(stderr, "ringzero-run: --output {}: {}\n", opt_.output_dir, ec.message());
        return 1;
      }
    }
    if (!open_job()) return 1;
    const auto started = clock_type::now();
    started_ = started;
    for (int r = 0; r < opt_.nproc; ++r)
      if (!spawn(r)) {
        stop(SIGTERM);
        break;
      }
    if (opt_.timeout_s > 0)
      job_deadline_ = started + std::chrono::duration_cast<clock_type::duration>(
                                    std::chrono::duration<double>(opt_.timeout_s));
    loop();
    for (const auto& rp : ranks_)
      if (rp.pid > 0) remove_shm_regions(rp.pid);
    if (store_) finish_elastic();
    if (spawn_failed_) return 127;
    if (store_ && !stopping_ && finished_ok_) return 0;
    if (store_ && !stopping_) {
      if (env_.arrival && !taken_in_) {
        fmt::print(stderr,
                   "ringzero-run: the job finished before these ranks were taken in (exit "
                   "status {})\n",
                   exit_not_taken_in);
        return exit_not_taken_in;
      }
      fmt::print(stderr, "ringzero-run: the elastic job ended without finishing (exit status {})\n",
                 exit_unfinished);
      return exit_unfinished;
    }
    if (first_failure_ >= 0)
      return exit_code_of(ranks_[static_cast<std::size_t>(first_failure_)].status);
    if (interrupted_by_ != 0) return 128 + interrupted_by_;
    if (timed_out_) return 124;
    return 0;
  }

 private:
  // Picks the port and token, or reads them from --join's file; an elastic job's store is
  // served here, so that it outlives any rank.
  bool open_job() {
    if (!opt_.join.empty()) {
      std::string why;
      auto j = read_job_file(opt_.join, why);
      if (!j) {
        fmt::print(stderr, "ringzero-run: --join {}: {}\n", opt_.join, why);
        return false;
      }
      env_ = *j;
    } else {
      env_.token = random_token();
      env_.elastic = opt_.elastic;
    }
    if (env_.elastic.empty()) {
      env_.port = opt_.port != 0 ? opt_.port : free_port();
      if (env_.port == 0) {
        fmt::print(stderr, "ringzero-run: could not find a free TCP port on 127.0.0.1\n");
        return false;
      }
      return true;
    }
    const auto lim = ringzero::elastic::parse_limits(env_.elastic);
    using keys = ringzero::elastic::session::keys;
    try {
      if (env_.arrival) {
        store_ = std::make_unique<ringzero::bootstrap::tcp_store>(
            env_.addr, env_.port, false, ringzero::elastic::session::store_world(lim), env_.token,
            std::min<std::chrono::nanoseconds>(ringzero::detail::env_timeout(),
                                               ringzero::elastic::session::arrival_connect));
        env_.first_id = store_->add(keys::next_id(), opt_.nproc) - opt_.nproc;
      } else {
        store_ = std::make_unique<ringzero::bootstrap::tcp_store>(
            env_.addr, opt_.port, true, ringzero::elastic::session::store_world(lim), env_.token,
            ringzero::detail::env_timeout(), env_.addr);
        env_.port = store_->port();
        store_->add(keys::next_id(), opt_.nproc);
        store_->add(elastic_local::started, opt_.nproc);
      }
    } catch (const ringzero::error& e) {
      fmt::print(stderr, "ringzero-run: the elastic job's store at {}:{}{}: {}\n", env_.addr,
                 env_.port, env_.arrival ? " (has the job finished?)" : "", e.what());
      return false;
    }
    if (!opt_.job_file.empty() && !write_job_file(opt_.job_file, env_)) {
      fmt::print(stderr, "ringzero-run: cannot write --job-file {}: {}\n", opt_.job_file,
                 std::strerror(errno));
      return false;
    }
    return true;
  }

  [[nodiscard]] double elapsed_s() const {
    return std::chrono::duration<double>(clock_type::now() - started_).count();
  }

  // Prints each generation as the ranks form it (an elastic job's world size over time); an
  // arrival's launcher notes instead whether one took its ranks in.
  void watch_generations() {
    using keys = ringzero::elastic::session::keys;
    if (!store_) return;
    try {
      const auto formed = static_cast<std::uint64_t>(
          store_->add_within(keys::formed(), 0, std::chrono::seconds(1)));
      for (; generations_.size() < formed;) {
        const auto g = generations_.size();
        const auto v = store_->get_within(keys::members(g), std::chrono::seconds(1));
        generations_.push_back(
            {elapsed_s(), std::string(reinterpret_cast<const char*>(v.data()), v.size())});
        const auto& list = generations_.back().members;
        if (env_.arrival) {
          for (std::string_view rest = list; !rest.empty();) {
            const auto comma = rest.find(',');
            std::int64_t id = -1;
            std::from_chars(rest.data(), rest.data() + std::min(comma, rest.size()), id);
            if (id >= env_.first_id && id < env_.first_id + opt_.nproc) taken_in_ = true;
            if (comma == std::string_view::npos) break;
            rest.remove_prefix(comma + 1);
          }
          continue;
        }
        const auto n = 1 + std::count(list.begin(), list.end(), ',');
        fmt::print(stderr,
                   "ringzero-run: generation {} formed at {:.1f} s: {} ranks (members {})\n", g,
                   generations_.back().at_s, n, list);
        std::fflush(stderr);
      }
    } catch (const ringzero::error&) {
      // The store is served here; a slow answer only delays the line.
    }
  }

  // The ranks the job declared lost (a member found one silent: stopped, or hung) are ended
  // here, where they would otherwise be waited for forever.
  void watch_losses() {
    using keys = ringzero::elastic::session::keys;
    if (!store_ || env_.arrival) return;
    try {
      const auto deaths = store_->add_within(keys::deaths(), 0, std::chrono::seconds(1));
      if (deaths == deaths_seen_) return;
      deaths_seen_ = deaths;
      for (std::size_t r = 0; r < ranks_.size(); ++r) {
        auto& rp = ranks_[r];
        const std::int64_t id = env_.first_id + static_cast<std::int64_t>(r);
        if (!rp.running || rp.declared_lost ||
            store_->add_within(keys::dead(id), 0, std::chrono::seconds(1)) == 0)
          continue;
        rp.declared_lost = true;
        fmt::print(stderr,
                   "ringzero-run: rank {} (pid {}) was declared lost by the job{}; ending it\n", id,
                   rp.pid, is_stopped(rp.pid) ? " (it is stopped: SIGSTOP or a debugger)" : "");
        std::fflush(stderr);
        signal_rank(rp.pid, SIGKILL);
      }
    } catch (const ringzero::error&) {
      // The store is served here; a slow answer only delays the check.
    }
  }

  // The elastic job's summary: deaths and generations, with what the ranks recorded.
  void finish_elastic() {
    using keys = ringzero::elastic::session::keys;
    watch_generations();
    // Only the job's own launcher ends it: an arrival's ending tells the others nothing.
    if (env_.arrival) return;
    try {
      store_->add_within(keys::finished(), 1, std::chrono::seconds(1));
    } catch (const ringzero::error&) {
    }
    fmt::print(stderr, "ringzero-run: elastic job ({}): {} ranks started, {} lost\n", env_.elastic,
               opt_.nproc, deaths_.size());
    // One timeline: deaths as this launcher saw them, generations as the ranks formed them.
    std::vector<death> lines = deaths_;
    for (std::size_t g = 0; g < generations_.size(); ++g) {
      std::string event;
      try {
        // Only generations with an event wait for it: one without would hold this summary up
        // for the whole limit, once per generation.
        if (store_->add_within(keys::recorded(g), 0, std::chrono::seconds(1)) > 0) {
          const auto v = store_->get_within(keys::event(g), std::chrono::seconds(1));
          event = std::string(reinterpret_cast<const char*>(v.data()), v.size());
        }
      } catch (const ringzero::error&) {
      }
      const auto& list = generations_[g].members;
      lines.push_back(
          {generations_[g].at_s, fmt::format("generation {}: {} ranks (members {}){}{}", g,
                                             1 + std::count(list.begin(), list.end(), ','), list,
                                             event.empty() ? "" : "; ", event)});
    }
    std::stable_sort(lines.begin(), lines.end(),
                     [](const death& a, const death& b) { return a.at_s < b.at_s; });
    for (const auto& l : lines) fmt::print(stderr, "  {:7.1f} s  {}\n", l.at_s, l.what);
    std::fflush(stderr);
    // Ranks known dead never close their store: the server need not wait for them.
    store_->excuse(
        ringzero::elastic::session::store_world(ringzero::elastic::parse_limits(env_.elastic)));
  }

  bool spawn(int r) {
    auto& rp = ranks_[static_cast<std::size_t>(r)];
    if (!opt_.output_dir.empty()) {
      const std::string path =
          (std::filesystem::path(opt_.output_dir) / fmt::format("rank{}.log", r)).string();
      rp.log_fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (rp.log_fd < 0) {
        fmt::print(stderr, "ringzero-run: cannot write {}: {}\n", path, std::strerror(errno));
        spawn_failed_ = true;
        return false;
      }
    }
    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
      fmt::print(stderr, "ringzero-run: pipe2 failed: {}\n", std::strerror(errno));
      spawn_failed_ = true;
      return false;
    }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    posix_spawn_file_actions_adddup2(&fa, err[1], 2);
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    sigset_t none, defaults;
    sigemptyset(&none);
    sigemptyset(&defaults);
    // An elastic job's ranks keep SIGPIPE ignored, as it is here: while this process lives it
    // drains the ranks' output, so it changes nothing then; once it has died, a rank's next
    // line fails with EPIPE instead of killing the rank before its session, which watches this
    // process, ends it cleanly. Other ranks watch nothing: SIGPIPE at their next line is what
    // ends them then.
    for (int s : {SIGCHLD, SIGINT, SIGTERM, SIGHUP}) sigaddset(&defaults, s);
    if (env_.elastic.empty()) sigaddset(&defaults, SIGPIPE);
    posix_spawnattr_setsigmask(&attr, &none);
    posix_spawnattr_setsigdefault(&attr, &defaults);
    posix_spawnattr_setpgroup(&attr, 0);
    posix_spawnattr_setflags(
        &attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);

    rp.local = r;
    if (env_.arrival) {
      try {
        rp.local = elastic_local::claim(*store_);
      } catch (const std::exception& e) {
        fmt::print(stderr, "ringzero-run: the elastic job's store gave no local rank: {}\n",
                   e.what());
        spawn_failed_ = true;
        return false;
      }
    }
    std::vector<std::string> env = rank_environment(opt_, r, rp.local, env_);
    std::vector<char*> envp, argv;
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    for (auto& a : opt_.command) argv.push_back(a.data());
    argv.push_back(nullptr);

    pid_t pid = -1;
    const int rc = ::posix_spawnp(&pid, argv[0], &fa, &attr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&attr);
    ::close(out[1]);
    ::close(err[1]);
    if (rc != 0) {
      ::close(out[0]);
      ::close(err[0]);
      fmt::print(stderr, "ringzero-run: cannot start '{}': {}\n", opt_.command[0],
                 std::strerror(rc));
      spawn_failed_ = true;
      return false;
    }
    ::fcntl(out[0], F_SETFL, O_NONBLOCK);
    ::fcntl(err[0], F_SETFL, O_NONBLOCK);
    rp.pid = pid;
    rp.running = true;
    const std::string prefix = fmt::format("[{}] ", env_.elastic.empty() ? r : env_.first_id + r);
    rp.out = {out[0], opt_.console ? 1 : -1, rp.log_fd, tags(opt_.tag, 1) ? prefix : "", {}};
    rp.err = {err[0], opt_.console ? 2 : -1, rp.log_fd, tags(opt_.tag, 2) ? prefix : "", {}};
    ++running_;
    return true;
  }

  // Sends `sig` to every running rank's process group and arms the SIGKILL deadline. SIGCONT
  // follows, so that a stopped rank (SIGSTOP, a debugger) acts on it now instead of holding the
  // grace period up.
  void stop(int sig) {
    for (auto& rp : ranks_)
      if (rp.running) signal_rank(rp.pid, sig);
    if (sig != SIGKILL)
      for (auto& rp : ranks_)
        if (rp.running) signal_rank(rp.pid, SIGCONT);
    if (sig != SIGKILL && !stopping_)
      kill_deadline_ = clock_type::now() + std::chrono::duration_cast<clock_type::duration>(
                                               std::chrono::duration<double>(opt_.grace_s));
    stopping_ = true;
  }

  void on_signal(int sig) {
    if (sig == SIGCHLD) return reap();
    if (!stopping_) {
      interrupted_by_ = sig;
      stop(sig);
    } else {
      stop(SIGKILL);
    }
  }

  void reap() {
    // Everything that ended by now, first: of a rank killed by a signal and a rank that exited
    // with an error because of it, the killed one is the culprit, in whatever order they end.
    std::vector<std::pair<pid_t, int>> ended;
    const auto collect = [&] {
      for (;;) {
        int status = 0;
        const pid_t pid = ::waitpid(-1, &status, WNOHANG);
        if (pid <= 0) break;
        ended.emplace_back(pid, status);
      }
    };
    collect();
    // A rank that exits with an error because a peer was SIGKILLed can end before the killed
    // one is reaped: a large process takes longer to be torn down than a small one takes to
    // notice and exit. Before the first verdict, give a killed rank a moment to show up, so
    // the verdict names it rather than the rank that reported it.
    const auto exited_with_error = [](const auto& e) {
      return WIFEXITED(e.second) && WEXITSTATUS(e.second) != 0;
    };
    const auto signalled = [](const auto& e) { return WIFSIGNALED(e.second); };
    if (!stopping_ && std::any_of(ended.begin(), ended.end(), exited_with_error) &&
        std::none_of(ended.begin(), ended.end(), signalled) && running_ > 1) {
      const auto until = clock_type::now() + std::chrono::milliseconds(250);
      while (clock_type::now() < until && std::none_of(ended.begin(), ended.end(), signalled)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        collect();
      }
    }
    std::stable_partition(ended.begin(), ended.end(),
                          [](const auto& e) { return WIFSIGNALED(e.second); });
    for (const auto& [pid, status] : ended) {
      for (std::size_t r = 0; r < ranks_.size(); ++r) {
        auto& rp = ranks_[r];
        if (rp.pid != pid || !rp.running) continue;
        rp.running = false;
        rp.status = status;
        --running_;
        // The rank's last words come before the verdict on it.
        rp.out.drain();
        rp.err.drain();
        const bool failed = !WIFEXITED(status) || WEXITSTATUS(status) != 0;
        if (!failed && store_) finished_ok_ = true;
        if (failed && !stopping_ && store_) {
          // Elastic: the others go on without it. Marking it dead lets them form the next
          // generation at once instead of waiting out the settle time.
          const std::int64_t id = env_.first_id + static_cast<std::int64_t>(r);
          try {
            using keys = ringzero::elastic::session::keys;
            if (store_->add_within(keys::dead(id), 1, std::chrono::seconds(1)) == 1)
              store_->add_within(keys::deaths(), 1, std::chrono::seconds(1));
            elastic_local::release(*store_, rp.local);
          } catch (const ringzero::error&) {
          }
          remove_shm_regions(pid);
          deaths_.push_back(
              {elapsed_s(), fmt::format("rank {} (pid {}) {}", id, pid, describe(status))});
          if (first_failure_ < 0) first_failure_ = static_cast<int>(r);
          fmt::print(stderr,
                     "ringzero-run: rank {} (pid {}) {} at {:.1f} s; {} of this "
                     "launcher's ranks go on (elastic {})\n",
                     id, pid, describe(status), deaths_.back().at_s, running_, env_.elastic);
          std::fflush(stderr);
          continue;
        }
        if (failed && !stopping_) {
          first_failure_ = static_cast<int>(r);
          // A stopped rank is the culprit of the waits that gave up on it, whichever rank's
          // error came first.
          const auto stopped = std::find_if(ranks_.begin(), ranks_.end(), [](const auto& o) {
            return o.running && is_stopped(o.pid);
          });
          if (stopped != ranks_.end())
            fmt::print(stderr,
                       "ringzero-run: rank {} (pid {}) is stopped (SIGSTOP or a debugger); rank {} "
                       "(pid {}) {} waiting for it; stopping the ranks\n",
                       stopped - ranks_.begin(), stopped->pid, r, pid, describe(status));
          else
            fmt::print(stderr, "ringzero-run: rank {} (pid {}) {}; stopping the other ranks\n", r,
                       pid, describe(status));
          std::fflush(stderr);
          stop(SIGTERM);
        }
      }
    }
  }

  void loop() {
    std::vector<pollfd> fds;
    std::vector<stream*> streams;
    std::optional<clock_type::time_point> linger_until;
    for (;;) {
      fds.clear();
      streams.clear();
      fds.push_back({signal_pipe[0], POLLIN, 0});
      for (auto& rp : ranks_)
        for (stream* s : {&rp.out, &rp.err})
          if (s->fd >= 0) {
            fds.push_back({s->fd, POLLIN, 0});
            streams.push_back(s);
          }
      if (running_ == 0) {
        if (streams.empty()) return;
        // A rank's child may still hold its output open; give it a moment, then stop reading.
        if (!linger_until) linger_until = clock_type::now() + std::chrono::seconds(1);
        if (clock_type::now() >= *linger_until) {
          for (auto& rp : ranks_) {
            rp.out.close();
            rp.out.emit(true);
            rp.err.close();
            rp.err.emit(true);
          }
          return;
        }
      }
      int wait_ms = poll_timeout_ms(linger_until);
      if (store_ && (wait_ms < 0 || wait_ms > 200)) wait_ms = 200;
      const int rc = ::poll(fds.data(), fds.size(), wait_ms);
      if (rc < 0 && errno != EINTR) {
        fmt::print(stderr, "ringzero-run: poll failed: {}\n", std::strerror(errno));
        stop(SIGKILL);
      }
      watch_generations();
      watch_losses();
      if (rc > 0 && fds[0].revents != 0) {
        unsigned char sigs[64];
        const ssize_t n = ::read(signal_pipe[0], sigs, sizeof sigs);
        for (ssize_t k = 0; k < n; ++k) on_signal(sigs[k]);
      }
      if (rc > 0)
        for (std::size_t k = 0; k < streams.size(); ++k)
          if (fds[k + 1].revents != 0) streams[k]->drain();
      check_deadlines();
    }
  }

  int poll_timeout_ms(const std::optional<clock_type::time_point>& linger_until) const {
    auto next = clock_type::time_point::max();
    if (kill_deadline_ && running_ > 0) next = std::min(next, *kill_deadline_);
    if (job_deadline_ && !stopping_) next = std::min(next, *job_deadline_);
    if (linger_until) next = std::min(next, *linger_until);
    if (next == clock_type::time_point::max()) return -1;
    const auto ms = std::chrono::ceil<std::chrono::milliseconds>(next - clock_type::now()).count();
    return static_cast<int>(std::clamp<long long>(ms, 0, 60 * 60 * 1000));
  }

  void check_deadlines() {
    const auto now = clock_type::now();
    if (job_deadline_ && !stopping_ && now >= *job_deadline_) {
      timed_out_ = true;
      fmt::print(stderr, "ringzero-run: the job ran past --timeout {} s; stopping the ranks\n",
                 opt_.timeout_s);
      std::fflush(stderr);
      stop(SIGTERM);
    }
    if (kill_deadline_ && running_ > 0 && now >= *kill_deadline_) {
      std::string left;
      for (std::size_t r = 0; r < ranks_.size(); ++r)
        if (ranks_[r].running) left += fmt::format("{}{}", left.empty() ? "" : ", ", r);
      fmt::print(stderr,
                 "ringzero-run: rank(s) {} still running {} s after being told to stop; "
                 "killing them\n",
                 left, opt_.grace_s);
      std::fflush(stderr);
      stop(SIGKILL);
      kill_deadline_.reset();
    }
  }

  struct death {
    double at_s;
    std::string what;
  };
  struct generation {
    double at_s;
    std::string members;
  };

  options opt_;
  job_env env_;
  std::unique_ptr<ringzero::bootstrap::tcp_store> store_;  ///< an elastic job's store
  bool finished_ok_ = false;                               ///< a rank of an elastic job exited 0
  bool taken_in_ = false;         ///< --join: a generation took one of these ranks in
  std::int64_t deaths_seen_ = 0;  ///< the job's count of members declared lost, last read
  std::vector<death> deaths_;
  std::vector<generation> generations_;
  clock_type::time_point started_{};
  std::vector<rank_process> ranks_;
  int running_ = 0;
  bool stopping_ = false;
  bool spawn_failed_ = false;
  bool timed_out_ = false;
  int interrupted_by_ = 0;
  int first_failure_ = -1;
  std::optional<clock_type::time_point> kill_deadline_;
  std::optional<clock_type::time_point> job_deadline_;
};

}  // namespace

int main(int argc, char** argv) {
  options o = parse_args(argc, argv);
  install_signal_handlers();
  return job(std::move(o)).run();
}
