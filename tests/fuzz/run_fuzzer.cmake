# Runs the frontend fuzzer for 30 seconds over a scratch copy of the seed corpus, the models, the
# diagnostic test inputs and the past crashers, with the language's dictionary. A single job: CI
# has two cores.
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK}/corpus ${WORK}/artifacts)
file(GLOB seeds ${CORPUS}/* ${MODELS}/*.kiln ${ERRORS}/*.kiln ${REGRESSIONS}/*.kiln)
file(COPY ${seeds} DESTINATION ${WORK}/corpus)
execute_process(COMMAND ${FUZZER} -max_total_time=30 -timeout=5 -rss_limit_mb=2048 -max_len=8192
                        -dict=${DICT} -artifact_prefix=${WORK}/artifacts/ ${WORK}/corpus
                WORKING_DIRECTORY ${WORK} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the frontend fuzzer failed (exit ${rc}); the crashing input is in ${WORK}/artifacts; "
                      "fix it and add it to tests/frontend/fuzz_regressions/")
endif()
