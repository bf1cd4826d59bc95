/* Byte spans copied between CPU buffers: see copy_spans.c. */
#ifndef FLASHRT_COPY_SPANS_H
#define FLASHRT_COPY_SPANS_H

#include <stdint.h>

/* The most bytes one call copies (just under 256 TiB): as many 64 KiB blocks as the copy's
 * claim word counts in its 32-bit halves. */
#define FLASHRT_COPY_SPANS_MOST (((INT64_C(1) << 32) - 1) << 16)

/* ``spans``: n triples (destination address, source address, length in bytes), not overlapping,
 * copied by up to ``threads`` threads, the caller's among them. ``during``, unless NULL, runs
 * once on the calling thread, with ``context``, before that thread joins the copy. Every byte is
 * copied when the call returns. */
void flashrt_copy_spans(const int64_t *spans, long n, int threads, void (*during)(void *), void *context);

#endif
