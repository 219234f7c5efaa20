# The README's main job (tour), the benchmark sweep (bench) and the plots (plots).
set(ATTN_SCRIPTS ${CMAKE_SOURCE_DIR}/scripts)
get_property(stages GLOBAL PROPERTY ATTN_STAGES)
set(ATTN_EXTRA_PROGRAMS "")
if(TARGET cublas_baseline)
  list(APPEND ATTN_EXTRA_PROGRAMS cublas_baseline)
endif()

if(Python3_Interpreter_FOUND)
  # Where the GPU stages were not built, the tour says why in its first lines too.
  set(tour_note "")
  if(NOT ATTN_CUDA)
    set(tour_note --gpu-not-built "${ATTN_CUDA_WHY}")
  endif()
  add_custom_target(tour
    COMMAND ${Python3_EXECUTABLE} ${ATTN_SCRIPTS}/tour.py --bin ${ATTN_BIN_DIR}
            --out ${CMAKE_BINARY_DIR}/tour ${tour_note}
    DEPENDS ${stages} ${ATTN_EXTRA_PROGRAMS} USES_TERMINAL VERBATIM
    COMMENT "The tour: every stage on its default problem, the CPU sweep, the plots")
  # The benchmark: the sweep of every stage this machine can run (and PyTorch's SDPA
  # backends where PyTorch can run), rows into docs/results/<device>/, then the plots and
  # the README's results table.
  add_custom_target(bench
    COMMAND ${Python3_EXECUTABLE} ${ATTN_SCRIPTS}/bench.py --bin ${ATTN_BIN_DIR}
    DEPENDS ${stages} ${ATTN_EXTRA_PROGRAMS} USES_TERMINAL VERBATIM
    COMMENT "The benchmark sweep: rows into docs/results/<device>/, plots, README table")
  add_custom_target(plots
    COMMAND ${Python3_EXECUTABLE} ${ATTN_SCRIPTS}/plots.py --results ${CMAKE_BINARY_DIR}/tour/sweep
            --out ${CMAKE_BINARY_DIR}/tour/plots
    USES_TERMINAL VERBATIM)
  # The README's results table and ARCHITECTURE.md's diff table are generated: this test
  # fails when a row or a stage source changed and they were not regenerated. Label "docs":
  # the dev preset (CI) runs it; the README's test command leaves it out, so that a learner
  # who edits a stage, as the exercises ask, is not told the docs are stale.
  add_test(NAME docs.generated_tables_current
           COMMAND ${Python3_EXECUTABLE} ${ATTN_SCRIPTS}/update_docs.py --check)
  set_tests_properties(docs.generated_tables_current PROPERTIES LABELS docs)
else()
  message(STATUS "Python 3 not found: the tour, bench and plots targets are skipped")
endif()
