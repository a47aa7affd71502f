# Runs one fuzzer for SECONDS over a scratch copy of its seeds (SEEDS: globs separated by `|`,
# past findings among them), with its dictionary DICT when given. A single job: CI has two cores.
# The fuzzer exits non-zero on a crash, a sanitizer report, a leak, an input slower than 5 s or
# more than 2 GiB of memory; the input that did it is left in WORK/artifacts.
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK}/corpus ${WORK}/artifacts)
string(REPLACE "|" ";" globs "${SEEDS}")
file(GLOB seeds LIST_DIRECTORIES false ${globs})
# Seeds from different folders may share a name: prefix each with a number.
set(i 0)
foreach(seed ${seeds})
  get_filename_component(base ${seed} NAME)
  file(COPY_FILE ${seed} ${WORK}/corpus/${i}-${base})
  math(EXPR i "${i} + 1")
endforeach()
set(dict_arg)
if(DICT)
  set(dict_arg -dict=${DICT})
endif()
execute_process(COMMAND ${FUZZER} -max_total_time=${SECONDS} -timeout=5 -rss_limit_mb=2048 -max_len=${MAX_LEN}
                        ${dict_arg} -artifact_prefix=${WORK}/artifacts/ ${WORK}/corpus
                WORKING_DIRECTORY ${WORK} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${FUZZER} failed (exit ${rc}) on one of its ${i} seeds or a mutation of them; the input is in "
                      "${WORK}/artifacts: fix the defect and keep the input in ${REGRESSIONS}/")
endif()
