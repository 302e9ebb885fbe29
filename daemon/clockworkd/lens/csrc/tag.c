/* Keyed BLAKE2b tags over libsodium (see tag.h). */
#include "tag.h"

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
