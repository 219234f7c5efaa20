# cmake -DPROGRAM=... -DARGS=a^b^c -DEXPECT_CODE=2 -DEXPECT_REGEX=... [-DEXPECT_FILE=...]
#       -P expect.cmake
# Runs PROGRAM and fails unless it exits with EXPECT_CODE and prints EXPECT_REGEX. With
# EXPECT_FILE (a file the run writes, such as its --tsv file; removed first, so that a stale
# one cannot pass), the regex is matched against the output followed by the file's text.
string(REPLACE "^" ";" args "${ARGS}")
if(EXPECT_FILE)
  file(REMOVE ${EXPECT_FILE})
endif()
execute_process(COMMAND ${PROGRAM} ${args} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                ERROR_VARIABLE err)
if(EXPECT_FILE AND EXISTS ${EXPECT_FILE})
  file(READ ${EXPECT_FILE} written)
  string(APPEND err "${written}")
endif()
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
