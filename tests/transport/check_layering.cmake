# Every include points down. Each header under include/ringzero/ sits on one floor (the list
# below, lowest first; docs/architecture.md draws it), and may include only headers of its own
# floor or lower ones; a header on no floor fails too, so a new one is placed deliberately.
# What the floors say, as rules:
#   - the vocabulary every layer shares (topology, tag_t: ringzero/base.hpp), errors, logging
#     and how a wait backs off (detail/backoff.hpp) sit below everything;
#   - tuning/'s constants and thresholds sit below the transports and the algorithms; the
#     predictions over the algorithm table are model/'s, above them;
#   - a transport's own headers (transport/<name>/...) hold only the transport: they include
#     neither the communicator, nor the algorithms' messaging (detail/exchange.hpp), nor
#     algorithms/, collectives.hpp or zero/; transport/<name>.hpp is the façade that gives the
#     transport's communicator;
#   - the algorithms sit below the dispatcher and reach it only through its declaration
#     (detail/dispatch_fwd.hpp); the API sits above the dispatcher, zero/ above the API.
# A deprecated forwarding header (it says "is deprecated: include ...") is exempt: it points at
# its replacement wherever that went.
# Run as: cmake -DROOT=<source dir> -P check_layering.cmake
if(NOT ROOT)
  message(FATAL_ERROR "check_layering.cmake: pass -DROOT=<source dir>")
endif()

# Floors, lowest first: a name, then the regular expressions of the headers on it (paths from
# include/).
set(floors base leaves kit transports communicator facades algorithms dispatcher api zero)
set(floor_base
    "^ringzero/(base|error|types|op|collective_table|algorithm|version|executor|log|wire)\\.hpp$"
    "^ringzero/detail/(env|backoff|tick_clock|agreement|shm_names|hmac|cuda_runtime)\\.hpp$")
set(floor_leaves
    "^ringzero/(reduce|kernels|bootstrap)/"
    "^ringzero/detail/rank_device\\.hpp$"
    "^ringzero/tuning/(policy|defaults|cost_terms|thresholds)\\.hpp$")
set(floor_kit
    "^ringzero/transport/(concept|native)\\.hpp$"
    "^ringzero/transport/detail/"
    "^ringzero/detail/trace_(writer|state)\\.hpp$")
set(floor_transports "^ringzero/transport/[a-z_]+/")
set(floor_communicator
    "^ringzero/detail/(comm_state|exchange|exchange_records|device_executor)\\.hpp$"
    "^ringzero/tuning/tuning_file\\.hpp$"
    "^ringzero/communicator\\.hpp$")
set(floor_facades "^ringzero/transport/[a-z_]+\\.hpp$")
set(floor_algorithms
    "^ringzero/algorithms/"
    "^ringzero/detail/(dispatch_fwd|validate)\\.hpp$")
set(floor_dispatcher
    "^ringzero/detail/(dispatch|call_route|reproducible_call|reproducible_device|quantized_call|trace_scope)\\.hpp$"
    "^ringzero/detail/paths/"
    "^ringzero/model/")
set(floor_api
    "^ringzero/(collectives|p2p|trace|ringzero|elastic)\\.hpp$"
    "^ringzero/elastic/"
    "^ringzero/detail/reproducible_combine\\.hpp$")
set(floor_zero "^ringzero/zero/")

# floor_of(<var> <header>): the index of the header's floor, or -1.
function(floor_of var header)
  set(i 0)
  foreach(f IN LISTS floors)
    foreach(re IN LISTS floor_${f})
      if(header MATCHES "${re}")
        set(${var} ${i} PARENT_SCOPE)
        return()
      endif()
    endforeach()
    math(EXPR i "${i} + 1")
  endforeach()
  set(${var} -1 PARENT_SCOPE)
endfunction()

file(GLOB_RECURSE headers RELATIVE "${ROOT}/include" "${ROOT}/include/ringzero/*.hpp"
     "${ROOT}/include/ringzero/*.cuh")
list(LENGTH headers count)
if(count EQUAL 0)
  message(FATAL_ERROR "check_layering.cmake: no headers under ${ROOT}/include/ringzero")
endif()
set(found "")
set(arrows 0)
foreach(header IN LISTS headers)
  file(READ "${ROOT}/include/${header}" text)
  if(text MATCHES "is deprecated: include ")
    continue()
  endif()
  floor_of(from "${header}")
  if(from EQUAL -1)
    list(APPEND found "${header}: on no floor (add it to check_layering.cmake's list)")
    continue()
  endif()
  list(GET floors ${from} from_name)
  file(STRINGS "${ROOT}/include/${header}" lines REGEX "^[ \t]*#[ \t]*include[ \t]*\"ringzero/")
  foreach(line IN LISTS lines)
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*\"([^\"]+)\".*$" "\\1" target "${line}")
    math(EXPR arrows "${arrows} + 1")
    floor_of(to "${target}")
    if(to GREATER from)
      list(GET floors ${to} to_name)
      list(APPEND found "${header} (${from_name}) includes ${target} (${to_name})")
    endif()
  endforeach()
endforeach()
if(found)
  list(JOIN found "\n  " text)
  message(FATAL_ERROR "includes that climb a floor:\n  ${text}")
endif()
message(STATUS "${count} headers, ${arrows} includes, every one pointing down or level")
