/* clockworkd.lens._probeio.Pacer: a thread that sends every NIC's probes on the probe interval.
 *
 * Why a thread: a probe tick is one sendmmsg per NIC, 100 times a second. Done from the daemon's Python
 * event loop, each tick also cost a wake-up of the loop and the Python around the call, on caches the
 * rest of the daemon keeps cold: that came to more than the sending itself. Here the tick runs in C on
 * its own thread, never takes the GIL, and the event loop wakes only to read (every 50 ms) and evaluate.
 *
 * What it shares with Python, and how: the per-path arrays (sequence numbers and the transmit rings it
 * writes, the echoes it reads) are numpy arrays whose buffers it holds while it lives. Python reads the
 * rings and writes the echoes only inside ``with pacer:``, which holds the pacer's lock; the thread holds
 * it for the duration of one tick. */
#include "pacer.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <time.h>

#include "probe_send.h"
#include "py_args.h"
#include "records.h"

#define PACER_NICS 16

typedef struct {
    int fd;
    long index;
    probe_paths paths;
    Py_buffer views[PATH_BUFFERS];
} pacer_nic;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t lock;
    pthread_cond_t wake;
    pthread_t thread;
    int ready;    /* lock and condition initialised */
    int started;  /* the thread runs (until stop) */
    int stopping; /* asked to stop (under lock) */
    key_set key;
    uint8_t *key_table; /* the pacer's own copy of a key table (NULL: one key), swapped by set_keys */
    long src_node;
    uint32_t session;
    int64_t interval_ns;
    long pair_every;
    int seam;
    int64_t seam_offset_ns, seam_epoch_ns;
    double seam_drift_ppm;
    probe_echoes echoes; /* read by the tick; written by note_arrivals (through echo_views, held writable) */
    Py_buffer echo_views[ECHO_BUFFERS];
    int echoes_held;
    pacer_nic nics[PACER_NICS];
    int nnics;
    unsigned long long ticks, sent, errors, late;
    long long cpu_ns;
    int last_errno;
    send_buf buf;
} Pacer;

static int64_t ns_of(const struct timespec *t) { return (int64_t)t->tv_sec * 1000000000LL + t->tv_nsec; }

static struct timespec timespec_of(int64_t ns) {
    struct timespec t = {(time_t)(ns / 1000000000LL), (long)(ns % 1000000000LL)};
    return t;
}

/* This node's clock at real time ``real``: through the clock seam when tests set one (ClockSeam.apply:
 * real + offset + round(drift_ppm * 1e-6 * (real - epoch)), rounding half to even). */
static int64_t node_clock(const Pacer *pc, int64_t real) {
    if (!pc->seam) return real;
    return real + pc->seam_offset_ns + (int64_t)llrint(pc->seam_drift_ppm * 1e-6 * (double)(real - pc->seam_epoch_ns));
}

/* This node's clock now, for transmit stamps. */
static int64_t transmit_clock(const Pacer *pc) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return node_clock(pc, ns_of(&t));
}

static void tick(Pacer *pc) {
    for (int i = 0; i < pc->nnics; i++) {
        pacer_nic *nic = &pc->nics[i];
        if (nic->paths.paths == 0) continue;
        ptrdiff_t pair = pc->pair_every > 0 ? (ptrdiff_t)((pc->ticks / (unsigned long long)pc->pair_every) %
                                                           (unsigned long long)nic->paths.paths)
                                            : -1;
        int err;
        pc->sent += send_probe_batch(&pc->buf, nic->fd, &pc->key, pc->src_node, nic->index, pc->session,
                                     transmit_clock(pc), pair, &nic->paths, &pc->echoes, &err);
        if (err) {
            pc->errors++;
            pc->last_errno = err;
        }
    }
    pc->ticks++;
    struct timespec cpu;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu);
    pc->cpu_ns = ns_of(&cpu);
}

static void *run(void *arg) {
    Pacer *pc = arg;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    int64_t next = ns_of(&now);
    pthread_mutex_lock(&pc->lock);
    while (!pc->stopping) {
        tick(pc);
        next += pc->interval_ns;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (ns_of(&now) - next > pc->interval_ns) { /* fell behind (held up): skip, never burst */
            next = ns_of(&now) + pc->interval_ns;
            pc->late++;
        }
        struct timespec until = timespec_of(next);
        while (!pc->stopping && pthread_cond_timedwait(&pc->wake, &pc->lock, &until) != ETIMEDOUT) {
        }
    }
    pthread_mutex_unlock(&pc->lock);
    return NULL;
}

/* Take the pacer's lock without holding the GIL while waiting (the thread never needs the GIL). */
static void lock(Pacer *pc) {
    if (pthread_mutex_trylock(&pc->lock) == 0) return;
    Py_BEGIN_ALLOW_THREADS pthread_mutex_lock(&pc->lock);
    Py_END_ALLOW_THREADS
}

static void stop(Pacer *pc) {
    if (!pc->started) return;
    lock(pc);
    pc->stopping = 1;
    pthread_cond_signal(&pc->wake);
    pthread_mutex_unlock(&pc->lock);
    Py_BEGIN_ALLOW_THREADS pthread_join(pc->thread, NULL);
    Py_END_ALLOW_THREADS
    pc->started = 0;
}

static int pacer_init(Pacer *pc, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"key", "src_node", "session", "interval_ns", "pair_every", "echo_seq", "echo_rx",
                             "seam", NULL};
    const char *key;
    Py_ssize_t keylen;
    unsigned long long session;
    long long interval;
    PyObject *echo[ECHO_BUFFERS], *seam = Py_None;
    if (pc->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Pacer is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y#lKLlOO|O", kwlist, &key, &keylen, &pc->src_node, &session,
                                     &interval, &pc->pair_every, &echo[0], &echo[1], &seam))
        return -1;
    if (interval < 100000) {
        PyErr_Format(PyExc_ValueError, "interval_ns must be >= 100000 (0.1 ms), not %lld", interval);
        return -1;
    }
    if (seam != Py_None &&
        !PyArg_ParseTuple(seam, "LdL;seam must be (offset_ns, drift_ppm, epoch_ns)", &pc->seam_offset_ns,
                          &pc->seam_drift_ppm, &pc->seam_epoch_ns))
        return -1;
    if (key_arg(&pc->key, key, keylen) != 0) return -1;
    if (pc->key.table != NULL) { /* the caller's bytes may go: keep a copy */
        pc->key_table = PyMem_RawMalloc((size_t)keylen);
        if (pc->key_table == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        memcpy(pc->key_table, key, (size_t)keylen);
        pc->key.table = pc->key_table;
    }
    if (echoes_from_buffers(echo, pc->echo_views, &pc->echoes, 1) != 0) return -1;
    pc->echoes_held = 1;
    pc->seam = seam != Py_None;
    pc->session = (uint32_t)session;
    pc->interval_ns = interval;
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&pc->wake, &attr);
    pthread_condattr_destroy(&attr);
    pthread_mutexattr_t kind; /* recursive: stats() inside ``with pacer:`` must not deadlock */
    pthread_mutexattr_init(&kind);
    pthread_mutexattr_settype(&kind, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&pc->lock, &kind);
    pthread_mutexattr_destroy(&kind);
    pc->ready = 1;
    return 0;
}

static void pacer_dealloc(Pacer *pc) {
    stop(pc);
    for (int i = 0; i < pc->nnics; i++) release_buffers(pc->nics[i].views, PATH_BUFFERS);
    if (pc->echoes_held) release_buffers(pc->echo_views, ECHO_BUFFERS);
    PyMem_RawFree(pc->key_table);
    if (pc->ready) {
        pthread_mutex_destroy(&pc->lock);
        pthread_cond_destroy(&pc->wake);
    }
    Py_TYPE(pc)->tp_free((PyObject *)pc);
}

static int usable(Pacer *pc, int before_start) {
    if (!pc->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Pacer is not initialised");
        return 0;
    }
    if (before_start && pc->started) {
        PyErr_SetString(PyExc_RuntimeError, "the pacer is running: add NICs before start()");
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(add_nic_doc,
             "add_nic(fd, nic, seq, dst_node, dst_nic, addrs, ring_seq, ring_tx, rev): probe from this NIC's\n"
             "socket at every tick (the arrays as send_probes takes them; held until the pacer is freed).");

static PyObject *pacer_add_nic(Pacer *pc, PyObject *args) {
    int fd;
    long index;
    PyObject *o[PATH_BUFFERS];
    if (!usable(pc, 1)) return NULL;
    if (!PyArg_ParseTuple(args, "ilOOOOOOO", &fd, &index, &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6]))
        return NULL;
    if (pc->nnics == PACER_NICS) {
        PyErr_Format(PyExc_ValueError, "a pacer sends from at most %d NICs", PACER_NICS);
        return NULL;
    }
    pacer_nic *nic = &pc->nics[pc->nnics];
    if (paths_from_buffers(o, nic->views, &nic->paths) != 0) return NULL;
    nic->fd = fd;
    nic->index = index;
    pc->nnics++;
    Py_RETURN_NONE;
}

static PyObject *pacer_start(Pacer *pc, PyObject *unused) {
    (void)unused;
    if (!usable(pc, 1)) return NULL;
    pc->stopping = 0;
    /* The thread takes no signal: the daemon's handlers run on its main thread. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int err = pthread_create(&pc->thread, NULL, run, pc);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err != 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    pc->started = 1;
    Py_RETURN_NONE;
}

static PyObject *pacer_stop(Pacer *pc, PyObject *unused) {
    (void)unused;
    if (pc->ready) stop(pc);
    Py_RETURN_NONE;
}

static PyObject *pacer_enter(Pacer *pc, PyObject *unused) {
    (void)unused;
    if (!usable(pc, 0)) return NULL;
    lock(pc);
    Py_INCREF(pc);
    return (PyObject *)pc;
}

static PyObject *pacer_exit(Pacer *pc, PyObject *args) {
    (void)args;
    pthread_mutex_unlock(&pc->lock);
    Py_RETURN_FALSE;
}

PyDoc_STRVAR(stats_doc,
             "stats() -> dict: ticks, probes sent, send errors (and the last errno), ticks skipped because the\n"
             "thread was held up, and the thread's CPU time in ns.");

static PyObject *pacer_stats(Pacer *pc, PyObject *unused) {
    (void)unused;
    if (!usable(pc, 0)) return NULL;
    lock(pc);
    unsigned long long ticks = pc->ticks, sent = pc->sent, errors = pc->errors, late = pc->late;
    long long cpu = pc->cpu_ns;
    int last = pc->last_errno;
    pthread_mutex_unlock(&pc->lock);
    return Py_BuildValue("{sKsKsKsisKsL}", "ticks", ticks, "sent", sent, "errors", errors, "last_errno", last, "late",
                         late, "cpu_ns", cpu);
}

PyDoc_STRVAR(note_arrivals_doc,
             "note_arrivals(records, n, in_session) -> int\n\n"
             "The newest probe of each incoming path among the first ``n`` of ``records`` (drain's, in arrival\n"
             "order) becomes the one the path's next echo names: its sequence number and arrival (this node's\n"
             "clock, through the seam) go into the echo arrays, under the pacer's lock, where the probe is newer\n"
             "than the echo's and of the session the path is known by (``in_session``). Returns how many probes\n"
             "are of another session (a restarted sender: Python files those, and sets their echoes itself).");

static PyObject *pacer_note_arrivals(Pacer *pc, PyObject *args) {
    PyObject *o_records, *o_session;
    Py_ssize_t n;
    Py_buffer b_records, b_session;
    if (!usable(pc, 0)) return NULL;
    if (!PyArg_ParseTuple(args, "OnO", &o_records, &n, &o_session)) return NULL;
    if (n < 0 || n > PY_SSIZE_T_MAX / RECORD_FIELDS) {
        PyErr_Format(PyExc_ValueError, "n must be a count of records, not %zd", n);
        return NULL;
    }
    const int64_t(*records)[RECORD_FIELDS] = (const void *)i64_buffer(o_records, &b_records, n * RECORD_FIELDS, 0,
                                                                       "records");
    if (records == NULL) return NULL;
    ptrdiff_t paths = pc->echoes.count;
    const int64_t *session = i64_buffer(o_session, &b_session, paths, 0, "in_session");
    if (session == NULL) {
        PyBuffer_Release(&b_records);
        return NULL;
    }
    int64_t *echo_seq = pc->echo_views[0].buf, *echo_rx = pc->echo_views[1].buf;
    Py_ssize_t other = 0;
    lock(pc);
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t *r = records[i];
        int64_t path = r[R_PATH];
        if (r[R_KIND] != KIND_PROBE || path < 0 || path >= paths) continue;
        if (r[R_SESSION] != session[path]) {
            other++;
        } else if (r[R_SEQ] > echo_seq[path]) {
            echo_seq[path] = r[R_SEQ];
            echo_rx[path] = node_clock(pc, r[R_RX]);
        }
    }
    pthread_mutex_unlock(&pc->lock);
    PyBuffer_Release(&b_records);
    PyBuffer_Release(&b_session);
    return PyLong_FromSsize_t(other);
}

PyDoc_STRVAR(set_keys_doc, "set_keys(key): tag the probes from the next tick on with these keys (a key change).");

static PyObject *pacer_set_keys(Pacer *pc, PyObject *args) {
    const char *key;
    Py_ssize_t keylen;
    key_set k;
    if (!usable(pc, 0)) return NULL;
    if (!PyArg_ParseTuple(args, "y#", &key, &keylen) || key_arg(&k, key, keylen) != 0) return NULL;
    uint8_t *copy = NULL;
    if (k.table != NULL) {
        copy = PyMem_RawMalloc((size_t)keylen);
        if (copy == NULL) return PyErr_NoMemory();
        memcpy(copy, key, (size_t)keylen);
        k.table = copy;
    }
    lock(pc);
    uint8_t *old = pc->key_table;
    pc->key = k;
    pc->key_table = copy;
    pthread_mutex_unlock(&pc->lock);
    PyMem_RawFree(old);
    Py_RETURN_NONE;
}

static PyMethodDef pacer_methods[] = {
    {"set_keys", (PyCFunction)pacer_set_keys, METH_VARARGS, set_keys_doc},
    {"note_arrivals", (PyCFunction)pacer_note_arrivals, METH_VARARGS, note_arrivals_doc},
    {"add_nic", (PyCFunction)pacer_add_nic, METH_VARARGS, add_nic_doc},
    {"start", (PyCFunction)pacer_start, METH_NOARGS, "Start sending, one tick per interval."},
    {"stop", (PyCFunction)pacer_stop, METH_NOARGS, "Stop the thread and wait for it (idempotent)."},
    {"stats", (PyCFunction)pacer_stats, METH_NOARGS, stats_doc},
    {"__enter__", (PyCFunction)pacer_enter, METH_NOARGS, "Hold the pacer's lock (no tick runs meanwhile)."},
    {"__exit__", (PyCFunction)pacer_exit, METH_VARARGS, "Release the pacer's lock."},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(pacer_doc,
             "Pacer(key, src_node, session, interval_ns, pair_every, echo_seq, echo_rx, seam=None)\n\n"
             "A thread that sends one probe batch per NIC every ``interval_ns`` (as send_probes does, the paths\n"
             "taking turns at the coded pair every ``pair_every`` ticks; 0: no pairs), stamped with real time or\n"
             "through ``seam`` = (offset_ns, drift_ppm, epoch_ns). Touch the arrays it holds only inside\n"
             "``with pacer:``.");

static PyTypeObject PacerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "clockworkd.lens._probeio.Pacer",
    .tp_basicsize = sizeof(Pacer),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = pacer_doc,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)pacer_init,
    .tp_dealloc = (destructor)pacer_dealloc,
    .tp_methods = pacer_methods,
};

int pacer_add_type(PyObject *module) {
    if (PyType_Ready(&PacerType) < 0) return -1;
    Py_INCREF(&PacerType);
    if (PyModule_AddObject(module, "Pacer", (PyObject *)&PacerType) < 0) {
        Py_DECREF(&PacerType);
        return -1;
    }
    return 0;
}
