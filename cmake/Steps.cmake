# attn_steps(STAGE [FLAG...]): the CTest cases of a stage's technique steps (STAGE/steps/, made
# and checked by scripts/steps.py; ARCHITECTURE.md section 16 says why steps).
#
#   STAGE.steps.apply             the patches apply in order and end at the stage's files
#                                 (label cpu: text alone, no toolkit needed);
#   STAGE.steps.build.NN-name     step NN compiles as the stage's program, with the stage's
#                                 warnings as errors and FLAG... (its architecture; without
#                                 FLAG, every one of CMAKE_CUDA_ARCHITECTURES), into
#                                 build/steps/STAGE-NN (label steps);
#   STAGE.steps.run.NN-name.CASE  that program checks a few shapes, forward and backward, against
#                                 the float64 reference (label gpu: skipped without a GPU).
# The build and run cases exist where the stage itself is built.
function(attn_steps stage)
  if(NOT Python3_Interpreter_FOUND)
    return()
  endif()
  set(steps_py ${PROJECT_SOURCE_DIR}/scripts/steps.py)
  add_test(NAME ${stage}.steps.apply COMMAND ${Python3_EXECUTABLE} ${steps_py} check ${stage})
  set_tests_properties(${stage}.steps.apply PROPERTIES LABELS cpu)
  if(NOT TARGET ${stage})
    return()
  endif()
  set(arch_flags ${ARGN})
  if(NOT arch_flags)
    foreach(arch ${CMAKE_CUDA_ARCHITECTURES})
      if(arch MATCHES "^(native|all|all-major)$")
        list(APPEND arch_flags -arch=${arch})
      else()
        string(REGEX REPLACE "-(real|virtual)$" "" number ${arch})
        list(APPEND arch_flags -gencode=arch=compute_${number},code=sm_${number})
      endif()
    endforeach()
  endif()
  file(GLOB patches CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/${stage}/steps/[0-9][0-9]-*.patch)
  foreach(patch ${patches})
    get_filename_component(step ${patch} NAME_WE)
    string(SUBSTRING ${step} 0 2 nn)
    set(program ${CMAKE_BINARY_DIR}/steps/${stage}-${nn})
    add_test(NAME ${stage}.steps.build.${step}
             COMMAND ${Python3_EXECUTABLE} ${steps_py} build ${stage} ${nn} ${program} --
                     ${CMAKE_CUDA_COMPILER} -O3 -std=c++20 ${arch_flags}
                     -I${PROJECT_SOURCE_DIR}/common
                     -Xcompiler=-Wall,-Wextra,-Wno-missing-field-initializers -Xcompiler=-Werror
                     -Werror all-warnings $<TARGET_FILE:attn_gpu> $<TARGET_FILE:attn_common> -lm)
    set_tests_properties(${stage}.steps.build.${step} PROPERTIES LABELS steps TIMEOUT 900
                         FIXTURES_SETUP ${stage}.step${nn})
    # A causal ragged pair at d = 64 and a square shape at d = 128 and 32, each dtype once.
    foreach(case "causal.127x513.d64;--causal;--seq-q;127;--seq-kv;513;-d;64;--dtype;fp16"
                 "N257.d128;-n;257;-d;128;--dtype;bf16" "N200.d32.causal;--causal;-n;200;-d;32")
      list(POP_FRONT case name)
      set(test ${stage}.steps.run.${step}.${name})
      add_test(NAME ${test} COMMAND ${ATTN_GPU_GATE} ${program} --check --backward -b 2 -H 3
                                    ${case})
      set_tests_properties(${test} PROPERTIES LABELS "gpu;steps" SKIP_RETURN_CODE 77
                           FIXTURES_REQUIRED "gpu_probe;${stage}.step${nn}")
    endforeach()
  endforeach()
endfunction()
