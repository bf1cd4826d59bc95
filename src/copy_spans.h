/* Byte spans copied between CPU buffers: see copy_spans.c. */
#ifndef FLASHRT_COPY_SPANS_H
#define FLASHRT_COPY_SPANS_H

#include <stdint.h>

/* ``spans``: n triples (destination address, source address, length in bytes), not overlapping. */
void flashrt_copy_spans(const int64_t *spans, long n, int threads);

#endif
