# ringzero-gpt --reproducible: one final crc32c at 1, 2, 3, 4 and 6 ranks, as threads (loopback)
# and as processes under ringzero-run (libfabric, when RUN is given), at stages 0 and 3, with
# --shard-group 2 where the world allows, and for a checkpoint saved at 4 ranks and resumed at 3.
# cmake -DGPT=<ringzero-gpt> [-DRUN=<ringzero-run>] -DDIR=<scratch dir> [-DLARGE=ON]
#       -P gpt_reproducible.cmake
#
# LARGE: the 3.2M-parameter model of docs/zero.md (--dim 256 --layers 4 --heads 4). By default a
# few runs of one step over 12 sequences (about 20 s of CPU at -O1): 1 and 4 threads at stage 3,
# 2 threads at stage 0, 4 processes in shard groups of 2. RINGZERO_GPT_LARGE_STEPS=20 runs the
# docs' table instead: 24 sequences, that many steps, every world size, stage and grouping.
cmake_policy(SET CMP0057 NEW)  # if(... IN_LIST ...)

set(small --reproducible --dim 16 --heads 2 --layers 1 --context 16 --batch 12 --steps 4
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
    message(FATAL_ERROR "${what} ended with '${crc}', the first run with '${want}'")
  endif()
endfunction()

# The table: at each stage, every world size as threads and processes, and shard groups of 2
# (as processes at the world sizes `grouped`).
function(table model grouped)
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
      if(RUN AND n IN_LIST grouped)
        expect("${n} processes in groups of 2, stage ${stage}" ${RUN} -n ${n} ${GPT}
               --stage ${stage} --shard-group 2 ${model})
      endif()
    endforeach()
  endforeach()
  set(want "${want}" PARENT_SCOPE)
endfunction()

if(LARGE)
  set(large --reproducible --dim 256 --layers 4 --heads 4 --sample 0)
  if(DEFINED ENV{RINGZERO_GPT_LARGE_STEPS})
    table("${large};--batch;24;--steps;$ENV{RINGZERO_GPT_LARGE_STEPS}" "2;4;6")
  else()
    set(model ${large} --batch 12 --steps 1)
    expect("1 thread, stage 3" ${GPT} -n 1 --stage 3 ${model})
    expect("4 threads, stage 3" ${GPT} -n 4 --stage 3 ${model})
    expect("2 threads, stage 0" ${GPT} -n 2 --stage 0 ${model})
    if(RUN)
      expect("4 processes in groups of 2, stage 3" ${RUN} -n 4 ${GPT} --stage 3 --shard-group 2
             ${model})
    endif()
  endif()
  return()
endif()

table("${small}" "4")

# Interrupted at step 2 on 4 ranks, resumed on 3: the uninterrupted bits.
file(REMOVE_RECURSE "${DIR}")
run_gpt(first ${GPT} -n 4 --stage 3 ${small} --stop-after 2 --save "${DIR}")
expect("saved at 4 ranks, resumed at 3" ${GPT} -n 3 --stage 1 ${small} --resume "${DIR}")
file(REMOVE_RECURSE "${DIR}")

# A world size that does not divide the micro-batches is refused by name.
execute_process(COMMAND ${GPT} -n 5 ${small} OUTPUT_VARIABLE out ERROR_VARIABLE err
                RESULT_VARIABLE rc)
if(rc EQUAL 0 OR NOT err MATCHES "--reproducible: the global batch is 12 micro-batches")
  message(FATAL_ERROR "5 ranks of 12 micro-batches: rc ${rc}\n${out}\n${err}")
endif()
