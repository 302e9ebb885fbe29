/* LinkPass's per-packet heartbeat work in C: tag and send one rail's heartbeats in one sendmmsg, and read,
 * authenticate and check everything a rail's socket holds in recvmmsg batches. In Python each heartbeat cost
 * ~9 us to send and ~9 us to receive (interpreter, one syscall per packet, HMAC), most of the control plane's
 * CPU at 1,024 nodes x 8 rails. The decisions stay in Python (linkpass.engine); only the per-packet work is
 * here, and the GIL is released around the tags and the syscalls.
 *
 * The wire format is linkpass/heartbeat.py's (VERSION 3): a 20-byte header (network byte order) of version u8,
 * flags u8, fabric fingerprint u32, sender node u16, rail u8, rails u8, nodes u16, seq u32, down mask u16, up
 * mask u16; one bitmap per rail of ceil(nodes / 8) bytes; then a 16-byte tag: the keyed BLAKE2b of the body's
 * 32-byte BLAKE2b digest (hash, then MAC: hashlib.blake2b(hashlib.blake2b(body, digest_size=32).digest(),
 * key=key, digest_size=16)), under the key of the pair (sender, receiver). Why a digest first: a rail's body is
 * the same for every peer, so a sender hashes it once and each peer's tag costs one BLAKE2b block; a receiver
 * hashes a packet once whatever number of keys it tries during a rotation. The keys are
 * Fleet Lens's key sets (daemon/clockworkd/lens/csrc/tag.h), one key for every node or a table of KEY_SLOTS
 * keys per node index (slot 0 sends; any non-zero slot is accepted, two or more while a key changes). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "tag.h"

#define HB_VERSION 3
#define HB_HEADER 20
#define HB_TAG 16
#define HB_MAX_PACKET (4092 - 28) /* IPoIB's datagram MTU less the IPv4 and UDP headers (heartbeat.MAX_PACKET) */
#define BATCH 64
#define DIGEST 32 /* the body's unkeyed BLAKE2b digest, which the tag is the keyed BLAKE2b of */

/* Why a packet was not accepted (linkpass.fastpath names them; keep both in step). */
enum {
    REJ_UNKNOWN = 1, /* no peer has the source address on this rail */
    REJ_SIZE,        /* not this fabric's packet size (truncated, oversized, another map's) */
    REJ_TAG,         /* no key the peer may use made the tag: forged, or a key out of step */
    REJ_VERSION,     /* another wire version */
    REJ_MAP,         /* another fabric map (fingerprint, node or rail count) */
    REJ_RANGE,       /* node, rail or masks out of range */
    REJ_CLAIM,       /* signed by the peer at that address, but names another node or rail */
};

static uint16_t get16(const uint8_t *p) { return (uint16_t)((p[0] << 8) | p[1]); }
static uint32_t get32(const uint8_t *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static int key_set_arg(key_set *k, const Py_buffer *key) {
    if (key_set_init(k, key->buf, (size_t)key->len, HB_TAG) != 0) {
        PyErr_SetString(PyExc_ValueError, "key: one key of 1 to 64 bytes, or a table of KEY_SLOTS x KEY_BYTES per node");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(send_doc,
             "send(port, key, batches) -> (sent, failed)\n\n"
             "One interval's heartbeats of every rail: each batch is (fd, body, nodes, addrs): tag ``body`` (a\n"
             "heartbeat without its tag) for each node index in ``nodes`` under its key in ``key`` (slot 0 of its\n"
             "row, or the one key) and send it from socket ``fd`` to that node's address on the rail, ``addrs`` (4\n"
             "bytes per node index, the IPv4 address in network order, 0: none), UDP port ``port``, in sendmmsg\n"
             "batches. ``failed`` counts nodes without an address or key and datagrams the kernel refused.");

/* One rail's batch (see send_doc) into ``sent`` and ``failed``: 0, or -1 with an exception. */
static int send_batch(PyObject *batch, int port, const key_set *keys, unsigned *sent, unsigned *failed) {
    int fd, rc = -1;
    PyObject *nodes_obj, *nodes = NULL;
    Py_buffer body = {0}, addrs = {0};
    struct mmsghdr *hdrs = NULL;
    struct iovec *iov = NULL;
    struct sockaddr_in *names = NULL;
    uint8_t *tags = NULL;
    long *node_of = NULL;
    if (!PyArg_ParseTuple(batch, "iy*Oy*", &fd, &body, &nodes_obj, &addrs)) return -1;
    if (body.len <= HB_HEADER || body.len + HB_TAG > HB_MAX_PACKET) {
        PyErr_SetString(PyExc_ValueError, "body: not a heartbeat's size");
        goto done;
    }
    nodes = PySequence_Fast(nodes_obj, "nodes must be a sequence of node indices");
    if (nodes == NULL) goto done;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(nodes), known = addrs.len / 4;
    size_t n = count > 0 ? (size_t)count : 1;
    hdrs = calloc(n, sizeof(*hdrs));
    iov = calloc(2 * n, sizeof(*iov));
    names = calloc(n, sizeof(*names));
    tags = calloc(n, HB_TAG);
    node_of = calloc(n, sizeof(*node_of));
    if (hdrs == NULL || iov == NULL || names == NULL || tags == NULL || node_of == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(nodes, i));
        if (v == -1 && PyErr_Occurred()) goto done;
        node_of[i] = v;
    }
    const uint32_t *addr_of = addrs.buf;
    const uint8_t *data = body.buf;
    size_t len = (size_t)body.len;
    unsigned ready = 0;
    int error = 0;
    uint8_t digest[DIGEST];
    Py_BEGIN_ALLOW_THREADS
    if (crypto_generichash_blake2b(digest, DIGEST, data, len, NULL, 0) != 0) error = 1;
    for (Py_ssize_t i = 0; i < count; i++) {
        long node = node_of[i];
        uint32_t ip;
        if (node < 0 || node >= known || (memcpy(&ip, addr_of + node, 4), ip == 0)) {
            (*failed)++;
            continue;
        }
        uint8_t *tag = tags + (size_t)ready * HB_TAG;
        int made = error ? -1 : key_set_tag(keys, node, 0, digest, DIGEST, tag);
        if (made != 1) {
            if (made < 0) error = 1;
            (*failed)++;
            continue;
        }
        names[ready].sin_family = AF_INET;
        names[ready].sin_port = htons((uint16_t)port);
        names[ready].sin_addr.s_addr = ip;
        iov[2 * ready].iov_base = (void *)data;
        iov[2 * ready].iov_len = len;
        iov[2 * ready + 1].iov_base = tag;
        iov[2 * ready + 1].iov_len = HB_TAG;
        hdrs[ready].msg_hdr.msg_name = &names[ready];
        hdrs[ready].msg_hdr.msg_namelen = sizeof(struct sockaddr_in);
        hdrs[ready].msg_hdr.msg_iov = &iov[2 * ready];
        hdrs[ready].msg_hdr.msg_iovlen = 2;
        ready++;
    }
    unsigned done_n = 0;
    while (done_n < ready) {
        unsigned chunk = ready - done_n < BATCH ? ready - done_n : BATCH;
        int got = sendmmsg(fd, hdrs + done_n, chunk, MSG_DONTWAIT);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) { /* the first datagram of the chunk was refused (no route, a full buffer): skip it */
            (*failed)++;
            done_n++;
            continue;
        }
        *sent += (unsigned)got;
        done_n += (unsigned)got;
    }
    Py_END_ALLOW_THREADS
    if (error) {
        PyErr_SetString(PyExc_RuntimeError, "BLAKE2b failed");
        goto done;
    }
    rc = 0;
done:
    Py_XDECREF(nodes);
    free(hdrs);
    free(iov);
    free(names);
    free(tags);
    free(node_of);
    PyBuffer_Release(&body);
    PyBuffer_Release(&addrs);
    return rc;
}

static PyObject *py_send(PyObject *self, PyObject *args) {
    (void)self;
    int port;
    PyObject *batches_obj, *batches = NULL, *result = NULL;
    Py_buffer key = {0};
    if (!PyArg_ParseTuple(args, "iy*O", &port, &key, &batches_obj)) return NULL;
    key_set keys;
    unsigned sent = 0, failed = 0;
    if (key_set_arg(&keys, &key) != 0) goto done;
    if (port <= 0 || port > 65535) {
        PyErr_SetString(PyExc_ValueError, "port out of range");
        goto done;
    }
    batches = PySequence_Fast(batches_obj, "batches must be a sequence of (fd, body, nodes, addrs)");
    if (batches == NULL) goto done;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(batches); i++)
        if (send_batch(PySequence_Fast_GET_ITEM(batches, i), port, &keys, &sent, &failed) != 0) goto done;
    result = Py_BuildValue("(II)", sent, failed);
done:
    Py_XDECREF(batches);
    PyBuffer_Release(&key);
    return result;
}

typedef struct {
    uint32_t src;    /* source address, network order */
    int32_t peer;    /* the node index the source address belongs to, -1: none */
    int code;        /* 0: accepted, else REJ_* */
    uint32_t seq;
    int32_t node;    /* the node and rail the packet names */
    int32_t rail;
    uint16_t down, up, hears;
    uint8_t flags;
} verdict;

/* The node index whose NIC on this rail has ``ip`` (network order): ``table`` holds ``count`` pairs of uint32
 * (address in host order, node index), sorted by address. -1 when none. */
static int32_t sender_of(const uint32_t *table, Py_ssize_t count, uint32_t ip) {
    uint32_t want = ntohl(ip);
    Py_ssize_t lo = 0, hi = count;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        uint32_t at = table[2 * mid];
        if (at == want) return (int32_t)table[2 * mid + 1];
        if (at < want) lo = mid + 1;
        else hi = mid;
    }
    return -1;
}

static void check(verdict *v, const uint8_t *p, size_t len, size_t size, const key_set *keys, long me, long rail,
                  uint32_t fingerprint, long nnodes, long nrails, size_t width) {
    v->node = v->rail = -1;
    if (v->peer < 0) {
        v->code = REJ_UNKNOWN;
        return;
    }
    if (len != size) {
        v->code = REJ_SIZE;
        return;
    }
    int authentic = 0;
    uint8_t digest[DIGEST];
    if (crypto_generichash_blake2b(digest, DIGEST, p, size - HB_TAG, NULL, 0) != 0) {
        v->code = REJ_TAG;
        return;
    }
    for (int slot = 0; slot < KEY_SLOTS && !authentic; slot++) {
        uint8_t tag[HB_TAG];
        authentic = key_set_tag(keys, v->peer, slot, digest, DIGEST, tag) == 1 &&
                    sodium_memcmp(tag, p + size - HB_TAG, HB_TAG) == 0;
    }
    if (!authentic) {
        v->code = REJ_TAG;
        return;
    }
    long node = get16(p + 6), r = p[8], pr = p[9], pn = get16(p + 10);
    uint16_t down = get16(p + 16), up = get16(p + 18);
    if (p[0] != HB_VERSION) {
        v->code = REJ_VERSION;
        return;
    }
    if (get32(p + 2) != fingerprint || pr != nrails || pn != nnodes) {
        v->code = REJ_MAP;
        return;
    }
    if (node >= nnodes || r >= nrails || ((down | up) >> nrails) != 0) {
        v->code = REJ_RANGE;
        return;
    }
    v->node = (int32_t)node;
    v->rail = (int32_t)r;
    if (node != v->peer || r != rail) {
        v->code = REJ_CLAIM;
        return;
    }
    v->code = 0;
    v->flags = p[1];
    v->seq = get32(p + 12);
    v->down = down;
    v->up = up;
    uint16_t hears = 0;
    const uint8_t *bits = p + HB_HEADER + (size_t)(me >> 3);
    for (long k = 0; k < nrails; k++)
        if (bits[(size_t)k * width] & (1u << (me & 7))) hears |= (uint16_t)(1u << k);
    v->hears = hears;
}

/* The Python results of ``n`` verdicts of rail ``rail`` appended to ``accepted`` and ``rejected``: 0, or -1. */
static int add_verdicts(const verdict *verdicts, int n, long rail, PyObject *accepted, PyObject *rejected) {
    for (int i = 0; i < n; i++) {
        const verdict *v = &verdicts[i];
        PyObject *item, *list = accepted;
        if (v->code == 0) {
            item = Py_BuildValue("(liIHHBH)", rail, v->node, v->seq, v->down, v->up, v->flags, v->hears);
        } else {
            char text[INET_ADDRSTRLEN];
            struct in_addr a = {.s_addr = v->src};
            if (inet_ntop(AF_INET, &a, text, sizeof(text)) == NULL) text[0] = '\0';
            item = Py_BuildValue("(lsiiii)", rail, text, v->peer, v->code, v->node, v->rail);
            list = rejected;
        }
        if (item == NULL || PyList_Append(list, item) != 0) {
            Py_XDECREF(item);
            return -1;
        }
        Py_DECREF(item);
    }
    return 0;
}

typedef struct {
    const key_set *keys;
    long me, nnodes, nrails;
    uint32_t fingerprint;
    size_t width, size, slot;
    uint8_t *slots;
    int max_batches;
} fabric_args;

/* Drain socket ``fd`` of rail ``rail`` (``senders``: its sorted (address, node) pairs) into the lists. */
static int drain_rail(const fabric_args *f, int fd, const Py_buffer *senders, long rail, PyObject *accepted,
                      PyObject *rejected, unsigned *errors) {
    const uint32_t *table = senders->buf;
    Py_ssize_t known = senders->len / 8;
    struct mmsghdr hdrs[BATCH];
    struct iovec iov[BATCH];
    struct sockaddr_in names[BATCH];
    verdict verdicts[BATCH];
    for (int batch = 0; batch < f->max_batches; batch++) {
        int got, error = 0;
        Py_BEGIN_ALLOW_THREADS
        for (int i = 0; i < BATCH; i++) {
            iov[i].iov_base = f->slots + (size_t)i * f->slot;
            iov[i].iov_len = f->slot;
            memset(&hdrs[i], 0, sizeof(hdrs[i]));
            hdrs[i].msg_hdr.msg_name = &names[i];
            hdrs[i].msg_hdr.msg_namelen = sizeof(names[i]);
            hdrs[i].msg_hdr.msg_iov = &iov[i];
            hdrs[i].msg_hdr.msg_iovlen = 1;
        }
        got = recvmmsg(fd, hdrs, BATCH, MSG_DONTWAIT, NULL);
        if (got < 0) error = errno;
        for (int i = 0; i < got; i++) {
            verdict *v = &verdicts[i];
            memset(v, 0, sizeof(*v));
            v->src = names[i].sin_addr.s_addr;
            v->peer = hdrs[i].msg_hdr.msg_namelen >= sizeof(names[i]) && names[i].sin_family == AF_INET
                          ? sender_of(table, known, v->src)
                          : -1;
            check(v, f->slots + (size_t)i * f->slot, hdrs[i].msg_len, f->size, f->keys, f->me, rail, f->fingerprint,
                  f->nnodes, f->nrails, f->width);
        }
        Py_END_ALLOW_THREADS
        if (got < 0) { /* empty (EAGAIN), or an error that ends this rail's read only: the others still count */
            *errors += error != EAGAIN && error != EWOULDBLOCK && error != EINTR;
            return 0;
        }
        if (add_verdicts(verdicts, got, rail, accepted, rejected) != 0) return -1;
        if (got < BATCH) return 0;
    }
    return 0;
}

PyDoc_STRVAR(receive_doc,
             "receive(sockets, key, me, fingerprint, nodes, rails, max_batches) -> (accepted, rejected, errors)\n\n"
             "Read what waits on each rail's socket (``sockets``: (fd, senders, rail index) each; recvmmsg, up to\n"
             "``max_batches`` x 64 datagrams per socket) and check each datagram: its source address names the\n"
             "sender (``senders``: sorted uint32 pairs (address in host order, node index) of that rail), its tag\n"
             "must be under one of that node's keys in ``key``, and it must be of this fabric (``fingerprint``,\n"
             "``nodes``, ``rails``) and name that node and that rail. ``accepted``: one tuple (rail, node, seq,\n"
             "down, up, flags, hears) per packet, ``hears`` the mask of the rails on which the sender hears node\n"
             "``me``; ``rejected``: (rail, source address, its node or -1, code, named node, named rail); ``errors``:\n"
             "the sockets whose read failed (nothing more is read from those this time).");

static PyObject *py_receive(PyObject *self, PyObject *args) {
    (void)self;
    int max_batches;
    long me, nnodes, nrails;
    unsigned long fingerprint;
    Py_buffer key = {0};
    PyObject *socks_obj, *socks = NULL, *accepted = NULL, *rejected = NULL, *result = NULL;
    uint8_t *slots = NULL;
    if (!PyArg_ParseTuple(args, "Oy*lklli", &socks_obj, &key, &me, &fingerprint, &nnodes, &nrails, &max_batches))
        return NULL;
    key_set keys;
    if (key_set_arg(&keys, &key) != 0) goto done;
    if (nnodes < 1 || nnodes > 65535 || nrails < 1 || nrails > 16 || me < 0 || me >= nnodes || max_batches < 1) {
        PyErr_SetString(PyExc_ValueError, "me, nodes, rails or max_batches out of range");
        goto done;
    }
    fabric_args f = {.keys = &keys, .me = me, .nnodes = nnodes, .nrails = nrails,
                     .fingerprint = (uint32_t)fingerprint, .max_batches = max_batches};
    f.width = (size_t)(nnodes + 7) / 8;
    f.size = HB_HEADER + (size_t)nrails * f.width + HB_TAG;
    if (f.size > HB_MAX_PACKET) {
        PyErr_SetString(PyExc_ValueError, "heartbeats of this fabric do not fit one datagram");
        goto done;
    }
    f.slot = f.size + 1; /* one byte more: a longer datagram shows as too long, not as this size */
    socks = PySequence_Fast(socks_obj, "sockets must be a sequence of (fd, senders, rail)");
    if (socks == NULL) goto done;
    slots = f.slots = malloc(BATCH * f.slot);
    accepted = PyList_New(0);
    rejected = PyList_New(0);
    if (slots == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (accepted == NULL || rejected == NULL) goto done;
    unsigned errors = 0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(socks); i++) {
        int fd;
        long rail;
        Py_buffer senders = {0};
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(socks, i), "iy*l", &fd, &senders, &rail)) goto done;
        int rc = -1;
        if (rail < 0 || rail >= nrails) PyErr_SetString(PyExc_ValueError, "rail out of range");
        else rc = drain_rail(&f, fd, &senders, rail, accepted, rejected, &errors);
        PyBuffer_Release(&senders);
        if (rc != 0) goto done;
    }
    result = Py_BuildValue("(OOI)", accepted, rejected, errors);
done:
    Py_XDECREF(socks);
    Py_XDECREF(accepted);
    Py_XDECREF(rejected);
    free(slots);
    PyBuffer_Release(&key);
    return result;
}

PyDoc_STRVAR(tag_doc, "tag(body, key, node, slot) -> bytes | None: the 16-byte tag of ``body`` under ``node``'s key in "
                      "``slot`` (None: no key there); what send() appends, for tests.");

static PyObject *py_tag(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer body = {0}, key = {0};
    long node;
    int slot;
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "y*y*li", &body, &key, &node, &slot)) return NULL;
    key_set keys;
    uint8_t out[HB_TAG], digest[DIGEST];
    if (key_set_arg(&keys, &key) != 0) goto done;
    if (crypto_generichash_blake2b(digest, DIGEST, body.buf, (size_t)body.len, NULL, 0) != 0) {
        PyErr_SetString(PyExc_RuntimeError, "BLAKE2b failed");
        goto done;
    }
    int made = body.len == 0 ? -1 : key_set_tag(&keys, node, slot, digest, DIGEST, out);
    if (made < 0) PyErr_SetString(PyExc_ValueError, "cannot tag an empty body");
    else if (made == 0) result = Py_NewRef(Py_None);
    else result = PyBytes_FromStringAndSize((const char *)out, HB_TAG);
done:
    PyBuffer_Release(&body);
    PyBuffer_Release(&key);
    return result;
}

static PyMethodDef methods[] = {
    {"send", py_send, METH_VARARGS, send_doc},
    {"receive", py_receive, METH_VARARGS, receive_doc},
    {"tag", py_tag, METH_VARARGS, tag_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "linkpass._hbfast", "LinkPass's per-packet heartbeat work (tag, send; receive, verify) in C.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__hbfast(void) {
    if (sodium_init() < 0) {
        PyErr_SetString(PyExc_ImportError, "libsodium could not be initialised");
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "VERSION", HB_VERSION) != 0 || PyModule_AddIntConstant(m, "TAG_BYTES", HB_TAG) != 0 ||
        PyModule_AddIntConstant(m, "KEY_SLOTS", KEY_SLOTS) != 0 || PyModule_AddIntConstant(m, "KEY_BYTES", KEY_BYTES) != 0 ||
        PyModule_AddIntConstant(m, "BATCH", BATCH) != 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
