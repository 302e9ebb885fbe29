/* The int64 records the receiver fills, one per probe or train packet (fastio.py's R_* names the fields, in
 * this order): shared by the drain (_probeio.c) and the pacer's echo bookkeeping. */
#ifndef CLOCKWORK_RECORDS_H
#define CLOCKWORK_RECORDS_H

#define RECORD_FIELDS 12

enum { R_PATH, R_KIND, R_FLAGS, R_SEQ, R_TX, R_RX, R_SESSION, R_AUX, R_ECHO_SEQ, R_HOLD, R_LENGTH, R_SRC_NODE };

#endif
