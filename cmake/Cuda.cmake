# CUDA is optional: without a toolkit the CPU stages still build and test.
set(ATTN_CUDA OFF)
if(ATTN_ENABLE_CUDA)
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # The GPUs that are present (each kind once), else A100 and H100 (CMake's "native" fails
    # where no GPU is present, so detect first). A user's -DCMAKE_CUDA_ARCHITECTURES=..., or
    # the CUDAARCHS environment variable that CMake reads in its place, always wins.
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT DEFINED ENV{CUDAARCHS})
      set(detected "")
      set(too_old "")
      find_program(NVIDIA_SMI nvidia-smi)
      if(NVIDIA_SMI)
        execute_process(COMMAND ${NVIDIA_SMI} --query-gpu=compute_cap --format=csv,noheader
                        OUTPUT_VARIABLE caps RESULT_VARIABLE rc ERROR_QUIET
                        OUTPUT_STRIP_TRAILING_WHITESPACE)
        if(rc EQUAL 0)
          string(REPLACE "\n" ";" caps "${caps}")
          foreach(cap ${caps})
            if(cap MATCHES "^ *([0-9]+)\\.([0-9]+)")
              set(arch "${CMAKE_MATCH_1}${CMAKE_MATCH_2}")
              # The stages need compute capability 8.0 (07 does not even compile for less).
              if(arch LESS 80)
                list(APPEND too_old sm_${arch})
              else()
                list(APPEND detected ${arch})
              endif()
            endif()
          endforeach()
          list(REMOVE_DUPLICATES detected)
          list(SORT detected COMPARE NATURAL)
          list(REMOVE_DUPLICATES too_old)
        endif()
      endif()
      if(too_old)
        string(REPLACE ";" ", " names "${too_old}")
        message(STATUS "CUDA: ${names} present, older than the stages' 8.0: not built for; "
                       "tests on such a GPU are skipped")
      endif()
      if(detected)
        set(CMAKE_CUDA_ARCHITECTURES "${detected}" CACHE STRING "CUDA architectures")
        string(REPLACE ";" ", sm_" names "${detected}")
        message(STATUS "CUDA: building for the GPUs present (sm_${names})")
      else()
        set(CMAKE_CUDA_ARCHITECTURES "80;90" CACHE STRING "CUDA architectures")
        message(STATUS "CUDA: no GPU of compute capability 8.0 or later detected, building "
                       "for sm_80 and sm_90")
      endif()
    endif()
    enable_language(CUDA)
    # Stage 10 asks the driver for its TMA entry point by version
    # (cudaGetDriverEntryPointByVersion), which CUDA 12.5 added.
    if(CMAKE_CUDA_COMPILER_VERSION VERSION_LESS 12.5)
      message(STATUS "CUDA: toolkit ${CMAKE_CUDA_COMPILER_VERSION} found, 12.5 or later "
                     "needed; the GPU stages 03-11 and the cuBLAS baseline are skipped")
    else()
      find_package(CUDAToolkit REQUIRED)
      # C++20 for designated initialisers: the GPU stages fill their descriptor as the C stages
      # do. Given as a flag: CMake 3.25 does not know nvcc's C++20 flag (CMAKE_CUDA_STANDARD 20
      # fails there), and nvcc 12 and 13 accept it.
      add_compile_options("$<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>")
      # g++ warns about members a designated initialiser leaves out; in C (and here) they are
      # zero by definition, which is what the descriptors rely on.
      add_compile_options(
        "$<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-Wno-missing-field-initializers>")
      # CMAKE_COMPILE_WARNING_AS_ERROR makes nvcc's own warnings errors; the host compiler's
      # need their own flag.
      if(CMAKE_COMPILE_WARNING_AS_ERROR)
        add_compile_options("$<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Werror>")
      endif()
      set(ATTN_CUDA ON)
    endif()
  else()
    message(STATUS "CUDA: no CUDA toolkit found; the GPU stages 03-11 and the cuBLAS baseline "
                   "are skipped")
  endif()
else()
  message(STATUS "CUDA: disabled (ATTN_ENABLE_CUDA=OFF); the GPU stages 03-11 and the cuBLAS "
                 "baseline are skipped")
endif()
