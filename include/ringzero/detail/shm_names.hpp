// Removing names under /dev/shm that a killed process left behind. The native shm transport,
// the libfabric watchdog and ringzero-run each clean up after a dead process, each with its
// own prefix; this header pulls in nothing but libc so that the launcher can use it too.
#pragma once

#include <dirent.h>
#include <unistd.h>

#include <string_view>

namespace ringzero::detail {

/// Unlinks every name in /dev/shm that starts with `prefix`. Only the name goes: the memory
/// itself lives on until its last mapping does.
inline void remove_shm_names(std::string_view prefix) noexcept {
  DIR* d = ::opendir("/dev/shm");
  if (d == nullptr) return;
  while (const dirent* e = ::readdir(d))
    if (std::string_view(e->d_name).starts_with(prefix)) ::unlinkat(::dirfd(d), e->d_name, 0);
  ::closedir(d);
}

}  // namespace ringzero::detail
