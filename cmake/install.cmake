# `cmake --install`: headers, tools, a CMake package and pkg-config files.
#
# ringzero is header-only, so everything lands under share/ (ARCH_INDEPENDENT) except the tools.
# The backend components are installed whether or not this build found their dependencies: an
# installed package is the same on every machine, and find_package(ringzero COMPONENTS ...)
# decides on the consumer's machine whether libfabric or NCCL is there (cmake/ringzero-*.cmake).

include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(RINGZERO_INSTALL_CMAKEDIR "${CMAKE_INSTALL_DATADIR}/cmake/ringzero"
    CACHE STRING "Where ringzeroConfig.cmake is installed, relative to the prefix")
set(RINGZERO_INSTALL_PKGCONFIGDIR "${CMAKE_INSTALL_DATADIR}/pkgconfig"
    CACHE STRING "Where ringzero.pc is installed, relative to the prefix")

# --- core --------------------------------------------------------------------------------------
install(TARGETS ringzero EXPORT ringzero-targets FILE_SET HEADERS
        DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")
install(EXPORT ringzero-targets NAMESPACE ringzero:: DESTINATION "${RINGZERO_INSTALL_CMAKEDIR}"
        FILE ringzero-targets.cmake)

# --- backend headers ---------------------------------------------------------------------------
# The same globs as cmake/components.cmake (with the CUDA runtime check both backends share), plus
# the CUDA reduction kernels NCCL's side uses.
file(GLOB_RECURSE ringzero_component_headers CONFIGURE_DEPENDS
     RELATIVE "${PROJECT_SOURCE_DIR}/include"
     "${PROJECT_SOURCE_DIR}/include/ringzero/transport/libfabric*.hpp"
     "${PROJECT_SOURCE_DIR}/include/ringzero/transport/libfabric/*.hpp"
     "${PROJECT_SOURCE_DIR}/include/ringzero/transport/nccl*.hpp"
     "${PROJECT_SOURCE_DIR}/include/ringzero/transport/nccl/*.hpp"
     "${PROJECT_SOURCE_DIR}/include/ringzero/reduce/cuda*"
     "${PROJECT_SOURCE_DIR}/include/ringzero/reduce/cuda/*"
     "${PROJECT_SOURCE_DIR}/include/ringzero/detail/cuda_runtime.hpp"
     "${PROJECT_SOURCE_DIR}/include/ringzero/*.cuh")  # CUDA headers, wherever they sit
list(REMOVE_DUPLICATES ringzero_component_headers)
foreach(header IN LISTS ringzero_component_headers)
  get_filename_component(header_dir "${header}" DIRECTORY)
  install(FILES "${PROJECT_SOURCE_DIR}/include/${header}"
          DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}/${header_dir}")
endforeach()

# --- tools -------------------------------------------------------------------------------------
foreach(tool IN ITEMS ringzero-run ringzero-perf ringzero-export ringzero-model ringzero-trace)
  if(TARGET ${tool})
    install(TARGETS ${tool} RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}")
  endif()
endforeach()
if(TARGET ringzero-model)
  install(DIRECTORY "${PROJECT_SOURCE_DIR}/tools/model/fabrics/"
          DESTINATION "${CMAKE_INSTALL_DATADIR}/ringzero/fabrics")
endif()

# --- CMake package -----------------------------------------------------------------------------
configure_package_config_file(
  "${CMAKE_CURRENT_LIST_DIR}/ringzeroConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/package/ringzeroConfig.cmake"
  INSTALL_DESTINATION "${RINGZERO_INSTALL_CMAKEDIR}"
  NO_SET_AND_CHECK_MACRO NO_CHECK_REQUIRED_COMPONENTS_MACRO)
write_basic_package_version_file(
  "${PROJECT_BINARY_DIR}/package/ringzeroConfigVersion.cmake"
  VERSION "${PROJECT_VERSION}" COMPATIBILITY SameMajorVersion ARCH_INDEPENDENT)
install(FILES "${PROJECT_BINARY_DIR}/package/ringzeroConfig.cmake"
              "${PROJECT_BINARY_DIR}/package/ringzeroConfigVersion.cmake"
              "${CMAKE_CURRENT_LIST_DIR}/ringzero-libfabric.cmake"
              "${CMAKE_CURRENT_LIST_DIR}/ringzero-nccl.cmake"
        DESTINATION "${RINGZERO_INSTALL_CMAKEDIR}")

# --- pkg-config --------------------------------------------------------------------------------
# prefix is written relative to the .pc file so the tree can be moved (Conan, vcpkg, tarballs).
if(IS_ABSOLUTE "${RINGZERO_INSTALL_PKGCONFIGDIR}")
  set(RINGZERO_PC_PREFIX "${CMAKE_INSTALL_PREFIX}")
else()
  file(RELATIVE_PATH ringzero_pc_up "/prefix/${RINGZERO_INSTALL_PKGCONFIGDIR}" "/prefix")
  string(REGEX REPLACE "/+$" "" ringzero_pc_up "${ringzero_pc_up}")
  set(RINGZERO_PC_PREFIX "\${pcfiledir}/${ringzero_pc_up}")
endif()
if(IS_ABSOLUTE "${CMAKE_INSTALL_INCLUDEDIR}")
  set(RINGZERO_PC_INCLUDEDIR "${CMAKE_INSTALL_INCLUDEDIR}")
else()
  set(RINGZERO_PC_INCLUDEDIR "\${prefix}/${CMAKE_INSTALL_INCLUDEDIR}")
endif()
foreach(pc IN ITEMS ringzero ringzero-libfabric)
  configure_file("${CMAKE_CURRENT_LIST_DIR}/${pc}.pc.in" "${PROJECT_BINARY_DIR}/package/${pc}.pc"
                 @ONLY)
  install(FILES "${PROJECT_BINARY_DIR}/package/${pc}.pc"
          DESTINATION "${RINGZERO_INSTALL_PKGCONFIGDIR}")
endforeach()

foreach(doc IN ITEMS LICENSE README.md)
  if(EXISTS "${PROJECT_SOURCE_DIR}/${doc}")
    install(FILES "${PROJECT_SOURCE_DIR}/${doc}" DESTINATION "${CMAKE_INSTALL_DOCDIR}")
  endif()
endforeach()
