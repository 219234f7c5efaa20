/* The check of the harness's own tests (and of stage 11's CPU test of its chunk rule): a
 * failed EXPECT prints its message and counts, so one run reports every failure; the test
 * returns 1 if `failures` is not 0. */
#ifndef ATTN_TESTS_EXPECT_H
#define ATTN_TESTS_EXPECT_H

#include <stdio.h>

static int failures = 0;

#define EXPECT(cond, ...)                    \
  do {                                       \
    if (!(cond)) {                           \
      failures++;                            \
      fprintf(stderr, "FAIL: " __VA_ARGS__); \
      fputc('\n', stderr);                   \
    }                                        \
  } while (0)

#endif
