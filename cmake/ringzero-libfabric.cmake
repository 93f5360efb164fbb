# Component libfabric of the installed ringzero package (included by ringzeroConfig.cmake).
# libfabric is found through pkg-config, as its own packages describe it.
find_package(PkgConfig QUIET)
if(NOT PkgConfig_FOUND)
  set(_ringzero_reason "pkg-config was not found (Debian: apt-get install pkg-config)")
  return()
endif()
pkg_check_modules(ringzero_LIBFABRIC QUIET IMPORTED_TARGET libfabric>=1.14)
if(NOT ringzero_LIBFABRIC_FOUND)
  string(CONCAT _ringzero_reason "pkg-config cannot find libfabric >= 1.14 (Debian: "
                "apt-get install libfabric-dev; elsewhere add its lib/pkgconfig to PKG_CONFIG_PATH)")
  return()
endif()
if(NOT TARGET ringzero::libfabric)
  add_library(ringzero::libfabric INTERFACE IMPORTED)
  set_target_properties(ringzero::libfabric PROPERTIES
    INTERFACE_LINK_LIBRARIES "ringzero::ringzero;PkgConfig::ringzero_LIBFABRIC")
endif()
set(ringzero_libfabric_FOUND TRUE)
