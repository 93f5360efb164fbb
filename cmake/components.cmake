# Opt-in backend components. Each is an INTERFACE target with its own header set and its own
# dependency, so the core never needs libfabric or CUDA.

# --- ringzero::libfabric ---------------------------------------------------------------------
set(RINGZERO_HAVE_LIBFABRIC OFF)
if(NOT RINGZERO_WITH_LIBFABRIC STREQUAL "OFF")
  find_package(PkgConfig)
  if(PkgConfig_FOUND)
    pkg_check_modules(LIBFABRIC IMPORTED_TARGET libfabric>=1.14)
  endif()
  if(LIBFABRIC_FOUND)
    set(RINGZERO_HAVE_LIBFABRIC ON)
  elseif(RINGZERO_WITH_LIBFABRIC STREQUAL "ON")
    message(FATAL_ERROR "RINGZERO_WITH_LIBFABRIC=ON but pkg-config cannot find libfabric >= 1.14 "
                        "(Debian: apt-get install libfabric-dev pkg-config)")
  else()
    message(STATUS "ringzero: libfabric not found; ringzero::libfabric will not be available")
  endif()
endif()
if(RINGZERO_HAVE_LIBFABRIC)
  file(GLOB_RECURSE RINGZERO_LIBFABRIC_HEADERS CONFIGURE_DEPENDS
       RELATIVE "${CMAKE_CURRENT_SOURCE_DIR}" include/ringzero/transport/libfabric*.hpp
       include/ringzero/transport/libfabric/*.hpp)
  add_library(ringzero_libfabric INTERFACE)
  add_library(ringzero::libfabric ALIAS ringzero_libfabric)
  set_target_properties(ringzero_libfabric PROPERTIES
    EXPORT_NAME libfabric VERIFY_INTERFACE_HEADER_SETS ${PROJECT_IS_TOP_LEVEL})
  target_link_libraries(ringzero_libfabric INTERFACE ringzero::ringzero PkgConfig::LIBFABRIC)
  target_sources(ringzero_libfabric INTERFACE FILE_SET HEADERS BASE_DIRS include
                 FILES ${RINGZERO_LIBFABRIC_HEADERS})
endif()

# --- ringzero::nccl --------------------------------------------------------------------------
set(RINGZERO_HAVE_NCCL OFF)
if(NOT RINGZERO_WITH_NCCL STREQUAL "OFF")
  find_package(CUDAToolkit QUIET)
  find_path(RINGZERO_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} ENV NCCL_HOME
            PATH_SUFFIXES include)
  find_library(RINGZERO_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} ENV NCCL_HOME
               PATH_SUFFIXES lib lib64)
  if(CUDAToolkit_FOUND AND RINGZERO_NCCL_INCLUDE_DIR AND RINGZERO_NCCL_LIBRARY)
    set(RINGZERO_HAVE_NCCL ON)
  elseif(RINGZERO_WITH_NCCL STREQUAL "ON")
    message(FATAL_ERROR "RINGZERO_WITH_NCCL=ON but the CUDA toolkit or NCCL was not found "
                        "(set CUDAToolkit_ROOT / NCCL_HOME)")
  else()
    message(STATUS "ringzero: CUDA toolkit or NCCL not found; ringzero::nccl will not be available")
  endif()
endif()
if(RINGZERO_HAVE_NCCL)
  file(GLOB_RECURSE RINGZERO_NCCL_HEADERS CONFIGURE_DEPENDS
       RELATIVE "${CMAKE_CURRENT_SOURCE_DIR}" include/ringzero/transport/nccl*.hpp
       include/ringzero/transport/nccl/*.hpp)
  add_library(ringzero_nccl INTERFACE)
  add_library(ringzero::nccl ALIAS ringzero_nccl)
  set_target_properties(ringzero_nccl PROPERTIES
    EXPORT_NAME nccl VERIFY_INTERFACE_HEADER_SETS ${PROJECT_IS_TOP_LEVEL})
  target_include_directories(ringzero_nccl INTERFACE ${RINGZERO_NCCL_INCLUDE_DIR})
  target_link_libraries(ringzero_nccl INTERFACE ringzero::ringzero CUDA::cudart
                        ${RINGZERO_NCCL_LIBRARY})
  target_sources(ringzero_nccl INTERFACE FILE_SET HEADERS BASE_DIRS include
                 FILES ${RINGZERO_NCCL_HEADERS})
endif()
