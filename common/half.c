/* fp16 and bf16 on the host: round-to-nearest-even, NaN and infinity kept. The GPU rounds
 * the same way (__float2half_rn, __float2bfloat16_rn), so host and device agree bit for bit
 * on what the inputs are. */
#include <string.h>

#include "attention.h"

static uint32_t float_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return u;
}

static float bits_float(uint32_t u) {
  float x;
  memcpy(&x, &u, sizeof x);
  return x;
}

static uint16_t float_to_bf16(float x) {
  uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u); /* ties to even; overflow rounds up to infinity */
  return (uint16_t)(u >> 16);
}

static uint16_t float_to_fp16(float x) {
  uint32_t u = float_bits(x);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;  /* NaN */
  if (abs >= 0x477ff000u) return sign | 0x7c00u; /* rounds to or beyond 65520: infinity */
  if (abs < 0x38800000u) {                       /* below 2^-14: subnormal or zero */
    /* Scale so that one fp16 subnormal step (2^-24) is one unit, then round to even. */
    float scaled = bits_float(abs) * 16777216.0f; /* exact: a power-of-two scaling */
    uint32_t whole = (uint32_t)scaled;
    float rest = scaled - (float)whole;
    if (rest > 0.5f || (rest == 0.5f && (whole & 1u))) whole++;
    return sign | (uint16_t)whole;
  }
  /* Normal: re-bias the exponent (127 -> 15) and round the 23 mantissa bits to 10. */
  uint32_t rebased = abs - ((127u - 15u) << 23);
  uint32_t rounded = rebased + 0xfffu + ((rebased >> 13) & 1u);
  return sign | (uint16_t)(rounded >> 13);
}

static float fp16_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24, exact in float */
    float x = (float)mantissa * (1.0f / 16777216.0f);
    return sign ? -x : x;
  }
  return bits_float(sign | ((exponent + 127u - 15u) << 23) | (mantissa << 13));
}

uint16_t attn_float_to_half_bits(float x, attn_dtype t) {
  return t == DTYPE_BF16 ? float_to_bf16(x) : float_to_fp16(x);
}

float attn_half_bits_to_float(uint16_t h, attn_dtype t) {
  return t == DTYPE_BF16 ? bits_float((uint32_t)h << 16) : fp16_to_float(h);
}

float attn_round_to_dtype(float x, attn_dtype t) {
  if (t == DTYPE_FP32) return x;
  return attn_half_bits_to_float(attn_float_to_half_bits(x, t), t);
}
