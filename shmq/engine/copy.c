/*
 * shmq/engine/copy.c: copying payloads into and out of the ring when the
 * destination sits just past the source modulo a page.
 *
 * glibc's memcpy moves 2 KiB to L2-sized blocks with `rep movsb` on x86-64
 * CPUs that have ERMS/FSRM.  When (dst - src) mod 4096 is small, each store
 * lands a few bytes past the load that follows it at the same page offset,
 * and the CPU waits on that false dependency: on an AMD EPYC VM, a 64 KiB
 * memcpy at distances 1 to 31 runs at 2.9 GB/s against 25-50 GB/s at the
 * others (stress/copy_bench.py, docs/benchmarks.md).  A ring's frames sit
 * at every offset, so now and then a payload of a steady stream lands at
 * such a distance from its source and takes many times its neighbours'
 * time.  eng_copy (engine.h) sends distances 1 to 63 (a margin
 * for other CPUs) here: a backward loop of 16-byte moves, whose loads run
 * ahead of its stores (at lower addresses), so no load follows a store it
 * could be taken to depend on.
 */
#include "engine.h"

#if ENG_COPY_APART
#include <emmintrin.h>

void eng_copy_apart(void *dst_, const void *src_, size_t n) {
    char *dst = dst_, *q = dst + n;
    const char *p = (const char *)src_ + n;
    size_t tail = (uintptr_t)q & 15; /* the destination's end, down to a 16-byte boundary */
    q -= tail;
    p -= tail;
    memcpy(q, p, tail);
    while ((size_t)(q - dst) >= 64) {
        q -= 64;
        p -= 64;
        __m128i a = _mm_loadu_si128((const __m128i *)(p + 48)), b = _mm_loadu_si128((const __m128i *)(p + 32));
        __m128i c = _mm_loadu_si128((const __m128i *)(p + 16)), d = _mm_loadu_si128((const __m128i *)p);
        _mm_store_si128((__m128i *)(q + 48), a);
        _mm_store_si128((__m128i *)(q + 32), b);
        _mm_store_si128((__m128i *)(q + 16), c);
        _mm_store_si128((__m128i *)q, d);
    }
    memcpy(dst, src_, (size_t)(q - dst)); /* under 64 bytes: no rep movsb */
}
#endif
