/* Bun.hash: Zig's std.hash.Wyhash (final v4 variant), seed 0 by default.
 *
 * mlx-bun hashes its v3 cache file headers and tensors with Bun.hash, which is
 * Zig's std.hash.Wyhash. This is a C port of that code (one-shot and the
 * streaming init/update/final state machine, which gives the same value for
 * any split of the input). The GIL is released while large buffers hash.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static const uint64_t SECRET[4] = {
    0xa0761d6478bd642fULL,
    0xe7037ed1a0b428dbULL,
    0x8ebc6af09c88c6e3ULL,
    0x589965cc75374cc3ULL,
};

/* Below this many bytes the GIL round trip costs more than the hash. */
#define RELEASE_GIL_ABOVE 8192

static inline uint64_t rd64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline uint64_t rd32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

static inline void mum(uint64_t *a, uint64_t *b) {
    __uint128_t x = (__uint128_t)*a * *b;
    *a = (uint64_t)x;
    *b = (uint64_t)(x >> 64);
}

static inline uint64_t mix(uint64_t a, uint64_t b) {
    mum(&a, &b);
    return a ^ b;
}

typedef struct {
    uint64_t a, b;
    uint64_t state[3];
    uint64_t total_len;
    uint8_t buf[48];
    size_t buf_len;
} wy_state;

static void wy_init(wy_state *s, uint64_t seed) {
    s->a = s->b = 0;
    s->state[0] = seed ^ mix(seed ^ SECRET[0], SECRET[1]);
    s->state[1] = s->state[0];
    s->state[2] = s->state[0];
    s->total_len = 0;
    s->buf_len = 0;
}

static inline void wy_round(uint64_t state[3], const uint8_t *in) {
    state[0] = mix(rd64(in) ^ SECRET[1], rd64(in + 8) ^ state[0]);
    state[1] = mix(rd64(in + 16) ^ SECRET[2], rd64(in + 24) ^ state[1]);
    state[2] = mix(rd64(in + 32) ^ SECRET[3], rd64(in + 40) ^ state[2]);
}

/* Rounds over whole 48-byte blocks, always leaving a non-empty tail:
 * Wyhash runs the last block through final1 even when it is full. */
static size_t wy_rounds(uint64_t state[3], const uint8_t *in, size_t len) {
    size_t i = 0;
    uint64_t s0 = state[0], s1 = state[1], s2 = state[2];
    while (i + 48 < len) {
        const uint8_t *p = in + i;
        s0 = mix(rd64(p) ^ SECRET[1], rd64(p + 8) ^ s0);
        s1 = mix(rd64(p + 16) ^ SECRET[2], rd64(p + 24) ^ s1);
        s2 = mix(rd64(p + 32) ^ SECRET[3], rd64(p + 40) ^ s2);
        i += 48;
    }
    state[0] = s0;
    state[1] = s1;
    state[2] = s2;
    return i;
}

static void small_key(wy_state *s, const uint8_t *in, size_t len) {
    if (len >= 4) {
        size_t end = len - 4;
        size_t quarter = (len >> 3) << 2;
        s->a = (rd32(in) << 32) | rd32(in + quarter);
        s->b = (rd32(in + end) << 32) | rd32(in + end - quarter);
    } else if (len > 0) {
        s->a = ((uint64_t)in[0] << 16) | ((uint64_t)in[len >> 1] << 8) | in[len - 1];
        s->b = 0;
    } else {
        s->a = 0;
        s->b = 0;
    }
}

/* in_lb[0 .. lb_len) with lb_len >= 16; the input proper starts at start. */
static void final1(wy_state *s, const uint8_t *in_lb, size_t lb_len, size_t start) {
    const uint8_t *in = in_lb + start;
    size_t len = lb_len - start;
    size_t i = 0;
    while (i + 16 < len) {
        s->state[0] = mix(rd64(in + i) ^ SECRET[1], rd64(in + i + 8) ^ s->state[0]);
        i += 16;
    }
    s->a = rd64(in_lb + lb_len - 16);
    s->b = rd64(in_lb + lb_len - 8);
}

static uint64_t final2(wy_state *s) {
    s->a ^= SECRET[1];
    s->b ^= s->state[0];
    mum(&s->a, &s->b);
    return mix(s->a ^ SECRET[0] ^ s->total_len, s->b ^ SECRET[1]);
}

static uint64_t wy_hash(uint64_t seed, const uint8_t *in, size_t len) {
    wy_state s;
    wy_init(&s, seed);
    if (len <= 16) {
        small_key(&s, in, len);
    } else {
        size_t i = 0;
        if (len >= 48) {
            i = wy_rounds(s.state, in, len);
            s.state[0] ^= s.state[1] ^ s.state[2];
        }
        final1(&s, in, len, i);
    }
    s.total_len = len;
    return final2(&s);
}

static void wy_update(wy_state *s, const uint8_t *in, size_t len) {
    s->total_len += len;
    if (len <= 48 - s->buf_len) {
        memcpy(s->buf + s->buf_len, in, len);
        s->buf_len += len;
        return;
    }
    size_t i = 0;
    if (s->buf_len > 0) {
        i = 48 - s->buf_len;
        memcpy(s->buf + s->buf_len, in, i);
        wy_round(s->state, s->buf);
        s->buf_len = 0;
    }
    i += wy_rounds(s->state, in + i, len - i);
    size_t rem = len - i;
    if (rem < 16 && i >= 48) {
        /* keep the bytes before the tail: final reads the last 16 bytes */
        size_t back = 16 - rem;
        memcpy(s->buf + 48 - back, in + i - back, back);
    }
    memcpy(s->buf, in + i, rem);
    s->buf_len = rem;
}

static uint64_t wy_final(const wy_state *self) {
    wy_state s = *self;
    if (self->total_len <= 16) {
        small_key(&s, self->buf, self->buf_len);
    } else {
        s.state[0] ^= s.state[1] ^ s.state[2];
        if (self->buf_len < 16) {
            uint8_t scratch[16];
            size_t rem = 16 - self->buf_len;
            memcpy(scratch, self->buf + 48 - rem, rem);
            memcpy(scratch + rem, self->buf, self->buf_len);
            final1(&s, scratch, 16, rem);
        } else {
            final1(&s, self->buf, self->buf_len, 0);
        }
    }
    return final2(&s);
}

/* ---- Python binding ------------------------------------------------------ */

static int get_bytes(PyObject *obj, Py_buffer *view) {
    /* PyBUF_SIMPLE: the exporter must hand over one contiguous run of bytes */
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) != 0) {
        return -1;
    }
    return 0;
}

static PyObject *py_hash(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"data", "seed", NULL};
    PyObject *obj;
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|K:hash", kwlist, &obj, &seed)) {
        return NULL;
    }
    Py_buffer view;
    if (get_bytes(obj, &view) != 0) {
        return NULL;
    }
    uint64_t h;
    if (view.len > RELEASE_GIL_ABOVE) {
        Py_BEGIN_ALLOW_THREADS
        h = wy_hash(seed, (const uint8_t *)view.buf, (size_t)view.len);
        Py_END_ALLOW_THREADS
    } else {
        h = wy_hash(seed, (const uint8_t *)view.buf, (size_t)view.len);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}

typedef struct {
    PyObject_HEAD
    wy_state st;
    PyThread_type_lock lock; /* updates run without the GIL */
} WyhashObject;

static int Wyhash_init(WyhashObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"data", "seed", NULL};
    PyObject *data = NULL;
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|OK:Wyhash", kwlist, &data, &seed)) {
        return -1;
    }
    if (self->lock == NULL) {
        self->lock = PyThread_allocate_lock();
        if (self->lock == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    wy_init(&self->st, seed);
    if (data != NULL && data != Py_None) {
        Py_buffer view;
        if (get_bytes(data, &view) != 0) {
            return -1;
        }
        wy_update(&self->st, (const uint8_t *)view.buf, (size_t)view.len);
        PyBuffer_Release(&view);
    }
    return 0;
}

static void Wyhash_dealloc(WyhashObject *self) {
    if (self->lock != NULL) {
        PyThread_free_lock(self->lock);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Wyhash_update(WyhashObject *self, PyObject *obj) {
    Py_buffer view;
    if (get_bytes(obj, &view) != 0) {
        return NULL;
    }
    if (view.len > RELEASE_GIL_ABOVE) {
        Py_BEGIN_ALLOW_THREADS
        PyThread_acquire_lock(self->lock, 1);
        wy_update(&self->st, (const uint8_t *)view.buf, (size_t)view.len);
        PyThread_release_lock(self->lock);
        Py_END_ALLOW_THREADS
    } else {
        PyThread_acquire_lock(self->lock, 1);
        wy_update(&self->st, (const uint8_t *)view.buf, (size_t)view.len);
        PyThread_release_lock(self->lock);
    }
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyObject *Wyhash_intdigest(WyhashObject *self, PyObject *Py_UNUSED(ignored)) {
    PyThread_acquire_lock(self->lock, 1);
    uint64_t h = wy_final(&self->st);
    PyThread_release_lock(self->lock);
    return PyLong_FromUnsignedLongLong(h);
}

static PyObject *Wyhash_copy(WyhashObject *self, PyObject *Py_UNUSED(ignored)) {
    WyhashObject *other = PyObject_New(WyhashObject, Py_TYPE(self));
    if (other == NULL) {
        return NULL;
    }
    other->lock = PyThread_allocate_lock();
    if (other->lock == NULL) {
        Py_DECREF(other);
        return PyErr_NoMemory();
    }
    PyThread_acquire_lock(self->lock, 1);
    other->st = self->st;
    PyThread_release_lock(self->lock);
    return (PyObject *)other;
}

static PyObject *Wyhash_total(WyhashObject *self, void *Py_UNUSED(closure)) {
    return PyLong_FromUnsignedLongLong(self->st.total_len);
}

static PyMethodDef Wyhash_methods[] = {
    {"update", (PyCFunction)Wyhash_update, METH_O, "Feed more bytes (any buffer)."},
    {"intdigest", (PyCFunction)Wyhash_intdigest, METH_NOARGS,
     "The u64 hash of everything fed so far (the state is unchanged)."},
    {"copy", (PyCFunction)Wyhash_copy, METH_NOARGS, "An independent copy of the state."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Wyhash_getset[] = {
    {"total_len", (getter)Wyhash_total, NULL, "Bytes fed so far.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject WyhashType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvstore._wyhash.Wyhash",
    .tp_basicsize = sizeof(WyhashObject),
    .tp_dealloc = (destructor)Wyhash_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Streaming Zig std.hash.Wyhash: Wyhash(data=None, seed=0).",
    .tp_methods = Wyhash_methods,
    .tp_getset = Wyhash_getset,
    .tp_init = (initproc)Wyhash_init,
    .tp_new = PyType_GenericNew,
};

static PyMethodDef module_methods[] = {
    {"hash", (PyCFunction)(void (*)(void))py_hash, METH_VARARGS | METH_KEYWORDS,
     "hash(data, seed=0) -> int: Zig std.hash.Wyhash of a contiguous buffer."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef wyhash_module = {
    PyModuleDef_HEAD_INIT, "kvstore._wyhash",
    "Zig std.hash.Wyhash (Bun.hash), one-shot and streaming.", -1, module_methods,
};

PyMODINIT_FUNC PyInit__wyhash(void) {
    if (PyType_Ready(&WyhashType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&wyhash_module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&WyhashType);
    if (PyModule_AddObject(m, "Wyhash", (PyObject *)&WyhashType) < 0) {
        Py_DECREF(&WyhashType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
