/* The float64 reference, on double inputs (the harness widens the stage's inputs, already
 * rounded to the stage's dtype, so both see the same numbers). */
#ifndef ATTN_REFERENCE_H
#define ATTN_REFERENCE_H

#include "attention.h"

#ifdef __cplusplus
extern "C" {
#endif

/* O and LSE of the rows listed in `rows` (indices into the B*H*Nq query rows; every row when
 * rows == NULL), written densely: o[n*d + c], lse[n]. max_abs_s gets max|S| over their
 * visible logits, the fp32 rule's logit magnitude; with a softcap c, S the capped logits, or
 * max |scale q . k| / c where that is larger (reference.c says why). */
void reference_forward_rows(const attn_problem *p, const double *q, const double *k,
                            const double *v, const long *rows, long n_rows, double *o, double *lse,
                            double *max_abs_s);
/* dQ, dK, dV of loss = sum(O * dO) + sum(w_lse * LSE) (w_lse may be NULL), every row; and
 * dS = dLoss/dS [B,H,Nq,Nkv] when ds != NULL (for the tests of its invariants), S the logits
 * the softmax takes (with a softcap, the capped ones), 0 where masked. */
void reference_backward(const attn_problem *p, const double *q, const double *k, const double *v,
                        const double *d_o, const double *w_lse, double *dq, double *dk, double *dv,
                        double *ds);

#ifdef __cplusplus
}
#endif

#endif
