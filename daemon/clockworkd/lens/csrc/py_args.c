/* Arguments from Python that the probe sender needs checked (see py_args.h). */
#include "py_args.h"

int tag_key(tag_state *s, const char *key, Py_ssize_t keylen) {
    if (tag_init(s, (const uint8_t *)key, (size_t)keylen, TAG) != 0) {
        PyErr_Format(PyExc_ValueError, "tag key must be 1 to 64 bytes, not %zd", keylen);
        return -1;
    }
    return 0;
}

int key_arg(key_set *k, const char *key, Py_ssize_t keylen) {
    if (key_set_init(k, (const uint8_t *)key, (size_t)keylen, TAG) != 0) {
        PyErr_Format(PyExc_ValueError, "tag key must be 1 to 64 bytes or a table of N x %d bytes, not %zd",
                     KEY_SLOTS * KEY_BYTES, keylen);
        return -1;
    }
    return 0;
}

int64_t *i64_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t count, int writable, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) != 0) return NULL;
    if (view->len % 8 != 0 || view->len / 8 < count) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes where %zd int64 values are needed", name, view->len, count);
        PyBuffer_Release(view);
        return NULL;
    }
    return (int64_t *)view->buf;
}

void release_buffers(Py_buffer *views, int count) {
    for (int i = 0; i < count; i++) PyBuffer_Release(&views[i]);
}

int paths_from_buffers(PyObject *const objs[PATH_BUFFERS], Py_buffer views[PATH_BUFFERS], probe_paths *p) {
    int held = 0;
    if (!(p->seq = i64_buffer(objs[0], &views[0], 0, 1, "seq"))) return -1;
    held = 1;
    p->paths = views[0].len / 8;
    if (!(p->dst_node = i64_buffer(objs[1], &views[1], p->paths, 0, "dst_node"))) goto fail;
    held++;
    if (!(p->dst_nic = i64_buffer(objs[2], &views[2], p->paths, 0, "dst_nic"))) goto fail;
    held++;
    if (PyObject_GetBuffer(objs[3], &views[3], PyBUF_C_CONTIGUOUS) != 0) goto fail;
    held++;
    if (views[3].len < p->paths * 16) {
        PyErr_Format(PyExc_ValueError, "addrs: %zd bytes for %zd paths", views[3].len, p->paths);
        goto fail;
    }
    p->addrs = views[3].buf;
    if (!(p->ring_seq = i64_buffer(objs[4], &views[4], p->paths, 1, "ring_seq"))) goto fail;
    held++;
    p->ring = p->paths ? views[4].len / 8 / p->paths : 1;
    if (p->ring < 1) p->ring = 1;
    if (!(p->ring_tx = i64_buffer(objs[5], &views[5], p->paths * p->ring, 1, "ring_tx"))) goto fail;
    held++;
    if (!(p->rev = i64_buffer(objs[6], &views[6], p->paths, 0, "rev"))) goto fail;
    return 0;
fail:
    release_buffers(views, held);
    return -1;
}

int echoes_from_buffers(PyObject *const objs[ECHO_BUFFERS], Py_buffer views[ECHO_BUFFERS], probe_echoes *e,
                        int writable) {
    if (!(e->seq = i64_buffer(objs[0], &views[0], 0, writable, "echo_seq"))) return -1;
    e->count = views[0].len / 8;
    if (!(e->rx = i64_buffer(objs[1], &views[1], e->count, writable, "echo_rx"))) {
        PyBuffer_Release(&views[0]);
        return -1;
    }
    return 0;
}
