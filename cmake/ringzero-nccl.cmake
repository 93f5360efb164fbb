# Component nccl of the installed ringzero package (included by ringzeroConfig.cmake).
# nccl.h and libnccl are looked for next to the CUDA toolkit, then under $NCCL_HOME, as
# cmake/components.cmake does when ringzero itself is built.
find_package(CUDAToolkit QUIET)
if(NOT CUDAToolkit_FOUND)
  set(_ringzero_reason "the CUDA toolkit was not found (set CUDAToolkit_ROOT)")
  return()
endif()
find_path(RINGZERO_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} ENV NCCL_HOME
          PATH_SUFFIXES include)
find_library(RINGZERO_NCCL_LIBRARY nccl
             HINTS ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_ROOT} ENV NCCL_HOME
             PATH_SUFFIXES lib lib64)
if(NOT RINGZERO_NCCL_INCLUDE_DIR OR NOT RINGZERO_NCCL_LIBRARY)
  string(CONCAT _ringzero_reason "NCCL was not found (set NCCL_HOME, or "
                "RINGZERO_NCCL_INCLUDE_DIR and RINGZERO_NCCL_LIBRARY)")
  return()
endif()
if(NOT TARGET ringzero::nccl)
  add_library(ringzero::nccl INTERFACE IMPORTED)
  set_target_properties(ringzero::nccl PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${RINGZERO_NCCL_INCLUDE_DIR}"
    INTERFACE_LINK_LIBRARIES "ringzero::ringzero;CUDA::cudart;${RINGZERO_NCCL_LIBRARY}")
endif()
set(ringzero_nccl_FOUND TRUE)
