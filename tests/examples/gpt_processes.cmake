# The GPT demo as processes under ringzero-run (libfabric) computes what it computes as threads
# (loopback); a checkpoint 4 processes save resumes in 4 processes bitwise and in 2 processes.
# cmake -DGPT=<ringzero-gpt> -DRUN=<ringzero-run> -DDIR=<scratch dir> -P gpt_processes.cmake
set(model --dim 16 --heads 2 --layers 1 --context 16 --batch 8 --steps 6 --warmup 2 --sample 20
          --log-every 1)

include("${CMAKE_CURRENT_LIST_DIR}/gpt_common.cmake")

file(REMOVE_RECURSE "${DIR}")
run_gpt(threads ${GPT} -n 4 ${model})
final_crc(threads_crc "${threads}")
run_gpt(processes ${RUN} -n 4 ${GPT} ${model})
final_crc(processes_crc "${processes}")
if(NOT threads_crc STREQUAL processes_crc)
  message(FATAL_ERROR "processes ended with '${processes_crc}', threads with '${threads_crc}'")
endif()
foreach(what "ranks \\(processes, libfabric" "step    6  loss" "tokens/s" "ZeRO formula" "sample")
  if(NOT processes MATCHES "${what}")
    message(FATAL_ERROR "the process run printed no '${what}':\n${processes}")
  endif()
endforeach()

run_gpt(first ${RUN} -n 4 ${GPT} ${model} --stop-after 3 --save "${DIR}")
run_gpt(resumed4 ${RUN} -n 4 ${GPT} ${model} --resume "${DIR}")
final_crc(resumed4_crc "${resumed4}")
if(NOT resumed4_crc STREQUAL threads_crc)
  message(FATAL_ERROR "resumed at 4: '${resumed4_crc}', uninterrupted: '${threads_crc}'")
endif()
run_gpt(resumed2 ${RUN} -n 2 ${GPT} ${model} --resume "${DIR}")
if(NOT resumed2 MATCHES "resumed from .* at step 3" OR NOT resumed2 MATCHES "step    6  loss")
  message(FATAL_ERROR "the 2-process resume did not continue from step 3 to 6:\n${resumed2}")
endif()
file(REMOVE_RECURSE "${DIR}")
