# What the GPT demo's script tests share: run a command, failing with its output; find the
# "final fp32 weights" line (the checksum) in what it printed.

function(run_gpt out)
  execute_process(COMMAND ${ARGN} OUTPUT_VARIABLE text ERROR_VARIABLE err RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "'${ARGN}' failed (${rc}):\n${text}\n${err}")
  endif()
  set(${out} "${text}" PARENT_SCOPE)
endfunction()

function(final_crc out text)
  string(REGEX MATCH "final fp32 weights: [0-9]+ values, crc32c [0-9a-f]+" line "${text}")
  if(NOT line)
    message(FATAL_ERROR "no final weights in:\n${text}")
  endif()
  set(${out} "${line}" PARENT_SCOPE)
endfunction()
