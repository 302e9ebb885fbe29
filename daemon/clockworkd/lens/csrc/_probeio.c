/* clockworkd.lens._probeio: Fleet Lens's per-packet work in C (see the Python docstring below).
 *
 * Why: at a 10 ms interval with 16 peers per NIC a node sends and receives ~3,300 probes a second.
 * Building, tagging (keyed BLAKE2b) and parsing them in Python cost ~6 % of a core; here the pacer
 * thread (pacer.c) sends each NIC's whole batch per tick (sendmmsg, built in probe_send.c), and one call
 * per drain reads, authenticates and parses everything waiting (recvmmsg) into a preallocated array of
 * int64 records that numpy reads in one go. ``send_probes`` is the pacer's tick as one call (what the
 * tests check byte for byte). The wire format is the one wire.py defines (wire.py stays the Python
 * reference the tests check this module against). Linux only. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <netinet/in.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "tag.h"
#include "pacer.h"
#include "probe_send.h"
#include "py_args.h"
#include "records.h"

#define TRAIN_SLOT 9000
#define RECV_BATCH 64
#define RECV_SLOT 8192
#define CONTROL 64

static send_buf sends; /* the module's functions run with the GIL held: one buffer serves them all */
static uint8_t train_data[SEND_BATCH][TRAIN_SLOT];

static uint8_t recv_data[RECV_BATCH][RECV_SLOT];
static uint8_t recv_control[RECV_BATCH][CONTROL];
static struct sockaddr_in recv_names[RECV_BATCH];
static struct iovec recv_iov[RECV_BATCH];
static struct mmsghdr recv_hdrs[RECV_BATCH];

static inline uint16_t get16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline int64_t get64(const uint8_t *p) { int64_t v; memcpy(&v, p, 8); return v; }

static PyObject *send_prepared(int fd, unsigned count) {
    int err;
    unsigned done = send_slots(&sends, fd, count, &err);
    return Py_BuildValue("(Ii)", done, err);
}

PyDoc_STRVAR(tag_doc, "tag(key, data) -> bytes: the 8-byte keyed BLAKE2b tag (= wire.tag).");

static PyObject *py_tag(PyObject *self, PyObject *args) {
    const char *key;
    Py_ssize_t keylen;
    Py_buffer data;
    tag_state s;
    uint8_t out[TAG];
    (void)self;
    if (!PyArg_ParseTuple(args, "y#y*", &key, &keylen, &data)) return NULL;
    if (tag_key(&s, key, keylen) != 0 || data.len == 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "nothing to tag");
        PyBuffer_Release(&data);
        return NULL;
    }
    tag_of(&s, data.buf, (size_t)data.len, out);
    PyBuffer_Release(&data);
    return PyBytes_FromStringAndSize((const char *)out, TAG);
}

PyDoc_STRVAR(send_probes_doc,
             "send_probes(fd, key, src_node, src_nic, session, tx_ns, pair, seq, dst_node, dst_nic, addrs,\n"
             "            ring_seq, ring_tx, rev, echo_seq, echo_rx) -> (sent, errno)\n\n"
             "One probe to each of P paths in one sendmmsg; path ``pair`` (-1: none) gets a coded pair instead,\n"
             "sent first. Per path (int64 arrays of P): ``seq`` (advanced here), ``dst_node``/``dst_nic``,\n"
             "``rev`` (index into ``echo_seq``/``echo_rx``: the reverse path's newest probe, -1: none); ``addrs``:\n"
             "P sockaddr_in (16 bytes each); ``ring_seq``/``ring_tx``: P rows of R transmit records (seq % R).");

static PyObject *py_send_probes(PyObject *self, PyObject *args) {
    int fd, pair;
    const char *key;
    Py_ssize_t keylen;
    long src_node, src_nic;
    unsigned long long session;
    long long tx;
    PyObject *o[PATH_BUFFERS + ECHO_BUFFERS];
    Py_buffer b[PATH_BUFFERS + ECHO_BUFFERS];
    probe_paths p;
    probe_echoes e;
    key_set s;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy#llKLiOOOOOOOOO", &fd, &key, &keylen, &src_node, &src_nic, &session, &tx, &pair,
                          &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7], &o[8]))
        return NULL;
    if (key_arg(&s, key, keylen) != 0 || paths_from_buffers(o, b, &p) != 0) return NULL;
    if (echoes_from_buffers(o + PATH_BUFFERS, b + PATH_BUFFERS, &e, 0) != 0) {
        release_buffers(b, PATH_BUFFERS);
        return NULL;
    }
    int err;
    unsigned sent = send_probe_batch(&sends, fd, &s, src_node, src_nic, (uint32_t)session, tx, pair, &p, &e, &err);
    release_buffers(b, PATH_BUFFERS + ECHO_BUFFERS);
    return Py_BuildValue("(Ii)", sent, err);
}

PyDoc_STRVAR(send_train_doc,
             "send_train(fd, key, src_node, src_nic, dst_node, dst_nic, addr, seq, tx_ns, session, first, n, total,\n"
             "           size) -> (sent, errno): packets ``first`` .. ``first + n - 1`` (n <= MAX_TRAIN) of a train of\n"
             "``total`` packets of ``size`` bytes each (header, tag, zero padding).");

static PyObject *py_send_train(PyObject *self, PyObject *args) {
    int fd, first, count, total, size;
    const char *key, *addr;
    Py_ssize_t keylen, addrlen;
    long src_node, src_nic, dst_node, dst_nic;
    unsigned long long seq, session;
    long long tx;
    key_set s;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy#lllly#KLKiiii", &fd, &key, &keylen, &src_node, &src_nic, &dst_node, &dst_nic,
                          &addr, &addrlen, &seq, &tx, &session, &first, &count, &total, &size))
        return NULL;
    if (key_arg(&s, key, keylen) != 0) return NULL;
    if (addrlen != (Py_ssize_t)sizeof(struct sockaddr_in) || count < 1 || count > SEND_BATCH || first < 0 ||
        total > 0xFFFF || first + count > total || size < PROBE_BYTES || size > TRAIN_SLOT) {
        PyErr_Format(PyExc_ValueError, "send_train: bad address length %zd, packets %d+%d of %d or size %d", addrlen,
                     first, count, total, size);
        return NULL;
    }
    for (int i = 0; i < count; i++) {
        uint8_t *p = train_data[i];
        memset(p + PROBE_BYTES, 0, (size_t)size - PROBE_BYTES);
        probe_header(p, KIND_TRAIN, 0, src_node, src_nic, dst_node, dst_nic, (uint32_t)seq, tx, (uint32_t)session,
               ((uint32_t)(first + i) << 16) | (uint32_t)total, 0, (uint32_t)NO_ECHO);
        if (key_set_tag(&s, dst_node, 0, p, HEADER, p + HEADER) != 1) {
            PyErr_Format(PyExc_ValueError, "send_train: no key for node %ld", dst_node);
            return NULL;
        }
        send_slot(&sends, (unsigned)i, p, (size_t)size, (const uint8_t *)addr);
    }
    return send_prepared(fd, (unsigned)count);
}

PyDoc_STRVAR(drain_doc,
             "drain(fd, key, me_node, me_nic, nic_ip, ncols, path_of, out, max_batches) -> (n, rejected, summaries)\n\n"
             "Read what waits on ``fd`` (recvmmsg, up to ``max_batches`` x 64 datagrams) and keep the authentic\n"
             "probes and trains addressed to this NIC, from the NIC they name (``nic_ip``: uint32 network-order\n"
             "addresses, rows of ``ncols`` per node), on a watched path (``path_of[node * ncols + nic]`` >= 0), as\n"
             "records of 12 int64 in ``out`` (RECORD_DTYPE). Authentic summaries come back whole, as bytes.\n"
             "Anything cut, unstamped, forged, misaddressed or spoofed is counted in ``rejected``. ``key``: one key, or\n"
             "a key table (per node index, KEY_SLOTS keys of KEY_BYTES): a packet must carry a tag under one of the\n"
             "keys of the node it names as its source.");

static PyObject *py_drain(PyObject *self, PyObject *args) {
    int fd, max_batches;
    const char *key;
    Py_ssize_t keylen;
    long me_node, me_nic, ncols;
    PyObject *o_ip, *o_path, *o_out;
    Py_buffer b_ip, b_path, b_out;
    key_set s;
    PyObject *summaries = NULL, *result = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy#llOlOOi", &fd, &key, &keylen, &me_node, &me_nic, &o_ip, &ncols, &o_path, &o_out,
                          &max_batches))
        return NULL;
    if (key_arg(&s, key, keylen) != 0) return NULL;
    if (ncols < 1) {
        PyErr_SetString(PyExc_ValueError, "ncols must be >= 1");
        return NULL;
    }
    if (PyObject_GetBuffer(o_ip, &b_ip, PyBUF_C_CONTIGUOUS) != 0) return NULL;
    if (PyObject_GetBuffer(o_path, &b_path, PyBUF_C_CONTIGUOUS) != 0) {
        PyBuffer_Release(&b_ip);
        return NULL;
    }
    if (PyObject_GetBuffer(o_out, &b_out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) {
        PyBuffer_Release(&b_ip);
        PyBuffer_Release(&b_path);
        return NULL;
    }
    const uint32_t *nic_ip = b_ip.buf;
    const int64_t *path_of = b_path.buf;
    Py_ssize_t nodes = b_ip.len / 4 / ncols;
    if (b_path.len / 8 < nodes * ncols) {
        PyErr_SetString(PyExc_ValueError, "path_of is smaller than nic_ip");
        goto done;
    }
    int64_t(*out)[RECORD_FIELDS] = b_out.buf;
    Py_ssize_t cap = b_out.len / (8 * RECORD_FIELDS), n = 0, rejected = 0;
    summaries = PyList_New(0);
    if (summaries == NULL) goto done;
    for (int batch = 0; batch < max_batches && n + RECV_BATCH <= cap; batch++) {
        for (int i = 0; i < RECV_BATCH; i++) {
            recv_iov[i].iov_base = recv_data[i];
            recv_iov[i].iov_len = RECV_SLOT;
            memset(&recv_hdrs[i], 0, sizeof(recv_hdrs[i]));
            recv_hdrs[i].msg_hdr.msg_name = &recv_names[i];
            recv_hdrs[i].msg_hdr.msg_namelen = sizeof(struct sockaddr_in);
            recv_hdrs[i].msg_hdr.msg_iov = &recv_iov[i];
            recv_hdrs[i].msg_hdr.msg_iovlen = 1;
            recv_hdrs[i].msg_hdr.msg_control = recv_control[i];
            recv_hdrs[i].msg_hdr.msg_controllen = CONTROL;
        }
        int got = recvmmsg(fd, recv_hdrs, RECV_BATCH, MSG_DONTWAIT, NULL);
        if (got < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
            if (n == 0 && PyList_GET_SIZE(summaries) == 0) {
                PyErr_SetFromErrno(PyExc_OSError);
                goto done;
            }
            break; /* keep what was read; the next drain reports the error */
        }
        for (int i = 0; i < got; i++) {
            struct msghdr *h = &recv_hdrs[i].msg_hdr;
            const uint8_t *p = recv_data[i];
            size_t len = recv_hdrs[i].msg_len;
            int64_t rx = 0;
            for (struct cmsghdr *c = CMSG_FIRSTHDR(h); c != NULL; c = CMSG_NXTHDR(h, c)) {
                if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_TIMESTAMPNS &&
                    c->cmsg_len >= CMSG_LEN(sizeof(struct timespec))) {
                    struct timespec ts;
                    memcpy(&ts, CMSG_DATA(c), sizeof(ts));
                    rx = (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
                }
            }
            if ((h->msg_flags & MSG_TRUNC) || rx == 0 || len < PROBE_BYTES || memcmp(p, "CWL1", 4) != 0) {
                rejected++;
                continue;
            }
            int kind = p[4];
            size_t signed_len = HEADER;
            if (kind == KIND_SUMMARY) {
                signed_len += get32(p + 28);
                if (signed_len + TAG > len) {
                    rejected++;
                    continue;
                }
            }
            long sn = get16(p + 6), snic = p[8], dnic = p[9], dn = get16(p + 10);
            int authentic = 0; /* under one of the keys the node it names may use now (its own, pairwise) */
            for (int slot = 0; slot < KEY_SLOTS && !authentic; slot++) {
                uint8_t digest[TAG];
                authentic = key_set_tag(&s, sn, slot, p, signed_len, digest) == 1 &&
                            memcmp(digest, p + signed_len, TAG) == 0;
            }
            if (!authentic || dn != me_node || dnic != me_nic || sn >= nodes ||
                snic >= ncols || nic_ip[sn * ncols + snic] != recv_names[i].sin_addr.s_addr) {
                rejected++; /* forged, not for this NIC, or not sent by the NIC it claims */
                continue;
            }
            if (kind == KIND_SUMMARY) {
                PyObject *packet = PyBytes_FromStringAndSize((const char *)p, (Py_ssize_t)len);
                if (packet == NULL || PyList_Append(summaries, packet) != 0) {
                    Py_XDECREF(packet);
                    goto done;
                }
                Py_DECREF(packet);
                continue;
            }
            int64_t path = path_of[sn * ncols + snic];
            if (path < 0 || (kind != KIND_PROBE && kind != KIND_TRAIN)) continue; /* not a watched path */
            int64_t *r = out[n++];
            r[R_PATH] = path;
            r[R_KIND] = kind;
            r[R_FLAGS] = p[5];
            r[R_SEQ] = get32(p + 12);
            r[R_TX] = get64(p + 16);
            r[R_RX] = rx;
            r[R_SESSION] = get32(p + 24);
            r[R_AUX] = get32(p + 28);
            r[R_ECHO_SEQ] = get32(p + 32);
            r[R_HOLD] = get32(p + 36);
            r[R_LENGTH] = (int64_t)len;
            r[R_SRC_NODE] = sn;
        }
        if (got < RECV_BATCH) break;
    }
    result = Py_BuildValue("(nnO)", n, rejected, summaries);
done:
    Py_XDECREF(summaries);
    PyBuffer_Release(&b_ip);
    PyBuffer_Release(&b_path);
    PyBuffer_Release(&b_out);
    return result;
}

static PyMethodDef methods[] = {
    {"tag", py_tag, METH_VARARGS, tag_doc},
    {"send_probes", py_send_probes, METH_VARARGS, send_probes_doc},
    {"send_train", py_send_train, METH_VARARGS, send_train_doc},
    {"drain", py_drain, METH_VARARGS, drain_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "clockworkd.lens._probeio",
    "Fleet Lens's per-packet work (build, tag, send; receive, verify, parse) in C.",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__probeio(void) {
    if (sodium_init() < 0) { /* picks BLAKE2b's fastest implementation for this CPU; tags need it */
        PyErr_SetString(PyExc_ImportError, "libsodium could not be initialised");
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "RECORD_FIELDS", RECORD_FIELDS) != 0 ||
        PyModule_AddIntConstant(m, "MAX_TRAIN", SEND_BATCH) != 0 ||
        PyModule_AddIntConstant(m, "RECV_BATCH", RECV_BATCH) != 0 ||
        PyModule_AddIntConstant(m, "KEY_SLOTS", KEY_SLOTS) != 0 || PyModule_AddIntConstant(m, "KEY_BYTES", KEY_BYTES) != 0 ||
        pacer_add_type(m) != 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
