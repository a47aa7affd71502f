# Runs the frontend fuzzer for 30 seconds over a scratch copy of the seed corpus and the models.
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
file(GLOB seeds ${CORPUS}/* ${MODELS}/*.kiln)
file(COPY ${seeds} DESTINATION ${WORK})
execute_process(COMMAND ${FUZZER} -max_total_time=30 -timeout=10 -rss_limit_mb=2048 -max_len=8192 ${WORK}
                WORKING_DIRECTORY ${WORK} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the frontend fuzzer failed (exit ${rc}); the crashing input is in ${WORK}")
endif()
