/* Fleet Lens's packet tags: keyed BLAKE2b with a digest of 1..64 bytes, what hashlib.blake2b(data, key=...,
 * digest_size=...) computes (the wire format), by libsodium's crypto_generichash_blake2b. The keyed state is
 * made once per key (tag_init) and copied for each message (tag_of). sodium_init() must have run. */
#ifndef CLOCKWORK_TAG_H
#define CLOCKWORK_TAG_H

#include <sodium.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    crypto_generichash_blake2b_state keyed; /* after the key, before any message byte */
    size_t outlen;
} tag_state;

/* The state for ``key`` (1..64 bytes) and digests of ``outlen`` (1..64) bytes; -1 when either is out of range. */
int tag_init(tag_state *s, const uint8_t *key, size_t keylen, size_t outlen);

/* The digest of ``data`` (1 byte or more) into ``out`` (``s`` is not modified); -1 for empty data. */
int tag_of(const tag_state *s, const uint8_t *data, size_t len, uint8_t *out);

#endif
