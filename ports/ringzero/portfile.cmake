# ringzero is header-only: one release configuration, nothing under debug/.
#
# Used as an overlay port from a ringzero checkout (vcpkg --overlay-ports=<checkout>/ports), the
# port builds that checkout. Copied elsewhere (a registry), it fetches the commit named by
# RINGZERO_GIT_REF from RINGZERO_GIT_URL; pass both with VCPKG_KEEP_ENV_VARS.
set(VCPKG_BUILD_TYPE release)

get_filename_component(ringzero_checkout "${CMAKE_CURRENT_LIST_DIR}/../.." ABSOLUTE)
if(EXISTS "${ringzero_checkout}/include/ringzero/ringzero.hpp")
  set(SOURCE_PATH "${ringzero_checkout}")
else()
  vcpkg_from_git(
    OUT_SOURCE_PATH SOURCE_PATH
    URL "$ENV{RINGZERO_GIT_URL}"
    REF "$ENV{RINGZERO_GIT_REF}")
endif()

# A feature makes its dependency required at build time; the component's headers and its
# find_package() logic are installed either way (see the usage file).
vcpkg_check_features(
  OUT_FEATURE_OPTIONS feature_options
  FEATURES
    libfabric RINGZERO_WITH_LIBFABRIC
    nccl RINGZERO_WITH_NCCL)

vcpkg_cmake_configure(
  SOURCE_PATH "${SOURCE_PATH}"
  OPTIONS
    ${feature_options}
    -DRINGZERO_INSTALL=ON
    -DRINGZERO_BUILD_TESTS=OFF
    -DRINGZERO_BUILD_EXAMPLES=OFF
    -DRINGZERO_BUILD_BENCH=OFF
    -DRINGZERO_BUILD_TOOLS=OFF)
vcpkg_cmake_install()
vcpkg_cmake_config_fixup(CONFIG_PATH share/cmake/ringzero)
vcpkg_fixup_pkgconfig()

file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/debug" "${CURRENT_PACKAGES_DIR}/share/doc")
file(INSTALL "${CMAKE_CURRENT_LIST_DIR}/usage" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}")
vcpkg_install_copyright(FILE_LIST "${SOURCE_PATH}/LICENSE")
