/* probe_floor: the packets Fleet Lens sends and reads, and nothing else.
 *
 * bench/lens_overhead.py runs one of these per node, side by side with the daemon measurements, to show
 * what the probe traffic alone costs on this machine: the same probes per tick (one per peer, one peer
 * a coded pair), the same size, one sendmmsg per NIC per tick, and every socket read with recvmmsg and
 * kernel receive stamps every DRAIN_TICKS ticks. No headers are built, tagged, checked or filed: whatever
 * Lens costs above this is Lens's own work.
 *
 * usage: probe_floor PORT INTERVAL_US DRAIN_TICKS BYTES SRC:DST[,DST...] [SRC:DST[,DST...] ...]
 * (one SRC:DST... argument per NIC; IPv4 addresses). Runs until SIGTERM or SIGINT.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_NICS 8
#define MAX_PEERS 256
#define RECV_BATCH 64
#ifndef SO_TIMESTAMPNS
#define SO_TIMESTAMPNS 35
#endif

struct nic {
    int fd;
    int peers;
    struct sockaddr_in dst[MAX_PEERS];
};

static volatile sig_atomic_t stop;

static void on_signal(int sig) {
    (void)sig;
    stop = 1;
}

static int parse_addr(const char *text, int port, struct sockaddr_in *out) {
    memset(out, 0, sizeof *out);
    out->sin_family = AF_INET;
    out->sin_port = htons((unsigned short)port);
    return inet_pton(AF_INET, text, &out->sin_addr) == 1 ? 0 : -1;
}

/* "SRC:DST,DST,..." -> a bound socket and its destinations */
static int open_nic(char *spec, int port, struct nic *nic) {
    char *colon = strchr(spec, ':');
    if (!colon) return -1;
    *colon = '\0';
    struct sockaddr_in src;
    if (parse_addr(spec, port, &src)) return -1;
    nic->peers = 0;
    for (char *tok = strtok(colon + 1, ","); tok && nic->peers < MAX_PEERS; tok = strtok(NULL, ",")) {
        if (parse_addr(tok, port, &nic->dst[nic->peers])) return -1;
        nic->peers++;
    }
    nic->fd = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK, 0);
    int on = 1;
    if (nic->fd < 0 || setsockopt(nic->fd, SOL_SOCKET, SO_TIMESTAMPNS, &on, sizeof on) ||
        bind(nic->fd, (struct sockaddr *)&src, sizeof src)) {
        perror("probe_floor: socket");
        return -1;
    }
    return nic->peers > 0 ? 0 : -1;
}

static void send_tick(struct nic *nic, unsigned long tick, size_t bytes) {
    static char payload[2048];
    struct mmsghdr msgs[MAX_PEERS + 1];
    struct iovec iov = {payload, bytes};
    int pair = (int)(tick % (unsigned long)nic->peers), n = 0;
    for (int p = 0; p < nic->peers; p++) {
        for (int copy = 0; copy < (p == pair ? 2 : 1); copy++, n++) {
            memset(&msgs[n], 0, sizeof msgs[n]);
            msgs[n].msg_hdr.msg_name = &nic->dst[p];
            msgs[n].msg_hdr.msg_namelen = sizeof nic->dst[p];
            msgs[n].msg_hdr.msg_iov = &iov;
            msgs[n].msg_hdr.msg_iovlen = 1;
        }
    }
    for (int done = 0; done < n;) {
        int sent = sendmmsg(nic->fd, msgs + done, (unsigned)(n - done), MSG_DONTWAIT);
        if (sent <= 0) break; /* a full queue or an unreachable peer: Lens counts it and goes on too */
        done += sent;
    }
}

static void drain(int fd) {
    static char bufs[RECV_BATCH][2048];
    static char ctrl[RECV_BATCH][64];
    struct mmsghdr msgs[RECV_BATCH];
    struct iovec iov[RECV_BATCH];
    for (;;) {
        for (int i = 0; i < RECV_BATCH; i++) {
            iov[i].iov_base = bufs[i];
            iov[i].iov_len = sizeof bufs[i];
            memset(&msgs[i], 0, sizeof msgs[i]);
            msgs[i].msg_hdr.msg_iov = &iov[i];
            msgs[i].msg_hdr.msg_iovlen = 1;
            msgs[i].msg_hdr.msg_control = ctrl[i];
            msgs[i].msg_hdr.msg_controllen = sizeof ctrl[i];
        }
        int got = recvmmsg(fd, msgs, RECV_BATCH, MSG_DONTWAIT, NULL);
        if (got < RECV_BATCH) return;
    }
}

int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: %s PORT INTERVAL_US DRAIN_TICKS BYTES SRC:DST[,DST...] ...\n", argv[0]);
        return 2;
    }
    int port = atoi(argv[1]);
    long interval_ns = atol(argv[2]) * 1000L;
    int drain_ticks = atoi(argv[3]);
    size_t bytes = (size_t)atol(argv[4]);
    int nics = argc - 5;
    struct nic nic[MAX_NICS];
    if (interval_ns <= 0 || drain_ticks <= 0 || bytes == 0 || bytes > 2048 || nics > MAX_NICS) {
        fprintf(stderr, "probe_floor: bad arguments\n");
        return 2;
    }
    for (int i = 0; i < nics; i++) {
        if (open_nic(argv[5 + i], port, &nic[i])) {
            fprintf(stderr, "probe_floor: bad NIC spec or socket: %s\n", argv[5 + i]);
            return 2;
        }
    }
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    struct timespec next;
    clock_gettime(CLOCK_MONOTONIC, &next);
    for (unsigned long tick = 0; !stop; tick++) {
        next.tv_nsec += interval_ns;
        while (next.tv_nsec >= 1000000000L) {
            next.tv_nsec -= 1000000000L;
            next.tv_sec++;
        }
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &next, NULL) == EINTR && !stop) {
        }
        struct timespec stamp; /* Lens stamps each batch's transmit time */
        clock_gettime(CLOCK_REALTIME, &stamp);
        for (int i = 0; i < nics; i++) send_tick(&nic[i], tick, bytes);
        if (tick % (unsigned long)drain_ticks == 0)
            for (int i = 0; i < nics; i++) drain(nic[i].fd);
    }
    return 0;
}
