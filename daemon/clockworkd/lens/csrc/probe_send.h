/* Building, tagging and sending probe batches: the part of Fleet Lens's wire work that both the
 * module's functions (one call per NIC per tick) and its pacer thread (pacer.c) do. Plain C: no Python
 * object is touched here, so the pacer can run it without the GIL. Wire format: wire.py. */
#ifndef CLOCKWORK_PROBE_SEND_H
#define CLOCKWORK_PROBE_SEND_H

#include <netinet/in.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "tag.h"

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

/* Room for one sendmmsg of up to SEND_BATCH probes (each caller that may run concurrently has its own). */
typedef struct {
    uint8_t data[SEND_BATCH][PROBE_BYTES];
    struct sockaddr_in names[SEND_BATCH];
    struct iovec iov[SEND_BATCH];
    struct mmsghdr hdrs[SEND_BATCH];
} send_buf;

/* The outgoing paths of one NIC (arrays of ``paths`` int64 unless said otherwise). */
typedef struct {
    ptrdiff_t paths;
    int64_t *seq;            /* newest sequence number sent per path (advanced here) */
    const int64_t *dst_node; /* destination node and NIC index per path */
    const int64_t *dst_nic;
    const uint8_t *addrs;    /* ``paths`` struct sockaddr_in */
    int64_t *ring_seq;       /* ``paths`` rows of ``ring`` transmit records, slot seq % ring */
    int64_t *ring_tx;
    ptrdiff_t ring;
    const int64_t *rev;      /* per path: index into the echoes of the reverse path's newest probe, -1: none */
} probe_paths;

/* Per incoming path: the newest probe received (sequence number, -1: none) and when it arrived. */
typedef struct {
    const int64_t *seq;
    const int64_t *rx;
    ptrdiff_t count;
} probe_echoes;

/* The 40-byte header (wire.HEADER). */
void probe_header(uint8_t *p, int kind, int flags, long src_node, long src_nic, long dst_node, long dst_nic,
                  uint32_t seq, int64_t tx, uint32_t session, uint32_t aux, uint32_t echo_seq, uint32_t hold);

/* Point slot ``i`` of ``buf`` at ``len`` bytes of ``data`` for the address ``addr`` (a sockaddr_in). */
void send_slot(send_buf *buf, unsigned i, uint8_t *data, size_t len, const uint8_t *addr);

/* sendmmsg of the first ``count`` slots, going on after a partial send; returns how many were sent and
 * sets ``*err`` to the errno of a failure (0: all sent). Never blocks. */
unsigned send_slots(send_buf *buf, int fd, unsigned count, int *err);

/* One probe to each path, path ``pair`` (-1: none) a coded pair instead, sent first (its transmit stamp
 * is the one clock sync relies on). Every probe carries the reverse path's newest echo and the tag of the
 * destination node's key (a path to a node without one is skipped). Returns how many were sent; ``*err`` as
 * send_slots. */
unsigned send_probe_batch(send_buf *buf, int fd, const key_set *keys, long src_node, long src_nic,
                          uint32_t session, int64_t tx, ptrdiff_t pair, const probe_paths *p,
                          const probe_echoes *e, int *err);

#endif
