# cmake -DPROGRAM=... -DARGS=a^b^c -DEXPECT_CODE=2 -DEXPECT_REGEX=... -P expect.cmake
# Runs PROGRAM and fails unless it exits with EXPECT_CODE and prints EXPECT_REGEX.
string(REPLACE "^" ";" args "${ARGS}")
execute_process(COMMAND ${PROGRAM} ${args} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                ERROR_VARIABLE err)
message("${out}${err}")
if(rc STREQUAL "77" AND NOT EXPECT_CODE STREQUAL "77")
  message("SKIPPED: no CUDA device")
  return()
endif()
if(NOT rc STREQUAL EXPECT_CODE)
  message(FATAL_ERROR "exit code ${rc}, expected ${EXPECT_CODE}")
endif()
if(NOT "${out}${err}" MATCHES "${EXPECT_REGEX}")
  message(FATAL_ERROR "the output does not say '${EXPECT_REGEX}'")
endif()
