# cmake -DPROBE=<gpu_probe> -DANSWER=<file> -P gpu_probe.cmake: the CTest fixture gpu.probe.
# Writes the probe's line into ANSWER only where the probe ran and gave a clear answer (exit 0:
# a device; 77: none); the previous answer is removed first, so that a stale "no CUDA device"
# can never skip the tests of a machine that now has a GPU (common/gpu_gate.c runs every test
# whose answer is missing). Always passes: it only reports.
file(REMOVE "${ANSWER}")
execute_process(COMMAND "${PROBE}" RESULT_VARIABLE rc OUTPUT_VARIABLE line ERROR_VARIABLE err
                OUTPUT_STRIP_TRAILING_WHITESPACE)
if(rc STREQUAL "0" OR rc STREQUAL "77")
  file(WRITE "${ANSWER}" "${line}\n")
endif()
if(rc STREQUAL "77")
  message("gpu.probe: ${line}: every GPU test skips at once (exit 77)")
elseif(rc STREQUAL "0")
  message("gpu.probe: ${line}: the GPU tests run")
else()
  message("gpu.probe: the probe did not answer (exit ${rc}${err}); each GPU test asks for itself")
endif()
