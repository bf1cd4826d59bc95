/* flashrt_ros._span_copy: copy_spans.c called as a Python extension function, not through ctypes.
 *
 * A capsule snapshot on a CPU is called from a cold cache (a decode step has streamed the
 * weights through it), and there the call itself costs: ctypes' argument conversion plus the
 * array.array the spans had to be packed into took 35-40 us more than this function, a quarter
 * of copying a 1.6 MiB state (bench VM, interleaved). Here the spans come as a list or tuple of
 * ints and are read straight into a C array (or built here from a layout's rows: copy_rows),
 * and a Python callable (a capsule's bookkeeping) can run on the calling thread while the other
 * threads already copy.
 *
 * The caller vouches for the addresses, as with any copy by address: see span_copy.py.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

#include "copy_spans.h"

/* A snapshot has a handful of spans: their triples fit here, with no allocation. */
#define ON_STACK 96

/* An int that is not a bool: True would pass as the address or length 1. */
#define IS_INT(value) (PyLong_Check(value) && !PyBool_Check(value))

/* Past FLASHRT_COPY_SPANS_MOST bytes the copy's block count would not fit its claim word; no
 * real batch comes near (256 TiB), but lengths summing past 2^63 would be undefined in C. */
static int check_total(const int64_t *spans, Py_ssize_t n) {
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (__builtin_add_overflow(total, spans[3 * i + 2], &total) || total > FLASHRT_COPY_SPANS_MOST) {
            PyErr_SetString(PyExc_OverflowError, "spans add up to more bytes than one copy takes (256 TiB)");
            return -1;
        }
    return 0;
}

/* Reads ``seq`` into ``spans`` (``stack`` when it fits, else allocated: the caller frees what is not
 * ``stack``). Exactly a list or tuple of ints: reading those runs no Python code (an __index__ could
 * resize the list under the loop). Returns the number of triples, or -1 with an exception set. */
static Py_ssize_t read_spans(PyObject *seq, int64_t *stack, int64_t **spans) {
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) {
        PyErr_SetString(PyExc_TypeError, "spans must be a list or tuple of ints");
        return -1;
    }
    const Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    if (count % 3 != 0) {
        PyErr_SetString(PyExc_ValueError, "spans must be (destination, source, length) triples");
        return -1;
    }
    int64_t *out = count <= ON_STACK ? stack : malloc((size_t)count * sizeof(int64_t));
    if (out == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!IS_INT(items[i])) {
            PyErr_SetString(PyExc_TypeError, "spans must be a list or tuple of ints");
            goto failed;
        }
        out[i] = PyLong_AsLongLong(items[i]);
        if (out[i] == -1 && PyErr_Occurred())
            goto failed;
        if (i % 3 == 2 && out[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "a span's length is negative");
            goto failed;
        }
    }
    if (check_total(out, count / 3) < 0)
        goto failed;
    *spans = out;
    return count / 3;
failed:
    if (out != stack)
        free(out);
    return -1;
}

static int read_threads(PyObject *value) {
    const long threads = PyLong_AsLong(value);
    if (threads == -1 && PyErr_Occurred())
        return -1;
    return threads < 1 ? 1 : threads > 1024 ? 1024 : (int)threads;
}

/* ``during`` runs on the calling thread, interpreter lock held, while the team copies; then
 * the thread lets go of the lock and joins the copy. */
typedef struct {
    PyObject *call, *result;
    PyThreadState *saved;
} During;

static void run_during(void *context) {
    During *during = context;
    during->result = PyObject_CallNoArgs(during->call);   /* NULL with the exception set */
    during->saved = PyEval_SaveThread();
}

/* ``during`` as given (None or absent: no call), into ``call``; -1 with an exception set. */
static int read_during(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t at, PyObject **call) {
    *call = NULL;
    if (nargs > at && args[at] != Py_None) {
        if (!PyCallable_Check(args[at])) {
            PyErr_SetString(PyExc_TypeError, "during must be callable or None");
            return -1;
        }
        *call = args[at];
    }
    return 0;
}

/* Copies the spans, running ``call`` (unless NULL) on this thread meanwhile; frees ``spans``
 * unless it is ``stack``. Returns what ``call`` returned (None without one), NULL if it raised. */
static PyObject *copy_and_run(int64_t *spans, int64_t *stack, Py_ssize_t n, int threads, PyObject *call) {
    During during = {call, NULL, NULL};
    if (call == NULL) {
        Py_BEGIN_ALLOW_THREADS   /* as a torch copy does: the digest thread may run meanwhile */
        flashrt_copy_spans(spans, (long)n, threads, NULL, NULL);
        Py_END_ALLOW_THREADS
    } else {
        flashrt_copy_spans(spans, (long)n, threads, run_during, &during);
        PyEval_RestoreThread(during.saved);
    }
    if (spans != stack)
        free(spans);
    if (call == NULL)
        Py_RETURN_NONE;
    return during.result;   /* NULL, raising the call's exception, when it raised */
}

/* copy(spans, threads, during=None): spans are flat (destination, source, length) triples. */
static PyObject *span_copy_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t stack[ON_STACK], *spans = NULL;
    PyObject *call;
    if (nargs != 2 && nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "copy(spans, threads, during=None) takes 2 or 3 arguments");
        return NULL;
    }
    if (read_during(args, nargs, 2, &call) < 0)
        return NULL;
    const int threads = read_threads(args[1]);
    if (threads < 0)
        return NULL;
    const Py_ssize_t n = read_spans(args[0], stack, &spans);
    if (n < 0)
        return NULL;
    return copy_and_run(spans, stack, n, threads, call);
}

static int read_count(PyObject *value, const char *what, int64_t *out) {
    *out = IS_INT(value) ? PyLong_AsLongLong(value) : -1;
    if (*out == -1 && PyErr_Occurred())
        return -1;
    if (*out < 0) {
        PyErr_Format(PyExc_ValueError, "copy_rows: %s must be an int >= 0", what);
        return -1;
    }
    return 0;
}

/* copy_rows(destination, source, fixed, rows, start, end, threads, during=None): bytes
 * [0, fixed) of ``source``, then rows [start, end) of each (offset, row bytes) pair of ``rows``,
 * laid end to end at ``destination``. A snapshot's spans, built here rather than in Python: from
 * a cold cache, building them before the copy could start cost it some 12 us (bench VM). */
static PyObject *span_copy_copy_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t stack[ON_STACK], *spans = stack;
    int64_t destination, source, fixed, start, end;
    PyObject *call;
    if (nargs != 7 && nargs != 8) {
        PyErr_SetString(PyExc_TypeError,
                        "copy_rows(destination, source, fixed, rows, start, end, threads, during=None) "
                        "takes 7 or 8 arguments");
        return NULL;
    }
    if (read_count(args[0], "destination", &destination) < 0 || read_count(args[1], "source", &source) < 0
            || read_count(args[2], "fixed", &fixed) < 0 || read_count(args[4], "start", &start) < 0
            || read_count(args[5], "end", &end) < 0 || read_during(args, nargs, 7, &call) < 0)
        return NULL;
    PyObject *rows = args[3];
    if (!PyTuple_CheckExact(rows)) {
        PyErr_SetString(PyExc_TypeError, "copy_rows: rows must be a tuple of (offset, row bytes) tuples");
        return NULL;
    }
    const int threads = read_threads(args[6]);
    if (threads < 0)
        return NULL;
    const Py_ssize_t regions = PyTuple_GET_SIZE(rows), most = 3 * (regions + 1);
    if (most > ON_STACK && (spans = malloc((size_t)most * sizeof(int64_t))) == NULL)
        return PyErr_NoMemory();
    Py_ssize_t n = 0;
    int64_t at = destination;
    if (fixed > 0) {
        spans[0] = at, spans[1] = source, spans[2] = fixed;
        if (__builtin_add_overflow(at, fixed, &at)) {
            PyErr_SetString(PyExc_OverflowError, "copy_rows: rows reach past 64-bit addresses");
            goto failed;
        }
        n = 1;
    }
    for (Py_ssize_t i = 0; end > start && i < regions; i++) {
        PyObject *pair = PyTuple_GET_ITEM(rows, i);
        int64_t offset, row;
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "copy_rows: rows must be a tuple of (offset, row bytes) tuples");
            goto failed;
        }
        if (read_count(PyTuple_GET_ITEM(pair, 0), "a row offset", &offset) < 0
                || read_count(PyTuple_GET_ITEM(pair, 1), "a row size", &row) < 0)
            goto failed;
        int64_t from, length;   /* no address a process has is near 2^63: overflow means bad arguments */
        if (__builtin_mul_overflow(start, row, &from) || __builtin_add_overflow(from, offset, &from)
                || __builtin_add_overflow(from, source, &from)
                || __builtin_mul_overflow(end - start, row, &length) || __builtin_add_overflow(at, length, &at)) {
            PyErr_SetString(PyExc_OverflowError, "copy_rows: rows reach past 64-bit addresses");
            goto failed;
        }
        spans[3 * n] = at - length, spans[3 * n + 1] = from, spans[3 * n + 2] = length;
        n++;
    }
    if (check_total(spans, n) < 0)
        goto failed;
    return copy_and_run(spans, stack, n, threads, call);
failed:
    if (spans != stack)
        free(spans);
    return NULL;
}

static PyMethodDef methods[] = {
    {"copy", (PyCFunction)(void (*)(void))span_copy_copy, METH_FASTCALL,
     "copy(spans, threads, during=None): copy flat (destination, source, length) triples, ``threads``\n"
     "sharing the bytes. ``during()`` runs on this thread while the others start; once every byte\n"
     "is copied its result is returned (its exception raised). Lets go of the interpreter lock for\n"
     "the copy. The caller vouches for the addresses."},
    {"copy_rows", (PyCFunction)(void (*)(void))span_copy_copy_rows, METH_FASTCALL,
     "copy_rows(destination, source, fixed, rows, start, end, threads, during=None): copy bytes\n"
     "[0, fixed) of ``source``, then rows [start, end) of each (offset, row bytes) pair of ``rows``,\n"
     "end to end to ``destination``, as ``copy`` copies spans (``during`` included). The caller\n"
     "vouches for the addresses."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_span_copy", "Byte spans copied between CPU buffers (src/copy_spans.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__span_copy(void) {
    return PyModule_Create(&module);
}
