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

/* The keys of Fleet Lens's packets: one key for every node (``table`` NULL: the single state), or a table of
 * ``nodes`` x KEY_SLOTS x KEY_BYTES bytes, the pairwise keys of this node with each node by its index in the
 * fabric map. Slot 0 is what packets to that node are tagged with; a packet from it may carry any non-zero
 * slot (two or more while a key changes). An all-zero slot is unused. */
#define KEY_SLOTS 4
#define KEY_BYTES 32
typedef struct {
    tag_state single;
    const uint8_t *table;
    long nodes;
} key_set;

/* A key set over ``key`` of ``len`` bytes: 1..64 bytes is a single key, a positive multiple of
 * KEY_SLOTS * KEY_BYTES a table (the caller keeps it alive); -1 otherwise. */
int key_set_init(key_set *k, const uint8_t *key, size_t len, size_t outlen);

/* The tag of ``data`` under ``node``'s key in ``slot`` into ``out``: 1; 0 when that slot is unused or the node is
 * out of the table's range (nothing written); -1 on error. */
int key_set_tag(const key_set *k, long node, int slot, const uint8_t *data, size_t len, uint8_t *out);

#endif
