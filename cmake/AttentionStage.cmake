# attention_stage(NAME SOURCE [CAUSAL] [BACKWARD] [ATOMIC_DQ] [ANY_DIM] [GQA] [CACHE_LENS]
#                 [LAYOUTS] [DIMS d...] [DTYPES t...])
#
# LAYOUTS: the stage also reads and writes [B, N, H, d] in place (--layout bshd).
#
# ATOMIC_DQ: the backward adds dQ by fp32 atomics by default, and ATTN_DETERMINISTIC=1 runs
# another path; that path gets tests of its own.
#
# Builds one stage program (a .c file runs on the CPU, a .cu file on the GPU) and registers
# its CTest cases, named "<stage>.<case>" so that `ctest -R 02_` runs one stage, and
# labelled cpu, gpu or sanitizer. A GPU test run where there is no GPU exits 77, which CTest
# shows as skipped, never as passed. The matrix is docs/conventions.md section 4.

set(ATTN_CMAKE_DIR ${CMAKE_CURRENT_LIST_DIR})
set(ATTN_BIN_DIR ${CMAKE_BINARY_DIR}/bin)
set(ATTN_SKIP_REGEX "no CUDA device")
if(ATTN_CUDA)
  find_program(ATTN_COMPUTE_SANITIZER compute-sanitizer HINTS ${CUDAToolkit_BIN_DIR})
  if(NOT ATTN_COMPUTE_SANITIZER)
    message(STATUS "compute-sanitizer not found: the GPU sanitizer tests will show as skipped")
  endif()
endif()

# Square N, (Nq, Nkv) pairs, the (B, H) list (docs/conventions.md section 4).
set(ATTN_SQUARE_N 1 2 5 17 64 97 113 127 128 129 200 257 1023 1025)
set(ATTN_PAIRS 1,147 3,799 113,203 128,217 127,513 256,512 512,256 239,1 799,3 1023,1024
               1024,1023)
set(ATTN_BATCH_HEADS 1,1 2,3 4,9)
# Logits of magnitude 1e3 and more: a softmax scale of 100 (instead of 1/8 at d = 64) makes
# max|S| about 3000 on unit-normal inputs; --inputs large-q reaches about 1e3 with Q scaled up.
set(ATTN_LARGE_LOGIT_SCALE 100)
# The stages that prove a stage without the sliding window, the softcap and varlen refuses
# each (they come in 13_window_softcap_varlen): one CPU stage and one GPU stage, since the
# refusal is one code path in common/runner.c whatever the stage, and the descriptor fields
# that say "no" are the zeros every stage's designated initialiser leaves.
set(ATTN_WINDOW_REFUSAL_STAGES 00_naive 09_swizzle_pipeline)
# A TSV file of another table (another first line), which --tsv must refuse to append to.
set(ATTN_OTHER_TABLE ${CMAKE_BINARY_DIR}/other_table.tsv)
file(WRITE ${ATTN_OTHER_TABLE} "name\tvalue\nx\t1\n")

# Every GPU test starts through the gate (common/gpu_gate.c): where the fixture gpu.probe
# found no CUDA device, it exits 77 at once, so that a machine without a GPU skips thousands
# of tests in seconds instead of asking the CUDA runtime for a device thousands of times.
# Where the probe found a device, or gave no answer, the test runs as written.
set(ATTN_GPU_PROBE_ANSWER ${CMAKE_BINARY_DIR}/gpu_probe_answer.txt)
set(ATTN_GPU_GATE $<TARGET_FILE:attn_gpu_gate> ${ATTN_GPU_PROBE_ANSWER})

# The command of a test of this kind: a GPU test's behind the gate.
function(attn_gate kind out)
  if(kind STREQUAL "gpu")
    set(${out} ${ATTN_GPU_GATE} ${ARGN} PARENT_SCOPE)
  else()
    set(${out} ${ARGN} PARENT_SCOPE)
  endif()
endfunction()

# What a GPU test needs: the probe's answer, and 77 shown as skipped (the gate's exit).
function(attn_gate_properties kind name)
  if(kind STREQUAL "gpu")
    set_property(TEST ${name} APPEND PROPERTY FIXTURES_REQUIRED gpu_probe)
    set_tests_properties(${name} PROPERTIES SKIP_RETURN_CODE 77)
  endif()
endfunction()

function(attn_test stage case kind)
  set(name ${stage}.${case})
  attn_gate(${kind} command $<TARGET_FILE:${stage}> ${ARGN})
  add_test(NAME ${name} COMMAND ${command})
  set_tests_properties(${name} PROPERTIES LABELS ${kind} SKIP_RETURN_CODE 77 TIMEOUT 600)
  attn_gate_properties(${kind} ${name})
endfunction()

# The shared memory per block of the smallest GPUs a stage claims: sm_86 and sm_89 (99 KiB)
# and sm_80 (163 KiB), and per SM (100 and 164 KiB). Tests run with ATTN_SHARED_MEMORY_LIMIT
# and ATTN_SHARED_MEMORY_PER_SM set to each pair, so the tiles a stage picks for those GPUs are
# exercised on whatever GPU runs the tests.
set(ATTN_SMALL_SHARED_MEMORY 101376 166912)
set(ATTN_SMALL_SHARED_MEMORY_PER_SM 102400 167936)
# The environment that stands in for the GPU whose block limit is `limit`, into `var`.
function(attn_small_gpu_env var limit)
  list(FIND ATTN_SMALL_SHARED_MEMORY ${limit} at)
  list(GET ATTN_SMALL_SHARED_MEMORY_PER_SM ${at} per_sm)
  set(${var} "ATTN_SHARED_MEMORY_LIMIT=${limit};ATTN_SHARED_MEMORY_PER_SM=${per_sm}" PARENT_SCOPE)
endfunction()

# A run that must exit with `code` and print a line matching `regex`.
function(attn_expect stage case kind code regex)
  string(JOIN "^" args ${ARGN})
  set(name ${stage}.${case})
  attn_gate(${kind} command ${CMAKE_COMMAND} -DPROGRAM=$<TARGET_FILE:${stage}> -DARGS=${args}
            -DEXPECT_CODE=${code} "-DEXPECT_REGEX=${regex}" -P ${ATTN_CMAKE_DIR}/expect.cmake)
  add_test(NAME ${name} COMMAND ${command})
  set_tests_properties(${name} PROPERTIES LABELS ${kind} SKIP_REGULAR_EXPRESSION
                                          "${ATTN_SKIP_REGEX}" TIMEOUT 120)
  attn_gate_properties(${kind} ${name})
endfunction()

# compute-sanitizer's `tool` on one run of the stage (labels gpu and sanitizer); where the
# tool is missing, the test says so and shows as skipped.
# Sliding windows, forward and backward, on ragged (Nq, Nkv) pairs at the head dims given
# (stages 13 and 14): a window of one key (0,0), one that looks back only (16,0), one on both
# sides, one bounded on one side only, each with and without causal (which sets the right side
# to 0). With Nq > Nkv and a narrow window whole rows see no key (O = 0, LSE = -inf, zero
# gradients).
function(attn_window_tests stage)
  set(windows "0,0" "16,0" "100,50" "-1,32" "200,-1")
  set(pairs 113,203 512,256 1023,1024)
  foreach(dtype fp16 bf16)
    foreach(d ${ARGN})
      foreach(window ${windows})
        string(REPLACE "," "_" w ${window})
        string(REPLACE "-1" "inf" w ${w})
        foreach(pair ${pairs})
          string(REPLACE "," ";" pair ${pair})
          list(GET pair 0 nq)
          list(GET pair 1 nkv)
          foreach(mask nomask causal)
            set(c "")
            set(m "")
            if(mask STREQUAL "causal")
              set(c --causal)
              set(m ".causal")
            endif()
            attn_test(${stage} window.${w}.q${nq}kv${nkv}.d${d}${m}.${dtype} gpu --check
                      --dtype ${dtype} ${c} --backward -b 2 -H 3 --seq-q ${nq} --seq-kv ${nkv}
                      -d ${d} --window ${window})
          endforeach()
        endforeach()
      endforeach()
    endforeach()
  endforeach()
endfunction()

function(attn_sanitizer_test stage case tool)
  set(name ${stage}.sanitizer.${tool}.${case})
  if(ATTN_COMPUTE_SANITIZER)
    add_test(NAME ${name} COMMAND ${ATTN_GPU_GATE} ${ATTN_COMPUTE_SANITIZER} --tool ${tool}
                                  --error-exitcode 1 $<TARGET_FILE:${stage}> ${ARGN})
    attn_gate_properties(gpu ${name})
  else()
    add_test(NAME ${name} COMMAND ${CMAKE_COMMAND} -E echo
                                  "SKIPPED: no CUDA device tools (compute-sanitizer)")
  endif()
  set_tests_properties(${name} PROPERTIES LABELS "gpu;sanitizer" SKIP_RETURN_CODE 77
                                          SKIP_REGULAR_EXPRESSION "${ATTN_SKIP_REGEX}" TIMEOUT 900)
endfunction()

# Two runs whose saved .npy files must be identical bit for bit: MODE=reload runs with
# --save, then --load of what it saved; MODE=repeat runs the same command twice.
function(attn_compare_runs stage case kind mode)
  string(JOIN "^" args ${ARGN})
  set(name ${stage}.${case})
  attn_gate(${kind} command ${CMAKE_COMMAND} -DPROGRAM=$<TARGET_FILE:${stage}> -DARGS=${args}
            -DMODE=${mode} -DWORK_DIR=${CMAKE_CURRENT_BINARY_DIR}/${case}
            -P ${ATTN_CMAKE_DIR}/compare_runs.cmake)
  add_test(NAME ${name} COMMAND ${command})
  set_tests_properties(${name} PROPERTIES LABELS ${kind} SKIP_REGULAR_EXPRESSION
                                          "${ATTN_SKIP_REGEX}" TIMEOUT 300)
  attn_gate_properties(${kind} ${name})
endfunction()

# A stage built on wgmma and setmaxnreg, which exist only in sm_90a, the architecture-specific
# Hopper target: its program and library are built for it alone, whatever
# CMAKE_CUDA_ARCHITECTURES says, and say on any other GPU that they need compute capability 9.0
# (exit 77). (Stages 10 and 12.)
function(attn_hopper_only stage)
  foreach(target ${stage} attn_${stage})
    if(TARGET ${target})
      set_target_properties(${target} PROPERTIES CUDA_ARCHITECTURES OFF)
      target_compile_options(${target} PRIVATE
                             $<$<COMPILE_LANGUAGE:CUDA>:-gencode=arch=compute_90a,code=sm_90a>)
    endif()
  endforeach()
endfunction()

function(attention_stage name source)
  cmake_parse_arguments(ARG "CAUSAL;BACKWARD;ATOMIC_DQ;ANY_DIM;GQA;CACHE_LENS;LAYOUTS" ""
                        "DIMS;DTYPES" ${ARGN})
  get_filename_component(ext ${source} LAST_EXT)
  if(ext STREQUAL ".cu")
    if(NOT ATTN_CUDA)
      return()
    endif()
    set(kind gpu)
  else()
    set(kind cpu)
  endif()
  add_executable(${name} ${source})
  if(kind STREQUAL "gpu")
    target_link_libraries(${name} PRIVATE attn_gpu)
    # -lineinfo: Nsight Compute and compute-sanitizer name source lines. ptxas's report of
    # registers, spills and shared memory per kernel on request (-DATTN_PTXAS_VERBOSE=ON).
    target_compile_options(${name} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-lineinfo>)
    if(ATTN_PTXAS_VERBOSE)
      target_compile_options(${name} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xptxas=-v>)
    endif()
  else()
    target_link_libraries(${name} PRIVATE attn_common)
  endif()
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${ATTN_BIN_DIR})
  if(kind STREQUAL "gpu" AND ATTN_PYTHON AND name MATCHES "^[0-9][0-9]_")
    # The same source as a library for the Python package (common/stage_library.cu).
    add_library(attn_${name} SHARED ${CMAKE_SOURCE_DIR}/common/stage_library.cu)
    target_compile_definitions(attn_${name} PRIVATE
                               ATTN_STAGE_SOURCE="${CMAKE_CURRENT_SOURCE_DIR}/${source}")
    target_compile_options(attn_${name} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-lineinfo>)
    target_link_libraries(attn_${name} PRIVATE attn_gpu)
    target_link_options(attn_${name} PRIVATE
                        "LINKER:--version-script=${CMAKE_SOURCE_DIR}/cmake/stage_library.map")
    set_property(TARGET attn_${name} APPEND PROPERTY LINK_DEPENDS
                                                    ${CMAKE_SOURCE_DIR}/cmake/stage_library.map)
    set_target_properties(attn_${name} PROPERTIES LIBRARY_OUTPUT_DIRECTORY
                                                   ${CMAKE_BINARY_DIR}/lib)
    set_property(GLOBAL APPEND PROPERTY ATTN_STAGE_LIBRARIES attn_${name})
  endif()
  set_property(GLOBAL APPEND PROPERTY ATTN_STAGES ${name})
  set_property(GLOBAL APPEND PROPERTY ATTN_STAGE_KINDS ${kind})

  if(ARG_DIMS)
    set(dims ${ARG_DIMS})
  elseif(kind STREQUAL "gpu")
    set(dims 32 64 128)
  else()
    set(dims 32 64 128 40 59)
  endif()
  set(dtypes fp32)
  if(ARG_DTYPES)
    set(dtypes ${ARG_DTYPES})
  endif()
  list(GET dims 0 d0)
  set(masks "")
  if(ARG_CAUSAL)
    set(masks "" causal)
  endif()

  # The shapes of the [B, N, H, d] cases (see the refusal below), ':'-separated words each.
  if(ARG_LAYOUTS)
    set(layout_shapes "-b:3:-H:5:-n:129" "-b:2:-H:4:--seq-q:97:--seq-kv:300"
                      "-b:2:-H:3:--seq-q:257:--seq-kv:64" "-b:2:-H:2:-n:1")
    set(layout_names B3H5.N129 B2H4.q97kv300 B2H3.q257kv64 B2H2.N1)
    set(layout_forward_only "")
    if(ARG_GQA)
      # Forward only unless the stage has the grouped-query backward; a group that fills a
      # decode block, one that does not, one query per sequence.
      list(APPEND layout_shapes "-b:2:-H:8:--heads-kv:2:--seq-q:97:--seq-kv:300"
           "-b:3:-H:8:--heads-kv:2:--seq-q:1:--seq-kv:3000" "-b:2:-H:8:--heads-kv:2:--seq-q:4:--seq-kv:700")
      list(APPEND layout_names gqa.H8Hkv2.q97kv300 gqa.H8Hkv2.q1kv3000 gqa.H8Hkv2.q4kv700)
      list(APPEND layout_forward_only gqa.H8Hkv2.q97kv300 gqa.H8Hkv2.q1kv3000 gqa.H8Hkv2.q4kv700)
    endif()
    if(ARG_CACHE_LENS)
      list(APPEND layout_shapes "-b:3:-H:8:--heads-kv:2:-n:2000:--cache-lens:random"
           "-b:3:-H:4:--seq-q:5:--seq-kv:900:--cache-lens:0,899,333")
      list(APPEND layout_names cache.H8Hkv2.q1kv2000 cache.H4.q5kv900)
      list(APPEND layout_forward_only cache.H8Hkv2.q1kv2000 cache.H4.q5kv900)
    endif()
  endif()

  foreach(dtype ${dtypes})
    set(t "")
    if(NOT dtype STREQUAL "fp32")
      set(t ".${dtype}")
    endif()
    set(common_args --check --dtype ${dtype})
    set(bwd "")
    if(ARG_BACKWARD)
      set(bwd --backward)
    endif()
    foreach(mask IN ITEMS nomask ${masks})
      set(m "")
      set(c "")
      if(mask STREQUAL "causal")
        set(m ".causal")
        set(c --causal)
      endif()
      if(ARG_LAYOUTS) # [B, N, H, d] in place: every head dim, the backward where the shape has it
        foreach(d ${dims})
          foreach(shape shape_name IN ZIP_LISTS layout_shapes layout_names)
            string(REPLACE ":" ";" shape ${shape})
            set(b "")
            if(NOT shape_name IN_LIST layout_forward_only)
              set(b ${bwd})
            endif()
            attn_test(${name} layout.bshd.${shape_name}.d${d}${m}.${dtype} ${kind} ${common_args}
                      ${c} ${b} --layout bshd ${shape} -d ${d})
          endforeach()
        endforeach()
      endif()
      # The square-N list and the (Nq, Nkv) pairs at d = 64 and, as thoroughly, d = 128.
      foreach(d 64 128)
        set(dn "")
        if(NOT d EQUAL 64)
          set(dn ".d${d}")
        endif()
        foreach(n ${ATTN_SQUARE_N})
          attn_test(${name} square.N${n}${dn}${m}${t} ${kind} ${common_args} ${c} ${bwd} -n ${n}
                    -d ${d})
        endforeach()
        foreach(pair ${ATTN_PAIRS})
          string(REPLACE "," ";" qk ${pair})
          list(GET qk 0 nq)
          list(GET qk 1 nkv)
          attn_test(${name} pair.${nq}x${nkv}${dn}${m}${t} ${kind} ${common_args} ${c} ${bwd} -H 2
                    --seq-q ${nq} --seq-kv ${nkv} -d ${d})
        endforeach()
      endforeach()
      foreach(d ${dims})
        attn_test(${name} dim.d${d}${m}${t} ${kind} ${common_args} ${c} ${bwd} -b 2 -H 3 -n 129
                  -d ${d})
        attn_test(${name} dim.d${d}.pair${m}${t} ${kind} ${common_args} ${c} ${bwd}
                  --seq-q 200 --seq-kv 67 -d ${d})
      endforeach()
      foreach(bh ${ATTN_BATCH_HEADS})
        string(REPLACE "," ";" bhl ${bh})
        list(GET bhl 0 b)
        list(GET bhl 1 h)
        attn_test(${name} heads.B${b}H${h}${m}${t} ${kind} ${common_args} ${c} ${bwd} -b ${b}
                  -H ${h} -n 113 -d ${d0})
      endforeach()
      attn_test(${name} hard.large_logits${m}${t} ${kind} ${common_args} ${c} ${bwd} -n 257 -d 64
                --scale ${ATTN_LARGE_LOGIT_SCALE})
      # The same magnitude reached the other way, Q scaled up (elements of about 1e3 in the
      # dtype, raw Q K^T about 1e4 before the default scale), at the smallest and largest d.
      foreach(d 32 128)
        attn_test(${name} hard.large_q.d${d}${m}${t} ${kind} ${common_args} ${c} ${bwd} -n 257
                  -d ${d} --inputs large-q)
      endforeach()
      attn_test(${name} hard.const_v${m}${t} ${kind} ${common_args} ${c} ${bwd} -n 200 -d 64
                --inputs const-v)
      attn_test(${name} hard.zero_q${m}${t} ${kind} ${common_args} ${c} ${bwd} -n 200 -d 64
                --inputs zero-q)
      attn_test(${name} hard.nkv1${m}${t} ${kind} ${common_args} ${c} ${bwd} --seq-q 97
                --seq-kv 1 -d 64)
      if(ARG_BACKWARD)
        # The shapes that once overflowed FlashAttention's own backward to NaN.
        foreach(n 1 2 5 17 128)
          foreach(d 32 64)
            foreach(x 3 5)
              attn_test(${name} overflow.N${n}.d${d}.x${x}${m}${t} ${kind} ${common_args} ${c}
                        ${bwd} -n ${n} -d ${d} --input-scale ${x})
            endforeach()
          endforeach()
        endforeach()
      endif()
      if(ARG_BACKWARD AND dtype STREQUAL "fp16")
        # dS = P (dP - D) is rounded to the dtype, and with large V and a small softmax scale it
        # passes fp16's 65504 while the gradients stay small; the kernels keep it in range by
        # a power of two (docs/conventions.md section 1). Input scale 8: the bound on |dS| is
        # about 3e3, nothing is scaled; 3000: the bound is past 2^15 and dS is scaled, though
        # |dS| itself (about 500) would fit; 12000 with the scale 1.2e-9: |dS| about 7.6e4,
        # which overflowed fp16 before the scaling.
        foreach(xs "8;0.1" "3000;1e-8" "12000;1.2e-9")
          list(GET xs 0 x)
          list(GET xs 1 s)
          foreach(d 64 128)
            attn_test(${name} ds_range.x${x}.d${d}${m}${t} ${kind} ${common_args} ${c} ${bwd}
                      -n 64 -d ${d} --input-scale ${x} --scale ${s})
            if(ARG_ATOMIC_DQ)
              attn_test(${name} ds_range.x${x}.d${d}.deterministic${m}${t} ${kind} ${common_args}
                        ${c} ${bwd} -n 64 -d ${d} --input-scale ${x} --scale ${s})
              set_tests_properties(${name}.ds_range.x${x}.d${d}.deterministic${m}${t}
                                   PROPERTIES ENVIRONMENT ATTN_DETERMINISTIC=1)
            endif()
          endforeach()
        endforeach()
      endif()
      if(dtype STREQUAL "bf16")
        # Inputs of magnitude 133120 (fp16 would overflow at 65504): FlashAttention's
        # backward once returned NaN here. The forward is checked in full; the backward's
        # logits (about 1e10) are beyond what an fp32 LSE resolves, so it must only stay
        # finite.
        attn_test(${name} hard.magnitude_133120${m}${t} ${kind} ${common_args} ${c} -n 257 -d 64
                  --input-scale 133120)
        if(ARG_BACKWARD)
          attn_test(${name} hard.magnitude_133120.backward_finite${m}${t} ${kind} --check-finite
                    --dtype ${dtype} ${c} --backward -n 257 -d 64 --input-scale 133120)
        endif()
      endif()
      if(kind STREQUAL "gpu")
        # At least 4 x the SMs of any GPU of up to 160 SMs in (batch, head) pairs (an A100 has
        # 108, an H100 132, a B200 148).
        attn_test(${name} heads.many${m}${t} ${kind} ${common_args} ${c} ${bwd} -b 8 -H 80
                  -n 64 -d 64)
        # Past the grid's y and z limits (65535): B x H = 65538.
        attn_test(${name} heads.over_65535${m}${t} ${kind} ${common_args} ${c} ${bwd} -b 2
                  -H 32769 -n 3 -d ${d0})
        # The forward and, where there is one, the backward: identical bits run after run.
        attn_compare_runs(${name} deterministic${m}${t} ${kind} repeat ${common_args} ${c} ${bwd}
                          -b 2 -H 3 -n 1025 -d 64)
        # (A stage that adds dQ by atomics has a deterministic path: the one tested here.)
        set_tests_properties(${name}.deterministic${m}${t} PROPERTIES
                             ENVIRONMENT ATTN_DETERMINISTIC=1)
        if(ARG_ATOMIC_DQ)
          # That path's own kernels, checked like the default's: every head dim, Nq != Nkv
          # (causal: rows that see no key), B x H past 65535, and the tiles of a 99 KiB GPU.
          set(det_tests)
          set(det_nq 200 127)
          set(det_nkv 67 513)
          foreach(d ${dims})
            foreach(nq nkv IN ZIP_LISTS det_nq det_nkv)
              set(case deterministic_dq.d${d}.q${nq}kv${nkv}${m}${t})
              attn_test(${name} ${case} ${kind} ${common_args} ${c} ${bwd} -b 2 -H 3 --seq-q ${nq}
                        --seq-kv ${nkv} -d ${d})
              list(APPEND det_tests ${name}.${case})
            endforeach()
          endforeach()
          set(case deterministic_dq.heads.over_65535${m}${t})
          attn_test(${name} ${case} ${kind} ${common_args} ${c} ${bwd} -b 2 -H 32769 -n 3 -d ${d0})
          list(APPEND det_tests ${name}.${case})
          set_tests_properties(${det_tests} PROPERTIES ENVIRONMENT ATTN_DETERMINISTIC=1)
          list(GET ATTN_SMALL_SHARED_MEMORY 0 smallest)
          set(case deterministic_dq.smem${smallest}.d128.q127kv513${m}${t})
          attn_test(${name} ${case} ${kind} ${common_args} ${c} ${bwd} -b 2 -H 3 --seq-q 127
                    --seq-kv 513 -d 128)
          attn_small_gpu_env(small_env ${smallest})
          set_tests_properties(${name}.${case} PROPERTIES ENVIRONMENT
                               "ATTN_DETERMINISTIC=1;${small_env}")
        endif()
        # The tiles the smallest GPUs get (see ATTN_SMALL_SHARED_MEMORY), every head dim.
        foreach(limit ${ATTN_SMALL_SHARED_MEMORY})
          foreach(d ${dims})
            foreach(shape "-n;257" "--seq-q;127;--seq-kv;513")
              string(REPLACE ";" "" sn "${shape}")
              string(REPLACE "--seq-q" "q" sn "${sn}")
              string(REPLACE "--seq-kv" "kv" sn "${sn}")
              string(REPLACE "-n" "N" sn "${sn}")
              attn_test(${name} smem${limit}.d${d}.${sn}${m}${t} ${kind} ${common_args} ${c}
                        ${bwd} -b 2 -H 3 ${shape} -d ${d})
              attn_small_gpu_env(small_env ${limit})
              set_tests_properties(${name}.smem${limit}.d${d}.${sn}${m}${t} PROPERTIES
                                   ENVIRONMENT "${small_env}")
            endforeach()
          endforeach()
        endforeach()
      endif()
    endforeach()
  endforeach()

  # compute-sanitizer's four tools on small shapes (label "sanitizer"): memcheck (out of
  # bounds), racecheck (shared-memory races), initcheck (reads of global memory nothing
  # wrote), synccheck (barriers not reached by every thread). With the large tiles, and
  # with the tiles of a 99 KiB GPU.
  if(kind STREQUAL "gpu")
    set(small --check -b 2 -H 3 --seq-q 97 --seq-kv 130 -d 64)
    set(variants plain)
    if(ARG_CAUSAL)
      list(APPEND variants causal)
    endif()
    foreach(tool memcheck racecheck initcheck synccheck)
      foreach(variant ${variants} small_smem)
        foreach(dtype ${dtypes})
          set(extra --dtype ${dtype})
          set(env "")
          if(variant STREQUAL "causal")
            list(APPEND extra --causal --seq-q 130 --seq-kv 97)
          elseif(variant STREQUAL "small_smem")
            list(GET ATTN_SMALL_SHARED_MEMORY 0 smallest)
            attn_small_gpu_env(env ${smallest})
            list(APPEND extra -d 128)
            if(ARG_CAUSAL)
              list(APPEND extra --causal)
            endif()
          endif()
          if(ARG_BACKWARD)
            list(APPEND extra --backward)
          endif()
          set(t "")
          if(NOT dtype STREQUAL "fp32")
            set(t ".${dtype}")
          endif()
          attn_sanitizer_test(${name} ${variant}${t} ${tool} ${small} ${extra})
          if(env)
            set_tests_properties(${name}.sanitizer.${tool}.${variant}${t} PROPERTIES
                                 ENVIRONMENT "${env}")
          endif()
        endforeach()
      endforeach()
      if(ARG_ATOMIC_DQ)
        # The deterministic dQ path (ATTN_DETERMINISTIC=1), causal with rows that see no key.
        list(GET dtypes 0 dtype)
        set(extra --dtype ${dtype} --backward)
        if(ARG_CAUSAL)
          list(APPEND extra --causal --seq-q 130 --seq-kv 97)
        endif()
        attn_sanitizer_test(${name} deterministic_dq ${tool} ${small} ${extra})
        set_tests_properties(${name}.sanitizer.${tool}.deterministic_dq PROPERTIES
                             ENVIRONMENT ATTN_DETERMINISTIC=1)
      endif()
    endforeach()
  endif()

  if(kind STREQUAL "gpu" AND ARG_BACKWARD)
    # Where even the small tiles do not fit, a clear refusal (exit 2), not a failed launch;
    # and a limit that is not a byte count is refused too (" -5": strtoull would negate it
    # past the spaces into 2^64 - 5, no limit at all).
    foreach(case "limit_too_small;40000;needs [0-9]+ bytes of shared memory"
                 "limit_not_a_number;99KiB;ATTN_SHARED_MEMORY_LIMIT must be a positive byte count"
                 "limit_negative; -5;ATTN_SHARED_MEMORY_LIMIT must be a positive byte count"
                 "per_sm_not_a_number;100KiB;ATTN_SHARED_MEMORY_PER_SM must be a positive byte count")
      list(GET case 0 what)
      list(GET case 1 value)
      list(GET case 2 regex)
      set(variable ATTN_SHARED_MEMORY_LIMIT)
      if(what MATCHES "^per_sm")
        set(variable ATTN_SHARED_MEMORY_PER_SM)
      endif()
      attn_expect(${name} bad.shared_memory_${what} ${kind} 2 "${regex}" --backward -d 128 -n 64)
      set_tests_properties(${name}.bad.shared_memory_${what} PROPERTIES
                           ENVIRONMENT "${variable}=${value}")
    endforeach()
  endif()

  # Save, then load what was saved: the same outputs bit for bit, and where the stage has a
  # backward, dO and the gradients too (where dQ is added by atomics, in no fixed order, with
  # ATTN_DETERMINISTIC=1).
  set(save_backward "")
  if(ARG_BACKWARD)
    set(save_backward --backward)
  endif()
  attn_compare_runs(${name} save_load ${kind} reload --check -b 2 -H 3 --seq-q 97
                    --seq-kv 130 -d ${d0} ${save_backward})
  if(ARG_ATOMIC_DQ)
    set_tests_properties(${name}.save_load PROPERTIES ENVIRONMENT ATTN_DETERMINISTIC=1)
  endif()

  # The check cannot pass a wrong answer at any input size: with O halved after the stage
  # returns (ATTN_TEST_FAULT, common/runner.c), every input scale from 1 to 1e9 must end in a
  # mismatch (exit 1) whose result line names O; fp16 stops at 1e4 (1e5 is beyond its range).
  foreach(dtype ${dtypes})
    set(t "")
    if(NOT dtype STREQUAL "fp32")
      set(t ".${dtype}")
    endif()
    set(scales 1 10 100 300 1e3 1e4 1e6 1e9)
    if(dtype STREQUAL "fp16")
      set(scales 1 10 100 300 1e3 1e4)
    endif()
    foreach(x ${scales})
      attn_expect(${name} check_catches.halved_o.x${x}${t} ${kind} 1
                  "FAIL [(]O: max err [^)]* > tol [^)]*[)].*O: mismatch" --dtype ${dtype} -b 1 -H 2
                  -n 64 -d ${d0} --input-scale ${x})
      set_tests_properties(${name}.check_catches.halved_o.x${x}${t} PROPERTIES
                           ENVIRONMENT ATTN_TEST_FAULT=halve-o)
    endforeach()
    if(ARG_BACKWARD)
      # One NaN in one gradient: the backward's line says which tensor and why.
      foreach(g dq dk dv)
        string(REPLACE "d" "" gn ${g})
        string(TOUPPER ${gn} gn)
        attn_expect(${name} check_catches.nan_${g}${t} ${kind} 1
                    "bwd .* FAIL [(]d${gn}: 1 non-finite value[)]" --dtype ${dtype} --backward -b 1
                    -H 2 -n 64 -d ${d0})
        set_tests_properties(${name}.check_catches.nan_${g}${t} PROPERTIES
                             ENVIRONMENT ATTN_TEST_FAULT=nan-${g})
      endforeach()
    endif()
  endforeach()

  # Bad input: exit 2 with one line saying what and why.
  attn_expect(${name} bad.zero_seq ${kind} 2 "--seq must be an integer" -n 0)
  attn_expect(${name} bad.negative_batch ${kind} 2 "--batch must be an integer" -b -3)
  attn_expect(${name} bad.not_a_number ${kind} 2 "--dim must be an integer" -d 6x4)
  attn_expect(${name} bad.missing_value ${kind} 2 "--heads needs a value" --heads)
  attn_expect(${name} bad.unknown_option ${kind} 2 "unknown option '--fast'" --fast)
  attn_expect(${name} bad.dtype_name ${kind} 2 "--dtype must be fp32, fp16 or bf16"
              --dtype fp64)
  attn_expect(${name} bad.scale_nan ${kind} 2 "--scale must be a finite number" --scale nan)
  attn_expect(${name} bad.too_large ${kind} 2 "too large" -b 16384 -H 16384 -n 16384)
  attn_expect(${name} bad.load_missing ${kind} 2 "No such file" --load
              ${CMAKE_CURRENT_BINARY_DIR}/no_such_dir)
  attn_expect(${name} bad.load_input_scale ${kind} 2 "--input-scale scales random inputs"
              --load ${CMAKE_CURRENT_BINARY_DIR}/no_such_dir --input-scale 2)
  attn_expect(${name} bad.load_large_q ${kind} 2 "--inputs large-q scales random inputs"
              --load ${CMAKE_CURRENT_BINARY_DIR}/no_such_dir --inputs large-q)
  if(NOT ARG_CAUSAL)
    attn_expect(${name} bad.causal ${kind} 2 "causal mask comes in 05_causal" --causal)
  endif()
  if(NOT ARG_BACKWARD)
    attn_expect(${name} bad.backward ${kind} 2 "backward comes in 06_backward" --backward)
  endif()
  if(NOT ARG_DTYPES)
    attn_expect(${name} bad.dtype_fp16 ${kind} 2 "fp32 only" --dtype fp16)
  endif()
  # Grouped-query attention and the KV cache: refused where the stage has neither, with the
  # stage that adds them; where it has them, the K/V heads must divide the query heads.
  if(ARG_GQA)
    attn_expect(${name} bad.heads_kv_divides ${kind} 2 "--heads-kv 3 must divide --heads 8" -H 8
                --heads-kv 3)
  else()
    attn_expect(${name} bad.heads_kv ${kind} 2
                "grouped-query attention, which this stage does not have: it comes in 11_" -H 4
                --heads-kv 2)
  endif()
  attn_expect(${name} bad.heads_kv_zero ${kind} 2 "--heads-kv must be an integer" --heads-kv 0)
  if(NOT ARG_CACHE_LENS)
    attn_expect(${name} bad.cache_lens ${kind} 2
                "--cache-lens is not supported by this stage: .* comes in 11_" --cache-lens random)
  endif()
  if(name IN_LIST ATTN_WINDOW_REFUSAL_STAGES)
    attn_expect(${name} bad.window ${kind} 2
                "--window is not supported by this stage: .* comes in 13_window_softcap_varlen"
                --window 8,0)
    attn_expect(${name} bad.softcap ${kind} 2
                "--softcap is not supported by this stage: .* comes in 13_window_softcap_varlen"
                --softcap 30)
    attn_expect(${name} bad.seqlens ${kind} 2
                "--seqlens is not supported by this stage: .* come in 13_window_softcap_varlen"
                --seqlens 100,0,28)
  endif()
  # [B, N, H, d] in place: where the stage has it, cases of its own (in the dtype and mask loop
  # above: every dtype, mask and head dim; several sequences and heads, so that the batch, head and row strides all differ from
  # [B, H, N, d]'s; ragged Nq != Nkv both ways; one query; the backward where there is one;
  # grouped-query and cache shapes where the stage has them) and memcheck; elsewhere refused.
  if(ARG_LAYOUTS)
    list(GET dtypes 0 dtype0)
    set(b "")
    if(ARG_BACKWARD)
      set(b --backward)
    endif()
    attn_sanitizer_test(${name} layout.bshd memcheck --dtype ${dtype0} --causal ${b}
                        --layout bshd -b 2 -H 3 --seq-q 97 --seq-kv 130 -d 64)
    if(ARG_GQA)
      attn_sanitizer_test(${name} layout.bshd.decode memcheck --dtype ${dtype0} --layout bshd
                          -b 3 -H 8 --heads-kv 2 --seq-q 2 --seq-kv 3000 -d 128)
    endif()
    if(ARG_ATOMIC_DQ) # the deterministic dQ kernel reads and writes in place too
      foreach(d ${dims})
        attn_test(${name} layout.bshd.deterministic.d${d}.causal.${dtype0} ${kind} --check
                  --dtype ${dtype0} --causal --backward --layout bshd -b 2 -H 3 --seq-q 200
                  --seq-kv 131 -d ${d})
        set_tests_properties(${name}.layout.bshd.deterministic.d${d}.causal.${dtype0} PROPERTIES
                             ENVIRONMENT ATTN_DETERMINISTIC=1)
      endforeach()
    endif()
    attn_expect(${name} bad.layout_name ${kind} 2 "--layout must be bhnd or bshd" --layout nhd)
  else()
    attn_expect(${name} bad.layout ${kind} 2
                "--layout bshd is not supported by this stage: .* comes in 09_" --layout bshd)
  endif()
  if(kind STREQUAL "gpu" AND NOT ARG_ANY_DIM)
    attn_expect(${name} bad.head_dim ${kind} 2 "head dim 40 is not supported" -d 40)
  endif()
  foreach(bad wrong_dtype wrong_shape fortran_order truncated)
    attn_expect(${name} bad.npy_${bad} ${kind} 2 "npy" --load ${ATTN_NPY_FIXTURES}/${bad} -H 2
                --seq-q 3 --seq-kv 5 -d ${d0})
    set_property(TEST ${name}.bad.npy_${bad} APPEND PROPERTY FIXTURES_REQUIRED npy_fixtures)
  endforeach()
  attn_expect(${name} bad.npy_negative_dim ${kind} 2 "q.npy: dimension 2 is -3" --load
              ${ATTN_NPY_FIXTURES}/negative_dim -H 2 --seq-q 3 --seq-kv 5 -d ${d0})
  attn_expect(${name} bad.npy_huge_dim ${kind} 2
              "q.npy: dimension 2 is 4611686018427387904. the array's size overflows" --load
              ${ATTN_NPY_FIXTURES}/huge_dim -H 2 --seq-q 3 --seq-kv 5 -d ${d0})
  set_property(TEST ${name}.bad.npy_negative_dim ${name}.bad.npy_huge_dim APPEND
               PROPERTY FIXTURES_REQUIRED npy_fixtures)
  # The command line: getopt_long's forms and a word that belongs to no option.
  attn_expect(${name} bad.seq_long_form ${kind} 2
              "--seq must be an integer in 1..[0-9]+, got 'abc'" --seq=abc)
  attn_expect(${name} bad.stray_argument ${kind} 2 "unexpected argument 'extra'" -n 64 extra)
  # What the stage cannot represent is refused up front, not left to end in NaN and a failed
  # check: a scale beyond fp32, inputs beyond the dtype, logits that could overflow fp32.
  set(wide fp32) # the stage's widest dtype: its inputs overflow only beyond fp32's range
  if(ARG_DTYPES)
    list(GET ARG_DTYPES -1 wide)
  endif()
  attn_expect(${name} bad.scale_overflow ${kind} 2 "--scale 1e39 is beyond fp32's range"
              --scale 1e39)
  attn_expect(${name} bad.logits_scale ${kind} 2 "logits could overflow fp32" --scale 1e37)
  attn_expect(${name} bad.logits_input_scale ${kind} 2 "logits could overflow fp32" --dtype
              ${wide} --input-scale 1e30)
  # Refused after the inputs are made, so its line ends with the seed that made them, as any
  # failure's does from there on.
  attn_expect(${name} bad.input_overflow ${kind} 2 "Q element 0 overflows fp32.* [(]seed 42[)]"
              --input-scale 1e39 --seed 42)
  if("fp16" IN_LIST ARG_DTYPES)
    attn_expect(${name} bad.input_beyond_fp16 ${kind} 2
                "Q element [0-9]+ is [-0-9.e+]+, beyond fp16's range .largest 65504."
                --dtype fp16 --input-scale 1e6)
  endif()
  # Outputs that cannot be written are found before any computing: each run also asks for a
  # problem too large for memory, refused before any input exists, so the path must be
  # refused before that.
  attn_expect(${name} bad.tsv_unwritable ${kind} 2
              "--tsv /nonexistent_dir/x.tsv: No such file or directory" --tsv
              /nonexistent_dir/x.tsv -b 16384 -H 16384 -n 16384)
  # A table of another layout is not appended to, and a device that takes no write is
  # refused before the run too.
  attn_expect(${name} bad.tsv_other_table ${kind} 2
              "--tsv .*other_table.tsv: the file holds another table" --tsv
              ${ATTN_OTHER_TABLE} -b 16384 -H 16384 -n 16384)
  if(EXISTS /dev/full)
    attn_expect(${name} bad.tsv_full ${kind} 2 "--tsv /dev/full: No space left on device" --tsv
                /dev/full -b 16384 -H 16384 -n 16384)
  endif()
  attn_expect(${name} bad.save_unwritable ${kind} 2
              "--save .*/CMakeLists.txt/saved: Not a directory" --save
              ${CMAKE_CURRENT_SOURCE_DIR}/CMakeLists.txt/saved -b 16384 -H 16384 -n 16384)
endfunction()
