// error_flag.cuh: how a kernel reports a bad input that only the device sees (an index out of
// range), without making the host wait: the first bad index since the last check is recorded in
// the device's error flag (src/cuda/error_flag.rs), and the next host read (to_vec, item,
// synchronize) turns it into Error::IndexOutOfRange naming the op and the value.
// CPU twin: none (the CPU checks at once and returns the error from the op itself).

#pragma once

#include "common.cuh"

// The op a bad index is reported for, equal to src/cuda/error_flag.rs `IndexOp` (a test compares
// them).
enum FgIndexOp {
  FG_INDEX_SELECT = 0, FG_GATHER = 1, FG_INDEX_ADD = 2, FG_SCATTER_ADD = 3, FG_EMBEDDING = 4,
  FG_CROSS_ENTROPY_TARGET = 5, FG_INDEX_COPY = 6
};

// Mirrored by src/cuda/error_flag.rs `Record` in page-locked host memory mapped into the device:
// 4 + 4 + 8 + 8 = 24 bytes.
struct FgErrorRecord {
  unsigned int set;  // written last: 1 once op, value and size are valid
  int op;
  long long value;
  unsigned long long size;
};

// Record (op, value, size) unless an earlier bad index already was: `claim` (device memory, 0 when
// armed) elects one thread, which writes the record and raises `set` after a system-wide fence.
static __device__ __noinline__ void fg_bad_index(unsigned int* claim, FgErrorRecord* rec, int op, long long value,
                                                 fg_u64 size) {
  if (atomicCAS(claim, 0u, 1u) != 0u) return;
  volatile FgErrorRecord* r = rec;
  r->op = op;
  r->value = value;
  r->size = size;
  __threadfence_system();
  r->set = 1u;
}
