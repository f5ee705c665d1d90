#include "core/cpu_relax.h"

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace gradcomm {

void cpu_relax() {
#if defined(__SSE2__)
  _mm_pause();
#endif
}

}  // namespace gradcomm
