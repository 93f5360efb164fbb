#include <doctest/doctest.h>

#include <cstdlib>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/table.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/error.hpp"
#include "ringzero/op.hpp"

using namespace ringzero;

namespace {

template <class E>
void check_error(const E& e, errc code) {
  const error& base = e;
  const std::runtime_error& std_base = e;
  CHECK(base.code() == code);
  CHECK(std::string_view(std_base.what()).substr(0, 10) == "ringzero: ");
  CHECK(std::string_view(e.what()).find("detail") != std::string_view::npos);
}

}  // namespace

TEST_CASE("every error type carries its code and a ringzero: message") {
  check_error(invalid_argument("detail"), errc::invalid_argument);
  check_error(unsupported("detail"), errc::unsupported);
  check_error(timeout_error("detail", 3), errc::timeout);
  check_error(peer_error("detail", 4), errc::peer_failure);
  check_error(transport_error("detail"), errc::transport);
  check_error(bootstrap_error("detail"), errc::bootstrap);
  check_error(checkpoint_error("detail"), errc::checkpoint);
  check_error(mismatch_error("detail"), errc::mismatch);
  CHECK(timeout_error("x", 3).peer() == 3);
  CHECK(peer_error("x", 4).peer() == 4);
}

TEST_CASE("error codes have distinct names") {
  std::set<std::string_view> names;
  for (errc c : {errc::invalid_argument, errc::unsupported, errc::timeout, errc::peer_failure,
                 errc::transport, errc::bootstrap, errc::checkpoint, errc::mismatch})
    names.insert(errc_name(c));
  CHECK(names.size() == 8);
  CHECK(names.count("error") == 0);
  CHECK(std::string_view(errc_name(static_cast<errc>(99))) == "error");
}

TEST_CASE("names parse back; unknown names are invalid arguments") {
  for (op o : all_ops) CHECK(parse_op(op_name(o)) == o);
  CHECK_THROWS_AS((void)parse_op("mean"), invalid_argument);
  for (auto a :
       {algorithm::automatic, algorithm::ring, algorithm::tree, algorithm::recursive_doubling,
        algorithm::recursive_halving_doubling, algorithm::hierarchical})
    CHECK(parse_algorithm(algorithm_name(a)) == a);
  CHECK(parse_algorithm("automatic") == algorithm::automatic);
  CHECK_THROWS_AS((void)parse_algorithm("butterfly"), invalid_argument);
  CHECK_FALSE(is_valid(static_cast<op>(5)));
}

TEST_CASE("malformed RINGZERO_* values are rejected, not ignored") {
  ::setenv("RINGZERO_TIMEOUT", "soon", 1);
  CHECK_THROWS_AS((void)detail::env_timeout(), invalid_argument);
  ::setenv("RINGZERO_TIMEOUT", "-1", 1);
  CHECK_THROWS_AS((void)detail::env_timeout(), invalid_argument);
  ::setenv("RINGZERO_TIMEOUT", "0.5", 1);
  CHECK(detail::env_timeout() == std::chrono::milliseconds(500));
  ::unsetenv("RINGZERO_TIMEOUT");
  CHECK(detail::env_timeout() == std::chrono::seconds(300));
  ::setenv("RINGZERO_CHECK", "yes", 1);
  CHECK_THROWS_AS((void)detail::env_flag("RINGZERO_CHECK"), invalid_argument);
  ::unsetenv("RINGZERO_CHECK");
  CHECK_FALSE(detail::env_flag("RINGZERO_CHECK"));
}

TEST_CASE("call_env sees every setenv, unsetenv and putenv between calls") {
  // What each collective reads; the thread's remembered answer must never outlive a change.
  const auto algo = [] {
    const auto e = detail::call_env::read();
    return e.algo ? std::string(*e.algo) : std::string("(unset)");
  };
  ::unsetenv("RINGZERO_ALGO");
  ::unsetenv("RINGZERO_CHECK");
  CHECK(algo() == "(unset)");
  CHECK_FALSE(detail::call_env::read().check_on());
  ::setenv("RINGZERO_ALGO", "ring", 1);
  CHECK(algo() == "ring");
  CHECK(algo() == "ring");
  ::setenv("RINGZERO_ALGO", "tree", 1);  // the same name, a new value
  CHECK(algo() == "tree");
  ::setenv("RINGZERO_ALGO", "ring", 1);  // a value seen before (glibc reuses its string)
  CHECK(algo() == "ring");
  ::setenv("RINGZERO_CHECK", "1", 1);  // a new name
  CHECK(detail::call_env::read().check_on());
  CHECK(algo() == "ring");
  ::setenv("RINGZERO_CHECK", "0", 1);
  CHECK_FALSE(detail::call_env::read().check_on());
  ::setenv("RINGZERO_CHECK", "yes", 1);
  CHECK_THROWS_AS((void)detail::call_env::read().check_on(), invalid_argument);
  ::unsetenv("RINGZERO_CHECK");  // the entries after it move down
  CHECK_FALSE(detail::call_env::read().check_on());
  ::setenv("RINGZERO_ALGO", "", 1);  // empty is unset, as for getenv_str
  CHECK(algo() == "(unset)");
  static char mine[] = "RINGZERO_ALGO=rd";
  static char other[] = "RINGZERO_ALGO=rhd";
  ::putenv(mine);
  CHECK(algo() == "rd");
  ::putenv(other);
  CHECK(algo() == "rhd");
  // Another thread reads for itself, and sees the same.
  std::string seen;
  std::thread([&] { seen = algo(); }).join();
  CHECK(seen == "rhd");
  ::unsetenv("RINGZERO_ALGO");
  CHECK(algo() == "(unset)");
  // One name removed and another added keep the count; the last entry differs.
  ::setenv("RINGZERO_TEST_SPARE", "1", 1);
  CHECK(algo() == "(unset)");
  ::unsetenv("RINGZERO_TEST_SPARE");
  ::setenv("RINGZERO_ALGO", "tree", 1);
  CHECK(algo() == "tree");
  // The same with the found entry moved down: it is looked up again where it was.
  ::setenv("RINGZERO_TEST_SPARE", "1", 1);
  CHECK(algo() == "tree");
  ::unsetenv("RINGZERO_ALGO");
  ::setenv("RINGZERO_TEST_OTHER", "1", 1);
  CHECK(algo() == "(unset)");
  ::unsetenv("RINGZERO_TEST_SPARE");
  ::unsetenv("RINGZERO_TEST_OTHER");
  CHECK(algo() == "(unset)");
}
