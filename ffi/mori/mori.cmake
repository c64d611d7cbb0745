# The MoRI implementation (ROCm): built only where hipcc and MoRI's headers and libraries are found
# (MORI_ROOT: a MoRI install or the amd-mori wheel's mori/ directory, holding
# _jit_sources/include/mori/... or include/mori/..., and libmori_ops.so / libmori_shmem.so).
# Elsewhere it is skipped with a message saying what is missing; the host implementation is
# unaffected.
set(MORI_ROOT "$ENV{MORI_ROOT}" CACHE PATH "MoRI install or the amd-mori wheel's mori/ directory")
find_program(HIPCC_EXECUTABLE hipcc HINTS "$ENV{ROCM_PATH}/bin" /opt/rocm/bin)
find_path(MORI_INCLUDE_DIR mori/ops/dispatch_combine/launch.hpp
          HINTS "${MORI_ROOT}/_jit_sources/include" "${MORI_ROOT}/include")
find_library(MORI_OPS_LIBRARY mori_ops HINTS "${MORI_ROOT}" "${MORI_ROOT}/lib")
find_library(MORI_SHMEM_LIBRARY mori_shmem HINTS "${MORI_ROOT}" "${MORI_ROOT}/lib")
find_library(MORI_APPLICATION_LIBRARY mori_application HINTS "${MORI_ROOT}" "${MORI_ROOT}/lib")

set(_mori_missing "")
if(HIPCC_EXECUTABLE)
  include(CheckLanguage)
  check_language(HIP)  # a HIP toolchain CMake can use (ROCm's clang); a failed probe is "missing", not fatal
  set(HIP_LANGUAGE "${CMAKE_HIP_COMPILER}")
endif()
foreach(_what HIPCC_EXECUTABLE HIP_LANGUAGE MORI_INCLUDE_DIR MORI_OPS_LIBRARY MORI_SHMEM_LIBRARY MORI_APPLICATION_LIBRARY)
  if(NOT ${_what})
    list(APPEND _mori_missing ${_what})
  endif()
endforeach()

if(_mori_missing)
  set(MOEJAX_FFI_MORI OFF CACHE INTERNAL "the MoRI target is configured")
  message(STATUS "moejax_ffi: MoRI implementation not built, not found: ${_mori_missing} "
                 "(needs ROCm's hipcc and MoRI; set MORI_ROOT)")
else()
  # ep_mori.cc is host C++ against MoRI's C++ API (C++20, as MoRI's headers need); the two layout
  # kernels are HIP
  enable_language(HIP)
  find_package(hip REQUIRED)
  add_library(moejax_ep_mori SHARED mori/ep_mori.cc mori/layout_kernels.hip)
  set_source_files_properties(mori/layout_kernels.hip PROPERTIES LANGUAGE HIP)
  target_include_directories(moejax_ep_mori SYSTEM PRIVATE "${XLA_FFI_INCLUDE_DIR}" "${MORI_INCLUDE_DIR}")
  target_link_libraries(moejax_ep_mori PRIVATE hip::host ${MORI_OPS_LIBRARY} ${MORI_SHMEM_LIBRARY}
                        ${MORI_APPLICATION_LIBRARY})
  set_target_properties(moejax_ep_mori PROPERTIES PREFIX "lib" CXX_STANDARD 20 HIP_STANDARD 17)
  install(TARGETS moejax_ep_mori LIBRARY DESTINATION .)
  # setup.py builds this target on its own, so a failing MoRI build never costs the host library
  set(MOEJAX_FFI_MORI ON CACHE INTERNAL "the MoRI target is configured")
  message(STATUS "moejax_ffi: MoRI implementation configured against ${MORI_INCLUDE_DIR}")
endif()
