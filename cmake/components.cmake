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
       include/ringzero/transport/nccl/*.hpp include/ringzero/detail/cuda_runtime.hpp)
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

# --- ringzero::cuda: the CUDA kernels (include/ringzero/kernels/cuda/*.cuh) --------------------
# Reductions and the optimizer's kernels on device buffers. Needs nvcc (CMake's CUDA language);
# the per-element code they run lives in the core's kernels/*.hpp and is tested on the host.
# Built for sm_80 and sm_90 unless CMAKE_CUDA_ARCHITECTURES says otherwise. The .cuh files are
# not in a verified header set (CMake would compile them as C++); tests/kernels compiles each
# on its own with nvcc instead.
# The component itself is headers and CUDA::cudart: only a build that compiles CUDA sources of
# its own (tests, examples, benchmarks, tools) needs CMake's CUDA language. A package build or a
# parent project (vcpkg, Conan, add_subdirectory) asks for the toolkit and its nvcc only, which
# spares each such configure about 3 s of CPU (check_language and enable_language run nvcc).
set(RINGZERO_HAVE_CUDA OFF)
if(NOT RINGZERO_WITH_CUDA STREQUAL "OFF")
  find_package(CUDAToolkit QUIET)
  set(ringzero_compiles_cuda OFF)
  if(RINGZERO_BUILD_TESTS OR RINGZERO_BUILD_EXAMPLES OR RINGZERO_BUILD_BENCH
     OR RINGZERO_BUILD_TOOLS)
    # A compiler CMake cannot use leaves the component out instead of failing the configure.
    include(CheckLanguage)
    check_language(CUDA)
    set(ringzero_compiles_cuda ON)
  endif()
  if(CUDAToolkit_FOUND AND (ringzero_compiles_cuda AND CMAKE_CUDA_COMPILER OR
                            NOT ringzero_compiles_cuda AND EXISTS "${CUDAToolkit_NVCC_EXECUTABLE}"))
    if(ringzero_compiles_cuda)
      if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
        set(CMAKE_CUDA_ARCHITECTURES 80 90)
      endif()
      enable_language(CUDA)
    endif()
    set(RINGZERO_HAVE_CUDA ON)
  elseif(RINGZERO_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "RINGZERO_WITH_CUDA=ON but no CUDA compiler or toolkit was found "
                        "(put nvcc on PATH or set CMAKE_CUDA_COMPILER)")
  else()
    message(STATUS "ringzero: no CUDA compiler found; ringzero::cuda will not be available")
  endif()
endif()
if(RINGZERO_HAVE_CUDA)
  file(GLOB_RECURSE RINGZERO_CUDA_HEADERS CONFIGURE_DEPENDS
       RELATIVE "${CMAKE_CURRENT_SOURCE_DIR}" include/ringzero/kernels/cuda/*.cuh
       include/ringzero/zero/*.cuh include/ringzero/detail/cuda_runtime.hpp)
  add_library(ringzero_cuda INTERFACE)
  add_library(ringzero::cuda ALIAS ringzero_cuda)
  set_target_properties(ringzero_cuda PROPERTIES EXPORT_NAME cuda)
  target_link_libraries(ringzero_cuda INTERFACE ringzero::ringzero CUDA::cudart)
  # CMake 3.25 knows neither cuda_std_20 nor CUDA20's flag for nvcc 13, so the flag is given.
  target_compile_options(ringzero_cuda INTERFACE $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>)
  target_sources(ringzero_cuda INTERFACE FILE_SET HEADERS BASE_DIRS include
                 FILES ${RINGZERO_CUDA_HEADERS})
endif()
