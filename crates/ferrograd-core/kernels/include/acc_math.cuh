// acc_math.cuh: math in the accumulation type (float: the f32 library functions, double: the f64
// ones), the constants of src/op.rs, and tanh-GELU with its derivative, shared by the elementwise
// kernels (unary.cu) and the fused ops that compute the same functions (softmax, cross entropy,
// the fused linear's activation gradient).
// CPU twins: src/op.rs `UnaryOp::eval_f32` / `eval_f64` (GeluTanh, GeluTanhGrad).

#pragma once

#include "common.cuh"

static __device__ __forceinline__ float fg_exp(float x) { return expf(x); }
static __device__ __forceinline__ double fg_exp(double x) { return exp(x); }
static __device__ __forceinline__ float fg_log(float x) { return logf(x); }
static __device__ __forceinline__ double fg_log(double x) { return log(x); }
static __device__ __forceinline__ float fg_sqrt(float x) { return sqrtf(x); }
static __device__ __forceinline__ double fg_sqrt(double x) { return sqrt(x); }
static __device__ __forceinline__ float fg_tanh(float x) { return tanhf(x); }
static __device__ __forceinline__ double fg_tanh(double x) { return tanh(x); }
static __device__ __forceinline__ float fg_erf(float x) { return erff(x); }
static __device__ __forceinline__ double fg_erf(double x) { return erf(x); }
static __device__ __forceinline__ float fg_fabs(float x) { return fabsf(x); }
static __device__ __forceinline__ double fg_fabs(double x) { return fabs(x); }
// Rust's f32::max / f64::max ignore a NaN operand, as fmax does.
static __device__ __forceinline__ float fg_fmax(float a, float b) { return fmaxf(a, b); }
static __device__ __forceinline__ double fg_fmax(double a, double b) { return fmax(a, b); }
static __device__ __forceinline__ float fg_fmin(float a, float b) { return fminf(a, b); }
static __device__ __forceinline__ double fg_fmin(double a, double b) { return fmin(a, b); }

// The constants of op.rs, each in the precision the CPU uses for this ACC (std::f32::consts /
// std::f64::consts are the nearest value of each type to the real constant).
template <typename A> struct FgK;
template <> struct FgK<float> {
  static __device__ __forceinline__ float frac_2_sqrt_pi() { return 1.12837916709551257389615890312154517f; }
  static __device__ __forceinline__ float sqrt_2() { return 1.41421356237309504880168872420969808f; }
  static __device__ __forceinline__ float gelu_c() { return 0.044715f; }
};
template <> struct FgK<double> {
  static __device__ __forceinline__ double frac_2_sqrt_pi() { return 1.12837916709551257389615890312154517; }
  static __device__ __forceinline__ double sqrt_2() { return 1.41421356237309504880168872420969808; }
  static __device__ __forceinline__ double gelu_c() { return 0.044715; }
};

// GPT-2's GELU: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), in op.rs's order of operations.
template <typename A>
static __device__ __forceinline__ A fg_gelu_tanh(A x) {
  typedef FgK<A> K;
  const A one = (A)1, half = (A)0.5;
  const A k = K::frac_2_sqrt_pi() / K::sqrt_2();
  return half * x * (one + fg_tanh(k * (x + K::gelu_c() * x * x * x)));
}

// d/dx of fg_gelu_tanh, returned, and fg_gelu_tanh(x) itself written to `*y`, from one tanh (the
// same expressions as fg_gelu_tanh's, so the same values: linear.cu's dz kernel that also writes
// the activation).
template <typename A>
static __device__ __forceinline__ A fg_gelu_tanh_grad_and_value(A x, A* y) {
  typedef FgK<A> K;
  const A one = (A)1, half = (A)0.5;
  const A k = K::frac_2_sqrt_pi() / K::sqrt_2();
  const A c = K::gelu_c();
  const A t = fg_tanh(k * (x + c * x * x * x));
  *y = half * x * (one + t);
  return half * (one + t) + half * x * (one - t * t) * k * (one + (A)3 * c * x * x);
}

// d/dx of fg_gelu_tanh (UnaryOp::GeluTanhGrad); the value the compiler drops.
template <typename A>
static __device__ __forceinline__ A fg_gelu_tanh_grad(A x) {
  A unused;
  return fg_gelu_tanh_grad_and_value(x, &unused);
}
