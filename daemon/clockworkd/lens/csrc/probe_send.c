/* Building, tagging and sending probe batches (see probe_send.h). */
#include "probe_send.h"

#include <errno.h>
#include <string.h>

static inline void put16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }
static inline void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void put64(uint8_t *p, int64_t v) { memcpy(p, &v, 8); }

void probe_header(uint8_t *p, int kind, int flags, long src_node, long src_nic, long dst_node, long dst_nic,
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

void send_slot(send_buf *buf, unsigned i, uint8_t *data, size_t len, const uint8_t *addr) {
    memcpy(&buf->names[i], addr, sizeof(struct sockaddr_in));
    buf->iov[i].iov_base = data;
    buf->iov[i].iov_len = len;
    memset(&buf->hdrs[i], 0, sizeof(buf->hdrs[i]));
    buf->hdrs[i].msg_hdr.msg_name = &buf->names[i];
    buf->hdrs[i].msg_hdr.msg_namelen = sizeof(struct sockaddr_in);
    buf->hdrs[i].msg_hdr.msg_iov = &buf->iov[i];
    buf->hdrs[i].msg_hdr.msg_iovlen = 1;
}

unsigned send_slots(send_buf *buf, int fd, unsigned count, int *err) {
    unsigned done = 0;
    *err = 0;
    while (done < count) {
        int n = sendmmsg(fd, buf->hdrs + done, count - done, MSG_DONTWAIT);
        if (n <= 0) {
            *err = errno ? errno : EAGAIN;
            break;
        }
        done += (unsigned)n;
    }
    return done;
}

unsigned send_probe_batch(send_buf *buf, int fd, const key_set *keys, long src_node, long src_nic,
                          uint32_t session, int64_t tx, ptrdiff_t pair, const probe_paths *p,
                          const probe_echoes *e, int *err) {
    unsigned count = 0, sent = 0;
    *err = 0;
    if (pair >= p->paths) pair = -1;
    for (ptrdiff_t step = 0; step <= p->paths; step++) {
        ptrdiff_t k = step == 0 ? pair : step - 1;
        if (k < 0 || (step > 0 && k == pair)) continue;
        if (keys->table != NULL && (p->dst_node[k] < 0 || p->dst_node[k] >= keys->nodes)) continue;
        uint32_t e_seq = 0, hold = (uint32_t)NO_ECHO;
        ptrdiff_t r = p->rev[k];
        if (r >= 0 && r < e->count && e->seq[r] >= 0) {
            long long h = tx - e->rx[r];
            if (h >= 0 && (unsigned long long)h < NO_ECHO) {
                e_seq = (uint32_t)e->seq[r];
                hold = (uint32_t)h;
            }
        }
        int n = step == 0 ? 2 : 1;
        p->seq[k] += n;
        for (int j = 0; j < n; j++) {
            int64_t q = p->seq[k] - (n - 1 - j);
            int flags = step == 0 ? (j == 0 ? PAIR_FIRST : PAIR_SECOND) : 0;
            ptrdiff_t at = k * p->ring + (ptrdiff_t)(((uint64_t)q) % (uint64_t)p->ring);
            p->ring_seq[at] = q & 0xFFFFFFFF;
            p->ring_tx[at] = tx;
            uint8_t *d = buf->data[count];
            probe_header(d, KIND_PROBE, flags, src_node, src_nic, p->dst_node[k], p->dst_nic[k], (uint32_t)q, tx,
                         session, 0, e_seq, hold);
            if (key_set_tag(keys, (long)p->dst_node[k], 0, d, HEADER, d + HEADER) != 1) continue; /* no key */
            send_slot(buf, count, d, PROBE_BYTES, p->addrs + 16 * k);
            if (++count == SEND_BATCH) { /* more paths than one batch: send this one, go on */
                sent += send_slots(buf, fd, count, err);
                count = 0;
                if (*err) return sent;
            }
        }
    }
    if (count > 0) sent += send_slots(buf, fd, count, err);
    return sent;
}
