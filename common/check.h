/* Checking a stage's outputs (docs/conventions.md section 3). */
#ifndef ATTN_CHECK_H
#define ATTN_CHECK_H

#include "attention.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  const attn_problem *p;
  const float *q, *k, *v, *d_o; /* the inputs exactly as the stage saw them */
  uint64_t seed;                /* --seed (also with --load): draws a large check's row sample */
  int saves_lse;
} attn_check_inputs;

/* Checks O (and LSE when the stage saves it) against the float64 reference, and against
 * the closed form where the inputs have one (every V row equal: O = V; Q = 0: O = mean of
 * the visible V; Nkv = 1: O = V_0). Sets *ok; prints every failure with its worst element
 * (and attn_failure_note). */
void attn_check_forward(const attn_check_inputs *in, const float *o, const float *lse,
                        int v_is_constant, int q_is_zero, double *err, double *tol, int *ok);
/* Checks dQ, dK, dV against the float64 reference backward of loss = sum(O * dO). */
void attn_check_backward(const attn_check_inputs *in, const float *o, const float *lse,
                         const float *dq, const float *dk, const float *dv, double *err,
                         double *tol, int *ok);

/* Why this thread's last check failed, in a few words that name the tensor ("dK: 12 non-finite
 * values", "dQ: max err 2.1e-03 > tol 6.4e-04"); "" when it passed. The checks above also
 * refuse, with exit 2, a problem whose tolerance would be as large as the answer itself. */
const char *attn_check_verdict(void);

/* Only that every output is finite and LSE is -inf exactly on the rows that see no key
 * (dq, dk, dv may be NULL): for inputs so large that no fp32 result can be compared. */
int attn_check_finite(const attn_check_inputs *in, const float *o, const float *lse,
                      const float *dq, const float *dk, const float *dv);

#ifdef __cplusplus
}
#endif

#endif
