/* kvmesh.runtime._otlpc: the OTLP span encoder of kvmesh.runtime.otlp, compiled, and the span
 * building of Tracer.record.
 *
 * `encode_request(resource, scope, records)` returns the same bytes as the pure-Python
 * `kvmesh.runtime.otlp.encode_request_python` (tests/unit/test_otlp.py checks the two byte for
 * byte, and both against the OpenTelemetry SDK's encoder): an ExportTraceServiceRequest of one
 * resource and one scope, in protobuf's wire format, fields in the same order. It runs on the
 * batch span processor's thread. In Python, encoding a gateway request's three spans took
 * ~10 us, more than recording them on the request path; here ~1.3 us.
 *
 * A record is an ended span or a list of them (kvmesh.runtime.otlp.SpanGroup). A span is read
 * by position when it is a tuple of 9 (kvmesh.runtime.otlp.FinishedSpan: name, context,
 * parent, remote_parent, kind, start_ns, end_ns, attributes, error_message), else by attribute
 * name (kvmesh.runtime.otlp.EndedSpan). A context is a TraceContext (trace_id, span_id, flags,
 * tracestate), read by position when it is a tuple, else by name.
 *
 * On the request path, `record_spans` builds the spans of kvmesh.runtime.telemetry.Tracer.record
 * (the same tuples as its Python loop, which tests/unit/test_otlp.py compares; span ids from a
 * generator of its own, `span_id`, seeded by kvmesh.runtime.otlp through `seed`).
 *
 * Built by hatch_build.py when kvmesh is installed (a C compiler and Python's headers are
 * needed; without them kvmesh uses the Python encoder). Plain CPython C API, no other library.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#ifndef KVMESH_OTLPC_SOURCE
#define KVMESH_OTLPC_SOURCE ""
#endif

typedef struct {
    char *data;
    Py_ssize_t len;
    Py_ssize_t cap;
} Buf;

static int buf_reserve(Buf *b, Py_ssize_t extra) {
    if (b->len + extra <= b->cap) return 0;
    Py_ssize_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + extra) cap *= 2;
    char *data = PyMem_Realloc(b->data, (size_t)cap);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = data;
    b->cap = cap;
    return 0;
}

static int put(Buf *b, const void *src, Py_ssize_t n) {
    if (buf_reserve(b, n) < 0) return -1;
    memcpy(b->data + b->len, src, (size_t)n);
    b->len += n;
    return 0;
}

static int put_byte(Buf *b, unsigned char c) {
    if (buf_reserve(b, 1) < 0) return -1;
    b->data[b->len++] = (char)c;
    return 0;
}

static int varint_size(uint64_t v) {
    int n = 1;
    while (v > 0x7F) {
        v >>= 7;
        n++;
    }
    return n;
}

static void write_varint(char *out, uint64_t v) {
    while (v > 0x7F) {
        *out++ = (char)((v & 0x7F) | 0x80);
        v >>= 7;
    }
    *out = (char)v;
}

static int put_varint(Buf *b, uint64_t v) {
    if (buf_reserve(b, 10) < 0) return -1;
    write_varint(b->data + b->len, v);
    b->len += varint_size(v);
    return 0;
}

static int put_fixed64(Buf *b, uint64_t v) {
    if (buf_reserve(b, 8) < 0) return -1;
    unsigned char *out = (unsigned char *)b->data + b->len;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(out, &v, 8);
#else
    for (int i = 0; i < 8; i++) out[i] = (unsigned char)(v >> (8 * i));
#endif
    b->len += 8;
    return 0;
}

/* A length-delimited field whose length is known once its payload is written: `open_field`
 * writes the tag and one byte for the length and returns where the payload starts;
 * `close_field` writes the length there, moving the payload when it needs more bytes. */
static Py_ssize_t open_field(Buf *b, unsigned char tag) {
    if (buf_reserve(b, 2) < 0) return -1;
    b->data[b->len++] = (char)tag;
    b->len++;
    return b->len;
}

static int close_field(Buf *b, Py_ssize_t start) {
    uint64_t n = (uint64_t)(b->len - start);
    int size = varint_size(n);
    if (size > 1) {
        if (buf_reserve(b, size - 1) < 0) return -1;
        memmove(b->data + start + size - 1, b->data + start, (size_t)n);
        b->len += size - 1;
    }
    write_varint(b->data + start - 1, n);
    return 0;
}

static int put_bytes_field(Buf *b, unsigned char tag, const char *s, Py_ssize_t n) {
    if (put_byte(b, tag) < 0 || put_varint(b, (uint64_t)n) < 0) return -1;
    return put(b, s, n);
}

static int put_str_field(Buf *b, unsigned char tag, PyObject *s) {
    Py_ssize_t n;
    const char *utf8 = PyUnicode_AsUTF8AndSize(s, &n);
    if (utf8 == NULL) return -1;
    return put_bytes_field(b, tag, utf8, n);
}

static signed char HEX[256]; /* a hex digit's value, -1 for any other byte (module init) */

/* A hex id (`nbytes` bytes) as the payload of a field with the two-byte head `head`. */
static int put_id(Buf *b, const char head[2], PyObject *hex, Py_ssize_t nbytes) {
    if (!PyUnicode_Check(hex) || !PyUnicode_IS_COMPACT_ASCII(hex) ||
        PyUnicode_GET_LENGTH(hex) != 2 * nbytes) {
        PyErr_Format(PyExc_ValueError, "a span id must be %zd hex digits, not %R", 2 * nbytes,
                     hex);
        return -1;
    }
    if (buf_reserve(b, 2 + nbytes) < 0) return -1;
    char *out = b->data + b->len;
    const unsigned char *digits = PyUnicode_1BYTE_DATA(hex);
    out[0] = head[0];
    out[1] = head[1];
    int bad = 0;
    for (Py_ssize_t i = 0; i < nbytes; i++) {
        int hi = HEX[digits[2 * i]], lo = HEX[digits[2 * i + 1]];
        bad |= hi | lo; /* negative if either is not a hex digit */
        out[2 + i] = (char)(((unsigned)hi << 4) | (unsigned)lo);
    }
    if (bad < 0) {
        PyErr_Format(PyExc_ValueError, "a span id must be hex digits, not %R", hex);
        return -1;
    }
    b->len += 2 + nbytes;
    return 0;
}

/* Tags: (field number << 3) | wire type (0 varint, 1 fixed64, 2 length-delimited). */
enum {
    ANY_STRING = 0x0a, ANY_BOOL = 0x10, ANY_INT = 0x18, ANY_DOUBLE = 0x21, ANY_ARRAY = 0x2a,
    ARRAY_VALUE = 0x0a, KV_KEY = 0x0a, KV_VALUE = 0x12,
    SPAN_TRACE_STATE = 0x1a, SPAN_NAME = 0x2a, SPAN_KIND = 0x30, SPAN_START = 0x39,
    SPAN_END = 0x41, SPAN_ATTRIBUTE = 0x4a, SPAN_STATUS = 0x7a,
    STATUS_MESSAGE = 0x12, STATUS_CODE = 0x18, STATUS_CODE_ERROR = 2,
    SCOPE_SPANS_SCOPE = 0x0a, SCOPE_SPANS_SPAN = 0x12,
    RESOURCE_SPANS_RESOURCE = 0x0a, RESOURCE_SPANS_SCOPE_SPANS = 0x12,
    REQUEST_RESOURCE_SPANS = 0x0a,
};
/* SpanFlags: bit 8, the parent's remoteness is known; bit 9, the parent is remote. */
#define HAS_IS_REMOTE 0x100u
#define IS_REMOTE 0x200u

/* An AnyValue's payload, as otlp._any writes it: str, bool, int (two's complement, 64 bits),
 * float, list or tuple (an ArrayValue), anything else as its str(). */
static int put_any(Buf *b, PyObject *value, int depth) {
    if (PyUnicode_Check(value)) return put_str_field(b, ANY_STRING, value);
    if (PyBool_Check(value)) {
        unsigned char bytes[2] = {ANY_BOOL, value == Py_True ? 1 : 0};
        return put(b, bytes, 2);
    }
    if (PyLong_Check(value)) {
        unsigned long long v = PyLong_AsUnsignedLongLongMask(value);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
        if (put_byte(b, ANY_INT) < 0) return -1;
        return put_varint(b, (uint64_t)v);
    }
    if (PyFloat_Check(value)) {
        double d = PyFloat_AS_DOUBLE(value);
        uint64_t bits;
        memcpy(&bits, &d, 8);
        if (put_byte(b, ANY_DOUBLE) < 0) return -1;
        return put_fixed64(b, bits);
    }
    if (PyList_Check(value) || PyTuple_Check(value)) {
        if (depth > 32) {
            PyErr_SetString(PyExc_ValueError, "span attribute nested too deep");
            return -1;
        }
        PyObject *seq = PySequence_Fast(value, "a sequence");
        if (seq == NULL) return -1;
        Py_ssize_t array = open_field(b, ANY_ARRAY);
        int rc = array < 0 ? -1 : 0;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        for (Py_ssize_t i = 0; rc == 0 && i < n; i++) {
            Py_ssize_t item = open_field(b, ARRAY_VALUE);
            rc = item < 0 ? -1 : put_any(b, PySequence_Fast_GET_ITEM(seq, i), depth + 1);
            if (rc == 0) rc = close_field(b, item);
        }
        if (rc == 0) rc = close_field(b, array);
        Py_DECREF(seq);
        return rc;
    }
    PyObject *text = PyObject_Str(value);
    if (text == NULL) return -1;
    int rc = put_str_field(b, ANY_STRING, text);
    Py_DECREF(text);
    return rc;
}

static int put_attribute(Buf *b, unsigned char tag, PyObject *key, PyObject *value) {
    if (!PyUnicode_Check(key)) {
        PyErr_Format(PyExc_TypeError, "a span attribute's key must be a str, not %R", key);
        return -1;
    }
    Py_ssize_t kv = open_field(b, tag);
    if (kv < 0 || put_str_field(b, KV_KEY, key) < 0) return -1;
    Py_ssize_t any = open_field(b, KV_VALUE);
    if (any < 0 || put_any(b, value, 0) < 0 || close_field(b, any) < 0) return -1;
    return close_field(b, kv);
}

static int put_attributes(Buf *b, unsigned char tag, PyObject *attributes) {
    if (PyDict_Check(attributes)) {
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        while (PyDict_Next(attributes, &pos, &key, &value)) {
            if (put_attribute(b, tag, key, value) < 0) return -1;
        }
        return 0;
    }
    PyObject *items = PyMapping_Items(attributes);
    if (items == NULL) return -1;
    int rc = 0;
    for (Py_ssize_t i = 0; rc == 0 && i < PyList_GET_SIZE(items); i++) {
        PyObject *pair = PyList_GET_ITEM(items, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "span attributes must be a mapping");
            rc = -1;
        } else {
            rc = put_attribute(b, tag, PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1));
        }
    }
    Py_DECREF(items);
    return rc;
}

/* Interned names, for spans and contexts that are not tuples. */
enum { F_NAME, F_CONTEXT, F_PARENT, F_REMOTE, F_KIND, F_START, F_END, F_ATTRS, F_ERROR, NSPAN };
static const char *SPAN_FIELDS[NSPAN] = {"name", "context", "parent", "remote_parent", "kind",
                                         "start_ns", "end_ns", "attributes", "error_message"};
static PyObject *span_names[NSPAN];
enum { C_TRACE, C_SPAN, C_FLAGS, C_STATE, NCTX };
static const char *CONTEXT_FIELDS[NCTX] = {"trace_id", "span_id", "flags", "tracestate"};
static PyObject *context_names[NCTX];

/* `out[i]` = field i of `obj` (new references): by position from a tuple of at least `n`,
 * else by attribute name. */
static int fields_of(PyObject *obj, PyObject **names, Py_ssize_t n, PyObject **out) {
    if (PyTuple_Check(obj) && PyTuple_GET_SIZE(obj) >= n) {
        for (Py_ssize_t i = 0; i < n; i++) out[i] = Py_NewRef(PyTuple_GET_ITEM(obj, i));
        return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = PyObject_GetAttr(obj, names[i]);
        if (out[i] == NULL) {
            for (Py_ssize_t j = 0; j < i; j++) Py_DECREF(out[j]);
            return -1;
        }
    }
    return 0;
}

static void release(PyObject **objs, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) Py_XDECREF(objs[i]);
}

/* One Span message's payload, fields in otlp._span's order. */
static int put_span(Buf *b, PyObject *span) {
    PyObject *f[NSPAN], *ctx[NCTX], *parent[NCTX];
    int rc = -1, have_parent = 0;
    memset(ctx, 0, sizeof ctx);
    memset(parent, 0, sizeof parent);
    if (fields_of(span, span_names, NSPAN, f) < 0) return -1;
    if (fields_of(f[F_CONTEXT], context_names, NCTX, ctx) < 0) goto done;
    if (f[F_PARENT] != Py_None) {
        if (fields_of(f[F_PARENT], context_names, NCTX, parent) < 0) goto done;
        have_parent = 1;
    }
    static const char trace_head[2] = {0x0a, 0x10}, span_head[2] = {0x12, 0x08},
                      parent_head[2] = {0x22, 0x08};
    if (put_id(b, trace_head, ctx[C_TRACE], 16) < 0 || put_id(b, span_head, ctx[C_SPAN], 8) < 0)
        goto done;
    if (have_parent && put_id(b, parent_head, parent[C_SPAN], 8) < 0) goto done;
    if (!PyUnicode_Check(f[F_NAME])) {
        PyErr_Format(PyExc_TypeError, "a span's name must be a str, not %R", f[F_NAME]);
        goto done;
    }
    if (put_str_field(b, SPAN_NAME, f[F_NAME]) < 0) goto done;
    long kind = PyLong_AsLong(f[F_KIND]);
    if (kind == -1 && PyErr_Occurred()) goto done;
    if (kind < 0 || kind > 2) {
        PyErr_Format(PyExc_ValueError, "span kind %ld (kvmesh records 0, 1 or 2)", kind);
        goto done;
    }
    if (put_byte(b, SPAN_KIND) < 0 || put_byte(b, (unsigned char)(kind + 1)) < 0) goto done;
    unsigned long long start = PyLong_AsUnsignedLongLongMask(f[F_START]);
    if (start == (unsigned long long)-1 && PyErr_Occurred()) goto done;
    unsigned long long end = PyLong_AsUnsignedLongLongMask(f[F_END]);
    if (end == (unsigned long long)-1 && PyErr_Occurred()) goto done;
    if (put_byte(b, SPAN_START) < 0 || put_fixed64(b, start) < 0) goto done;
    if (put_byte(b, SPAN_END) < 0 || put_fixed64(b, end) < 0) goto done;
    PyObject *state = ctx[C_STATE];
    if (!PyUnicode_Check(state)) {
        PyErr_Format(PyExc_TypeError, "a tracestate must be a str, not %R", state);
        goto done;
    }
    if (PyUnicode_GET_LENGTH(state) > 0 && put_str_field(b, SPAN_TRACE_STATE, state) < 0)
        goto done;
    if (put_attributes(b, SPAN_ATTRIBUTE, f[F_ATTRS]) < 0) goto done;
    PyObject *error = f[F_ERROR];
    if (error == Py_None) {
        if (put_byte(b, SPAN_STATUS) < 0 || put_byte(b, 0) < 0) goto done;
    } else {
        if (!PyUnicode_Check(error)) {
            PyErr_Format(PyExc_TypeError, "a span's error message must be a str, not %R", error);
            goto done;
        }
        Py_ssize_t status = open_field(b, SPAN_STATUS);
        if (status < 0) goto done;
        if (PyUnicode_GET_LENGTH(error) > 0 && put_str_field(b, STATUS_MESSAGE, error) < 0)
            goto done;
        if (put_byte(b, STATUS_CODE) < 0 || put_byte(b, STATUS_CODE_ERROR) < 0) goto done;
        if (close_field(b, status) < 0) goto done;
    }
    int remote = 0;
    if (have_parent) {
        remote = PyObject_IsTrue(f[F_REMOTE]);
        if (remote < 0) goto done;
    }
    uint32_t flags = HAS_IS_REMOTE | (remote ? IS_REMOTE : 0);
    unsigned char flag_bytes[6] = {0x85, 0x01, (unsigned char)flags, (unsigned char)(flags >> 8),
                                   0, 0};
    rc = put(b, flag_bytes, 6);
done:
    release(f, NSPAN);
    release(ctx, NCTX);
    release(parent, NCTX);
    return rc;
}

static int put_record(Buf *b, PyObject *span) {
    Py_ssize_t field = open_field(b, SCOPE_SPANS_SPAN);
    if (field < 0 || put_span(b, span) < 0) return -1;
    return close_field(b, field);
}

/* The request's two outer heads (ResourceSpans and ScopeSpans: a tag and a length each) and
 * the resource and scope fields come before the spans, but their lengths are known only after
 * them: the spans are written after room for all of that, which is filled in backwards at the
 * end (no copy of the spans to make room). */
static PyObject *encode_request(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "encode_request(resource, scope, records)");
        return NULL;
    }
    Py_buffer resource, scope;
    if (PyObject_GetBuffer(args[0], &resource, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &scope, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&resource);
        return NULL;
    }
    PyObject *records = PySequence_Fast(args[2], "records must be a sequence");
    PyObject *result = NULL;
    Buf b = {NULL, 0, 0};
    if (records == NULL) goto done;
    Py_ssize_t resource_field = 1 + varint_size((uint64_t)resource.len) + resource.len;
    Py_ssize_t scope_field = 1 + varint_size((uint64_t)scope.len) + scope.len;
    Py_ssize_t room = 11 + resource_field + 11 + scope_field; /* heads: tag + up to 10 */
    Py_ssize_t n = PySequence_Fast_GET_SIZE(records);
    if (buf_reserve(&b, room + 256 * n) < 0) goto done;
    b.len = room;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(records, i);
        if (PyList_Check(item)) { /* a SpanGroup */
            for (Py_ssize_t j = 0; j < PyList_GET_SIZE(item); j++) {
                if (put_record(&b, PyList_GET_ITEM(item, j)) < 0) goto done;
            }
        } else if (put_record(&b, item) < 0) {
            goto done;
        }
    }
    uint64_t scope_spans = (uint64_t)(scope_field + b.len - room);
    uint64_t resource_spans =
        (uint64_t)resource_field + 1 + (uint64_t)varint_size(scope_spans) + scope_spans;
    Py_ssize_t at = room - scope_field;
    char *data = b.data;
    data[at] = SCOPE_SPANS_SCOPE;
    write_varint(data + at + 1, (uint64_t)scope.len);
    memcpy(data + room - scope.len, scope.buf, (size_t)scope.len);
    at -= varint_size(scope_spans);
    write_varint(data + at, scope_spans);
    data[--at] = RESOURCE_SPANS_SCOPE_SPANS;
    at -= resource_field;
    data[at] = RESOURCE_SPANS_RESOURCE;
    write_varint(data + at + 1, (uint64_t)resource.len);
    memcpy(data + at + resource_field - resource.len, resource.buf, (size_t)resource.len);
    at -= varint_size(resource_spans);
    write_varint(data + at, resource_spans);
    data[--at] = REQUEST_RESOURCE_SPANS;
    result = PyBytes_FromStringAndSize(data + at, b.len - at);
done:
    PyMem_Free(b.data);
    Py_XDECREF(records);
    PyBuffer_Release(&resource);
    PyBuffer_Release(&scope);
    return result;
}

/* --- the request path: the spans of Tracer.record, built here ------------------------------- */

/* Span ids: xoshiro256** (https://prng.di.unimi.it/), seeded from os.urandom by
 * kvmesh.runtime.otlp at import and again in a forked child (`seed`). Ids must be unique and
 * random, not secret: the OpenTelemetry SDK uses Python's Mersenne Twister for them. */
static uint64_t rng[4] = {0x9e3779b97f4a7c15ull, 0xbf58476d1ce4e5b9ull, 0x94d049bb133111ebull,
                          0x2545f4914f6cdd1dull};

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t next_u64(void) {
    uint64_t result = rotl(rng[1] * 5, 7) * 9, t = rng[1] << 17;
    rng[2] ^= rng[0];
    rng[3] ^= rng[1];
    rng[1] ^= rng[2];
    rng[0] ^= rng[3];
    rng[2] ^= t;
    rng[3] = rotl(rng[3], 45);
    return result;
}

static PyObject *seed(PyObject *module, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    if (view.len != (Py_ssize_t)sizeof(rng)) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "seed takes %zu bytes", sizeof(rng));
        return NULL;
    }
    memcpy(rng, view.buf, sizeof(rng));
    PyBuffer_Release(&view);
    if (!(rng[0] | rng[1] | rng[2] | rng[3])) rng[0] = 1; /* the one state it must not have */
    Py_RETURN_NONE;
}

static PyObject *new_span_id_str(void) {
    uint64_t v = next_u64();
    if (v == 0) v = 1; /* all zero is invalid */
    PyObject *s = PyUnicode_New(16, 127);
    if (s == NULL) return NULL;
    Py_UCS1 *out = PyUnicode_1BYTE_DATA(s);
    static const char digits[] = "0123456789abcdef";
    for (int i = 15; i >= 0; i--, v >>= 4) out[i] = (Py_UCS1)digits[v & 15];
    return s;
}

static PyObject *span_id(PyObject *module, PyObject *unused) { return new_span_id_str(); }

/* A `type` (a subclass of tuple with no instance dict: a NamedTuple) holding the `n` items,
 * references stolen; NULL (and the references released) on failure. */
static PyObject *new_tuple_of(PyTypeObject *type, PyObject **items, Py_ssize_t n) {
    PyObject *t = type->tp_alloc(type, n);
    if (t == NULL) {
        for (Py_ssize_t i = 0; i < n; i++) Py_XDECREF(items[i]);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(t, i, items[i]);
    return t;
}

/* record_spans(context_type, span_type, parent, steps, flags, remote) -> list: the spans of
 * kvmesh.runtime.telemetry.Tracer.record, as its Python loop builds them (which is used where
 * this module is not built): per step (name, start_ns, end_ns, attributes, error), a
 * span_type (FinishedSpan) of (name, context, parent, remote, 0, start_ns, end_ns, attributes,
 * message), its context a context_type (TraceContext) of (parent's trace id, a new span id,
 * flags, parent's tracestate); a failed step's error (type, message) sets the attribute
 * error.type and the message (the type when empty). */
static PyObject *record_spans(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "record_spans takes 6 arguments");
        return NULL;
    }
    PyTypeObject *ctx_type = (PyTypeObject *)args[0], *span_type = (PyTypeObject *)args[1];
    PyObject *parent = args[2], *steps = args[3], *flags = args[4], *remote = args[5];
    if (!PyType_Check(args[0]) || !PyType_Check(args[1]) ||
        !PyType_IsSubtype(ctx_type, &PyTuple_Type) ||
        !PyType_IsSubtype(span_type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "record_spans: the context and span types are tuples");
        return NULL;
    }
    if (!PyTuple_Check(parent) || PyTuple_GET_SIZE(parent) != 4) {
        PyErr_SetString(PyExc_TypeError, "record_spans: the parent is a TraceContext");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(steps, "record_spans: steps is a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **step_items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    PyObject *trace_id = PyTuple_GET_ITEM(parent, 0), *tracestate = PyTuple_GET_ITEM(parent, 3);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *step = step_items[i];
        if (!PyTuple_Check(step) || PyTuple_GET_SIZE(step) != 5) {
            PyErr_SetString(PyExc_TypeError,
                            "record_spans: a step is (name, start_ns, end_ns, attributes, error)");
            goto fail;
        }
        PyObject *attributes = PyTuple_GET_ITEM(step, 3), *error = PyTuple_GET_ITEM(step, 4);
        PyObject *message = Py_None;
        Py_INCREF(message);
        if (error != Py_None) {
            if (!PyTuple_Check(error) || PyTuple_GET_SIZE(error) != 2 || !PyDict_Check(attributes)) {
                Py_DECREF(message);
                PyErr_SetString(PyExc_TypeError,
                                "record_spans: a step's error is (type, message), its attributes "
                                "a dict");
                goto fail;
            }
            PyObject *kind = PyTuple_GET_ITEM(error, 0), *text = PyTuple_GET_ITEM(error, 1);
            if (PyDict_SetItemString(attributes, "error.type", kind) < 0) {
                Py_DECREF(message);
                goto fail;
            }
            int truthy = PyObject_IsTrue(text);
            if (truthy < 0) {
                Py_DECREF(message);
                goto fail;
            }
            Py_SETREF(message, Py_NewRef(truthy ? text : kind));
        }
        PyObject *ctx_items[4] = {Py_NewRef(trace_id), new_span_id_str(), Py_NewRef(flags),
                                  Py_NewRef(tracestate)};
        if (ctx_items[1] == NULL) {
            Py_DECREF(ctx_items[0]);
            Py_DECREF(ctx_items[2]);
            Py_DECREF(ctx_items[3]);
            Py_DECREF(message);
            goto fail;
        }
        PyObject *context = new_tuple_of(ctx_type, ctx_items, 4);
        if (context == NULL) {
            Py_DECREF(message);
            goto fail;
        }
        PyObject *span_items[9] = {
            Py_NewRef(PyTuple_GET_ITEM(step, 0)), context, Py_NewRef(parent), Py_NewRef(remote),
            PyLong_FromLong(0), Py_NewRef(PyTuple_GET_ITEM(step, 1)),
            Py_NewRef(PyTuple_GET_ITEM(step, 2)), Py_NewRef(attributes), message,
        };
        if (span_items[4] == NULL) {
            for (int k = 0; k < 9; k++) Py_XDECREF(span_items[k]);
            goto fail;
        }
        PyObject *span = new_tuple_of(span_type, span_items, 9);
        if (span == NULL) goto fail;
        PyList_SET_ITEM(out, i, span);
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_DECREF(seq);
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"encode_request", (PyCFunction)(void (*)(void))encode_request, METH_FASTCALL,
     "encode_request(resource, scope, records) -> bytes: an ExportTraceServiceRequest, the same "
     "bytes as kvmesh.runtime.otlp's Python encoder."},
    {"record_spans", (PyCFunction)(void (*)(void))record_spans, METH_FASTCALL,
     "record_spans(context_type, span_type, parent, steps, flags, remote) -> list: the spans "
     "kvmesh.runtime.telemetry.Tracer.record queues."},
    {"span_id", span_id, METH_NOARGS, "span_id() -> str: a new span id (16 hex digits)."},
    {"seed", seed, METH_O, "seed(bytes of 32): seeds the span id generator."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "kvmesh.runtime._otlpc",
    "kvmesh.runtime.otlp's span encoder, compiled (see _otlpc.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__otlpc(void) {
    for (int c = 0; c < 256; c++) {
        HEX[c] = (signed char)(c >= '0' && c <= '9'   ? c - '0'
                               : c >= 'a' && c <= 'f' ? c - 'a' + 10
                               : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                                      : -1);
    }
    for (int i = 0; i < NSPAN; i++) {
        span_names[i] = PyUnicode_InternFromString(SPAN_FIELDS[i]);
        if (span_names[i] == NULL) return NULL;
    }
    for (int i = 0; i < NCTX; i++) {
        context_names[i] = PyUnicode_InternFromString(CONTEXT_FIELDS[i]);
        if (context_names[i] == NULL) return NULL;
    }
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) return NULL;
    if (PyModule_AddStringConstant(module, "SOURCE", KVMESH_OTLPC_SOURCE) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
