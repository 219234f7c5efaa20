/* fp16 and bf16 rounding on the host: known values, ties to even, overflow, subnormals, and
 * every fp16 and bf16 bit pattern surviving a round trip through float. */
#include <math.h>
#include <stdio.h>

#include "attention.h"

static int failures = 0;

static void expect_bits(float x, attn_dtype t, unsigned want) {
  unsigned got = attn_float_to_half_bits(x, t);
  if (got != want) {
    failures++;
    fprintf(stderr, "FAIL: %s(%.9g) = 0x%04x, expected 0x%04x\n", attn_dtype_name(t), x, got, want);
  }
}

int main(void) {
  expect_bits(1.0f, DTYPE_FP16, 0x3c00);
  expect_bits(-2.0f, DTYPE_FP16, 0xc000);
  expect_bits(65504.0f, DTYPE_FP16, 0x7bff);
  expect_bits(65519.0f, DTYPE_FP16, 0x7bff);           /* below the halfway point to 65536 */
  expect_bits(65520.0f, DTYPE_FP16, 0x7c00);           /* rounds to infinity */
  expect_bits(1.0f + 1.0f / 2048, DTYPE_FP16, 0x3c00); /* a tie: to the even neighbour */
  expect_bits(1.0f + 3.0f / 2048, DTYPE_FP16, 0x3c02); /* a tie: to the even neighbour */
  expect_bits(5.9604645e-8f, DTYPE_FP16, 0x0001);      /* the smallest subnormal, 2^-24 */
  expect_bits(2.9802322e-8f, DTYPE_FP16, 0x0000);      /* half of it: a tie, to even (zero) */
  expect_bits(1.0f, DTYPE_BF16, 0x3f80);
  expect_bits(133120.0f, DTYPE_BF16, 0x4802);
  expect_bits(1.0f + 1.0f / 256, DTYPE_BF16, 0x3f80); /* a tie: to even */
  expect_bits(INFINITY, DTYPE_BF16, 0x7f80);
  expect_bits(-INFINITY, DTYPE_FP16, 0xfc00);
  for (int t = DTYPE_FP16; t <= DTYPE_BF16; t++)
    for (unsigned h = 0; h < 65536; h++) {
      float x = attn_half_bits_to_float((uint16_t)h, (attn_dtype)t);
      if (isnan(x)) continue;
      unsigned back = attn_float_to_half_bits(x, (attn_dtype)t);
      if (back != h) {
        failures++;
        fprintf(stderr, "FAIL: %s 0x%04x -> %.9g -> 0x%04x\n", attn_dtype_name((attn_dtype)t), h, x,
                back);
        break;
      }
    }
  printf("half conversions: %d failures\n", failures);
  return failures ? 1 : 0;
}
