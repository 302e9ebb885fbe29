/* Keyed BLAKE2b tags over libsodium (see tag.h). */
#include "tag.h"

#include <string.h>

int tag_init(tag_state *s, const uint8_t *key, size_t keylen, size_t outlen) {
    if (keylen < 1 || keylen > crypto_generichash_blake2b_KEYBYTES_MAX || outlen < 1 ||
        outlen > crypto_generichash_blake2b_BYTES_MAX)
        return -1;
    s->outlen = outlen;
    return crypto_generichash_blake2b_init(&s->keyed, key, keylen, outlen);
}

int tag_of(const tag_state *s, const uint8_t *data, size_t len, uint8_t *out) {
    crypto_generichash_blake2b_state st = s->keyed; /* a plain copy: the keyed state is reused per message */
    if (len == 0) return -1;                        /* every Lens message holds at least a 40-byte header */
    if (crypto_generichash_blake2b_update(&st, data, len) != 0) return -1;
    return crypto_generichash_blake2b_final(&st, out, s->outlen);
}

int key_set_init(key_set *k, const uint8_t *key, size_t len, size_t outlen) {
    const size_t row = (size_t)KEY_SLOTS * KEY_BYTES;
    k->table = NULL;
    k->nodes = 0;
    if (len >= 1 && len <= crypto_generichash_blake2b_KEYBYTES_MAX) return tag_init(&k->single, key, len, outlen);
    if (len == 0 || len % row != 0 || outlen < 1 || outlen > crypto_generichash_blake2b_BYTES_MAX) return -1;
    k->single.outlen = outlen;
    k->table = key;
    k->nodes = (long)(len / row);
    return 0;
}

int key_set_tag(const key_set *k, long node, int slot, const uint8_t *data, size_t len, uint8_t *out) {
    static const uint8_t zero[KEY_BYTES];
    if (k->table == NULL) return slot == 0 ? (tag_of(&k->single, data, len, out) == 0 ? 1 : -1) : 0;
    if (node < 0 || node >= k->nodes || slot < 0 || slot >= KEY_SLOTS) return 0;
    const uint8_t *key = k->table + ((size_t)node * KEY_SLOTS + (size_t)slot) * KEY_BYTES;
    if (memcmp(key, zero, KEY_BYTES) == 0) return 0;
    tag_state s; /* keyed per packet: one BLAKE2b block, a fraction of a microsecond */
    if (tag_init(&s, key, KEY_BYTES, k->single.outlen) != 0) return -1;
    return tag_of(&s, data, len, out) == 0 ? 1 : -1;
}
