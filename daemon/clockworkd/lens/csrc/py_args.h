/* Arguments from Python that the probe sender needs checked: the tag key, and the int64 arrays it reads
 * and updates, held as buffers (one place for both the module's send_probes and the pacer, which holds
 * them for as long as it runs). */
#ifndef CLOCKWORK_PY_ARGS_H
#define CLOCKWORK_PY_ARGS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "probe_send.h"

#define PATH_BUFFERS 7
#define ECHO_BUFFERS 2

/* ``s`` keyed for 8-byte tags; -1 with a ValueError for a key that is not 1 to 64 bytes. */
int tag_key(tag_state *s, const char *key, Py_ssize_t keylen);

/* ``k`` over ``key``: a single key (1 to 64 bytes) or a key table (tag.h); -1 with a ValueError otherwise. */
int key_arg(key_set *k, const char *key, Py_ssize_t keylen);

/* A C-contiguous buffer of at least ``count`` int64 values (``writable`` when the caller updates it). */
int64_t *i64_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t count, int writable, const char *name);

/* seq, dst_node, dst_nic, addrs, ring_seq, ring_tx, rev (as send_probes documents them) into ``p``; on
 * success every view in ``views`` is held (release them with release_buffers), on failure none is and a
 * Python exception is set. */
int paths_from_buffers(PyObject *const objs[PATH_BUFFERS], Py_buffer views[PATH_BUFFERS], probe_paths *p);

/* echo_seq, echo_rx into ``e`` (held ``writable`` when the caller updates them); as paths_from_buffers. */
int echoes_from_buffers(PyObject *const objs[ECHO_BUFFERS], Py_buffer views[ECHO_BUFFERS], probe_echoes *e,
                        int writable);

void release_buffers(Py_buffer *views, int count);

#endif
