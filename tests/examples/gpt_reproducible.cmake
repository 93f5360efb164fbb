# ringzero-gpt --reproducible: one final crc32c at 1, 2, 3, 4 and 6 ranks, as threads (loopback)
# and as processes under ringzero-run (libfabric, when RUN is given), at stages 0 and 3, with
# --shard-group 2 where the world allows, and for a checkpoint saved at 4 ranks and resumed at 3.
# cmake -DGPT=<ringzero-gpt> [-DRUN=<ringzero-run>] -DDIR=<scratch dir> -P gpt_reproducible.cmake
set(model --reproducible --dim 16 --heads 2 --layers 1 --context 16 --batch 12 --steps 4
          --warmup 2 --sample 0 --log-every 1)

include("${CMAKE_CURRENT_LIST_DIR}/gpt_common.cmake")

# Every run must print what the first printed.
set(want "")
function(expect what)
  run_gpt(text ${ARGN})
  final_crc(crc "${text}")
  if(want STREQUAL "")
    set(want "${crc}" PARENT_SCOPE)
    message(STATUS "${what}: ${crc}")
  elseif(NOT crc STREQUAL want)
    message(FATAL_ERROR "${what} ended with '${crc}', 1 thread with '${want}'")
  endif()
endfunction()

foreach(stage 0 3)
  foreach(n 1 2 3 4 6)
    expect("${n} threads, stage ${stage}" ${GPT} -n ${n} --stage ${stage} ${model})
    if(RUN)
      expect("${n} processes, stage ${stage}" ${RUN} -n ${n} ${GPT} --stage ${stage} ${model})
    endif()
  endforeach()
  foreach(n 2 4 6)
    expect("${n} threads in groups of 2, stage ${stage}" ${GPT} -n ${n} --stage ${stage}
           --shard-group 2 ${model})
  endforeach()
  if(RUN)
    expect("4 processes in groups of 2, stage ${stage}" ${RUN} -n 4 ${GPT} --stage ${stage}
           --shard-group 2 ${model})
  endif()
endforeach()

# Interrupted at step 2 on 4 ranks, resumed on 3: the uninterrupted bits.
file(REMOVE_RECURSE "${DIR}")
run_gpt(first ${GPT} -n 4 --stage 3 ${model} --stop-after 2 --save "${DIR}")
expect("saved at 4 ranks, resumed at 3" ${GPT} -n 3 --stage 1 ${model} --resume "${DIR}")
file(REMOVE_RECURSE "${DIR}")

# A world size that does not divide the micro-batches is refused by name.
execute_process(COMMAND ${GPT} -n 5 ${model} OUTPUT_VARIABLE out ERROR_VARIABLE err
                RESULT_VARIABLE rc)
if(rc EQUAL 0 OR NOT err MATCHES "--reproducible: the global batch is 12 micro-batches")
  message(FATAL_ERROR "5 ranks of 12 micro-batches: rc ${rc}\n${out}\n${err}")
endif()
