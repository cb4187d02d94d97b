/* One element of each storage dtype to its math type and back, for the CPU
 * kernels written as one template per dtype (cross_entropy, rotary):
 * LOAD_<DT>(element) widens, STORE_<DT>(value) narrows (round to nearest
 * even, NaN kept; convert.h's bits). float16 goes through convert_block.h's
 * branch-free forms, so a loop of them vectorizes. f64 and f32 are used as
 * they are. */
#ifndef OPSMITH_CPU_LOAD_STORE_H
#define OPSMITH_CPU_LOAD_STORE_H

#include "convert.h"
#include "convert_block.h"

#define LOAD_F64(p) (p)
#define STORE_F64(v) (v)
#define LOAD_F32(p) (p)
#define STORE_F32(v) (v)
#define LOAD_F16(p) opsmith_block_f16_to_f32(p)
#define STORE_F16(v) opsmith_block_f32_to_f16(v)
#define LOAD_BF16(p) opsmith_bf16_to_f32(p)
#define STORE_BF16(v) opsmith_f32_to_bf16(v)

#endif /* OPSMITH_CPU_LOAD_STORE_H */
