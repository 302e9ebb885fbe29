/* clockworkd.lens._probeio: Fleet Lens's per-packet work in C (see the Python docstring below).
 *
 * Why: at a 10 ms interval with 16 peers per NIC a node sends and receives ~3,300 probes a second.
 * Building, tagging (keyed BLAKE2b) and parsing them in Python cost ~6 % of a core; here one call per
 * NIC per tick sends the whole batch (sendmmsg) and one call per drain reads, authenticates and parses
 * everything waiting (recvmmsg) into a preallocated array of int64 records that numpy reads in one go.
 * The wire format is the one wire.py defines (wire.py stays the Python reference the tests check this
 * module against). Linux only. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <netinet/in.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "blake2b.h"

#define HEADER 40
#define TAG 8
#define PROBE_BYTES (HEADER + TAG)
#define KIND_PROBE 1
#define KIND_TRAIN 2
#define KIND_SUMMARY 3
#define PAIR_FIRST 1
#define PAIR_SECOND 2
#define NO_ECHO 0xFFFFFFFFULL
#define SEND_BATCH 128
#define TRAIN_SLOT 9000
#define RECV_BATCH 64
#define RECV_SLOT 8192
#define CONTROL 64
#define RECORD_FIELDS 12

/* One received probe or train packet (int64 fields; the order is RECORD_DTYPE's in fastio.py). */
enum { R_PATH, R_KIND, R_FLAGS, R_SEQ, R_TX, R_RX, R_SESSION, R_AUX, R_ECHO_SEQ, R_HOLD, R_LENGTH, R_SRC_NODE };

static uint8_t send_data[SEND_BATCH][PROBE_BYTES];
static uint8_t train_data[SEND_BATCH][TRAIN_SLOT];
static struct sockaddr_in send_names[SEND_BATCH];
static struct iovec send_iov[SEND_BATCH];
static struct mmsghdr send_hdrs[SEND_BATCH];

static uint8_t recv_data[RECV_BATCH][RECV_SLOT];
static uint8_t recv_control[RECV_BATCH][CONTROL];
static struct sockaddr_in recv_names[RECV_BATCH];
static struct iovec recv_iov[RECV_BATCH];
static struct mmsghdr recv_hdrs[RECV_BATCH];

static inline void put16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }
static inline void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void put64(uint8_t *p, int64_t v) { memcpy(p, &v, 8); }
static inline uint16_t get16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline int64_t get64(const uint8_t *p) { int64_t v; memcpy(&v, p, 8); return v; }

static void header(uint8_t *p, int kind, int flags, long src_node, long src_nic, long dst_node, long dst_nic,
                   uint32_t seq, int64_t tx, uint32_t session, uint32_t aux, uint32_t echo_seq, uint32_t hold) {
    memcpy(p, "CWL1", 4);
    p[4] = (uint8_t)kind;
    p[5] = (uint8_t)flags;
    put16(p + 6, (uint16_t)src_node);
    p[8] = (uint8_t)src_nic;
    p[9] = (uint8_t)dst_nic;
    put16(p + 10, (uint16_t)dst_node);
    put32(p + 12, seq);
    put64(p + 16, tx);
    put32(p + 24, session);
    put32(p + 28, aux);
    put32(p + 32, echo_seq);
    put32(p + 36, hold);
}

static int keyed(blake2b_state *s, const char *key, Py_ssize_t keylen) {
    if (blake2b_keyed_init(s, (const uint8_t *)key, (size_t)keylen, TAG) != 0) {
        PyErr_Format(PyExc_ValueError, "tag key must be 1 to 64 bytes, not %zd", keylen);
        return -1;
    }
    return 0;
}

/* A C-contiguous buffer of at least ``count`` int64 values (``writable`` when the call updates it). */
static int64_t *i64(PyObject *obj, Py_buffer *view, Py_ssize_t count, int writable, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) != 0) return NULL;
    if (view->len % 8 != 0 || view->len / 8 < count) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes where %zd int64 values are needed", name, view->len, count);
        PyBuffer_Release(view);
        return NULL;
    }
    return (int64_t *)view->buf;
}

/* sendmmsg of the first ``count`` prepared slots, going on after a partial send; returns the number sent
 * and sets ``*err`` to the errno of a failure (0: all sent). */
static unsigned send_slots(int fd, unsigned count, int *err) {
    unsigned done = 0;
    *err = 0;
    while (done < count) {
        int n = sendmmsg(fd, send_hdrs + done, count - done, MSG_DONTWAIT);
        if (n <= 0) {
            *err = errno ? errno : EAGAIN;
            break;
        }
        done += (unsigned)n;
    }
    return done;
}

static PyObject *send_prepared(int fd, unsigned count) {
    int err;
    unsigned done = send_slots(fd, count, &err);
    return Py_BuildValue("(Ii)", done, err);
}

static void slot(unsigned i, uint8_t *data, size_t len, const uint8_t *addr) {
    memcpy(&send_names[i], addr, sizeof(struct sockaddr_in));
    send_iov[i].iov_base = data;
    send_iov[i].iov_len = len;
    memset(&send_hdrs[i], 0, sizeof(send_hdrs[i]));
    send_hdrs[i].msg_hdr.msg_name = &send_names[i];
    send_hdrs[i].msg_hdr.msg_namelen = sizeof(struct sockaddr_in);
    send_hdrs[i].msg_hdr.msg_iov = &send_iov[i];
    send_hdrs[i].msg_hdr.msg_iovlen = 1;
}

PyDoc_STRVAR(tag_doc, "tag(key, data) -> bytes: the 8-byte keyed BLAKE2b tag (= wire.tag).");

static PyObject *py_tag(PyObject *self, PyObject *args) {
    const char *key;
    Py_ssize_t keylen;
    Py_buffer data;
    blake2b_state s;
    uint8_t out[TAG];
    (void)self;
    if (!PyArg_ParseTuple(args, "y#y*", &key, &keylen, &data)) return NULL;
    if (keyed(&s, key, keylen) != 0 || data.len == 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "nothing to tag");
        PyBuffer_Release(&data);
        return NULL;
    }
    blake2b_final_from(&s, data.buf, (size_t)data.len, out);
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
    PyObject *o_seq, *o_dn, *o_dnic, *o_addrs, *o_rseq, *o_rtx, *o_rev, *o_eseq, *o_erx;
    Py_buffer b[9];
    int held = 0;
    PyObject *result = NULL;
    blake2b_state s;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy#llKLiOOOOOOOOO", &fd, &key, &keylen, &src_node, &src_nic, &session, &tx, &pair,
                          &o_seq, &o_dn, &o_dnic, &o_addrs, &o_rseq, &o_rtx, &o_rev, &o_eseq, &o_erx))
        return NULL;
    if (keyed(&s, key, keylen) != 0) return NULL;
    if (PyObject_GetBuffer(o_seq, &b[0], PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) return NULL;
    held = 1;
    Py_ssize_t paths = b[0].len / 8;
    int64_t *seq = b[0].buf, *dn, *dnic, *rseq, *rtx, *rev, *eseq, *erx;
    if (b[0].len % 8 != 0) {
        PyErr_Format(PyExc_ValueError, "seq: %zd bytes is not a whole number of int64", b[0].len);
        goto done;
    }
    if (!(dn = i64(o_dn, &b[1], paths, 0, "dst_node"))) goto done;
    held++;
    if (!(dnic = i64(o_dnic, &b[2], paths, 0, "dst_nic"))) goto done;
    held++;
    if (PyObject_GetBuffer(o_addrs, &b[3], PyBUF_C_CONTIGUOUS) != 0) goto done;
    held++;
    if (b[3].len < paths * 16) {
        PyErr_Format(PyExc_ValueError, "addrs: %zd bytes for %zd paths", b[3].len, paths);
        goto done;
    }
    if (!(rseq = i64(o_rseq, &b[4], paths, 1, "ring_seq"))) goto done;
    held++;
    Py_ssize_t ring = paths ? b[4].len / 8 / paths : 1;
    if (ring < 1) ring = 1;
    if (!(rtx = i64(o_rtx, &b[5], paths * ring, 1, "ring_tx"))) goto done;
    held++;
    if (!(rev = i64(o_rev, &b[6], paths, 0, "rev"))) goto done;
    held++;
    if (!(eseq = i64(o_eseq, &b[7], 0, 0, "echo_seq"))) goto done;
    held++;
    if (!(erx = i64(o_erx, &b[8], b[7].len / 8, 0, "echo_rx"))) goto done;
    held++;
    Py_ssize_t echoes = b[7].len / 8;
    const uint8_t *addrs = b[3].buf;
    unsigned count = 0, sent = 0;
    int err = 0;
    if (pair >= paths) pair = -1;
    /* The pair first (its transmit stamp is the one clock sync relies on), then every other path. */
    for (Py_ssize_t step = 0; step <= paths; step++) {
        Py_ssize_t k = step == 0 ? pair : step - 1;
        if (k < 0 || (step > 0 && k == pair)) continue;
        uint32_t e_seq = 0, hold = (uint32_t)NO_ECHO;
        Py_ssize_t r = rev[k];
        if (r >= 0 && r < echoes && eseq[r] >= 0) {
            long long h = tx - erx[r];
            if (h >= 0 && (unsigned long long)h < NO_ECHO) {
                e_seq = (uint32_t)eseq[r];
                hold = (uint32_t)h;
            }
        }
        int n = step == 0 ? 2 : 1;
        seq[k] += n;
        for (int j = 0; j < n; j++) {
            int64_t q = seq[k] - (n - 1 - j);
            int flags = step == 0 ? (j == 0 ? PAIR_FIRST : PAIR_SECOND) : 0;
            Py_ssize_t at = k * ring + (Py_ssize_t)(((uint64_t)q) % (uint64_t)ring);
            rseq[at] = q & 0xFFFFFFFF;
            rtx[at] = tx;
            uint8_t *p = send_data[count];
            header(p, KIND_PROBE, flags, src_node, src_nic, dn[k], dnic[k], (uint32_t)q, tx, (uint32_t)session, 0,
                   e_seq, hold);
            blake2b_final_from(&s, p, HEADER, p + HEADER);
            slot(count, p, PROBE_BYTES, addrs + 16 * k);
            if (++count == SEND_BATCH) { /* more paths than one batch: send this one, go on */
                unsigned n = send_slots(fd, count, &err);
                sent += n;
                count = 0;
                if (err) goto sent_all;
            }
        }
    }
    if (count > 0) sent += send_slots(fd, count, &err);
sent_all:
    result = Py_BuildValue("(Ii)", sent, err);
done:
    for (int i = 0; i < held; i++) PyBuffer_Release(&b[i]);
    return result;
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
    blake2b_state s;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy#lllly#KLKiiii", &fd, &key, &keylen, &src_node, &src_nic, &dst_node, &dst_nic,
                          &addr, &addrlen, &seq, &tx, &session, &first, &count, &total, &size))
        return NULL;
    if (keyed(&s, key, keylen) != 0) return NULL;
    if (addrlen != (Py_ssize_t)sizeof(struct sockaddr_in) || count < 1 || count > SEND_BATCH || first < 0 ||
        total > 0xFFFF || first + count > total || size < PROBE_BYTES || size > TRAIN_SLOT) {
        PyErr_Format(PyExc_ValueError, "send_train: bad address length %zd, packets %d+%d of %d or size %d", addrlen,
                     first, count, total, size);
        return NULL;
    }
    for (int i = 0; i < count; i++) {
        uint8_t *p = train_data[i];
        memset(p + PROBE_BYTES, 0, (size_t)size - PROBE_BYTES);
        header(p, KIND_TRAIN, 0, src_node, src_nic, dst_node, dst_nic, (uint32_t)seq, tx, (uint32_t)session,
               ((uint32_t)(first + i) << 16) | (uint32_t)total, 0, (uint32_t)NO_ECHO);
        blake2b_final_from(&s, p, HEADER, p + HEADER);
        slot((unsigned)i, p, (size_t)size, (const uint8_t *)addr);
    }
    return send_prepared(fd, (unsigned)count);
}

PyDoc_STRVAR(drain_doc,
             "drain(fd, key, me_node, me_nic, nic_ip, ncols, path_of, out, max_batches) -> (n, rejected, summaries)\n\n"
             "Read what waits on ``fd`` (recvmmsg, up to ``max_batches`` x 64 datagrams) and keep the authentic\n"
             "probes and trains addressed to this NIC, from the NIC they name (``nic_ip``: uint32 network-order\n"
             "addresses, rows of ``ncols`` per node), on a watched path (``path_of[node * ncols + nic]`` >= 0), as\n"
             "records of 12 int64 in ``out`` (RECORD_DTYPE). Authentic summaries come back whole, as bytes.\n"
             "Anything cut, unstamped, forged, misaddressed or spoofed is counted in ``rejected``.");

static PyObject *py_drain(PyObject *self, PyObject *args) {
    int fd, max_batches;
    const char *key;
    Py_ssize_t keylen;
    long me_node, me_nic, ncols;
    PyObject *o_ip, *o_path, *o_out;
    Py_buffer b_ip, b_path, b_out;
    blake2b_state s;
    PyObject *summaries = NULL, *result = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy#llOlOOi", &fd, &key, &keylen, &me_node, &me_nic, &o_ip, &ncols, &o_path, &o_out,
                          &max_batches))
        return NULL;
    if (keyed(&s, key, keylen) != 0) return NULL;
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
            uint8_t digest[TAG];
            blake2b_final_from(&s, p, signed_len, digest);
            long sn = get16(p + 6), snic = p[8], dnic = p[9], dn = get16(p + 10);
            if (memcmp(digest, p + signed_len, TAG) != 0 || dn != me_node || dnic != me_nic || sn >= nodes ||
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
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "RECORD_FIELDS", RECORD_FIELDS) != 0 ||
        PyModule_AddIntConstant(m, "MAX_TRAIN", SEND_BATCH) != 0 ||
        PyModule_AddIntConstant(m, "RECV_BATCH", RECV_BATCH) != 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
