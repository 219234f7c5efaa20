/* One GPU stage as a shared library, for the Python package (python/flash_stages).
 *
 * The stage's own source file is compiled here unchanged: ATTN_STAGE_SOURCE names it, and its
 * main() is renamed so that the library has none. What the library adds is seven C entry
 * points around the stage's descriptor, so that Python (ctypes) runs exactly the kernels the
 * stage program runs, on buffers PyTorch owns. The descriptor is read, not copied: the head
 * dims and dtypes Python accepts are the ones the program accepts.
 */
#include "attention.h"
#include "gpu.h"

#ifndef ATTN_STAGE_SOURCE
#error "ATTN_STAGE_SOURCE must name the stage's .cu file"
#endif

#define main attn_stage_program_main
#include ATTN_STAGE_SOURCE
#undef main

/* The version of these entry points, which python/flash_stages/_library.py checks: 6 since
 * attn_problem, attn_buffers and attn_stage end with the window, softcap and varlen fields
 * (5: a layout; 4: cache lengths; 3: every call returns the harness's exit code and
 * attn_library_error says why). A library of another version would be
 * misread, so the package refuses one without this function or with another version. */
extern "C" int attn_library_abi(void) { return 6; }

/* The stage's descriptor: name, idea, head dims, dtypes, causal and backward support. The
 * program name is set here, once, so that the harness's error lines name the stage. */
extern "C" const attn_stage *attn_library_stage(void) {
  attn_program_name = stage.name;
  return &stage;
}

/* Every entry point below runs the stage with a return point set: where the program would
 * exit, the call returns the program's exit code instead (2: a problem this device cannot run,
 * such as tiles past its shared memory; 77: a stage built for another GPU; 1: a CUDA error)
 * and attn_library_error() holds the line the program would print; 0 when all is well. A CUDA
 * error that poisons the context (an illegal address) still leaves it unusable. */

/* Both ways out of a call, so that the next call on this thread starts clean. */
static int end_call(int code) {
  attn_fail_return_to(NULL);
  attn_set_deterministic(0);
  attn_set_stream(0);
  return code;
}

/* *bytes: the device workspace the forward or the backward needs for problem p (the caller
 * allocates it and passes it in t->workspace). Stage 11 plans its decode split here, from
 * the current device's SMs and shared memory. */
/* What the harness's validation would refuse and a kernel could not tell: a layout the
 * stage's kernels do not read, or a mask or softcap they do not apply (they would compute
 * plain attention and return it as the answer). */
static void check_problem(const attn_problem *p) {
  if (p->layout != LAYOUT_BHND && !stage.has_layouts)
    attn_fail(EXIT_BAD_USAGE, "layout %s: this stage reads [B, H, N, d] only",
              attn_layout_name(p->layout));
  if (p->windowed && !stage.has_window)
    attn_fail(EXIT_BAD_USAGE,
              "this stage has no sliding window (it comes in 13_window_softcap_varlen)");
  if (p->softcap > 0 && !stage.has_softcap)
    attn_fail(EXIT_BAD_USAGE,
              "this stage has no logit softcap (it comes in 13_window_softcap_varlen)");
  if (p->seqs > 0 && !stage.has_varlen)
    attn_fail(EXIT_BAD_USAGE,
              "this stage takes no packed variable-length sequences (varlen comes in "
              "13_window_softcap_varlen)");
}

static int workspace(attn_workspace_fn fn, const attn_problem *p, size_t *bytes) {
  jmp_buf failed;
  if (setjmp(failed) != 0) return end_call(attn_last_failure_code());
  attn_fail_return_to(&failed);
  check_problem(p);
  *bytes = fn ? fn(p) : 0;
  return end_call(EXIT_OK);
}
extern "C" int attn_library_forward_workspace(const attn_problem *p, size_t *bytes) {
  return workspace(stage.forward_workspace, p, bytes);
}
extern "C" int attn_library_backward_workspace(const attn_problem *p, size_t *bytes) {
  return workspace(stage.backward_workspace, p, bytes);
}

/* The passes, launched on `stream` (PyTorch's current stream, a cudaStream_t; 0 is the
 * legacy default stream, as in the stage program). Every launch inside is checked by the
 * stage, and the last error once more here. */
static int run_pass(attn_pass_fn pass, const char *name, const attn_problem *p,
                    const attn_buffers *t, void *stream, int deterministic) {
  jmp_buf failed;
  if (setjmp(failed) != 0) return end_call(attn_last_failure_code());
  attn_fail_return_to(&failed);
  if (!pass) attn_fail(EXIT_BAD_USAGE, "this stage has no %s pass", name);
  /* Every variable, whichever this stage reads (a workspace query reads those it needs): a
   * call with a bad value fails the same way on every stage. */
  attn_check_environment();
  check_problem(p);
  if (t->cache_lens && !stage.has_cache_lens)
    attn_fail(EXIT_BAD_USAGE,
              "this stage takes no cache lengths (they come in 11_split_kv_decode)");
  if ((t->cu_seqlens_q || t->cu_seqlens_k) && !stage.has_varlen)
    attn_fail(EXIT_BAD_USAGE,
              "this stage takes no packed variable-length sequences (varlen comes in "
              "13_window_softcap_varlen)");
  attn_set_stream((cudaStream_t)stream);
  attn_set_deterministic(deterministic);
  pass(p, t);
  CUDA_CHECK(cudaGetLastError());
  return end_call(EXIT_OK);
}

extern "C" int attn_library_forward(const attn_problem *p, const attn_buffers *t, void *stream) {
  return run_pass(stage.forward, "forward", p, t, stream, 0);
}
/* deterministic: nonzero takes the deterministic path where the stage has one, as
 * ATTN_DETERMINISTIC=1 does, without touching the environment. */
extern "C" int attn_library_backward(const attn_problem *p, const attn_buffers *t, void *stream,
                                     int deterministic) {
  return run_pass(stage.backward, "backward", p, t, stream, deterministic);
}

/* The line of the last failed call on this thread ("stage: why"), "" if none failed. */
extern "C" const char *attn_library_error(void) { return attn_last_failure(); }
