/* SPDX-License-Identifier: Apache-2.0 */
/* bex-ps dump SNAPSHOT DIR (issue 28 item 6): each table of a bex-ps
 * snapshot (docs/protocol.md, "Snapshot file") as .npy files a trainer
 * loads with numpy.load: DIR/table<ID>_keys.npy (uint64, n),
 * DIR/table<ID>_rows.npy (float32, n x dim) and, for Adagrad,
 * DIR/table<ID>_accumulators.npy; the names of bex.snapshot's dump. The
 * checksum is verified first; a file that does not parse is refused with
 * what is wrong and where, nothing written. */
#include <errno.h>
#include <inttypes.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "dump.h"

#define HASH_LEN 32

struct snap {
    const uint8_t *p;
    size_t len; /* without the checksum */
};

static uint32_t get32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint8_t *read_all(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    struct stat st;
    if (!f || fstat(fileno(f), &st) || st.st_size < 0) {
        if (f)
            fclose(f);
        return NULL;
    }
    uint8_t *b = malloc((size_t)st.st_size + 1);
    size_t got = b ? fread(b, 1, (size_t)st.st_size, f) : 0;
    fclose(f);
    if (!b || got != (size_t)st.st_size) {
        free(b);
        errno = EIO;
        return NULL;
    }
    *len = got;
    return b;
}

/* A .npy file (format 1.0) of shape (n) or (n, cols) of descr, its data
 * gathered from n records of stride bytes, each cols items of size at off. */
static int write_npy(const char *path, const char *descr, size_t size, uint32_t n, uint32_t cols,
                     bool two_d, const uint8_t *rec, size_t stride, size_t off)
{
    char hdr[128];
    int hl = two_d ? snprintf(hdr, sizeof hdr,
                              "{'descr': '%s', 'fortran_order': False, 'shape': (%" PRIu32
                              ", %" PRIu32 "), }",
                              descr, n, cols)
                   : snprintf(hdr, sizeof hdr,
                              "{'descr': '%s', 'fortran_order': False, 'shape': (%" PRIu32 ",), }",
                              descr, n);
    int total = (10 + hl + 1 + 63) / 64 * 64; /* magic, version, length, header, '\n' */
    memset(hdr + hl, ' ', (size_t)(total - 10 - hl - 1));
    hdr[total - 10 - 1] = '\n';
    FILE *f = fopen(path, "wb");
    if (!f)
        return -errno;
    uint8_t pre[10] = {
        0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, (uint8_t)(total - 10), (uint8_t)((total - 10) >> 8)};
    int ok = fwrite(pre, 1, 10, f) == 10 &&
             fwrite(hdr, 1, (size_t)(total - 10), f) == (size_t)(total - 10);
    for (uint32_t i = 0; ok && i < n; i++) /* the file's bytes are little-endian, as .npy's */
        ok = fwrite(rec + (size_t)i * stride + off, size, cols, f) == cols;
    if (fclose(f) || !ok)
        return -EIO;
    return 0;
}

/* One table at *off: checked, then written to dir (NULL: checked only). 0
 * or an error (said). */
static int dump_table(const struct snap *s, size_t *off, const char *dir)
{
    if (*off + 16 > s->len) {
        fprintf(stderr, "bex-ps dump: table header at byte %zu past the end\n", *off);
        return -EINVAL;
    }
    const uint8_t *h = s->p + *off;
    uint32_t id = get32(h), dim = get32(h + 4), opt = get32(h + 8), n = get32(h + 12);
    if ((opt != 1 && opt != 2) || dim == 0 || dim > 4096) {
        fprintf(stderr, "bex-ps dump: table %u at byte %zu: dim %u, optimizer %u\n", id, *off, dim,
                opt);
        return -EINVAL;
    }
    size_t stride = 8 + 4 * (size_t)dim * (opt == 2 ? 2 : 1);
    if ((s->len - *off - 16) / stride < n) {
        fprintf(stderr, "bex-ps dump: table %u: %u rows at byte %zu past the end\n", id, n,
                *off + 16);
        return -EINVAL;
    }
    const uint8_t *rec = h + 16;
    char path[4096];
    int rc = 0;
    if (!dir) {
        *off += 16 + (size_t)n * stride;
        return 0;
    }
    snprintf(path, sizeof path, "%s/table%u_keys.npy", dir, id);
    rc = write_npy(path, "<u8", 8, n, 1, false, rec, stride, 0);
    snprintf(path, sizeof path, "%s/table%u_rows.npy", dir, id);
    if (!rc)
        rc = write_npy(path, "<f4", 4, n, dim, true, rec, stride, 8);
    snprintf(path, sizeof path, "%s/table%u_accumulators.npy", dir, id);
    if (!rc && opt == 2)
        rc = write_npy(path, "<f4", 4, n, dim, true, rec, stride, 8 + 4 * (size_t)dim);
    if (rc)
        fprintf(stderr, "bex-ps dump: %s: %s\n", path, strerror(-rc));
    else
        printf("table %u: %u rows of dim %u (%s)\n", id, n, dim, opt == 2 ? "adagrad" : "sgd");
    *off += 16 + (size_t)n * stride;
    return rc;
}

/* The snapshot's header checked: its table count, or -1 (said). */
static long check_snap(const uint8_t *b, size_t len, struct snap *s)
{
    uint8_t h[HASH_LEN];
    if (len < 8 + 16 + HASH_LEN || memcmp(b, "BEXPSNAP", 8)) {
        fprintf(stderr, "bex-ps dump: not a bex-ps snapshot (no BEXPSNAP magic)\n");
        return -1;
    }
    s->p = b;
    s->len = len - HASH_LEN;
    if (sodium_init() < 0 || crypto_generichash(h, HASH_LEN, b, s->len, NULL, 0) ||
        sodium_memcmp(h, b + s->len, HASH_LEN)) {
        fprintf(stderr, "bex-ps dump: checksum mismatch (corrupt or truncated file)\n");
        return -1;
    }
    uint32_t version = get32(b + 8);
    if (version < 1 || version > 4) {
        fprintf(stderr, "bex-ps dump: snapshot version %u, this one knows 1..4\n", version);
        return -1;
    }
    printf("shard %u of %u, version %u\n", get32(b + 12), get32(b + 16), version);
    return get32(b + 20);
}

int bex_ps_dump_main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: bex-ps dump SNAPSHOT DIR\n");
        return 2;
    }
    size_t len = 0;
    uint8_t *b = read_all(argv[1], &len);
    if (!b) {
        fprintf(stderr, "bex-ps dump: %s: %s\n", argv[1], strerror(errno));
        return 1;
    }
    struct snap s;
    long n_tables = check_snap(b, len, &s);
    /* every table checked before anything is written */
    int rc = n_tables < 0;
    for (int pass = 0; pass < 2 && !rc; pass++) {
        size_t off = 24;
        if (pass && mkdir(argv[2], 0755) && errno != EEXIST) {
            fprintf(stderr, "bex-ps dump: %s: %s\n", argv[2], strerror(errno));
            rc = 1;
        }
        for (long t = 0; !rc && t < n_tables; t++)
            rc = dump_table(&s, &off, pass ? argv[2] : NULL) != 0;
    }
    free(b);
    return rc;
}
