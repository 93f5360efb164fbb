# Runs ports/ringzero/portfile.cmake the way `vcpkg install ringzero` would, without vcpkg.
#
# vcpkg itself cannot be installed on the test machines (it is neither a Debian nor a PyPI
# package), so this script provides the subset of vcpkg's port environment that the ringzero port
# uses, written from vcpkg's documentation of each helper:
#   variables  PORT, VERSION, FEATURES, TARGET_TRIPLET, CURRENT_PORT_DIR, CURRENT_PACKAGES_DIR,
#              CURRENT_BUILDTREES_DIR, CURRENT_INSTALLED_DIR, VCPKG_BUILD_TYPE (set by the port)
#   helpers    vcpkg_from_git, vcpkg_check_features, vcpkg_cmake_configure, vcpkg_cmake_install,
#              vcpkg_cmake_config_fixup, vcpkg_fixup_pkgconfig, vcpkg_install_copyright
# then applies the post-build checks vcpkg would (no debug tree in a release-only port, a
# copyright file, no absolute paths of the build machine in installed files) and merges the
# package into an installed tree <OUT>/installed/<triplet>, the prefix a vcpkg toolchain puts on
# CMAKE_PREFIX_PATH.
#
# Not reproduced: building fmt (the port's dependency comes from the system here), the host
# dependencies vcpkg-cmake/vcpkg-cmake-config (their functions are the shims below), vcpkg's
# toolchain file, binary caching and ABI hashing.
#
#   cmake -DPORT_DIR=<ports/ringzero> -DOUT=<dir> [-DWITH_FEATURES=libfabric;nccl] -P vcpkg-shim.cmake
cmake_minimum_required(VERSION 3.25)

foreach(var IN ITEMS PORT_DIR OUT)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "vcpkg-shim: -D${var}=... is required")
  endif()
endforeach()
get_filename_component(CURRENT_PORT_DIR "${PORT_DIR}" ABSOLUTE)
get_filename_component(OUT "${OUT}" ABSOLUTE)

# --- the manifest ------------------------------------------------------------------------------
file(READ "${CURRENT_PORT_DIR}/vcpkg.json" manifest)
string(JSON PORT GET "${manifest}" name)
string(JSON VERSION ERROR_VARIABLE no_semver GET "${manifest}" version-semver)
if(no_semver)
  string(JSON VERSION GET "${manifest}" version)
endif()
set(declared_dependencies "")
string(JSON ndeps LENGTH "${manifest}" dependencies)
math(EXPR last "${ndeps} - 1")
foreach(i RANGE ${last})
  string(JSON dep GET "${manifest}" dependencies ${i})
  string(JSON name ERROR_VARIABLE plain GET "${dep}" name)
  if(plain)
    set(name "${dep}")
  endif()
  list(APPEND declared_dependencies "${name}")
endforeach()
foreach(needed IN ITEMS fmt vcpkg-cmake vcpkg-cmake-config)
  if(NOT needed IN_LIST declared_dependencies)
    message(FATAL_ERROR "vcpkg-shim: vcpkg.json does not depend on ${needed}")
  endif()
endforeach()
set(FEATURES core)
foreach(feature IN LISTS WITH_FEATURES)
  string(JSON described ERROR_VARIABLE missing GET "${manifest}" features ${feature} description)
  if(missing)
    message(FATAL_ERROR "vcpkg-shim: vcpkg.json has no feature '${feature}'")
  endif()
  list(APPEND FEATURES "${feature}")
endforeach()

set(TARGET_TRIPLET x64-linux)
set(VCPKG_TARGET_IS_LINUX ON)
set(VCPKG_TARGET_EXECUTABLE_SUFFIX "")
set(CURRENT_BUILDTREES_DIR "${OUT}/buildtrees/${PORT}")
set(CURRENT_PACKAGES_DIR "${OUT}/packages/${PORT}_${TARGET_TRIPLET}")
set(CURRENT_INSTALLED_DIR "${OUT}/installed/${TARGET_TRIPLET}")
file(REMOVE_RECURSE "${CURRENT_BUILDTREES_DIR}" "${CURRENT_PACKAGES_DIR}")
file(MAKE_DIRECTORY "${CURRENT_BUILDTREES_DIR}" "${CURRENT_PACKAGES_DIR}" "${CURRENT_INSTALLED_DIR}")

function(z_shim_run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " line "${ARGN}")
    message(FATAL_ERROR "vcpkg-shim: command failed (${rc}): ${line}")
  endif()
endfunction()

# --- helpers the port calls --------------------------------------------------------------------

# Clones URL and checks out REF, which vcpkg requires to be a full commit id.
function(vcpkg_from_git)
  cmake_parse_arguments(PARSE_ARGV 0 arg "" "OUT_SOURCE_PATH;URL;REF;FETCH_REF;HEAD_REF" "PATCHES")
  if(NOT arg_URL OR NOT arg_REF)
    message(FATAL_ERROR "vcpkg_from_git: URL and REF are required (got URL '${arg_URL}', REF "
                        "'${arg_REF}')")
  endif()
  string(LENGTH "${arg_REF}" ref_length)
  if(NOT arg_REF MATCHES "^[0-9a-f]+$" OR NOT ref_length EQUAL 40)
    message(FATAL_ERROR "vcpkg_from_git: REF must be a full 40-character commit id, got "
                        "'${arg_REF}'")
  endif()
  set(dir "${CURRENT_BUILDTREES_DIR}/src/${arg_REF}")
  file(REMOVE_RECURSE "${dir}")
  z_shim_run(git clone --quiet "${arg_URL}" "${dir}")
  z_shim_run(git -C "${dir}" -c advice.detachedHead=false checkout --quiet "${arg_REF}")
  set(${arg_OUT_SOURCE_PATH} "${dir}" PARENT_SCOPE)
endfunction()

# FEATURES <feature> <variable> ... -> -D<variable>=ON|OFF in OUT_FEATURE_OPTIONS.
function(vcpkg_check_features)
  cmake_parse_arguments(PARSE_ARGV 0 arg "" "OUT_FEATURE_OPTIONS;PREFIX" "FEATURES;INVERTED_FEATURES")
  set(options "")
  list(LENGTH arg_FEATURES n)
  math(EXPR odd "${n} % 2")
  if(odd)
    message(FATAL_ERROR "vcpkg_check_features: FEATURES takes <feature> <option> pairs")
  endif()
  while(arg_FEATURES)
    list(POP_FRONT arg_FEATURES feature variable)
    string(JSON unused ERROR_VARIABLE missing GET "${manifest}" features ${feature})
    if(missing)
      message(FATAL_ERROR "vcpkg_check_features: '${feature}' is not a feature in vcpkg.json")
    endif()
    if(feature IN_LIST FEATURES)
      list(APPEND options "-D${variable}=ON")
    else()
      list(APPEND options "-D${variable}=OFF")
    endif()
  endwhile()
  set(${arg_OUT_FEATURE_OPTIONS} "${options}" PARENT_SCOPE)
endfunction()

function(vcpkg_cmake_configure)
  cmake_parse_arguments(PARSE_ARGV 0 arg "" "SOURCE_PATH"
                        "OPTIONS;OPTIONS_RELEASE;OPTIONS_DEBUG")
  if(NOT VCPKG_BUILD_TYPE STREQUAL "release")
    message(FATAL_ERROR "vcpkg-shim: only release-only ports (VCPKG_BUILD_TYPE release) are "
                        "emulated; a header-only port should be one")
  endif()
  set(build "${CURRENT_BUILDTREES_DIR}/${TARGET_TRIPLET}-rel")
  set(generator "Unix Makefiles")
  find_program(ninja NAMES ninja ninja-build)
  if(ninja)
    set(generator Ninja)
  endif()
  z_shim_run("${CMAKE_COMMAND}" -S "${arg_SOURCE_PATH}" -B "${build}" -G "${generator}"
             -DCMAKE_BUILD_TYPE=Release "-DCMAKE_INSTALL_PREFIX=${CURRENT_PACKAGES_DIR}"
             "-DCMAKE_PREFIX_PATH=${CURRENT_INSTALLED_DIR}" -DBUILD_SHARED_LIBS=OFF
             -DFETCHCONTENT_FULLY_DISCONNECTED=ON -DCMAKE_INSTALL_LIBDIR=lib
             -DCMAKE_INSTALL_BINDIR=bin -DCMAKE_INSTALL_INCLUDEDIR=include
             -DCMAKE_INSTALL_DATAROOTDIR=share ${arg_OPTIONS} ${arg_OPTIONS_RELEASE})
  set(Z_SHIM_BUILD_DIR "${build}" CACHE INTERNAL "")
endfunction()

function(vcpkg_cmake_install)
  z_shim_run("${CMAKE_COMMAND}" --build "${Z_SHIM_BUILD_DIR}" --target install)
endfunction()

# Moves CONFIG_PATH to share/<PACKAGE_NAME> (removing an emptied .../cmake parent) and re-derives
# the import prefix of every moved .cmake file for its new depth, share/<name>.
function(vcpkg_cmake_config_fixup)
  cmake_parse_arguments(PARSE_ARGV 0 arg "DO_NOT_DELETE_PARENT_CONFIG_PATH;NO_PREFIX_CORRECTION"
                        "PACKAGE_NAME;CONFIG_PATH" "")
  if(NOT arg_PACKAGE_NAME)
    set(arg_PACKAGE_NAME "${PORT}")
  endif()
  if(NOT arg_CONFIG_PATH)
    set(arg_CONFIG_PATH "share/${arg_PACKAGE_NAME}")
  endif()
  set(from "${CURRENT_PACKAGES_DIR}/${arg_CONFIG_PATH}")
  set(to "${CURRENT_PACKAGES_DIR}/share/${arg_PACKAGE_NAME}")
  if(NOT EXISTS "${from}")
    message(FATAL_ERROR "vcpkg_cmake_config_fixup: '${from}' does not exist")
  endif()
  if(NOT from STREQUAL to)
    file(GLOB files "${from}/*")
    file(COPY ${files} DESTINATION "${to}")
    file(REMOVE_RECURSE "${from}")
    get_filename_component(parent "${from}" DIRECTORY)
    get_filename_component(parent_name "${parent}" NAME)
    if(parent_name STREQUAL "cmake" AND NOT arg_DO_NOT_DELETE_PARENT_CONFIG_PATH)
      file(REMOVE_RECURSE "${parent}")
    endif()
  endif()
  set(get_prefix [[get_filename_component(_IMPORT_PREFIX "${CMAKE_CURRENT_LIST_FILE}" PATH)]])
  set(up [[get_filename_component(_IMPORT_PREFIX "${_IMPORT_PREFIX}" PATH)]])
  string(REGEX REPLACE "([][()\\$.*+?^{}|])" "\\\\\\1" get_prefix_re "${get_prefix}")
  string(REGEX REPLACE "([][()\\$.*+?^{}|])" "\\\\\\1" up_re "${up}")
  file(GLOB_RECURSE cmake_files "${to}/*.cmake")
  foreach(f IN LISTS cmake_files)
    file(READ "${f}" contents)
    if(NOT arg_NO_PREFIX_CORRECTION)
      string(REGEX REPLACE "${get_prefix_re}(\n${up_re})*" "${get_prefix}\n${up}\n${up}" contents
                           "${contents}")
      string(REGEX REPLACE
             [[get_filename_component\(PACKAGE_PREFIX_DIR "\${CMAKE_CURRENT_LIST_DIR}/\.\./(\.\./)*" ABSOLUTE\)]]
             [[get_filename_component(PACKAGE_PREFIX_DIR "${CMAKE_CURRENT_LIST_DIR}/../../" ABSOLUTE)]]
             contents "${contents}")
    endif()
    string(REPLACE "${CURRENT_INSTALLED_DIR}" [[${_IMPORT_PREFIX}]] contents "${contents}")
    string(REPLACE "${CURRENT_PACKAGES_DIR}" [[${_IMPORT_PREFIX}]] contents "${contents}")
    file(WRITE "${f}" "${contents}")
  endforeach()
endfunction()

# vcpkg rewrites prefix= to be relative to the .pc file; ringzero's already is, so this checks it.
function(vcpkg_fixup_pkgconfig)
  file(GLOB pcs "${CURRENT_PACKAGES_DIR}/lib/pkgconfig/*.pc"
       "${CURRENT_PACKAGES_DIR}/share/pkgconfig/*.pc")
  if(NOT pcs)
    message(FATAL_ERROR "vcpkg_fixup_pkgconfig: no .pc files were installed")
  endif()
  foreach(pc IN LISTS pcs)
    file(STRINGS "${pc}" prefix_line REGEX "^prefix=")
    if(NOT prefix_line MATCHES [[^prefix=\${pcfiledir}/]])
      message(FATAL_ERROR "vcpkg_fixup_pkgconfig: ${pc} has '${prefix_line}', expected a prefix "
                          "relative to \${pcfiledir}")
    endif()
  endforeach()
endfunction()

function(vcpkg_install_copyright)
  cmake_parse_arguments(PARSE_ARGV 0 arg "" "COMMENT" "FILE_LIST")
  set(text "")
  foreach(f IN LISTS arg_FILE_LIST)
    if(NOT EXISTS "${f}")
      message(FATAL_ERROR "vcpkg_install_copyright: '${f}' does not exist")
    endif()
    file(READ "${f}" part)
    string(APPEND text "${part}")
  endforeach()
  file(WRITE "${CURRENT_PACKAGES_DIR}/share/${PORT}/copyright" "${text}")
endfunction()

# --- the port ----------------------------------------------------------------------------------
set(CMAKE_CURRENT_LIST_DIR "${CURRENT_PORT_DIR}")
include("${CURRENT_PORT_DIR}/portfile.cmake")

# --- post-build checks -------------------------------------------------------------------------
set(problems "")
if(EXISTS "${CURRENT_PACKAGES_DIR}/debug")
  list(APPEND problems "a release-only port left a debug/ tree")
endif()
if(NOT EXISTS "${CURRENT_PACKAGES_DIR}/share/${PORT}/copyright")
  list(APPEND problems "share/${PORT}/copyright is missing")
endif()
if(NOT EXISTS "${CURRENT_PACKAGES_DIR}/share/${PORT}/usage")
  list(APPEND problems "share/${PORT}/usage is missing")
endif()
if(EXISTS "${CURRENT_PACKAGES_DIR}/share/cmake")
  list(APPEND problems "share/cmake/ is left over after vcpkg_cmake_config_fixup")
endif()
file(GLOB loose LIST_DIRECTORIES false "${CURRENT_PACKAGES_DIR}/*")
if(loose)
  list(APPEND problems "files at the package root: ${loose}")
endif()
file(GLOB_RECURSE installed_files "${CURRENT_PACKAGES_DIR}/*")
foreach(f IN LISTS installed_files)
  file(STRINGS "${f}" hits REGEX "${OUT}")
  if(hits)
    file(RELATIVE_PATH rel "${CURRENT_PACKAGES_DIR}" "${f}")
    list(APPEND problems "${rel} contains an absolute path of the build: ${hits}")
  endif()
endforeach()
if(problems)
  list(JOIN problems "\n  " problems)
  message(FATAL_ERROR "vcpkg-shim: post-build checks failed:\n  ${problems}")
endif()

file(COPY "${CURRENT_PACKAGES_DIR}/" DESTINATION "${CURRENT_INSTALLED_DIR}")
list(JOIN FEATURES "," feature_list)
message(STATUS "vcpkg-shim: installed ${PORT}[${feature_list}] ${VERSION} into "
               "${CURRENT_INSTALLED_DIR}")
