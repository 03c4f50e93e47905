/*
 * Non-temporal memory copy for the async-save staging buffers.
 *
 * A staging buffer is written once and read much later by the writer thread, so caching it is pure
 * cost: ordinary stores first read every destination line (read-for-ownership), moving 3 bytes per
 * byte copied. Non-temporal stores move 2. glibc's memmove switches to them only above
 * x86_non_temporal_threshold (3/4 of the per-thread share of L3), which on machines that report a
 * large L3 (many VMs, large-cache servers) is bigger than any tensor, so tensor-sized copies never
 * get them. This copies in one sequential stream of 16-byte streaming stores (SSE2, present on every
 * x86-64 CPU), 64 bytes (one cache line) per step, then fences. An earlier version interleaved four
 * pages per step and ran slower than memmove; the sequential stream beats memmove
 * (docs/benchmarks.md). Elsewhere it is a plain memcpy.
 *
 * Python API: copy(dst_address, src_address, nbytes) -> None, with the GIL released. The caller
 * guarantees both ranges are valid, writable (dst) and do not overlap.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define HF_NT_COPY 1
#else
#define HF_NT_COPY 0
#endif

static void copy_bytes(char *dst, const char *src, size_t n) {
#if HF_NT_COPY
    size_t head = (64 - ((uintptr_t)dst & 63)) & 63;
    if (n < 4096 + head) {
        memcpy(dst, src, n);
        return;
    }
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    while (n >= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), e);
        src += 64;
        dst += 64;
        n -= 64;
    }
    _mm_sfence();
    memcpy(dst, src, n);
#else
    memcpy(dst, src, n);
#endif
}

static PyObject *fastcopy_copy(PyObject *self, PyObject *args) {
    unsigned long long dst, src, n;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKK:copy", &dst, &src, &n)) {
        return NULL;
    }
    if (n > 0 && (dst == 0 || src == 0)) {
        PyErr_SetString(PyExc_ValueError, "copy: null address");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    copy_bytes((char *)(uintptr_t)dst, (const char *)(uintptr_t)src, (size_t)n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy", fastcopy_copy, METH_VARARGS, "copy(dst_address, src_address, nbytes): non-temporal copy, GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fastcopy", "Non-temporal memory copy for staging buffers.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fastcopy(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "NON_TEMPORAL", HF_NT_COPY) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
