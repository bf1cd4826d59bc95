/* flashrt_ros._span_copy: copy_spans.c called as a Python extension function, not through ctypes.
 *
 * A capsule snapshot on a CPU is called from a cold cache (a decode step has streamed the
 * weights through it), and there the call itself costs: ctypes' argument conversion plus the
 * array.array the spans had to be packed into took 35-40 us more than this function, a quarter
 * of copying a 1.6 MiB state (bench VM, interleaved). Here the spans come as a list or tuple of
 * ints and are read straight into a C array.
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

/* copy(spans, threads): spans are flat (destination, source, length) triples. */
static PyObject *span_copy_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "copy(spans, threads) takes 2 arguments");
        return NULL;
    }
    const long threads = PyLong_AsLong(args[1]);
    if (threads == -1 && PyErr_Occurred())
        return NULL;
    /* Exactly a list or tuple of ints: reading those runs no Python code (an __index__ could
     * resize the list under the loop), and the interpreter lock stays held until the copy. */
    PyObject *seq = args[0];
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) {
        PyErr_SetString(PyExc_TypeError, "copy: spans must be a list or tuple of ints");
        return NULL;
    }
    const Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    if (count % 3 != 0) {
        PyErr_SetString(PyExc_ValueError, "copy: spans must be (destination, source, length) triples");
        return NULL;
    }
    int64_t stack[ON_STACK];
    int64_t *spans = count <= ON_STACK ? stack : malloc((size_t)count * sizeof(int64_t));
    if (spans == NULL)
        return PyErr_NoMemory();
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int failed = 0;
    for (Py_ssize_t i = 0; i < count && !failed; i++) {
        if (!PyLong_Check(items[i])) {
            PyErr_SetString(PyExc_TypeError, "copy: spans must be a list or tuple of ints");
            failed = 1;
            break;
        }
        spans[i] = PyLong_AsLongLong(items[i]);
        if (spans[i] == -1 && PyErr_Occurred())
            failed = 1;
        else if (i % 3 == 2 && spans[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "copy: a span's length is negative");
            failed = 1;
        }
    }
    if (!failed) {
        const int team = threads < 1 ? 1 : threads > 1024 ? 1024 : (int)threads;
        Py_BEGIN_ALLOW_THREADS   /* as a torch copy does: the digest thread may run meanwhile */
        flashrt_copy_spans(spans, (long)(count / 3), team);
        Py_END_ALLOW_THREADS
    }
    if (spans != stack)
        free(spans);
    if (failed)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy", (PyCFunction)(void (*)(void))span_copy_copy, METH_FASTCALL,
     "copy(spans, threads): copy flat (destination, source, length) triples, ``threads`` sharing the\n"
     "bytes. Lets go of the interpreter lock meanwhile. The caller vouches for the addresses."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_span_copy", "Byte spans copied between CPU buffers (src/copy_spans.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__span_copy(void) {
    return PyModule_Create(&module);
}
