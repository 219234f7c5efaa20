/* The plain same-precision baseline of the half-precision tolerance rule (docs/conventions.md
 * section 3): attention computed the way a straightforward fp16/bf16 implementation
 * would, so that a stage's error can be compared with "what the dtype costs anyway". */
#ifndef ATTN_BASELINE_H
#define ATTN_BASELINE_H

#include "attention.h"

#ifdef __cplusplus
extern "C" {
#endif

/* O (rounded to p->dtype) and LSE (float) of the listed rows (every row when rows == NULL),
 * written densely like reference_forward_rows. Inputs are already rounded to p->dtype. */
void baseline_forward_rows(const attn_problem *p, const float *q, const float *k, const float *v,
                           const long *rows, long n_rows, float *o, float *lse);
/* dQ, dK, dV (rounded to p->dtype) of loss = sum(O * dO), every row. */
void baseline_backward(const attn_problem *p, const float *q, const float *k, const float *v,
                       const float *d_o, float *dq, float *dk, float *dv);

#ifdef __cplusplus
}
#endif

#endif
