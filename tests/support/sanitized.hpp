// Whether this program is built with AddressSanitizer or ThreadSanitizer, for the tests that run
// a smaller workload there (instrumented code runs several times slower, and the optimized build
// checks the full size). One place, because the compilers answer differently: GCC defines
// __SANITIZE_ADDRESS__ and __SANITIZE_THREAD__, Clang 14 (stage 2's compiler) defines neither
// and answers __has_feature instead; a test that asked only GCC's way ran at full size under
// Clang's AddressSanitizer.
#pragma once

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define RINGZERO_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define RINGZERO_TEST_SANITIZED 1
#endif
#endif

namespace test_support {
#if defined(RINGZERO_TEST_SANITIZED)
inline constexpr bool sanitized = true;
#else
inline constexpr bool sanitized = false;
#endif
}  // namespace test_support
