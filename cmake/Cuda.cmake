# CUDA is optional: without a toolkit the CPU stages still build and test. ATTN_CUDA_WHY says,
# where the GPU stages are not built, why (the test gpu.stages_not_built repeats it).
set(ATTN_CUDA OFF)
set(ATTN_CUDA_WHY "")
if(ATTN_ENABLE_CUDA)
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # Which GPUs are present (each kind once): CMake's "native" asks the toolkit's
    # __nvcc_device_query, and fails outright where there is no GPU, so ask it here first
    # (nvidia-smi where the toolkit lacks it). By default the GPU stages are built only for
    # the GPUs present, and not at all where there is none: compiling them for a GPU that
    # cannot run them cost a newcomer's first build most of half an hour on 2 cores.
    # ATTN_CUDA_ALL_ARCHITECTURES=ON builds them for sm_80 and sm_90 as well (CI's dev preset,
    # so that every kernel still compiles for A100 and H100 on a machine without a GPU). A
    # user's -DCMAKE_CUDA_ARCHITECTURES=..., or the CUDAARCHS environment variable that CMake
    # reads in its place, always wins, and builds the stages with or without a GPU.
    option(ATTN_CUDA_ALL_ARCHITECTURES
           "Build the GPU stages for sm_80 and sm_90 (and the GPUs present), even without a GPU"
           OFF)
    set(user_archs OFF)
    if(DEFINED ENV{CUDAARCHS}
       OR (DEFINED CMAKE_CUDA_ARCHITECTURES
           AND NOT "${CMAKE_CUDA_ARCHITECTURES}" STREQUAL "${ATTN_CUDA_ARCHITECTURES_CHOSEN}"))
      set(user_archs ON)
    endif()
    set(detected "")
    set(too_old "")
    if(NOT user_archs)
      get_filename_component(nvcc_dir "${CMAKE_CUDA_COMPILER}" DIRECTORY)
      set(caps "")
      set(rc 1)
      if(EXISTS "${nvcc_dir}/__nvcc_device_query")
        execute_process(COMMAND "${nvcc_dir}/__nvcc_device_query" OUTPUT_VARIABLE caps
                        RESULT_VARIABLE rc ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
      endif()
      if(NOT rc EQUAL 0)
        find_program(NVIDIA_SMI nvidia-smi)
        if(NVIDIA_SMI)
          execute_process(COMMAND ${NVIDIA_SMI} --query-gpu=compute_cap --format=csv,noheader
                          OUTPUT_VARIABLE caps RESULT_VARIABLE rc ERROR_QUIET
                          OUTPUT_STRIP_TRAILING_WHITESPACE)
          string(REPLACE "." "" caps "${caps}") # 9.0 -> 90
        endif()
      endif()
      if(rc EQUAL 0)
        string(REGEX MATCHALL "[0-9]+" caps "${caps}")
        foreach(arch ${caps})
          # The stages need compute capability 8.0 (07 does not even compile for less).
          if(arch LESS 80)
            list(APPEND too_old sm_${arch})
          else()
            list(APPEND detected ${arch})
          endif()
        endforeach()
        list(REMOVE_DUPLICATES detected)
        list(SORT detected COMPARE NATURAL)
        list(REMOVE_DUPLICATES too_old)
      endif()
      if(too_old)
        string(REPLACE ";" ", " names "${too_old}")
        message(STATUS "CUDA: ${names} present, older than the stages' 8.0: not built for; "
                       "tests on such a GPU are skipped")
      endif()
      if(ATTN_CUDA_ALL_ARCHITECTURES)
        set(archs 80 90 ${detected})
        list(REMOVE_DUPLICATES archs)
        list(SORT archs COMPARE NATURAL)
        string(REPLACE ";" ", sm_" names "${archs}")
        message(STATUS "CUDA: building the GPU stages for every architecture (sm_${names}): "
                       "ATTN_CUDA_ALL_ARCHITECTURES=ON")
      elseif(detected)
        set(archs ${detected})
        string(REPLACE ";" ", sm_" names "${detected}")
        message(STATUS "CUDA: building for the GPU present (sm_${names}); "
                       "-DATTN_CUDA_ALL_ARCHITECTURES=ON builds for sm_80 and sm_90 too")
      else()
        set(archs "")
      endif()
      set(ATTN_CUDA_ARCHITECTURES_CHOSEN "${archs}" CACHE INTERNAL "")
      if(archs)
        set(CMAKE_CUDA_ARCHITECTURES "${archs}" CACHE STRING "CUDA architectures" FORCE)
      else()
        unset(CMAKE_CUDA_ARCHITECTURES CACHE)
      endif()
    endif()
    if(NOT user_archs AND NOT archs)
      set(ATTN_CUDA_WHY "no GPU here (-DATTN_CUDA_ALL_ARCHITECTURES=ON builds them)")
      message(STATUS "CUDA: toolkit found, no GPU of compute capability 8.0 or later: the GPU "
                     "stages 03-13 are not built (-DATTN_CUDA_ALL_ARCHITECTURES=ON builds them "
                     "for sm_80 and sm_90)")
    else()
      if(user_archs)
        message(STATUS "CUDA: building for the architectures given (${CMAKE_CUDA_ARCHITECTURES}"
                       "$ENV{CUDAARCHS})")
      endif()
      enable_language(CUDA)
    endif()
    # Stage 10 asks the driver for its TMA entry point by version
    # (cudaGetDriverEntryPointByVersion), which CUDA 12.5 added.
    if(NOT user_archs AND NOT archs)
      # (said above)
    elseif(CMAKE_CUDA_COMPILER_VERSION VERSION_LESS 12.5)
      set(ATTN_CUDA_WHY "CUDA ${CMAKE_CUDA_COMPILER_VERSION} is older than 12.5")
      message(STATUS "CUDA: toolkit ${CMAKE_CUDA_COMPILER_VERSION} found, 12.5 or later "
                     "needed; the GPU stages 03-13 and the cuBLAS baseline are skipped")
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
    set(ATTN_CUDA_WHY "no CUDA toolkit found")
    message(STATUS "CUDA: no CUDA toolkit found; the GPU stages 03-13 and the cuBLAS baseline "
                   "are skipped")
  endif()
else()
  set(ATTN_CUDA_WHY "ATTN_ENABLE_CUDA=OFF")
  message(STATUS "CUDA: disabled (ATTN_ENABLE_CUDA=OFF); the GPU stages 03-13 and the cuBLAS "
                 "baseline are skipped")
endif()
