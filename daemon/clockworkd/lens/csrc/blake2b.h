/* BLAKE2b (RFC 7693), keyed, digest of 1..64 bytes: what hashlib.blake2b(data, key=..., digest_size=...)
 * computes. Written for Fleet Lens's packet tags from the RFC's description (sequential, no SIMD):
 * a 40-byte probe header costs one compression once the key block is absorbed (blake2b_keyed_init). */
#ifndef CLOCKWORK_BLAKE2B_H
#define CLOCKWORK_BLAKE2B_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint64_t h[8];
    uint64_t t; /* bytes compressed so far (messages here are far below 2^64 bytes) */
    size_t outlen;
} blake2b_state;

/* The state after the key block: copy it and call blake2b_final_from for each message. */
int blake2b_keyed_init(blake2b_state *s, const uint8_t *key, size_t keylen, size_t outlen);

/* Digest of ``data`` (1 byte or more) continuing from a keyed state (``s`` is not modified); -1 for empty data. */
int blake2b_final_from(const blake2b_state *s, const uint8_t *data, size_t len, uint8_t *out);

#endif
