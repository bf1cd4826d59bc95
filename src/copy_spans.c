/* Byte spans copied between CPU buffers in one call: the copies of a capsule snapshot or restore
 * on a CPU (see flashrt_ros/capsule/span_copy.py for why these are not left to torch). Python
 * calls it through the extension module of span_copy_module.c.
 *
 * ``spans`` holds n triples (destination address, source address, length in bytes), laid end to
 * end as one batch of bytes. Spans must not overlap. The threads of an OpenMP team share the
 * batch, whatever the spans' sizes: in equal stretches of consecutive bytes, or, when the calling
 * thread first runs ``during`` (a capsule's bookkeeping) while the others already copy, in
 * BLOCK-sized blocks, the others claiming from the front and the calling thread, once it joins,
 * from the back, so that it takes what is left. The team is torch's (same runtime), whose
 * threads still spin from the last parallel region: a thread of our own, woken from sleep,
 * joined so late on the bench VM that it copied next to nothing.
 *
 * Stretches of STREAM bytes and more are written with non-temporal stores on x86, which skip
 * reading each destination line in first: from a cold cache, 1.6 MiB took 94 us this way and
 * 138 us through torch's copy (bench VM, interleaved). What is written so leaves the caches,
 * and its next reader (the digest thread after a snapshot, the next step after a restore) reads
 * it from memory; a step's stream of weights would have evicted most of it anyway.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "copy_spans.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#define STREAM 4096

static void copy_stretch(char *dst, const char *src, size_t length) {
#if defined(__x86_64__)
    if (length >= STREAM) {
        const size_t head = (16 - ((uintptr_t)dst & 15)) & 15;   /* up to dst's first 16-byte boundary */
        memcpy(dst, src, head);
        dst += head, src += head, length -= head;
        size_t i = 0;
        for (; i + 64 <= length; i += 64) {
            const __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            const __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            const __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            const __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        }
        memcpy(dst + i, src + i, length - i);
        _mm_sfence();   /* the streamed stores are ordered before whatever the caller does next */
        return;
    }
#endif
    memcpy(dst, src, length);
}

/* Bytes [first, last) of the batch, the spans laid end to end. */
static void copy_batch_bytes(const int64_t *spans, long n, int64_t first, int64_t last) {
    int64_t at = 0;   /* where span i starts within the batch */
    for (long i = 0; i < n && at < last; i++) {
        const int64_t length = spans[3 * i + 2];
        const int64_t from = at > first ? at : first, to = at + length < last ? at + length : last;
        if (from < to)
            copy_stretch((char *)(intptr_t)spans[3 * i] + (from - at),
                         (const char *)(intptr_t)spans[3 * i + 1] + (from - at), (size_t)(to - from));
        at += length;
    }
}

/* Small enough that a caller joining after ``during`` still finds blocks to take; large enough
 * that a claim (one atomic operation on a line every thread writes) is rare next to the copy. */
#define BLOCK (64 * 1024)
_Static_assert(FLASHRT_COPY_SPANS_MOST / BLOCK <= 0xffffffff, "a batch's block count must fit 32 bits");

/* The blocks not yet claimed, [front, back), in one word so that both ends move atomically:
 * the team takes blocks from the front, the calling thread, once ``during`` returns, from the
 * back. Each thread so streams through consecutive blocks: blocks handed out alternately from
 * the front, the calling thread's among them, took 7-16% longer at 3.8 MiB than one stretch
 * per thread (bench VM, interleaved). */
#define FRONT(word) ((word) & 0xffffffffu)
#define BACK(word) ((word) >> 32)

static int64_t claim(atomic_uint_fast64_t *left, int from_back) {
    uint_fast64_t word = atomic_load_explicit(left, memory_order_relaxed);
    for (;;) {
        const uint_fast64_t front = FRONT(word), back = BACK(word);
        if (front >= back)
            return -1;
        const uint_fast64_t next = from_back ? front | (back - 1) << 32 : (front + 1) | back << 32;
        if (atomic_compare_exchange_weak_explicit(left, &word, next, memory_order_relaxed, memory_order_relaxed))
            return (int64_t)(from_back ? back - 1 : front);
    }
}

static void claim_and_copy(const int64_t *spans, long n, int64_t total, atomic_uint_fast64_t *left, int from_back) {
    for (int64_t block; (block = claim(left, from_back)) >= 0;) {
        const int64_t first = block * BLOCK;
        copy_batch_bytes(spans, n, first, first + BLOCK < total ? first + BLOCK : total);
    }
}

void flashrt_copy_spans(const int64_t *spans, long n, int threads, void (*during)(void *), void *context) {
    int64_t total = 0;
    for (long i = 0; i < n; i++)
        total += spans[3 * i + 2];
    const int64_t blocks = (total + BLOCK - 1) / BLOCK;   /* < 2^32: see FLASHRT_COPY_SPANS_MOST */
    atomic_uint_fast64_t left;
    atomic_init(&left, (uint_fast64_t)blocks << 32);
    if (during != NULL && threads > blocks + 1)   /* more would find nothing to do; thread 0 is busy */
        threads = (int)blocks + 1;
    if (threads < 1)
        threads = 1;
#pragma omp parallel num_threads(threads)
    {
        int me = 0, team = 1;
#ifdef _OPENMP
        me = omp_get_thread_num();
        team = omp_get_num_threads();
#endif
        if (during == NULL) {
            /* All start together: equal shares of consecutive bytes, one stretch each (claimed
             * blocks, interleaved between the threads, took up to 9% longer at 1.6 MiB, six runs). */
            copy_batch_bytes(spans, n, total * me / team, total * (me + 1) / team);
        } else {
            if (me == 0)
                during(context);
            claim_and_copy(spans, n, total, &left, me == 0);
        }
    }   /* the region's end waits for every thread's last bytes */
}
