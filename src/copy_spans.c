/* Byte spans copied between CPU buffers in one call: the copies of a capsule snapshot or restore
 * on a CPU (see flashrt_ros/capsule/span_copy.py for why these are not left to torch).
 *
 * ``spans`` holds n triples (destination address, source address, length in bytes). The total
 * is cut into ``threads`` equal shares of consecutive bytes, so that each thread copies one
 * contiguous stretch of the batch, whatever the spans' sizes. Spans must not overlap.
 */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

void flashrt_copy_spans(const int64_t *spans, long n, int threads) {
    int64_t total = 0;
    for (long i = 0; i < n; i++)
        total += spans[3 * i + 2];
    if (threads < 1)
        threads = 1;
#pragma omp parallel num_threads(threads)
    {
        int me = 0, team = 1;
#ifdef _OPENMP
        me = omp_get_thread_num();
        team = omp_get_num_threads();
#endif
        const int64_t first = total * me / team, last = total * (me + 1) / team;
        int64_t at = 0;   /* where span i starts within the batch */
        for (long i = 0; i < n && at < last; i++) {
            const int64_t length = spans[3 * i + 2];
            const int64_t from = at > first ? at : first, to = at + length < last ? at + length : last;
            if (from < to)
                memcpy((char *)(intptr_t)spans[3 * i] + (from - at),
                       (const char *)(intptr_t)spans[3 * i + 1] + (from - at), (size_t)(to - from));
            at += length;
        }
    }
}
