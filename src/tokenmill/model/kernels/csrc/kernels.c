/* The kernel library's one translation unit: every file, in dependency order
 * (model/kernels/cpu_kernels.py says why one unit). */
#include "tm_kernels.h"

#include "paged_attention.c"
#include "paged_run.c"
#include "prefill_attention.c"
#include "argmax.c"
#include "elementwise.c"
#include "kquant.c"
#include "threads.c"
#include "dense.c"
#include "int8.c"
#include "int4.c"
#include "kquant_tiles.c"
#include "linear.c"
#include "lora.c"
#include "step.c"
