/* LinkPass's per-packet heartbeat work in C: tag and send one rail's heartbeats in one sendmmsg, and read,
 * authenticate and check everything a rail's socket holds in recvmmsg batches. In Python each heartbeat cost
 * ~9 us to send and ~9 us to receive (interpreter, one syscall per packet, HMAC), most of the control plane's
 * CPU at 1,024 nodes x 8 rails. The decisions stay in Python (linkpass.engine); only the per-packet work is
 * here, and the GIL is released around the tags and the syscalls.
 *
 * The wire format is linkpass/heartbeat.py's (VERSION 4): a 22-byte header (network byte order) of version u8,
 * flags u8, fabric fingerprint u32, sender node u16, rail u8, rails u8, nodes u16, seq u32, down mask u16, up
 * mask u16, entries u16; one entry (node u16, rails-heard mask u16) per path peer of the sender; then a 16-byte
 * tag: the keyed BLAKE2b of the body (hashlib.blake2b(body, key=key, digest_size=16)) under the key of the pair
 * (sender, receiver). (Version 3 tagged the body's BLAKE2b-256 digest, to hash a 1 KB body once for every peer;
 * a body now fits one BLAKE2b block, and the digest was one block more per packet.) The keys are
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

#define HB_VERSION 4
#define HB_HEADER 22
#define HB_ENTRY 4 /* node u16, rails-heard mask u16 */
#define HB_TAG 16
#define HB_MAX_PACKET (4092 - 28) /* IPoIB's datagram MTU less the IPv4 and UDP headers (heartbeat.MAX_PACKET) */
#define BATCH 64

/* Why a packet was not accepted (linkpass.fastpath names them; keep both in step). */
enum {
    REJ_UNKNOWN = 1, /* no peer has the source address on this rail */
    REJ_SIZE,        /* not the size its entry count says (truncated, oversized, not a heartbeat) */
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
    if (body.len < HB_HEADER || (body.len - HB_HEADER) % HB_ENTRY != 0 || body.len + HB_TAG > HB_MAX_PACKET) {
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
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        long node = node_of[i];
        uint32_t ip;
        if (node < 0 || node >= known || (memcpy(&ip, addr_of + node, 4), ip == 0)) {
            (*failed)++;
            continue;
        }
        uint8_t *tag = tags + (size_t)ready * HB_TAG;
        int made = error ? -1 : key_set_tag(keys, node, 0, data, len, tag);
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

static void check(verdict *v, const uint8_t *p, size_t len, const key_set *keys, long me, long rail,
                  uint32_t fingerprint, long nnodes, long nrails) {
    v->node = v->rail = -1;
    if (v->peer < 0) {
        v->code = REJ_UNKNOWN;
        return;
    }
    size_t entries = len >= HB_HEADER ? get16(p + 20) : 0;
    if (len < HB_HEADER + HB_TAG || len != HB_HEADER + entries * HB_ENTRY + HB_TAG) {
        v->code = REJ_SIZE;
        return;
    }
    int authentic = 0;
    for (int slot = 0; slot < KEY_SLOTS && !authentic; slot++) {
        uint8_t tag[HB_TAG];
        authentic = key_set_tag(keys, v->peer, slot, p, len - HB_TAG, tag) == 1 &&
                    sodium_memcmp(tag, p + len - HB_TAG, HB_TAG) == 0;
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
    uint16_t hears = 0;
    int in_range = node < nnodes && r < nrails && ((down | up) >> nrails) == 0;
    for (size_t k = 0; k < entries && in_range; k++) {
        const uint8_t *e = p + HB_HEADER + k * HB_ENTRY;
        long peer = get16(e);
        uint16_t mask = get16(e + 2);
        in_range = peer < nnodes && (mask >> nrails) == 0;
        if (peer == me) hears = mask;
    }
    if (!in_range) {
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
    v->hears = hears;
}

/* The accepted packets of one receive: one entry per (sender, seq, content), with the rails it came on. One
 * interval's packets of a path peer say the same on every rail, so the engine files them once, not once per rail. */
typedef struct {
    int32_t node;
    uint32_t seq;
    uint16_t down, up, hears, rails;
    uint8_t flags;
} arrival;

typedef struct {
    arrival *items;
    size_t n, cap;
} arrivals;

static int arrivals_add(arrivals *a, const verdict *v, long rail) {
    if (a->n == a->cap) {
        size_t cap = a->cap ? 2 * a->cap : 64;
        arrival *items = realloc(a->items, cap * sizeof(*items));
        if (items == NULL) return -1;
        a->items = items;
        a->cap = cap;
    }
    a->items[a->n++] = (arrival){.node = v->node, .seq = v->seq, .down = v->down, .up = v->up, .hears = v->hears,
                                 .rails = (uint16_t)(1u << rail), .flags = v->flags};
    return 0;
}

static int arrival_cmp(const void *x, const void *y) {
    const arrival *a = x, *b = y;
    if (a->node != b->node) return a->node < b->node ? -1 : 1;
    if (a->seq != b->seq) return a->seq < b->seq ? -1 : 1;
    uint64_t ka = (uint64_t)a->down << 40 | (uint64_t)a->up << 24 | (uint64_t)a->hears << 8 | a->flags;
    uint64_t kb = (uint64_t)b->down << 40 | (uint64_t)b->up << 24 | (uint64_t)b->hears << 8 | b->flags;
    return ka < kb ? -1 : ka > kb;
}

/* ``a`` merged (sorted by sender and seq: the order filing needs) into ``accepted``: 0, or -1. */
static int add_arrivals(arrivals *a, PyObject *accepted) {
    if (a->n == 0) return 0;
    qsort(a->items, a->n, sizeof(*a->items), arrival_cmp);
    size_t out = 0;
    for (size_t i = 1; i < a->n; i++) {
        if (arrival_cmp(&a->items[out], &a->items[i]) == 0) a->items[out].rails |= a->items[i].rails;
        else a->items[++out] = a->items[i];
    }
    for (size_t i = 0; i <= out; i++) {
        const arrival *v = &a->items[i];
        PyObject *item = Py_BuildValue("(HiIHHBH)", v->rails, v->node, v->seq, v->down, v->up, v->flags, v->hears);
        if (item == NULL || PyList_Append(accepted, item) != 0) {
            Py_XDECREF(item);
            return -1;
        }
        Py_DECREF(item);
    }
    return 0;
}

/* ``n`` verdicts of rail ``rail``: the accepted into ``got``, the rejected appended to ``rejected``: 0, or -1. */
static int add_verdicts(const verdict *verdicts, int n, long rail, arrivals *got, PyObject *rejected) {
    for (int i = 0; i < n; i++) {
        const verdict *v = &verdicts[i];
        if (v->code == 0) {
            if (arrivals_add(got, v, rail) != 0) {
                PyErr_NoMemory();
                return -1;
            }
            continue;
        }
        char text[INET_ADDRSTRLEN];
        struct in_addr a = {.s_addr = v->src};
        if (inet_ntop(AF_INET, &a, text, sizeof(text)) == NULL) text[0] = '\0';
        PyObject *item = Py_BuildValue("(lsiiii)", rail, text, v->peer, v->code, v->node, v->rail);
        if (item == NULL || PyList_Append(rejected, item) != 0) {
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
    uint8_t *slots;
    int max_batches;
} fabric_args;

#define SLOT (HB_MAX_PACKET + 1) /* one byte more: a longer datagram shows as too long, not as this size */

/* Drain socket ``fd`` of rail ``rail`` (``senders``: its sorted (address, node) pairs) into the lists. */
static int drain_rail(const fabric_args *f, int fd, const Py_buffer *senders, long rail, arrivals *accepted,
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
            iov[i].iov_base = f->slots + (size_t)i * SLOT;
            iov[i].iov_len = SLOT;
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
            check(v, f->slots + (size_t)i * SLOT, hdrs[i].msg_len, f->keys, f->me, rail, f->fingerprint, f->nnodes,
                  f->nrails);
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
             "``nodes``, ``rails``) and name that node and that rail. ``accepted``: one tuple (rails, node, seq,\n"
             "down, up, flags, hears) per sender and content, ``rails`` the mask of the rails it arrived on (one\n"
             "interval's packets of a path peer, one per rail, are one tuple), sorted by sender and seq, ``hears``\n"
             "the mask of the rails on which the sender hears node ``me``; ``rejected``: (rail, source address,\n"
             "its node or -1, code, named node, named rail), one per packet; ``errors``: the sockets whose read\n"
             "failed (nothing more is read from those this time).");

static PyObject *py_receive(PyObject *self, PyObject *args) {
    (void)self;
    int max_batches;
    long me, nnodes, nrails;
    unsigned long fingerprint;
    Py_buffer key = {0};
    PyObject *socks_obj, *socks = NULL, *accepted = NULL, *rejected = NULL, *result = NULL;
    uint8_t *slots = NULL;
    arrivals got = {0};
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
    socks = PySequence_Fast(socks_obj, "sockets must be a sequence of (fd, senders, rail)");
    if (socks == NULL) goto done;
    slots = f.slots = malloc(BATCH * SLOT);
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
        else rc = drain_rail(&f, fd, &senders, rail, &got, rejected, &errors);
        PyBuffer_Release(&senders);
        if (rc != 0) goto done;
    }
    if (add_arrivals(&got, accepted) != 0) goto done;
    result = Py_BuildValue("(OOI)", accepted, rejected, errors);
done:
    free(got.items);
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
    uint8_t out[HB_TAG];
    if (key_set_arg(&keys, &key) != 0) goto done;
    int made = body.len == 0 ? -1 : key_set_tag(&keys, node, slot, body.buf, (size_t)body.len, out);
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
